"""``latecomer.testing.check_problem``: the problem contract as a check a user runs on their own
problem (determinism for replay, shapes, ``fresh_gradients`` declared truthfully, a finite loss)."""

from __future__ import annotations

import numpy as np
import pytest

from latecomer.testing import check_problem
from problems.base import GradResult, Problem


class _Toy(Problem):
    """A seeded linear problem, with one thing broken per test (``how``)."""

    layout = (("w", (4,)),)

    def __init__(self, how: str = "") -> None:
        self.how = how
        self.g = np.empty(4, np.float32)
        if how in ("reuse-declared-fresh",):
            self.fresh_gradients = True

    def init_params(self, seed):
        return np.zeros(4, np.float64 if self.how == "float64" else np.float32)

    def grad(self, x, seed, batch_size):
        noise = np.random.default_rng(None if self.how == "unseeded" else seed).standard_normal(4)
        g = (x - 1 + noise).astype(np.float32)
        if self.how == "shape":
            return GradResult(g[:3], 0.0)
        if self.how.startswith("reuse"):
            self.g[:] = g
            return GradResult(self.g, 0.0)
        return GradResult(g, 0.0)

    def evaluate(self, x):
        return {"loss": float("nan") if self.how == "nan-loss" else float(((x - 1) ** 2).sum())}


@pytest.mark.parametrize("spec, options", [("quadratic", {"d": 8}), ("logreg", {"n": 100, "p": 5}),
                                           ("synthetic", {"d": 10}), ("digits", {})])
def test_the_built_in_problems_meet_the_contract(spec, options):
    check_problem(spec, options)


def test_a_problem_that_reuses_its_buffer_without_saying_it_is_fresh_passes():
    check_problem(_Toy("reuse"))
    check_problem(_Toy())


@pytest.mark.parametrize("how, words", [
    ("unseeded", "pure function of (x, seed, batch_size)"),
    ("reuse-declared-fresh", "declares fresh_gradients = True but a later call wrote"),
    ("shape", "expected 4 values (w (4,)), got 3"),
    ("nan-loss", "evaluate gave loss nan"),
    ("float64", "expected a float32 vector of 4 values"),
])
def test_each_broken_contract_fails_with_a_message_that_says_what(how, words):
    with pytest.raises(AssertionError) as e:
        check_problem(_Toy(how))
    assert words in str(e.value), str(e.value)


def test_the_own_model_example_meets_the_contract(monkeypatch):
    """A TorchProblem (examples/own_model/mymodel.py): its pooled gradient buffers are fresh as declared."""
    import os

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "own_model"))
    check_problem("mymodel:make", {"hidden": 16})


UNSEEDED = '''
import numpy as np
import latecomer


class Noisy(latecomer.Problem):
    layout = (("w", (3,)),)

    def init_params(self, seed):
        return np.zeros(3, np.float32)

    def grad(self, x, seed, batch_size):
        return latecomer.GradResult(np.random.default_rng().standard_normal(3).astype(np.float32), 0.0)

    def evaluate(self, x):
        return {"loss": 0.0}


def make(device="cpu"):
    return Noisy()
'''


def test_the_check_problem_command_says_ok_or_what_broke_in_one_line(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from ps.cli.main import main

    r = CliRunner().invoke(main, ["check-problem", "quadratic", "--problem-opt", "d=8"])
    assert r.exit_code == 0 and "quadratic: meets the problem contract" in r.output, r.output
    (tmp_path / "noisymod.py").write_text(UNSEEDED)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    r = CliRunner().invoke(main, ["check-problem", "noisymod:make"])
    assert r.exit_code == 1 and "pure function of (x, seed, batch_size)" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(main, ["check-problem", "nosuchmod:make"])
    assert r.exit_code == 1 and "cannot import module 'nosuchmod'" in r.output, r.output
