"""The inline reply's short path (worker/intake.py ``_run`` -> worker/replies.py ``_reply_now``)
against the general one (``_send_results``): the same messages in the same order, the short path
taken only when nothing is before the reply (outbox, unsent), the server has welcomed us and the
reply is in frames; and the iterate cache's eviction (its short path for unpinned oldest ids)
against the general loop."""

from __future__ import annotations

import select
import time

import numpy as np
import pytest

from problems.quadratic import make_quadratic
from protocol.messages import Job, JobKind, Reply
from worker.link import Worker, WorkerConfig
from worker.runner import INLINE_AFTER, INLINE_MAX_S, ComputeThread, DelaySpec, IterateCache

D = 8


def _worker(monkeypatch) -> tuple[Worker, list]:
    w = Worker(WorkerConfig(server="tcp://127.0.0.1:9", worker_id="w0", shm="off"))
    sent: list = []

    def record(msg) -> bool:
        sent.append(msg)
        return not getattr(w, "refuse", False)

    monkeypatch.setattr(w, "_send", record)
    w.compute = ComputeThread(lambda: make_quadratic(d=D), DelaySpec(), finish=w._finish)
    deadline = time.monotonic() + 30
    while not w.compute.outbox:  # the thread writes its wake-up pipe once the problem is loaded
        ready, _, _ = select.select([w.compute.wake_r], [], [], max(0.0, deadline - time.monotonic()))
        assert ready or w.compute.outbox, "the problem did not load within 30 s"
    w.compute.outbox.popleft()  # LOADED
    w.loaded = w.welcomed = True
    w.last_contact = w.clock()
    w.compute.recent_s.extend([INLINE_MAX_S / 10] * INLINE_AFTER)
    assert w.compute.can_inline()
    return w, sent


def _job(k: int) -> Job:
    return Job(job_id=k, kind=JobKind.GRAD, created_at=k, iterate_ids=(k,), seed=k, point_ids=(k,),
               points=(np.full(D, k, np.float32),))


def _old(k: int) -> Reply:
    return Reply(job_id=k, created_at=k, grads=(np.zeros(D, np.float32),), holds=())


@pytest.fixture
def worker(monkeypatch):
    w, sent = _worker(monkeypatch)
    try:
        yield w, sent
    finally:
        w.compute.close()
        w.ctx.term()


def test_the_common_case_replies_at_once_with_what_the_cache_holds(worker):
    w, sent = worker
    for k in range(1, 7):
        w._on_job(_job(k))
    assert [r.job_id for r in sent] == [1, 2, 3, 4, 5, 6] and w.replies_sent == 6 and not w.jobs
    assert sent[-1].holds == (2, 3, 4, 5, 6)  # sent before the eviction, as ever
    assert tuple(w.cache.items) == (3, 4, 5, 6)
    assert [r.job_id for _, r in w.recent] == [1, 2, 3, 4, 5, 6][-w.recent.maxlen:]
    assert w.compute.inline_jobs == 6 and not w.compute.outbox and not w.unsent


def test_an_unsent_reply_goes_first(worker):
    w, sent = worker
    w.unsent.append(_old(50))
    w._on_job(_job(1))
    assert [r.job_id for r in sent] == [50, 1] and not w.unsent and w.replies_sent == 2


def test_a_result_in_the_outbox_goes_first(worker):
    w, sent = worker
    w.jobs[40] = _job(40)
    w.compute.outbox.append((40, _old(40), None))
    w._on_job(_job(1))
    assert [r.job_id for r in sent] == [40, 1] and not w.compute.outbox


def test_not_welcomed_the_reply_waits_in_unsent(worker):
    w, sent = worker
    w.welcomed = False
    w._on_job(_job(1))
    assert sent == [] and [r.job_id for r in w.unsent] == [1] and w.replies_sent == 0


def test_a_reply_that_cannot_go_now_waits_in_unsent(worker):
    w, sent = worker
    w.refuse = True
    w._on_job(_job(1))
    assert [r.job_id for r in sent] == [1] and [r.job_id for r in w.unsent] == [1] and w.replies_sent == 0
    assert not w.recent


def test_a_failed_job_is_reported_by_the_general_path(worker):
    w, sent = worker
    job = Job(job_id=3, kind=JobKind.GRAD, created_at=3, iterate_ids=(3,), seed=3, point_ids=(3,),
              points=(np.ones(D + 1, np.float32),))  # the wrong size: the problem fails
    w._on_job(job)
    assert len(sent) == 1 and type(sent[0]).__name__ == "Error" and sent[0].job_id == 3 and w.replies_sent == 0


@pytest.mark.parametrize("pinned", [set(), {1}, {2}, {1, 2}, {1, 2, 3, 4, 5, 6}, {3, 1}])
def test_eviction_keeps_the_order_and_the_pinned_ids(pinned):
    def reference(items: list, capacity: int) -> list:
        out = list(items)
        for iid in items:
            if len(out) <= capacity:
                break
            if iid not in pinned:
                out.remove(iid)
        return out

    c = IterateCache(3)
    for i in range(1, 7):
        c.put(i, np.zeros(1))
    c.get(2)  # recently used: 1, 3, 4, 5, 6, 2
    before = list(c.items)
    c.evict(pinned)
    assert list(c.items) == reference(before, 3)


def test_a_job_whose_iterate_is_missing_waits_and_asks_for_it(worker):
    w, sent = worker
    w._on_job(_job(1))
    pair = Job(job_id=2, kind=JobKind.GRAD_PAIR, created_at=2, iterate_ids=(1, 7, 9), seed=2)
    w._on_job(pair)
    err = sent[-1]
    assert type(err).__name__ == "Error" and err.job_id == 2 and err.iterate_ids == (7, 9)
    assert w.waiting == {2: pair} and 2 in w.jobs and w.replies_sent == 1


def test_a_job_carrying_another_iterate_than_the_one_it_names_uses_the_cached_one(worker):
    w, sent = worker
    w._on_job(_job(1))
    job = Job(job_id=2, kind=JobKind.GRAD, created_at=2, iterate_ids=(1,), seed=2, point_ids=(2,),
              points=(np.full(D, 2, np.float32),))
    w._on_job(job)
    at_1 = make_quadratic(d=D).grad(np.full(D, 1, np.float32), 2, 1).grad
    assert [r.job_id for r in sent] == [1, 2] and np.array_equal(sent[-1].grads[0], at_1)
    assert tuple(w.cache.items) == (2, 1)  # 2 cached, then 1 used


def test_the_wire_dtype_is_checked_and_converted_on_the_general_path(worker):
    w, sent = worker
    w.wire = "f16"
    w._on_job(_job(1))  # float32 frames on an f16 run: refused, never cached
    assert sent == [] and not w.cache.items and not w.jobs
    half = Job(job_id=2, kind=JobKind.GRAD, created_at=2, iterate_ids=(2,), seed=2, point_ids=(2,),
               points=(np.full(D, 2, np.float16),))
    w._on_job(half)
    assert [r.job_id for r in sent] == [2] and w.cache.items[2].dtype == np.float32
