"""Muon (Ringmaster LMO, spectral LMO per weight matrix) over the real daemon with local workers."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_ringmaster_muon_trains_digits_mlp_over_real_daemon(procs, tmp_path):
    out = tmp_path / "run"
    p = procs.start("run", "--no-progress", "--algorithm", "ringmaster-lmo", "--set", "lmo=muon", "--set", "lr=0.02",
                    "--set", "R=6", "--workers", "3", "--delays", "0,0.003,0.01", "--steps", "800",
                    "--eval-every", "200", "--out", str(out))
    assert p.wait(timeout=240) == 0, p.stderr.read()[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    first, last = summary["evaluations"][0], summary["evaluations"][-1]
    assert summary["version"] == 800 and summary["accounted"]
    assert first["accuracy"] < 0.2
    assert last["accuracy"] > 0.8, last  # chance is 0.1
    assert (out / "convergence.png").stat().st_size > 1000
