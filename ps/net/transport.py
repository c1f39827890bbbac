"""The server's end of the wire: frames in, validated messages with their peer out, and back.

ps-lite's ``Van`` is the model: the core and the algorithms never see it. :class:`ServerTransport`
owns the ROUTER socket and everything that is about connections rather than training:

* decoding, with the protocol's limits, and large arrays that come in ``part`` messages
  (reassembled per connection, bounded: ps/net/connections.py);
* the connection table (one :class:`~ps.net.connections.Conn` per routing id: the worker a hello
  bound it to, its CURVE key, its transfer, its rates, its heartbeat repeats);
* the CURVE identity of a message (the key the handshake authenticated) and the caps on
  workers in total and per key, quarantined keys;
* the same-host path (iterates and gradients in shared memory slots, protocol/shm.py) and the
  wire dtype (iterates converted for sending, replies converted back);
* rate-limited answers to what never reaches the core (errors, ``status?``);
* the server's heartbeats, a slice per pass of the loop.

:meth:`ServerTransport.receive` turns one ROUTER message into at most one :class:`Inbound`
(what the core is to be fed, with what the journal keeps) or a :class:`Count` (a message the
core never sees, which still counts); :meth:`ServerTransport.send` turns a core command's message
into frames for its worker. The transport reads the core (its worker table, its iterate store)
but never changes it: the daemon journals and feeds the core (ps/drivers/daemon.py).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import zmq

from algorithms._pool import POOL
from protocol.chunks import split
from protocol.codec import decode, encode
from protocol.errors import RemoteProtocolError, UnsupportedVersion
from protocol.messages import (
    CHUNK_THRESHOLD,
    ID_IN_USE,
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
    StatusRequest,
    Welcome,
)
from protocol.wire import to_wire
from ps.core.iterates import EvictionCursor
from ps.journal.replies import reply_from_wire
from ps.net.connections import (
    DEFAULT_MAX_WORKERS,
    DEFAULT_MAX_WORKERS_PER_KEY,
    Conn,
    ConnectionLimits,
    Connections,
    RateLimitedLog,
)
from ps.net.endpoints import needs_ipv6
from worker.sockio import recv_frames, send_frames

_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # plain ints: no enum per call
log = logging.getLogger("latecomer.server")

HB_SLICE = 256  # server heartbeats sent per pass of the loop (see ServerTransport.heartbeat_some)
MAX_SUPERSEDED = 4096  # replaced (worker id, boot) pairs remembered (ps/net/transport.py _hello_refusal)
MAX_SHM_LISTED = 1024  # summary.json lists at most this many workers that used shared memory
SMALL_MESSAGE = 512  # a message of one frame at most this long may be a heartbeat repeat


@dataclass
class Inbound:
    """A message for the core, from the worker ``wid`` over ``conn``.

    ``frames``: what the journal keeps of it (as received, or re-encoded when the transport
    changed it: arrays from parts or from shared memory). ``wire``: the dtype its gradients
    travelled in when not the run's (the same-host path is float32). ``refusal``: why the
    transport refuses the reply's gradients (the core counts it as bad)."""

    conn: Conn
    wid: str
    msg: Any
    key: str
    frames: list
    wire: str | None = None
    refusal: str | None = None
    body: bytes | None = None  # a small one-frame message: kept to recognise a heartbeat's repeats


@dataclass(frozen=True)
class Count:
    """A message the core never sees that still counts (``invalid``, ``stray``, ``refused``)."""

    kind: str


def server_socket(ctx: zmq.Context, bind: str, max_array_bytes: int, security: Any = None) -> zmq.Socket:
    """The ROUTER socket, its options (protocol/PROTOCOL.md §2) and its bind."""
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.sndhwm = 4 * MAX_PARTS  # a job in parts is up to MAX_PARTS + 1 messages
    sock.rcvhwm = 8 * MAX_PARTS
    # Largest legal frame: one float64 gradient (libzmq applies MAXMSGSIZE per frame); the
    # header frame is far smaller. A peer sending more is disconnected by libzmq.
    sock.setsockopt(zmq.MAXMSGSIZE, max(max_array_bytes, MAX_HEADER_BYTES) + 4096)
    # No ZMTP heartbeats: libzmq 4.3.5 aborts when the heartbeat timer fires on a connection
    # that was reset while its receive pipe was full (SECURITY.md, "the libzmq abort"); the
    # protocol's own heartbeats and the liveness timeout tell a silent worker, and TCP
    # keepalive closes a connection whose peer vanished (about 25 s).
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 10)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 5)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    sock.setsockopt(zmq.BACKLOG, 1024)  # the front connects once per client: bursts of them
    if security is not None:
        security.apply(sock)
    sock.ipv6 = needs_ipv6(bind)  # IPv6 literals only: IPv4 binds keep their plain endpoint
    sock.bind(bind)
    return sock


def _open_arena(dim: int, boot: int) -> tuple[Any, str]:
    """The same-host path's shared memory (protocol/shm.py), or (None, "") where unusable."""
    from protocol import shm as shm_mod

    if not shm_mod.shm_dir_usable():
        return None, ""
    try:
        shm_mod.remove_stale()
        arena = shm_mod.ShmArena(dim, boot)
        POOL.factory = arena.allocate  # new iterates are born in shared memory
        return arena, shm_mod.host_id()
    except OSError as e:
        log.warning("shared memory unavailable (%s): TCP only", e)
        return None, ""


def _remember(table: collections.OrderedDict, key: Any) -> None:
    """``key`` as the newest entry of a bounded table (the oldest dropped past MAX_SUPERSEDED)."""
    table[key] = None
    table.move_to_end(key)
    while len(table) > MAX_SUPERSEDED:
        table.popitem(last=False)


class ServerTransport:
    """The ROUTER socket and the per-connection state (see the module docstring).

    Args:
        core: read only: its worker table (``workers``), iterate store, ledger, dimension, boot
            and configuration.
        bind: the endpoint to bind.
        clock: the daemon's monotonic clock.
        keys_dir: CurveZMQ keys (ps/net/security.py); None: no security.
        shm: ``auto`` (same-host workers that ask), ``any`` (every worker that asks) or ``off``.
        wire_dtype: the dtype iterates and gradients travel in.
        max_workers, max_workers_per_key: the caps a new join must pass.
        limits: the connection table's bounds; None: derived from the core's configuration.
        journaled: the daemon journals what the core is fed (a reply whose arrays came in parts
            or in shared memory is then re-encoded, so the journal holds them).
    """

    def __init__(self, ctx: zmq.Context, core: Any, bind: str, *, clock: Callable[[], float],
                 keys_dir: str | None = None, shm: str = "auto", wire_dtype: str = "f32",
                 max_workers: int = DEFAULT_MAX_WORKERS, max_workers_per_key: int = DEFAULT_MAX_WORKERS_PER_KEY,
                 limits: ConnectionLimits | None = None, journaled: bool = False) -> None:
        if shm not in ("auto", "any", "off"):
            raise ValueError(f"shm must be auto, any or off, got {shm!r}")
        self.core = core
        self.clock = clock
        self.journaled = journaled  # a reply whose arrays the transport changed is re-encoded for the journal
        self.max_array_bytes = max(core.dim, 1) * 8  # a sharded coordinator (dim 0) takes empty arrays
        self.security = None
        if keys_dir is not None:
            from ps.net.security import ServerSecurity

            self.security = ServerSecurity(ctx, keys_dir)
        self.sock = server_socket(ctx, bind, self.max_array_bytes, self.security)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.conns = Connections(limits or self.default_limits(core), now=clock(),
                                 alloc=lambda n: POOL.empty((n,), np.uint8))
        self.max_workers, self.max_workers_per_key = max_workers, max_workers_per_key
        self.banned_keys: set[str] = set()  # keys of quarantined or revoked workers
        self.refusals = RateLimitedLog(log)  # one line per 10 s per kind of refused hello
        # (worker id, boot) of incarnations a newer boot replaced: if one speaks again, two live
        # processes share the id (PROTOCOL.md 8.1). Oldest dropped past MAX_SUPERSEDED.
        self.superseded: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        # Ids proven shared that way: a new boot of one is refused while its holder is live (a twin
        # that restarts, e.g. under Restart=always, cannot take the id back and forth).
        self.contested: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.hb_queue: collections.deque[bytes] = collections.deque()  # still to get this period's heartbeat
        self.wire_dtype = wire_dtype
        self.wire_cache: dict[int, np.ndarray] = {}  # iterate id -> its wire-dtype copy
        self.evictions = EvictionCursor()  # which iterates left the core's store (sweep)
        self.shm_any = shm == "any"  # offer it to every worker that asks: its probe decides
        self.arena, self.host_id = _open_arena(core.dim, core.server_boot) if shm != "off" else (None, "")
        self.shm_used: set[str] = set()  # got at least one job through it (summary.json; MAX_SHM_LISTED)
        self.next_xfer = 0
        self.shards_map: Callable[[], tuple] = tuple  # a sharded server's Welcome.shards (ps/sharded/hub.py)
        self.parts_in = self.parts_out = 0
        self.send_failures = self.invalid_messages = self.bytes_in = 0

    @staticmethod
    def default_limits(core: Any) -> ConnectionLimits:
        """An idle connection forgotten after twice the liveness timeout, a transfer of at most
        two float64 gradients per connection and four such transfers' worth (at least 64 MiB) in
        all, heartbeat repeats dropped within a third of the liveness timeout."""
        xfer = 2 * core.dim * 8
        return ConnectionLimits(idle_s=2 * core.cfg.liveness_timeout_s, transfer_bytes=xfer,
                                transfer_total_bytes=max(64 << 20, 4 * xfer),
                                hb_refresh_s=core.cfg.liveness_timeout_s / 3)

    # ------------------------------------------------------------------ inbound
    def pending(self) -> Iterator[list]:
        """What the socket holds now, one ROUTER message (its frames) at a time."""
        while self.sock.get(_EVENTS) & _POLLIN:  # cheaper than a zmq.Again
            try:
                yield recv_frames(self.sock, _NOBLOCK)
            except zmq.Again:
                return

    def is_repeat(self, conn: Conn | None, frames: list, now: float) -> bool:
        """Whether this message of ``conn`` is a heartbeat repeat (see :meth:`receive`), checked
        before it is queued: dropped then, it costs a bytes comparison and nothing else."""
        return (conn is not None and conn.hb_raw is not None and len(frames) == 2
                and len(frames[1]) <= SMALL_MESSAGE and self.conns.repeat_heartbeat(conn, frames[1].bytes, now))

    def receive(self, frames: list, now: float, status: Callable[[int], list]) -> Inbound | Count | None:
        """One ROUTER message: what the core is to be fed (:class:`Inbound`), a message that only
        counts (:class:`Count`), or None (a part, a heartbeat repeat, a ``status?`` answered with
        ``status(token)``'s frames)."""
        rid = frames[0].bytes
        conn = self.conns.get(rid, now)  # created on the connection's first message
        body = frames[1].bytes if len(frames) == 2 and len(frames[1]) <= SMALL_MESSAGE else None
        if body is not None and self.conns.repeat_heartbeat(conn, body, now):
            return None  # a repeat of the heartbeat handed on moments ago: it would change nothing
        msg = self._decode(conn, frames, now)
        if msg is None or isinstance(msg, Count):
            return msg
        self.bytes_in += sum(len(f) for f in frames)
        if isinstance(msg, StatusRequest):  # read-only: no core input, nothing journaled; rate-limited
            if self.conns.status_ask(conn, msg.token, now):
                self.send_frames(rid, status(msg.token))
            return None
        key = self._key(frames[1])
        wid = self._identify(conn, msg, key, now)
        if wid is None or isinstance(wid, Count):
            return wid
        if isinstance(msg, Ready):
            self._ready(conn, msg)
        inbound = Inbound(conn, wid, msg, key, frames[1:], body=body)
        return self._reply_arrays(inbound) if isinstance(msg, Reply) else inbound

    def _decode(self, conn: Conn, frames: list, now: float) -> Any:
        try:
            msg = decode(frames[1:], max_array_bytes=self.max_array_bytes,
                         payload=lambda xfer, n: self.conns.take_transfer(conn, xfer, n))
            if isinstance(msg, Part):  # kept by the connection table (bounded), only after hello
                if conn.wid is None:
                    raise RemoteProtocolError("part from a connection that has not said hello")
                self.conns.add_part(conn, msg, now)
                self.parts_in += 1
                return None
            return msg
        except RemoteProtocolError as e:
            self.invalid_messages += 1
            log.debug("invalid message from %r: %s", conn.rid[:32], e)
            code = ErrorCode.UNSUPPORTED_VERSION if isinstance(e, UnsupportedVersion) else ErrorCode.MALFORMED
            self.answer_error(conn, Error(code, "".join(c if c.isprintable() else "?" for c in str(e))[:200]))
            return Count("invalid")

    def _key(self, frame: Any) -> str:
        """The fingerprint of the z85 public key CURVE authenticated for this message ("" without keys)."""
        if self.security is None:
            return ""
        from ps.net.security import fingerprint

        user = frame.get("User-Id")
        return fingerprint(user) if user else ""

    def _identify(self, conn: Conn, msg: Any, key: str, now: float) -> str | Count | None:
        """The worker a message is from: a hello binds its connection (or is refused), anything
        else must come over a bound connection with the same key."""
        if isinstance(msg, Hello):
            refused = self._hello_refusal(conn, msg, key, now)
            if refused:
                return self._refuse(conn, msg.worker_id, refused[1], now, kind=refused[0])
            self.conns.bind(conn, msg.worker_id, key)  # a record bound to wid before loses it
            conn.parts = msg.parts
            if self.arena is not None:
                self.arena.forget_worker(msg.worker_id)
                conn.shm_capable = bool(msg.shm and (self.shm_any or msg.host_id == self.host_id))
            return msg.worker_id
        if conn.wid is None:
            if isinstance(msg, Bye):
                return None
            self.answer_error(conn, Error(ErrorCode.UNKNOWN_WORKER, "say hello first"))
            return Count("stray" if isinstance(msg, (Heartbeat, Ready)) else "invalid")
        if conn.key != key:  # another key took this routing id over
            self.answer_error(conn, Error(ErrorCode.REFUSED, "key does not match the worker's"))
            return Count("invalid")
        return conn.wid

    def _hello_refusal(self, conn: Conn, hello: Hello, key: str, now: float) -> tuple[str, str] | None:
        """Why the transport refuses this hello, as (kind for the log or "", text), or None."""
        wid = hello.worker_id
        if conn.wid is not None and conn.wid != wid:  # one connection cannot be two workers
            return "", "routing id already bound to another worker"
        if key and key in self.banned_keys:
            return "", "this key is quarantined"
        w = self.core.workers.get(wid)
        if (wid, hello.boot) in self.superseded or (  # a replaced incarnation speaks again: not a restart
                wid in self.contested and w is not None and w.boot != hello.boot
                and now - w.last_seen < self.core.cfg.liveness_timeout_s):  # a proven twin's next boot
            _remember(self.contested, wid)
            return "id_in_use", (f"{ID_IN_USE}: {wid[:64]} belongs to another live process (a newer boot took it); "
                                 "give each worker its own --worker-id")
        if w is not None:
            if w.key != key:
                return "", "worker id in use with another key"
            if w.boot != hello.boot:  # a new incarnation replaces w: a restart, unless w speaks again
                _remember(self.superseded, (wid, w.boot))
            return None
        # A new join: the caps.
        if len(self.core.workers) >= self.max_workers:
            return "max_workers", f"too many workers ({self.max_workers}; serve --max-workers)"
        if key and self.conns.workers_of_key(key) >= self.max_workers_per_key:
            return "max_workers_per_key", (f"key {key} already has {self.max_workers_per_key} workers "
                                           "(serve --max-workers-per-key)")
        return None

    def _refuse(self, conn: Conn, wid: str, refusal: str, now: float, kind: str = "") -> Count:
        """A refused hello: answered ``err REFUSED`` and, for a ``kind`` of refusal an operator
        should hear of, logged at most once per 10 s; it counts as ``refused``."""
        if kind:
            self.refusals.warning(kind, now, "refused hello from worker %s: %s", wid[:64], refusal)
        self.answer_error(conn, Error(ErrorCode.REFUSED, refusal))
        return Count("refused")

    def _ready(self, conn: Conn, msg: Ready) -> None:
        if msg.shm and conn.shm_capable:
            conn.shm_ready = True
            return
        if conn.shm_capable:
            log.info("worker %s cannot open the shared memory: TCP for it", conn.wid)
        conn.shm_ready = False

    def _reply_arrays(self, inb: Inbound) -> Inbound:
        """A reply's gradients as the core takes them (float32 or float64 arrays in the message),
        with the frames the journal keeps."""
        msg, journaled = inb.msg, self.journaled
        if msg.xfer:  # its arrays came in parts: the journal gets them with the message, as sent
            msg = dataclasses.replace(msg, xfer=0)
            inb.frames = encode(msg) if journaled else inb.frames
        if msg.in_shm:  # the gradients are in the slots lent for this job (float32)
            grads = None if msg.grads or self.arena is None else self.arena.gradients(inb.wid, msg.job_id)
            msg = Reply(msg.job_id, msg.created_at, grads or (), msg.loss, msg.count, msg.compute_s, msg.holds,
                        False, msg.xfer)  # no grads: the core refuses it (a constructor: replace() costs 4x)
            inb.frames = encode(msg) if journaled else inb.frames
            inb.wire = "f32" if self.wire_dtype != "f32" else None
        elif self.wire_dtype != "f32":
            msg, inb.refusal = reply_from_wire(msg, self.wire_dtype)  # the journal keeps the wire frames
        inb.msg = msg
        return inb

    def handled(self, inb: Inbound, now: float) -> None:
        """The core has taken ``inb``: the connection's record follows (heartbeat repeats, a bye,
        a hello that joined or not)."""
        conn, msg = inb.conn, inb.msg
        self.conns.handed_on(conn, inb.body if isinstance(msg, Heartbeat) else None, now)
        if isinstance(msg, Bye):
            self.conns.forget(inb.wid)
        elif isinstance(msg, Hello):  # joined (or not): a live worker's record never expires
            self.conns.set_live(conn, conn.wid == inb.wid and inb.wid in self.core.workers, now)

    # ------------------------------------------------------------------ outbound
    def answer_error(self, conn: Conn, err: Error) -> None:
        """Answer a bad message, within the error rates of the connection table (one per
        connection per 0.2 s, 100 per second in all): a flood of garbage must not turn into a
        flood of answers (every bad message is still counted)."""
        if self.conns.may_answer_error(conn, self.clock()):
            self.send_message(conn.rid, err)

    def send(self, wid: str, msg: Any) -> bool:
        """A core command's message to worker ``wid``. False: the worker cannot be reached (its
        connection is gone or its pipe is full)."""
        conn = self.conns.by_wid.get(wid)
        if conn is None:
            return False
        if isinstance(msg, Error) and wid not in self.core.workers:
            self.answer_error(conn, msg)  # to a written-off worker (UNKNOWN_WORKER): rate-limited
            return True
        if isinstance(msg, Job):
            msg = self._job_arrays(conn, msg)
            if conn.parts and sum(p.nbytes for p in msg.points) > CHUNK_THRESHOLD:
                self.next_xfer += 1
                messages = split(msg, self.next_xfer)  # large arrays: parts, then the job
                self.parts_out += len(messages) - 1
                return all(self.send_frames(conn.rid, frames) for frames in messages)
        elif isinstance(msg, Welcome):
            msg = dataclasses.replace(msg, wire_dtype=self.wire_dtype, parts=conn.parts,
                                      shm=self.arena.prefix if conn.shm_capable else "", shards=self.shards_map())
        return self.send_message(conn.rid, msg)

    def _job_arrays(self, conn: Conn, job: Job) -> Job:
        """Transport of a job's iterates: shared-memory slots for same-host workers, else the
        frames the core chose, converted to the wire dtype."""
        if conn.shm_ready:
            store = self.core.store
            refs = tuple(self.arena.iterate_slot(i, store[i]) for i in job.iterate_ids)
            n = 1 if job.kind == JobKind.FULL_GRAD else len(job.iterate_ids)
            if len(self.shm_used) < MAX_SHM_LISTED:
                self.shm_used.add(conn.wid)
            return Job(job.job_id, job.kind, job.created_at, job.iterate_ids, job.seed, job.batch_size, job.shard,
                       job.deadline, (), (), refs, self.arena.lend(conn.wid, job.job_id, n), job.xfer)
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

    def send_message(self, rid: bytes, msg: Any) -> bool:
        return self.send_frames(rid, encode(msg))

    def send_frames(self, rid: bytes, frames: list) -> bool:
        try:
            send_frames(self.sock, [rid, *frames], _NOBLOCK)
            return True
        except zmq.Again:
            self.send_failures += 1
            return False
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:
                self.send_failures += 1
                return False
            raise

    def sweep(self) -> None:
        """After the core's commands: shared-memory slots and wire copies of iterates the core no
        longer holds are released."""
        core = self.core
        gone = self.evictions.take(core)  # only these left the store since the last sweep (None: unknown)
        if self.arena is not None and (self.arena.lent or self.arena.copies or self.arena.free_grad):
            self.arena.sweep(core.store, core.ledger, core.workers, gone)
        if self.wire_cache:
            for iid in [i for i in (self.wire_cache if gone is None else gone)
                        if i in self.wire_cache and i not in core.store]:
                del self.wire_cache[iid]

    # ------------------------------------------------------------------ heartbeats
    def start_heartbeats(self) -> None:
        """A new heartbeat period: every live worker is queued for its heartbeat."""
        workers = self.core.workers
        self.hb_queue.extend(c.rid for c in self.conns.bound() if c.wid in workers)

    def heartbeat_some(self) -> list[str]:
        """Send this period's heartbeat to the next HB_SLICE workers of the queue: a period's
        heartbeats go out a slice per pass of the loop, between batches of messages, so thousands
        of workers do not hold the others' replies back for the time of one long burst. Returns
        the workers that could not be reached."""
        frames = encode(Heartbeat(boot=self.core.server_boot))  # the same bytes for every worker
        workers, queue, gone = self.core.workers, self.hb_queue, []
        for _ in range(min(HB_SLICE, len(queue))):
            conn = self.conns.by_rid.get(queue.popleft())
            if conn is None or conn.wid not in workers:
                continue  # gone, or declared dead meanwhile (its record is kept a while)
            if not self.send_frames(conn.rid, frames):
                gone.append(conn.wid)
        return gone

    # ------------------------------------------------------------------ the end
    def drain(self, bye: Bye, deadline: float) -> None:
        """Tell every worker bye and wait (until ``deadline``) for their acknowledging bye. A
        worker that missed it (it was reconnecting) gets it again in answer to whatever it sends."""
        pending = {c.rid for c in self.conns.bound()}
        for rid in list(pending):
            if not self.send_message(rid, bye):
                pending.discard(rid)
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
                self.send_message(rid, bye)

    def close(self) -> None:
        if self.arena is not None:
            if POOL.factory == self.arena.allocate:
                POOL.factory = None
                POOL.clear()
            self.arena.close()
        # A short linger lets the final Bye messages reach the workers; everything else the
        # server would have sent is re-derivable from the job ledger.
        self.sock.close(linger=1000)
        if self.security is not None:
            self.security.stop()

    def figures(self) -> dict[str, Any]:
        """For summary.json's ``transport``."""
        return {"wire_dtype": self.wire_dtype, "shm": self.arena.prefix if self.arena else "",
                "shm_workers": sorted(self.shm_used),
                "shm_iterate_copies": self.arena.copies_made if self.arena else 0,
                "parts_in": self.parts_in, "parts_out": self.parts_out}
