"""A frozen worker (SIGSTOP: no FIN, no heartbeat, its TCP connection stays up) is declared dead by
the liveness timeout, training goes on without it, and after SIGCONT its late reply to the job that
was written off is counted as late (never applied) and it rejoins by itself.

Two timings of the late reply, because they take different paths through worker and server:

* ``due_at_thaw``: a short job (0.2 s) frozen in the middle; its injected delay runs out while the
  process is stopped, so the reply is ready the instant the worker thaws, before the worker has
  noticed that the server forgot it.
* ``due_after_rejoin``: a long job (2.5 s) frozen right after it was issued; the reply is ready only
  after the thawed worker has said hello again.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.integration.util import read_events, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

LIVENESS_S = 1.5
SETTLED = ("applied", "dropped", "lost", "failed", "cancelled", "rejected")


def applied_by(events, wid):
    return sum(1 for e in events if e["ev"] == "applied" and e["worker_id"] == wid)


def outstanding_of(events, wid):
    """Job ids issued to ``wid`` and not settled yet, according to the event log."""
    issued = [e["job_id"] for e in events if e["ev"] == "issued" and e["worker_id"] == wid]
    settled = {e["job_id"] for e in events if e["ev"] in SETTLED}
    return [j for j in issued if j not in settled]


def story(events, wid, since=0):
    """What happened to ``wid`` from event index ``since`` on, compactly (for failure messages)."""
    keep = ("joined", "ready", "lost", "left", "late", "applied", "issued", "worker_error", "rejected")
    return [(e["ev"], e.get("job_id"), e.get("reason", e.get("was"))) for e in events[since:]
            if e.get("worker_id") == wid and e["ev"] in keep][:40]


@pytest.mark.parametrize("victim_delay", [pytest.param(0.2, id="due_at_thaw"),
                                          pytest.param(2.5, id="due_after_rejoin")])
def test_frozen_worker_is_declared_dead_its_late_reply_is_not_applied_and_it_rejoins(procs, tmp_path,
                                                                                     victim_delay):
    events = str(tmp_path / "events.jsonl")
    out = str(tmp_path / "out")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--problem-opt", "d=64",
                         "--algorithm", "asgd", "--set", "lr=0.1", "--batch-size", "1", "--max-time", "120",
                         "--liveness-timeout", str(LIVENESS_S), "--heartbeat-interval", "0.25", "--min-workers", "3",
                         "--events", events, "--out", out, "--eval-every", "50", "--log-level", "warning")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    workers = {w: procs.start("work", "--server", endpoint, "--worker-id", w, "--delay", str(d))
               for w, d in (("w1", 0.01), ("w2", victim_delay), ("w3", 0.02))}
    wait_events(events, lambda ev: all(applied_by(ev, w) >= (1 if w == "w2" else 3) for w in workers), timeout=60)
    # Freeze w2 just after it was handed a job, so that job is in the middle of being computed.
    n = len(read_events(events))
    wait_events(events, lambda ev: any(e["ev"] == "issued" and e["worker_id"] == "w2" for e in ev[n:]),
                timeout=victim_delay + 10, poll_s=0.01)

    victim = workers["w2"]
    victim.send_signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        left = wait_events(events, lambda ev: [e for e in ev if e["ev"] == "left" and e["worker_id"] == "w2"],
                           timeout=LIVENESS_S + 5, poll_s=0.01)
        detected_s = time.monotonic() - frozen_at
        ev = read_events(events)
        lost = [e for e in ev if e["ev"] == "lost" and e["worker_id"] == "w2"]
        assert left[0]["reason"] == "timeout", story(ev, "w2")
        assert detected_s <= LIVENESS_S + 1.0, f"frozen worker declared dead {detected_s:.2f} s after the freeze"
        # credit 1: it held exactly one job, written off as lost because of the timeout
        assert len(lost) == 1 and lost[0]["reason"] == "timeout" and left[0]["lost"] == 1, story(ev, "w2")
        old_jobs = {e["job_id"] for e in lost}
        assert not outstanding_of(ev, "w2"), story(ev, "w2")
        n_dead = ev.index(left[0])
        # training goes on with the other two while w2 is still frozen
        wait_events(events, lambda ev: applied_by(ev[n_dead:], "w1") >= 10 and applied_by(ev[n_dead:], "w3") >= 5,
                    timeout=30)
        assert victim.poll() is None, "the frozen worker must still be there"
    finally:
        victim.send_signal(signal.SIGCONT)
    thawed_at = time.monotonic()
    print(f"\nfreeze ({victim_delay} s jobs): declared dead {detected_s:.2f} s after SIGSTOP "
          f"(liveness timeout {LIVENESS_S} s); SIGCONT after {thawed_at - frozen_at:.2f} s")

    # It rejoins by itself: a new join and ready, then replies to new jobs are applied.
    def rejoined(ev):
        kinds = [e["ev"] for e in ev[n_dead + 1:] if e.get("worker_id") == "w2"]
        return "joined" in kinds and "ready" in kinds[kinds.index("joined"):] \
            and any(e["ev"] == "applied" and e["worker_id"] == "w2" and e["job_id"] not in old_jobs
                    for e in ev[n_dead + 1:])

    try:
        wait_events(events, rejoined, timeout=30 + 2 * victim_delay)
    except TimeoutError as e:
        raise AssertionError(f"w2 did not rejoin after SIGCONT: {story(read_events(events), 'w2', n_dead)}") from e
    print(f"freeze ({victim_delay} s jobs): rejoined and a new reply applied {time.monotonic() - thawed_at:.2f} s "
          f"after SIGCONT")

    server.send_signal(signal.SIGTERM)
    assert wait_exit(server, timeout=30) == 0
    ev = read_events(events)
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    c = summary["counters"]

    # The reply to the written-off job was not applied, and was counted as late.
    assert not [e for e in ev if e["ev"] in ("applied", "dropped") and e["job_id"] in old_jobs], story(ev, "w2")
    late = [e for e in ev if e["ev"] == "late" and e["worker_id"] == "w2"]
    assert c["late"] >= 1 or late, (
        f"the thawed worker's reply to job {sorted(old_jobs)} was not counted as late: late={c['late']} "
        f"invalid={c['invalid']} unknown={c['unknown']}; w2 after the timeout: {story(ev, 'w2', n_dead)[:8]}")
    assert {e["job_id"] for e in late} <= old_jobs, late
    assert [e["ev"] for e in ev if e["ev"] == "joined" and e["worker_id"] == "w2"] == ["joined", "joined"]
    assert c["workers_lost"] == 1

    # Every job is accounted for.
    assert c["issued"] == c["applied"] + c["dropped"] + c["lost"] + c["failed"] + c["cancelled"] + c["rejected"] \
        + summary["outstanding"]
    issued = {e["job_id"] for e in ev if e["ev"] == "issued"}
    settled = [e["job_id"] for e in ev if e["ev"] in SETTLED]
    assert len(settled) == len(set(settled)), "a job was settled twice"
    assert len(issued) == c["issued"] and len(issued - set(settled)) == summary["outstanding"]
    evals = summary["evaluations"]
    assert evals[-1]["loss"] < evals[0]["loss"]
