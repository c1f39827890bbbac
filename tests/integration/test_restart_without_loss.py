"""Restart without loss (issue 14): kill -9 the server while 3 real workers each hold a job,
start it again from its state directory on the same endpoint, and the replies to exactly those
jobs are applied when the workers come back, not written off as lost.

The restored workers get ``ps.core.config.restart_grace_s(liveness)`` to say hello again, which covers
the worker's reconnect backoff (protocol/messages.py: ZMQ_RECONNECT_MAX_S + HELLO_BACKOFF_MAX_S);
with only a liveness timeout (3 s) a worker whose reconnect attempt and hello backoff fall late
is written off with its job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ps.ops.report import make_report
from tests.integration.test_worker_lifecycle import free_port
from tests.integration.util import read_events, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

STEPS = 15
DELAY_S = 3.0  # per job: a job issued less than DELAY_S - 1 s ago is surely still held by its worker
WORKERS = ("w1", "w2", "w3")
# How long the server stays down after the workers noticed it was gone (each logs "server silent
# ... reconnecting" and starts its backoff on a fresh socket at T). The new server listens about
# 1.5 s after it is started, S - T = 13 to 15 s: libzmq's next attempt is at T + 16.3 s (0.1 s
# doubling to 5 s), the next hello at T + 19.75 s (0.25 s doubling to 4 s), 5 to 7 s after S:
# past a bare liveness timeout (3 s), within the restart grace (12 s).
OUTAGE_S = 12.0


def serve_cmd(endpoint, state):
    return ["serve", "--bind", endpoint, "--state", state, "--problem", "quadratic", "--problem-opt", "d=16",
            "--algorithm", "asgd", "--set", "lr=0.05", "--batch-size", "1", "--max-steps", str(STEPS),
            "--min-workers", "3", "--fsync", "always", "--log-level", "info"]  # liveness: the default 3 s


def held_jobs(events):
    """worker -> (job id, issued at) of each job issued and not settled yet, by the event log."""
    open_: dict[int, dict] = {}
    for e in events:
        if e["ev"] == "issued":
            open_[e["job_id"]] = e
        elif e["ev"] in ("applied", "dropped", "lost", "failed", "cancelled", "rejected"):
            open_.pop(e["job_id"], None)
    out: dict[str, list] = {}
    for jid, e in open_.items():
        out.setdefault(e["worker_id"], []).append((jid, e["t"]))
    return out


def status_json(endpoint):
    r = subprocess.run([sys.executable, "-m", "ps", "status", "--server", endpoint, "--json", "--timeout", "5"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_jobs_held_at_a_kill_minus_nine_are_applied_after_the_restart(procs, tmp_path):
    state = str(tmp_path / "state")
    events = os.path.join(state, "events.jsonl")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = procs.start(*serve_cmd(endpoint, state))
    wait_line(server, r"listening on", timeout=60)
    workers = [procs.start("work", "--server", endpoint, "--worker-id", w, "--delay", f"{DELAY_S:g}", "--shm", "off",
                           stderr=subprocess.STDOUT) for w in WORKERS]

    def all_hold_fresh(ev):
        """Each worker holds a job issued so recently that it is still computing it (the clock
        of the events is the daemon's time.monotonic(), this machine's monotonic clock)."""
        if sum(e["ev"] == "applied" for e in ev) < 3:  # every worker has had a reply applied
            return None
        held = held_jobs(ev)
        now = time.monotonic()
        if set(held) != set(WORKERS) or any(len(v) != 1 or now - v[0][1] > DELAY_S - 1.5 for v in held.values()):
            return None
        return {w: v[0][0] for w, v in held.items()}

    held = wait_events(events, all_hold_fresh, timeout=90)
    st = status_json(endpoint)  # the server's own view, right before the kill
    rows = [dict(zip(st["columns"], r, strict=True)) for r in st["rows"]]
    holding = {row["worker"]: row["holding"] for row in rows}
    assert all(holding.get(w) == 1 for w in WORKERS), rows
    t_kill = time.monotonic()
    os.killpg(server.pid, signal.SIGKILL)  # the supervisor and its daemon (our child's own session)
    assert wait_exit(server, timeout=10) == -signal.SIGKILL
    oldest = min(t for v in held_jobs(read_events(events)).values() for _, t in v)
    assert t_kill - oldest < DELAY_S, "killed too late: a worker may have finished its job"
    jobs = set(held.values())
    before = read_events(events)
    assert not any(e["ev"] in ("applied", "lost") and e.get("job_id") in jobs for e in before), \
        "a held job was settled before the kill"

    for w in workers:  # each noticed the silence: it reconnects, with its backoff
        wait_line(w, r"server silent for .*reconnecting", timeout=30)
    # The outage itself (the scenario, not a synchronisation): the server stays down OUTAGE_S
    # after the workers noticed, so their reconnect attempts and hellos have backed off.
    time.sleep(OUTAGE_S)
    server2 = procs.start(*serve_cmd(endpoint, state))
    wait_line(server2, r"listening on", timeout=60)
    assert wait_exit(server2, timeout=120) == 0, server2.stderr.read().decode()[-3000:]
    err = server2.stderr.read().decode()
    assert "resumed" in err, err[-2000:]
    for w in workers:
        assert wait_exit(w, timeout=30) == 0

    after = read_events(events)[len(before):]
    lost = [e for e in after if e["ev"] == "lost" and e["job_id"] in jobs]
    applied = {e["job_id"]: e["worker_id"] for e in after if e["ev"] == "applied" and e["job_id"] in jobs}
    assert not lost, f"jobs held at the crash were written off: {lost}"
    assert applied == {j: w for w, j in held.items()}, (held, applied)
    left = [e for e in after if e["ev"] == "left" and e.get("reason") == "timeout"]
    assert not left, f"restored workers timed out before they came back: {left}"
    summary = json.loads((tmp_path / "state" / "summary.json").read_text())
    assert summary["version"] == STEPS and summary["accounted"]
    sessions = make_report(state, str(tmp_path / "report"))["sessions"]  # latecomer report: both sessions
    assert [s["session"] for s in sessions] == [1, 2], sessions
    assert sessions[1]["restored_outstanding"] == 3 and sessions[1]["lost_at_resume"] == 0, sessions[1]
    assert sessions[0]["applied"] + sessions[1]["applied"] == summary["counters"]["applied"], sessions
    r = subprocess.run([sys.executable, "-m", "ps", "replay", state], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "bit-identical to the recorded final iterate: yes" in r.stdout, r.stdout + r.stderr
