"""`latecomer bench --quick`: every backend's row holds finite positive figures, or says why it was skipped."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks.bench import BACKENDS, SIM
from benchmarks.latecomer_ps import missing_flag

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECONDS, WARMUP = 1.0, 0.25  # per cell: timed interval (5 windows of 0.2 s) and warm-up
pytestmark = pytest.mark.bench  # `make test-bench` (CI runs it after `make test`)
FIGURES = ("updates_per_s", "bytes_per_update", "cpu_s_per_update", "rtt_p50_s", "rtt_p99_s", "peak_rss_bytes")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_quick(tmp_path):
    out, js, png = tmp_path / "RESULTS.md", tmp_path / "rows.json", tmp_path / "bench.png"
    # Shorter intervals than --quick's (1.5 s timed, 0.5 s warm-up per cell): the rows' structure
    # and figures are checked here, not their precision.
    p = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--quick", "--seconds", str(SECONDS), "--warmup",
                        str(WARMUP), "--out", str(out), "--json", str(js), "--plot", str(png)],
                       cwd=REPO, capture_output=True, text=True, timeout=840)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    data = json.loads(js.read_text())
    assert data["seconds"] == SECONDS and data["warmup"] == WARMUP
    rows = data["rows"]
    cells = {(r["backend"], r["d"], r["workers"]) for r in rows}
    assert cells == {(b, d, 1) for b in BACKENDS if b != SIM for d in (1000, 100_000)} | {(SIM, 1000, 100)}
    by = {(r["backend"], r["d"]): r for r in rows}
    for r in rows:
        if r["skipped"]:  # only ray where it is not installed, and a latecomer row whose CLI flag is not there
            assert (r["backend"] == "ray" and "not installed" in r["skipped"]) or \
                (missing_flag(r["backend"]) and r["skipped"] == missing_flag(r["backend"])), r
            continue
        if r["backend"] == SIM:  # simulated jobs per wall second; CPU per job of the bench process
            assert math.isfinite(r["updates_per_s"]) and r["updates_per_s"] > 100, r
            assert math.isfinite(r["cpu_s_per_update"]) and r["cpu_s_per_update"] > 0, r
            assert len(r["windows"]) == 5 and min(r["windows"]) > 0, r
            continue
        for k in FIGURES:
            assert math.isfinite(r[k]) and r[k] > 0, (k, r)
        assert r["rtt_p99_s"] >= r["rtt_p50_s"]
        assert r["updates"] > 0 and len(r["windows"]) == 5
        if r["backend"] == "latecomer-shm":  # headers only: the same few hundred bytes whatever d
            assert r["bytes_per_update"] < 1024 and r["bytes_per_update"] == by[("latecomer-shm", 1000)][
                "bytes_per_update"], r
        elif r["backend"] == "latecomer-bf16":  # x one way, g the other, 2 bytes per element
            assert 4 * r["d"] <= r["bytes_per_update"] < 8 * r["d"], r
        else:
            assert r["bytes_per_update"] >= 8 * r["d"]  # x one way, g the other, float32
    for lc in ("latecomer", "latecomer-curve"):  # the TCP path needs no new flag: these rows are measured
        assert not by[(lc, 1000)]["skipped"] and not by[(lc, 100_000)]["skipped"]
    assert {int(k) for k in data["vector_pass_s"]} == {1000, 100_000}
    assert all(0 < v < 1 for v in data["vector_pass_s"].values())
    # the no-transport ceiling does the reference's pass and more (the gradient's copy, the check)
    assert {int(k) for k in data["ceiling_s"]} == {1000, 100_000}
    assert all(data["vector_pass_s"][k] < v < 1 for k, v in data["ceiling_s"].items())
    md = out.read_text()
    assert "| latecomer | 1,000 | 1 |" in md and "| simulator | 1,000 | 100 |" in md and "Machine:" in md
    assert "## Ratios" in md and "vector passes" in md and "n/a" in md and "latecomer-shm / ceiling" in md
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.slow
def test_gpu_check_plan_runs_on_cpu_workers(tmp_path):
    """`make gpu-check` has never run on a GPU here (none is lent to this machine kind); its plan
    runs with --device cpu so the script stays working: every check holds and the results file
    has both sections. Without CUDA the default device is refused with one line and status 2."""
    import torch

    out = tmp_path / "gpu.md"
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--steps", "200",
                        "--seconds", "2", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    text = out.read_text()
    assert "| replay bit-identical (journaled gradients) | yes |" in text and "**NO**" not in text
    assert "| cpu | TCP (--shm off) |" in text and "| cpu | same-host (--shm auto) |" in text
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path / "x.md")],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no CUDA device" in r.stderr, r.stderr
