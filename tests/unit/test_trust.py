"""problems/trust.py: allow patterns, what is trusted, and the refusals of the worker and of the
commands that read a state directory (issue 13 point 9). The real-process attacks are in
tests/integration/test_worker_trust.py and test_state_trust.py."""

from __future__ import annotations

import dataclasses
import shlex
import sys

import numpy as np
import pytest
from click.testing import CliRunner

import algorithms
from problems.loader import BUILTIN_PROBLEMS
from problems.trust import (
    BUILTINS_ONLY,
    Allowed,
    UntrustedError,
    check_pattern,
    check_run,
    is_user_problem,
    matches,
    worker_refusal,
)
from protocol.messages import ErrorCode, Welcome
from ps.cli.main import main
from ps.core.config import CoreConfig
from ps.core.server_core import ServerCore
from ps.journal.checkpoints import write_checkpoint
from ps.journal.runfile import write_run


@pytest.mark.parametrize("pattern, spec, expected", [
    ("mymodel:make", "mymodel:make", True),
    ("mymodel:make", "mymodel:make2", False),
    ("mymodel:make", "mymodel2:make", False),
    ("mymodel:*", "mymodel:anything", True),
    ("mymodel:*", "mymodel.sub:make", False),
    ("mymodel", "mymodel:make", True),  # no ':': the module part
    ("mymodel", "mymodel.sub:make", False),
    ("mymodel", "mymodelx:make", False),
    ("mypkg.*", "mypkg:make", True),  # the package itself
    ("mypkg.*", "mypkg.a:make", True),
    ("mypkg.*", "mypkg.a.b:Cls.make", True),
    ("mypkg.*", "mypkgx:make", False),
    ("mypkg.*", "os:system", False),
    ("mypkg.*:make", "mypkg.a:make", True),
    ("mypkg.*:make", "mypkg.a:other", False),
    ("my?odel:make", "mymodel:make", True),
    ("m[xy]mod:make", "mymod:make", True),
    ("m[!y]mod:make", "mymod:make", False),
    ("MyModel", "mymodel:make", False),  # case-sensitive, as module names are
    ("mymodel", "mymodel", False),  # not a module:attr spec at all
])
def test_pattern_matching(pattern, spec, expected):
    assert check_pattern(pattern) == pattern
    assert matches(pattern, spec) is expected


@pytest.mark.parametrize("pattern", ["", "*", "*:*", "?x", ":make", "a:b:c", "my model", "mymodel:", "a;rm", "-x",
                                     "mod/ule", "mod:\n"])
def test_patterns_that_trust_anything_or_nothing_sensible_are_refused(pattern):
    with pytest.raises(ValueError, match=r"expected MODULE, MODULE:CALLABLE") as info:
        check_pattern(pattern)
    assert "\n" not in str(info.value).replace(repr(pattern), "")


def test_builtins_are_trusted_by_name_and_target_and_nothing_else_of_ours():
    for name, target in BUILTIN_PROBLEMS.items():
        assert BUILTINS_ONLY.problem_ok(name) and BUILTINS_ONLY.problem_ok(target)
        assert not is_user_problem(name) and not is_user_problem(target)
    assert BUILTINS_ONLY.problem_ok("no-such-problem")  # no ':': the loader refuses it, importing nothing
    for spec in ("os:system", "problems.loader:load_problem", "problems.quadratic:QuadraticProblem", "subprocess:run",
                 "builtins:exec"):
        assert not BUILTINS_ONLY.problem_ok(spec), spec
    for name in algorithms.ALGORITHMS:
        assert BUILTINS_ONLY.algorithm_ok(name)
    assert not BUILTINS_ONLY.algorithm_ok("my_algorithm:MomentumSGD")


def test_allowed_from_flags_names_and_splits_like_an_environment_variable():
    a = Allowed.from_flags(["mymodel:make  mypkg.*", "other"], ["my_algorithm:*"])
    assert a.problems == ("mymodel:make", "mypkg.*", "other")
    assert a.problem_ok("mypkg.x:make") and a.problem_ok("other:make") and not a.problem_ok("os:system")
    assert a.algorithm_ok("my_algorithm:MomentumSGD") and not a.algorithm_ok("evil:Alg")
    b = a.naming(problem="exact:make", algorithm="exactalg:A")
    assert b.problem_ok("exact:make") and not b.problem_ok("exact:other") and b.algorithm_ok("exactalg:A")
    assert not a.problem_ok("exact:make"), "naming returns a new Allowed"
    with pytest.raises(ValueError, match="--allow-algorithm '\\*'"):
        Allowed.from_flags([], ["*"])


def test_worker_refusal_is_one_line_that_names_the_flag():
    assert worker_refusal("digits", BUILTINS_ONLY) is None
    assert worker_refusal("mymodel:make", Allowed(("mymodel:*",))) is None
    why = worker_refusal("os:system", Allowed(("mymodel:*",)))
    assert why.startswith("problem 'os:system': not allowed here") and "\n" not in why
    assert "add --allow-problem os:system to `latecomer work`" in why
    assert "--allow-problem 'a b:c'" in worker_refusal("a b:c", BUILTINS_ONLY)  # shell-quoted


def test_check_run_names_the_file_the_callable_and_the_flag():
    run = {"problem": "os:system", "algorithm": "asgd"}
    with pytest.raises(UntrustedError) as info:
        check_run(run, BUILTINS_ONLY, "S/run.json", problem_hint="--allow-problem {spec} (or --problem {spec})")
    assert str(info.value) == ("S/run.json names the problem os:system, code of your own: it runs only if the command "
                               "line names it too: add --allow-problem os:system (or --problem os:system)")
    with pytest.raises(UntrustedError, match="names the algorithm evil:Alg.*add --allow-algorithm evil:Alg$"):
        check_run({"problem": "quadratic", "algorithm": "evil:Alg"}, BUILTINS_ONLY, "run.json")
    check_run({"problem": "quadratic", "algorithm": "evil:Alg"}, BUILTINS_ONLY, "x", check_algorithm=False)
    check_run({"problem": "m:make", "algorithm": "a:A"}, Allowed(("m",), ("a:*",)), "x")


# --------------------------------------------------------------------------- the worker, unit level

def test_worker_refuses_a_welcome_naming_code_before_importing_it(tmp_path, monkeypatch):
    from worker.link import Worker, WorkerConfig

    (tmp_path / "unitevil.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    w = Worker(WorkerConfig(server="tcp://127.0.0.1:1", worker_id="t", allow_problems=("mine.*",)))
    sent = []
    monkeypatch.setattr(w, "_send", lambda msg: sent.append(msg) or True)
    w._on_welcome(Welcome(server_boot=1, version=1, problem="unitevil:make", run_id=3))
    assert "unitevil" not in sys.modules and w.compute is None and not w.loaded
    assert [(type(m).__name__, m.code) for m in sent] == [("Error", ErrorCode.PROBLEM_UNAVAILABLE)]
    assert w.failure == w.stopping and w.failure.startswith("cannot load problem unitevil:make: not allowed here")
    assert w.welcomed, "so that the bye follows the error on the way out (PROTOCOL.md 8.1)"
    w.ctx.term()


def test_work_refuses_a_pattern_that_trusts_everything():
    r = CliRunner().invoke(main, ["work", "--server", "tcp://127.0.0.1:1", "--allow-problem", "*"])
    assert r.exit_code == 2 and "--allow-problem" in r.output and "expected MODULE" in r.output
    r = CliRunner().invoke(main, ["work", "--server", "tcp://127.0.0.1:1"], env={"LATECOMER_ALLOW_PROBLEM": "ok *"})
    assert r.exit_code == 2 and "'*'" in r.output


# --------------------------------------------------------------------------- state directories, unit level

MARKER = '''
import os
open(os.path.join({folder!r}, "{name}.imported"), "w").close()
from dataclasses import dataclass
from algorithms.baselines import VanillaASGD
from problems.quadratic import make_quadratic

def make(d: int = 3):
    open(os.path.join({folder!r}, "{name}.called"), "w").close()
    return make_quadratic(d=d)

@dataclass(frozen=True)
class Alg(VanillaASGD):
    pass
'''


@pytest.fixture
def marked(tmp_path, monkeypatch):
    """A module (in the working directory) that leaves a marker when imported or called."""
    name = f"marked_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(MARKER.format(folder=str(tmp_path), name=name))
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


def markers(tmp_path) -> list[str]:
    return sorted(p.suffix for p in tmp_path.iterdir() if p.suffix in (".imported", ".called"))


def state_with(path, problem: str, algorithm: str = "asgd"):
    path.mkdir()
    cfg = CoreConfig(problem=problem, problem_options={"d": 3}, batch_size=4, seed=0, run_id=1)
    write_run(str(path), {"problem": problem, "problem_options": {"d": 3}, "algorithm": algorithm,
                          "settings": {"lr": 0.1}, "format": 1, "wire_dtype": "f32", "core": dataclasses.asdict(cfg)})
    write_checkpoint(str(path), 0, ServerCore(algorithms.build("asgd", {"lr": 0.1}), np.zeros(3, np.float32),
                                              cfg).snapshot())
    return str(path)


def test_replay_and_export_of_a_state_dir_naming_a_user_problem_import_nothing(tmp_path, marked):
    d = state_with(tmp_path / "state", f"{marked}:make")
    for args in (["replay", d], ["export", d, "-o", str(tmp_path / "m.pt")], ["replay", d, "--allow-problem", "x:*"],
                 ["export", d, "-o", str(tmp_path / "m.pt"), "--allow-problem", "x:*"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
        assert f"run.json names the problem {marked}:make" in r.output
        assert f"add --allow-problem {marked}:make" in r.output
    assert markers(tmp_path) == [] and marked not in sys.modules
    r = CliRunner().invoke(main, ["export", d, "-o", str(tmp_path / "m.npz"), "--format", "npy",
                                  "--allow-problem", f"{marked}:*"])
    assert r.exit_code == 0, r.output
    assert markers(tmp_path) == [".called", ".imported"]


def test_replay_and_export_of_a_state_dir_naming_a_user_algorithm_import_nothing(tmp_path, marked):
    d = state_with(tmp_path / "state", "quadratic", f"{marked}:Alg")
    for args in (["replay", d], ["export", d, "-o", str(tmp_path / "m.pt")]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
        assert f"add --allow-algorithm {marked}:Alg" in r.output
    assert markers(tmp_path) == [] and marked not in sys.modules
    r = CliRunner().invoke(main, ["export", d, "-o", str(tmp_path / "m.npz"), "--format", "npy",
                                  "--allow-algorithm", marked])
    assert r.exit_code == 0, r.output
    assert markers(tmp_path) == [".imported"]


def test_replay_api_trusts_only_the_builtins_by_default(tmp_path, marked):
    from ps.drivers.replay import replay_run

    d = state_with(tmp_path / "state", f"{marked}:make")
    with pytest.raises(UntrustedError):
        replay_run(d)
    assert markers(tmp_path) == []


def test_mnist_errors_do_not_quote_a_files_bytes():
    from problems.mnist import parse_idx

    for raw in (b"-----BEGIN OPENSSH PRIVATE KEY-----", b"\x00\x00\x42secret"):
        with pytest.raises(ValueError) as info:
            parse_idx(raw, name="f")
        assert raw[:4].hex() not in str(info.value) and "42" not in str(info.value), str(info.value)


def test_launch_passes_the_allow_list_to_every_worker(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("h1 2\n")
    r = CliRunner().invoke(main, ["launch", "--hosts", str(hosts), "--server", "tcp://srv:5555", "--dry-run",
                                  "--allow-problem", "mymodel:make", "--allow-problem", "mypkg.*"])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 2
    for line in lines:  # ssh ... HOST 'REMOTE COMMAND': the remote command's own words
        remote = shlex.split(shlex.split(line)[-1])
        i = remote.index("--allow-problem")
        assert remote[i:i + 4] == ["--allow-problem", "mymodel:make", "--allow-problem", "mypkg.*"], remote
