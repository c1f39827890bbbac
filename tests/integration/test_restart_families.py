"""kill -9 of the server with replies in flight, for every algorithm family (issue 28): the
reference worker follows PROTOCOL.md 8.6/8.11 (a reply it sent within the liveness timeout is
listed in its next ``hello.busy`` and sent again after the ``welcome`` of the same run), so a
reply that died with the server is applied by its successor, and no job held by a worker is
written off. The server keeps its side of the rule: a restored worker is sent nothing (no job, no
cancel) before its hello, so it is never written off as unreachable meanwhile.

What is counted: ``lost`` events whose reason blames the worker's link ("vanished": not in its
busy list; "timeout"; "unreachable"), and jobs written off whose reply came back later (``late``):
a reply the worker had, lost all the same. A job the dead server had issued but never delivered
is written off at the worker's hello as "server_restart" (the worker never held it, and sends no
reply) and is not counted against the worker. Every run then replays bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ps.ops.children import reap
from tests.integration.test_worker_lifecycle import free_port
from tests.integration.util import read_events, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

STEPS = 40
FAMILIES = {  # one algorithm of each family, and the job kinds it issues
    "asgd": ("asgd", "lr=0.05"),  # one point per job
    "ordered-momentum": ("ordered-momentum", "lr=0.05"),  # momentum weights by age
    "ringmaster": ("ringmaster", "lr=0.05"),  # a delay threshold
    "rennala": ("rennala", "lr=0.05"),  # batch rounds
    "rennala-mvr": ("rennala-mvr", "lr=0.05"),  # pairs on one sample, cancels
    "ringmaster-lmo": ("ringmaster-lmo", "lr=0.05"),  # LMO steps
    # full-gradient snapshots (of a problem of N samples)
    "snapshot-vr": ("snapshot-vr", "lr=0.05", "num_samples=64", "m=5", "shards=2"),
}


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ps", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def serve(endpoint: str, state: str, algorithm: str, *settings: str) -> subprocess.Popen:
    problem = ("logreg", "--problem-opt", "n=64", "--problem-opt", "p=8") if algorithm == "snapshot-vr" else \
        ("quadratic", "--problem-opt", "d=16")
    p = spawn("serve", "--bind", endpoint, "--state", state, "--problem", *problem,
              "--algorithm", algorithm, *[a for kv in settings for a in ("--set", kv)], "--batch-size", "1",
              "--max-steps", str(STEPS), "--eval-every", "0", "--min-workers", "2", "--shm", "off",
              "--log-level", "info")
    wait_line(p, r"listening on", 60)
    return p


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kill9_with_replies_in_flight_loses_no_job_a_worker_held(family, tmp_path):
    algorithm, *settings = FAMILIES[family]
    state, endpoint = str(tmp_path / "state"), f"tcp://127.0.0.1:{free_port()}"
    events = os.path.join(state, "events.jsonl")
    procs = [serve(endpoint, state, algorithm, *settings)]
    try:
        procs += [spawn("work", "--server", endpoint, "--worker-id", w, "--credit", "2", "--delay", "0.05",
                        "--shm", "off", "--give-up", "60") for w in ("w1", "w2")]
        wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev) >= 8, timeout=60)
        os.killpg(procs[0].pid, signal.SIGKILL)  # the supervisor and its daemon: replies in flight die with them
        assert wait_exit(procs[0], 10) == -signal.SIGKILL
        before = len(read_events(events))
        procs[0] = serve(endpoint, state, algorithm, *settings)  # at once, on the same endpoint
        assert wait_exit(procs[0], 120) == 0
        for w in procs[1:]:
            assert wait_exit(w, 30) == 0
    finally:
        reap(procs, grace_s=5)
    after = read_events(events)[before:]
    blamed = [e for e in after if e["ev"] == "lost" and e["reason"] in ("vanished", "timeout", "unreachable")]
    assert blamed == [], blamed
    # A reply that came back after its job was written off: the worker had it, and it was lost anyway.
    late = {e["job_id"] for e in after if e["ev"] == "late"}
    lost_yet_answered = [e for e in after if e["ev"] == "lost" and e["job_id"] in late]
    assert lost_yet_answered == [], lost_yet_answered
    assert not [e for e in after if e["ev"] == "left" and e.get("reason") in ("timeout", "unreachable")]
    r = subprocess.run([sys.executable, "-m", "ps", "replay", state], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "bit-identical to the recorded final iterate: yes" in r.stdout, r.stdout + r.stderr
