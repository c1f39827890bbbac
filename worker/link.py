"""The worker's link to the server: the only worker module that imports zmq.

A DEALER socket with application heartbeats both ways, reconnection with exponential
backoff when the server goes silent, a fresh ``hello`` when the server restarts (its
``server_boot`` changes), and a graceful SIGTERM (say bye, exit). Compute runs in
:class:`worker.runner.ComputeThread`; this loop only moves messages.
"""

from __future__ import annotations

import dataclasses
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
from problems.trust import Allowed, worker_refusal
from protocol.chunks import Reassembler, split
from protocol.codec import decode, encode, error_text
from protocol.errors import RemoteProtocolError
from protocol.messages import (
    CHUNK_THRESHOLD,
    DEFAULT_MAX_ARRAY_BYTES,
    HEARTBEAT_INTERVAL_S,
    HELLO_BACKOFF_MAX_S,
    HELLO_BACKOFF_S,
    ID_IN_USE,
    LIVENESS_TIMEOUT_S,
    RECONNECT_IVL_MAX_S,
    RECONNECT_IVL_S,
    Bye,
    Cancel,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Job,
    Part,
    Ready,
    Reply,
    Welcome,
)
from protocol.shm import ShmReader, host_id, shm_dir_usable
from protocol.wire import from_wire, to_wire
from worker.identity import BASE_MAX, claim_default_id
from worker.runner import ComputeThread, DelaySpec, IterateCache
from worker.shards import ShardLinks, header_only
from worker.sockio import recv_frames, send_frames

# Plain ints: no enum per call.
_EVENTS, _POLLIN, _RCVTIMEO, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVTIMEO), int(zmq.NOBLOCK)
_F32 = np.dtype(np.float32)
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
    backoff_max_s: float = HELLO_BACKOFF_MAX_S  # a resumed server's restart grace covers it (ps.core.server_core)
    give_up_s: float | None = None
    max_jobs: int | None = None
    threads: int | None = None
    delay: DelaySpec = DelaySpec()
    key_secret: str | None = None  # CurveZMQ: this worker's NAME.key_secret file
    server_key: str | None = None  # CurveZMQ: the server's server.key file
    shm: str = "auto"  # same-host path: "auto" (use it when the server offers it) or "off"
    problem_overrides: tuple[tuple[str, str], ...] = ()  # worker-local problem options (problems.loader)
    allow_problems: tuple[str, ...] = ()  # user problems this worker trusts (problems.trust patterns)
    local_problems: tuple[str, ...] = ()  # local names (<local>:NAME#N) of the forking process it trusts exactly


class Worker:
    """One worker process's I/O loop. ``run()`` returns the reason it stopped."""

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

    # ------------------------------------------------------------------ socket
    def _connect(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 1000
        s.routing_id = f"{self.worker_id}/{self.boot:x}".encode()
        s.setsockopt(zmq.IMMEDIATE, 1)
        s.setsockopt(zmq.RECONNECT_IVL, round(RECONNECT_IVL_S * 1000))
        s.setsockopt(zmq.RECONNECT_IVL_MAX, round(RECONNECT_IVL_MAX_S * 1000))
        # No ZMTP heartbeats (PINGs): the protocol's own heartbeats and the liveness timeout tell a
        # silent server, and a PING queued behind a full receive pipe on a reset connection is what
        # makes libzmq 4.3.5 abort (SECURITY.md, "the libzmq abort"), on either end. TCP keepalive
        # closes a connection whose server vanished without a FIN.
        s.setsockopt(zmq.TCP_KEEPALIVE, 1)
        s.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 10)
        s.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 5)
        s.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
        s.setsockopt(zmq.HANDSHAKE_IVL, 5000)
        if self.curve is not None:
            s.curve_publickey, s.curve_secretkey, s.curve_serverkey = self.curve
        s.ipv6 = self.cfg.server.startswith("tcp://[")  # an IPv6 literal (ps/net/endpoints.py needs_ipv6)
        s.connect(self.cfg.server)
        self.sock = s
        self.rcvtimeo = -1
        self.welcomed = False

    def _send(self, msg: Any) -> bool:
        sock = self.sock
        if self.shards is not None and type(msg) is Reply and msg.grads:
            if not self.shards.send_blocks(msg):  # the blocks to the shards, then the header here
                return False
            msg = header_only(msg)
        try:
            if self.parts_ok and type(msg) is Reply and _nbytes(msg.grads) > CHUNK_THRESHOLD:
                self.next_xfer += 1
                for frames in split(msg, self.next_xfer):  # large gradients: parts, then the reply
                    send_frames(sock, frames, _NOBLOCK)
                return True
            send_frames(sock, encode(msg), _NOBLOCK)
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
        return self._send(Hello(worker_id=self.worker_id, boot=self.boot, credit=self.cfg.credit,
                                device=self.cfg.device, host_id=host_id(), holds=self.cache.ids(),
                                busy=self._busy(recent=True), seen=self.seen, run_id=self.run_id,
                                shm=self.cfg.shm == "auto" and shm_dir_usable(), parts=True))

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
                if self.shards is None and (compute is None or (self.loaded and compute.pending == 0
                                                                and not compute.outbox)):
                    self._receive_one(timeout_ms)
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
        wake = min(self.next_hb if self.welcomed else self.next_hello, now + 0.1)
        return max(0, int((wake - now) * 1000)) + 1

    def _receive_one(self, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for one message and handle it."""
        sock = self.sock
        if timeout_ms != self.rcvtimeo:
            sock.set(_RCVTIMEO, timeout_ms)
            self.rcvtimeo = timeout_ms
        try:
            frames = recv_frames(sock)
        except zmq.Again:  # the timeout
            return
        self._on_message(frames)

    def _poll(self, timeout_ms: int) -> None:
        """Wait for the socket or the compute thread's wake-up pipe; handle what is ready."""
        if self.poller_for != (self.sock, self.compute, self.shards):  # rebuilt on reconnect, a new problem
            self.poller = zmq.Poller()
            self.poller.register(self.sock, zmq.POLLIN)
            if self.compute is not None:
                self.poller.register(self.compute.wake_r, zmq.POLLIN)
            for s in self.shards.socks if self.shards is not None else ():
                self.poller.register(s, zmq.POLLIN)
            self.poller_for = (self.sock, self.compute, self.shards)
        ready = dict(self.poller.poll(timeout_ms))
        if self.shards is not None:
            for i, s in enumerate(self.shards.socks):
                if s in ready:
                    self._from_shard(i)
        sock = self.sock
        if sock in ready:
            for i in range(64):
                # The poll saw a message; after it, EVENTS is cheaper than a zmq.Again.
                if i and not sock.get(_EVENTS) & _POLLIN:
                    break
                try:
                    frames = recv_frames(sock, _NOBLOCK)
                except zmq.Again:
                    break
                self._on_message(frames)
                if sock is not self.sock:  # reconnected meanwhile
                    break
        if self.compute is not None and self.compute.wake_r in ready:
            self.compute.drain_wakeups()

    def _on_message(self, frames: list) -> None:
        self.last_contact = self.clock()
        self._on_frames(frames)
        if self.welcomed:
            self.backoff = self.cfg.backoff_s

    def _close(self) -> None:
        if self.sock is not None:
            if self.welcomed:  # our own leaving, or the acknowledgement of the server's bye
                self._send(Bye(_printable(self.stopping or "exit")[:1000]))
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

    # ------------------------------------------------------------------ inbound
    def _on_frames(self, frames: list) -> None:
        try:
            msg = decode(frames, payload=self.parts.take)
            kind = type(msg)  # the message classes are final: no isinstance needed
            if kind is Part:
                self.parts.add(msg)
                return
        except RemoteProtocolError as e:
            log.warning("undecodable message from server: %s", e)
            return
        if kind is Job:  # the common case first
            self._on_job(msg)
        elif kind is Welcome:
            self._on_welcome(msg)
        elif kind is Cancel:
            ids = set(msg.job_ids)
            if self.shards is not None:
                self.shards.cancel(ids)
            for jid in ids:
                self.jobs.pop(jid, None)
                self.waiting.pop(jid, None)
            if self.compute is not None:
                self.compute.cancel(ids)
        elif kind is Heartbeat:
            if self.server_boot is not None and msg.boot != self.server_boot:
                log.warning("server restarted: saying hello again")
                self.welcomed = False
        elif kind is Bye:
            self.stopping = f"server said bye: {msg.reason}"
        elif kind is Error:
            if msg.code == ErrorCode.UNKNOWN_WORKER:
                self.welcomed = False  # the server forgot us (restart, timeout): hello again
            elif msg.code == ErrorCode.UNSUPPORTED_VERSION:
                self.stopping = f"server refused: {msg.message}"
            elif msg.code == ErrorCode.REFUSED and msg.message.startswith(ID_IN_USE) and not self.welcomed:
                self._id_in_use(msg.message)
            elif msg.code == ErrorCode.REFUSED:  # e.g. benched: every job failed (PROTOCOL.md 8.8)
                log.warning("server refused: %s", msg.message)
            else:
                log.info("server error %s: %s (job %s)", msg.code.name, msg.message, msg.job_id)

    def _id_in_use(self, text: str) -> None:
        """Another live process has our worker id (two hosts or containers of one name sharing a
        key, PROTOCOL.md 8.1): a default id becomes ``ID-BOOT`` (this process's boot, so unique),
        and the hello goes again at once; an id the user gave stops the worker with one line."""
        if self.id_claim is None:
            self.stopping = f"server refused: {text}"
            return
        new_id = f"{self.worker_id[:BASE_MAX]}-{self.boot & 0xFFFFFF:06x}"
        log.warning("worker id %s is taken by another live process: this worker is %s from now on",
                    self.worker_id, new_id)
        self.id_claim.release()
        self.id_claim, self.worker_id = None, new_id
        self.next_hello = self.clock()

    def _on_welcome(self, w: Welcome) -> None:
        """A welcome: load the problem it names (if allowed and not loaded yet), settle what we
        hold against its run (another run: drop all; the same run from a new server process:
        resend), take its transport (wire dtype, parts, shared memory) and timing, say ready."""
        key = (w.problem, tuple(sorted(w.problem_options.items())))
        refusal = worker_refusal(w.problem, self.allowed)
        if refusal is not None:  # never import what a server names unless our command line allows it
            self._close_compute()
            self.problem_key, self.loaded, self.welcomed = key, False, True  # welcomed: bye on the way out
            self._load_failed(refusal)
            return
        if key != self.problem_key:
            self._start_loading(key, w)
        self._settle_run(w)
        self.server_boot = w.server_boot
        self.wire = w.wire_dtype
        self.parts_ok = w.parts
        self.shm = self._open_shm(w) if w.shm else None
        self._link_shards(w.shards)
        self.hb_interval = w.heartbeat_interval_s
        self.liveness = w.liveness_timeout_s
        self.welcomed = True
        if self.loaded:  # same problem as before (e.g. a server restart): ready at once
            self._send(Ready(credit=self.cfg.credit, holds=self.cache.ids(), shm=self.shm is not None))
        self._send_results()

    def _link_shards(self, shards: tuple) -> None:
        """A sharded server: connect to its shards (again, if they moved), else none."""
        if self.shards is not None and self.shards.map == tuple(shards):
            self.shards.wire = self.wire
            return
        if self.shards is not None:
            self.shards.close()
            self.shards = None
        if shards:  # the same-host path to a shard on this host, as to the server (--shm)
            self.shards = ShardLinks(self.ctx, shards, f"{self.worker_id}/{self.boot:x}".encode(), curve=self.curve,
                                     shm=self.cfg.shm == "auto" and shm_dir_usable(), wire=self.wire)
            log.info("sharded server: %d shards", len(shards))

    def _from_shard(self, i: int) -> None:
        for what, x in self.shards.receive(i):
            if what == "gone":  # settled at the server (written off, cancelled): drop it
                self.jobs.pop(x, None)
            elif x.job_id in self.jobs:
                self._on_job(x, whole=True)

    def _close_compute(self) -> None:
        if self.compute is not None:
            self.compute.close()
            self.compute = None

    def _start_loading(self, key: tuple, w: Welcome) -> None:
        """A new problem: its compute thread loads it (the worker's own options merged in)."""
        self._close_compute()
        spec, options, device, threads = w.problem, dict(w.problem_options), self.cfg.device, self.cfg.threads
        overrides = dict(self.cfg.problem_overrides)

        def load():
            if overrides:  # refused (a failed load) unless the factory declares them worker-local
                from problems.loader import merge_worker_options
                problem = self._load_problem(spec, merge_worker_options(spec, options, overrides), device=device)
            else:
                problem = self._load_problem(spec, options, device=device)
            if threads and "torch" in sys.modules:  # only torch problems pay for importing torch
                sys.modules["torch"].set_num_threads(threads)
            return problem

        self.problem_key = key
        self.loaded = False
        self.compute = ComputeThread(load, self.cfg.delay, finish=self._finish)
        self.cache.items.clear()
        self.jobs.clear()
        self.waiting.clear()

    def _settle_run(self, w: Welcome) -> None:
        if w.run_id != self.run_id:
            # Another run (a fresh server): nothing we hold belongs to it. A resumed run keeps its
            # run id, and then our unanswered jobs and unsent replies are still wanted.
            if self.jobs and self.compute is not None:
                self.compute.cancel(set(self.jobs))
            self.jobs.clear()
            self.waiting.clear()
            self.unsent.clear()
            self.recent.clear()
            self.cache.items.clear()  # iterate ids restart at 0 in every run
            self.seen = -1
            self.run_id = w.run_id
        elif self.server_boot is not None and w.server_boot != self.server_boot:
            # The same run, resumed by a new server process: resend what it may not have read.
            pending = {r.job_id for r in self.unsent}
            resend = [r for _, r in self.recent if r.job_id not in pending] + self.unsent
            # Gradients left in the old server's shared memory travel as frames now.
            self.unsent = [r for r in (self._detach(r, w.wire_dtype) for r in resend) if r is not None]
            self.recent.clear()

    def _open_shm(self, w: Welcome) -> ShmReader | None:
        """The server's shared memory (the same-host path), if its probe succeeds from here."""
        try:
            reader = ShmReader(w.shm)
            why = reader.probe(w.server_boot)
        except ValueError as e:
            why = str(e)
        if why is None:
            log.info("same-host path: iterates and gradients through shared memory %s", w.shm)
            return reader
        log.warning("same-host path unavailable (%s): using TCP", why)
        return None

    def _on_job(self, job: Job, whole: bool = False) -> None:
        if self.compute is None:
            return
        if job.job_id > self.seen:
            self.seen = job.job_id
        if self.shards is not None and not whole:  # its iterates come from the shards
            self.jobs[job.job_id] = job
            need = tuple(dict.fromkeys(i for i in job.iterate_ids if self.cache.get(i) is None))
            self.shards.fetch(job, need, self.clock())
            return
        if job.refs or job.grad_slots:  # same-host path: the iterates are in shared memory
            self._on_shm_job(job)
            return
        cache, wire = self.cache, self.wire
        for iid, p in zip(job.point_ids, job.points, strict=True):
            if wire == "f32" and type(p) is np.ndarray and p.dtype == _F32:  # from_wire's identity, unchecked
                cache.put(iid, p)
                continue
            try:
                cache.put(iid, from_wire(p, wire))
            except ValueError as e:
                log.warning("job %d: %s", job.job_id, e)
                return  # never cached: the server's ledger writes the job off as vanished
        self.jobs[job.job_id] = job
        points = tuple([cache.get(i) for i in job.iterate_ids])
        if any(p is None for p in points):
            missing = tuple(i for i, p in zip(job.iterate_ids, points, strict=True) if p is None)
            self.waiting[job.job_id] = job
            self._send(Error(ErrorCode.MISSING_ITERATE, "iterate not in cache", job_id=job.job_id,
                             iterate_ids=missing))
            return
        if self.waiting:
            self.waiting.pop(job.job_id, None)
        self._run(job, points)
        if len(cache.items) > cache.capacity:
            cache.evict({i for j in self.jobs.values() for i in j.iterate_ids})

    def _on_shm_job(self, job: Job) -> None:
        self.jobs[job.job_id] = job
        self.shm_jobs[job.job_id] = [self.server_boot, None]
        if self.shm is None or len(job.refs) != len(job.iterate_ids):
            self.jobs.pop(job.job_id, None)
            self._send(Error(ErrorCode.REFUSED, "shared-memory job, but no shared memory here", job_id=job.job_id))
            return
        try:
            points = tuple(self.shm.view(s) for s in job.refs)
        except (OSError, ValueError) as e:
            self.jobs.pop(job.job_id, None)
            self._send(Error(ErrorCode.REFUSED, _printable(f"shared memory: {e}")[:200], job_id=job.job_id))
            return
        self._run(job, points)

    def _run(self, job: Job, points: tuple) -> None:
        compute = self.compute
        if compute.can_inline():
            compute.run_inline(job, points, self.cache.ids())  # sent at once: the holds are now
            self._send_results()
        else:
            compute.submit(job, points)

    def _finish(self, job: Job, grads: tuple) -> tuple[tuple, bool]:
        """On the compute side, after the gradients: put them where the server reads them.
        Returns the reply's gradients and whether they went to shared memory."""
        if job.grad_slots:
            if len(grads) != len(job.grad_slots):
                raise ValueError(f"{len(grads)} gradients for {len(job.grad_slots)} shared-memory slots")
            for g, slot in zip(grads, job.grad_slots, strict=True):
                dst = self.shm.view(slot, writable=True)
                if dst.size != g.size:
                    raise ValueError(f"gradient of {g.size} values, shared-memory slot of {dst.size}")
                np.copyto(dst, g.reshape(-1))
            held = self.shm_jobs.get(job.job_id)
            if held is not None:
                held[1] = grads  # for a resend to a restarted server
            return (), True
        if self.wire != "f32":
            return tuple(to_wire(g, self.wire) for g in grads), False
        return grads, False

    # ------------------------------------------------------------------ outbound
    def _send_results(self) -> None:
        while True:
            try:
                jid, reply, error = self.compute.outbox.popleft()
            except IndexError:
                break
            if jid == ComputeThread.LOAD_FAILED:
                self._load_failed(error)
                return
            if jid == ComputeThread.LOADED:
                self.loaded = True
                if self.welcomed:
                    self._send(Ready(credit=self.cfg.credit, holds=self.cache.ids(), shm=self.shm is not None))
                continue
            if self.jobs.pop(jid, None) is None:
                continue  # cancelled meanwhile
            if error is not None:  # the compute side logged it (FailureLog); the server records a failed job
                self._send(Error(ErrorCode.COMPUTE_FAILED, error_text(error), job_id=jid))
                continue
            self.unsent.append(reply)
        while self.unsent and self.welcomed:
            r = self.unsent[0]
            if r.in_shm and self.shm_jobs.get(r.job_id, (None,))[0] != self.server_boot:
                r = self._detach(r, self.wire)  # computed for the previous server process
                if r is None:
                    self.unsent.pop(0)
                    continue
            holds = self.cache.ids()
            if r.holds != holds:  # computed inline, the reply says it already
                r = _with_holds(r, holds)
            if not self._send(r):
                break
            self.unsent.pop(0)
            self.replies_sent += 1
            now = self.clock()
            self.recent.append((now, r))
            while self.recent and now - self.recent[0][0] > self.liveness:
                self.recent.popleft()
        if self.shm_jobs:  # keep only what a resend after a server restart could need
            keep = {r.job_id for _, r in self.recent} | {r.job_id for r in self.unsent} | set(self.jobs)
            for jid in [j for j in self.shm_jobs if j not in keep]:
                del self.shm_jobs[jid]

    def _load_failed(self, reason: str) -> None:
        """The welcome's problem cannot be loaded here: tell the server why (PROBLEM_UNAVAILABLE)
        and stop; :func:`run_worker` then prints the reason and exits with status 3."""
        spec = self.problem_key[0] if self.problem_key else "?"
        # The loader's one-line ValueErrors name the spec already, and so does our line.
        reason = reason.removeprefix("ValueError: ").removeprefix(f"problem {spec!r}: ")
        self.failure = self.stopping = f"cannot load problem {spec}: {reason}"
        self._send(Error(ErrorCode.PROBLEM_UNAVAILABLE, error_text(reason)))

    def _detach(self, r: Reply, wire: str) -> Reply | None:
        """A shared-memory reply as a frame reply (for a new server process, which cannot read
        the old one's slots); None if its gradients are gone, or if the wire dtype is not f32:
        the gradient was computed at the exact float32 iterate, not at the quantized one a TCP
        reply implies, and recovery recomputes it at the latter. The new server writes a
        dropped job off (it is not in our busy list)."""
        if not r.in_shm:
            return r
        grads = self.shm_jobs.get(r.job_id, (None, None))[1]
        if grads is None or wire != "f32":
            log.info("job %d: its reply went to the previous server's shared memory; dropped", r.job_id)
            return None
        return dataclasses.replace(r, grads=tuple(to_wire(g, wire) for g in grads), in_shm=False)


def _with_holds(r: Reply, holds: tuple[int, ...]) -> Reply:
    """``dataclasses.replace(r, holds=holds)``, at a third of the cost (once per reply)."""
    return Reply(job_id=r.job_id, created_at=r.created_at, grads=r.grads, loss=r.loss, count=r.count,
                 compute_s=r.compute_s, holds=holds, in_shm=r.in_shm)


def _nbytes(arrays: tuple) -> int:
    return sum([a.nbytes for a in arrays])


def _load_curve(cfg: WorkerConfig) -> tuple[bytes, bytes, bytes]:
    """(public, secret, server public) for CURVE; ValueError with the culprit if unusable."""
    from worker.keys import client_keys

    return client_keys(cfg.key_secret, cfg.server_key)


def _printable(text: str) -> str:
    """Protocol strings are printable: tracebacks and odd bytes become spaces."""
    return "".join(c if c.isprintable() else " " for c in text)


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
