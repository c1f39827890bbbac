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
    PROTOCOL_VERSION,
    PROTOCOL_VERSION_MIN,
    Bye,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Job,
    Ready,
    Reply,
    Welcome,
)
from ps.core.commands import Command, Send
from ps.core.config import CoreConfig
from ps.core.dispatch import dispatch_jobs, job_message
from ps.core.faults import on_error, on_missing, quarantine_worker, unbench
from ps.core.iterates import index_iterates, sweep
from ps.core.ledger import Counters, LedgerEntry, Outstanding, mark_received, skip_job_ids
from ps.core.replies import check_grads, checked_apply, in_run_dtype, result_of
from ps.core.settlement import apply_results, clock_round, settle, write_off
from ps.core.snapshot import restore_into, snapshot_of
from ps.core.workers import (
    WorkerInfo,
    add,
    alive_top,
    expired,
    forget,
    grant,
    index_workers,
    rebase_liveness,
    reindex,
    seen,
)


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
        iterate store's (:func:`ps.core.iterates.index_iterates`)."""
        index_workers(self)
        self.jobs = Outstanding(self.ledger)
        index_iterates(self)

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
        (see ``ps.journal.persist.pack_tree``). Arrays are shared, not copied: serialize it at once."""
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
        last_seen = now + self.cfg.restart_grace - self.cfg.liveness_timeout_s
        self.events.append({"ev": "resumed", "boot": self.server_boot, "version": self.version,
                            "workers": len(self.workers), "outstanding": len(self.ledger),
                            "grace_s": self.cfg.restart_grace, "t": now})
        rebase_liveness(self, last_seen)
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
        seen(self, w, now)
        if isinstance(msg, Reply):
            return self.on_reply(w, msg, now, refusal)
        if isinstance(msg, Heartbeat):
            return self.on_heartbeat(w, msg, now)
        if isinstance(msg, Ready):
            if msg.credit:
                w.credit = grant(self, msg.credit)
            w.holds = self._trusted_holds(msg.holds)
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
            skip_job_ids(self, max([hello.seen, *hello.busy]))
        if old is None:
            w = WorkerInfo(
                worker_id=worker_id, boot=hello.boot, credit=grant(self, hello.credit), device=hello.device,
                host_id=hello.host_id, joined_at=now, last_seen=now, holds=holds, key=key)
            add(self, w)
            self.counters.workers_joined += 1
            self.round_blocked = False
            self.events.append({"ev": "joined", "worker_id": worker_id, "device": hello.device, "key": key, "t": now})
        else:  # same incarnation saying hello again (after a reconnect or a server restart)
            old.credit, old.holds = grant(self, hello.credit), holds
            seen(self, old, now)
            if old.benched:  # a hello brings a benched worker back (a new incarnation is a new join anyway)
                unbench(self, old, "hello", now)
            busy = set(hello.busy)
            if same_run:
                # Only what it holds survives. A worker says hello again on a new connection (its
                # own reconnect, or after a server restart); a job sent on the old one that it had
                # not seen yet died with that connection, and keeping it (as "in flight") left a
                # worker with credit 1 waiting for it for good, heartbeating, never given a job.
                gone = sorted(j for j in old.outstanding if j not in busy)
                write_off(self, old, gone, "server_restart" if old.reconnecting else "vanished", now)
            else:  # it worked for another run: on our welcome it drops everything it holds
                write_off(self, old, sorted(old.outstanding), "other_run", now)
            old.reconnecting = False
            reindex(self, old)
        out.append(Send(worker_id, Welcome(
            server_boot=self.server_boot, run_id=self.cfg.run_id, version=PROTOCOL_VERSION, problem=self.cfg.problem,
            problem_options=dict(self.cfg.problem_options),
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            liveness_timeout_s=self.cfg.liveness_timeout_s)))
        return out + self.dispatch(now)


    def _trusted_holds(self, ids: Any) -> set[int]:
        """The iterates a worker says it caches that are this process's: ids up to our version."""
        v = self.version
        return {i for i in ids if i <= v}

    def on_reply(self, w: WorkerInfo, reply: Reply, now: float,
                 refusal: tuple[ErrorCode, str] | None = None) -> list[Command]:
        entry = self.ledger.get(reply.job_id)
        if entry is None or entry.received:
            how = self.closed.get(reply.job_id)
            if how is not None or (entry is not None and entry.received):
                self.counters.late += 1
                self.events.append({"ev": "late", "job_id": reply.job_id, "worker_id": w.worker_id,
                                    "was": how or "duplicate"})
                return self.dispatch(now)
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
            result = result_of(entry, w.worker_id, reply, grads)
            pre, problem = checked_apply(self.alg, self.state, result)
        if problem is not None:
            code, text = problem
            out = [Send(w.worker_id, Error(code, text, job_id=reply.job_id))]
            settle(self, entry, "rejected")
            self.counters.rejected += 1
            self.state = self.alg.on_lost(self.state, [entry.job_id])
            self._sweep_store()
            self.events.append({"ev": "rejected", "job_id": entry.job_id, "worker_id": w.worker_id,
                                "code": int(code), "message": text})
            w.bad_in_a_row += 1
            if self.cfg.max_bad_replies and w.bad_in_a_row >= self.cfg.max_bad_replies:
                out += quarantine_worker(self, w, now)
            return out + self.dispatch(now)
        w.bad_in_a_row = 0
        w.failed_in_a_row = 0
        w.resends_in_a_row = 0
        if w.benched:  # not every job of it fails after all
            unbench(self, w, "success", now)
        w.jobs_done += 1
        w.compute_s += reply.compute_s
        if reply.holds:
            w.holds = self._trusted_holds(reply.holds)
        w.outstanding.discard(entry.job_id)
        reindex(self, w)
        if pre is None:
            result = result_of(entry, w.worker_id, reply, grads)
        if self.alg.mode == "round":
            mark_received(self, entry)
            self.buffer.append(result)
            self.round_blocked = False
            return self.dispatch(now)
        return apply_results(self, [result], now, pre) + self.dispatch(now)


    def on_heartbeat(self, w: WorkerInfo, hb: Heartbeat, now: float) -> list[Command]:
        """Refresh credit and reconcile: a job the worker has seen but neither holds nor answered
        was lost in transit (messages on one connection arrive in order, so its reply would have
        come before this heartbeat). Write it off."""
        if hb.credit:
            w.credit = grant(self, hb.credit)
            reindex(self, w)
        busy = set(hb.busy)
        write_off(self, w, sorted(j for j in w.outstanding if j <= hb.seen and j not in busy), "vanished",
                                  now)
        return self.dispatch(now)

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
        w = alive_top(self)
        if w is not None:
            t = min(t, w.last_seen + self.cfg.liveness_timeout_s)
        return t

    def remove_worker(self, worker_id: str, now: float, *, reason: str) -> list[Command]:
        """Forget a worker; its outstanding jobs are written off as lost and the algorithm told."""
        w = forget(self, worker_id)
        if w is None:
            return []
        if reason not in ("bye", "restarted"):  # it did not leave of its own accord
            self.counters.workers_lost += 1
        lost = sorted(w.outstanding)
        write_off(self, w, lost, reason, now)
        self.events.append({"ev": "left", "worker_id": worker_id, "reason": reason, "lost": len(lost), "t": now})
        return self.dispatch(now)

    # ------------------------------------------------------------------ the parts, as drivers and shards use them
    def dispatch(self, now: float) -> list[Command]:
        """The jobs every worker's free credit allows (after the issuing was held)."""
        return dispatch_jobs(self, now)

    def _job_message(self, entry: LedgerEntry, w: WorkerInfo) -> Job:
        return job_message(self, entry, w)

    def _check_grads(self, entry: LedgerEntry, reply: Reply, grads: tuple,
                     deferred: bool = False) -> tuple[ErrorCode, str] | None:
        """Why the reply's gradients are refused, or None (:func:`ps.core.replies.check_grads`)."""
        return check_grads(entry, reply, grads, self.dim, self.layout_text, deferred)

    def _in_run_dtype(self, reply: Reply) -> tuple:
        """The reply's gradients in the run's dtype (:func:`ps.core.replies.in_run_dtype`)."""
        return in_run_dtype(reply, self.dtype)

    def _sweep_store(self) -> None:
        """Forget iterates no job references and the algorithm does not need. Only those whose
        count fell to 0 are looked at, not the whole store."""
        if self._unref:
            sweep(self, self.alg.live_iterate_ids(self.state))
