"""A resumed server's restored workers get a grace that covers the worker's reconnect backoff
(issue 14, restart without loss): ps.core.config.restart_grace_s, from the protocol's backoff caps."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import algorithms
from protocol.messages import (
    HELLO_BACKOFF_MAX_S,
    HELLO_BACKOFF_S,
    LIVENESS_TIMEOUT_S,
    RECONNECT_IVL_MAX_S,
    RECONNECT_IVL_S,
    Hello,
    Ready,
)
from ps.core.commands import Send
from ps.core.config import CoreConfig, restart_grace_s
from ps.core.server_core import ServerCore
from tests.unit.test_core import D, jobs_in, reply_for
from worker.link import WorkerConfig


def restored(liveness=3.0, **cfg):
    """A core with w1 (holding job 0) and w2 (holding job 1), snapshotted and restored as a
    resumed server does, its clock rebased at t = 100."""
    alg = algorithms.build("asgd", {"lr": 0.1})
    core = ServerCore(alg, np.ones(D, np.float32), CoreConfig(liveness_timeout_s=liveness, run_id=7, **cfg))
    jobs = {}
    for wid in ("w1", "w2"):
        core.handle(wid, Hello(worker_id=wid, boot=1, credit=1, run_id=7), 0.0)
        jobs[wid] = jobs_in(core.handle(wid, Ready(credit=1), 0.0))[0][1]
    snap = core.snapshot()
    core2 = ServerCore.restore(algorithms.build("asgd", {"lr": 0.1}), snap, core.cfg, server_boot=2)
    core2.rebase_clock(100.0)
    return core2, jobs


def schedule(first: float, cap: float):
    """0, then first, 2 first, 4 first, ... capped at cap: the times of a doubling backoff."""
    t, step = 0.0, first
    while True:
        yield t
        t += step
        step = min(step * 2, cap)


def test_the_grace_is_the_liveness_timeout_plus_both_backoff_caps():
    assert restart_grace_s(3.0) == 3.0 + RECONNECT_IVL_MAX_S + HELLO_BACKOFF_MAX_S == 12.0
    assert CoreConfig(liveness_timeout_s=2.0).restart_grace == restart_grace_s(2.0)
    assert CoreConfig(restart_grace_s=20.0).restart_grace == 20.0
    assert CoreConfig(liveness_timeout_s=3.0, restart_grace_s=1.0).restart_grace == 3.0, "never below liveness"
    w = WorkerConfig(server="tcp://127.0.0.1:1")  # the reference worker uses the protocol's constants
    assert (w.backoff_s, w.backoff_max_s) == (HELLO_BACKOFF_S, HELLO_BACKOFF_MAX_S)


def test_the_grace_covers_the_reference_workers_worst_reconnect():
    """The worker reconnects on a fresh socket at 0 (after a silent server): libzmq tries to
    connect at 0, 0.1, 0.3, 0.7, ... (doubling to 5 s), the worker says hello at 0, 0.25, 0.75,
    1.75, ... (doubling to 4 s), and a hello goes through only once connected. For a server
    listening again at any S in the first minute: the hello arrives within the grace, and at
    some S later than a bare liveness timeout (what lost the jobs before)."""
    connects = list(itertools.takewhile(lambda t: t < 80, schedule(RECONNECT_IVL_S, RECONNECT_IVL_MAX_S)))
    hellos = list(itertools.takewhile(lambda t: t < 80, schedule(HELLO_BACKOFF_S, HELLO_BACKOFF_MAX_S)))
    waits = []
    for s in np.arange(0.0, 60.0, 0.01):
        c = next(t for t in connects if t >= s)
        waits.append(next(h for h in hellos if h >= c) - s)
    assert max(waits) > LIVENESS_TIMEOUT_S
    assert max(waits) <= RECONNECT_IVL_MAX_S + HELLO_BACKOFF_MAX_S < restart_grace_s(LIVENESS_TIMEOUT_S)


def test_a_restored_worker_is_kept_through_the_grace_and_its_job_applied():
    core, jobs = restored()
    assert core.next_deadline() == pytest.approx(100.0 + 12.0)
    assert core.on_tick(100.0 + 3.0 + 0.5) == [] and set(core.workers) == {"w1", "w2"}, \
        "not written off after a bare liveness timeout"
    j1 = jobs["w1"]
    core.handle("w1", Hello(worker_id="w1", boot=1, credit=1, busy=(j1.job_id,), seen=j1.job_id, run_id=7), 110.0)
    core.handle("w1", Ready(credit=1), 110.0)
    assert core.counters.lost == 0 and j1.job_id in core.ledger
    core.handle("w1", reply_for(j1), 110.5)
    assert core.counters.applied == 1 and j1.job_id not in core.ledger
    # w2 never came back: written off at the end of its grace, not before
    core.on_tick(100.0 + 12.0 - 0.01)
    assert "w2" in core.workers
    core.on_tick(100.0 + 12.0 + 0.01)
    assert "w2" not in core.workers and core.counters.lost == 1 and jobs["w2"].job_id not in core.ledger
    assert "w1" in core.workers, "w1 was heard from at 110.5: a liveness timeout from then"
    assert core.accounted()


def test_a_message_from_a_restored_worker_ends_its_grace():
    core, _ = restored()
    core.handle("w1", Hello(worker_id="w1", boot=1, credit=1, busy=(0,), seen=0, run_id=7), 101.0)
    core.on_tick(101.0 + 3.0 + 0.01)
    assert "w1" not in core.workers and "w2" in core.workers, "heard from at 101: the usual liveness timeout"


def test_the_resumed_event_names_the_boot_and_the_grace():
    core, _ = restored(liveness=2.0)
    (ev,) = [e for e in core.drain_events() if e["ev"] == "resumed"]
    assert ev == {"ev": "resumed", "boot": 2, "version": 0, "workers": 2, "outstanding": 2,
                  "grace_s": restart_grace_s(2.0), "t": 100.0}


def test_the_same_inputs_after_a_rebase_give_the_same_core():
    """Recovery and replay call rebase_clock with the journaled time and the run's config: the
    grace is a function of those alone, so both see the same expiries."""
    outs = []
    for _ in range(2):
        core, jobs = restored()
        trail = [core.on_tick(t) for t in (103.5, 111.0, 112.5)]
        outs.append((sorted(core.workers), core.counters.as_dict(), [len(c) for c in trail]))
    assert outs[0] == outs[1] and outs[0][0] == []


def restored_with_credit(await_hello: bool):
    """w1 and w2 of credit 2 each, two jobs each, restored at t = 100 (asgd)."""
    alg = algorithms.build("asgd", {"lr": 0.1})
    core = ServerCore(alg, np.ones(D, np.float32), CoreConfig(run_id=7, await_hello=await_hello))
    jobs = {}
    for wid in ("w1", "w2"):
        core.handle(wid, Hello(worker_id=wid, boot=1, credit=2, run_id=7), 0.0)
        jobs[wid] = [j for _, j in jobs_in(core.handle(wid, Ready(credit=2), 0.0))]
    core2 = ServerCore.restore(algorithms.build("asgd", {"lr": 0.1}), core.snapshot(), core.cfg, server_boot=2)
    core2.rebase_clock(100.0)
    return core2, jobs


@pytest.mark.parametrize("await_hello", [True, False])
def test_a_restored_worker_gets_no_job_and_no_cancel_before_its_hello(await_hello, monkeypatch):
    """PROTOCOL.md 8.11: a restored worker has no connection until its hello, so the server sends
    it nothing before (a send there fails, and used to write the worker off as unreachable). The
    algorithm cancels one of w1's jobs (settled, no ``cancel`` sent); w2 says hello and its reply
    is applied; w1, silent, is given nothing; after its hello it gets the credit the cancel freed.
    The control (a run of an earlier version, ``await_hello`` False) sends w1 both at once."""
    from ps.core.settlement import cancel_jobs

    core, jobs = restored_with_credit(await_hello)
    monkeypatch.setattr(type(core.alg), "cancel", lambda self, state, view: [jobs["w1"][0].job_id])
    out = cancel_jobs(core, 100.2)
    monkeypatch.undo()
    assert jobs["w1"][0].job_id not in core.ledger
    out += core.handle("w2", Hello(worker_id="w2", boot=1, credit=2, run_id=7, busy=(jobs["w2"][0].job_id,),
                                   seen=max(j.job_id for j in jobs["w2"])), 100.5)
    out += core.handle("w2", reply_for(jobs["w2"][0]), 100.6)
    sent_to_w1 = [type(c.msg).__name__ for c in out if isinstance(c, Send) and c.worker_id == "w1"]
    if not await_hello:
        assert sent_to_w1 == ["Cancel", "Job"], sent_to_w1
        return
    assert sent_to_w1 == [] and "w1" in core.workers
    out = core.handle("w1", Hello(worker_id="w1", boot=1, credit=2, run_id=7,
                                  busy=tuple(j.job_id for j in jobs["w1"]), seen=jobs["w1"][-1].job_id), 101.0)
    assert [w for w, _ in jobs_in(out)] == ["w1"], "after its hello w1 gets the credit its cancelled job freed"
