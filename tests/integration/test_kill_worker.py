"""Real daemon, real workers, real kill -9: training goes on and every job is accounted for."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.integration.util import read_events, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

LIVENESS_S = 1.5


def applied_by(events, wid):
    return sum(1 for e in events if e["ev"] == "applied" and e["worker_id"] == wid)


def test_kill_minus_nine_worker_mid_run(procs, tmp_path):
    events = str(tmp_path / "events.jsonl")
    out = str(tmp_path / "out")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--problem-opt", "d=64",
                         "--algorithm", "ordered-momentum", "--set", "lr=0.2", "--set", "beta=0.3",
                         "--batch-size", "1", "--max-time", "120", "--liveness-timeout", str(LIVENESS_S),
                         "--heartbeat-interval", "0.25", "--min-workers", "3", "--events", events, "--out", out,
                         "--eval-every", "50")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    workers = {f"w{i}": procs.start("work", "--server", endpoint, "--worker-id", f"w{i}", "--delay", str(d))
               for i, d in ((1, 0.01), (2, 0.03), (3, 0.02))}
    # every worker contributes before the kill
    wait_events(events, lambda ev: all(applied_by(ev, w) >= 3 for w in workers), timeout=60)
    victim = workers["w2"]
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    assert wait_exit(victim, timeout=10) == -signal.SIGKILL  # reaped
    lost = wait_events(events, lambda ev: [e for e in ev if e["ev"] == "lost" and e["worker_id"] == "w2"],
                       timeout=LIVENESS_S + 5)
    detected_s = time.monotonic() - killed_at
    assert detected_s <= LIVENESS_S + 1.0, f"dead worker's job written off after {detected_s:.2f} s"
    assert len(lost) == 1  # credit 1: exactly its one outstanding job
    n_before = len(read_events(events))
    # training goes on with the two survivors
    wait_events(events, lambda ev: len(ev) > n_before + 20 and applied_by(ev[n_before:], "w1") >= 5
                and applied_by(ev[n_before:], "w3") >= 2, timeout=30)
    server.send_signal(signal.SIGTERM)
    assert wait_exit(server, timeout=30) == 0
    for w in ("w1", "w3"):  # told bye, they exit by themselves
        assert wait_exit(workers[w], timeout=15) == 0
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    c = summary["counters"]
    assert c["lost"] == 1 and c["workers_lost"] >= 1
    assert c["issued"] == c["applied"] + c["dropped"] + c["lost"] + c["failed"] + c["cancelled"] + c["rejected"] \
        + summary["outstanding"]
    ev = read_events(events)
    issued = {e["job_id"] for e in ev if e["ev"] == "issued"}
    settled = [e["job_id"] for e in ev if e["ev"] in ("applied", "dropped", "lost", "failed", "cancelled", "rejected")]
    assert len(settled) == len(set(settled)), "a job was settled twice"
    assert len(issued) == c["issued"] and len(issued - set(settled)) == summary["outstanding"]
    evals = summary["evaluations"]
    assert evals[-1]["loss"] < evals[0]["loss"]
