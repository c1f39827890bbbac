"""The worker's compute side: an iterate cache, a delay model and a compute thread.

No sockets here (``worker/link.py`` owns the DEALER). The compute thread takes jobs from a
queue, runs :func:`worker.compute.compute_grads` (run_job's gradients), waits out the injected
delay (interruptible by a cancel), and hands the reply back through a queue plus one byte on a
pipe, which wakes the link's poll loop. Heartbeats therefore keep flowing during long computations.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from algorithms._pool import ArrayPool
from problems.base import Problem
from protocol.messages import MAX_LIST_LEN, Job, JobKind, Reply
from worker.compute import BadGradient, compute_grads

log = logging.getLogger("latecomer.worker")


@dataclass(frozen=True)
class DelaySpec:
    """Injected heterogeneity for experiments (``latecomer work --delay/--jitter/--slowdown``).

    A job then takes at least ``delay · cost(kind) · sample_cost + |N(0, jitter²)|`` seconds,
    and ``slowdown`` stretches the measured compute time by that factor. cost(GRAD)=1,
    cost(GRAD_PAIR)=2, cost(FULL_GRAD)=shard size / batch. ``data_dependent`` multiplies by the
    problem's ``sample_cost`` (e.g. κ for the slow class).
    """

    delay_s: float = 0.0
    jitter_s: float = 0.0
    slowdown: float = 1.0
    data_dependent: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("delay_s", "jitter_s"):
            v = getattr(self, name)
            if not (v >= 0 and np.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if not (self.slowdown >= 1 and np.isfinite(self.slowdown)):
            raise ValueError(f"slowdown must be >= 1, got {self.slowdown}")

    def extra_s(self, job: Job, compute_s: float, sample_cost: float, rng: np.random.Generator) -> float:
        if job.kind == JobKind.GRAD_PAIR:
            cost = 2.0
        elif job.kind == JobKind.FULL_GRAD and job.shard is not None:
            cost = (job.shard[1] - job.shard[0]) / max(1, job.batch_size)
        else:
            cost = 1.0
        if self.data_dependent:
            cost *= sample_cost
        extra = self.delay_s * cost + (self.slowdown - 1.0) * compute_s
        if self.jitter_s > 0:
            extra += abs(rng.normal(0.0, self.jitter_s))
        return extra


class IterateCache:
    """Iterates by id, least recently used evicted first; never evicts ids pinned by a job."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.items: OrderedDict[int, np.ndarray] = OrderedDict()

    def put(self, iid: int, x: np.ndarray) -> None:
        self.items[iid] = x
        self.items.move_to_end(iid)

    def get(self, iid: int) -> np.ndarray | None:
        x = self.items.get(iid)
        if x is not None:
            self.items.move_to_end(iid)
        return x

    def evict(self, pinned: set[int] | frozenset[int]) -> None:
        items, capacity = self.items, self.capacity
        while len(items) > capacity:  # the common case: the least recently used ids are not pinned
            iid, x = items.popitem(last=False)
            if iid in pinned:  # back in its place; the rest by the loop below
                items[iid] = x
                items.move_to_end(iid, last=False)
                break
        else:
            return
        for iid in list(items):
            if len(items) <= capacity:
                break
            if iid not in pinned:
                del items[iid]

    def ids(self) -> tuple[int, ...]:
        """What a hello, ready or reply says the worker holds: the most recently used ids, at most
        MAX_LIST_LEN (a protocol list; a larger ``--cache-size`` or many pinned ids hold more, and
        the server then merely sends again an iterate the worker has)."""
        ids = tuple(self.items)
        return ids if len(ids) <= MAX_LIST_LEN else ids[-MAX_LIST_LEN:]


def failure_text(exc: BaseException) -> str:
    """One line for a job that failed: ``"ValueError: boom"``; a :class:`BadGradient` (already
    one line naming the layout) as its text alone."""
    if isinstance(exc, BadGradient):
        return str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class FailureLog:
    """The worker's log of jobs it could not compute, without a flood.

    The first failure at each *place* (exception type and the file/line of every traceback
    frame) is logged with its traceback (a :class:`BadGradient` as one line: its traceback
    points into run_job, not at the problem); repeats are counted, and every ``every``-th
    failure logs one line with the running count. At most ``max_places`` places are told
    apart; beyond them every failure counts as a repeat.
    """

    def __init__(self, every: int = 100, max_places: int = 16) -> None:
        self.every = every
        self.max_places = max_places
        self.places: set[tuple] = set()
        self.count = 0
        self.lock = threading.Lock()  # the compute thread and the inline path both report

    def record(self, job_id: int, exc: BaseException) -> str:
        """Count (and maybe log) the failure of ``job_id``; returns its one-line text."""
        text = failure_text(exc)
        place = (type(exc).__qualname__,
                 tuple((f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__)))
        with self.lock:
            self.count += 1
            count, new = self.count, place not in self.places and len(self.places) < self.max_places
            if new:
                self.places.add(place)
        if new:
            log.error("job %d failed: %s", job_id, text, exc_info=None if isinstance(exc, BadGradient) else exc)
        elif count % self.every == 0:
            log.error("job %d failed: %s (%d jobs failed so far; each kind of failure is logged once with "
                      "its traceback)", job_id, text, count)
        return text


INLINE_AFTER = 8  # fast jobs in a row before the I/O thread computes them itself
INLINE_MAX_S = 0.005  # "fast": well under any heartbeat interval


class ComputeThread:
    """Runs jobs one at a time off the I/O thread."""

    LOAD_FAILED = -1  # outbox job id: the problem could not be loaded (error text follows)
    LOADED = -2  # outbox job id: the problem is loaded; the worker may say Ready

    def __init__(self, load: Callable[[], Problem], delay: DelaySpec,
                 finish: Callable[[Job, tuple], tuple[tuple, bool]] | None = None) -> None:
        self._load = load
        # finish(job, grads) -> (grads, in_shm): e.g. write the gradients into shared memory (same-host path)
        self.finish = finish
        # where the gradients of a problem that may write them again are copied (worker/compute.py):
        # a buffer comes back once no reply, frame or shared-memory resend holds it
        self.grad_pool = ArrayPool()
        self.pending = 0  # jobs submitted to the thread whose results are not in the outbox yet
        self.recent_s: deque[float] = deque(maxlen=INLINE_AFTER)
        self.inline_jobs = 0
        self.problem: Problem | None = None
        self.delay = delay
        self.no_delay = delay == DelaySpec(seed=delay.seed)  # nothing injected
        self.rng = np.random.default_rng(delay.seed)
        self.failures = FailureLog()
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: deque = deque()  # (job id, reply, error); appends and pops are atomic
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.cancelled: set[int] = set()
        self.current: int | None = None
        self.current_cancel = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="compute", daemon=True)
        self.thread.start()

    def submit(self, job: Job, points: tuple[np.ndarray, ...]) -> None:
        with self.lock:
            self.pending += 1
        self.inbox.put((job, points))

    def cancel(self, job_ids: set[int]) -> None:
        with self.lock:
            self.cancelled |= job_ids
            if self.current in job_ids:
                self.current_cancel.set()

    def stop(self) -> None:
        self.inbox.put(None)
        self.current_cancel.set()

    def drain_wakeups(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        self.stop()
        self.thread.join(timeout=5)
        for fd in (self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _loop(self) -> None:
        # Load the problem here, not on the I/O thread: importing torch and building data can take
        # seconds, and heartbeats must keep flowing meanwhile. Jobs queue up until it is done.
        try:
            self.problem = self._load()
        except Exception as e:  # reported to the link, which tells the server and stops the worker
            log.debug("the problem could not be loaded", exc_info=e)
            why = str(e) if isinstance(e, ValueError) and str(e) else failure_text(e)  # the loader's one line
            self.outbox.append((self.LOAD_FAILED, None, why))
            os.write(self.wake_w, b"x")
            return
        self.outbox.append((self.LOADED, None, None))
        os.write(self.wake_w, b"x")
        while True:
            item = self.inbox.get()
            if item is None:
                return
            job, points = item
            with self.lock:
                if job.job_id in self.cancelled:
                    self.cancelled.discard(job.job_id)
                    self.pending -= 1
                    continue
                self.current = job.job_id
                self.current_cancel.clear()
            reply, error = self._execute(job, points)
            with self.lock:
                self.current = None
                dropped = job.job_id in self.cancelled
                self.cancelled.discard(job.job_id)
            with self.lock:  # the result in the outbox, then pending == 0 (nothing more can come), together:
                if not dropped:  # the link, woken below, sees both, so its next job can take the inline path
                    self.outbox.append((job.job_id, reply, error))
                self.pending -= 1
            if not dropped:
                os.write(self.wake_w, b"x")

    def _execute(self, job: Job, points: tuple[np.ndarray, ...],
                 holds: tuple[int, ...] = ()) -> tuple[Reply | None, str | None]:
        t0 = time.perf_counter()
        try:
            grads, loss, count = compute_grads(job, points, self.problem, self.grad_pool.empty)
            in_shm = False
            if self.finish is not None:
                grads, in_shm = self.finish(job, grads)
        except Exception as e:  # a problem's bug must not kill the worker: the job fails, the server is told
            compute_s = time.perf_counter() - t0
            self.recent_s.append(compute_s)
            return None, self.failures.record(job.job_id, e)
        compute_s = time.perf_counter() - t0
        self.recent_s.append(compute_s)
        if not self.no_delay:
            cost = self.problem.sample_cost(job.seed, job.batch_size) if self.delay.data_dependent else 1.0
            extra = self.delay.extra_s(job, compute_s, cost, self.rng)
            if extra > 0:
                self.current_cancel.wait(extra)
            compute_s = time.perf_counter() - t0
        # The one Reply of this job (run_job's would be rebuilt for compute_s).
        return Reply(job_id=job.job_id, created_at=job.created_at, grads=grads, loss=loss, count=count,
                     compute_s=compute_s, holds=holds, in_shm=in_shm), None

    # ---------------------------------------------------------------- the inline fast path
    def can_inline(self) -> bool:
        """Run the next job on the I/O thread? Only when the compute thread is idle, no delay is
        injected, and the last INLINE_AFTER jobs each took under INLINE_MAX_S: then the thread
        hand-off (two wake-ups, a queue, a pipe) would cost more than the job, and heartbeats
        are late by at most a few ms. One slow job sends work back to the thread."""
        return (self.no_delay and self.pending == 0 and self.problem is not None
                and len(self.recent_s) == INLINE_AFTER and max(self.recent_s) < INLINE_MAX_S)

    def run_inline(self, job: Job, points: tuple[np.ndarray, ...], holds: tuple[int, ...] = ()) -> None:
        """Compute ``job`` now, on the caller's thread; the result goes to the outbox. ``holds``:
        the reply's (the link sends it at once, so it can say now what the cache holds then)."""
        reply, error = self.execute_inline(job, points, holds)
        self.outbox.append((job.job_id, reply, error))

    def execute_inline(self, job: Job, points: tuple[np.ndarray, ...],
                       holds: tuple[int, ...] = ()) -> tuple[Reply | None, str | None]:
        """:meth:`run_inline`'s result, returned instead of put in the outbox: ``(reply, None)``
        or ``(None, error text)``. The caller sends it or puts it in the outbox itself."""
        result = self._execute(job, points, holds)
        self.inline_jobs += 1
        return result
