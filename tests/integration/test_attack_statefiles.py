"""Issue 29 point 5, crafted state directories, against the real commands: a real run (``serve
--state`` and one worker) leaves a state directory once; each crafted file (tests/crafted_state.py)
goes into a fresh copy of it, and every command that reads that file runs as a real process
(``.venv/bin/latecomer``, one per command).

Each must end within 5 s + 3 x the time of the same command on the undamaged copy (measured in
this test: speed-independent; the quadratic resync took 45 s), with a peak RSS (``wait4``'s, the
command and its children) of at most the undamaged command's + 4 x the crafted file's size +
32 MiB (the design reads a state file whole a constant number of times and allocates nothing its
header declares before checking it against the file), and:

- refused: exit 1, exactly one line on stderr naming the file, no traceback, the directory
  byte for byte as it was;
- or, where the design goes on (a checkpoint that does not verify is skipped for the previous
  one; ``--repair`` moves a damaged segment aside; ``report`` leaves out a damaged summary or
  event line): exit 0, a warning line naming the file, no traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests import crafted_state as crafted
from tests.conftest import REPO, Procs
from tests.integration.util import wait_exit, wait_line

pytestmark = [pytest.mark.slow, pytest.mark.attack]

LATECOMER = os.path.join(os.path.dirname(sys.executable), "latecomer")
SERVE = ("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--algorithm", "asgd", "--set", "lr=0.1",
         "--eval-every", "0")
RESUME = (*SERVE, "--max-time", "0.5")  # a resumed server with no worker: it stops by itself


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A real run's state directory (60 steps, checkpoints every 20), and an ``--out``-like copy
    of it (problem.json and final_x.npy: what export reads without run.json)."""
    base = tmp_path_factory.mktemp("statefiles")
    state = str(base / "state")
    procs = Procs()
    try:
        server = procs.start(*SERVE, "--state", state, "--max-steps", "60", "--checkpoint-every", "20")
        endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
        worker = procs.start("work", "--server", endpoint, "--worker-id", "w1")
        assert wait_exit(server, timeout=120) == 0, server.stderr.read()[-2000:]
        wait_exit(worker, timeout=30)
    finally:
        procs.reap()
    out = str(base / "out")
    os.makedirs(out)
    for name in ("problem.json", "final_x.npy", "summary.json"):
        shutil.copy2(os.path.join(state, name), out)
    return state, out


def snapshot(d: str) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(d):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, d)] = hashlib.sha256(f.read()).hexdigest()
    return out


class Ran:
    def __init__(self, rc: int, stderr: str, seconds: float, maxrss: int) -> None:
        self.rc, self.stderr, self.seconds, self.maxrss = rc, stderr, seconds, maxrss

    def lines(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if ln.strip()]


# A small launcher measures each command: ``wait4``'s peak RSS is the command's (and its children's)
# and that of the process it was forked from, so that must be this small one, not pytest.
LAUNCH = """import json, os, subprocess, sys, time
t = time.monotonic()
p = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(p.pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump([os.waitstatus_to_exitcode(status), time.monotonic() - t, usage.ru_maxrss * 1024], f)
"""


def run(args: tuple[str, ...], cwd: str, timeout: float = 120) -> Ran:
    """One command as a real process; its exit status, time and peak RSS (it and its children)."""
    figures = os.path.join(cwd, "figures.json")
    with open(os.path.join(cwd, "stderr.txt"), "w+b") as err:
        p = subprocess.Popen([sys.executable, "-c", LAUNCH, figures, LATECOMER, *args], cwd=REPO,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait(timeout=10)
            raise AssertionError(f"{args} still running after {timeout} s") from None
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    assert p.returncode == 0, (args, stderr[-2000:])
    with open(figures) as f:
        rc, seconds, maxrss = json.load(f)
    return Ran(rc, stderr, seconds, maxrss)


def commands(state: str, out: str, target: str) -> dict[str, tuple[str, ...]]:
    exported = os.path.join(os.path.dirname(target), "model.npz")
    return {"serve": (*RESUME, "--state", state), "repair": (*RESUME, "--state", state, "--repair"),
            "replay": ("replay", state), "export": ("export", state, "--format", "npy", "-o", exported),
            "export-out": ("export", out, "--format", "npy", "-o", exported),
            "report": ("report", state, "--out", os.path.join(os.path.dirname(target), "report"))}


def _plain(build):
    return lambda path, info: build(path)


# (name, which directory, the file crafted (a function of the pristine run's facts), its builder,
# {command: "refused" | "goes on"})
VARIANTS = [
    ("checkpoint 600 deep", "state", lambda i: f"ckpt-{i['newest']:012d}.bin",
     lambda path, i: crafted.deep_checkpoint(path, i["newest"]),
     {"serve": "goes on", "repair": "goes on", "export": "goes on", "export --checkpoint": "refused"}),
    ("run.json 200,000 deep", "state", lambda i: "run.json", _plain(crafted.deep_json),
     {"serve": "refused", "repair": "refused", "replay": "refused", "export": "refused"}),
    ("segment: over-long record + 6,000 candidates", "state", lambda i: f"wal-{i['segments'] + 1:06d}.log",
     lambda path, i: crafted.overlong_segment(path, i["last_lsn"] + 1),
     {"serve": "refused", "repair": "goes on", "replay": "refused"}),
    *[(f"final_x.npy {kind}", "out", lambda i: "final_x.npy", _plain(build), {"export-out": "refused"})
      for kind, build in sorted(crafted.BAD_NPY.items())],
    ("final_x.npy huge", "state", lambda i: "final_x.npy", _plain(crafted.bad_npy_huge), {"replay": "refused"}),
    ("final_x.npy header", "state", lambda i: "final_x.npy", _plain(crafted.bad_npy_header), {"replay": "refused"}),
    ("problem.json []", "out", lambda i: "problem.json", _plain(crafted.problem_json_list), {"export-out": "refused"}),
    ("problem.json 200,000 deep", "out", lambda i: "problem.json", _plain(crafted.deep_json),
     {"export-out": "refused"}),
    ("summary.json 200,000 deep", "state", lambda i: "summary.json", _plain(crafted.deep_json), {"report": "goes on"}),
    ("an event line 200,000 deep", "state", lambda i: "events.jsonl", _plain(crafted.deep_event_line),
     {"report": "goes on"}),
]


def control_runs(pristine, tmp_path) -> dict[str, Ran]:
    """Every command on an undamaged copy: the time and memory each crafted run is held to."""
    out = {}
    for name in ("serve", "repair", "replay", "export", "export-out", "report"):
        case = tmp_path / f"control-{name}"
        state, outdir = str(case / "state"), str(case / "out")
        shutil.copytree(pristine[0], state)
        shutil.copytree(pristine[1], outdir)
        r = run(commands(state, outdir, state)[name], str(case))
        assert r.rc == 0 and "Traceback" not in r.stderr, (name, r.stderr[-2000:])
        out[name] = r
    return out


def test_every_crafted_state_file_is_one_line_within_bounded_time_and_memory(pristine, tmp_path):
    from ps.journal.checkpoints import checkpoint_files
    from ps.journal.segments import journal_segments, last_lsn

    info = {"newest": checkpoint_files(pristine[0])[-1][0], "last_lsn": last_lsn(pristine[0]),
            "segments": journal_segments(pristine[0])[-1][0]}
    control = control_runs(pristine, tmp_path)
    print({k: (round(r.seconds, 2), r.maxrss >> 20) for k, r in control.items()})
    for k, (name, where, filename, build, expect) in enumerate(VARIANTS):
        for command, verdict in expect.items():
            case = tmp_path / f"v{k}-{command.replace(' ', '')}"
            state, outdir = str(case / "state"), str(case / "out")
            shutil.copytree(pristine[0], state)
            shutil.copytree(pristine[1], outdir)
            target = build(os.path.join(state if where == "state" else outdir, filename(info)), info)
            args = commands(state, outdir, target)[command.split()[0]]
            if command == "export --checkpoint":
                args = (*args, "--checkpoint", str(info["newest"]))
            check_one(f"{name}, {command}", args, verdict, case, target, control[command.split()[0]])


def check_one(name, args, verdict, case, target, ctl: Ran) -> None:
    """One crafted run against its control (the same command on the undamaged copy)."""
    before = snapshot(os.path.dirname(target))
    r = run(args, str(case))
    what = f"{name}: rc {r.rc}, {r.seconds:.2f} s, {r.maxrss >> 20} MiB: {r.lines()[-3:]}"
    print(what)
    assert "Traceback" not in r.stderr, what
    assert r.seconds <= 5 + 3 * ctl.seconds, (what, ctl.seconds)
    assert r.maxrss <= ctl.maxrss + 4 * max(os.path.getsize(target), 1) + (32 << 20), (what, ctl.maxrss)
    fname = os.path.basename(target)
    if verdict == "refused":
        assert r.rc == 1 and len(r.lines()) == 1 and fname in r.lines()[0], what
        assert snapshot(os.path.dirname(target)) == before, f"{what}: the directory changed"
    else:
        assert r.rc == 0 and any(fname in ln for ln in r.lines()), what
    if "--repair" in args and fname.startswith("wal-"):  # what --repair documents: moved aside, whole
        [moved] = [d for d in os.listdir(os.path.dirname(target)) if d.startswith("damaged-")]
        assert before[fname] == snapshot(os.path.join(os.path.dirname(target), moved))[fname], what
