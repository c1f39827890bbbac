"""The worker's compute side: short jobs move to the I/O thread only when that is safe."""

from __future__ import annotations

import time

import numpy as np
import pytest

from problems.base import GradResult, Problem
from problems.quadratic import make_quadratic
from protocol.messages import Job, JobKind
from worker.runner import INLINE_AFTER, INLINE_MAX_S, ComputeThread, DelaySpec


def job(i: int) -> Job:
    return Job(job_id=i, kind=JobKind.GRAD, created_at=0, iterate_ids=(0,), seed=i, batch_size=1)


def wait_outbox(ct: ComputeThread, n: int, timeout: float = 30.0) -> list:
    deadline = time.monotonic() + timeout
    while len(ct.outbox) < n:
        assert time.monotonic() < deadline, f"{len(ct.outbox)} of {n} results"
        time.sleep(0.005)
    return [ct.outbox.popleft() for _ in range(n)]


@pytest.fixture
def problem():
    return make_quadratic(d=8)


def test_short_jobs_go_inline_after_a_run_of_fast_ones_and_give_the_same_reply(problem):
    ct = ComputeThread(lambda: problem, DelaySpec())
    try:
        x = np.ones(8, np.float32)
        assert wait_outbox(ct, 1)[0][0] == ComputeThread.LOADED
        assert not ct.can_inline()  # no history yet
        threaded = []
        for i in range(INLINE_AFTER):
            ct.submit(job(i), (x,))
            threaded += wait_outbox(ct, 1)
        deadline = time.monotonic() + 10
        while ct.pending and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ct.pending == 0 and ct.can_inline()
        ct.run_inline(job(0), (x,))
        (jid, reply, err), = [ct.outbox.popleft()]
        assert jid == 0 and err is None and ct.inline_jobs == 1
        assert np.array_equal(reply.grads[0], threaded[0][1].grads[0])  # the same bits either way
        ct.submit(job(99), (x,))  # a job on the thread: no inline meanwhile
        assert ct.pending == 1 and not ct.can_inline()
        wait_outbox(ct, 1)
    finally:
        ct.close()


def test_no_inline_with_injected_delays_or_after_a_slow_job(problem):
    ct = ComputeThread(lambda: problem, DelaySpec(delay_s=0.001))
    try:
        x = np.ones(8, np.float32)
        wait_outbox(ct, 1)
        for i in range(INLINE_AFTER):
            ct.submit(job(i), (x,))
            wait_outbox(ct, 1)
        assert not ct.can_inline()  # delays are for experiments: they run on the thread
    finally:
        ct.close()
    ct = ComputeThread(lambda: problem, DelaySpec())
    try:
        wait_outbox(ct, 1)
        ct.recent_s.extend([INLINE_MAX_S / 10] * INLINE_AFTER)
        assert ct.can_inline()
        ct.recent_s.append(INLINE_MAX_S * 2)  # one slow job: back to the thread
        assert not ct.can_inline()
    finally:
        ct.close()


def test_a_cache_larger_than_a_protocol_list_reports_its_newest_ids_and_encodes():
    """--cache-size 300 (or many ids pinned by jobs): what a reply says the worker holds is at most
    MAX_LIST_LEN ids, the most recently used, so the reply still encodes (it used to raise
    LocalProtocolError and end the worker)."""
    from protocol.codec import encode
    from protocol.messages import MAX_LIST_LEN, Reply
    from worker.runner import IterateCache

    cache = IterateCache(300)
    for i in range(300):
        cache.put(i, np.zeros(2, np.float32))
    cache.get(5)  # used again: among the newest
    ids = cache.ids()
    assert len(ids) == MAX_LIST_LEN and ids[-1] == 5 and set(ids) == {5} | set(range(45, 300))
    encode(Reply(1, 0, (np.zeros(2, np.float32),), holds=ids))


class _Reusing(Problem):
    """A problem that writes every gradient (``seed + x[0]`` everywhere) into the buffer it returned
    last time, ``fresh_gradients`` not set (as for a user's problem that does not say), and the
    default ``grad_pair``."""

    layout = (("w", (6,)),)

    def __init__(self, dtype=np.float32, fresh: bool | None = None) -> None:
        self.g = np.empty(6, dtype)
        if fresh is not None:
            self.fresh_gradients = fresh

    def grad(self, x, seed, batch_size):
        self.g.fill(seed + x[0])
        return GradResult(self.g, 0.0)


def _counting_alloc(calls: list):
    def alloc(shape, dtype):
        calls.append(shape)
        return np.empty(shape, dtype)
    return alloc


def test_a_gradient_the_problem_may_write_again_is_copied_once_and_kept_as_computed():
    """The reply keeps its job's gradient (it may still wait in ZeroMQ's queue, or be kept for a
    resend) while the problem writes the next one into the same buffer; a pair gets two copies."""
    from worker.compute import compute_grads, run_job

    p, calls = _Reusing(), []
    x = np.zeros(6, np.float32)
    first, _, _ = compute_grads(job(3), (x,), p, _counting_alloc(calls))
    second, _, _ = compute_grads(job(4), (x,), p, _counting_alloc(calls))
    assert first[0] is not p.g and second[0] is not p.g and calls == [(6,), (6,)]
    assert np.all(first[0] == 3) and np.all(second[0] == 4) and np.all(p.g == 4)
    pair = Job(job_id=5, kind=JobKind.GRAD_PAIR, created_at=0, iterate_ids=(0, 1), seed=7, batch_size=1)
    a, b = compute_grads(pair, (x, x + 1), p)[0]
    assert np.all(a == 7) and np.all(b == 8), "the default grad_pair keeps the first before the second is written"
    kept = run_job(job(9), (x,), p)  # the simulator's path: its core may keep the array
    compute_grads(job(10), (x,), p)
    assert np.all(kept.grads[0] == 9)


def test_a_fresh_or_converted_gradient_is_not_copied():
    """``fresh_gradients = True`` (the built-in problems, TorchProblem): the problem's array as
    is. A float64 gradient: its float32 conversion is a new array already, no second copy."""
    from worker.compute import compute_grads

    x = np.zeros(6, np.float32)
    calls: list = []
    fresh = _Reusing(fresh=True)
    g, _, _ = compute_grads(job(1), (x,), fresh, _counting_alloc(calls))
    assert g[0] is fresh.g and calls == []
    wide = _Reusing(np.float64)
    g, _, _ = compute_grads(job(2), (x,), wide, _counting_alloc(calls))
    assert g[0].dtype == np.float32 and g[0].flags.owndata and calls == []
    compute_grads(job(3), (x,), wide)
    assert np.all(g[0] == 2)
    from problems.quadratic import make_quadratic as mq
    from problems.synthetic import make_synthetic

    assert make_synthetic(4).fresh_gradients and mq(d=4).fresh_gradients


def test_the_compute_thread_copies_into_its_pool_and_reuses_a_buffer_nobody_holds():
    """Copies come from the compute side's pool: a buffer comes back only once the reply that
    held it is gone, so the kept reply is never written over."""
    p = _Reusing()
    p.g = np.empty(100_000, np.float32)  # pooled size (>= 256 KiB)
    p.layout = (("w", (100_000,)),)
    ct = ComputeThread(lambda: p, DelaySpec())
    try:
        x = np.zeros(100_000, np.float32)
        assert wait_outbox(ct, 1)[0][0] == ComputeThread.LOADED
        ct.submit(job(1), (x,))
        (_, kept, _), = wait_outbox(ct, 1)
        ct.submit(job(2), (x,))
        (_, nxt, _), = wait_outbox(ct, 1)
        assert np.all(kept.grads[0] == 1) and np.all(nxt.grads[0] == 2)
        assert ct.grad_pool.size() == 2 and ct.grad_pool.allocated == 2
        del kept, nxt
        ct.submit(job(3), (x,))
        wait_outbox(ct, 1)
        assert ct.grad_pool.allocated == 2, "a buffer no reply holds is used again"
    finally:
        ct.close()
