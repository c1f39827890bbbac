"""The authors' recipes of the ringmaster-lmo experiment (issue 15 item 7): each method runs once
at the official code's own setting, the char transformer scaled to a CPU, the group's quadratic
at its full size."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
from click.testing import CliRunner

from experiments import ringmaster_lmo
from experiments.cli import experiment


def _built(runs, group):
    """method -> (algorithm, problem, delays, config) of the runs of ``group``."""
    out = {}
    for r in runs:
        if r.group == group:
            alg, problem, delays, cfg, _ = r.make()
            out[r.method] = (alg, problem, delays, cfg)
    return out


def test_full_recipes_carry_the_authors_settings():
    """No simulation: the full recipes build the official scripts' algorithms, workers and delays."""
    c = ringmaster_lmo.recipes(quick=False)
    lm, quad = c["charlm recipe"], c["quadratic recipe"]
    assert (lm["n"], lm["horizon"], lm["batch"], lm["models"]) == (8, 500.0, 4, ("linear",))
    assert (lm["opts"]["layers"], lm["opts"]["heads"]) == (6, 3)  # depth 6, 3 heads; width scaled
    assert (quad["n"], quad["horizon"], quad["opts"]["d"]) == (6174, 2000.0, 1729)
    runs = ringmaster_lmo.make_recipe_runs({"quadratic recipe": quad}, seed=0)
    assert len(runs) == 4
    q = _built(runs, "quadratic recipe, sqrt1")
    ring, pa, ren, da = (q[m][0] for m in ringmaster_lmo.RECIPE_METHODS)
    assert (ring.lmo, ring.schedule, ring.lr, ring.R, ring.alpha, ring.nesterov) == ("muon", "fixed", 0.04, 6, 0.05,
                                                                                      True)
    assert (pa.lmo, pa.schedule, pa.lr) == ("muon", "agnostic", 0.5)
    assert (ren.lr, ren.B, ren.beta, ren.nesterov) == (0.04, 6, 0.95, True)
    assert (da.lr, da.n_workers, da.alpha) == (0.005, 6174, 0.05)
    assert all(a.ns == "polar-express" and a.ns_steps == 5 for a in (ring, pa, ren, da))
    _, problem, delays, cfg = q["ringmaster-muon"]
    assert (problem.d, problem.sigma, problem.noise, cfg.min_workers, cfg.batch_size) == (1729, 0.01, "scalar",
                                                                                        6174, 1)
    i = np.arange(6174)  # the group's script: tau_i = 1 + sqrt(i), half-normal noise of scale sqrt(i + 1)
    np.testing.assert_allclose(delays.tau, 1 + np.sqrt(i), rtol=1e-12)
    np.testing.assert_allclose(delays.noise, np.sqrt(i + 1), rtol=1e-12)


def test_charlm_recipe_settings_and_delays():
    """The NanoChat settings: γ = 1, R = 2; η = 5; γ = 1, B = 2; γ = 1; τ_i = i, noise 0.05·τ_i."""
    lm = ringmaster_lmo.recipes(quick=True)["charlm recipe"]
    assert lm["settings"] == ringmaster_lmo.recipes(quick=False)["charlm recipe"]["settings"]
    q = _built(ringmaster_lmo.make_recipe_runs({"charlm recipe": lm}, seed=0), "charlm recipe, linear")
    ring, pa, ren, da = (q[m][0] for m in ringmaster_lmo.RECIPE_METHODS)
    assert (ring.lr, ring.R, ring.schedule) == (1.0, 2, "fixed")
    assert (pa.lr, pa.schedule) == (5.0, "agnostic")
    assert (ren.lr, ren.B) == (1.0, 2)
    assert (da.lr, da.n_workers) == (1.0, 8)
    _, problem, delays, cfg = q["ringmaster-muon"]
    np.testing.assert_allclose(delays.tau, np.arange(1, 9), rtol=1e-12)
    np.testing.assert_allclose(delays.noise, 0.05 * np.arange(1, 9), rtol=1e-12)
    assert cfg.batch_size == 4 and problem.heads == 3


def test_quick_recipes_run_write_their_outputs_and_repeat(tmp_path):
    """About 3 s per run: both recipes, four methods each, finite and below the start; same seed, same CSV."""
    a = ringmaster_lmo.run(str(tmp_path / "a"), quick=True, seed=3, progress=False, part="recipes")
    assert a["headline"] == {} and [p.rsplit("/", 1)[1] for p in a["csv"]] == ["recipes.csv"]
    assert sorted(p.rsplit("/", 1)[1] for p in a["png"]) == ["recipe-charlm.png", "recipe-quadratic.png"]
    assert set(a["recipes"]) == {"charlm recipe, linear", "quadratic recipe, sqrt1"}
    with open(a["csv"][0], newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for group, finals in a["recipes"].items():
        for m in ringmaster_lmo.RECIPE_METHODS:
            curve = [r for r in rows if r["group"] == group and r["method"] == m]
            key = "train_loss" if group.startswith("charlm") else "loss"
            start = float(curve[0][key])
            assert math.isfinite(finals[m]) and finals[m] < start, (group, m, start, finals[m])
            assert finals[m] == float(curve[-1][key])
    with open(a["markdown"], encoding="utf-8") as f:
        text = f.read()
    assert "authors (NanoChat, linear)" in text and "### quadratic recipe, sqrt1" in text
    b = ringmaster_lmo.run(str(tmp_path / "b"), quick=True, seed=3, progress=False, part="recipes")
    with open(a["csv"][0], "rb") as fa, open(b["csv"][0], "rb") as fb:
        assert fa.read() == fb.read()


def test_part_is_checked():
    with pytest.raises(ValueError, match="part must be one of"):
        ringmaster_lmo.run("/nonexistent-never-created", quick=True, part="tables")
    res = CliRunner().invoke(experiment, ["rennala-mvr", "--quick", "--part", "grids"])
    assert res.exit_code != 0 and "--part is for ringmaster-lmo only" in res.output
