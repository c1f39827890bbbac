"""The job ledger: every issued job not yet settled (:class:`LedgerEntry`, by job id), the
indexed view of the outstanding ones that ``Algorithm.cancel`` gets (:class:`Outstanding`), the
settled job ids remembered to tell a late reply from an unknown one, the job id counter, and the
counters of the accounting identity (:class:`Counters`)::

    issued == applied + dropped + lost + failed + cancelled + rejected + outstanding

The ledger (``core.ledger``), its index (``core.jobs``), the closed ids (``core.closed``) and the
counter (``core.next_job_id``) are attributes of the core (the ``core`` argument below), as a
checkpoint sees it; the functions here keep them in step.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Iterator

from protocol.messages import JobKind

MAX_CLOSED_REMEMBERED = 65536  # settled job ids remembered to tell "late" from "unknown"
MAX_JOB_ID_SKIP = 1 << 20  # how far a rejoining worker's seen job ids may move the counter (skip_job_ids)


@dataclass(slots=True)
class LedgerEntry:
    job_id: int
    worker_id: str
    kind: JobKind
    created_at: int
    iterate_ids: tuple[int, ...]
    seed: int
    batch_size: int
    shard: tuple[int, int] | None
    deadline: int | None
    issued_at: float
    received: bool = False  # result buffered for the next round (round mode)
    resends: int = 0  # times re-sent after err MISSING_ITERATE


class Outstanding(Sequence):
    """The outstanding jobs that have no buffered result yet, in job-id order: what
    ``Algorithm.cancel`` receives (ledger entries: ``job_id``, ``created_at``, ``kind``,
    ``iterate_ids``, ``shard``, ...). A read-only view the core keeps in step with its ledger;
    valid during the call it is passed to.

    Iterating it (or indexing it) costs its length. The queries cost what they return
    (amortized), however many jobs are outstanding: :meth:`created_at_most`,
    :meth:`count_like`, :meth:`oldest_created_at`, :attr:`created_at_sum`. Built-in algorithms
    use them (``algorithms.base.jobs_created_at_most``); an algorithm that iterates instead still
    works, at a cost per update that grows with the jobs outstanding.
    """

    __slots__ = ("_ledger", "_received", "_groups", "_heap", "_in_heap", "_classes", "_created_sum", "_list")

    def __init__(self, ledger: dict[int, LedgerEntry]) -> None:
        self._ledger = ledger  # the core's ledger (received entries included)
        self._received = 0  # ledger entries whose result is buffered (round mode): not in this view
        self._groups: dict[int, dict[int, None]] = {}  # created_at -> job ids (ordered set)
        self._heap: list[int] = []  # created_at values of groups, a min-heap; emptied groups linger (lazy)
        self._in_heap: set[int] = set()
        self._classes: dict[tuple, int] = {}  # (created_at, kind, iterate_ids) -> how many
        self._created_sum = 0
        self._list: list[LedgerEntry] | None = None  # for indexing, built once per change
        for e in ledger.values():
            if e.received:
                self._received += 1
            else:
                self._add(e)

    # ---- the Sequence
    def __len__(self) -> int:
        return len(self._ledger) - self._received

    def __iter__(self) -> Iterator[LedgerEntry]:
        if not self._received:
            return iter(self._ledger.values())
        return (e for e in self._ledger.values() if not e.received)

    def __getitem__(self, i: int | slice) -> Any:
        if self._list is None:
            self._list = list(self)
        return self._list[i]

    # ---- indexed queries
    def created_at_most(self, created_at: int) -> list[int]:
        """Ids of the jobs created at version ``created_at`` or before, ascending."""
        self._prune()
        h, groups, out, todo = self._heap, self._groups, [], [0]
        n = len(h)
        while todo:  # the heap's nodes <= created_at form a subtree at its root
            i = todo.pop()
            if i < n and h[i] <= created_at:
                g = groups.get(h[i])
                if g:
                    out.extend(g)
                todo += (2 * i + 1, 2 * i + 2)
        out.sort()
        return out

    def count_like(self, created_at: int, kind: Any, iterate_ids: Sequence[int]) -> int:
        """How many jobs have exactly this ``created_at``, kind and iterate ids."""
        return self._classes.get((created_at, kind, tuple(iterate_ids)), 0)

    def oldest_created_at(self) -> int | None:
        """The smallest ``created_at`` among the jobs (None if there are none)."""
        self._prune()
        return self._heap[0] if self._heap else None

    @property
    def created_at_sum(self) -> int:
        """The sum of the jobs' ``created_at`` (their mean age is version - sum / len)."""
        return self._created_sum

    # ---- kept in step by the core (never by an algorithm)
    def _add(self, e: LedgerEntry) -> None:
        self._list = None
        c = e.created_at
        g = self._groups.get(c)
        if g is None:
            g = self._groups[c] = {}
            if c not in self._in_heap:
                heapq.heappush(self._heap, c)
                self._in_heap.add(c)
        g[e.job_id] = None
        ids = e.iterate_ids
        key = (c, e.kind, ids if type(ids) is tuple else tuple(ids))
        classes = self._classes
        classes[key] = classes.get(key, 0) + 1
        self._created_sum += c

    def _drop(self, e: LedgerEntry) -> None:
        self._list = None
        c = e.created_at
        g = self._groups[c]
        del g[e.job_id]
        if not g:
            del self._groups[c]
            if len(self._heap) > 2 * len(self._groups) + 32:  # mostly emptied groups: rebuild (amortized O(1))
                self._heap = list(self._groups)
                heapq.heapify(self._heap)
                self._in_heap = set(self._groups)
        ids = e.iterate_ids
        key = (c, e.kind, ids if type(ids) is tuple else tuple(ids))
        classes = self._classes
        left = classes[key] - 1
        if left:
            classes[key] = left
        else:
            del classes[key]
        self._created_sum -= c

    def _mark_received(self, e: LedgerEntry) -> None:
        self._drop(e)
        self._received += 1

    def _settled(self, e: LedgerEntry) -> None:
        if e.received:
            self._received -= 1
        else:
            self._drop(e)

    def _prune(self) -> None:
        h = self._heap
        while h and h[0] not in self._groups:
            self._in_heap.discard(heapq.heappop(h))


@dataclass(slots=True)
class Counters:
    issued: int = 0
    applied: int = 0
    dropped: int = 0
    lost: int = 0
    failed: int = 0  # the worker could not compute the job (err COMPUTE_FAILED)
    cancelled: int = 0
    rejected: int = 0  # a reply to an outstanding job that failed validation (job written off)
    late: int = 0  # reply to a job already settled (cancelled, lost, rejected, duplicate)
    unknown: int = 0  # reply to a job id never issued or not this worker's
    invalid: int = 0  # undecodable or out-of-place messages (counted by the driver too)
    updates: int = 0
    workers_joined: int = 0
    workers_lost: int = 0
    quarantined: int = 0
    refused: int = 0  # hellos refused (quarantined id, too many workers, wrong key)
    stray: int = 0  # heartbeats/ready from workers not (or no longer) known
    worker_errors: int = 0  # err messages from workers (a failed job, a cache miss, ...)
    missing_iterates: int = 0
    benched: int = 0  # times a worker was benched (max_failed_jobs failures in a row)

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}




def new_job_id(core: Any) -> int:
    """The next job id of ``core`` (a :class:`ps.core.server_core.ServerCore`), taken."""
    jid = core.next_job_id
    core.next_job_id += 1
    return jid


def add_entry(core: Any, entry: LedgerEntry) -> None:
    """A job issued: into the ledger and its index."""
    core.ledger[entry.job_id] = entry
    core.jobs._add(entry)


def mark_received(core: Any, entry: LedgerEntry) -> None:
    """Round mode: the job's result is buffered for the next round (still outstanding)."""
    entry.received = True
    core.jobs._mark_received(entry)


def close_entry(core: Any, entry: LedgerEntry, how: str) -> None:
    """Remove a job from the ledger and its index, and remember how it was settled (the latest
    ``MAX_CLOSED_REMEMBERED``: a reply to one of those is late, not unknown)."""
    del core.ledger[entry.job_id]
    core.jobs._settled(entry)
    core.closed[entry.job_id] = how
    if len(core.closed) > MAX_CLOSED_REMEMBERED:
        core.closed.popitem(last=False)


def skip_job_ids(core: Any, seen: int) -> None:
    """Job ids start past ``seen`` (the highest a rejoining worker of this run saw or holds),
    at most MAX_JOB_ID_SKIP ahead: after a restart the worker may have seen ids that this
    process, resumed from the journal's durable prefix, would issue again. The hello is
    journaled, so replay skips the same way."""
    if core.next_job_id <= seen < core.next_job_id + MAX_JOB_ID_SKIP:
        core.next_job_id = seen + 1
