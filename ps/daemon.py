"""The ZeroMQ daemon: the only server module that touches sockets and the clock.

One ROUTER socket, one poll loop, one thread owning the :class:`ServerCore`:
``poll(timeout=next_deadline) -> decode -> core.handle -> encode -> send``
(the shape of zguide ``mdbroker.py``). Every deadline comes from ``clock`` (monotonic).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
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

from algorithms._pool import POOL
from problems.base import Problem
from protocol.chunks import split
from protocol.codec import decode, encode, error_text
from protocol.errors import LocalProtocolError, RemoteProtocolError, UnsupportedVersion
from protocol.messages import (
    CHUNK_THRESHOLD,
    MAX_HEADER_BYTES,
    MAX_PARTS,
    Bye,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Job,
    JobKind,
    Part,
    Ready,
    Reply,
    Status,
    StatusRequest,
    Welcome,
)
from protocol.wire import to_wire
from ps.connections import (
    DEFAULT_MAX_WORKERS,
    DEFAULT_MAX_WORKERS_PER_KEY,
    Conn,
    ConnectionLimits,
    Connections,
    RateLimitedLog,
)
from ps.core import Disconnect, Send, ServerCore
from ps.endpoints import needs_ipv6
from ps.persist import EventLog, Persistence, reply_from_wire
from worker.compute import describe_layout

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: no enum per call
log = logging.getLogger("latecomer.server")

MAX_BATCH = 256  # messages handled per poll wake-up before timers are checked again
HB_SLICE = 256  # server heartbeats sent per pass of the loop (see Daemon._heartbeat_some)


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
DRAIN_S = 2.0  # at shutdown, how long to wait for the workers to acknowledge the bye
MAX_SHM_LISTED = 1024  # summary.json lists at most this many workers that used shared memory


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
        limits: the bounds of the connection table (ps/connections.py); None: the defaults, with
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
                 limits: ConnectionLimits | None = None) -> None:
        self.core = core
        self.persist = persistence
        self.problem = problem
        self.stop = stop or StopCondition()
        self.eval_every = eval_every
        self.on_progress = on_progress
        self.clock = clock
        self.own_ctx = context is None
        self.ctx = context or zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.sndhwm = 4 * MAX_PARTS  # a job in parts is up to MAX_PARTS + 1 messages
        self.sock.rcvhwm = 8 * MAX_PARTS
        # Largest legal frame: one float64 gradient (libzmq applies MAXMSGSIZE per frame); the
        # header frame is far smaller. A peer sending more is disconnected by libzmq.
        self.max_array_bytes = core.dim * 8
        layout = tuple(getattr(problem, "layout", ()) or ())
        if not core.layout_text and layout:
            core.layout_text = describe_layout(layout)  # BAD_SHAPE texts name the blocks
        self.sock.setsockopt(zmq.MAXMSGSIZE, max(self.max_array_bytes, MAX_HEADER_BYTES) + 4096)
        # No ZMTP heartbeats: libzmq 4.3.5 aborts when the heartbeat timer fires on a connection
        # that was reset while its receive pipe was full (SECURITY.md, "the libzmq abort"); the
        # protocol's own heartbeats and the liveness timeout tell a silent worker, and TCP
        # keepalive closes a connection whose peer vanished (about 25 s).
        self.sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        self.sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 10)
        self.sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 5)
        self.sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
        self.sock.setsockopt(zmq.BACKLOG, 1024)  # the front connects once per client: bursts of them
        self.security = None
        if keys_dir is not None:
            from ps.security import ServerSecurity

            self.security = ServerSecurity(self.ctx, keys_dir)
            self.security.apply(self.sock)
        self.banned_keys: set[str] = set()  # keys of quarantined workers
        self.reload_keys = False  # set by SIGHUP
        self.recent_ages: deque[int] = deque(maxlen=4096)  # ages of the latest applied replies
        self.age_counts: dict[int, int] = {}  # age -> applied replies (all run long), for histograms
        self.versions: deque[tuple[float, int]] = deque(maxlen=256)  # (time, version) for the step rate
        self.lifecycle = logging.getLogger("latecomer.events")
        self.metrics = None  # a SnapshotCollector when --metrics-port is given
        self.next_publish = 0.0
        self.sock.ipv6 = needs_ipv6(bind)  # IPv6 literals only: IPv4 binds keep their plain endpoint
        self.sock.bind(bind)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if limits is None:
            xfer = 2 * self.max_array_bytes  # one transfer: a pair of float64 gradients
            limits = ConnectionLimits(idle_s=2 * core.cfg.liveness_timeout_s, transfer_bytes=xfer,
                                      transfer_total_bytes=max(64 << 20, 4 * xfer),
                                      hb_refresh_s=core.cfg.liveness_timeout_s / 3)
        # Every routing id's state (worker binding, key, transfer, rates): ps/connections.py.
        self.conns = Connections(limits, now=clock(), alloc=lambda n: POOL.empty((n,), np.uint8))
        self.max_workers = max_workers
        self.max_workers_per_key = max_workers_per_key
        self.refusals = RateLimitedLog(log)  # one line per 10 s per kind of refused hello
        self.events_file = EventLog(events_path) if events_path else None  # a full disk drops events, no crash
        self.events_dirty = False
        self.stopping: str | None = None
        self.hb_queue: collections.deque[bytes] = collections.deque()  # still to get this period's heartbeat
        self.started_at = clock()
        self.training_started_at: float | None = None  # when the first job went out
        self.evaluations: list[dict[str, float]] = []
        self.last_eval_version = -1
        self.send_failures = 0
        self.invalid_messages = 0
        self.bytes_in = 0
        self.wire_dtype = wire_dtype
        self.wire_cache: dict[int, np.ndarray] = {}  # iterate id -> its wire-dtype copy
        # Same-host path (ps/shm.py): offered to workers with our host id that ask for it.
        self.arena = None
        self.host_id = ""
        self.shm_used: set[str] = set()  # got at least one job through it (summary.json; MAX_SHM_LISTED)
        self.next_xfer = 0
        self.parts_in = self.parts_out = 0
        if shm not in ("auto", "any", "off"):
            raise ValueError(f"shm must be auto, any or off, got {shm!r}")
        self.shm_any = shm == "any"  # offer it to every worker that asks: its probe decides
        if shm != "off":
            from ps import shm as shm_mod

            if shm_mod.shm_dir_usable():
                try:
                    shm_mod.remove_stale()
                    self.arena = shm_mod.ShmArena(core.dim, core.server_boot)
                    self.host_id = shm_mod.host_id()
                    POOL.factory = self.arena.allocate  # new iterates are born in shared memory
                except OSError as e:
                    log.warning("shared memory unavailable (%s): TCP only", e)
                    self.arena = None

    # ------------------------------------------------------------------ lifecycle
    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: Any) -> None:
            self.stopping = f"signal {signal.Signals(signum).name}"
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

        def hup(signum: int, frame: Any) -> None:
            self.reload_keys = True
        signal.signal(signal.SIGHUP, hup)

    def evaluate(self) -> dict[str, float]:
        """Evaluate the current iterate. ``t`` counts from the first job issued (0 before)."""
        if self.training_started_at is None and self.core.started:
            self.training_started_at = self.clock()
        t = 0.0 if self.training_started_at is None else self.clock() - self.training_started_at
        ev = {"t": t, "version": float(self.core.version),
              **{k: float(v) for k, v in self.problem.evaluate(self.core.params()).items()}}
        self.evaluations.append(ev)
        self.last_eval_version = self.core.version
        return ev

    def run(self) -> str:
        """Serve until the stop condition or a signal. Returns the reason for stopping."""
        core = self.core
        self.evaluate()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        hb_every = server_heartbeat_period(core.cfg)
        next_hb = self.clock()
        next_progress = self.clock()
        try:
            while self.stopping is None:
                now = self.clock()
                deadline = min(now if self.hb_queue else next_hb, self._core_deadline(), next_progress + 0.2,
                               self.conns.next_deadline(),
                               now + self.persist.sync_due_in() if self.persist is not None else math.inf)
                timeout_ms = max(0, min(100, math.ceil((deadline - now) * 1000)))
                if poller.poll(timeout_ms):
                    for _ in range(MAX_BATCH):
                        if not self.sock.get(_EVENTS) & _POLLIN:  # cheaper than a zmq.Again
                            break
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_frames(frames)
                        if self.training_started_at is None and core.started:
                            self.training_started_at = self.clock()
                        if self._check_stop():
                            break
                now = self.clock()
                if self.reload_keys:
                    self.reload_keys = False
                    if self.security is not None:
                        self._revoke(self.security.reload())  # revocation without restart (SIGHUP)
                if now >= self._core_deadline() and self._journal("tick", now=now):
                    self._execute(core.on_tick(now))
                self.conns.expire(now)
                for rid, token in self.conns.status_due(now):  # status? answers that waited their turn
                    self._send_frames(rid, self.status_frames(token))
                if self.persist is not None:
                    self.persist.after_batch(core, now)
                if self.metrics is not None and now >= self.next_publish:
                    self.publish_metrics()
                    self.next_publish = now + 0.5
                if now >= next_hb:
                    self.hb_queue.extend(c.rid for c in self.conns.bound() if c.wid in core.workers)
                    next_hb = now + hb_every
                if self.hb_queue:
                    self._heartbeat_some()
                if self.eval_every and core.version >= self.last_eval_version + self.eval_every:
                    ev = self.evaluate()
                    if self.on_progress:
                        self.on_progress(self, ev)
                    next_progress = now
                if self.on_progress and now >= next_progress + 0.2:
                    self.on_progress(self, None)
                    next_progress = now
                if self.events_dirty:  # once per pass of the loop (a batch of messages), not per message
                    self.events_file.flush()
                    self.events_dirty = False
                self._check_stop()
        finally:
            self._shutdown()
        return self.stopping or "stopped"

    def _check_stop(self) -> bool:
        if self.stopping is None:
            loss = self.evaluations[-1].get("loss") if self.evaluations else None
            why = self.stop.reached(self.core.version, self.clock() - self.started_at, loss)
            if why:
                self.stopping = why
        return self.stopping is not None

    def _shutdown(self) -> None:
        self._journal("stop_issuing")
        self.core.issuing = False
        if self.persist is not None:
            self.persist.checkpoint(self.core)
        if self.last_eval_version != self.core.version or len(self.evaluations) < 2:
            self.evaluate()
        self._flush_events()
        self._drain(Bye(f"server stopping: {self.stopping}"))
        log.info("stopping: %s", self.stopping)

    def _drain(self, bye: Bye) -> None:
        """Tell every worker bye and wait (at most DRAIN_S) for their acknowledging bye. A worker
        that missed it (it was reconnecting) gets it again in answer to whatever it sends. The
        run is over: nothing received now reaches the core."""
        pending = {c.rid for c in self.conns.bound()}
        for rid in list(pending):
            if not self._send_raw(rid, bye):
                pending.discard(rid)
        deadline = self.clock() + DRAIN_S
        while pending and self.clock() < deadline:
            if not self.sock.poll(max(1, int((deadline - self.clock()) * 1000)), zmq.POLLIN):
                break
            frames = self.sock.recv_multipart(copy=False)
            rid = frames[0].bytes
            try:
                msg = decode(frames[1:], max_array_bytes=self.max_array_bytes)
            except RemoteProtocolError:
                continue
            if isinstance(msg, Bye):
                pending.discard(rid)
            else:
                self._send_raw(rid, bye)

    def close(self) -> None:
        if self.arena is not None:
            if POOL.factory == self.arena.allocate:
                POOL.factory = None
                POOL.clear()
            self.arena.close()
        if self.events_file:
            self.events_file.close()
            self.events_file = None
        if self.metrics is not None:
            self.metrics.close()
        # A short linger lets the final Bye messages reach the workers; everything else the
        # server would have sent is re-derivable from the job ledger. Terminating the context
        # waits for that flush (an exiting process would otherwise drop it).
        self.sock.close(linger=1000)
        if self.security is not None:
            self.security.stop()
        if self.own_ctx:
            self.ctx.term()

    # ------------------------------------------------------------------ inbound
    def _answer_error(self, conn: Conn, err: Error) -> None:
        """Answer a bad message, within the error rates of the connection table (one per
        connection per 0.2 s, 100 per second in all): a flood of garbage must not turn into a flood
        of answers (every bad message is still counted)."""
        if self.conns.may_answer_error(conn, self.clock()):
            self._send_raw(conn.rid, err)

    def _refuse(self, conn: Conn, wid: str, refusal: str, now: float, kind: str = "") -> None:
        """A hello refused by the daemon: counted (and journaled), answered ``err REFUSED``, and,
        for a ``kind`` of refusal an operator should hear of, logged at most once per 10 s."""
        self._count("refused")
        if kind:
            self.refusals.warning(kind, now, "refused hello from worker %s: %s", wid[:64], refusal)
        self._answer_error(conn, Error(ErrorCode.REFUSED, refusal))

    def _hello_refusal(self, conn: Conn, hello: Hello, key: str) -> tuple[str, str] | None:
        """Why the daemon refuses this hello, as (kind for the log or "", text), or None."""
        wid = hello.worker_id
        if conn.wid is not None and conn.wid != wid:  # one connection cannot be two workers
            return "", "routing id already bound to another worker"
        if key and key in self.banned_keys:
            return "", "this key is quarantined"
        w = self.core.workers.get(wid)
        if w is not None:
            return ("", "worker id in use with another key") if w.key != key else None
        # A new join: the caps.
        if len(self.core.workers) >= self.max_workers:
            return "max_workers", f"too many workers ({self.max_workers}; serve --max-workers)"
        if key and self.conns.workers_of_key(key) >= self.max_workers_per_key:
            return "max_workers_per_key", (f"key {key} already has {self.max_workers_per_key} workers "
                                           "(serve --max-workers-per-key)")
        return None

    def _count(self, kind: str) -> None:
        """A message that never reaches the core still counts (and is journaled, so replay agrees)."""
        if self._journal("count", kind=kind):
            setattr(self.core.counters, kind, getattr(self.core.counters, kind) + 1)

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        now = self.clock()
        rid = frames[0].bytes
        conn = self.conns.get(rid, now)  # created on the connection's first message
        body = frames[1].bytes if len(frames) == 2 and len(frames[1]) <= 512 else None  # a heartbeat is one frame
        if body is not None and self.conns.repeat_heartbeat(conn, body, now):
            return  # a repeat of the heartbeat handed on moments ago: it would change nothing
        try:
            msg = decode(frames[1:], max_array_bytes=self.max_array_bytes,
                         payload=lambda xfer, n: self.conns.take_transfer(conn, xfer, n))
            if isinstance(msg, Part):  # kept by the connection table (bounded), only after hello
                if conn.wid is None:
                    raise RemoteProtocolError("part from a connection that has not said hello")
                self.conns.add_part(conn, msg, now)
                self.parts_in += 1
                return
        except RemoteProtocolError as e:
            self.invalid_messages += 1
            self._count("invalid")
            log.debug("invalid message from %r: %s", rid[:32], e)
            code = ErrorCode.UNSUPPORTED_VERSION if isinstance(e, UnsupportedVersion) else ErrorCode.MALFORMED
            self._answer_error(conn, Error(code, "".join(c if c.isprintable() else "?" for c in str(e))[:200]))
            return
        self.bytes_in += sum(len(f) for f in frames)
        if isinstance(msg, StatusRequest):  # read-only: no core input, nothing journaled; rate-limited
            if self.conns.status_ask(conn, msg.token, now):
                self._send_frames(rid, self.status_frames(msg.token))
            return
        key = ""
        if self.security is not None:
            from ps.security import fingerprint

            user = frames[1].get("User-Id")  # the z85 public key CURVE authenticated
            key = fingerprint(user) if user else ""
        if isinstance(msg, Hello):
            wid = msg.worker_id
            refused = self._hello_refusal(conn, msg, key)
            if refused:
                self._refuse(conn, wid, refused[1], now, kind=refused[0])
                return
            self.conns.bind(conn, wid, key)  # a record bound to wid before loses it
            conn.parts = msg.parts
            if self.arena is not None:
                self.arena.forget_worker(wid)
                conn.shm_capable = bool(msg.shm and (self.shm_any or msg.host_id == self.host_id))
        else:
            wid = conn.wid
            if wid is None:
                if not isinstance(msg, Bye):
                    self._count("stray" if isinstance(msg, (Heartbeat, Ready)) else "invalid")
                    self._answer_error(conn, Error(ErrorCode.UNKNOWN_WORKER, "say hello first"))
                return
            if conn.key != key:  # another key took this routing id over
                self._count("invalid")
                self._answer_error(conn, Error(ErrorCode.REFUSED, "key does not match the worker's"))
                return
        frames_in = frames[1:]
        if isinstance(msg, Ready):
            if msg.shm and conn.shm_capable:
                conn.shm_ready = True
            else:
                if conn.shm_capable:
                    log.info("worker %s cannot open the shared memory: TCP for it", wid)
                conn.shm_ready = False
        refusal, wire = None, None
        if isinstance(msg, Reply):
            if msg.xfer:  # its arrays came in parts: the journal gets them with the message, as sent
                msg = dataclasses.replace(msg, xfer=0)
                frames_in = encode(msg) if self.persist is not None else frames_in
            if msg.in_shm:  # the gradients are in the slots lent for this job (float32)
                grads = None if msg.grads or self.arena is None else self.arena.gradients(wid, msg.job_id)
                msg = dataclasses.replace(msg, grads=grads or (), in_shm=False)  # none: the core refuses it
                frames_in = encode(msg) if self.persist is not None else frames_in
                wire = "f32" if self.wire_dtype != "f32" else None
            elif self.wire_dtype != "f32":
                msg, refusal = reply_from_wire(msg, self.wire_dtype)  # the journal keeps the wire frames
        if self.persist is not None and not self.persist.record_message(self.core, wid, msg, frames_in, now, key,
                                                                        wire=wire, refused=refusal is not None):
            return  # not journaled (the state directory cannot be written): not accepted, the core never sees it
        self._execute(self.core.handle(wid, msg, now, key, refusal))
        self.conns.handed_on(conn, body if isinstance(msg, Heartbeat) else None, now)
        if isinstance(msg, Bye):
            self._forget(wid)
        elif isinstance(msg, Hello):  # joined (or not): a live worker's record never expires
            self.conns.set_live(conn, conn.wid == wid and wid in self.core.workers, now)

    # ------------------------------------------------------------------ outbound
    def _execute(self, cmds: list) -> None:
        for c in cmds:
            if isinstance(c, Send):
                if not self._send(c.worker_id, c.msg):
                    self._unreachable(c.worker_id)
            elif isinstance(c, Disconnect):
                conn = self.conns.by_wid.get(c.worker_id)
                if conn is not None and conn.key:
                    self.banned_keys.add(conn.key)  # it cannot come back under a new id
                self._forget(c.worker_id)
        core = self.core
        if self.arena is not None and (self.arena.lent or self.arena.copies or self.arena.free_grad):
            self.arena.sweep(core.store, core.ledger, core.workers)
        if self.wire_cache:
            for iid in [i for i in self.wire_cache if i not in core.store]:
                del self.wire_cache[iid]
        self._flush_events()

    def _send(self, wid: str, msg: Any) -> bool:
        conn = self.conns.by_wid.get(wid)
        if conn is None:
            return False
        rid = conn.rid
        if isinstance(msg, Error) and wid not in self.core.workers:
            self._answer_error(conn, msg)  # to a written-off worker (UNKNOWN_WORKER): rate-limited
            return True
        if isinstance(msg, Job):
            msg = self._job_arrays(conn, msg)
            if conn.parts and sum(p.nbytes for p in msg.points) > CHUNK_THRESHOLD:
                self.next_xfer += 1
                messages = split(msg, self.next_xfer)  # large arrays: parts, then the job
                for frames in messages:
                    if not self._send_frames(rid, frames):
                        return False
                self.parts_out += len(messages) - 1
                return True
        elif isinstance(msg, Welcome):
            msg = dataclasses.replace(msg, wire_dtype=self.wire_dtype, parts=conn.parts,
                                      shm=self.arena.prefix if conn.shm_capable else "")
        return self._send_raw(rid, msg)

    def _job_arrays(self, conn: Conn, job: Job) -> Job:
        """Transport of a job's iterates: shared-memory slots for same-host workers, else the
        frames the core chose, converted to the wire dtype."""
        if conn.shm_ready:
            wid = conn.wid
            store = self.core.store
            refs = tuple(self.arena.iterate_slot(i, store[i]) for i in job.iterate_ids)
            n = 1 if job.kind == JobKind.FULL_GRAD else len(job.iterate_ids)
            if len(self.shm_used) < MAX_SHM_LISTED:
                self.shm_used.add(wid)
            return dataclasses.replace(job, point_ids=(), points=(), refs=refs,
                                       grad_slots=self.arena.lend(wid, job.job_id, n))
        if self.wire_dtype != "f32" and job.points:
            return dataclasses.replace(job, points=tuple(self._wire_iterate(i, p)
                                                         for i, p in zip(job.point_ids, job.points, strict=True)))
        return job

    def _wire_iterate(self, iid: int, x: np.ndarray) -> np.ndarray:
        """An iterate converted to the wire dtype once per version (cached while it is stored)."""
        held = self.wire_cache.get(iid)
        if held is None:
            held = self.wire_cache[iid] = to_wire(x, self.wire_dtype)
        return held

    def _send_raw(self, rid: bytes, msg: Any) -> bool:
        return self._send_frames(rid, encode(msg))

    def _send_frames(self, rid: bytes, frames: list) -> bool:
        try:
            self.sock.send_multipart([rid, *frames], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            self.send_failures += 1
            return False
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:
                self.send_failures += 1
                return False
            raise

    def _journal(self, op: str, **body: Any) -> bool:
        """Write-ahead: record a core input before the core sees it (see ps/persist.py). False:
        it could not be recorded (paused, the disk is full), so the core must not see it."""
        return self.persist is None or self.persist.append(op, **body)

    def _core_deadline(self) -> float:
        """When the core next needs a tick; never while paused (no input reaches the core then)."""
        if self.persist is not None and self.persist.paused is not None:
            return math.inf
        return self.core.next_deadline()

    def _forget(self, wid: str) -> None:
        """The worker said bye or was quarantined or revoked: its connection's record goes."""
        self.conns.forget(wid)

    def _heartbeat_some(self) -> None:
        """Send this period's heartbeat to the next HB_SLICE workers of the queue: a period's
        heartbeats go out a slice per pass of the loop, between batches of messages, so thousands
        of workers do not hold the others' replies back for the time of one long burst."""
        frames = encode(Heartbeat(boot=self.core.server_boot))  # the same bytes for every worker
        workers, queue = self.core.workers, self.hb_queue
        for _ in range(min(HB_SLICE, len(queue))):
            conn = self.conns.by_rid.get(queue.popleft())
            if conn is None or conn.wid not in workers:
                continue  # gone, or declared dead meanwhile (its record is kept a while)
            if not self._send_frames(conn.rid, frames):
                self._unreachable(conn.wid)

    def _revoke(self, allowed: set[str]) -> None:
        """Workers whose key left the allow-list are dropped now (CURVE only checks keys at the
        handshake, so their open connections would otherwise live on) and their keys banned."""
        for conn in self.conns.bound():
            wid, key = conn.wid, conn.key
            if key and key not in allowed:
                self.banned_keys.add(key)
                if wid in self.core.workers:
                    log.warning("worker %s: key %s revoked, disconnecting it", wid, key)
                    self._send(wid, Bye("revoked"))
                    now = self.clock()
                    if self._journal("remove", wid=wid, now=now, reason="revoked"):
                        self._execute(self.core.remove_worker(wid, now, reason="revoked"))
                self._forget(wid)

    def _unreachable(self, wid: str) -> None:
        """ROUTER_MANDATORY refused a send: the peer's connection is gone (a killed process closes
        its sockets at once) or its pipe is full. Write it off now, not after the liveness
        timeout. Its record is kept a while, so a reply it still sends is recognised as late."""
        if wid in self.core.workers:
            now = self.clock()
            if self._journal("remove", wid=wid, now=now, reason="unreachable"):
                self._execute(self.core.remove_worker(wid, now, reason="unreachable"))

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
                self.lifecycle.info("%s %s", kind, ev.get("worker_id", ""), extra={"event": ev})
            elif kind in FAILURE_LINES and (kind != "failed" or ev.get("worker_failed") == 1):
                self.lifecycle.warning(FAILURE_LINES[kind].format_map(ev), extra={"event": ev})
        if events:
            now = self.clock()
            if not self.versions or now - self.versions[-1][0] >= 0.1:
                self.versions.append((now, self.core.version))
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
        info.update(self.conns.figures())  # the connection table: records, transfers, rates (ps/connections.py)
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
        return dict(list(info.items())[:64])  # the map cap of the protocol

    def enable_metrics(self, port: int, addr: str = "127.0.0.1") -> None:
        from ps.metrics import serve_metrics

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
                              "paused": int(self.persist is not None and self.persist.paused is not None)})

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
                         now - w.last_seen, len(w.outstanding), max(ages) if ages else 0, state, w.failed,
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
        return {"endpoint": self.endpoint, "version": self.core.version, "stopped": self.stopping,
                "elapsed_s": self.clock() - self.started_at, "counters": c, "outstanding": self.core.outstanding,
                "accounted": self.core.accounted(), "evaluations": self.evaluations,
                "invalid_messages": self.invalid_messages, "send_failures": self.send_failures,
                "connections": {k[len("conn."):]: v for k, v in self.conns.figures().items()},
                "store_peak": self.core.store_peak,
                "transport": {"wire_dtype": self.wire_dtype, "shm": self.arena.prefix if self.arena else "",
                              "shm_workers": sorted(self.shm_used),
                              "shm_iterate_copies": self.arena.copies_made if self.arena else 0,
                              "parts_in": self.parts_in, "parts_out": self.parts_out}}


def write_outputs(out_dir: str, daemon: Daemon) -> None:
    """Write summary.json, final_x.npy and problem.json (the problem's spec and options, which
    ``latecomer export`` rebuilds it from) into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "problem.json"), "w", encoding="utf-8") as f:
        json.dump({"problem": daemon.core.cfg.problem, "problem_options": dict(daemon.core.cfg.problem_options)}, f,
                  indent=1)
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(daemon.summary(), f, indent=1)
    np.save(os.path.join(out_dir, "final_x.npy"), np.asarray(daemon.core.params()))
