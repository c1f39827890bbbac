"""The worker table: one :class:`WorkerInfo` per joined worker (``core.workers``, in join order),
and the indexes kept in step with it so that no message costs a scan of the table: the workers
free to take a job (``core._free``: ready, not benched, credit left), those eligible
(``core._eligible``: ready, not benched; ``min_workers``), each worker's place in join order
(``core._seq``) and a liveness heap (``core._alive``: who was heard from longest ago).

The table and its indexes are attributes of the core (a :class:`ps.core.server_core.ServerCore`,
the ``core`` argument below), as a checkpoint sees it; the indexes are derived state, never in a
snapshot, rebuilt from the table (:func:`index_workers`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class WorkerInfo:
    worker_id: str
    boot: int
    credit: int
    device: str
    host_id: str
    joined_at: float
    last_seen: float
    holds: set[int] = field(default_factory=set)
    outstanding: set[int] = field(default_factory=set)
    jobs_done: int = 0
    compute_s: float = 0.0
    bad_in_a_row: int = 0
    key: str = ""
    ready: bool = False  # set by the worker's first Ready (its problem is loaded); no job before
    reconnecting: bool = False  # restored after a server restart: its next hello settles its jobs
    awaiting_hello: bool = False  # restored by a restart (not a pause): no connection until its hello
    failed: int = 0  # its jobs that failed (err COMPUTE_FAILED)
    failed_in_a_row: int = 0  # failed jobs since its last accepted reply
    last_error: str = ""  # the text of its latest COMPUTE_FAILED or PROBLEM_UNAVAILABLE
    benched: bool = False  # max_failed_jobs failures in a row: no more jobs until a hello or a success
    resends_in_a_row: int = 0  # jobs re-sent after err MISSING_ITERATE since its last accepted reply


def index_workers(core: Any) -> None:
    """Build the indexes of ``core.workers``. ``_alive``: a min-heap of (last_seen as pushed,
    seq, id), one entry per worker brought up to date lazily when it reaches the top
    (:func:`alive_top`)."""
    core._seq = {}
    core._next_seq = 0
    core._free = set()
    core._eligible = set()
    core._alive = []
    for w in core.workers.values():
        enter(core, w)


def grant(core: Any, credit: int) -> int:
    """The credit a worker gets when it asks for ``credit``: at most ``max_credit``."""
    return min(credit, core.cfg.max_credit)


def trusted_holds(core: Any, ids: Any) -> set[int]:
    """The iterates a worker says it caches that are this process's: ids up to our version."""
    v = core.version
    return {i for i in ids if i <= v}


def add(core: Any, w: WorkerInfo) -> None:
    """Put a new worker at the end of the table."""
    core.workers[w.worker_id] = w
    enter(core, w)


def enter(core: Any, w: WorkerInfo) -> None:
    """Index a worker just put at the end of ``workers``."""
    core._seq[w.worker_id] = core._next_seq
    core._next_seq += 1
    heapq.heappush(core._alive, (w.last_seen, core._seq[w.worker_id], w.worker_id))
    reindex(core, w)


def forget(core: Any, worker_id: str) -> WorkerInfo | None:
    """Take a worker out of the table and its indexes (None if it is not in it)."""
    w = core.workers.pop(worker_id, None)
    if w is None:
        return None
    reindex(core, w)  # out of the free and eligible sets
    del core._seq[worker_id]  # its liveness entry is dropped when it reaches the top
    return w


def reindex(core: Any, w: WorkerInfo) -> None:
    """Bring ``w``'s membership of the free and eligible sets up to date (after any change to
    its readiness, bench, credit or jobs)."""
    wid = w.worker_id
    if core.workers.get(wid) is not w:
        core._free.discard(wid)
        core._eligible.discard(wid)
        return
    if w.ready and not w.benched and not (w.awaiting_hello and core.cfg.await_hello):
        core._eligible.add(wid)
        if len(w.outstanding) < w.credit:
            core._free.add(wid)
            return
    else:
        core._eligible.discard(wid)
    core._free.discard(wid)


def seen(core: Any, w: WorkerInfo, now: float) -> None:
    """``w`` was heard from at ``now``. Its liveness entry is refreshed lazily, except when the
    driver's clock went back (an entry must never be later than the worker's last_seen)."""
    if now < w.last_seen:
        heapq.heappush(core._alive, (now, core._seq[w.worker_id], w.worker_id))
    w.last_seen = now


def alive_top(core: Any) -> WorkerInfo | None:
    """The worker heard from longest ago (None if none), its heap entry made exact.

    Entries are (last_seen when pushed, seq, id); a worker's actual last_seen is never
    earlier, so the top, once exact, is the minimum. Stale tops are dropped (worker gone) or
    pushed down to their actual time: each refresh stands for a message the worker sent, so
    the cost is O(log n) per message, amortized."""
    h = core._alive
    while h:
        t, seq, wid = h[0]
        w = core.workers.get(wid)
        if w is None or core._seq.get(wid) != seq or t > w.last_seen:
            heapq.heappop(h)  # gone, a former incarnation, or a duplicate left by a clock step back
        elif t < w.last_seen:
            heapq.heapreplace(h, (w.last_seen, seq, wid))
        else:
            return w
    return None


def expired(core: Any, now: float) -> list[str]:
    """The workers silent for longer than the liveness timeout at ``now``, in join order (as the
    table holds them); their liveness entries are taken off the heap."""
    timeout = core.cfg.liveness_timeout_s
    out: dict[str, int] = {}
    while (w := alive_top(core)) is not None and now - w.last_seen > timeout:
        heapq.heappop(core._alive)  # the rest were heard from later: not expired (subtraction is monotone)
        out[w.worker_id] = core._seq[w.worker_id]
    return sorted(out, key=out.__getitem__)


def free_in_join_order(core: Any) -> list[str]:
    """The free workers in join order (a pass costs the workers served, not those connected)."""
    return sorted(core._free, key=core._seq.__getitem__)


def rebase_liveness(core: Any, last_seen: float, restart: bool = True) -> None:
    """After a restart (or a pause): every worker was last seen at ``last_seen`` and is
    reconnecting; after a restart, it has no connection until its hello (``awaiting_hello``)."""
    for w in core.workers.values():
        w.last_seen = last_seen
        w.reconnecting = True
        w.awaiting_hello = w.awaiting_hello or restart
        reindex(core, w)  # cfg.await_hello: no job before its hello
    core._alive = [(last_seen, core._seq[wid], wid) for wid in core.workers]
    heapq.heapify(core._alive)
