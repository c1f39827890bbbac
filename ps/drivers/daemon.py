"""The ZeroMQ daemon: the loop that drives a :class:`ServerCore` in real time.

One poll loop, one thread owning the core. Per message (:meth:`Daemon._on_frames`): the
transport validates it (ps/net/transport.py: socket, connections, keys, parts, same-host path),
the journal records it (ps/journal/persistence.py), ``core.handle`` answers with commands, the transport
sends them (the shape of zguide ``mdbroker.py``). Which received message is handled when is the
receive schedule's (ps/drivers/schedule.py). Between batches the clock-driven inputs
(:meth:`Daemon._timers`). Every deadline comes from ``clock`` (monotonic). What the run tells
the outside (events, status, metrics, summary) is ps/drivers/outputs.py; its evaluations are
ps/drivers/evaluator.py's; a sharded run's coordinator side is ps/drivers/coordinator.py.
docs/ARCHITECTURE.md follows one reply along this path.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import zmq

from problems.base import Problem
from protocol.messages import Bye
from protocol.shm import host_id
from protocol.wire import WIRE_NUMPY
from ps.core.commands import Disconnect, Send
from ps.core.server_core import ServerCore
from ps.drivers.coordinator import ShardedRun
from ps.drivers.evaluator import RunEvaluations
from ps.drivers.outputs import EVENTS_FLUSH_S, STATUS_ERROR_CHARS, RunOutputs
from ps.drivers.schedule import ReceiveSchedule
from ps.journal.inputs import CoreInputs
from ps.journal.persistence import Persistence
from ps.net.connections import (
    DEFAULT_MAX_WORKERS,
    DEFAULT_MAX_WORKERS_PER_KEY,
    ConnectionLimits,
)
from ps.net.loopwait import SMALL_JOB_BYTES, BusyPoll, LoopWait, usable_cpus
from ps.net.transport import Count, ServerTransport
from ps.observe.observer import TICK_S, Observers, snapshot
from worker.compute import describe_layout

log = logging.getLogger("latecomer.server")

def server_heartbeat_period(cfg: Any) -> float:
    """How often the server heartbeats each worker: the announced interval, but no more often
    than three times per liveness timeout (a worker reconnects after a liveness timeout without
    a word from the server, so three heartbeats may be lost in a row). At the defaults (0.5 s,
    3 s) that is once a second: half the messages a heartbeat every interval would cost."""
    return max(cfg.heartbeat_interval_s, cfg.liveness_timeout_s / 3)


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
        # Events, status answers, metrics, the summary (ps/drivers/outputs.py).
        self.outputs = RunOutputs(self, events_path)
        core.record_issued = self.outputs.events_file is not None  # nothing else here reads them
        self.stopping: str | None = None
        self.sends = 0  # messages sent (Send commands executed): what a backlogged message cost
        # `serve --busy-poll-us`: the loop polls without blocking for up to a bound before it
        # sleeps, the window adapted to how soon messages come (ps/net/loopwait.py); off here, auto
        # from the command line: the bound while the host has a CPU for the server and each of the
        # run's processes on it (its workers, `local_shards`), checked every second (_adapt_busy_poll);
        # each worker is advised by the same rule for its own host (its jobs' spin_us)
        self.busy_poll = BusyPoll()
        self.local_shards = 0
        self.busy_cpus = self.busy_local = 0  # auto's figures: usable CPUs, the run's processes on this host
        self.busy_host = ""  # this host's id (protocol/shm.py host_id), as the workers' hellos give theirs
        self.busy_seen = 0  # the workers it counted them among (a join or a leave: counted again at once)
        self.next_busy_poll_check = 0.0
        self.loop_wait: LoopWait | None = None  # the loop's wait, once it runs (its busy-poll figures)
        self.schedule = ReceiveSchedule(self)  # which received message is handled when (ps/drivers/schedule.py)
        self.started_at = clock()
        self.training_started_at: float | None = None  # when the first job went out
        self.evals = RunEvaluations(self, problem, clock)  # off the loop, one at a time (ps/drivers/evaluator.py)
        self.observers = Observers()  # loggers, the dashboard, a Python caller (ps/observe/observer.py)
        self.hooks: list[Callable[[float], None]] = []  # called every pass of the loop (serve's local shards)
        # A sharded server (ps/drivers/coordinator.py, ps/sharded/hub.py): shards = {"n", "bind", "ranges",
        # "x0"}; the core is the coordinator's (an empty iterate), the parameters are the shards'.
        self.sharded: ShardedRun | None = None
        if shards is not None:
            self.sharded = ShardedRun(self, shards)
            self.sharded.sync_hold(self.clock())

    # The transport's parts that the CLI, the supervisor and status read.
    sock = property(lambda self: self.transport.sock)
    conns = property(lambda self: self.transport.conns)
    security = property(lambda self: self.transport.security)
    arena = property(lambda self: self.transport.arena)
    max_array_bytes = property(lambda self: self.transport.max_array_bytes)
    wire_dtype = property(lambda self: self.transport.wire_dtype)
    # A sharded server's hub, which the CLI, status and observers read (None: not sharded).
    hub = property(lambda self: self.sharded.hub if self.sharded is not None else None)
    # The receive schedule's backlog, which tests of the schedule read.
    backlog = property(lambda self: self.schedule.backlog)
    backlogged = property(lambda self: self.schedule.backlogged)
    backlog_hb = property(lambda self: self.schedule.backlog_hb)
    backlog_bytes = property(lambda self: self.schedule.backlog_bytes)
    backlog_paused_until = property(lambda self: self.schedule.paused_until)
    # The run's evaluations, which the CLI, status and the stop condition read.
    evaluations = property(lambda self: self.evals.evaluations)
    # The outputs' parts that the CLI and observers read.
    metrics = property(lambda self: self.outputs.metrics)
    age_counts = property(lambda self: self.outputs.age_counts)

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
        if self.sharded is None:
            return self.core.params()
        return self.sharded.params()

    def evaluate(self) -> None:
        """Start an evaluation of the current iterate, off the loop (RunEvaluations.evaluate)."""
        self.evals.evaluate()

    def add_observer(self, obs: Any) -> None:
        """Add an observer (ps/observe/observer.py); before :meth:`run`."""
        self.observers.add(obs)
        if getattr(obs, "wants_issued", False):
            self.core.record_issued = True

    def run(self) -> str:
        """Serve until the stop condition or a signal. Returns the reason for stopping."""
        if self.observers:
            self.observers.call("on_start", self.outputs.settings())
        self.evaluate()
        wait = self.transport.wait = self.loop_wait = LoopWait()  # one epoll, not zmq_poll
        if self.busy_poll.bound_us:
            self.busy_cpus, self.busy_host = usable_cpus(), host_id()
            self._adapt_busy_poll(self.clock())
        wait.add(self.sock)
        if self.hub is not None:
            wait.add(self.hub.sock)
        if self.transport.sealed is not None:  # the sealed data path (ps/net/sealed.py)
            wait.add(self.transport.sealed.sock)
        handed = self.transport.handed  # connections the front handed over (ps/net/handover.py)
        if handed is not None:
            wait.add(handed)
        self.next_hb = self.next_progress = self.clock()
        try:
            while self.stopping is None:
                ready = wait.wait(self._timeout_ms(self.clock()))
                if self.hub is not None:
                    self.hub.receive(self.clock())
                if ready or self.backlog or handed is not None and handed.inbox:
                    self._receive_batch()
                self._timers(self.clock())
                self._check_stop()
        finally:
            self.transport.wait = None
            wait.close()
            self._shutdown()
        return self.stopping or "stopped"

    def _timeout_ms(self, now: float) -> int:
        """How long the loop may wait for a message: until the first of its deadlines, at most 100 ms."""
        backlog_due = self.schedule.due(now)
        handed = self.transport.handed
        if handed is not None:
            backlog_due = min(backlog_due, now if handed.inbox else now + handed.timeout(now))
        deadline = min(now if self.transport.hb_queue else self.next_hb, backlog_due, self._core_deadline(),
                       self.next_progress + 0.2, self.transport.conns.next_deadline(),
                       now + EVENTS_FLUSH_S if self.outputs.events_dirty else math.inf,
                       now + self.persist.sync_due_in() if self.persist is not None else math.inf)
        return max(0, min(100, math.ceil((deadline - now) * 1000)))

    def _receive_batch(self) -> None:
        """Handle what the socket holds, in the receive schedule's order (ps/drivers/schedule.py)."""
        self.schedule.batch()

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
        conns = self.transport.conns  # not the property: every pass pays for it
        conns.expire(now)
        if self.transport.handed is not None:
            self.transport.handed.service(now)
        for rid, token in conns.status_due(now):  # status? answers that waited their turn
            self.transport.send_frames(rid, self.status_frames(token))
        if self.persist is not None:
            self.persist.after_batch(core, now)
        if self.sharded is not None:
            self.sharded.loop_pass(now)
        for hook in self.hooks:
            hook(now)
        self.outputs.publish_due(now)
        if self.busy_poll.bound_us and (now >= self.next_busy_poll_check or len(self.core.workers) != self.busy_seen):
            self._adapt_busy_poll(now)
        if now >= self.next_hb:
            self.transport.start_heartbeats()
            self.next_hb = now + server_heartbeat_period(core.cfg)
        for wid in self.transport.heartbeat_some() if self.transport.hb_queue else ():
            self._unreachable(wid)
        self._progress(now)
        if self.observers and now >= self.observers.next_tick:
            self.observers.next_tick = now + TICK_S
            self.observers.call("on_tick", snapshot(self), now)
        self.outputs.flush_event_log()

    def _adapt_busy_poll(self, now: float) -> None:
        """The busy poll's bound now, the daemon's and the one each worker's jobs advise (``auto``:
        none on a host whose CPUs do not cover the run's processes there: the daemon and its
        local shards on this host, the workers by their hellos' ``host_id``, each worker's host
        by its hello's ``cpus``); again in a second, or as soon as a worker joins or leaves."""
        self.next_busy_poll_check = now + 1.0
        workers, poll, here = self.core.workers, self.busy_poll, self.busy_host
        self.busy_seen = len(workers)
        per_host = Counter(w.host_id for w in workers.values())
        self.busy_local = self.local_shards + (per_host[here] if here else 0)
        self.loop_wait.set_bound(poll.bound_s(self.busy_cpus, self.busy_local))
        t = self.transport
        large = t.core.dim * WIRE_NUMPY[t.wire_dtype].itemsize > SMALL_JOB_BYTES
        for wid, w in workers.items():
            conn = t.conns.by_wid.get(wid)
            if conn is not None:  # an unknown host (no host_id) counts as crowded
                n = (per_host[w.host_id] + (1 + self.local_shards if w.host_id == here else 0)) if w.host_id else 0
                own_reads = conn.shm_ready or (t.sealed is not None and conn.seal_capable)  # no libzmq hop
                conn.spin_us = poll.advice_us(conn.cpus, n, large and not own_reads)

    def _progress(self, now: float) -> None:
        if self.evals.collect():
            self.next_progress = now
        self.evals.start_due()
        if self.on_progress and now >= self.next_progress + 0.2:
            self.on_progress(self, None)
            self.next_progress = now

    def _check_stop(self) -> bool:
        """Whether the run is to stop (the stop condition reached, or a signal). Twice an update: the
        condition is only asked where it could be reached (a time limit alone: once the time has
        passed), and the version and the last evaluation's loss only read where it limits them
        (reached ignores them without a limit)."""
        if self.stopping is None:
            stop = self.stop
            elapsed = self.clock() - self.started_at
            if stop.max_steps or stop.target_loss is not None or stop.max_time_s and elapsed >= stop.max_time_s:
                version = self.core.version if stop.max_steps else 0
                evals = self.evals.evaluations if stop.target_loss is not None else None
                loss = evals[-1].get("loss") if evals else None
                why = stop.reached(version, elapsed, loss)
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
        if self.sharded is not None:
            self.sharded.final_gather()
        self._flush_events()
        self._drain(Bye(f"server stopping: {self.stopping}"))
        self.evals.finish()
        self.stopped_at = self.clock()  # summary's elapsed_s: the same figure however late it is asked
        log.info("stopping: %s", self.stopping)

    def _drain(self, bye: Bye) -> None:
        """Tell every worker bye and wait (at most DRAIN_S) for their acknowledging bye. The run
        is over: nothing received now reaches the core."""
        self.transport.drain(bye, self.clock() + DRAIN_S)

    def close(self) -> None:
        self.evals.close()
        if self.observers:
            self.observers.call("on_tick", snapshot(self), self.clock())  # the final figures
            self.observers.call("close")
            self.observers = Observers()
        self.outputs.close()
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
            if self.sharded is not None and self.sharded.message(item, now):
                return
            cmds = self.inputs.message(item.wid, item.msg, now, item.key, item.refusal, frames=item.frames,
                                       wire=item.wire)
            if cmds is not None:  # None: not journaled (the disk is full): not accepted, the core never saw it
                self._execute(cmds)
                self.transport.handled(item, now)

    def _execute(self, cmds: list) -> None:
        for c in cmds:
            if isinstance(c, Send):
                self.sends += 1
                if not self.transport.send(c.worker_id, c.msg) and not self._awaiting_hello(c.worker_id):
                    self._unreachable(c.worker_id)
            elif isinstance(c, Disconnect):
                conn = self.conns.by_wid.get(c.worker_id)
                if conn is not None and conn.key:
                    self.transport.banned_keys.add(conn.key)  # it cannot come back under a new id
                self._forget(c.worker_id)
        self.transport.sweep()
        self.outputs.flush_events()  # _flush_events, a call less per update

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

    def _awaiting_hello(self, wid: str) -> bool:
        """A worker restored by a restart that has not said hello yet: no connection is bound to it,
        so nothing reaches it, and that is no reason to write it off before its grace ends
        (PROTOCOL.md 8.11)."""
        w = self.core.workers.get(wid)
        return w is not None and w.awaiting_hello and wid not in self.conns.by_wid

    def _unreachable(self, wid: str) -> None:
        """ROUTER_MANDATORY refused a send: the peer's connection is gone (a killed process closes
        its sockets at once) or its pipe is full. Write it off now, not after the liveness
        timeout. Its record is kept a while, so a reply it still sends is recognised as late."""
        if wid in self.core.workers:
            now = self.clock()
            self._execute(self.inputs.remove(wid, now, "unreachable") or [])

    # ------------------------------------------------------------------ outputs (ps/drivers/outputs.py)
    def _flush_events(self) -> None:
        self.outputs.flush_events()

    def status_info(self) -> dict[str, Any]:
        """Flat figures for a status request (what `latecomer status` shows)."""
        return self.outputs.status_info()

    def enable_metrics(self, port: int, addr: str = "127.0.0.1") -> None:
        self.outputs.enable_metrics(port, addr)

    def step_rate(self, now: float) -> float:
        """Updates per second over the last ~10 s."""
        return self.outputs.step_rate(now)

    def worker_rows(self, error_chars: int = STATUS_ERROR_CHARS) -> tuple[tuple[str, ...], tuple[tuple, ...]]:
        """One row per worker for status (see RunOutputs.worker_rows)."""
        return self.outputs.worker_rows(error_chars)

    def status_frames(self, token: int) -> list:
        """The encoded answer to a status request."""
        return self.outputs.status_frames(token)

    def summary(self) -> dict[str, Any]:
        """Counters, evaluations and age statistics of the run (JSON-able)."""
        return self.outputs.summary()
