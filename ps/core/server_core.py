"""ServerCore: the sans-I/O heart of the parameter server.

It holds the worker table, the job ledger (every issued job with its creation step), the
iterate store and the algorithm state, and composes the parts that act on them: the worker
table's indexes and liveness (ps/core/workers.py), the ledger's bookkeeping (ps/core/ledger.py),
the store's references and eviction (ps/core/iterates.py), dispatch (ps/core/dispatch.py),
settlement (ps/core/settlement.py), worker faults (ps/core/faults.py), reply validation
(ps/core/replies.py) and snapshots (ps/core/snapshot.py). The tables stay attributes of the core,
as a checkpoint sees it (and the drivers, the shards and the tests read them). It takes decoded
messages and the current time ``now`` as arguments and returns commands for its driver (the
ZeroMQ daemon or the simulator) to carry out. No sockets, no clock, no threads: the same object
runs in production and in the deterministic simulator, and a run can be replayed exactly.

Accounting invariant, checked by the tests at every step::

    issued == applied + dropped + lost + failed + cancelled + rejected + outstanding

where ``outstanding`` counts jobs issued and not yet settled (including results received
and buffered for the next round of a round-based algorithm), ``failed`` the jobs a worker
could not compute (``err COMPUTE_FAILED``) and ``lost`` those written off without an answer.

Cost per message. Nothing the core does for one message scans the worker table or the job
ledger: free workers (ready, not benched, credit left) are an index kept in step with every
change, liveness deadlines a heap with lazy refresh, the iterate store's sweep looks only at
iterates whose last reference just went, and ``Algorithm.cancel`` gets an indexed view of the
outstanding jobs (:class:`ps.core.ledger.Outstanding`). What remains proportional is proportional to what
the message itself carries or settles (a heartbeat's busy list, a worker's own jobs when it is
written off), so 10,000 connected workers or 40,000 hoarded jobs cost a reply no more than 10.
A worker holds at most ``CoreConfig.max_credit`` jobs, whatever credit it asks for.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Any

import numpy as np

from algorithms.base import Algorithm, JobSpec, Result
from protocol.messages import (
    Bye,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Job,
    Ready,
    Reply,
)
from ps.core import membership, replies
from ps.core.commands import Command, Send
from ps.core.config import CoreConfig
from ps.core.dispatch import dispatch_jobs, job_message
from ps.core.faults import on_error, on_missing
from ps.core.iterates import index_iterates, sweep
from ps.core.ledger import Counters, LedgerEntry, Outstanding
from ps.core.replies import check_grads, in_run_dtype
from ps.core.settlement import clock_round
from ps.core.snapshot import restore_into, snapshot_of
from ps.core.workers import (
    WorkerInfo,
    alive_top,
    expired,
    grant,
    index_workers,
    rebase_liveness,
    reindex,
    seen,
    trusted_holds,
)

_BASE_VERSION = Algorithm.version  # reads ``state.version``
_NO_LIVE = Algorithm.live_iterate_ids  # needs no iterate kept


class ServerCore:
    """Worker table + job ledger + iterate store around one algorithm.

    Args:
        algorithm: the (bound) algorithm.
        x0: initial parameters (1-D float array).
        config: see :class:`ps.core.config.CoreConfig`.
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
        self.workers: dict[str, WorkerInfo] = {}  # in join order (ps/core/workers.py)
        self.ledger: dict[int, LedgerEntry] = {}  # outstanding jobs (ps/core/ledger.py)
        self.store: dict[int, np.ndarray] = {}  # iterates jobs reference (ps/core/iterates.py)
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
        cost O(1) or O(log n) in the number of workers and jobs. The worker table's (join order,
        free and eligible workers, liveness: :func:`ps.core.workers.index_workers`), the ledger's
        (``jobs``: the outstanding jobs indexed, :class:`ps.core.ledger.Outstanding`) and the
        iterate store's (:func:`ps.core.iterates.index_iterates`); and whether :attr:`version` may
        read the state's without the algorithm's call."""
        index_workers(self)
        self.jobs = Outstanding(self.ledger)
        index_iterates(self)
        # the algorithm, where its version is Algorithm.version's ``state.version`` (:attr:`version`)
        alg = self.alg
        self._plain_alg = alg if getattr(type(alg), "version", None) is _BASE_VERSION else None

    # ------------------------------------------------------------------ properties
    @property
    def version(self) -> int:
        """k, ``int(alg.version(state))``; read without the call where the algorithm's
        ``version`` is ``Algorithm.version`` (read several times per reply)."""
        alg = self.alg
        v = self.state.version if alg is self._plain_alg else alg.version(self.state)
        return v if type(v) is int else int(v)

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
        return snapshot_of(self)

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
        restore_into(self, algorithm, snap)
        self._build_indexes()
        return self

    def rebase_clock(self, now: float, restart: bool = True) -> None:
        """After a restart the driver's clock is a different one: give every restored worker the
        restart grace (``cfg.restart_grace``, which covers the worker's reconnect backoff) to say
        hello again, and restart the round clock. The grace is a function of the run's config
        only, so recovery and replay, which call this with the journaled ``now``, do the same.

        The liveness rule is unchanged: a worker's ``last_seen`` is set to ``now + grace -
        liveness_timeout_s`` (later than ``now``), so it expires at ``now + grace`` unless it is
        heard from first; any message from it sets ``last_seen`` to its own time. ``restart``: a
        new server process (False: the end of a disk-full pause), whose restored workers have no
        connection until their hello and get nothing before it (``cfg.await_hello``).

        Emits a ``resumed`` event naming this server's ``boot``: where a new server session
        begins in the event log (``latecomer report``; the end of a disk-full pause emits one with
        the same boot as its session)."""
        last_seen = now + self.cfg.restart_grace - self.cfg.liveness_timeout_s
        self.events.append({"ev": "resumed", "boot": self.server_boot, "version": self.version,
                            "workers": len(self.workers), "outstanding": len(self.ledger),
                            "grace_s": self.cfg.restart_grace, "t": now})
        rebase_liveness(self, last_seen, restart)
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
            return membership.on_hello(self, worker_id, msg, now, key)
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
        if now < w.last_seen:
            seen(self, w, now)  # the clock went back: its liveness entry is pushed again
        w.last_seen = now
        if isinstance(msg, Reply):
            return replies.on_reply(self, w, msg, now, refusal)
        if isinstance(msg, Heartbeat):
            return membership.on_heartbeat(self, w, msg, now)
        if isinstance(msg, Ready):
            if msg.credit:
                w.credit = grant(self, msg.credit)
            w.holds = trusted_holds(self, msg.holds)
            if not w.ready:
                w.ready = True
                self.round_blocked = False
                self.events.append({"ev": "ready", "worker_id": worker_id, "credit": w.credit})
            reindex(self, w)
            return self.dispatch(now)
        if isinstance(msg, Bye):
            return self.remove_worker(worker_id, now, reason="bye")
        if isinstance(msg, Error):
            self.counters.worker_errors += 1
            if msg.code == ErrorCode.MISSING_ITERATE:
                return on_missing(self, w, msg, now)
            return on_error(self, w, msg, now)
        self.counters.invalid += 1
        return [Send(worker_id, Error(ErrorCode.MALFORMED, f"{type(msg).__name__} is not for the server"))]

    def on_tick(self, now: float) -> list[Command]:
        """Expire silent workers and run clock-driven rounds. Call at ``next_deadline()``."""
        out: list[Command] = []
        for wid in expired(self, now):
            out += self.remove_worker(wid, now, reason="timeout")
        if self.alg.mode == "round" and self.cfg.round_period_s and now >= self.next_round_at:
            while now >= self.next_round_at:
                self.next_round_at += self.cfg.round_period_s
            out += clock_round(self, now)
        return out + self.dispatch(now)

    def next_deadline(self) -> float:
        """The earliest time at which ``on_tick`` has something to do (inf if none)."""
        t = self.next_round_at
        h = self._alive
        if not h:
            return t
        last, seq, wid = h[0]  # an exact top (the common case) is alive_top's answer, without its call
        w = self.workers.get(wid)
        if w is None or last != w.last_seen or self._seq.get(wid) != seq:
            w = alive_top(self)
        if w is not None:
            d = w.last_seen + self.cfg.liveness_timeout_s
            if d < t:  # min(t, d): t where they tie
                return d
        return t

    def remove_worker(self, worker_id: str, now: float, *, reason: str) -> list[Command]:
        """Forget a worker; its outstanding jobs are written off as lost and the algorithm told."""
        return membership.remove_worker(self, worker_id, now, reason=reason)

    def reply_verdict(self, worker_id: str, reply: Reply) -> str:
        """Without changing anything: ``"ok"``, ``"bad"`` or ``"other"`` (see
        :func:`ps.core.replies.reply_verdict`)."""
        return replies.reply_verdict(self, worker_id, reply)

    # ------------------------------------------------------------------ the parts, as drivers and shards use them
    def dispatch(self, now: float) -> list[Command]:
        """The jobs every worker's free credit allows (after the issuing was held)."""
        return dispatch_jobs(self, now)

    def _job_message(self, entry: LedgerEntry, w: WorkerInfo) -> Job:
        return job_message(self, entry, w)

    def _check_grads(self, entry: LedgerEntry, reply: Reply, grads: tuple,
                     deferred: bool = False) -> tuple[ErrorCode, str] | None:
        """Why the reply's gradients are refused, or None (:func:`ps.core.replies.check_grads`)."""
        return check_grads(entry, reply, grads, self.dim, self.layout_text, deferred, self.cfg.refuse_overflow)

    def _in_run_dtype(self, reply: Reply) -> tuple:
        """The reply's gradients in the run's dtype (:func:`ps.core.replies.in_run_dtype`)."""
        return in_run_dtype(reply, self.dtype)

    def _sweep_store(self) -> None:
        """Forget iterates no job references and the algorithm does not need. Only those whose
        count fell to 0 are looked at, not the whole store."""
        if self._unref:
            alg = self.alg
            # Algorithm.live_iterate_ids needs none: not called
            live = () if getattr(type(alg), "live_iterate_ids", None) is _NO_LIVE else alg.live_iterate_ids(self.state)
            sweep(self, live)
