"""The worker's compute side: short jobs move to the I/O thread only when that is safe."""

from __future__ import annotations

import time

import numpy as np
import pytest

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
