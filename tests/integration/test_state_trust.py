"""Issue 13 point 9, state directories: a run.json is data, not an instruction to run code.

A real run of a user problem (``markmod:make``, a quadratic that leaves a marker file whenever its
module is imported or its factory called) leaves a state directory; then ``serve --state`` and
``replay`` must refuse it with one line (and import nothing: the markers stay absent) unless the
command line names the problem (``--problem`` equal to it, or an ``--allow-problem`` pattern),
and with it they proceed: the resumed server reaches its step limit, the replay is bit-identical.
A run.json tampered to name ``os:system`` runs no shell command. The workers of the run itself
are started with ``--allow-problem``, as the README's commands show.

Not a load test: no RSS bound applies (what is measured is whether the named code runs).
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.integration.util import wait_exit, wait_line

pytestmark = pytest.mark.slow

MARKMOD = '''
import os
_here = os.path.dirname(os.path.abspath(__file__))
open(os.path.join(_here, "markmod.imported"), "w").close()

from problems.quadratic import make_quadratic


def make(d: int = 8):
    open(os.path.join(_here, "markmod.called"), "w").close()
    return make_quadratic(d=d)
'''


@pytest.fixture
def mods(tmp_path):
    d = tmp_path / "mods"
    d.mkdir()
    (d / "markmod.py").write_text(MARKMOD)
    return d


def markers(mods) -> list[str]:
    return sorted(p.name for p in mods.iterdir() if p.suffix in (".imported", ".called"))


def clear(mods) -> None:
    for p in mods.iterdir():
        if p.suffix in (".imported", ".called"):
            p.unlink()


SERVE = ("serve", "--bind", "tcp://127.0.0.1:0", "--algorithm", "asgd", "--set", "lr=0.2", "--eval-every", "0",
         "--checkpoint-every", "20", "--liveness-timeout", "1.5", "--heartbeat-interval", "0.25")


def one_line_refusal(p, what: str) -> str:
    out, err = p.communicate(timeout=60)
    lines = err.decode().strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, (p.returncode, err.decode()[-2000:])
    assert what in lines[0], lines[0]
    return lines[0]


def test_state_dir_naming_a_user_callable_needs_the_command_line(procs, mods, tmp_path):
    env = {"PYTHONPATH": str(mods)}
    state = tmp_path / "state"
    server = procs.start(*SERVE, "--problem", "markmod:make", "--problem-opt", "d=8", "--max-steps", "60",
                         "--state", str(state), env=env)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    worker = procs.start("work", "--server", endpoint, "--worker-id", "w1", "--allow-problem", "markmod:make",
                         env=env)
    assert wait_exit(server, timeout=120) == 0, server.stderr.read()[-2000:]
    assert wait_exit(worker, timeout=20) == 0
    assert json.loads((state / "run.json").read_text())["problem"] == "markmod:make"

    clear(mods)
    line = one_line_refusal(procs.start(*SERVE, "--state", str(state), "--max-steps", "60", env=env),
                            "add --allow-problem markmod:make (or --problem markmod:make)")
    print(line)
    assert markers(mods) == [], "serve --state imported or called the module run.json names"
    line = one_line_refusal(procs.start("replay", str(state), env=env), "add --allow-problem markmod:make")
    print(line)
    line = one_line_refusal(procs.start("replay", str(state), "--allow-problem", "other:*", env=env),
                            "add --allow-problem markmod:make")
    assert markers(mods) == [], "replay imported or called the module run.json names"

    replay = procs.start("replay", str(state), "--allow-problem", "markmod:*", env=env)
    out, err = replay.communicate(timeout=120)
    assert replay.returncode == 0 and "bit-identical to the recorded final iterate: yes" in out.decode(), \
        out.decode() + err.decode()[-2000:]
    assert markers(mods) == ["markmod.called", "markmod.imported"]

    clear(mods)  # resuming with --problem naming it: the server loads it and goes on to 80 steps
    server = procs.start(*SERVE, "--state", str(state), "--problem", "markmod:make", "--max-steps", "80", env=env)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    worker = procs.start("work", "--server", endpoint, "--worker-id", "w1", "--allow-problem", "markmod", env=env)
    assert wait_exit(server, timeout=120) == 0, server.stderr.read()[-2000:]
    assert wait_exit(worker, timeout=20) == 0
    assert json.loads((state / "summary.json").read_text())["version"] == 80
    assert markers(mods) == ["markmod.called", "markmod.imported"]

    # the same directory with run.json tampered to name os:system: nothing runs
    evil = tmp_path / "evil"
    shutil.copytree(state, evil)
    run = json.loads((evil / "run.json").read_text())
    witness = tmp_path / "os-system-ran"
    run["problem"] = run["core"]["problem"] = "os:system"
    run["problem_options"] = run["core"]["problem_options"] = {"command": f"touch {witness}"}
    (evil / "run.json").write_text(json.dumps(run))
    one_line_refusal(procs.start(*SERVE, "--state", str(evil), env=env), "add --allow-problem os:system")
    one_line_refusal(procs.start("replay", str(evil), env=env), "add --allow-problem os:system")
    one_line_refusal(procs.start("export", str(evil), "-o", str(tmp_path / "m.pt"), env=env),
                     "add --allow-problem os:system")
    assert not witness.exists()
