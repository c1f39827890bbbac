"""ServerCore: the sans-I/O heart of the parameter server.

It owns the worker table, the job ledger (every issued job with its creation step), the
iterate store and the algorithm state. It takes decoded messages and the current time
``now`` as arguments and returns commands for its driver (the ZeroMQ daemon or the
simulator) to carry out. No sockets, no clock, no threads: the same object runs in
production and in the deterministic simulator, and a run can be replayed exactly.

Accounting invariant, checked by the tests at every step::

    issued == applied + dropped + lost + failed + cancelled + rejected + outstanding

where ``outstanding`` counts jobs issued and not yet settled (including results received
and buffered for the next round of a round-based algorithm), ``failed`` the jobs a worker
could not compute (``err COMPUTE_FAILED``) and ``lost`` those written off without an answer.

Cost per message. Nothing the core does for one message scans the worker table or the job
ledger: free workers (ready, not benched, credit left) are an index kept in step with every
change, liveness deadlines a heap with lazy refresh, the iterate store's sweep looks only at
iterates whose last reference just went, and ``Algorithm.cancel`` gets an indexed view of the
outstanding jobs (:class:`Outstanding`). What remains proportional is proportional to what
the message itself carries or settles (a heartbeat's busy list, a worker's own jobs when it is
written off), so 10,000 connected workers or 40,000 hoarded jobs cost a reply no more than 10.
A worker holds at most ``CoreConfig.max_credit`` jobs, whatever credit it asks for.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np

from algorithms._pool import finite
from algorithms.base import Algorithm, JobSpec, NonFiniteGradient, Result
from protocol.messages import (
    HEARTBEAT_INTERVAL_S,
    HELLO_BACKOFF_MAX_S,
    LIVENESS_TIMEOUT_S,
    PROTOCOL_VERSION,
    PROTOCOL_VERSION_MIN,
    RECONNECT_IVL_MAX_S,
    Bye,
    Cancel,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Job,
    JobKind,
    Ready,
    Reply,
    Welcome,
)

MAX_CLOSED_REMEMBERED = 65536  # settled job ids remembered to tell "late" from "unknown"
MAX_CREDIT = 64  # jobs one worker may hold at once, whatever credit it asks for (`latecomer work --credit` <= 64)
MAX_JOB_ID_SKIP = 1 << 20  # how far a rejoining worker's seen job ids may move the counter (_skip_job_ids)


EVICTED_KEPT = 4096  # iterate ids swept from the store that the core remembers (EvictionCursor)


class EvictionCursor:
    """What a driver keeps beside the core's store (shared-memory copies, wire-dtype copies of
    iterates) learns which iterates left the store from this, not by looking at each of its own:
    :meth:`take` answers the ids swept since its last call. With thousands of jobs outstanding the
    store holds thousands of iterates; a scan of every copy after each batch of messages was the
    biggest single cost of a server under 4,000 heartbeating fakes (13 % of its loop)."""

    def __init__(self) -> None:
        self.core: Any = None
        self.mark = 0

    def take(self, core: Any) -> list[int] | None:
        """The iterate ids ``core`` swept from its store since the last call; None where that is
        not known (the first call, another core object, or more swept than it keeps): look at all."""
        n = core.evictions - self.mark
        known = core is self.core and n <= len(core.evicted)
        self.core, self.mark = core, core.evictions
        if not known:
            return None
        return [core.evicted[-i] for i in range(1, n + 1)] if n else []


# --------------------------------------------------------------------------- commands

@dataclass(frozen=True, slots=True)
class Send:
    """Send ``msg`` to ``worker_id``."""

    worker_id: str
    msg: Any


@dataclass(frozen=True, slots=True)
class Disconnect:
    """Forget this worker at the transport level (quarantine); a Bye was already queued."""

    worker_id: str
    reason: str


Command = Send | Disconnect


# --------------------------------------------------------------------------- checkpoint columns

def _ints(values: list, types: set) -> np.ndarray | None:
    """``values`` as int64 when each is an int (or an int subclass, not a bool) within int64."""
    if not all(issubclass(t, int) and t is not bool for t in types):
        return None
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:  # past int64 either way
        return None


def _column(values: list) -> Any:
    """One field of many rows, packed for a checkpoint: an array when every value is an int,
    float or bool of one kind, a count for Nones, flat ints and lengths for tuples or sets of
    ints, distinct strings and indexes for strings; else the list itself. ``_uncolumn`` inverts it
    exactly. The kinds are told apart by the set of the values' types (one C pass), not by a test
    per value: a checkpoint of 25,600 ledger entries took 106 ms that way, which the loop waits."""
    if not values:
        return list(values)
    types = set(map(type, values))
    if types == {type(None)}:
        return {"nones": len(values)}
    if types == {bool}:
        return np.array(values, dtype=np.bool_)
    ints = _ints(values, types)
    if ints is not None:
        return ints
    if types == {float}:
        return np.array(values, dtype=np.float64)
    if types == {str}:
        distinct = list(dict.fromkeys(values))
        at = {s: i for i, s in enumerate(distinct)}
        return {"strs": distinct, "idx": np.array([at[v] for v in values], dtype=np.int64)}
    if types == {tuple} or types == {set}:
        kind = next(iter(types))
        flat = [x for v in values for x in (sorted(v) if kind is set else v)]
        packed = _ints(flat, set(map(type, flat))) if flat else np.array(flat, dtype=np.int64)
        if packed is not None:
            return {"ints": kind.__name__, "flat": packed, "lens": np.array(list(map(len, values)), dtype=np.int64)}
    return list(values)


def _uncolumn(c: Any) -> list:
    if isinstance(c, np.ndarray):
        return c.tolist()  # Python ints, floats and bools, bit for bit
    if isinstance(c, dict) and "nones" in c:
        return [None] * c["nones"]
    if isinstance(c, dict) and "strs" in c:
        return [c["strs"][i] for i in c["idx"].tolist()]
    if isinstance(c, dict) and "ints" in c:
        make = tuple if c["ints"] == "tuple" else set
        flat, out, at = c["flat"].tolist(), [], 0
        for n in c["lens"].tolist():
            out.append(make(flat[at:at + n]))
            at += n
        return out
    return list(c)


def _table(rows: Iterable[Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """Rows of a slotted dataclass as columns: a checkpoint of 40,000 ledger entries is then a
    few arrays, not 40,000 dicts for the serializer to walk."""
    rows = list(rows)
    return {"rows": len(rows), "columns": {f: _column(list(map(operator.attrgetter(f), rows))) for f in fields}}


def _untable(t: Any) -> list[dict[str, Any]]:
    """The rows of :func:`_table` as dicts; a list (a format-1 checkpoint) as it is."""
    if isinstance(t, list):
        return t
    cols = {f: _uncolumn(c) for f, c in t["columns"].items()}
    return [{f: v[i] for f, v in cols.items()} for i in range(t["rows"])]


# --------------------------------------------------------------------------- tables

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
    failed: int = 0  # its jobs that failed (err COMPUTE_FAILED)
    failed_in_a_row: int = 0  # failed jobs since its last accepted reply
    last_error: str = ""  # the text of its latest COMPUTE_FAILED or PROBLEM_UNAVAILABLE
    benched: bool = False  # max_failed_jobs failures in a row: no more jobs until a hello or a success
    resends_in_a_row: int = 0  # jobs re-sent after err MISSING_ITERATE since its last accepted reply


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
        key = (c, e.kind, tuple(e.iterate_ids))
        self._classes[key] = self._classes.get(key, 0) + 1
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
        key = (c, e.kind, tuple(e.iterate_ids))
        left = self._classes[key] - 1
        if left:
            self._classes[key] = left
        else:
            del self._classes[key]
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


def restart_grace_s(liveness_timeout_s: float) -> float:
    """How long a resumed server waits for a restored worker to say hello again.

    A worker that heard nothing from the crashed server reconnects; from the moment the new
    server listens, libzmq's next connection attempt may be up to ``RECONNECT_IVL_MAX_S`` away
    and, once connected, the worker's next hello up to ``HELLO_BACKOFF_MAX_S`` (both caps of the
    reference worker's backoff, protocol/messages.py, PROTOCOL.md 8.10). The grace is those two
    plus a liveness timeout (the margin any worker gets): 5 + 4 + 3 = 12 s at the defaults."""
    return liveness_timeout_s + RECONNECT_IVL_MAX_S + HELLO_BACKOFF_MAX_S


@dataclass(frozen=True, slots=True)
class CoreConfig:
    """Driver-independent settings of the core.

    Attributes:
        problem: problem spec announced to workers in Welcome.
        problem_options: its options (msgpack-able scalars).
        batch_size: default minibatch per job (an algorithm's JobSpec may override it).
        heartbeat_interval_s: announced to workers; the daemon sends at this period too.
        liveness_timeout_s: a worker silent for longer is declared dead.
        min_workers: issue no job until this many workers are ready (then never wait again).
        max_bad_replies: quarantine a worker after this many invalid replies in a row (0: never).
        max_failed_jobs: bench a worker (no more jobs) after this many failed jobs in a row
            with no accepted reply between (0: never).
        quarantine_s: how long a quarantined worker id is refused.
        max_workers: refuse new workers beyond this many (bounds the worker table; the daemon
            refuses beyond its own ``serve --max-workers``, default 10,000, first).
        max_resends_per_job, max_resends: ``err MISSING_ITERATE`` makes the server send a job's
            iterates again (a 52-byte err, a whole iterate back): at most this many times per job,
            and per worker without an accepted reply between. Past either bound the job is
            written off (lost, reason "resends", a ``cancel`` tells the worker) and the err counts
            as an invalid reply (``max_bad_replies`` of them in a row: quarantine).
        max_credit: a worker holds at most this many jobs at once, whatever credit it asks for
            (bounds the ledger at max_workers * max_credit entries; a hoarder that never answers
            holds no more).
        round_period_s: round-mode algorithms: None = demand-driven rounds (a round whenever a
            worker is ready for a job); a number = a round every period on the driver's clock.
        seed: seeds the job sample seeds.
        run_id: this training run's id, announced in Welcome (kept when a run is resumed).
        restart_grace_s: after a restart (:meth:`ServerCore.rebase_clock`), how long each
            restored worker has to say hello again before it is written off; None (the default):
            :func:`restart_grace_s` of ``liveness_timeout_s``. Never less than the liveness timeout.
    """

    problem: str = "quadratic"
    problem_options: dict = field(default_factory=dict)
    batch_size: int = 1
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    liveness_timeout_s: float = LIVENESS_TIMEOUT_S
    min_workers: int = 1
    max_bad_replies: int = 5
    max_failed_jobs: int = 5
    quarantine_s: float = 300.0
    max_workers: int = 65536
    max_resends_per_job: int = 2
    max_resends: int = 4
    max_credit: int = MAX_CREDIT
    round_period_s: float | None = None
    seed: int = 0
    run_id: int = 0
    restart_grace_s: float | None = None

    @property
    def restart_grace(self) -> float:
        """The grace of a restored worker (``restart_grace_s`` resolved)."""
        g = restart_grace_s(self.liveness_timeout_s) if self.restart_grace_s is None else self.restart_grace_s
        return max(g, self.liveness_timeout_s)


class ServerCore:
    """Worker table + job ledger + iterate store around one algorithm.

    Args:
        algorithm: the (bound) algorithm.
        x0: initial parameters (1-D float array).
        config: see :class:`CoreConfig`.
        server_boot: this server incarnation's id, announced in Welcome.
        now: the time of creation (for clock-driven rounds).
    """

    record_issued = True  # an "issued" event per job; off where nothing reads them (ps/drivers/daemon.py)

    def __init__(self, algorithm: Algorithm, x0: np.ndarray, config: CoreConfig | None = None, *,
                 server_boot: int = 0, now: float = 0.0) -> None:
        self.alg = algorithm
        self.cfg = config or CoreConfig()
        self.server_boot = server_boot
        x0 = np.asarray(x0)
        if x0.ndim != 1:
            raise ValueError("x0 must be a 1-D vector")
        self.dim = int(x0.shape[0])
        self.dtype = x0.dtype
        self.state, init_jobs = algorithm.init(x0, seed=self.cfg.seed)
        self.rng = np.random.default_rng(self.cfg.seed)
        self.workers: dict[str, WorkerInfo] = {}
        self.ledger: dict[int, LedgerEntry] = {}
        self.store: dict[int, np.ndarray] = {}
        self.refs: dict[int, int] = {}
        self.store_peak = 0
        self.pending_specs: deque[JobSpec] = deque(init_jobs)  # init jobs, then clock-made round jobs
        self.buffer: list[Result] = []  # round mode: results waiting for the next round
        self.closed: OrderedDict[int, str] = OrderedDict()  # settled job id -> how
        self.counters = Counters()
        self.next_job_id = 0
        self.started = False
        self.issuing = True  # the driver sets False to drain (stop condition reached)
        self.held = ""  # why a sharded server holds the issuing of jobs ("": it does not; ps/sharded/hub.py)
        self.next_round_at = now + self.cfg.round_period_s if self.cfg.round_period_s else math.inf
        self.events: list[dict[str, Any]] = []
        self.last_metrics: dict[str, float] = {}
        self.quarantine: dict[str, float] = {}  # worker id -> refused until (time)
        # Round mode: after make_job said "nothing now", no round runs until something new happens
        # (a result arrives, a worker joins or is written off), so heartbeats never advance the model.
        self.round_blocked = False
        # The problem's layout as error texts name it ("w (5, 6), b (1,)"); set by the driver, which
        # holds the problem (worker.compute.describe_layout). Not state: only words in messages.
        self.layout_text = ""
        self._build_indexes()

    def _build_indexes(self) -> None:
        """Derived state (never in a snapshot), rebuilt from the tables: what makes each message
        cost O(1) or O(log n) in the number of workers and jobs.

        ``_seq``: each worker's place in join order (the order of ``workers``); ``_free``: workers
        that can take a job now (ready, not benched, credit left); ``_eligible``: ready and not
        benched (``min_workers``); ``_alive``: a min-heap of (last_seen as pushed, seq, id), one
        entry per worker brought up to date lazily when it reaches the top (``_alive_top``);
        ``jobs``: the outstanding jobs indexed (:class:`Outstanding`); ``_unref``: iterate ids
        whose reference count fell to 0 (what ``_sweep_store`` looks at)."""
        self._seq: dict[str, int] = {}
        self._next_seq = 0
        self._free: set[str] = set()
        self._eligible: set[str] = set()
        self._alive: list[tuple[float, int, str]] = []
        for w in self.workers.values():
            self._enter(w)
        self.jobs = Outstanding(self.ledger)
        self._unref: set[int] = {i for i, n in self.refs.items() if n <= 0}
        self.evicted: deque[int] = deque(maxlen=EVICTED_KEPT)  # the latest iterate ids swept from the store
        self.evictions = 0  # how many were, ever, by this object (EvictionCursor)

    def _enter(self, w: WorkerInfo) -> None:
        """Index a worker just put at the end of ``workers``."""
        self._seq[w.worker_id] = self._next_seq
        self._next_seq += 1
        heapq.heappush(self._alive, (w.last_seen, self._seq[w.worker_id], w.worker_id))
        self._reindex(w)

    def _reindex(self, w: WorkerInfo) -> None:
        """Bring ``w``'s membership of the free and eligible sets up to date (after any change to
        its readiness, bench, credit or jobs)."""
        wid = w.worker_id
        if self.workers.get(wid) is not w:
            self._free.discard(wid)
            self._eligible.discard(wid)
            return
        if w.ready and not w.benched:
            self._eligible.add(wid)
            if len(w.outstanding) < w.credit:
                self._free.add(wid)
                return
        else:
            self._eligible.discard(wid)
        self._free.discard(wid)

    def _seen(self, w: WorkerInfo, now: float) -> None:
        """``w`` was heard from at ``now``. Its liveness entry is refreshed lazily, except when the
        driver's clock went back (an entry must never be later than the worker's last_seen)."""
        if now < w.last_seen:
            heapq.heappush(self._alive, (now, self._seq[w.worker_id], w.worker_id))
        w.last_seen = now

    def _alive_top(self) -> WorkerInfo | None:
        """The worker heard from longest ago (None if none), its heap entry made exact.

        Entries are (last_seen when pushed, seq, id); a worker's actual last_seen is never
        earlier, so the top, once exact, is the minimum. Stale tops are dropped (worker gone) or
        pushed down to their actual time: each refresh stands for a message the worker sent, so
        the cost is O(log n) per message, amortized."""
        h = self._alive
        while h:
            t, seq, wid = h[0]
            w = self.workers.get(wid)
            if w is None or self._seq.get(wid) != seq or t > w.last_seen:
                heapq.heappop(h)  # gone, a former incarnation, or a duplicate left by a clock step back
            elif t < w.last_seen:
                heapq.heapreplace(h, (w.last_seen, seq, wid))
            else:
                return w
        return None

    def _grant(self, credit: int) -> int:
        return min(credit, self.cfg.max_credit)

    # ------------------------------------------------------------------ properties
    @property
    def version(self) -> int:
        return int(self.alg.version(self.state))

    def params(self) -> np.ndarray:
        return self.alg.params(self.state)

    @property
    def outstanding(self) -> int:
        return len(self.ledger)

    def outstanding_ages(self) -> tuple[int, float] | None:
        """(oldest, mean) age ``version - created_at`` of the outstanding jobs, buffered results
        included; None when there are none. Costs the buffered results, not the ledger."""
        n = len(self.ledger)
        if not n:
            return None
        v = self.version
        buffered = [r.created_at for r in self.buffer if r.job_id in self.ledger]
        if len(buffered) + len(self.jobs) != n:  # not the buffer's entries after all: count them
            created = [e.created_at for e in self.ledger.values()]
            return v - min(created), v - sum(created) / n
        oldest = self.jobs.oldest_created_at()
        lo = min(buffered + ([] if oldest is None else [oldest]))
        return v - lo, v - (self.jobs.created_at_sum + sum(buffered)) / n

    def accounted(self) -> bool:
        """The accounting invariant (see module docstring)."""
        c = self.counters
        return c.issued == c.applied + c.dropped + c.lost + c.failed + c.cancelled + c.rejected + len(self.ledger)

    # ------------------------------------------------------------------ persistence
    def snapshot(self) -> dict[str, Any]:
        """Everything needed to continue exactly: a nested structure of plain values and arrays
        (see ``ps.journal.checkpoints.pack_tree``). Arrays are shared, not copied: serialize it at once."""
        return {
            "format": 2,  # 1: workers, ledger and closed as lists of rows (still restored)
            "algorithm": self.alg.name,
            "alg_state": self.alg.to_state_dict(self.state),
            "rng": self.rng.bit_generator.state,
            "workers": _table(self.workers.values(), WorkerInfo.__slots__),
            "ledger": _table(self.ledger.values(), LedgerEntry.__slots__),
            "store": dict(self.store),
            "refs": dict(self.refs),
            "store_peak": self.store_peak,
            "pending_specs": [{f: getattr(sp, f) for f in JobSpec.__slots__} for sp in self.pending_specs],
            "buffer": [{f: getattr(r, f) for f in Result.__slots__} for r in self.buffer],
            "closed": {"ids": _column(list(self.closed)), "how": _column(list(self.closed.values()))},
            "counters": self.counters.as_dict(),
            "next_job_id": self.next_job_id,
            "started": self.started,
            "issuing": self.issuing,
            "held": self.held,
            "next_round_at": self.next_round_at,
            "round_blocked": self.round_blocked,
            "last_metrics": dict(self.last_metrics),
            "quarantine": dict(self.quarantine),
            "dim": self.dim,
            "dtype": self.dtype.str,
        }

    @classmethod
    def restore(cls, algorithm: Algorithm, snap: dict[str, Any], config: CoreConfig | None = None, *,
                server_boot: int = 0) -> ServerCore:
        """Rebuild a core from :meth:`snapshot` (the inverse, bit for bit)."""
        if snap.get("format") not in (1, 2) or snap.get("algorithm") != algorithm.name:
            raise ValueError(f"snapshot of {snap.get('algorithm')!r} (format {snap.get('format')}) "
                             f"cannot be restored into {algorithm.name!r}")
        self = cls.__new__(cls)
        self.alg = algorithm
        self.cfg = config or CoreConfig()
        self.server_boot = server_boot
        self.dim = int(snap["dim"])
        self.dtype = np.dtype(snap["dtype"])
        self.state = algorithm.from_state_dict(snap["alg_state"])
        self.rng = np.random.default_rng()
        self.rng.bit_generator.state = snap["rng"]
        self.workers = {w["worker_id"]: WorkerInfo(**w) for w in _untable(snap["workers"])}
        self.ledger = {e["job_id"]: LedgerEntry(**e) for e in _untable(snap["ledger"])}
        for e in self.ledger.values():
            e.kind = JobKind(e.kind)
        self.store = {int(k): v for k, v in snap["store"].items()}
        for v in self.store.values():
            v.setflags(write=False)
        self.refs = {int(k): int(v) for k, v in snap["refs"].items()}
        self.store_peak = int(snap["store_peak"])
        self.pending_specs = deque(JobSpec(**{**sp, "kind": JobKind(sp["kind"])}) for sp in snap["pending_specs"])
        self.buffer = [Result(**{**r, "kind": JobKind(r["kind"])}) for r in snap["buffer"]]
        closed = snap["closed"]
        pairs = zip(_uncolumn(closed["ids"]), _uncolumn(closed["how"]), strict=True) if isinstance(closed, dict) \
            else closed
        self.closed = OrderedDict((int(k), v) for k, v in pairs)
        self.counters = Counters(**snap["counters"])
        self.next_job_id = int(snap["next_job_id"])
        self.started = bool(snap["started"])
        self.issuing = bool(snap["issuing"])
        self.held = str(snap.get("held", ""))
        self.next_round_at = float(snap["next_round_at"])
        self.round_blocked = bool(snap["round_blocked"])
        self.last_metrics = dict(snap["last_metrics"])
        self.quarantine = dict(snap.get("quarantine", {}))
        self.events = []
        self.layout_text = ""
        self._build_indexes()
        return self

    def rebase_clock(self, now: float) -> None:
        """After a restart the driver's clock is a different one: give every restored worker the
        restart grace (``cfg.restart_grace``, which covers the worker's reconnect backoff) to say
        hello again, and restart the round clock. The grace is a function of the run's config
        only, so recovery and replay, which call this with the journaled ``now``, do the same.

        The liveness rule is unchanged: a worker's ``last_seen`` is set to ``now + grace -
        liveness_timeout_s`` (later than ``now``), so it expires at ``now + grace`` unless it is
        heard from first; any message from it sets ``last_seen`` to its own time.

        Emits a ``resumed`` event naming this server's ``boot``: where a new server session
        begins in the event log (``latecomer report``; the end of a disk-full pause emits one with
        the same boot as its session)."""
        seen = now + self.cfg.restart_grace - self.cfg.liveness_timeout_s
        self.events.append({"ev": "resumed", "boot": self.server_boot, "version": self.version,
                            "workers": len(self.workers), "outstanding": len(self.ledger),
                            "grace_s": self.cfg.restart_grace, "t": now})
        for w in self.workers.values():
            w.last_seen = seen
            w.reconnecting = True
        self._alive = [(seen, self._seq[wid], wid) for wid in self.workers]
        heapq.heapify(self._alive)
        self.quarantine = {wid: now + self.cfg.quarantine_s for wid in self.quarantine}
        if self.cfg.round_period_s:
            self.next_round_at = now + self.cfg.round_period_s

    def drain_events(self) -> list[dict[str, Any]]:
        ev, self.events = self.events, []
        return ev

    # ------------------------------------------------------------------ inbound
    def handle(self, worker_id: str, msg: Any, now: float, key: str = "",
               refusal: tuple[ErrorCode, str] | None = None) -> list[Command]:
        """Dispatch one decoded message from ``worker_id`` (``key``: fingerprint of its CURVE key).

        ``refusal``: the transport already found a reply unusable (e.g. a gradient frame in another
        dtype than the wire's): it is refused with this code and text, like a failed check."""
        if isinstance(msg, Hello):
            return self.on_hello(worker_id, msg, now, key)
        w = self.workers.get(worker_id)
        if w is None:  # never joined, or declared dead (it may come back: it must say hello again)
            if isinstance(msg, Bye):
                return []
            if isinstance(msg, Reply) and msg.job_id in self.closed:
                self.counters.late += 1  # e.g. a frozen worker thawed: its job was written off meanwhile
                self.events.append({"ev": "late", "job_id": msg.job_id, "worker_id": worker_id,
                                    "was": self.closed[msg.job_id], "t": now})
            elif isinstance(msg, (Heartbeat, Ready)):
                self.counters.stray += 1
            else:
                self.counters.invalid += 1
            return [Send(worker_id, Error(ErrorCode.UNKNOWN_WORKER, "say hello first"))]
        self._seen(w, now)
        if isinstance(msg, Reply):
            return self.on_reply(w, msg, now, refusal)
        if isinstance(msg, Heartbeat):
            return self.on_heartbeat(w, msg, now)
        if isinstance(msg, Ready):
            if msg.credit:
                w.credit = self._grant(msg.credit)
            w.holds = self._trusted_holds(msg.holds)
            if not w.ready:
                w.ready = True
                self.round_blocked = False
                self.events.append({"ev": "ready", "worker_id": worker_id, "credit": w.credit})
            self._reindex(w)
            return self._dispatch(now)
        if isinstance(msg, Bye):
            return self.remove_worker(worker_id, now, reason="bye")
        if isinstance(msg, Error):
            self.counters.worker_errors += 1
            if msg.code == ErrorCode.MISSING_ITERATE:
                return self.on_missing(w, msg, now)
            return self.on_error(w, msg, now)
        self.counters.invalid += 1
        return [Send(worker_id, Error(ErrorCode.MALFORMED, f"{type(msg).__name__} is not for the server"))]

    def on_hello(self, worker_id: str, hello: Hello, now: float, key: str = "") -> list[Command]:
        if hello.vmax < PROTOCOL_VERSION_MIN or hello.vmin > PROTOCOL_VERSION:
            self.counters.invalid += 1
            return [Send(worker_id, Error(ErrorCode.UNSUPPORTED_VERSION,
                                          f"server speaks {PROTOCOL_VERSION_MIN}..{PROTOCOL_VERSION}"))]
        if self.quarantine.get(worker_id, -math.inf) > now:
            self.counters.refused += 1
            return [Send(worker_id, Error(ErrorCode.REFUSED, "quarantined"))]
        self.quarantine.pop(worker_id, None)
        out: list[Command] = []
        old = self.workers.get(worker_id)
        if old is None and len(self.workers) >= self.cfg.max_workers:
            self.counters.refused += 1
            return [Send(worker_id, Error(ErrorCode.REFUSED, f"too many workers ({self.cfg.max_workers})"))]
        if old is not None and old.boot != hello.boot:
            out += self.remove_worker(worker_id, now, reason="restarted")  # new incarnation = new join
            old = None
        same_run = hello.run_id == self.cfg.run_id  # else its cache and jobs belong to another run
        # An iterate id names the iterate of that version: one above ours (or a job id above our
        # next) came from an old server process whose last records were never journaled; this
        # process makes those ids again, with other values. Such iterates are not trusted, and the
        # job ids skip past what the worker saw, so no new job shares an id with one it holds.
        holds = self._trusted_holds(hello.holds) if same_run else set()
        if same_run:
            self._skip_job_ids(max([hello.seen, *hello.busy]))
        if old is None:
            w = self.workers[worker_id] = WorkerInfo(
                worker_id=worker_id, boot=hello.boot, credit=self._grant(hello.credit), device=hello.device,
                host_id=hello.host_id, joined_at=now, last_seen=now, holds=holds, key=key)
            self._enter(w)
            self.counters.workers_joined += 1
            self.round_blocked = False
            self.events.append({"ev": "joined", "worker_id": worker_id, "device": hello.device, "key": key, "t": now})
        else:  # same incarnation saying hello again (after a reconnect or a server restart)
            old.credit, old.holds = self._grant(hello.credit), holds
            self._seen(old, now)
            if old.benched:  # a hello brings a benched worker back (a new incarnation is a new join anyway)
                self._unbench(old, "hello", now)
            busy = set(hello.busy)
            if same_run:
                # Only what it holds survives. A worker says hello again on a new connection (its
                # own reconnect, or after a server restart); a job sent on the old one that it had
                # not seen yet died with that connection, and keeping it (as "in flight") left a
                # worker with credit 1 waiting for it for good, heartbeating, never given a job.
                gone = sorted(j for j in old.outstanding if j not in busy)
                self._write_off(old, gone, "server_restart" if old.reconnecting else "vanished", now)
            else:  # it worked for another run: on our welcome it drops everything it holds
                self._write_off(old, sorted(old.outstanding), "other_run", now)
            old.reconnecting = False
            self._reindex(old)
        out.append(Send(worker_id, Welcome(
            server_boot=self.server_boot, run_id=self.cfg.run_id, version=PROTOCOL_VERSION, problem=self.cfg.problem,
            problem_options=dict(self.cfg.problem_options),
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            liveness_timeout_s=self.cfg.liveness_timeout_s)))
        return out + self._dispatch(now)

    def _trusted_holds(self, ids: Any) -> set[int]:
        """The iterates a worker says it caches that are this process's: ids up to our version."""
        v = self.version
        return {i for i in ids if i <= v}

    def _skip_job_ids(self, seen: int) -> None:
        """Job ids start past ``seen`` (the highest a rejoining worker of this run saw or holds),
        at most MAX_JOB_ID_SKIP ahead: after a restart the worker may have seen ids that this
        process, resumed from the journal's durable prefix, would issue again. The hello is
        journaled, so replay skips the same way."""
        if self.next_job_id <= seen < self.next_job_id + MAX_JOB_ID_SKIP:
            self.next_job_id = seen + 1

    def on_reply(self, w: WorkerInfo, reply: Reply, now: float,
                 refusal: tuple[ErrorCode, str] | None = None) -> list[Command]:
        entry = self.ledger.get(reply.job_id)
        if entry is None or entry.received:
            how = self.closed.get(reply.job_id)
            if how is not None or (entry is not None and entry.received):
                self.counters.late += 1
                self.events.append({"ev": "late", "job_id": reply.job_id, "worker_id": w.worker_id,
                                    "was": how or "duplicate"})
                return self._dispatch(now)
            self.counters.unknown += 1
            return [Send(w.worker_id, Error(ErrorCode.UNKNOWN_JOB, "job id not outstanding", job_id=reply.job_id))]
        if entry.worker_id != w.worker_id or entry.created_at != reply.created_at:
            self.counters.unknown += 1
            return [Send(w.worker_id, Error(ErrorCode.UNKNOWN_JOB, "job was given to another worker"
                                            if entry.worker_id != w.worker_id else "created_at does not match the job",
                                            job_id=reply.job_id))]
        grads = self._in_run_dtype(reply)
        fused = refusal is None and self.alg.checks_finite and self.alg.mode != "round"
        problem = refusal or self._check_grads(entry, reply, grads, deferred=fused)
        pre = None
        if problem is None and fused:
            result = self._result(entry, w, reply, grads)
            pre, problem = self._checked_apply(result)
        if problem is not None:
            code, text = problem
            out = [Send(w.worker_id, Error(code, text, job_id=reply.job_id))]
            self._settle(entry, "rejected")
            self.counters.rejected += 1
            self.state = self.alg.on_lost(self.state, [entry.job_id])
            self._sweep_store()
            self.events.append({"ev": "rejected", "job_id": entry.job_id, "worker_id": w.worker_id,
                                "code": int(code), "message": text})
            w.bad_in_a_row += 1
            if self.cfg.max_bad_replies and w.bad_in_a_row >= self.cfg.max_bad_replies:
                out += self._quarantine(w, now)
            return out + self._dispatch(now)
        w.bad_in_a_row = 0
        w.failed_in_a_row = 0
        w.resends_in_a_row = 0
        if w.benched:  # not every job of it fails after all
            self._unbench(w, "success", now)
        w.jobs_done += 1
        w.compute_s += reply.compute_s
        if reply.holds:
            w.holds = self._trusted_holds(reply.holds)
        w.outstanding.discard(entry.job_id)
        self._reindex(w)
        if pre is None:
            result = self._result(entry, w, reply, grads)
        if self.alg.mode == "round":
            entry.received = True
            self.jobs._mark_received(entry)
            self.buffer.append(result)
            self.round_blocked = False
            return self._dispatch(now)
        return self._apply([result], now, pre) + self._dispatch(now)

    def _checked_apply(self, result: Result) -> tuple[tuple | None, tuple[ErrorCode, str] | None]:
        """An algorithm that ``checks_finite`` applies ``result`` now, testing its gradients in
        the step's own pass: ((the version before, what apply returned), None), or (None, the
        refusal) with nothing changed."""
        v_before = self.version
        try:
            return (v_before, self.alg.apply(self.state, [result])), None
        except NonFiniteGradient:
            return None, (ErrorCode.NON_FINITE, "gradient holds NaN or Inf")

    def _in_run_dtype(self, reply: Reply) -> tuple:
        """The reply's gradients in the run's dtype (what the algorithm gets); a value past its
        range becomes Inf, which the finiteness test then refuses (no warning per message)."""
        if all(g.dtype == self.dtype for g in reply.grads):
            return reply.grads
        with np.errstate(over="ignore", invalid="ignore"):
            return tuple(g if g.dtype == self.dtype else g.astype(self.dtype) for g in reply.grads)

    @staticmethod
    def _result(entry: LedgerEntry, w: WorkerInfo, reply: Reply, grads: tuple) -> Result:
        return Result(job_id=entry.job_id, worker_id=w.worker_id, created_at=entry.created_at, kind=entry.kind,
                      iterate_ids=entry.iterate_ids, grads=grads, seed=entry.seed, loss=reply.loss,
                      count=reply.count, shard=entry.shard, block_sq=reply.block_sq,
                      step_sq=reply.step_sq)

    def on_heartbeat(self, w: WorkerInfo, hb: Heartbeat, now: float) -> list[Command]:
        """Refresh credit and reconcile: a job the worker has seen but neither holds nor answered
        was lost in transit (messages on one connection arrive in order, so its reply would have
        come before this heartbeat). Write it off."""
        if hb.credit:
            w.credit = self._grant(hb.credit)
            self._reindex(w)
        busy = set(hb.busy)
        self._write_off(w, sorted(j for j in w.outstanding if j <= hb.seen and j not in busy), "vanished", now)
        return self._dispatch(now)

    def _write_off(self, w: WorkerInfo, job_ids: list[int], reason: str, now: float) -> None:
        """These outstanding jobs of ``w`` will never be answered: lost; the algorithm is told."""
        for jid in job_ids:
            self._settle(self.ledger[jid], "lost")
            self.counters.lost += 1
            self.events.append({"ev": "lost", "job_id": jid, "worker_id": w.worker_id, "reason": reason, "t": now})
        if job_ids:
            self.state = self.alg.on_lost(self.state, job_ids)
            self.round_blocked = False
            self._sweep_store()

    def reply_verdict(self, worker_id: str, reply: Reply) -> str:
        """Without changing anything: ``"ok"`` if ``reply`` answers an outstanding job of this
        worker with valid gradients, ``"bad"`` if it answers one with invalid gradients,
        ``"other"`` if it would be ignored (late, unknown, another worker's)."""
        entry = self.ledger.get(reply.job_id)
        if worker_id not in self.workers or entry is None or entry.received or entry.worker_id != worker_id \
                or entry.created_at != reply.created_at:
            return "other"
        grads = self._in_run_dtype(reply)
        return "ok" if self._check_grads(entry, reply, grads) is None else "bad"

    def on_error(self, w: WorkerInfo, err: Error, now: float) -> list[Command]:
        """An ``err`` from a joined worker (other than MISSING_ITERATE). COMPUTE_FAILED for a job
        outstanding at it: the job is settled as failed (:meth:`_fail`). PROBLEM_UNAVAILABLE: the
        worker cannot load the problem (it is leaving; an event carries its reason). Any other
        code naming a job outstanding at it: the job is written off as lost, and it counts toward
        the worker's failures in a row like a failed job (so an err per job cannot make the server
        send a job, with its iterate, per 50-byte err without bound: benched after
        ``max_failed_jobs``). Either way its credit slot frees up and the algorithm is told; an err
        naming no such job settles nothing."""
        entry = self.ledger.get(err.job_id) if err.job_id is not None else None
        mine = entry is not None and entry.worker_id == w.worker_id and not entry.received
        if err.code == ErrorCode.COMPUTE_FAILED and mine:
            return self._fail(w, entry, err.message, now) + self._dispatch(now)
        if err.code == ErrorCode.PROBLEM_UNAVAILABLE:
            w.last_error = f"cannot load problem {self.cfg.problem}: {err.message}"
            self.events.append({"ev": "problem_unavailable", "worker_id": w.worker_id, "problem": self.cfg.problem,
                                "message": err.message, "t": now})
        else:
            self.events.append({"ev": "worker_error", "worker_id": w.worker_id, "code": int(err.code),
                                "message": err.message, "job_id": err.job_id})
        if not mine:
            return self._dispatch(now)
        self._write_off(w, [entry.job_id], "worker_error", now)  # frees its credit
        w.failed_in_a_row += 1
        w.last_error = f"{err.code.name}: {err.message}"
        return self._maybe_bench(w, w.last_error, now) + self._dispatch(now)

    def _fail(self, w: WorkerInfo, entry: LedgerEntry, message: str, now: float) -> list[Command]:
        """``w`` could not compute this job: settled as failed, the algorithm told (on_lost, as for
        any write-off). After ``max_failed_jobs`` failures in a row the worker is benched: it keeps
        its place in the table but gets no job until it says hello again or answers a job it
        still holds (it is told with ``err REFUSED``)."""
        self._settle(entry, "failed")
        self.counters.failed += 1
        w.failed += 1
        w.failed_in_a_row += 1
        w.last_error = message
        self.state = self.alg.on_lost(self.state, [entry.job_id])
        self.round_blocked = False
        self._sweep_store()
        self.events.append({"ev": "failed", "job_id": entry.job_id, "worker_id": w.worker_id,
                            "created_at": entry.created_at, "seed": entry.seed, "message": message,
                            "worker_failed": w.failed, "in_a_row": w.failed_in_a_row, "t": now})
        return self._maybe_bench(w, message, now)

    def _maybe_bench(self, w: WorkerInfo, message: str, now: float) -> list[Command]:
        """Bench ``w`` if it has failed ``max_failed_jobs`` jobs in a row (see :meth:`_fail`)."""
        k = self.cfg.max_failed_jobs
        if not k or w.benched or w.failed_in_a_row < k:
            return []
        w.benched = True
        self._reindex(w)
        self.counters.benched += 1
        self.events.append({"ev": "benched", "worker_id": w.worker_id, "in_a_row": w.failed_in_a_row,
                            "message": message, "t": now})
        return [Send(w.worker_id, Error(ErrorCode.REFUSED, f"benched: {w.failed_in_a_row} jobs in a row failed; "
                                        "no more jobs until this worker says hello again (restart it)"))]

    def _unbench(self, w: WorkerInfo, why: str, now: float) -> None:
        w.benched = False
        w.failed_in_a_row = 0
        self._reindex(w)
        self.round_blocked = False
        self.events.append({"ev": "unbenched", "worker_id": w.worker_id, "reason": why, "t": now})

    def on_missing(self, w: WorkerInfo, err: Error, now: float) -> list[Command]:
        """The worker lacks iterates a job references: send the job again with those points,
        within ``max_resends_per_job`` and ``max_resends`` (see :class:`CoreConfig`); past them the
        job is written off and the err counts as an invalid reply."""
        entry = self.ledger.get(err.job_id) if err.job_id is not None else None
        if entry is None or entry.worker_id != w.worker_id or entry.received:
            return []
        self.counters.missing_iterates += 1
        if entry.resends >= self.cfg.max_resends_per_job or w.resends_in_a_row >= self.cfg.max_resends:
            self._write_off(w, [entry.job_id], "resends", now)
            out: list[Command] = [Send(w.worker_id, Cancel((entry.job_id,)))]
            w.bad_in_a_row += 1
            if self.cfg.max_bad_replies and w.bad_in_a_row >= self.cfg.max_bad_replies:
                out += self._quarantine(w, now)
            return out + self._dispatch(now)
        entry.resends += 1
        w.resends_in_a_row += 1
        w.holds.difference_update(err.iterate_ids)
        return [Send(w.worker_id, self._job_message(entry, w))]

    def on_tick(self, now: float) -> list[Command]:
        """Expire silent workers and run clock-driven rounds. Call at ``next_deadline()``."""
        out: list[Command] = []
        timeout = self.cfg.liveness_timeout_s
        expired: dict[str, int] = {}
        while (w := self._alive_top()) is not None and now - w.last_seen > timeout:
            heapq.heappop(self._alive)  # the rest were heard from later: not expired (subtraction is monotone)
            expired[w.worker_id] = self._seq[w.worker_id]
        for wid in sorted(expired, key=expired.__getitem__):  # in join order, as the table holds them
            out += self.remove_worker(wid, now, reason="timeout")
        if self.alg.mode == "round" and self.cfg.round_period_s and now >= self.next_round_at:
            while now >= self.next_round_at:
                self.next_round_at += self.cfg.round_period_s
            out += self._clock_round(now)
        return out + self._dispatch(now)

    def next_deadline(self) -> float:
        """The earliest time at which ``on_tick`` has something to do (inf if none)."""
        t = self.next_round_at
        w = self._alive_top()
        if w is not None:
            t = min(t, w.last_seen + self.cfg.liveness_timeout_s)
        return t

    def remove_worker(self, worker_id: str, now: float, *, reason: str) -> list[Command]:
        """Forget a worker; its outstanding jobs are written off as lost and the algorithm told."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return []
        self._reindex(w)  # out of the free and eligible sets
        del self._seq[worker_id]  # its liveness entry is dropped when it reaches the top
        if reason not in ("bye", "restarted"):  # it did not leave of its own accord
            self.counters.workers_lost += 1
        lost = sorted(w.outstanding)
        self._write_off(w, lost, reason, now)
        self.events.append({"ev": "left", "worker_id": worker_id, "reason": reason, "lost": len(lost), "t": now})
        return self._dispatch(now)

    # ------------------------------------------------------------------ internals
    def _check_grads(self, entry: LedgerEntry, reply: Reply, grads: tuple,
                     deferred: bool = False) -> tuple[ErrorCode, str] | None:
        """Why the reply's gradients are refused, or None. ``grads``: them in the run's dtype (a
        float64 gradient finite as sent can overflow to Inf in float32: the test is of what the
        algorithm would get). ``deferred``: the algorithm tests finiteness in its step."""
        want = 1 if entry.kind == JobKind.FULL_GRAD else len(entry.iterate_ids)
        if len(reply.grads) != want:
            return ErrorCode.BAD_SHAPE, f"expected {want} gradient(s), got {len(reply.grads)}"
        for i, g in enumerate(reply.grads):
            if g.shape != (self.dim,):
                layout = f" ({self.layout_text})" if self.layout_text else ""
                return ErrorCode.BAD_SHAPE, f"gradient {i}: expected shape ({self.dim},){layout}, got {g.shape}"
            if g.dtype.kind != "f":
                return ErrorCode.BAD_SHAPE, f"gradient dtype {g.dtype} is not floating point"
            if not deferred and not finite(grads[i]):  # one BLAS pass, exact where it overflows (_pool.py)
                return ErrorCode.NON_FINITE, "gradient holds NaN or Inf"
        if entry.kind == JobKind.FULL_GRAD and entry.shard is not None:
            if reply.count != entry.shard[1] - entry.shard[0]:
                return ErrorCode.BAD_SHAPE, f"count {reply.count} != shard size {entry.shard[1] - entry.shard[0]}"
        if reply.loss is not None and not math.isfinite(reply.loss):
            if deferred and not all(finite(g) for g in grads):  # the gradient's refusal comes first
                return ErrorCode.NON_FINITE, "gradient holds NaN or Inf"
            return ErrorCode.NON_FINITE, "loss is not finite"
        return None

    def _quarantine(self, w: WorkerInfo, now: float) -> list[Command]:
        self.counters.quarantined += 1
        self.quarantine[w.worker_id] = now + self.cfg.quarantine_s
        self.events.append({"ev": "quarantined", "worker_id": w.worker_id, "bad_in_a_row": w.bad_in_a_row,
                            "key": w.key, "t": now})
        out: list[Command] = [Send(w.worker_id, Bye("quarantined: too many invalid replies"))]
        out += self.remove_worker(w.worker_id, now, reason="quarantined")
        out.append(Disconnect(w.worker_id, "quarantined"))
        return out

    def _settle(self, entry: LedgerEntry, how: str) -> None:
        """Remove a job from the ledger (and its worker's set); release iterate references."""
        del self.ledger[entry.job_id]
        self.jobs._settled(entry)
        w = self.workers.get(entry.worker_id)
        if w is not None:
            w.outstanding.discard(entry.job_id)
            self._reindex(w)
        for iid in entry.iterate_ids:
            self.refs[iid] -= 1
            if self.refs[iid] <= 0:
                self._unref.add(iid)
        self.closed[entry.job_id] = how
        if len(self.closed) > MAX_CLOSED_REMEMBERED:
            self.closed.popitem(last=False)

    def _apply(self, results: list[Result], now: float, pre: tuple | None = None) -> list[Command]:
        """The algorithm applies ``results`` (or did already: ``pre`` = (the version before,
        what its apply returned)), then the ledger, events and cancellations follow."""
        if pre is None:
            v_before = self.version
            self.state, outcome = self.alg.apply(self.state, results)
        else:
            v_before, (self.state, outcome) = pre
        for r in results:
            entry = self.ledger.get(r.job_id)
            if entry is None:
                continue
            if r.job_id in outcome.applied:
                self._settle(entry, "applied")
                self.counters.applied += 1
            else:
                self._settle(entry, "dropped")
                self.counters.dropped += 1
        ages = dict(zip(outcome.applied, outcome.ages, strict=True))
        for r in results:
            if r.job_id in ages:
                w = self.workers.get(r.worker_id)
                self.events.append({"ev": "applied", "job_id": r.job_id, "worker_id": r.worker_id,
                                    "created_at": r.created_at, "age": ages[r.job_id], "seed": r.seed,
                                    "version": self.version, "t": now, "key": w.key if w else ""})
            else:
                self.events.append({"ev": "dropped", "job_id": r.job_id, "worker_id": r.worker_id,
                                    "created_at": r.created_at, "age": v_before - r.created_at, "t": now})
        if self.version != v_before:
            self.counters.updates += self.version - v_before
        if outcome.metrics:
            self.last_metrics = dict(outcome.metrics)
            if self.version != v_before:  # per-step algorithm figures (M_k, batch fill, ...)
                self.events.append({"ev": "metrics", "version": self.version, "t": now, **self.last_metrics})
        out = self._cancel(now)
        self._sweep_store()
        return out

    def _cancel(self, now: float) -> list[Command]:
        ids = self.alg.cancel(self.state, self.jobs)
        if not ids:
            return []
        by_worker: dict[str, list[int]] = {}
        for jid in ids:
            entry = self.ledger.get(jid)
            if entry is None or entry.received:
                continue
            self._settle(entry, "cancelled")
            self.counters.cancelled += 1
            by_worker.setdefault(entry.worker_id, []).append(jid)
            self.events.append({"ev": "cancelled", "job_id": jid, "worker_id": entry.worker_id,
                                "created_at": entry.created_at, "t": now})
        return [Send(wid, Cancel(tuple(jids))) for wid, jids in by_worker.items() if wid in self.workers]

    def _round(self, now: float) -> list[Command]:
        """One round of a round-mode algorithm: apply everything buffered (maybe nothing)."""
        results, self.buffer = self.buffer, []
        return self._apply(results, now)

    def _clock_round(self, now: float) -> list[Command]:
        out = self._round(now)
        self.state, spec = self.alg.make_job(self.state, "")
        if spec is not None:
            self.pending_specs.append(spec)
        return out

    def dispatch(self, now: float) -> list[Command]:
        """The jobs every worker's free credit allows (after the issuing was held)."""
        return self._dispatch(now)

    def _dispatch(self, now: float) -> list[Command]:
        """Give jobs to every worker with free credit, in join order (the free workers are an
        index: a pass costs the workers served, not the workers connected)."""
        if not self.issuing or self.held:
            return []
        if not self.started:
            if len(self._eligible) < self.cfg.min_workers:
                return []
            self.started = True
        out: list[Command] = []
        round_mode = self.alg.mode == "round"
        clock_rounds = round_mode and bool(self.cfg.round_period_s)

        def idle() -> bool:
            # Nothing queued and no round to run: no worker gets a job in this pass (neither
            # condition changes within it), so stop rather than look at every free worker.
            return not self.pending_specs and (clock_rounds or (round_mode and self.round_blocked))

        if not self._free or idle():
            return out
        for wid in sorted(self._free, key=self._seq.__getitem__):
            if idle():
                break
            w = self.workers[wid]
            while len(w.outstanding) < w.credit and w.worker_id in self.workers:
                if self.pending_specs:
                    spec = self.pending_specs.popleft()
                elif clock_rounds:
                    break
                else:
                    if self.alg.mode == "round":
                        if self.round_blocked:
                            break
                        out += self._round(now)
                    self.state, spec = self.alg.make_job(self.state, w.worker_id)
                    if spec is None:
                        self.round_blocked = self.alg.mode == "round"
                        break
                out.append(Send(w.worker_id, self._issue(spec, w, now)))
        return out

    def _issue(self, spec: JobSpec, w: WorkerInfo, now: float) -> Job:
        if len(spec.iterate_ids) != len(spec.points):
            raise ValueError(f"{self.alg.name}: JobSpec has {len(spec.iterate_ids)} ids and {len(spec.points)} points")
        for iid, p in zip(spec.iterate_ids, spec.points, strict=True):
            if iid not in self.store:
                self.store[iid] = p
                self.refs.setdefault(iid, 0)
            self.refs[iid] = self.refs.get(iid, 0) + 1
        self.store_peak = max(self.store_peak, len(self.store))
        jid = self.next_job_id
        self.next_job_id += 1
        entry = LedgerEntry(job_id=jid, worker_id=w.worker_id, kind=spec.kind, created_at=spec.created_at,
                            iterate_ids=tuple(spec.iterate_ids), seed=int(self.rng.integers(0, 2**63)),
                            batch_size=spec.batch_size or self.cfg.batch_size, shard=spec.shard,
                            deadline=spec.deadline, issued_at=now)
        self.ledger[jid] = entry
        self.jobs._add(entry)
        self.state = self.alg.on_issued(self.state, jid, spec)  # the algorithm learns the job's id
        w.outstanding.add(jid)
        self._reindex(w)
        self.counters.issued += 1
        if self.record_issued:
            self.events.append({"ev": "issued", "job_id": jid, "worker_id": w.worker_id, "kind": int(spec.kind),
                                "created_at": spec.created_at, "seed": entry.seed, "t": now})
        return self._job_message(entry, w)

    def _job_message(self, entry: LedgerEntry, w: WorkerInfo) -> Job:
        missing = tuple(dict.fromkeys(i for i in entry.iterate_ids if i not in w.holds))
        w.holds.update(missing)
        return Job(job_id=entry.job_id, kind=entry.kind, created_at=entry.created_at,
                   iterate_ids=entry.iterate_ids, seed=entry.seed, batch_size=entry.batch_size,
                   shard=entry.shard, deadline=entry.deadline, point_ids=missing,
                   points=tuple(self.store[i] for i in missing))

    def _sweep_store(self) -> None:
        """Forget iterates no job references and the algorithm does not need. Only those whose
        count fell to 0 are looked at (``_unref``), not the whole store."""
        if not self._unref:
            return
        live = self.alg.live_iterate_ids(self.state)
        for iid in list(self._unref):
            if self.refs.get(iid, 1) > 0:  # referenced again (or gone): no longer a candidate
                self._unref.discard(iid)
            elif iid not in live:
                del self.refs[iid]
                self.store.pop(iid, None)
                self._unref.discard(iid)
                self.evicted.append(iid)
                self.evictions += 1
