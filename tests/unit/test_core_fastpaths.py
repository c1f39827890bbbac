"""The core's shortcuts for the common case, each beside the general path it stands for: the
version read without the algorithm's call, the calls of Algorithm's do-nothing hooks left out
(cancel, on_issued, live_iterate_ids), a job of one iterate id, the liveness heap's exact top,
A1's checked step of one reply. Each test fails if the shortcut's condition is wrong."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import algorithms
from algorithms._common import IterateState, sgd_step_checked, sgd_steps
from algorithms.base import NonFiniteGradient, Result
from algorithms.baselines import VanillaASGD
from protocol.messages import Cancel, Heartbeat, Hello, Job, JobKind, Ready, Reply
from ps.core.commands import Send
from ps.core.config import CoreConfig
from ps.core.dispatch import job_message
from ps.core.ledger import LedgerEntry
from ps.core.server_core import ServerCore

D = 4


def core_of(alg, **cfg) -> ServerCore:
    cfg.setdefault("liveness_timeout_s", 3.0)
    return ServerCore(alg, np.ones(D, np.float32), CoreConfig(**cfg))


def join(core: ServerCore, wid: str, credit: int = 1, now: float = 0.0) -> list:
    cmds = core.handle(wid, Hello(worker_id=wid, boot=1, credit=credit), now)
    return cmds + core.handle(wid, Ready(credit=credit), now)


def jobs_in(cmds) -> list[Job]:
    return [c.msg for c in cmds if isinstance(c, Send) and isinstance(c.msg, Job)]


def answer(core: ServerCore, wid: str, job: Job, now: float, value: float = 0.25) -> list:
    return core.handle(wid, Reply(job_id=job.job_id, created_at=job.created_at,
                                  grads=tuple(np.full(D, value, np.float32) for _ in job.iterate_ids)), now)


# ---------------------------------------------------------------- version
@dataclasses.dataclass(frozen=True)
class Offset(VanillaASGD):
    """A1 whose version is not its state's: the core must ask it."""

    def version(self, state):
        return np.int64(state.version + 1000)


def test_version_asks_an_algorithm_that_overrides_it():
    core = core_of(Offset(lr=0.1))
    assert core.version == 1000 and type(core.version) is int
    job = jobs_in(join(core, "w1"))[0]
    answer(core, "w1", job, 0.1)
    assert core.version == 1001 and core.counters.updates == 1


def test_version_follows_the_algorithm_the_core_holds_now():
    core = core_of(algorithms.build("asgd", {"lr": 0.1}))
    assert core.version == 0
    core.alg = Offset(lr=0.1)  # not the one it was built with: no shortcut for it
    assert core.version == 1000


def test_version_of_a_duck_typed_algorithm():
    class Wrap:
        def __init__(self, alg):
            self._alg = alg

        def __getattr__(self, name):
            return getattr(self._alg, name)

    core = core_of(Wrap(Offset(lr=0.1)))
    assert core.version == 1000


# ---------------------------------------------------------------- Algorithm's do-nothing hooks
@dataclasses.dataclass(frozen=True)
class Hooks(VanillaASGD):
    """A1 that cancels every other outstanding job, records the ids it is told and keeps
    iterate 0 in the store."""

    def cancel(self, state, outstanding):
        return [e.job_id for e in outstanding if e.job_id % 2 == 1]

    def on_issued(self, state, job_id, spec):
        ISSUED.append(job_id)
        return state

    def live_iterate_ids(self, state):
        return {0}


ISSUED: list[int] = []


def test_overridden_hooks_are_called():
    ISSUED.clear()
    core = core_of(Hooks(lr=0.1))
    jobs = jobs_in(join(core, "w1", credit=2))
    assert ISSUED == [j.job_id for j in jobs] == [0, 1]
    cmds = answer(core, "w1", jobs[0], 0.1)
    assert [c.msg.job_ids for c in cmds if isinstance(c.msg, Cancel)] == [(1,)]
    assert core.counters.cancelled == 1 and core.accounted()
    assert ISSUED == [0, 1, 2, 3] and 0 in core.store  # iterate 0 unreferenced, kept: the algorithm needs it


def test_plain_hooks_leave_the_store_and_ledger_as_before():
    core = core_of(algorithms.build("asgd", {"lr": 0.1}))
    jobs = jobs_in(join(core, "w1", credit=2))
    answer(core, "w1", jobs[0], 0.1)
    answer(core, "w1", jobs[1], 0.2)
    assert core.counters.cancelled == 0 and 0 not in core.store and core.accounted()
    assert not core.workers["w1"].outstanding.intersection({0, 1})


# ---------------------------------------------------------------- a job's points
def entry_of(ids) -> LedgerEntry:
    return LedgerEntry(job_id=7, worker_id="w1", kind=JobKind.GRAD_PAIR if len(ids) > 1 else JobKind.GRAD,
                       created_at=max(ids), iterate_ids=tuple(ids), seed=1, batch_size=1, shard=None,
                       deadline=None, issued_at=0.0)


@pytest.mark.parametrize("ids,holds,missing", [
    ((3,), set(), (3,)), ((3,), {3}, ()), ((3,), {1, 2}, (3,)),
    ((3, 1), {1}, (3,)), ((3, 1), set(), (3, 1)), ((3, 3), set(), (3,)), ((3, 1), {1, 3}, ())])
def test_job_message_sends_the_points_the_worker_lacks(ids, holds, missing):
    core = core_of(algorithms.build("asgd", {"lr": 0.1}))
    join(core, "w1")
    w = core.workers["w1"]
    for i in ids:
        core.store[i] = np.full(D, i, np.float32)
    w.holds = set(holds)
    job = job_message(core, entry_of(ids), w)
    assert job.point_ids == missing and type(job.point_ids) is tuple and type(job.points) is tuple
    assert [p[0] for p in job.points] == list(missing)
    assert job.iterate_ids == tuple(ids) and w.holds == set(holds) | set(ids)


# ---------------------------------------------------------------- the liveness deadline
def deadline_by_scan(core: ServerCore) -> float:
    t = core.next_round_at
    for w in core.workers.values():
        t = min(t, w.last_seen + core.cfg.liveness_timeout_s)
    return t


def test_next_deadline_is_the_oldest_worker_s_whatever_the_heap_holds():
    rng = np.random.default_rng(3)
    core = core_of(algorithms.build("asgd", {"lr": 0.1}), liveness_timeout_s=5.0)
    assert core.next_deadline() == math.inf
    now = 0.0
    for i in range(6):
        join(core, f"w{i}", now=now)
    for _ in range(400):
        wid = f"w{rng.integers(6)}"
        step = float(rng.choice([0.0, 0.5, -0.3]))  # ties, and the clock stepping back
        now = max(0.0, now + step)
        if wid in core.workers:
            core.handle(wid, Heartbeat(boot=1, credit=1, busy=tuple(core.workers[wid].outstanding)), now)
        else:
            join(core, wid, now=now)
        if rng.random() < 0.05:
            core.remove_worker(f"w{rng.integers(6)}", now, reason="bye")
        assert core.next_deadline() == deadline_by_scan(core)
        assert core.next_deadline() == deadline_by_scan(core)  # the second call finds the top exact


# ---------------------------------------------------------------- A1's checked step
def result(g, created_at=0, job_id=5) -> Result:
    return Result(job_id=job_id, worker_id="w1", created_at=created_at, kind=JobKind.GRAD,
                  iterate_ids=(created_at,), grads=(g,))


@pytest.mark.parametrize("squares", [False, True])
@pytest.mark.parametrize("value", [0.5, np.nan, np.inf, 3e19])
def test_sgd_step_checked_is_sgd_steps_of_one(squares, value):
    x = np.linspace(-1, 1, 9, dtype=np.float32)
    g = np.arange(9, dtype=np.float32)
    g[4] = value
    a, b = IterateState(version=3, x=x), IterateState(version=3, x=x)
    try:
        want = sgd_steps(a, [result(g, 1)], 0.1, checked=True, squares=squares)
    except NonFiniteGradient as e:
        with pytest.raises(NonFiniteGradient, match=str(e)):
            sgd_step_checked(b, result(g, 1), 0.1, squares)
        assert b.version == 3 and b.x is x
        return
    got = sgd_step_checked(b, result(g, 1), 0.1, squares)
    assert got == want and (b.version, b.x.tobytes()) == (a.version, a.x.tobytes()) == (4, b.x.tobytes())
    assert not b.x.flags.writeable
