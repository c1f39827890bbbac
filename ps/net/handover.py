"""Connections the front hands over: the daemon reads and writes them itself (PROTOCOL.md §1, "The front").

Under NULL security the front (ps/net/front.py) does a plaintext client's ZMTP handshake itself:
it sends the server's greeting and READY, reads the client's greeting and READY with its bounds,
and then passes the socket's descriptor to the daemon (``SCM_RIGHTS`` over a private
``SOCK_SEQPACKET`` socket), with what it has read from the client and what of its own greeting the
client has not taken yet. The front then closes its copy: from then on the client's bytes go
straight to the daemon's process, which parses them with protocol/zmtp.py, and the daemon's go
straight back. No relay, no libzmq I/O thread: at small messages the front's relay and libzmq's
wake-ups were most of a reply's cost (benchmarks/PROFILE.md, "Five server paths").

Each connection's routing id is what libzmq's ROUTER would have given it: the ``Identity`` of its
READY (the reference worker's ``worker_id/boot``), and a new connection with the same identity
takes it over, the old one closed (``ROUTER_HANDOVER``); without one, a zero byte and a counter
(an identity may not start with a zero byte). So the transport, the core, the journal and the
replay see messages exactly as they did through the ROUTER socket. What the front enforced on a relayed
connection the daemon enforces here on a handed one, with the same figures and the same words:

* the frame, message, frame-count and command bounds (the codec, checked at each header);
* all connections' unfinished messages together (``max_pending_bytes``);
* the frame rate: past ``max_frame_rate`` frames a second a connection is not read until its
  budget is back (a flood waits in its sender's socket);
* progress: an unfinished message must finish, or bring ``floor_bytes``, in every ``window_s``;
  a peer that leaves the daemon's bytes waiting must take ``floor_bytes`` in every window;
* the send queue: a connection holds at most ``max_out_messages`` messages the peer has not
  taken (libzmq's send high-water mark); past it a send fails, as it did with ROUTER_MANDATORY;
* descriptors: at most ``max_connections`` handed connections; past it the one silent longest
  that is not a live worker's is cut;
* PINGs are answered with PONG.

A cut connection gets a reset (``SO_LINGER`` 0); the daemon tells the front which connections it
closed, so the front's count per source address stays true.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import select
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from protocol.zmtp import IDLE_READ, Connection, ZmtpError, ZmtpLimits, finish_all, frames_out, pong, send_streamed

log = logging.getLogger("latecomer.server")

GENERATED = b"\x00"  # the routing id of a handed connection without an identity: this byte and its id
HAND_SOCKET = "hand.sock"  # beside the daemon's private socket
_HEAD = struct.Struct(">QHI")  # connection id, the source's length, the unsent greeting's length
MAX_HAND_MESSAGE = 64 * 1024  # the most the front sends with one descriptor
CLOSED = b"C"  # daemon -> front: these connection ids (8 bytes each) are closed
MAX_INBOX = 4096  # whole messages read and not yet taken by the daemon's loop: past it, no reads
MAX_READ_PASS = 256  # connections read per call of HandedPath.pending
FIRST_READ = 8 * 1024  # a handed connection's first read buffer (idle ones hold no more; it grows)
CHECK_EVERY_S = 0.5  # how often the progress windows are looked at
CUT_LOG_INTERVAL_S = 1.0
_SOFT = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)
_IN, _OUT, _GONE = select.EPOLLIN, select.EPOLLOUT, select.EPOLLERR | select.EPOLLHUP
_SIOCOUTQ = 0x5411
_BAD = (ZmtpError, ValueError, IndexError, struct.error)  # what the codec may raise on a peer's bytes
IOV_MAX = 512  # buffers per sendmsg


def attach(transport: Any, path: str, limits: HandLimits) -> None:
    """Behind the front: the daemon transport takes the connections the front hands over at
    ``path`` (under NULL its clients'; under CurveZMQ the sealed data connections, whose messages
    its sealed path opens, ps/net/sealed.py); a live worker's connection is never shed for room."""
    def live(rid: bytes) -> bool:
        conn = transport.conns.by_rid.get(rid)
        return conn is not None and conn.wid is not None and conn.wid in transport.core.workers

    from algorithms._pool import POOL

    sealed = transport.sealed
    alive = live if sealed is None else lambda token: sealed.live_token(token, live)
    transport.handed = HandedPath(path, limits, transport.clock, lambda n: POOL.empty((n,), np.uint8), alive)
    if sealed is not None:
        sealed.handed = transport.handed


def pack_hand(cid: int, source: str, unsent: bytes, read: bytes) -> bytes:
    """What goes with a handed descriptor: its id, the client's address, what of the server's
    greeting and READY it has not taken yet, and what the front read from it (greeting on)."""
    src = source.encode()[:255]
    return _HEAD.pack(cid, len(src), len(unsent)) + src + unsent + read


def unpack_hand(data: bytes) -> tuple[int, str, bytes, bytes]:
    """The inverse of :func:`pack_hand`. Raises ValueError."""
    if len(data) < _HEAD.size:
        raise ValueError("a hand-over message shorter than its header")
    cid, ns, nu = _HEAD.unpack_from(data)
    at = _HEAD.size
    if at + ns + nu > len(data):
        raise ValueError("a hand-over message shorter than it says")
    source = data[at:at + ns].decode(errors="replace")
    return cid, source, data[at + ns:at + ns + nu], data[at + ns + nu:]


class CutLog:
    """One log line per CUT_LOG_INTERVAL_S for cut, shed and refused connections, the next line
    counting those in between: the front's (ps/net/front.py) and the daemon's, each on its logger."""

    def __init__(self, logger: logging.Logger, clock: Callable[[], float]) -> None:
        self.logger, self.clock = logger, clock
        self.last, self.unlogged = -1e9, 0

    def __call__(self, why: str) -> None:
        now = self.clock()
        if now - self.last >= CUT_LOG_INTERVAL_S:
            more = f" ({self.unlogged} more cut since the last line)" if self.unlogged else ""
            self.logger.warning("cut a connection: %s%s", why, more)
            self.last, self.unlogged = now, 0
        else:
            self.unlogged += 1


def reset(s: socket.socket) -> None:
    """Close with a reset (``SO_LINGER`` 0): the peer broke a bound, nothing it sent is kept."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass


class Frame(bytes):
    """A small frame read from a handed connection, with ``zmq.Frame``'s ``bytes``."""

    __slots__ = ()

    @property
    def bytes(self) -> bytes:
        return bytes(self)


@dataclass(frozen=True)
class HandLimits:
    """The daemon's bounds on handed connections (the front's, see the module docstring)."""

    zmtp: ZmtpLimits
    max_pending_bytes: int
    max_frame_rate: float = 0.0
    max_connections: int = 1 << 20
    max_out_messages: int = 256
    window_s: float = 5.0
    floor_bytes: int = 64 * 1024


class _Hand:
    __slots__ = ("sock", "fd", "cid", "rid", "source", "codec", "out", "out_bytes", "mask", "last_done",
                 "unfinished", "win_start", "win_bytes", "dwin_start", "dwin_bytes", "dwin_q0", "tokens",
                 "tok_at", "paused_until")

    def __init__(self, sock: socket.socket, cid: int, rid: bytes, source: str, codec: Connection,
                 now: float) -> None:
        self.sock, self.fd, self.cid = sock, sock.fileno(), cid
        self.rid = Frame(rid)
        self.source, self.codec = source, codec
        self.out: collections.deque[list] = collections.deque()  # messages (buffers) the peer has not taken
        self.out_bytes = 0
        self.mask = _IN
        self.last_done = now  # the last whole message (or the hand-over)
        self.unfinished = 0  # this connection's share of HandedPath.pending_bytes
        self.win_start, self.win_bytes = 0.0, 0  # the progress window of an unfinished message
        self.dwin_start, self.dwin_bytes, self.dwin_q0 = 0.0, 0, 0  # ... of bytes waiting for the peer
        self.tokens, self.tok_at, self.paused_until = float("inf"), now, 0.0


class _Writing:
    """A handed connection's sending side: ``sendmsg`` of a message's buffers, what the peer does not
    take queued (at most ``max_out_messages``) and sent when its socket is writable again, and the
    window in which a peer must take what waits for it (a mixin of :class:`HandedPath`)."""

    def send(self, rid: bytes, frames: list, lazy: bool = False) -> bool | None:
        """One message to the handed connection ``rid``: True sent (or queued), False its queue is
        full or it went meanwhile, None: no handed connection has that routing id. ``lazy``: some
        frames are sealed as they are written (protocol/seal.py ``Streamed``); whole on return."""
        h = self.by_rid.get(rid)
        if h is None or len(h.out) >= self.limits.max_out_messages:
            if lazy:
                finish_all(frames)
            return None if h is None else False
        sent = self._send_raw(h, frames_out(frames), lazy)
        self.messages_out += sent
        return sent

    def _send_raw(self, h: _Hand, bufs: list, lazy: bool = False) -> bool:
        """``bufs``: bytes and byte-format memoryviews (frames_out), so ``len`` is their size;
        ``lazy``: and bodies made as they are written (zmtp.send_streamed), whole on return."""
        total = sum(map(len, bufs))
        if h.out:
            h.out.append(finish_all(bufs) if lazy else bufs)
            h.out_bytes += total
            return True
        try:
            if lazy:
                n = send_streamed(h.sock.sendmsg, bufs, IOV_MAX)
            else:
                n = h.sock.sendmsg(bufs) if len(bufs) <= IOV_MAX else 0
        except OSError as e:
            if e.errno not in _SOFT:
                self._close(h)
                return False
            n = 0
        if n < total:
            h.out.append(_rest(bufs, n))
            h.out_bytes += total - n
            self._waiting(h, 0)
            self._mask(h)
        return True

    def _flush(self, h: _Hand) -> None:
        sent = 0
        while h.out:
            bufs = [b for m in list(h.out)[:64] for b in m][:IOV_MAX]
            total = sum(map(len, bufs))
            try:
                n = h.sock.sendmsg(bufs)
            except OSError as e:
                if e.errno in _SOFT:
                    break
                self._close(h)
                return
            short = n < total
            sent += n
            h.out_bytes -= n
            while n and h.out:
                m = h.out[0]
                size = sum(map(len, m))
                if n >= size:
                    h.out.popleft()
                    n -= size
                else:
                    h.out[0] = _rest(m, n)
                    n = 0
            if short:
                break
        self._waiting(h, sent)
        self._mask(h)

    def _waiting(self, h: _Hand, sent: int) -> None:
        """The peer's window for taking what waits for it (the front's rule, Front._down_progress)."""
        if not h.out:
            self.stuck.discard(h)
        elif h in self.stuck:
            h.dwin_bytes += sent
        else:
            self.stuck.add(h)
            h.dwin_start, h.dwin_bytes, h.dwin_q0 = self.clock(), 0, unsent_bytes(h.sock)


class HandedPath(_Writing):
    """The hand-over socket, the handed connections and their messages (see the module docstring).

    Args:
        path: where to bind the hand-over socket (in the daemon's private directory).
        limits: the bounds.
        clock: the daemon's monotonic clock.
        alloc: a buffer for a large frame (``alloc(n)``).
        live: whether a routing id is a live worker's (never shed for room).
    """

    def __init__(self, path: str, limits: HandLimits, clock: Callable[[], float], alloc: Callable[[int], Any],
                 live: Callable[[bytes], bool] = lambda rid: False) -> None:
        self.limits, self.clock, self.alloc, self.live = limits, clock, alloc, live
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.listener.bind(path)
        self.listener.listen(4)
        self.listener.setblocking(False)
        self.ep = select.epoll()
        self.ep.register(self.listener.fileno(), _IN)
        self.front: socket.socket | None = None  # the front's end of the hand-over socket
        self.by_fd: dict[int, _Hand] = {}
        self.by_rid: dict[bytes, _Hand] = {}
        self.inbox: collections.deque[list] = collections.deque()  # whole messages, routing id first
        self.paused: set[_Hand] = set()  # not read until their frame budget is back
        self.mid: set[_Hand] = set()  # with an unfinished message
        self.stuck: set[_Hand] = set()  # with bytes waiting for the peer
        self.closed_ids: list[int] = []  # to tell the front
        self.pending_bytes = 0  # what all unfinished messages have declared
        self.next_check = 0.0
        self.handed = self.cut = self.shed = self.taken_over = self.pongs = self.messages_in = self.messages_out = 0
        self.reads = 0  # reads that brought bytes (over messages in: how often a message woke the loop)
        self._log_cut = CutLog(log, clock)

    def fileno(self) -> int:
        """The epoll descriptor: readable when a handed connection or the hand-over socket is ready."""
        return self.ep.fileno()

    # ---------------------------------------------------------------- reading
    def pending(self) -> Iterator[list]:
        """Whole messages of the handed connections, each its routing id, then its frames."""
        if len(self.inbox) < MAX_INBOX:
            self._poll()
        inbox = self.inbox
        while inbox:
            yield inbox.popleft()

    def _poll(self) -> None:
        try:
            events = self.ep.poll(0, MAX_READ_PASS)
        except InterruptedError:
            return
        lfd = self.listener.fileno()
        ffd = self.front.fileno() if self.front is not None else -1
        for fd, ev in events:
            if fd == lfd:
                self._accept_front()
            elif fd == ffd:
                self._take_hand_overs()
            else:
                h = self.by_fd.get(fd)
                if h is None:
                    continue
                if ev & _OUT:
                    self._flush(h)
                if h.fd in self.by_fd and ev & (_IN | _GONE) and h.mask & _IN:
                    self._read(h)
                elif h.fd in self.by_fd and ev & _GONE and not h.mask & _IN:
                    self._close(h)

    def _read(self, h: _Hand) -> None:
        codec = h.codec
        try:
            n = h.sock.recv_into(codec.buffer())
        except OSError as e:
            if e.errno in _SOFT:
                return
            n = 0
        if not n:
            self._close(h)
            return
        self.reads += 1
        seen = codec.seen
        try:
            msgs = codec.advance(n)
        except _BAD as e:
            self._cut(h, str(e))
            return
        self._account(h, n, msgs, codec.seen - seen)

    def _account(self, h: _Hand, n: int, msgs: list, frames: int) -> None:
        """After a read of ``n`` bytes that made ``msgs`` whole: the unfinished total, the progress
        window, the PINGs, the frame budget; then the messages go to the inbox."""
        codec = h.codec
        delta = codec.unfinished - h.unfinished
        h.unfinished += delta
        self.pending_bytes += delta
        if delta > 0 and self.pending_bytes > self.limits.max_pending_bytes:
            self._cut(h, f"all connections' unfinished messages passed {self.limits.max_pending_bytes} bytes")
            return
        now = self.clock()
        if msgs:
            h.last_done = now
            rid, put = h.rid, self.inbox.append
            for m in msgs:
                put([rid, *m])
            self.messages_in += len(msgs)
        if codec.mid:
            if h not in self.mid:
                self.mid.add(h)
                h.win_start, h.win_bytes = now, 0
            h.win_bytes += n
        else:
            self.mid.discard(h)
        if codec.pings:
            for context in codec.pings:
                self._send_raw(h, [pong(context)])
            self.pongs += len(codec.pings)
            codec.pings.clear()
        rate = self.limits.max_frame_rate
        if rate and frames:
            h.tokens = min(rate, h.tokens + (now - h.tok_at) * rate) - frames
            h.tok_at = now
            if h.tokens < 0 and h.fd in self.by_fd:
                h.paused_until = now - h.tokens / rate
                self.paused.add(h)
                self._mask(h)

    # ---------------------------------------------------------------- the front's hand-overs
    def _accept_front(self) -> None:
        try:
            s, _ = self.listener.accept()
        except OSError:
            return
        if self.front is not None:  # a new front (the old one went): it takes over
            self.ep.unregister(self.front.fileno())
            self.front.close()
        s.setblocking(False)
        self.front = s
        self.ep.register(s.fileno(), _IN)

    def _take_hand_overs(self) -> None:
        for _ in range(64):
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.front, MAX_HAND_MESSAGE, 4)
            except OSError as e:
                if e.errno in _SOFT:
                    return
                data, fds = b"", []
            if not data and not fds:
                self.ep.unregister(self.front.fileno())
                self.front.close()
                self.front = None
                return
            for extra in fds[1:]:
                os.close(extra)
            if not fds:
                continue
            try:
                cid, source, unsent, read = unpack_hand(data)
            except ValueError as e:
                os.close(fds[0])
                log.warning("a hand-over from the front did not parse: %s", e)
                continue
            self._adopt(fds[0], cid, source, unsent, read)

    def _adopt(self, fd: int, cid: int, source: str, unsent: bytes, read: bytes) -> None:
        """A connection from the front: its codec is fed what the front read (greeting on)."""
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        if len(self.by_fd) >= self.limits.max_connections and not self._shed():
            self._refuse(sock, cid, f"the server's {self.limits.max_connections} connections are taken")
            return
        codec = Connection(self.limits.zmtp, self.alloc, Frame, FIRST_READ, IDLE_READ)
        try:
            msgs = feed(codec, read)  # the greeting and READY at least (the front saw them whole)
            if codec.peer is None:
                raise ZmtpError("handed over before its READY")
        except _BAD as e:
            self._refuse(sock, cid, str(e))
            return
        rid = codec.peer.get("Identity", b"")
        if not 0 < len(rid) <= 255 or rid[0] == 0:
            rid = GENERATED + cid.to_bytes(8, "big")  # none (or one libzmq would refuse): its own
        old = self.by_rid.get(rid)
        if old is not None:  # the same identity reconnected: it takes the routing id over
            self.taken_over += 1
            self._close(old)
        h = _Hand(sock, cid, rid, source, codec, self.clock())
        self.by_fd[h.fd] = h
        self.by_rid[h.rid] = h
        self.ep.register(h.fd, _IN)
        self.handed += 1
        if unsent:
            self._send_raw(h, [unsent])
        if h.fd in self.by_fd:
            self._account(h, len(read), msgs, 0)

    def _refuse(self, sock: socket.socket, cid: int, why: str) -> None:
        """A connection not taken: reset, and the front told."""
        self._log_cut(why)
        self.cut += 1
        self.closed_ids.append(cid)
        reset(sock)
        sock.close()
        self._tell_front()

    def _shed(self) -> bool:
        """Make room: cut the handed connection silent longest that is not a live worker's."""
        victims = [h for h in self.by_fd.values() if not self.live(h.rid)]
        if not victims:
            return False
        h = min(victims, key=lambda v: v.last_done)
        self.shed += 1
        self._cut(h, f"shed to make room (the server's {self.limits.max_connections} connections are taken)")
        return True

    def _tell_front(self) -> None:
        """The connections closed since the last call, to the front (its count per source)."""
        while self.closed_ids and self.front is not None:
            batch, self.closed_ids = self.closed_ids[:4096], self.closed_ids[4096:]
            try:
                self.front.send(CLOSED + b"".join(c.to_bytes(8, "big") for c in batch))
            except OSError:
                self.closed_ids = batch + self.closed_ids  # full: the next pass tries again
                return

    def _mask(self, h: _Hand) -> None:
        m = (0 if h.paused_until else _IN) | (_OUT if h.out else 0)
        if m != h.mask and h.fd in self.by_fd:
            self.ep.modify(h.fd, m)
            h.mask = m

    # ---------------------------------------------------------------- deadlines, the end
    def service(self, now: float) -> None:
        """Every pass of the daemon's loop: unpause, tell the front, and the progress windows."""
        if self.paused:
            for h in [h for h in self.paused if now >= h.paused_until]:
                self.paused.discard(h)
                h.paused_until = 0.0
                self._mask(h)
        if self.closed_ids:
            self._tell_front()
        if now < self.next_check:
            return
        self.next_check = now + CHECK_EVERY_S
        b = self.limits
        for h in [h for h in self.mid if now - h.win_start >= b.window_s]:
            if h.win_bytes < b.floor_bytes:
                self._cut(h, f"an unfinished message brought {h.win_bytes} bytes in {b.window_s:g} s "
                             f"(at least {b.floor_bytes} per {b.window_s:g} s, or finish it)")
            else:
                h.win_start, h.win_bytes = now, 0
        for h in [h for h in self.stuck if now - h.dwin_start >= b.window_s]:
            queued = unsent_bytes(h.sock)
            took = h.dwin_q0 + h.dwin_bytes - queued
            if took < b.floor_bytes:
                self._cut(h, f"took {took} bytes of what the server sent it in {b.window_s:g} s "
                             f"(at least {b.floor_bytes} per {b.window_s:g} s while bytes wait for it)")
            else:
                h.dwin_start, h.dwin_bytes, h.dwin_q0 = now, 0, queued

    def timeout(self, now: float) -> float:
        """Seconds until service() has something to do (inf: nothing)."""
        t = float("inf")
        if self.paused:
            t = min(h.paused_until for h in self.paused) - now
        if self.mid or self.stuck:
            t = min(t, self.next_check - now)
        if self.closed_ids:
            t = 0.0
        return max(0.0, t)

    def _cut(self, h: _Hand, why: str) -> None:
        """``h`` broke a bound: a reset, and nothing it sent that is not whole is kept."""
        self.cut += 1
        self._log_cut(why)
        reset(h.sock)
        self._close(h)

    def _close(self, h: _Hand) -> None:
        if self.by_fd.pop(h.fd, None) is None:
            return
        del self.by_rid[h.rid]
        self.pending_bytes -= h.unfinished
        h.unfinished = 0
        for s in (self.paused, self.mid, self.stuck):
            s.discard(h)
        try:
            self.ep.unregister(h.fd)
        except (OSError, ValueError):
            pass
        h.sock.close()
        h.out.clear()
        self.closed_ids.append(h.cid)
        self._tell_front()

    def close(self, linger_s: float = 1.0) -> None:
        """Close every handed connection, after at most ``linger_s`` for what waits to be sent
        (the final byes: libzmq's ROUTER closes with the same linger)."""
        deadline = time.monotonic() + linger_s
        while any(h.out for h in self.by_fd.values()) and (left := deadline - time.monotonic()) > 0:
            for fd, ev in self.ep.poll(left):
                h = self.by_fd.get(fd)
                if h is not None and ev & (_OUT | _GONE):
                    self._flush(h) if ev & _OUT else self._close(h)
        for h in list(self.by_fd.values()):
            self._close(h)
        if self.front is not None:
            self.front.close()
        self.listener.close()
        self.ep.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def figures(self) -> dict[str, Any]:
        return {"handed_connections": len(self.by_fd), "handed_in_all": self.handed, "handed_cut": self.cut,
                "handed_shed": self.shed, "handed_taken_over": self.taken_over, "handed_messages_in": self.messages_in,
                "handed_messages_out": self.messages_out, "handed_reads": self.reads}


def feed(codec: Connection, data: bytes) -> list:
    """``data`` through the codec's buffer: the messages it makes whole. Raises ZmtpError."""
    view, at, msgs = memoryview(data), 0, []
    while at < len(data):
        buf = codec.buffer()
        k = min(len(buf), len(data) - at)
        buf[:k] = view[at:at + k]
        del buf
        msgs += codec.advance(k)
        at += k
    return msgs


def _rest(bufs: list, n: int) -> list:
    """What of ``bufs`` is left after ``n`` bytes were sent (views, no copies)."""
    out = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(memoryview(b)[n:] if n else b)
        n = 0
    return out


def unsent_bytes(s: socket.socket | None) -> int:
    """Bytes in a socket's send queue (TCP: not yet acknowledged by the peer); 0 if unknown (the
    front's rule for a peer that does not read, and the daemon's for a handed connection)."""
    if s is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(s.fileno(), _SIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return 0


__all__ = ["CutLog", "reset", "attach", "HandedPath", "HandLimits", "Frame", "GENERATED", "HAND_SOCKET", "pack_hand",
           "unpack_hand", "unsent_bytes"]
