"""The ZeroMQ daemon: the loop that drives a :class:`ServerCore` in real time.

One poll loop, one thread owning the core. Per message (:meth:`Daemon._on_frames`): the
transport validates it (ps/net/transport.py: socket, connections, keys, parts, same-host path),
the journal records it (ps/journal/persistence.py), ``core.handle`` answers with commands, the transport
sends them (the shape of zguide ``mdbroker.py``). Between batches the clock-driven inputs
(:meth:`Daemon._timers`). Every deadline comes from ``clock`` (monotonic).
docs/ARCHITECTURE.md follows one reply along this path.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import zmq

from problems.base import Problem
from protocol.codec import encode, error_text, looks_like_heartbeat
from protocol.errors import LocalProtocolError
from protocol.messages import (
    Bye,
    Heartbeat,
    Hello,
    Reply,
    Status,
)
from ps.core.commands import Disconnect, Send
from ps.core.server_core import ServerCore
from ps.drivers.evaluator import EvalLog, Evaluator
from ps.journal.events import EventLog
from ps.journal.inputs import CoreInputs
from ps.journal.persistence import Persistence
from ps.net.connections import (
    DEFAULT_MAX_WORKERS,
    DEFAULT_MAX_WORKERS_PER_KEY,
    ConnectionLimits,
)
from ps.net.transport import SMALL_MESSAGE, Count, ServerTransport
from ps.observe.observer import TICK_S, Observers, snapshot
from worker.compute import describe_layout

log = logging.getLogger("latecomer.server")

BACKLOG_SLICE = 16  # backlogged messages handled before the socket is looked at again (Daemon._receive_batch) ...
BACKLOG_SLICE_S = 0.001  # ... or fewer, once they took this long (a hoarder's ready issues 64 jobs: ~5 ms)
BATCH_S = 0.005  # ... for at most this long before the loop's timers run
BURST_SENDS = 8  # a backlog message that sends this many messages (jobs), while workers that train are active, ...
PAUSE_SHARE = 0.5  # ... is followed by a pause of this share of its cost, for their messages (Daemon._receive_batch)
TRAINING_RECENT_S = 0.01  # "active": one of their messages was handled this recently
MAX_BACKLOG = 4096  # messages received ahead of handling, at most ...
MAX_BACKLOG_BYTES = 64 << 20  # ... and bytes


def _nbytes(frames: list) -> int:
    return sum(len(f) for f in frames)


def server_heartbeat_period(cfg: Any) -> float:
    """How often the server heartbeats each worker: the announced interval, but no more often
    than three times per liveness timeout (a worker reconnects after a liveness timeout without
    a word from the server, so three heartbeats may be lost in a row). At the defaults (0.5 s,
    3 s) that is once a second: half the messages a heartbeat every interval would cost."""
    return max(cfg.heartbeat_interval_s, cfg.liveness_timeout_s / 3)
WORKER_COLUMNS = ("worker", "device", "jobs_done", "mean_job_s", "last_seen_s_ago", "holding", "oldest_age",
                  "state", "failed", "last_error")
STATUS_ERROR_CHARS = 200  # a worker's last error as status rows carry it
LIFECYCLE = {"joined", "ready", "left", "lost", "quarantined", "late", "rejected"}
# Worker failures: one warning line each (the event's fields ride along as with LIFECYCLE). A
# failed job is logged for the first failure of each worker only; the rest are in the event
# log, `latecomer status` and the counters.
FAILURE_LINES = {
    "problem_unavailable": "worker {worker_id} cannot load problem {problem}: {message}",
    "failed": "worker {worker_id}: job {job_id} failed: {message}",
    "benched": "worker {worker_id} benched: {in_a_row} jobs in a row failed (last: {message}); it gets no jobs "
               "until it says hello again",
    "unbenched": "worker {worker_id} gets jobs again ({reason})",
}
# Lifecycle events whose bare "KIND WORKER" line would not say what happened.
LIFECYCLE_LINES = {
    "late": "late {worker_id}: its reply to job {job_id} came after the job was settled ({was}): ignored, "
            "nothing lost (a slow or frozen worker whose job was written off or cancelled, or a repeat)",
}
DRAIN_S = 2.0  # at shutdown, how long to wait for the workers to acknowledge the bye


@dataclass(frozen=True)
class StopCondition:
    """When the daemon stops issuing jobs and exits. None/0 = no limit."""

    max_steps: int | None = None
    max_time_s: float | None = None
    target_loss: float | None = None

    def reached(self, version: int, elapsed_s: float, loss: float | None) -> str | None:
        if self.max_steps and version >= self.max_steps:
            return f"reached {self.max_steps} steps"
        if self.max_time_s and elapsed_s >= self.max_time_s:
            return f"ran for {self.max_time_s:g} s"
        if self.target_loss is not None and loss is not None and loss <= self.target_loss:
            return f"loss {loss:.4g} <= target {self.target_loss:g}"
        return None


class Daemon:
    """Drive a ServerCore over a ZeroMQ ROUTER socket.

    Args:
        core: the server core (already holding the algorithm and x0).
        problem: evaluated on the server every ``eval_every`` steps.
        bind: endpoint, e.g. ``tcp://127.0.0.1:0`` (port 0: the OS picks one).
        stop: stop condition.
        eval_every: evaluate every this many versions (0: only at start and end).
        events_path: append every core event as a JSON line here (None: don't).
        on_progress: called after each evaluation and at least every 0.2 s with (daemon, evaluation).
        clock: the monotonic clock (tests may substitute one).
        max_workers: refuse a hello that would make more workers than this.
        max_workers_per_key: under CurveZMQ, refuse a hello that would give one key more workers.
        limits: the bounds of the connection table (ps/net/connections.py); None: the defaults, with
            an idle connection forgotten after twice the liveness timeout, a transfer of at most
            two float64 gradients per connection and four such transfers' worth (at least 64 MiB)
            in all.
    """

    def __init__(self, core: ServerCore, problem: Problem, bind: str, *, stop: StopCondition | None = None,
                 eval_every: int = 0, events_path: str | None = None,
                 on_progress: Callable[[Daemon, dict[str, float] | None], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, context: zmq.Context | None = None,
                 persistence: Persistence | None = None, keys_dir: str | None = None, shm: str = "auto",
                 wire_dtype: str = "f32", max_workers: int = DEFAULT_MAX_WORKERS,
                 max_workers_per_key: int = DEFAULT_MAX_WORKERS_PER_KEY,
                 limits: ConnectionLimits | None = None, shards: dict | None = None) -> None:
        self.core = core
        self.persist = persistence
        self.inputs = CoreInputs(core, persistence)  # every core input, journaled first (ps/journal/inputs.py)
        self.problem = problem
        self.stop = stop or StopCondition()
        self.eval_every = eval_every
        self.on_progress = on_progress
        self.clock = clock
        self.own_ctx = context is None
        self.ctx = context or zmq.Context()
        layout = tuple(getattr(problem, "layout", ()) or ())
        if not core.layout_text and layout:
            core.layout_text = describe_layout(layout)  # BAD_SHAPE texts name the blocks
        # The wire: socket, connections, keys, same-host path, wire dtype (ps/net/transport.py).
        self.transport = ServerTransport(self.ctx, core, bind, clock=clock, keys_dir=keys_dir, shm=shm,
                                         wire_dtype=wire_dtype, max_workers=max_workers,
                                         max_workers_per_key=max_workers_per_key, limits=limits,
                                         journaled=persistence is not None)
        self.endpoint = self.transport.endpoint
        self.reload_keys = False  # set by SIGHUP
        self.recent_ages: deque[int] = deque(maxlen=4096)  # ages of the latest applied replies
        self.age_counts: dict[int, int] = {}  # age -> applied replies (all run long), for histograms
        self.versions: deque[tuple[float, int]] = deque(maxlen=256)  # (time, version) for the step rate
        self.lifecycle = logging.getLogger("latecomer.events")
        self.metrics = None  # a SnapshotCollector when --metrics-port is given
        self.next_publish = 0.0
        self.events_file = EventLog(events_path) if events_path else None  # a full disk drops events, no crash
        core.record_issued = self.events_file is not None  # nothing else here reads them
        self.events_dirty = False
        self.stopping: str | None = None
        self.backlog: collections.deque[list] = collections.deque()  # received, not yet handled (_receive_batch)
        self.backlogged: dict[bytes, int] = {}  # routing id -> its messages in the backlog
        self.backlog_hb: dict[bytes, bytes] = {}  # routing id -> its last message queued, where that is a heartbeat
        self.backlog_bytes = 0
        self.sends = 0  # messages sent (Send commands executed): what a backlogged message cost
        self.last_urgent = -math.inf  # when a message of a worker that trains was last handled
        self.backlog_paused_until = -math.inf  # the backlog waits until then (_receive_batch)
        self.started_at = clock()
        self.training_started_at: float | None = None  # when the first job went out
        self.evaluations: list[dict[str, float]] = self._prior_evaluations()  # a resumed run's, then ours
        self.evaluator = Evaluator(problem, clock)  # evaluations run off the loop (ps/drivers/evaluator.py)
        self.observers = Observers()  # loggers, the dashboard, a Python caller (ps/observe/observer.py)
        self.last_eval_version = -1  # the version of the evaluation started last
        # A sharded server (ps/sharded/hub.py): shards = {"n", "bind", "ranges", "x0"}; the core is the
        # coordinator's (an empty iterate), the parameters are the shards'.
        self.hooks: list[Callable[[float], None]] = []  # called every pass of the loop (serve's local shards)
        self.hub = None
        self.x: np.ndarray | None = None  # the latest iterate gathered from the shards, and its version
        self.x_version = -1
        self.gathering: int | None = None
        if shards is not None:
            self._open_shards(shards)

    def _open_shards(self, shards: dict) -> None:
        from ps.sharded.hub import ShardHub

        core = self.core
        self.hub = ShardHub(self.ctx, shards["bind"], shards["n"], core=core, persist=self.persist,
                            ranges=shards["ranges"], clock=self.clock, security=self.security)
        self.transport.shards_map = self.hub.shards_map
        if core.version == 0 and shards.get("x0") is not None:
            self.x, self.x_version = np.asarray(shards["x0"]), 0
        self._sync_hold(self.clock())

    # The transport's parts that the CLI, the supervisor and status read.
    sock = property(lambda self: self.transport.sock)
    conns = property(lambda self: self.transport.conns)
    security = property(lambda self: self.transport.security)
    arena = property(lambda self: self.transport.arena)
    max_array_bytes = property(lambda self: self.transport.max_array_bytes)
    wire_dtype = property(lambda self: self.transport.wire_dtype)

    # ------------------------------------------------------------------ lifecycle
    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: Any) -> None:
            self.stopping = f"signal {signal.Signals(signum).name}"
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

        def hup(signum: int, frame: Any) -> None:
            self.reload_keys = True
        signal.signal(signal.SIGHUP, hup)

    def params(self) -> np.ndarray:
        """The current iterate: the core's, or (sharded) the latest gathered from the shards."""
        if self.hub is None:
            return self.core.params()
        return self.x if self.x is not None else np.zeros(0, self.core.dtype)

    def _run_time(self) -> float:
        """Seconds since the first job was issued (0 before): an evaluation's ``t``; a resumed run
        goes on from its last recorded evaluation's."""
        if self.training_started_at is None and self.core.started:
            self.training_started_at = self.clock()
        own = 0.0 if self.training_started_at is None else self.clock() - self.training_started_at
        return self.t_offset + own

    def _prior_evaluations(self) -> list[dict[str, float]]:
        """With a state directory, its evaluations.jsonl (ps/drivers/evaluator.py ``EvalLog``): the
        evaluations of the sessions before this one, of versions before the recovered one."""
        self.eval_log, self.t_offset = None, 0.0
        if self.persist is None:
            return []
        self.eval_log = EvalLog(self.persist.state_dir)
        prior = self.eval_log.load(self.core.version)
        if self.eval_log.skipped:
            log.warning("%s: %d damaged lines skipped", self.eval_log.path, self.eval_log.skipped)
        self.t_offset = float(prior[-1]["t"]) if prior else 0.0
        return prior

    def evaluate(self) -> None:
        """Start an evaluation of the current iterate, off the loop (ps/drivers/evaluator.py): the
        figures are recorded (:meth:`_collect`) when it ends, named by the version it started
        at, with ``t`` of its start (counted from the first job issued, 0 before). A sharded
        server evaluates the iterate last gathered from its shards: if it has none of the
        current version it asks for it, and starts the evaluation when it has come."""
        version = self.core.version
        self.last_eval_version = version
        if self.hub is not None and (self.x_version != version or self.x is None):
            if self.gathering is None:
                self.gathering = self.hub.request_params(self.persist.journal.next_lsn - 1)
            return
        self._start_evaluation(version, self.params())

    def _start_evaluation(self, version: int, x: np.ndarray) -> None:
        if self.evaluator.busy:  # a gathered iterate came while one ran (rare): this one waits
            self._record(self.evaluator.wait())
        self.evaluator.submit(version, self._run_time(), x)

    def _record(self, ev: dict[str, float] | None, *, progress: bool = True) -> None:
        if ev is not None:
            self.evaluations.append(ev)
            if self.eval_log is not None:
                self.eval_log.append(ev)
            if self.observers:
                self.observers.call("on_evaluation", ev)
            if progress and self.on_progress:
                self.on_progress(self, ev)

    def _collect(self) -> bool:
        """Record the evaluation that ended, if one did. Returns whether one did."""
        ev = self.evaluator.take()
        self._record(ev)
        return ev is not None

    def _gathered(self) -> None:
        """Parameters the shards sent: the newest is the iterate; evaluated when asked for."""
        for token, _lsn, version, x in self.hub.take_params():
            if version >= self.x_version:
                self.x, self.x_version = x, version
            if token == self.gathering:
                self.gathering = None
                self._start_evaluation(version, x)

    def _sync_hold(self, now: float) -> None:
        """Hold the issuing of jobs while a shard is missing (journaled: the shards and replay follow)."""
        why = self.hub.hold_reason()
        if why and not self.core.held:
            log.warning("holding the issuing of jobs: %s", why)
            self.inputs.hold(now, why)
        elif not why and self.core.held:
            log.info("every shard is up: issuing jobs")
            self._execute(self.inputs.release(now) or [])

    def _shard_pass(self, now: float) -> None:
        """Each pass of the loop: records to the shards, replies whose blocks have all arrived to
        the core, the hold, gathered parameters."""
        hub = self.hub
        hub.ship(now)
        for item, refusal in hub.ready_replies(now):
            cmds = self.inputs.message(item.wid, item.msg, now, item.key, refusal or item.refusal, frames=item.frames,
                                       wire=item.wire, keep_refusal=refusal is not None)
            if cmds is not None:
                self._execute(cmds)
            if self._check_stop():  # the rest are not accepted: the run is over
                break
        if not self.stopping:
            self._sync_hold(now)
        self._gathered()

    def add_observer(self, obs: Any) -> None:
        """Add an observer (ps/observe/observer.py); before :meth:`run`."""
        self.observers.add(obs)
        if getattr(obs, "wants_issued", False):
            self.core.record_issued = True

    def settings(self) -> dict[str, Any]:
        """The run's settings as flat scalars (what a logger records as hyper-parameters)."""
        cfg, alg = self.core.cfg, self.core.alg
        out: dict[str, Any] = {"problem": cfg.problem, "algorithm": alg.name, "batch_size": cfg.batch_size,
                               "seed": cfg.seed, "run_id": cfg.run_id, "min_workers": cfg.min_workers,
                               "eval_every": self.eval_every, "liveness_timeout_s": cfg.liveness_timeout_s}
        out.update({f"problem.{k}": v for k, v in cfg.problem_options.items()})
        if dataclasses.is_dataclass(alg):
            for f in dataclasses.fields(alg):
                v = getattr(alg, f.name, None)
                if isinstance(v, (bool, int, float, str)) and not f.name.startswith("_"):
                    out[f"alg.{f.name}"] = v
        return out

    def run(self) -> str:
        """Serve until the stop condition or a signal. Returns the reason for stopping."""
        if self.observers:
            self.observers.call("on_start", self.settings())
        self.evaluate()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.hub is not None:
            poller.register(self.hub.sock, zmq.POLLIN)
        self.next_hb = self.next_progress = self.clock()
        try:
            while self.stopping is None:
                ready = poller.poll(self._timeout_ms(self.clock()))
                if self.hub is not None:
                    self.hub.receive(self.clock())
                if ready or self.backlog:
                    self._receive_batch()
                self._timers(self.clock())
                self._check_stop()
        finally:
            self._shutdown()
        return self.stopping or "stopped"

    def _timeout_ms(self, now: float) -> int:
        """How long the loop may wait for a message: until the first of its deadlines, at most 100 ms."""
        backlog_due = max(now, self.backlog_paused_until) if self.backlog else math.inf
        deadline = min(now if self.transport.hb_queue else self.next_hb, backlog_due, self._core_deadline(),
                       self.next_progress + 0.2, self.conns.next_deadline(),
                       now + self.persist.sync_due_in() if self.persist is not None else math.inf)
        return max(0, min(100, math.ceil((deadline - now) * 1000)))

    def _receive_batch(self) -> None:
        """Receive -> journal -> core -> send (:meth:`_on_frames`), scheduled so that thousands of
        connections cannot starve the workers that do the training. Everything the socket holds
        is received at once (receiving costs a few µs; handling a message, tens): messages of
        workers that have answered jobs are handled now, in arrival order; the others (hellos,
        readys, heartbeats of idle or new workers, anything from an unknown connection) wait in a
        backlog, handled BACKLOG_SLICE at a time or for BACKLOG_SLICE_S (whichever ends first),
        the socket looked at again between slices (for at most BATCH_S, then the loop's timers
        run). A connection with messages in the backlog has all its later ones queued behind
        them, so each connection's messages are handled in the order it sent them. The backlog
        is bounded (MAX_BACKLOG messages, MAX_BACKLOG_BYTES): past it, messages wait in libzmq's
        queues (its high-water marks).

        A costly message (one that sends BURST_SENDS messages or more: a ready of a job hoarder
        issues 64 jobs, ~5 ms) while workers that train are active is followed by a pause of the backlog for
        PAUSE_SHARE of its cost, in which the loop waits for their messages: a worker with
        credit 1 answers within about a millisecond, and without the pause each of its jobs
        waited behind the next costly message (400 hoarders joining took the training workers to
        0.06 of their rate, then 0.3 with the slice bounded by time). The costly messages keep at
        least 1 / (1 + PAUSE_SHARE) of the loop, so joining goes on; cheap ones (hellos,
        heartbeats) never pause it."""
        deadline = self.clock() + BATCH_S
        while True:
            urgent = self._receive_all()
            for frames in urgent:
                self._handle(frames)
                if self.stopping is not None:
                    return
            now = self.clock()
            if urgent:
                self.last_urgent = now
            if not self.backlog or now < self.backlog_paused_until:
                return
            self._backlog_slice(now)
            if self.stopping is not None or self.clock() >= deadline:
                return

    def _backlog_slice(self, t0: float) -> None:
        """Handle a slice of the backlog (see :meth:`_receive_batch`); pause it after a costly message."""
        slice_end, costly, t = t0 + BACKLOG_SLICE_S, 0.0, t0
        for _ in range(min(BACKLOG_SLICE, len(self.backlog))):
            sent = self.sends
            self._handle(self._unqueue())
            now = self.clock()
            if self.sends - sent >= BURST_SENDS:
                costly += now - t
            t = now
            if self.stopping is not None or t >= slice_end:
                break
        if costly and t - self.last_urgent < TRAINING_RECENT_S:
            self.backlog_paused_until = t + PAUSE_SHARE * costly

    def _unqueue(self) -> list:
        frames = self.backlog.popleft()
        rid = frames[0].bytes
        left = self.backlogged[rid] - 1
        if left:
            self.backlogged[rid] = left
        else:
            del self.backlogged[rid]
            self.backlog_hb.pop(rid, None)
        self.backlog_bytes -= _nbytes(frames)
        return frames

    def _receive_all(self) -> list:
        """What the socket holds (within the backlog's bounds): the urgent messages, returned,
        and the rest appended to the backlog."""
        urgent, by_rid, workers, now = [], self.conns.by_rid, self.core.workers, self.clock()
        for frames in self.transport.pending():
            rid = frames[0].bytes
            c = by_rid.get(rid)
            queued = rid in self.backlogged
            if self._queued_repeat(rid, frames) if queued else self.transport.is_repeat(c, frames, now):
                continue  # a heartbeat repeat: dropped unread (ps/net/connections.py)
            w = workers.get(c.wid) if c is not None and c.live else None
            if w is not None and w.jobs_done and not queued:
                urgent.append(frames)
            else:
                self.backlog.append(frames)
                self.backlogged[rid] = self.backlogged.get(rid, 0) + 1
                self.backlog_bytes += _nbytes(frames)
                body = frames[1].bytes if len(frames) == 2 and len(frames[1]) <= SMALL_MESSAGE else None
                if body is not None and looks_like_heartbeat(body):
                    self.backlog_hb[rid] = body
                else:
                    self.backlog_hb.pop(rid, None)
            if len(urgent) + len(self.backlog) >= MAX_BACKLOG or self.backlog_bytes >= MAX_BACKLOG_BYTES:
                break
        return urgent

    def _queued_repeat(self, rid: bytes, frames: list) -> bool:
        """Whether a message of a connection with messages in the backlog is byte for byte the
        heartbeat it queued last, with nothing in between: that one is still to be handed on (and
        refreshes the worker's liveness when it is, later than this one arrived), so this one would
        tell the core nothing. Dropped and counted as a repeat, like one that repeats the heartbeat
        handed on last (ServerTransport.is_repeat). Without it a server that fell behind queued
        every repeat of every connection with a message waiting (a full backlog of them: 4,000
        fakes heartbeating every 0.4 s kept it at MAX_BACKLOG and the real workers at a quarter of
        their rate, while the messages waiting in libzmq held its decoder buffers)."""
        tail = self.backlog_hb.get(rid)
        if tail is None or len(frames) != 2 or len(frames[1]) != len(tail) or frames[1].bytes != tail:
            return False
        self.conns.counters.hb_repeats += 1
        return True

    def _handle(self, frames: list) -> None:
        self._on_frames(frames)
        if self.training_started_at is None and self.core.started:
            self.training_started_at = self.clock()
        self._check_stop()

    def _timers(self, now: float) -> None:
        """After each batch: key reloads, the core's tick, the connection table's expiries and
        waiting status answers, the journal's sync and checkpoints, metrics, heartbeats,
        evaluations, progress and the event log's flush."""
        core = self.core
        if self.reload_keys:
            self.reload_keys = False
            if self.security is not None:
                self._revoke(self.security.reload())  # revocation without restart (SIGHUP)
        if now >= self._core_deadline():
            self._execute(self.inputs.tick(now) or [])
        self.conns.expire(now)
        for rid, token in self.conns.status_due(now):  # status? answers that waited their turn
            self.transport.send_frames(rid, self.status_frames(token))
        if self.persist is not None:
            self.persist.after_batch(core, now)
        if self.hub is not None:
            self._shard_pass(now)
        for hook in self.hooks:
            hook(now)
        if self.metrics is not None and now >= self.next_publish:
            self.publish_metrics()
            self.next_publish = now + 0.5
        if now >= self.next_hb:
            self.transport.start_heartbeats()
            self.next_hb = now + server_heartbeat_period(core.cfg)
        for wid in self.transport.heartbeat_some() if self.transport.hb_queue else ():
            self._unreachable(wid)
        self._progress(now)
        if self.observers and now >= self.observers.next_tick:
            self.observers.next_tick = now + TICK_S
            self.observers.call("on_tick", snapshot(self), now)
        if self.events_dirty:  # once per pass of the loop (a batch of messages), not per message
            self.events_file.flush()
            self.events_dirty = False

    def _progress(self, now: float) -> None:
        if self._collect():
            self.next_progress = now
        if self.eval_every and self.core.version >= self.last_eval_version + self.eval_every:
            if not self.evaluator.busy and self.gathering is None:
                self.evaluate()
            elif self.evaluator.busy and self.evaluator.late_for != self.last_eval_version:
                self.evaluator.late_for = self.last_eval_version  # counted once per evaluation
                self.evaluator.late += 1
                if self.evaluator.late == 1:
                    log.info("an evaluation is slower than %d steps of training: the next one starts when the "
                             "last ends", self.eval_every)
        if self.on_progress and now >= self.next_progress + 0.2:
            self.on_progress(self, None)
            self.next_progress = now

    def _check_stop(self) -> bool:
        if self.stopping is None:
            loss = self.evaluations[-1].get("loss") if self.evaluations else None
            why = self.stop.reached(self.core.version, self.clock() - self.started_at, loss)
            if why:
                self.stopping = why
        return self.stopping is not None

    def _shutdown(self) -> None:
        """The run is over: no more jobs, a checkpoint, (sharded) the final gather, bye to every
        worker; then the evaluation still running, if any, and one of the final iterate. The
        workers are told bye before the loop waits for an evaluation: they would hear nothing
        while it waits."""
        self.inputs.stop_issuing()
        if self.persist is not None:
            self.persist.checkpoint(self.core)
        if self.hub is not None:
            self._final_gather()
        self._flush_events()
        self._drain(Bye(f"server stopping: {self.stopping}"))
        self._record(self.evaluator.wait())  # the one running, if any
        if self.hub is not None and self.evaluations and self.evaluations[-1]["version"] != self.x_version:
            self.last_eval_version = -1  # the iterate gathered last is evaluated
        if self.last_eval_version != self.core.version or len(self.evaluations) < 2:
            self.evaluate()
        self._record(self.evaluator.wait(), progress=False)
        self.stopped_at = self.clock()  # summary's elapsed_s: the same figure however late it is asked
        log.info("stopping: %s", self.stopping)

    def _final_gather(self, timeout_s: float = 120.0) -> None:
        """The run is over: every shard applies the journal to its end and sends its slice (at most
        ``timeout_s``; a shard that is gone is waited for, as long as that), then is told to stop."""
        hub, last = self.hub, self.persist.journal.next_lsn - 1
        self.persist.journal.sync()
        token = hub.request_params(last)
        deadline = self.clock() + timeout_s
        while self.clock() < deadline:
            now = self.clock()
            hub.receive(now)
            hub.ship(now)
            got = [g for g in hub.take_params() if g[0] == token]
            if got:
                _, _, version, x = got[0]
                self.x, self.x_version = x, version
                break
            hub.sock.poll(50)
        else:
            log.error("the shards did not all send their parameters within %.0f s: final_x.npy is of step %d",
                      timeout_s, self.x_version)
        hub.stop(f"the run is over: {self.stopping}")

    def _drain(self, bye: Bye) -> None:
        """Tell every worker bye and wait (at most DRAIN_S) for their acknowledging bye. The run
        is over: nothing received now reaches the core."""
        self.transport.drain(bye, self.clock() + DRAIN_S)

    def close(self) -> None:
        if self.eval_log is not None:
            self.eval_log.close()
        if self.observers:
            self.observers.call("on_tick", snapshot(self), self.clock())  # the final figures
            self.observers.call("close")
            self.observers = Observers()
        if self.events_file:
            self.events_file.close()
            self.events_file = None
        if self.metrics is not None:
            self.metrics.close()
        if self.hub is not None:
            self.hub.close()
        self.transport.close()
        if self.own_ctx:  # terminating the context waits for the final byes to be flushed
            self.ctx.term()

    # ------------------------------------------------------------------ the message path
    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        """One message: the transport validates it (ps/net/transport.py), the journaling core records
        it and feeds the core (ps/journal/inputs.py), the core's commands go out."""
        now = self.clock()
        item = self.transport.receive(frames, now, self.status_frames)
        if isinstance(item, Count):
            self.inputs.count(item.kind)
        elif item is not None:
            if self.hub is not None and self._sharded_message(item, now):
                return
            cmds = self.inputs.message(item.wid, item.msg, now, item.key, item.refusal, frames=item.frames,
                                       wire=item.wire)
            if cmds is not None:  # None: not journaled (the disk is full): not accepted, the core never saw it
                self._execute(cmds)
                self.transport.handled(item, now)

    def _sharded_message(self, item: Any, now: float) -> bool:
        """A sharded server: a reply waits for its blocks (True: held); a heartbeat or hello counts
        the jobs whose replies wait as busy, so the core's reconciliation does not write them off."""
        msg = item.msg
        if type(msg) is Reply and item.refusal is None:
            if self.hub.take_reply(item, now):
                self.transport.handled(item, now)
                return True
        elif type(msg) is Hello and not self.hub.shards_map():
            # Not answered until every shard has joined once: the welcome must tell the shards. The
            # worker says hello again (its backoff); nothing of it reaches the core or the journal.
            self.transport.handled(item, now)
            return True
        if type(msg) in (Heartbeat, Hello):
            waiting = [j for j in self.hub.pending_for(item.wid) if j not in msg.busy]
            if waiting:
                item.msg = dataclasses.replace(msg, busy=(tuple(msg.busy) + tuple(waiting))[:256])
        return False

    def _execute(self, cmds: list) -> None:
        for c in cmds:
            if isinstance(c, Send):
                self.sends += 1
                if not self.transport.send(c.worker_id, c.msg):
                    self._unreachable(c.worker_id)
            elif isinstance(c, Disconnect):
                conn = self.conns.by_wid.get(c.worker_id)
                if conn is not None and conn.key:
                    self.transport.banned_keys.add(conn.key)  # it cannot come back under a new id
                self._forget(c.worker_id)
        self.transport.sweep()
        self._flush_events()

    def _core_deadline(self) -> float:
        """When the core next needs a tick; never while paused (no input reaches the core then)."""
        if self.persist is not None and self.persist.paused is not None:
            return math.inf
        return self.core.next_deadline()

    def _forget(self, wid: str) -> None:
        """The worker said bye or was quarantined or revoked: its connection's record goes."""
        self.conns.forget(wid)

    def _revoke(self, allowed: set[str]) -> None:
        """Workers whose key left the allow-list are dropped now (CURVE only checks keys at the
        handshake, so their open connections would otherwise live on) and their keys banned."""
        for conn in self.conns.bound():
            wid, key = conn.wid, conn.key
            if key and key not in allowed:
                self.transport.banned_keys.add(key)
                if wid in self.core.workers:
                    log.warning("worker %s: key %s revoked, disconnecting it", wid, key)
                    self.transport.send(wid, Bye("revoked"))
                    now = self.clock()
                    self._execute(self.inputs.remove(wid, now, "revoked") or [])
                self._forget(wid)

    def _unreachable(self, wid: str) -> None:
        """ROUTER_MANDATORY refused a send: the peer's connection is gone (a killed process closes
        its sockets at once) or its pipe is full. Write it off now, not after the liveness
        timeout. Its record is kept a while, so a reply it still sends is recognised as late."""
        if wid in self.core.workers:
            now = self.clock()
            self._execute(self.inputs.remove(wid, now, "unreachable") or [])

    def _flush_events(self) -> None:
        events = self.core.drain_events()
        for ev in events:
            kind = ev["ev"]
            if kind == "applied":
                self.recent_ages.append(ev["age"])
                self.age_counts[ev["age"]] = self.age_counts.get(ev["age"], 0) + 1
            elif kind in LIFECYCLE:  # one log line per lifecycle event (JSON with --log-format json)
                if kind == "left" and ev.get("worker_id") not in self.core.workers:
                    self.conns.release(ev.get("worker_id", ""), self.clock())  # idle from now: it expires
                text = LIFECYCLE_LINES.get(kind)
                if text is not None:
                    self.lifecycle.info(text.format_map(collections.defaultdict(str, ev)), extra={"event": ev})
                else:
                    self.lifecycle.info("%s %s", kind, ev.get("worker_id", ""), extra={"event": ev})
            elif kind in FAILURE_LINES and (kind != "failed" or ev.get("worker_failed") == 1):
                self.lifecycle.warning(FAILURE_LINES[kind].format_map(ev), extra={"event": ev})
        if events:
            now = self.clock()
            if not self.versions or now - self.versions[-1][0] >= 0.1:
                self.versions.append((now, self.core.version))
        if self.observers and events:
            self.observers.call("on_events", events, self.clock())
        if self.events_file and events:
            self.events_file.write("".join(json.dumps(ev) + "\n" for ev in events))
            self.events_dirty = True  # flushed by the loop after each batch of messages

    # ------------------------------------------------------------------ results
    def status_info(self) -> dict[str, Any]:
        """Flat figures for a status request (what `latecomer status` shows)."""
        core = self.core
        now = self.clock()
        info: dict[str, Any] = {f"counter.{k}": v for k, v in core.counters.as_dict().items()
                                if k not in ("updates", "missing_iterates")}
        info.update({"version": core.version, "workers": len(core.workers), "outstanding": core.outstanding,
                     "workers_benched": sum(w.benched for w in core.workers.values()),
                     "uptime_s": now - self.started_at, "step_rate": self.step_rate(now),
                     "algorithm": core.alg.name, "problem": core.cfg.problem, "wire_dtype": self.wire_dtype,
                     "shm_workers": sum(c.shm_ready and c.live for c in self.conns.bound())})
        info.update(self.conns.figures())  # the connection table: records, transfers, rates (ps/net/connections.py)
        if self.persist is not None:
            info.update(self.persist.status())  # journal bytes; paused (disk full): why, for how long
        if self.recent_ages:
            ages = np.array(self.recent_ages)
            info.update({"age.mean": float(ages.mean()), "age.p50": float(np.median(ages)),
                         "age.p90": float(np.percentile(ages, 90)), "age.max": int(ages.max())})
        ages = core.outstanding_ages()  # indexed: a status answer does not scan the ledger
        if ages is not None:
            info.update({"outstanding.max_age": ages[0], "outstanding.mean_age": ages[1]})
        if self.evaluations:
            info.update({f"eval.{k}": float(v) for k, v in self.evaluations[-1].items()})
        info.update({f"alg.{k}": float(v) for k, v in core.last_metrics.items()})
        if self.hub is not None:  # first: the cap below must not cut them off
            info = {"held": core.held, **self.hub.figures(), **info}
        return dict(list(info.items())[:64])  # the map cap of the protocol

    def enable_metrics(self, port: int, addr: str = "127.0.0.1") -> None:
        from ps.observe.metrics import serve_metrics

        self.metrics = serve_metrics(port, addr)
        self.publish_metrics()

    def publish_metrics(self) -> None:
        """Hand the HTTP thread an immutable snapshot of the figures."""
        core = self.core
        figures = {}
        if self.evaluations:
            last = self.evaluations[-1]
            figures.update({f"eval_{k}": float(v) for k, v in last.items() if k not in ("t", "version")})
        figures.update({f"alg_{k}": float(v) for k, v in core.last_metrics.items()})
        self.metrics.publish({"counters": core.counters.as_dict(), "version": core.version,
                              "workers": len(core.workers), "outstanding": core.outstanding,
                              "benched": sum(w.benched for w in core.workers.values()),
                              "step_rate": self.step_rate(self.clock()), "age_counts": dict(self.age_counts),
                              "figures": figures,
                              "paused": int(self.persist is not None and self.persist.paused is not None),
                              "shards": self.hub.summary() if self.hub is not None else ()})

    def step_rate(self, now: float) -> float:
        """Updates per second over the last ~10 s."""
        old = [(t, v) for t, v in self.versions if now - t <= 10.0]
        if len(old) < 2 or old[-1][0] <= old[0][0]:
            return 0.0
        return (old[-1][1] - old[0][1]) / (old[-1][0] - old[0][0])

    def worker_rows(self, error_chars: int = STATUS_ERROR_CHARS) -> tuple[tuple[str, ...], tuple[tuple, ...]]:
        """One row per worker for status: id, device, jobs done, mean job time, last seen, jobs held,
        the oldest held job's age, its state (``loading``: no ready yet; ``ok``; ``failing``: its
        latest job failed; ``benched``), its failed jobs and its last error (cut to ``error_chars``)."""
        now, v = self.clock(), self.core.version
        rows = []
        for w in list(self.core.workers.values())[:256]:
            ages = [v - self.core.ledger[j].created_at for j in w.outstanding if j in self.core.ledger]
            state = "benched" if w.benched else "loading" if not w.ready else "failing" if w.failed_in_a_row else "ok"
            rows.append((w.worker_id, w.device, w.jobs_done, w.compute_s / w.jobs_done if w.jobs_done else 0.0,
                         max(0.0, now - w.last_seen), len(w.outstanding), max(ages) if ages else 0, state, w.failed,
                         error_text(w.last_error, error_chars) if w.last_error and error_chars else ""))
        return WORKER_COLUMNS, tuple(rows)

    def status_frames(self, token: int) -> list:
        """The encoded answer to a status request. Should 256 rows with long ids and errors not fit
        the protocol's header cap, the error texts are cut shorter, then left out."""
        info = self.status_info()
        for chars in (STATUS_ERROR_CHARS, 40, 0):
            columns, rows = self.worker_rows(chars)
            try:
                return encode(Status(token=token, info=info, columns=columns, rows=rows))
            except LocalProtocolError:
                continue
        return encode(Status(token=token, info=info, columns=columns, rows=rows[:64]))

    def summary(self) -> dict[str, Any]:
        """Counters, evaluations and age statistics of the run (JSON-able)."""
        c = self.core.counters.as_dict()
        end = getattr(self, "stopped_at", None) or self.clock()
        return {"endpoint": self.endpoint, "version": self.core.version, "stopped": self.stopping,
                "elapsed_s": end - self.started_at, "counters": c, "outstanding": self.core.outstanding,
                "accounted": self.core.accounted(), "evaluations": self.evaluations,
                "invalid_messages": self.transport.invalid_messages, "send_failures": self.transport.send_failures,
                "connections": {k[len("conn."):]: v for k, v in self.conns.figures().items()},
                "store_peak": self.core.store_peak,
                "transport": self.transport.figures(),
                **({"shards": self.hub.summary(), "blocks_timed_out": self.hub.blocks_timed_out}
                   if self.hub is not None else {})}


def write_outputs(out_dir: str, daemon: Daemon) -> None:
    """Write summary.json, final_x.npy and problem.json (the problem's spec and options, which
    ``latecomer export`` rebuilds it from) into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "problem.json"), "w", encoding="utf-8") as f:
        json.dump({"problem": daemon.core.cfg.problem, "problem_options": dict(daemon.core.cfg.problem_options)}, f,
                  indent=1)
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(daemon.summary(), f, indent=1)
    params = getattr(daemon, "params", None)  # a sharded server's are gathered from its shards
    np.save(os.path.join(out_dir, "final_x.npy"), np.asarray(params() if params else daemon.core.params()))
