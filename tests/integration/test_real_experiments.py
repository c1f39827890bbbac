"""Experiments 2 (ordered-momentum) and 5 (async-vs-sync) on the real daemon with local worker
processes (``latecomer experiment NAME --real --quick``): files, finite curves, the ranking table."""

from __future__ import annotations

import csv
import math

import pytest
from click.testing import CliRunner

from experiments.cli import experiment
from experiments.real import kendall_tau, ranking


def test_ranking_and_kendall_tau():
    assert ranking({"a": 0.1, "b": math.nan, "c": 0.05}, higher_is_better=False) == ["c", "a", "b"]
    assert ranking({"a": 0.1, "b": 0.9}, higher_is_better=True) == ["b", "a"]
    assert kendall_tau(["a", "b", "c"], ["a", "b", "c"]) == 1.0
    assert kendall_tau(["a", "b", "c"], ["c", "b", "a"]) == -1.0
    assert kendall_tau(["a", "b", "c"], ["b", "a", "c"]) == pytest.approx(1 / 3)


@pytest.mark.slow
@pytest.mark.parametrize("name,metric,methods", [
    ("async-vs-sync", "loss", {"sync-sgd", "asgd"}),
    ("ordered-momentum", "f1", {"ordered-momentum", "asgd"}),
])
def test_quick_real_experiment_writes_side_by_side_outputs(name, metric, methods, tmp_path):
    out = tmp_path / name
    res = CliRunner().invoke(experiment, [name, "--real", "--quick", "--no-progress", "--out", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    for f in ("curves.csv", "side_by_side.png", "summary.md"):
        assert (out / f).stat().st_size > 0, f
    with open(out / "curves.csv", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    for system in ("sim", "real"):
        got = {r["method"] for r in rows if r["system"] == system}
        assert got == methods, (system, got)
        for m in methods:
            pts = [r for r in rows if r["system"] == system and r["method"] == m]
            assert len(pts) >= 3, (system, m)
            assert all(math.isfinite(float(r[metric])) and math.isfinite(float(r["t"])) for r in pts)
            if system == "real":  # time since the first job, within the budget, and training happened
                assert float(pts[-1]["t"]) <= 7.5 and float(pts[-1]["version"]) > 0
    md = (out / "summary.md").read_text(encoding="utf-8")
    assert "| method | setting |" in md and "- simulator: " in md and "- real: " in md
    assert "same order: yes" in md or "same order: no" in md
    assert "Kendall τ" in md


def test_real_flag_rejects_an_experiment_without_a_real_variant(tmp_path):
    res = CliRunner().invoke(experiment, ["rennala-mvr", "--real", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "real" in res.output
