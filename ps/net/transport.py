"""The server's end of the wire: frames in, validated messages with their peer out, and back.

ps-lite's ``Van`` is the model: the core and the algorithms never see it. :class:`ServerTransport`
owns the ROUTER socket and everything that is about connections rather than training. It is the
one server-side transport: the daemon's (the default) and a shard's data path (configured with a
:class:`~ps.net.routed.ShardRole`, PROTOCOL.md §12.1) share the socket's setup and its bounds,
parts in and out, the same-host path and the wire dtype:

* decoding, with the protocol's limits, and large arrays that come in ``part`` messages
  (reassembled per connection, bounded: ps/net/connections.py);
* the connection table (one :class:`~ps.net.connections.Conn` per routing id: the worker a hello
  bound it to, its CURVE key, its transfer, its rates, its heartbeat repeats);
* the CURVE identity of a message (the key the handshake authenticated) and the caps on
  workers in total and per key, quarantined keys;
* the same-host path (iterates and gradients in shared memory slots, protocol/shm.py) and the
  wire dtype (iterates converted for sending, replies converted back);
* rate-limited answers to what never reaches the core (errors, ``status?``);
* the server's heartbeats, a slice per pass of the loop;
* hello: a daemon binds a connection with it (its rules: ps/net/admission.py) and answers with
  ``welcome``; a shard knows a connection by its routing id (ps/net/routed.py), answers a hello
  only to offer its shared memory, and tells a connection that it takes parts with a welcome
  after the first job it sends it.

:meth:`ServerTransport.receive` turns one ROUTER message into at most one :class:`Inbound`
(what the core is to be fed, with what the journal keeps) or a :class:`Count` (a message the
core never sees, which still counts); :meth:`ServerTransport.send` turns a core command's message
into frames for its worker. The transport reads the core (its worker table, its iterate store)
but never changes it: the daemon journals and feeds the core (ps/drivers/daemon.py). A shard's
:meth:`ServerTransport.receive_routed` hands the shard a fetch or a reply (its block as the frames
the journal keeps) and :meth:`ServerTransport.send_routed` sends its answers.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import zmq

from algorithms._pool import POOL
from protocol.chunks import chunking
from protocol.codec import DEFAULT_MAX_ARRAY_BYTES, decode, encode
from protocol.errors import RemoteProtocolError, UnsupportedVersion
from protocol.messages import (
    MAX_HEADER_BYTES,
    MAX_PARTS,
    Bye,
    Error,
    ErrorCode,
    Fetch,
    Heartbeat,
    Hello,
    Job,
    Part,
    Ready,
    Reply,
    StatusRequest,
    Welcome,
)
from protocol.seal import GCM
from protocol.wire import WIRE_NUMPY, to_wire
from ps.core.iterates import EvictionCursor
from ps.journal.replies import reply_from_wire
from ps.net.admission import Admission
from ps.net.connections import (
    DEFAULT_MAX_WORKERS,
    DEFAULT_MAX_WORKERS_PER_KEY,
    Conn,
    ConnectionLimits,
    Connections,
    RateLimitedLog,
)
from ps.net.endpoints import needs_ipv6
from ps.net.handover import HandedPath
from ps.net.routed import MAX_PARTS_PEERS, PartsIn, ShardPeers, ShardRole, worker_of
from ps.net.samehost import SliceSameHost, lend_job, offers_shm, open_arena, opened_shm
from ps.net.sealed import OpenFrame, SealedPath
from worker.sockio import recv_frames, send_frames

_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # plain ints: no enum per call
_NBYTES = operator.attrgetter("nbytes")  # an array's size, for sum(map(...)): no generator per job sent
log = logging.getLogger("latecomer.server")

HB_SLICE = 256  # server heartbeats sent per pass of the loop (see ServerTransport.heartbeat_some)
MAX_SHM_LISTED = 1024  # summary.json lists at most this many workers that used shared memory
SMALL_MESSAGE = 512  # a message of one frame at most this long may be a heartbeat repeat
SHARD_HWM = 256  # a shard's data socket: its send and receive high-water marks (messages)
TRANSFER_TIMEOUT_S = 10.0  # a shard: an unfinished transfer from a worker that got no part for this long is dropped
TRANSFER_TOTAL_MIN = 64 << 20  # a shard: all unfinished transfers together, four blocks' worth, at least this


def with_spin(job: Job, spin_us: int) -> Job:
    """``job`` with the busy-poll advice ``spin_us``: built positionally, a quarter of what
    ``dataclasses.replace`` costs on every job of an advised worker (the field order is
    tests/unit/test_fastcodec.py's to keep)."""
    return Job(job.job_id, job.kind, job.created_at, job.iterate_ids, job.seed, job.batch_size, job.shard,
               job.deadline, job.point_ids, job.points, job.refs, job.grad_slots, job.xfer, spin_us)


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


def router_socket(ctx: zmq.Context, security: Any, sndhwm: int, rcvhwm: int) -> zmq.Socket:
    """A server's ROUTER (protocol/PROTOCOL.md §2): an unroutable send fails rather than vanishing,
    under CurveZMQ if the server runs it."""
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.sndhwm, sock.rcvhwm = sndhwm, rcvhwm
    if security is not None:
        security.apply(sock)
    return sock


def bind_router(sock: zmq.Socket, bind: str, max_array_bytes: int) -> None:
    """Bind ``sock``, its largest frame one float64 array of ``max_array_bytes`` (libzmq applies
    MAXMSGSIZE per frame, and copies a socket's options into the listener when it binds); the
    header frame is far smaller. A peer sending more is disconnected by libzmq."""
    sock.setsockopt(zmq.MAXMSGSIZE, max(max_array_bytes, MAX_HEADER_BYTES) + 4096)
    sock.ipv6 = needs_ipv6(bind)  # IPv6 literals only: IPv4 binds keep their plain endpoint
    sock.bind(bind)


def server_socket(ctx: zmq.Context, bind: str, max_array_bytes: int, security: Any = None) -> zmq.Socket:
    """The daemon's ROUTER socket, its options (protocol/PROTOCOL.md §2) and its bind."""
    # A job in parts is up to MAX_PARTS + 1 messages.
    sock = router_socket(ctx, security, 4 * MAX_PARTS, 8 * MAX_PARTS)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    # No ZMTP heartbeats: libzmq 4.3.5 aborts when the heartbeat timer fires on a connection
    # that was reset while its receive pipe was full (SECURITY.md, "the libzmq abort"); the
    # protocol's own heartbeats and the liveness timeout tell a silent worker, and TCP
    # keepalive closes a connection whose peer vanished (about 25 s).
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 10)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 5)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    sock.setsockopt(zmq.BACKLOG, 1024)  # the front connects once per client: bursts of them
    bind_router(sock, bind, max_array_bytes)
    return sock


def vector_limits(core: Any) -> ConnectionLimits:
    """The daemon's connection table: an idle connection forgotten after twice the liveness
    timeout, a transfer of at most two float64 gradients per connection and four such transfers'
    worth (at least 64 MiB) in all, heartbeat repeats dropped within a third of the liveness timeout,
    and a connection's heartbeats past four times the rate its interval asks for (at least 10/s) dropped too."""
    xfer = 2 * core.dim * 8
    hb_rate = max(10.0, 4.0 / core.cfg.heartbeat_interval_s)  # four times what a worker is told
    return ConnectionLimits(idle_s=2 * core.cfg.liveness_timeout_s, transfer_bytes=xfer,
                            transfer_total_bytes=max(64 << 20, 4 * xfer),
                            hb_refresh_s=core.cfg.liveness_timeout_s / 3, hb_rate=hb_rate, hb_burst=hb_rate)


def slice_limits(span: tuple[int, int]) -> ConnectionLimits:
    """The bounds on workers' unfinished transfers (parts of gradient blocks), the daemon's
    (:func:`vector_limits`) for this slice: one transfer per connection of at most two float64
    blocks, four such transfers' worth (at least ``TRANSFER_TOTAL_MIN``) over all
    connections, a transfer dropped after ``TRANSFER_TIMEOUT_S`` without a part. A record
    holds nothing but its transfer, so it is forgotten as soon as that could be dropped."""
    lo, hi = span
    xfer = 2 * max(hi - lo, 1) * 8
    return ConnectionLimits(idle_s=TRANSFER_TIMEOUT_S, max_idle=MAX_PARTS_PEERS, transfer_bytes=xfer,
                            transfer_total_bytes=max(TRANSFER_TOTAL_MIN, 4 * xfer),
                            transfer_timeout_s=TRANSFER_TIMEOUT_S)


def handed_messages(handed: HandedPath, sealed: SealedPath | None) -> Iterator[list]:
    """The whole messages of the handed connections: under CurveZMQ (``sealed``) those of the
    sealed data connections, opened as their CURVE connections' (ps/net/sealed.py)."""
    return handed.pending() if sealed is None else sealed.opened(handed.pending())


def await_byes(sock: zmq.Socket, pending: set[bytes], bye: Bye, deadline: float, clock: Callable[[], float],
               max_array_bytes: int, send: Callable[[bytes, Any], bool], sealed: Any = None,
               handed: Any = None) -> None:
    """Wait (until ``deadline``) for the acknowledging bye of each connection in ``pending``; what
    else one sends is answered with ``bye`` again (it missed it: it was reconnecting). ``sealed``:
    the sealed data path, where a worker on it sends its bye (what opens counts as its CURVE
    connection's); ``handed``: the connections the daemon reads itself (ps/net/handover.py)."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if sealed is not None:
        poller.register(sealed.sock, zmq.POLLIN)
    if handed is not None:
        poller.register(handed, zmq.POLLIN)
    while pending and clock() < deadline:
        ready = dict(poller.poll(max(1, int((deadline - clock()) * 1000))))
        if not ready:
            break
        messages = [sock.recv_multipart(copy=False)] if sock in ready else []
        if sealed is not None and sealed.sock in ready:
            messages += list(sealed.pending())
        if handed is not None and handed.fileno() in ready:  # the poller answers with the descriptor
            messages += list(handed_messages(handed, sealed))
        for frames in messages:
            rid = frames[0].bytes
            try:
                msg = decode(frames[1:], max_array_bytes=max_array_bytes)
            except RemoteProtocolError:
                continue
            if isinstance(msg, Bye):
                pending.discard(rid)
            else:
                send(rid, bye)


class _Outbound:
    """What the server sends of its own accord: heartbeats (a slice per pass), a message in parts, the
    final byes; and the frames of any message, on the path its connection takes (a mixin of
    ServerTransport, which holds the state)."""

    def _parts_out(self, msg: Any, rid: bytes | None = None) -> list:
        """The messages that carry ``msg`` in parts, then its header (a new transfer id); to a
        worker on the sealed path split as plaintext is."""
        self.next_xfer += 1
        sealed = self.sealed is not None and self.sealed.is_bound(rid)
        messages = (self.sealed.chunking if sealed else self.chunking).split(msg, self.next_xfer)
        self.parts_out += len(messages) - 1
        return messages

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

    def send_frames(self, rid: bytes, frames: list) -> bool:
        """``frames`` to the connection ``rid``: over the connection the daemon reads itself, the
        sealed data connection, or the ROUTER. False: it cannot be reached (gone, or its pipe full)."""
        sent = self.handed.send(rid, frames) if self.handed is not None and self.sealed is None else None
        if sent is not None:  # a plaintext connection the daemon reads itself (ps/net/handover.py)
            self.send_failures += not sent
            return sent
        sent = self.sealed.send(rid, frames) if self.sealed is not None and self.sealed.by_rid else None
        if sent is not None:  # on the sealed data connection (sent, or its pipe is full)
            self.send_failures += not sent
            return sent
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

    def drain(self, bye: Bye, deadline: float) -> None:
        """Tell every worker bye and wait (until ``deadline``) for their acknowledging bye. A
        worker that missed it (it was reconnecting) gets it again in answer to whatever it sends."""
        pending = {c.rid for c in self.conns.bound()}
        for rid in list(pending):
            if not self.send_message(rid, bye):
                pending.discard(rid)
        await_byes(self.sock, pending, bye, deadline, self.clock, self.max_array_bytes, self.send_message,
                   self.sealed, self.handed)


class ServerTransport(_Outbound):
    """The ROUTER socket and the per-connection state (see the module docstring).

    Args:
        core: read only: its worker table (``workers``), iterate store, ledger, dimension, boot
            and configuration. A shard's is set once its run starts (None before).
        bind: the endpoint to bind (a shard's: None, bound with :meth:`bind_slice`).
        clock: the daemon's monotonic clock.
        keys_dir: CurveZMQ keys (ps/net/security.py); None: no security.
        shm: ``auto`` (same-host workers that ask), ``any`` (every worker that asks) or ``off``.
        wire_dtype: the dtype iterates and gradients travel in.
        max_workers, max_workers_per_key: the caps a new join must pass.
        limits: the connection table's bounds; None: derived from the core's configuration.
        journaled: the daemon journals what the core is fed (a reply whose arrays came in parts
            or in shared memory is then re-encoded, so the journal holds them).
        shard: a shard's data path (ps/net/routed.py); None: the daemon's.
        security: a shard's CurveZMQ (its owner's, which its control channel shares).
    """

    def __init__(self, ctx: zmq.Context, core: Any, bind: str | None, *, clock: Callable[[], float],
                 keys_dir: str | None = None, shm: str = "auto", wire_dtype: str = "f32",
                 max_workers: int = DEFAULT_MAX_WORKERS, max_workers_per_key: int = DEFAULT_MAX_WORKERS_PER_KEY,
                 limits: ConnectionLimits | None = None, journaled: bool = False,
                 shard: ShardRole | None = None, security: Any = None) -> None:
        if shm not in ("auto", "any", "off"):
            raise ValueError(f"shm must be auto, any or off, got {shm!r}")
        self.core, self.clock = core, clock
        self.journaled = journaled  # a reply whose arrays the transport changed is re-encoded for the journal
        self.shard = shard
        self.security, self.own_security = security, keys_dir is not None
        if keys_dir is not None:
            from ps.net.security import ServerSecurity

            self.security = ServerSecurity(ctx, keys_dir)
        self.chunking = chunking(self.security is not None)  # how what it sends in parts is split
        self.wire_dtype = wire_dtype
        self.next_xfer = self.parts_in = self.parts_out = 0  # transfer ids sent, parts received and sent
        self.sealed: SealedPath | None = None  # under CurveZMQ behind the front: the sealed path (sealed.attach)
        self.handed: HandedPath | None = None  # behind the front: connections it hands over (sealed: data ones)
        self.wait: Any = None  # the daemon loop's wait while it runs (ps/net/loopwait.py): which sockets are quiet
        self.send_failures = self.invalid_messages = self.bytes_in = 0
        if shard is None:
            self._init_daemon(ctx, bind, shm, limits, max_workers, max_workers_per_key)
        else:
            self._init_shard(ctx, shm, shard)

    def _init_daemon(self, ctx: zmq.Context, bind: str, shm: str, limits: ConnectionLimits | None,
                     max_workers: int, max_workers_per_key: int) -> None:
        core = self.core
        self.max_array_bytes = max(core.dim, 1) * 8  # a sharded coordinator (dim 0) takes empty arrays
        self.sock = server_socket(ctx, bind, self.max_array_bytes, self.security)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.conns = Connections(limits or vector_limits(core), now=self.clock(),
                                 alloc=lambda n: POOL.empty((n,), np.uint8))
        self.max_workers, self.max_workers_per_key = max_workers, max_workers_per_key
        self.banned_keys: set[str] = set()  # keys of quarantined or revoked workers
        self.behind_front = False  # supervised: every connection comes through the front (ps/net/front.py)
        self.admission = Admission(self, Count)  # the hello rules
        self.hb_queue: collections.deque[bytes] = collections.deque()  # still to get this period's heartbeat
        self.wire_cache: dict[int, np.ndarray] = {}  # iterate id -> its wire-dtype copy
        self.evictions = EvictionCursor()  # which iterates left the core's store (sweep)
        self.shm_any = shm == "any"  # offer it to every worker that asks: its probe decides
        self.arena, self.host_id = open_arena(core.dim, core.server_boot) if shm != "off" else (None, "")
        self.shm_used: set[str] = set()  # got at least one job through it (summary.json; MAX_SHM_LISTED)
        self.shards_map: Callable[[], tuple] = tuple  # a sharded server's Welcome.shards (ps/sharded/hub.py)

    def _init_shard(self, ctx: zmq.Context, shm: str, shard: ShardRole) -> None:
        """A shard's data path: the socket made now, bound once the slice is known (:meth:`bind_slice`);
        the connections told (a welcome after the first job sent to them) and those whose hello
        said they take parts (PROTOCOL.md §6.13, §12.1); its same-host path."""
        self.sock = router_socket(ctx, self.security, SHARD_HWM, SHARD_HWM)
        self.endpoint = ""
        self.max_array_bytes = DEFAULT_MAX_ARRAY_BYTES  # the decoder's; libzmq's is the slice's (bind_slice)
        self.data_log = RateLimitedLog(shard.logger)
        self.parts: PartsIn | None = None  # workers' unfinished transfers (bounded for the slice: bind_slice)
        self.same_host = SliceSameHost(shm, shard.boot, shard.logger)
        self.peers = ShardPeers(shard, self.same_host)

    # ------------------------------------------------------------------ inbound
    def pending(self) -> Iterator[list]:
        """What the socket holds now, one ROUTER message (its frames) at a time. The socket's
        EVENTS are asked once (an empty socket then costs no zmq.Again, ~14 us), not before each
        message: asking costs ~6 us a message (a libzmq call and pyzmq's enum), twice a receive,
        and a flood's every message paid it (the daemon's largest cost under 4,000 heartbeating
        fakes, profiled); the end of what it holds is then one zmq.Again per pass."""
        wait = self.wait
        if not (wait is not None and wait.take_quiet(self.sock)) and self.sock.get(_EVENTS) & _POLLIN:
            while True:
                try:
                    yield recv_frames(self.sock, _NOBLOCK)
                except zmq.Again:
                    break
        if self.sealed is not None:  # opened: the CURVE connection's routing id, then the plain frames
            yield from self.sealed.pending(wait)
        if self.handed is not None:  # read by the daemon itself (ps/net/handover.py): handed_messages
            yield from self.handed.pending() if self.sealed is None else self.sealed.opened(self.handed.pending())

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
        self.bytes_in += sum(map(len, frames))
        if isinstance(msg, StatusRequest):  # read-only: no core input, nothing journaled; rate-limited
            source, auth = self._status_source(frames[1], rid)
            if self.conns.status_ask(conn, msg.token, now, source, auth):
                self.send_frames(rid, status(msg.token))
            return None
        key = self._key(frames[1]) if self.security is not None else ""  # _key's answer without keys
        wid = self.admission.identify(conn, msg, key, now)
        if wid is None or isinstance(wid, Count):
            return wid
        if isinstance(msg, Ready):
            conn.shm_ready = opened_shm(conn.shm_capable, msg.shm, conn.wid)
        inbound = Inbound(conn, wid, msg, key, frames[1:], body=body)
        wired = isinstance(msg, Reply) and (msg.xfer or msg.in_shm or self.wire_dtype != "f32")  # else: as it came
        return self._reply_arrays(inbound) if wired else inbound

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

    def _status_source(self, frame: Any, rid: bytes = b"") -> tuple[str, bool]:
        """Who asks a ``status?`` (Connections.status_ask), and whether with a key of the allow-list:
        under CurveZMQ its key; behind the front (``behind_front``) the client address the front
        puts in the connection's metadata (``X-Source``), or gave with a connection it handed over;
        without a front, the peer's own address; "" (the connection alone) where none is known."""
        key = self._key(frame)
        if key:
            return "key:" + key, key in getattr(self.security, "allowed", ())
        handed = self.handed.by_rid.get(rid) if self.handed is not None and self.sealed is None else None
        if handed is not None:
            return ("ip:" + handed.source if handed.source else ""), False
        try:
            addr = frame.get("X-Source" if self.behind_front else "Peer-Address")
        except (zmq.ZMQError, AttributeError, TypeError, ValueError):  # no such property, or a bytes frame
            return "", False
        return ("ip:" + addr if addr else ""), False

    def _key(self, frame: Any) -> str:
        """The fingerprint of the z85 public key CURVE authenticated for this message ("" without keys)."""
        if self.security is None:
            return ""
        if type(frame) is OpenFrame:  # opened on the sealed path: the key of the session's connection
            return frame.props["key"]
        from ps.net.security import fingerprint

        user = frame.get("User-Id")
        return fingerprint(user) if user else ""

    def offers_shm(self, hello: Hello) -> bool:
        """Whether the daemon offers its shared memory to the worker of ``hello`` (it has an arena)."""
        return offers_shm(hello, "any" if self.shm_any else "auto", self.host_id)

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
        if isinstance(msg, Job):  # _job_arrays changes only a job to shared memory or another wire dtype
            msg = self._job_arrays(conn, msg) if conn.shm_ready or self.wire_dtype != "f32" and msg.points else msg
            if conn.spin_us != msg.spin_us:  # the daemon's advice to this worker (PROTOCOL.md §6.4)
                msg = with_spin(msg, conn.spin_us)
            if conn.parts and sum(map(_NBYTES, msg.points)) > self.chunking.threshold:
                messages = self._parts_out(msg, conn.rid)  # large arrays: parts, then the job
                return all(self.send_frames(conn.rid, frames) for frames in messages)
        elif isinstance(msg, Welcome):
            seal, cipher = (self.sealed.offer(conn.rid, conn.key, conn.seal_segments, conn.seal_ciphers,
                                              self.core.dim * WIRE_NUMPY[self.wire_dtype].itemsize)
                            if self.sealed is not None and conn.seal_capable else ("", ""))
            msg = dataclasses.replace(msg, wire_dtype=self.wire_dtype, parts=conn.parts,
                                      shm=self.arena.prefix if conn.shm_capable else "", shards=self.shards_map(),
                                      seal=seal, seal_segments=bool(seal),
                                      seal_cipher="" if cipher == GCM else cipher)
        return self.send_frames(conn.rid, encode(msg))  # send_message's

    def _job_arrays(self, conn: Conn, job: Job) -> Job:
        """Transport of a job's iterates: shared-memory slots for same-host workers, else the
        frames the core chose, converted to the wire dtype."""
        if conn.shm_ready:
            if len(self.shm_used) < MAX_SHM_LISTED:
                self.shm_used.add(conn.wid)
            return lend_job(self.arena, conn.wid, job, self.core.store)
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

    def sweep(self) -> None:
        """After the core's commands: shared-memory slots and wire copies of iterates the core no
        longer holds are released."""
        if self.shard is not None:
            self.same_host.sweep(self.shard.core(), self.shard.live)
            return
        core = self.core
        gone = self.evictions.take(core)  # only these left the store since the last sweep (None: unknown)
        if self.arena is not None and (self.arena.lent or self.arena.copies or self.arena.free_grad):
            self.arena.sweep(core.store, core.ledger, core.workers, gone)
        if self.wire_cache:
            for iid in [i for i in (self.wire_cache if gone is None else gone)
                        if i in self.wire_cache and i not in core.store]:
                del self.wire_cache[iid]

    # ------------------------------------------------------------------ a shard's data path
    def bind_slice(self, bind: str, span: tuple[int, int]) -> str:
        """Bind a shard's socket, its largest frame a float64 block of the slice ``span`` (a restored
        shard knows it, a new one learns it from the coordinator's welcome); the bounds on its
        workers' transfers are the slice's. Returns the endpoint bound."""
        lo, hi = span
        try:
            bind_router(self.sock, bind, (hi - lo) * 8)
        except zmq.ZMQError as e:
            raise OSError(f"cannot bind {bind}: {e}") from None
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.parts = PartsIn(slice_limits(span), self.clock, self.data_log)
        return self.endpoint

    def receive_routed(self, frames: list, now: float) -> tuple[bytes, Any, list] | None:
        """One ROUTER message to a shard: (its routing id, a fetch or a reply, the frames the
        journal keeps of it: a block from parts or from shared memory as one message), or None:
        handled here (a part, a hello, a ready, an answer of error)."""
        rid, role = frames[0].bytes, self.shard
        try:
            msg = decode(frames[1:], max_array_bytes=self.max_array_bytes,
                         payload=lambda xfer, n: self.parts.take(rid, xfer, n))
            if type(msg) is Part:
                self.parts.add(rid, msg, now, role.live(rid))
                self.parts_in += 1
                return None
        except RemoteProtocolError as e:
            role.answer(rid, Error(ErrorCode.MALFORMED, str(e)[:200]))
            return None
        if role.core() is None:
            role.answer(rid, Error(ErrorCode.REFUSED, "this shard has not started"))
            return None
        if type(msg) is Fetch:
            return rid, msg, frames
        if type(msg) is Reply:
            if msg.in_shm:  # its gradients are in the slots lent for the job: read as the frames they stand for
                got = self.same_host.block(rid, msg, self.wire_dtype, role.holds(msg.job_id), role.answer,
                                           lambda kind, *args: self.data_log.warning(kind, self.clock(), *args))
                return None if got is None else (rid, *got)
            if msg.xfer:  # its arrays came in parts: the journal keeps them with the message, as one
                msg = dataclasses.replace(msg, xfer=0)
                frames = [rid, *encode(msg)]
            return rid, msg, frames
        if type(msg) is Hello:
            self.peers.hello(rid, msg, self._send_now)
        elif type(msg) is Ready:
            self.same_host.opened(rid, msg.shm, worker_of(rid))
        else:
            role.answer(rid, Error(ErrorCode.MALFORMED, f"{type(msg).__name__} is not for a shard"))
        return None

    def routed_job(self, rid: bytes, entry: Any, point_ids: tuple) -> Job:
        """A shard's answer to a fetch of the job ``entry`` of the ledger: over the same-host path
        to a connection that opened it, else its slices of ``point_ids`` in the wire dtype."""
        store = self.shard.core().store
        if rid in self.same_host.ready:
            job = self.same_host.job(rid, entry, store, self.wire_dtype, self.shard.live(rid))
            if job is not None:
                return job
        wire = self.wire_dtype
        points = tuple(store[i] if wire == "f32" else to_wire(store[i], wire) for i in point_ids)
        return Job(job_id=entry.job_id, kind=entry.kind, created_at=entry.created_at, iterate_ids=entry.iterate_ids,
                   seed=entry.seed, batch_size=entry.batch_size, shard=entry.shard, deadline=entry.deadline,
                   point_ids=tuple(point_ids), points=points)

    def send_routed(self, rid: bytes, msg: Any) -> None:
        """``msg`` to a shard's worker at ``rid``: a ``job`` whose slices pass the threshold goes in
        parts, then the job with ``xfer`` (PROTOCOL.md §6.13), to a connection whose hello said it
        takes them; the first job to a connection is followed by a welcome that says the shard
        takes parts."""
        if type(msg) is Job and rid in self.peers.parts and sum(p.nbytes for p in msg.points) > self.chunking.threshold:
            messages = self._parts_out(msg)
        else:
            messages = [encode(msg)]
        if type(msg) is Job and self.peers.first_job(rid):  # the first job to this connection (that we remember)
            messages.append(encode(self.shard.welcome("")))  # after it: a peer's first answer is its fetch's
        try:
            for frames in messages:
                self.sock.send_multipart([rid, *frames], flags=zmq.NOBLOCK, copy=False)
        except (zmq.Again, zmq.ZMQError):
            pass  # the worker is gone, or its pipe is full: it asks again (a transfer cut short is dropped there)

    def _send_now(self, rid: bytes, msg: Any) -> bool:
        """``msg`` to a shard's worker at once, in one message; False: it could not be sent."""
        try:
            self.sock.send_multipart([rid, *encode(msg)], flags=zmq.NOBLOCK, copy=False)
            return True
        except (zmq.Again, zmq.ZMQError):
            return False

    # ------------------------------------------------------------------ heartbeats
    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        if self.shard is not None:
            self.sock.close(linger=0)
            self.same_host.close()
            return
        if self.arena is not None:
            if POOL.factory == self.arena.allocate:
                POOL.factory = None
                POOL.clear()
            self.arena.close()
        # A short linger lets the final Bye messages reach the workers; everything else the
        # server would have sent is re-derivable from the job ledger.
        self.sock.close(linger=1000)
        if self.sealed is not None:
            self.sealed.close()
        if self.handed is not None:
            self.handed.close()
        if self.security is not None and self.own_security:
            self.security.stop()

    def figures(self) -> dict[str, Any]:
        """For summary.json's ``transport``."""
        return {"wire_dtype": self.wire_dtype, "shm": self.arena.prefix if self.arena else "",
                "shm_workers": sorted(self.shm_used),
                "shm_iterate_copies": self.arena.copies_made if self.arena else 0,
                "parts_in": self.parts_in, "parts_out": self.parts_out,
                **(self.sealed.figures() if self.sealed is not None else {}),
                **(self.handed.figures() if self.handed is not None else {})}
