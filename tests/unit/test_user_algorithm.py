"""A user's own algorithm (``--algorithm module:Class``), the contract check it can run
(``latecomer.testing``), and ``latecomer algorithms`` saying what every hyper-parameter means.

The command-line cases run in-process from a temporary folder holding the user's module, the
way a user starts ``latecomer`` from the folder of ``my_algorithm.py``."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys

import pytest
from click.testing import CliRunner

import algorithms
from algorithms import Outcome
from algorithms.registry import describe, resolve
from algorithms.wrappers import WRAPPER_KEYS, WrapperSettings
from latecomer.testing import check_algorithm, check_convergence, check_state_dict_round_trip
from ps.cli.main import main

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "my_algorithm.py"

BAD_MODULE = '''
from dataclasses import dataclass
from algorithms import Algorithm

class NotDataclass(Algorithm):
    lr = 0.1

@dataclass(frozen=True)
class NotAlgorithm:
    lr: float = 0.1

not_a_class = 3
'''


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A folder holding the example module and a few broken ones, made the working directory;
    sys.path and the imported user modules are restored afterwards."""
    shutil.copy(EXAMPLE, tmp_path / "my_algorithm.py")
    (tmp_path / "bad_algs.py").write_text(BAD_MODULE)
    (tmp_path / "raising_alg.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "missing_dep.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name in ("my_algorithm", "bad_algs", "raising_alg", "missing_dep"):
            del sys.modules[name]


def run_cli(args):
    r = CliRunner().invoke(main, args)
    return r, r.output


SIM = ["simulate", "--workers", "2", "--time", "50", "--problem-opt", "d=8"]


@pytest.mark.parametrize("spec,settings,needle", [
    ("nomod_xyz:Alg", [], "algorithm 'nomod_xyz:Alg': cannot import module 'nomod_xyz': run from the folder "
                          "that holds nomod_xyz.py"),
    ("missing_dep:Alg", [], "importing module 'missing_dep' failed: No module named 'no_such_dependency_xyz'"),
    ("raising_alg:Alg", [], "importing module 'raising_alg' failed: RuntimeError: boom at import"),
    ("my_algorithm:Nope", [], "module 'my_algorithm' has no attribute 'Nope'"),
    ("bad_algs:not_a_class", [], "not_a_class is not a subclass of algorithms.Algorithm"),
    ("bad_algs:NotAlgorithm", [], "NotAlgorithm is not a subclass of algorithms.Algorithm"),
    ("bad_algs:NotDataclass", [], "NotDataclass is not a dataclass"),
    ("my_algorithm:MomentumSGD", ["--set", "momentum=0.9"],
     "unknown hyper-parameter 'momentum' for my_algorithm:MomentumSGD (known: lr, beta; wrappers: lr_schedule"),
    ("my_algorithm:MomentumSGD", ["--set", "lr=fast"], "Invalid lr: 'fast' (expected float)"),
    ("my_algorithm:MomentumSGD", ["--set", "beta=1.5"], "Invalid beta: 1.5 (must be < 1.0)"),
    ("my_algorithm:MomentumSGD", ["--set", "lr_schedule=cosine"], "lr_schedule=cosine needs decay_steps"),
    ("nope", [], "unknown algorithm 'nope' (choose one of"),
])
def test_user_algorithm_mistakes_are_one_line_errors(user_folder, spec, settings, needle):
    r, out = run_cli([*SIM, "--algorithm", spec, *settings])
    assert r.exit_code == 2, out
    assert needle in " ".join(out.split()), out
    assert "Traceback" not in out and isinstance(r.exception, SystemExit)


def test_user_algorithm_simulates_with_its_hyper_parameters_and_wrappers(user_folder):
    out_dir = user_folder / "sim"
    r, out = run_cli([*SIM, "--algorithm", "my_algorithm:MomentumSGD", "--set", "lr=0.1", "--set", "beta=0.5",
                      "--set", "lr_schedule=linear", "--set", "clip_norm=1", "--max-steps", "40",
                      "--out", str(out_dir)])
    assert r.exit_code == 0, out
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["counters"]["updates"] == 40  # decay_steps defaulted to --max-steps: no error
    first = float(out.split("loss: ")[1].split(" -> ")[0])
    assert summary["points"][-1]["loss"] < 0.5 * first


def test_the_example_algorithm_meets_the_contract_and_a_broken_one_does_not(user_folder):
    MomentumSGD = resolve(algorithms.ALGORITHMS, "my_algorithm:MomentumSGD")  # from the working directory
    check_algorithm(MomentumSGD)  # the class is a factory of its defaults
    with pytest.raises(AssertionError, match=r"my-momentum: loss .* the contract needs at most 5%"):
        check_convergence(lambda: MomentumSGD(lr=0.2, beta=0.5))  # too large a step: diverges

    @dataclasses.dataclass(frozen=True)
    class Forgetful(MomentumSGD):
        """Loses the momentum on a state-dict round trip."""

        def from_state_dict(self, d):
            state = super().from_state_dict(d)
            state.m[...] = 0
            return state

    with pytest.raises(AssertionError, match="from_state_dict\\(to_state_dict\\(state\\)\\) is not the same state: m"):
        check_state_dict_round_trip(Forgetful)

    @dataclasses.dataclass(frozen=True)
    class InPlace(MomentumSGD):
        """Steps x in place: a point already handed out changes under the workers' feet."""

        def init(self, x0, *, seed):
            state, jobs = super().init(x0, seed=seed)
            state.x = state.x.copy()  # writable
            return state, jobs

        def apply(self, state, results):
            for r in results:
                state.m = self.beta * state.m + r.grads[0]
                state.x -= self.lr * state.m
                state.version += 1
            return state, Outcome(applied=tuple(r.job_id for r in results), updated=bool(results),
                                  ages=(0,) * len(results))

    with pytest.raises(AssertionError, match="changed after they were handed out"):
        check_convergence(InPlace)


def test_every_hyper_parameter_of_every_algorithm_and_wrapper_has_a_meaning():
    for name, cls in algorithms.ALGORITHMS.items():
        text = describe(cls)
        assert set(text) == set(algorithms.hyper_parameters(cls)), name
        assert all(len(t) > 5 for t in text.values()), (name, [k for k, t in text.items() if len(t) <= 5])
    assert set(describe(WrapperSettings)) == set(WRAPPER_KEYS)
    assert all(describe(WrapperSettings).values())


def test_latecomer_algorithms_prints_one_line_per_hyper_parameter_with_its_meaning():
    r, out = run_cli(["algorithms"])
    assert r.exit_code == 0, out
    blocks: dict[str, dict[str, str]] = {}
    current = None
    for line in out.splitlines():
        if not line.startswith(" "):
            current = line.split(":")[0]
            blocks[current] = {}
        else:
            key_default, _, meaning = line.strip().partition(" ")
            blocks[current][key_default.split("=")[0]] = meaning.strip()
    assert set(blocks) == set(algorithms.ALGORITHMS) | {"wrappers"}
    for name, cls in algorithms.ALGORITHMS.items():
        assert set(blocks[name]) == set(algorithms.hyper_parameters(cls)), name
        for key, meaning in blocks[name].items():
            assert meaning and meaning != "(undocumented)", (name, key)
    assert set(blocks["wrappers"]) == set(WRAPPER_KEYS)
    assert "x ← x − lr_k·λ·x" in blocks["wrappers"]["weight_decay"]


def test_latecomer_algorithms_describes_a_user_algorithm(user_folder):
    r, out = run_cli(["algorithms", "my_algorithm:MomentumSGD"])
    assert r.exit_code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("my_algorithm:MomentumSGD: Heavy-ball SGD")
    assert lines[1].split() == ["lr=0.1", "step", "size", "(>", "0)."]
    assert lines[2].split()[:2] == ["beta=0.5", "momentum"]
    assert lines[3].startswith("wrappers:")
    r, out = run_cli(["algorithms", "bad_algs:NotDataclass"])
    assert r.exit_code == 2 and "NotDataclass is not a dataclass" in out


def test_docstring_sections_and_field_metadata_both_describe_hyper_parameters():
    @dataclasses.dataclass(frozen=True)
    class Documented(algorithms.Algorithm):
        """Something.

        Attributes:
            a: the first one,
                continued on a second line.
            b (int): the second.
        """

        a: float = 1.0
        b: int = 2
        c: float = dataclasses.field(default=0.5, metadata={"help": "from the metadata"})
        d: float = 0.0

    assert describe(Documented) == {"a": "the first one, continued on a second line.", "b": "the second.",
                                    "c": "from the metadata", "d": ""}
