"""The worker's link to the server: its DEALER socket and the loop that moves messages.

A DEALER socket with application heartbeats both ways, reconnection with exponential
backoff when the server goes silent, a fresh ``hello`` when the server restarts (its
``server_boot`` changes), and a graceful SIGTERM (say bye, exit). Compute runs in
:class:`worker.runner.ComputeThread`; this loop only moves messages. ``Worker`` composes its
parts: the session with the server (worker/session.py), jobs in (worker/intake.py) and replies
out (worker/replies.py); a sharded server's shards are worker/shards.py's.
"""

from __future__ import annotations

import logging
import secrets
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import zmq

from algorithms._pool import POOL
from problems.loader import is_local
from problems.trust import Allowed
from protocol.chunks import Reassembler, chunking
from protocol.codec import encode
from protocol.messages import (
    DEFAULT_MAX_ARRAY_BYTES,
    HEARTBEAT_INTERVAL_S,
    HELLO_BACKOFF_MAX_S,
    HELLO_BACKOFF_S,
    LIVENESS_TIMEOUT_S,
    Bye,
    Heartbeat,
    Hello,
    Job,
    Reply,
)
from protocol.seal import GCM, available_ciphers
from protocol.shm import ShmReader, host_id, shm_dir_usable
from protocol.spin import SpinWindow, usable_cpus
from worker.identity import claim_default_id
from worker.intake import JobIntake
from worker.replies import ReplySender, printable
from worker.runner import ComputeThread, DelaySpec, IterateCache
from worker.sealed import SealedLink
from worker.session import ServerSession
from worker.shards import header_only
from worker.sockio import dealer_options, recv_frames, recv_within, send_frames

# Plain ints: no enum per call.
_EVENTS, _POLLIN, _RCVTIMEO, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVTIMEO), int(zmq.NOBLOCK)
log = logging.getLogger("latecomer.worker")
EXIT_PROBLEM_UNAVAILABLE = 3  # exit status of `latecomer work` when the server's problem cannot be loaded here


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one worker process.

    Attributes:
        server: endpoint, e.g. ``tcp://10.0.0.1:5555``.
        worker_id: stable name (default: the key's NAME under CurveZMQ, else ``HOST-PID``;
            see worker/identity.py).
        credit: jobs held at once (1: compute one, 2: one prefetched).
        device: torch device for torch problems (``cpu``, ``cuda``, ``cuda:1``).
        cache_size: iterates kept by id (at least credit + 1).
        backoff_s, backoff_max_s: reconnect backoff (doubling).
        give_up_s: exit after this long without any contact with a server (None: never).
        max_jobs: exit after this many replies (None: never); for tests.
        threads: torch intra-op threads (None: leave torch's default).
        shm: "auto" asks a server on this host for the shared-memory path; "off" never does.
        busy_poll: "auto" busy-polls the wait for the next job for as long as the server's jobs
            advise (``Job.spin_us``: where this host has a CPU for each of the run's processes on
            it); "off" never does.
        problem_overrides: ``(key, value)`` pairs laid over the options of the server's problem
            (``--problem-opt``); only options its factory declares worker-local are accepted.
        allow_problems: patterns of the user problems (``module:callable``) this worker loads
            when a server names them (``--allow-problem``; problems/trust.py); the built-ins
            need none. Any other problem a welcome names is refused before anything is imported.
        local_problems: local names (``<local>:NAME#N``, problems/loader.py ``register_local``)
            this worker loads: set only by the Python API for the workers it forks (they
            inherit the table of local factories); a name not registered here never loads.
    """

    server: str
    worker_id: str = ""
    credit: int = 1
    device: str = "cpu"
    cache_size: int = 4
    backoff_s: float = HELLO_BACKOFF_S
    backoff_max_s: float = HELLO_BACKOFF_MAX_S  # a resumed server's restart grace covers it (ps.core.config)
    give_up_s: float | None = None
    max_jobs: int | None = None
    threads: int | None = None
    delay: DelaySpec = DelaySpec()
    key_secret: str | None = None  # CurveZMQ: this worker's NAME.key_secret file
    server_key: str | None = None  # CurveZMQ: the server's server.key file
    shm: str = "auto"  # same-host path: "auto" (use it when the server offers it) or "off"
    busy_poll: str = "auto"  # busy-poll the wait for a job as the server advises ("auto") or never ("off")
    problem_overrides: tuple[tuple[str, str], ...] = ()  # worker-local problem options (problems.loader)
    allow_problems: tuple[str, ...] = ()  # user problems this worker trusts (problems.trust patterns)
    local_problems: tuple[str, ...] = ()  # local names (<local>:NAME#N) of the forking process it trusts exactly


class Worker(ServerSession, JobIntake, ReplySender, SealedLink):
    """One worker process's I/O loop. ``run()`` returns the reason it stopped.

    Its parts: the socket, the loop and its timers here; what the server says (worker/session.py),
    jobs in (worker/intake.py), replies out (worker/replies.py)."""

    def __init__(self, config: WorkerConfig, *, load_problem: Callable[..., Any] | None = None,
                 clock: Callable[[], float] = time.monotonic, context: zmq.Context | None = None) -> None:
        if config.credit < 1:
            raise ValueError("credit must be >= 1")
        self.cfg = config
        self.id_claim = None if config.worker_id else claim_default_id(config.key_secret)  # worker/identity.py
        self.worker_id = config.worker_id or self.id_claim.worker_id
        if not (self.worker_id.isascii() and self.worker_id.isprintable() and 0 < len(self.worker_id) <= 64):
            raise ValueError(f"worker id must be 1-64 printable ASCII characters, got {self.worker_id!r}")
        self.boot = secrets.randbits(63)
        self.clock = clock
        self.curve = _load_curve(config) if config.key_secret or config.server_key else None
        self.own_ctx = context is None
        self.ctx = context or zmq.Context()
        if load_problem is None:
            from problems import load_problem as _lp
            load_problem = _lp
        self._load_problem = load_problem
        self.allowed = Allowed.from_flags(config.allow_problems)  # ValueError: a bad pattern
        for name in config.local_problems:
            if not is_local(name):
                raise ValueError(f"local_problems: {name!r} is not a local name (<local>:NAME#N)")
            self.allowed = self.allowed.naming(problem=name)
        self.problem_key: tuple | None = None
        self.loaded = False  # the compute thread has loaded the current problem
        self.compute: ComputeThread | None = None
        self.cache = IterateCache(max(config.cache_size, config.credit + 1))
        self.jobs: dict[int, Job] = {}  # received, not answered (running, queued or waiting for iterates)
        self.wire = "f32"  # how the server sends iterates and wants gradients (Welcome.wire_dtype)
        self.shm: ShmReader | None = None  # the server's shared memory, when it offered and we could open it
        # job id -> [server boot whose memory it used, its gradients once computed]: a reply to a
        # server process that is gone is resent as frames (``_detach``)
        self.shm_jobs: dict[int, list] = {}
        self.parts_ok = False  # the server takes large arrays in parts (Welcome.parts)
        self.chunking = chunking(self.curve is not None)  # how its large replies are split
        self._init_seal()  # the sealed data connection (worker/sealed.py)
        self.parts = Reassembler(2 * DEFAULT_MAX_ARRAY_BYTES, alloc=lambda n: POOL.empty((n,), np.uint8))
        self.next_xfer = 0
        self.waiting: dict[int, Job] = {}  # jobs waiting for a missing iterate
        self.unsent: list[Reply] = []  # replies that could not be sent (disconnected)
        # Replies sent within the last liveness timeout: a server that crashes may never have
        # read them. Resent to a restarted server of the same run (it ignores duplicates).
        # Bounded by count too: each holds a gradient, and only the last few can be in flight.
        self.recent: deque[tuple[float, Reply]] = deque(maxlen=2 * config.credit + 2)
        self.seen = -1  # highest job id received in run ``run_id``
        self.run_id = 0  # the run this worker works for (from Welcome; 0: none yet)
        self.server_boot: int | None = None
        self.hb_interval = HEARTBEAT_INTERVAL_S
        self.liveness = LIVENESS_TIMEOUT_S
        self.welcomed = False
        self.replies_sent = 0
        self.stopping: str | None = None
        self.failure: str | None = None  # why the worker stops on its own failure (its problem cannot be loaded)
        self.sock: zmq.Socket | None = None
        self.rcvtimeo = -1  # the socket's RCVTIMEO (ms), set only when it changes
        self.poller: zmq.Poller | None = None
        self.poller_for: tuple | None = None  # (socket, compute thread) the poller watches
        self.shards = None  # a sharded server's shards (worker/shards.py), from Welcome.shards
        # its CPUs (for the hello), and its busy polling as the server's jobs advise (Job.spin_us, §6.4)
        self.cpus, self.spin_us, self.spin = usable_cpus(), 0, SpinWindow(0.0, time.perf_counter)

    # ------------------------------------------------------------------ socket
    def _connect(self) -> None:
        self._close_seal()
        if self.sock is not None:
            self.sock.close(linger=0)
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 1000
        s.routing_id = f"{self.worker_id}/{self.boot:x}".encode()
        s.setsockopt(zmq.IMMEDIATE, 1)
        dealer_options(s, self.cfg.server)  # worker/sockio.py: reconnection, keepalive, no ZMTP PINGs
        if self.curve is not None:
            s.curve_publickey, s.curve_secretkey, s.curve_serverkey = self.curve
        s.connect(self.cfg.server)
        self.sock = s
        self.rcvtimeo = -1
        self.welcomed = False

    def _send(self, msg: Any) -> bool:
        kind = type(msg)
        if self.shards is not None and kind is Reply and msg.grads:
            if not self.shards.send_blocks(msg):  # the blocks to the shards, then the header here
                return False
            msg = header_only(msg)
        sealed = self.seal_up and kind is not Hello
        chunks = self.plain_chunking if sealed else self.chunking
        try:
            if kind is Reply and self.parts_ok:
                nbytes = 0
                for a in msg.grads:
                    nbytes += a.nbytes
                if nbytes > chunks.threshold:
                    self.next_xfer += 1
                    for frames in chunks.split(msg, self.next_xfer):  # large gradients: parts, then the reply
                        self._out(frames, sealed)
                    return True
            if sealed:
                self._out(encode(msg), True)
            else:  # what _out does with it (worker/sealed.py)
                send_frames(self.sock, encode(msg), _NOBLOCK)
            return True
        except zmq.Again:  # not connected (IMMEDIATE) or pipe full: the caller keeps the message
            return False

    def _busy(self, *, recent: bool = False) -> tuple[int, ...]:
        """Jobs received and not answered yet: computing, queued, waiting, or reply unsent (and,
        for a hello, replies sent so recently that a crashed server may not have read them)."""
        ids = tuple(self.jobs) + tuple(r.job_id for r in self.unsent)
        if recent:
            ids += tuple(r.job_id for _, r in self.recent if r.job_id not in ids)
        return ids[:256]

    def _hello(self) -> bool:
        self._close_seal()  # a new session comes with the welcome
        return self._send(Hello(worker_id=self.worker_id, boot=self.boot, credit=self.cfg.credit,
                                device=self.cfg.device, host_id=host_id(), holds=self.cache.ids(),
                                busy=self._busy(recent=True), seen=self.seen, run_id=self.run_id,
                                shm=self.cfg.shm == "auto" and shm_dir_usable(), parts=True, shards=True,
                                seal=self.curve is not None, seal_segments=self.curve is not None,
                                seal_ciphers=tuple(c for c in available_ciphers() if c != GCM) if self.curve else (),
                                cpus=self.cpus))

    # ------------------------------------------------------------------ main loop
    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: Any) -> None:
            self.stopping = f"signal {signal.Signals(signum).name}"
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run(self) -> str:
        self._connect()
        now = self.clock()
        self.last_contact = now  # last message from a server
        self.backoff = self.cfg.backoff_s
        self.next_hello = self.next_hb = now
        try:
            while self.stopping is None:
                timeout_ms = self._timers()
                if self.stopping is not None:
                    break
                compute = self.compute
                # Nothing can come from the compute thread (no problem loading, no job on it, no
                # result waiting): then a blocking receive with a timeout, one poll syscall per
                # message, instead of a zmq_poll of the socket and the wake-up pipe (four).
                # pending drops only after a result is in the outbox (runner.py), so this order
                # of the two reads never misses one.
                if self.shards is None and (self.seal_sock is None or self.seal_up) and (
                        compute is None or (self.loaded and compute.pending == 0 and not compute.outbox)):
                    if self.seal_sock is None:
                        self._receive_one(timeout_ms)
                    else:
                        self._receive_sealed(timeout_ms)
                else:
                    self._poll(timeout_ms)
                    compute = self.compute
                if compute is not None and (compute.outbox or self.unsent):
                    self._send_results()
                if self.cfg.max_jobs is not None and self.replies_sent >= self.cfg.max_jobs:
                    self.stopping = f"did {self.replies_sent} jobs"
        finally:
            self._close()
        return self.stopping or "stopped"

    def _timers(self) -> int:
        """Hello (with backoff), heartbeat, liveness and give-up; returns the receive timeout (ms)."""
        now = self.clock()
        if self.sealer is not None and self._seal_timers():  # worker/sealed.py: the data connection dropped
            self.welcomed, self.next_hello, self.backoff = False, now, self.cfg.backoff_s
        if not self.welcomed and now >= self.next_hello:
            self._hello()
            self.next_hello = now + self.backoff
            self.backoff = min(self.backoff * 2, self.cfg.backoff_max_s)
        if self.welcomed and now >= self.next_hb:
            self._send(Heartbeat(boot=self.boot, credit=self.cfg.credit, busy=self._busy(), seen=self.seen))
            self.next_hb = now + self.hb_interval
        if self.shards is not None and self.shards.assembling:
            self.shards.refetch(now)
        if now - self.last_contact > self.liveness and self.welcomed:
            log.warning("server silent for %.1f s: reconnecting", now - self.last_contact)
            self._connect()
            self.next_hello = now
            self.backoff = self.cfg.backoff_s
        if self.cfg.give_up_s is not None and now - self.last_contact > self.cfg.give_up_s:
            self.stopping = f"no server for {self.cfg.give_up_s:g} s"
        wake = self.next_hb if self.welcomed else self.next_hello
        ms = int(((wake if wake < now + 0.1 else now + 0.1) - now) * 1000)
        return (ms if ms > 0 else 0) + 1

    def _receive_one(self, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for one message and handle it."""
        spin = self.spin
        if spin.bound:  # busy polling, as the server's jobs advise (protocol/spin.py)
            frames = spin.spin(self._take_now, timeout_ms / 1000.0) or spin.block(lambda: self._recv_wait(timeout_ms))
            if frames is not None:
                self._on_message(frames)
            return
        sock = self.sock  # _recv_wait's steps, here
        if timeout_ms != self.rcvtimeo:
            sock.set(_RCVTIMEO, timeout_ms)
            self.rcvtimeo = timeout_ms
        try:
            frames = recv_frames(sock)
        except zmq.Again:  # the timeout
            return
        self._on_message(frames)

    def _take_now(self) -> list | None:
        """The message the socket holds now, without waiting (None: none)."""
        sock = self.sock
        return recv_frames(sock, _NOBLOCK) if sock.get(_EVENTS) & _POLLIN else None

    def _recv_wait(self, timeout_ms: int) -> list | None:
        frames, self.rcvtimeo = recv_within(self.sock, timeout_ms, self.rcvtimeo)
        return frames

    def _poll(self, timeout_ms: int) -> None:
        """Wait for the socket or the compute thread's wake-up pipe; handle what is ready."""
        seal = self.seal_sock
        if self.poller_for != (self.sock, self.compute, self.shards, seal):  # rebuilt on reconnect, ...
            self.poller = zmq.Poller()
            self.poller.register(self.sock, zmq.POLLIN)
            if seal is not None:
                self.poller.register(seal.fileno(), zmq.POLLIN)  # ready() names it by its descriptor
                self.poll_seal_out = False
            if self.compute is not None:
                self.poller.register(self.compute.wake_r, zmq.POLLIN)
            for s in self.shards.socks if self.shards is not None else ():
                self.poller.register(s, zmq.POLLIN)
            self.poller_for = (self.sock, self.compute, self.shards, seal)
        if seal is not None and seal.wants_write != self.poll_seal_out:  # wait to write what it holds, too
            self.poll_seal_out = seal.wants_write
            self.poller.modify(seal.fileno(), zmq.POLLIN | (zmq.POLLOUT if self.poll_seal_out else 0))
        ready = dict(self.poller.poll(timeout_ms))
        if self.shards is not None:
            for i, s in enumerate(self.shards.socks):
                if s in ready:
                    self._from_shard(i)
        if self.sock in ready:
            self._drain(self.sock, self._on_message, lambda: self.sock)  # stops on a reconnection
        if seal is not None and seal is self.seal_sock and seal.fileno() in ready:
            self._drain_sealed()  # worker/sealed.py
        if self.compute is not None and self.compute.wake_r in ready:
            self.compute.drain_wakeups()

    @staticmethod
    def _drain(sock: zmq.Socket, handle: Callable[[list], None], current: Callable[[], Any]) -> None:
        """Handle up to 64 of the messages ``sock`` holds (a poll saw one; after it, EVENTS is
        cheaper than a zmq.Again), until it is no longer ``current()``."""
        for i in range(64):
            if i and not sock.get(_EVENTS) & _POLLIN:
                break
            try:
                frames = recv_frames(sock, _NOBLOCK)
            except zmq.Again:
                break
            handle(frames)
            if sock is not current():
                break

    def _on_message(self, frames: list) -> None:
        self.last_contact = self.clock()
        self._on_frames(frames)
        if self.welcomed:
            self.backoff = self.cfg.backoff_s

    def _close(self) -> None:
        if self.spin.spins or self.spin.bound:
            log.info("busy polls: %d, %d of them took a message", self.spin.spins, self.spin.hits)
        if self.sock is not None:
            if self.welcomed:  # our own leaving, or the acknowledgement of the server's bye
                self._send(Bye(printable(self.stopping or "exit")[:1000]))
            self._close_seal(linger=500)
            self.sock.close(linger=500)
            self.sock = None
        if self.shards is not None:
            self.shards.close()
            self.shards = None
        if self.own_ctx:
            self.ctx.term()  # waits (up to the linger) for the bye to leave
        if self.compute is not None:
            self.compute.close()
            self.compute = None
        if self.id_claim is not None:  # a default id is free for the next worker of this key
            self.id_claim.release()

def _load_curve(cfg: WorkerConfig) -> tuple[bytes, bytes, bytes]:
    """(public, secret, server public) for CURVE; ValueError with the culprit if unusable."""
    from worker.keys import client_keys

    return client_keys(cfg.key_secret, cfg.server_key)


def run_worker(config: WorkerConfig) -> str:
    """Run a worker in this process until told to stop; returns the reason. If the server's
    problem cannot be loaded here, prints one line saying why on stderr and exits the process
    with status 3 (EXIT_PROBLEM_UNAVAILABLE), after telling the server."""
    w = Worker(config)
    w.install_signal_handlers()
    reason = w.run()
    if w.failure is not None:
        sys.stderr.write(f"latecomer worker: {w.failure}\n")
        sys.stderr.flush()
        raise SystemExit(EXIT_PROBLEM_UNAVAILABLE)
    return reason
