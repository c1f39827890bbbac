"""Hypothesis: decoded but invalid messages never change the iterate, the algorithm state or the
version, whatever their fields, sender or order; each one is counted."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import algorithms
from algorithms.base import state_arrays_equal
from protocol.messages import Bye, Cancel, Error, ErrorCode, Hello, Job, JobKind, Ready, Reply, Welcome
from ps.core.commands import Send
from ps.core.config import CoreConfig
from ps.core.server_core import ServerCore

D = 6
ids = st.integers(0, 50)
senders = st.sampled_from(["w1", "w2", "ghost", "x" * 64])
bad_arrays = st.one_of(
    st.builds(lambda n: np.full(n, np.nan, np.float32), st.just(D)),
    st.builds(lambda n: np.full(n, np.inf, np.float32), st.just(D)),
    st.builds(lambda n: np.zeros(n, np.float32), st.integers(0, 2 * D).filter(lambda n: n != D)),
    st.builds(lambda: np.zeros((2, 3), np.float32)),
    st.builds(lambda: np.zeros(D, np.uint16)),
)
invalid_messages = st.one_of(
    # replies: wrong job ids, wrong created_at, bad gradients, wrong count, non-finite loss
    st.builds(Reply, job_id=st.integers(1000, 2000), created_at=ids, grads=st.lists(bad_arrays, max_size=2).map(tuple)),
    st.builds(Reply, job_id=ids, created_at=ids, grads=st.lists(bad_arrays, min_size=1, max_size=3).map(tuple)),
    st.builds(Reply, job_id=ids, created_at=st.integers(100, 200), grads=st.just((np.zeros(D, np.float32),))),
    st.builds(Reply, job_id=ids, created_at=ids, grads=st.just((np.zeros(D, np.float32),) * 3)),
    st.builds(Reply, job_id=ids, created_at=ids, grads=st.just((np.zeros(D, np.float32),)),
              loss=st.sampled_from([float("nan"), float("inf")])),
    # server-to-worker messages sent to the server
    st.builds(Job, job_id=ids, kind=st.sampled_from(JobKind), created_at=ids, iterate_ids=st.just((0,)), seed=ids),
    st.builds(Welcome, server_boot=ids, version=st.just(1), problem=st.just("quadratic")),
    st.builds(Cancel, job_ids=st.lists(ids, max_size=3).map(tuple)),
    st.builds(Error, code=st.sampled_from([c for c in ErrorCode if c != ErrorCode.MISSING_ITERATE]),
              job_id=st.none() | st.integers(1000, 2000)),
    # version ranges the server does not speak
    st.builds(Hello, worker_id=senders, boot=ids, credit=st.integers(1, 4), vmin=st.integers(2, 9),
              vmax=st.integers(9, 20)),
)


def fresh_core() -> tuple[ServerCore, list]:
    core = ServerCore(algorithms.build("ordered-momentum", {"lr": 0.1, "beta": 0.5}), np.ones(D, np.float32),
                      CoreConfig(max_bad_replies=0))
    sent = []
    for w in ("w1", "w2"):
        sent += core.handle(w, Hello(worker_id=w, boot=1, credit=2), 0.0)
        sent += core.handle(w, Ready(credit=2), 0.0)
    first = [c.msg for c in sent if isinstance(c, Send) and isinstance(c.msg, Job)]
    # one honest update so that the state is not trivial
    core.handle("w1", Reply(job_id=first[0].job_id, created_at=0, grads=(np.full(D, 0.5, np.float32),)), 0.1)
    return core, first


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(senders, invalid_messages), min_size=1, max_size=12))
def test_core_state_unchanged_by_invalid_messages(batch):
    core, _ = fresh_core()
    x0, v0 = core.params().copy(), core.version
    sd0 = core.alg.to_state_dict(core.state)
    before = core.counters.as_dict()
    for t, (sender, msg) in enumerate(batch):
        out = core.handle(sender, msg, 0.2 + t * 0.01)
        assert all(isinstance(c, Send) for c in out)
        assert np.array_equal(core.params(), x0) and core.version == v0
        assert state_arrays_equal(core.alg.to_state_dict(core.state), sd0)
        assert core.accounted()
    after = core.counters.as_dict()
    counted = sum(after[k] - before[k] for k in ("invalid", "unknown", "late", "rejected", "stray", "refused",
                                                 "worker_errors"))
    assert counted == len(batch), "every invalid message is counted exactly once"


def test_core_bye_from_a_stranger_changes_nothing():
    core, _ = fresh_core()
    workers = dict(core.workers)
    assert core.handle("ghost", Bye("x"), 1.0) == []
    assert core.workers.keys() == workers.keys()


def test_errs_naming_its_own_jobs_bench_a_worker_like_failures():
    """Amplification (issue 13): an ``err`` (any code but COMPUTE_FAILED and MISSING_ITERATE)
    naming a job the worker holds writes it off and frees the credit, which used to buy the next
    job, iterate and all, for every 50-byte err without bound. Such errs count toward the
    failures in a row: after max_failed_jobs (5) the worker is benched and gets no more jobs."""
    from protocol.messages import Error, ErrorCode
    from ps.core.config import CoreConfig
    from tests.unit.test_core import jobs_in, make_core

    core: ServerCore = make_core()
    assert CoreConfig().max_failed_jobs == 5
    job = jobs_in(join_one(core))[0][1]
    sent = 0
    for i in range(20):
        cmds = core.handle("w1", Error(ErrorCode.REFUSED, "no", job_id=job.job_id), 0.1 + i)
        nxt = jobs_in(cmds)
        if not nxt:
            break
        sent += 1
        job = nxt[0][1]
    assert sent == 4 and core.workers["w1"].benched, "5 errs, 4 new jobs, then benched"
    assert core.counters.lost == 5 and core.counters.failed == 0 and core.accounted()
    assert core.workers["w1"].last_error == "REFUSED: no"


def join_one(core):
    from protocol.messages import Hello, Ready

    core.handle("w1", Hello(worker_id="w1", boot=1, credit=1), 0.0)
    return core.handle("w1", Ready(credit=1), 0.0)
