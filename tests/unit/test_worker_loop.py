"""The worker's receive-compute-send path in one process: a test ROUTER over inproc plays the
server. Fast jobs go inline after a run of them, their replies say what the cache holds; the
link blocks in a receive only when nothing can come from the compute thread; the compute
thread's `pending` drops only after its result is in the outbox (what the link's choice between
receiving and polling relies on); compute_grads converts gradients as run_job always did. How
frames are sent and received: tests/unit/test_sockio.py."""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np
import pytest
import zmq

from problems.base import GradResult
from problems.quadratic import make_quadratic
from protocol.codec import decode, encode
from protocol.messages import Hello, Job, JobKind, Ready, Reply, Welcome
from worker.compute import compute_grads, run_job
from worker.link import Worker, WorkerConfig
from worker.runner import INLINE_AFTER, ComputeThread, DelaySpec

D = 8


def _recv(sock: zmq.Socket, timeout_s: float = 30.0) -> list:
    assert sock.poll(int(timeout_s * 1000)), "nothing received"
    return sock.recv_multipart()


def _recv_msg(router: zmq.Socket, want: type):
    """The next message of type ``want`` from the worker (heartbeats and others skipped)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rid, *frames = _recv(router)
        msg = decode(frames)
        if type(msg) is want:
            return rid, msg
    raise AssertionError(f"no {want.__name__} within 30 s")


def test_worker_replies_inline_and_from_the_thread_with_holds_and_blocks_only_when_idle(monkeypatch):
    # "fast" is 5 ms in production; a loaded CI machine can take longer for these tiny jobs, and this
    # test is about the two paths, not the machine's speed: any job counts as fast here.
    monkeypatch.setattr("worker.runner.INLINE_MAX_S", 10.0)
    n_jobs = 3 * INLINE_AFTER
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind("inproc://worker-loop")
    w = Worker(WorkerConfig(server="inproc://worker-loop", worker_id="w0", shm="off", max_jobs=n_jobs),
               load_problem=lambda spec, options, device: make_quadratic(d=D), context=ctx)
    blocked_with, threads = [], []
    receive_one = w._receive_one

    def watched_receive_one(timeout_ms: int) -> None:
        if w.compute is not None:  # what could still come from the compute thread
            blocked_with.append((w.compute.pending, len(w.compute.outbox)))
            threads.append(w.compute)
        receive_one(timeout_ms)

    w._receive_one = watched_receive_one
    result: list = []
    t = threading.Thread(target=lambda: result.append(w.run()), daemon=True)
    t.start()
    try:
        rid, hello = _recv_msg(router, Hello)
        router.send_multipart([rid, *encode(Welcome(server_boot=1, version=1, problem="quadratic", run_id=5,
                                                    heartbeat_interval_s=30.0, liveness_timeout_s=60.0))])
        _recv_msg(router, Ready)
        problem = make_quadratic(d=D)
        for k in range(1, n_jobs + 1):
            x = np.full(D, k, np.float32)
            job = Job(job_id=k, kind=JobKind.GRAD, created_at=k, iterate_ids=(k,), seed=k, point_ids=(k,),
                      points=(x,))
            router.send_multipart([rid, *encode(job)])
            _, reply = _recv_msg(router, Reply)
            assert reply.job_id == k and reply.compute_s > 0
            assert np.array_equal(reply.grads[0], run_job(job, (x,), problem).grads[0])
            # What the cache holds when the reply leaves: this job's iterate and the ones before it.
            assert reply.holds[-1] == k and len(reply.holds) >= min(k, 4), reply.holds
        t.join(timeout=30)
        assert result == [f"did {n_jobs} jobs"]
    finally:
        w.stopping = w.stopping or "test over"
        t.join(timeout=30)
        router.close(0)
        ctx.term()
    ct = threads[-1]
    assert 0 < ct.inline_jobs < n_jobs  # both paths ran: the thread first, then inline
    assert blocked_with and set(blocked_with) == {(0, 0)}  # never blocked with a job on the thread


class _Recording(deque):
    """An outbox that notes the compute thread's `pending` at each append."""

    def __init__(self, ct: ComputeThread) -> None:
        super().__init__()
        self.ct, self.pending_at_append = ct, []

    def append(self, item) -> None:
        self.pending_at_append.append(self.ct.pending)
        super().append(item)


def test_pending_drops_only_after_the_result_is_in_the_outbox():
    ct = ComputeThread(lambda: make_quadratic(d=D), DelaySpec())
    try:
        deadline = time.monotonic() + 30
        while not ct.outbox:  # LOADED
            assert time.monotonic() < deadline
            time.sleep(0.005)
        ct.outbox.popleft()
        ct.outbox = rec = _Recording(ct)
        x = np.ones(D, np.float32)
        for i in range(5):
            ct.submit(Job(job_id=i, kind=JobKind.GRAD, created_at=0, iterate_ids=(0,), seed=i), (x,))
        while len(rec) < 5 or ct.pending:
            assert time.monotonic() < deadline, (len(rec), ct.pending)
            time.sleep(0.005)
        assert len(rec.pending_at_append) == 5 and min(rec.pending_at_append) >= 1, rec.pending_at_append
    finally:
        ct.close()


class _Returns:
    """grad() returns the array ``make()`` builds."""

    layout = ()

    def __init__(self, make) -> None:
        self.make = make

    def grad(self, x, seed, batch_size):
        return GradResult(self.make(), 0.5)


@pytest.mark.parametrize("make", [lambda: np.arange(4, dtype=np.float64),
                                  lambda: np.arange(8, dtype=np.float32).reshape(4, 2)[:, 0] / 2,
                                  lambda: np.arange(4, dtype=">f4"),
                                  lambda: list(range(4))])
def test_compute_grads_makes_every_gradient_a_contiguous_float32_vector(make):
    job = Job(job_id=1, kind=JobKind.GRAD, created_at=0, iterate_ids=(0,), seed=1)
    (g,), loss, count = compute_grads(job, (np.zeros(4, np.float32),), _Returns(make))
    assert type(g) is np.ndarray and g.dtype == np.float32 and g.dtype.isnative and g.flags.c_contiguous
    assert np.array_equal(g, np.arange(4)) and (loss, count) == (0.5, 1)


def test_compute_grads_keeps_a_float32_vector_as_it_is_where_the_problem_says_it_is_fresh():
    """``fresh_gradients``: the problem never writes a returned array again, so no copy; without
    it the worker owns a copy (worker/compute.py)."""
    mine = np.arange(4, dtype=np.float32)
    job = Job(job_id=1, kind=JobKind.GRAD, created_at=0, iterate_ids=(0,), seed=1)
    fresh = _Returns(lambda: mine)
    fresh.fresh_gradients = True
    (g,), _, _ = compute_grads(job, (np.zeros(4, np.float32),), fresh)
    assert g is mine  # no copy
    (g,), _, _ = compute_grads(job, (np.zeros(4, np.float32),), _Returns(lambda: mine))
    assert g is not mine and np.array_equal(g, mine) and g.flags.owndata
