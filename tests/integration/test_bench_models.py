"""`latecomer bench --models` end to end at its smallest: the tiny MLP, every system of the three targets, a
few seconds each, real processes (a server and workers, DDP ranks). Checks that the report and the JSON
have the expected rows and finite figures and ratios; never their speed."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.bench]

SYSTEMS = ("plain", "ddp-2", "latecomer-2", "ddp-2-slow", "latecomer-2-slow")


@pytest.mark.timeout(600)
def test_bench_models_smallest_configuration(tmp_path):
    out, js, png = tmp_path / "models.md", tmp_path / "models.json", tmp_path / "models.png"
    # --cores 1: one thread per process, whatever else this machine runs (the figures are not checked)
    p = subprocess.run([sys.executable, "-m", "ps", "bench", "--models", "--model", "mlp", "--model-size", "tiny",
                        "--grad-size", "tiny", "--grad-reps", "2", "--seconds", "3", "--cores", "1",
                        "--systems", ",".join(SYSTEMS), "--out", str(out), "--json", str(js), "--plot", str(png)],
                       cwd=REPO, capture_output=True, text=True, timeout=560)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads(js.read_text())
    runs = {r["name"]: r for r in data["runs"]}
    assert set(runs) == set(SYSTEMS)
    for r in runs.values():
        assert not r["skipped"], r
        assert r["steps"] > 0 and math.isfinite(r["steps_per_s"]) and r["steps_per_s"] > 0, r
        assert r["curve"] and all(math.isfinite(v) for _, _, v in r["curve"]), r
        assert math.isfinite(r["tta_s"]) and r["tta_s"] >= 0, r  # the tiny target is reached by every system
    assert runs["latecomer-2-slow"]["profile"]["workers"], runs["latecomer-2-slow"]["profile"]
    [grad] = data["grad"]
    assert grad["model"] == "mlp" and grad["blocks"] == 60 and math.isfinite(grad["ratio"]) and grad["ratio"] > 0
    targets = {r["what"]: r for r in data["ratios"] if r["target"]}
    assert len(targets) == 3
    for r in targets.values():
        assert math.isfinite(r["value"]) and r["value"] > 0 and r["met"] in (True, False), r
    md = out.read_text()
    for name in SYSTEMS:
        assert f"| mlp | {name} |" in md
    assert "## Ratios and targets" in md and "target" in p.stdout and ("met" in p.stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
