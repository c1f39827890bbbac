"""The front: a ZMTP-aware relay between the network and the daemon process.

``latecomer serve`` binds the public endpoint here, in the supervisor process (ps/net/supervise.py),
and relays every connection byte for byte to the daemon, which binds a private Unix socket
(mode 0700 directory) and never sees the network. The relay exists for two bounds libzmq
cannot give (SECURITY.md, "Limits and rates"):

* **Unfinished messages.** libzmq caps each frame (``ZMQ_MAXMSGSIZE``) and counts its
  high-water marks in whole messages, so a peer that sends one multipart message with frames
  flagged MORE forever makes the daemon's I/O thread hold every frame (a partial message is
  never visible to the application). The front reads the ZMTP 3 frame headers on the way in
  (flags byte, 1- or 8-byte size; rfc.zeromq.org/spec/23) and cuts a connection whose
  unfinished message would pass ``max_message_bytes`` or ``max_frames``, counting each frame
  when its header arrives (libzmq allocates a frame whole when it reads the header). All
  connections' unfinished messages together are bounded by ``max_pending_bytes``. Under CURVE
  the MORE flag travels inside the encrypted box: the front then bounds each frame and the
  handshake, and only allow-listed keys can send frames at all.
* **No connection error while the daemon's input is stopped.** libzmq 4.3.5 aborts
  (``Assertion failed: !_io_error (stream_engine_base.cpp:310)``) when a connection whose
  receive pipe is full (input stopped) sees a reset or hang-up (``in_event`` marks the engine
  ``_io_error``) and the engine then writes: its heartbeat timer fires, or it answers a PING
  that was queued behind the full pipe. No socket option avoids it for a peer that sends
  PINGs itself. The daemon's sockets are the front's, which never resets or hangs them up:
  when a client goes, the front half-closes the daemon side (``shutdown(SHUT_WR)``: the daemon
  reads an EOF once its input runs again) and reads and discards until the daemon closes
  (at most ``DRAIN_S``), so nothing reaches the daemon's engine while its input is stopped.

A client that sends faster than any worker does is slowed, not served: past ``max_frame_rate``
frames a second the front stops reading it until its budget is back (``Front._throttle``), so a
flood waits in the sender's socket instead of costing the daemon's loop a read per message.

A client that does not read is bounded the same way: once the daemon's bytes wait in the front for
it, it must take ``floor_bytes`` in every window or it is reset, and the daemon drops what it
queued for it (``Front._down_progress``).

Everything else (the greeting's version and security mechanism, CURVE, the protocol) is the
daemon's: the front forwards the daemon's bytes untouched and parses only what it must.
Per connection the front holds at most ``CHUNK`` bytes in each direction (it reads a side
only when what it read before has been written to the other side).

On Linux the bytes that need no parsing move with ``splice(2)``, not through the process: what
the daemon sends once a read from it brought at least ``SPLICE_MIN`` bytes, and the body of a
frame whose header the front has read while at least ``SPLICE_MIN`` bytes of it are left
(smaller reads cost the same copied). They go through one pipe the front shares between all
connections: at most ``CHUNK`` bytes are spliced from a socket into the pipe, then at once from
the pipe to the other socket; what that socket does not take is read out of the pipe into the
connection's buffer, so the pipe is empty between calls and holds no connection's bytes. Where
splice is missing or refused (``EINVAL`` for a socket type), the front reads and writes
through its own buffer instead.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import select
import socket
import time
from dataclasses import dataclass
from typing import Callable

from protocol.codec import looks_like_heartbeat
from protocol.seal import token_ok
from protocol.zmtp import ZmtpError, check_header
from protocol.zmtp import ready as zmtp_ready
from ps.net.handover import CLOSED, MAX_HAND_MESSAGE, CutLog, pack_hand, reset, unsent_bytes

log = logging.getLogger("latecomer.front")

MORE, LONG, COMMAND = 0x01, 0x02, 0x04
RESERVED = 0xF8
GREETING_BYTES = 64
CHUNK = 256 * 1024  # bytes read at once, and the most held per connection and direction
DRAIN_S = 10.0  # after a client went: how long to wait for the daemon to close its end
MAX_COMMAND_BYTES = 64 * 1024  # a NULL-mechanism command (READY with metadata, PING, ...)
CURVE_OVERHEAD = 64  # a CURVE MESSAGE box around a frame: command name, nonce, MAC, flags
SPLICE_MIN = 16 * 1024  # a frame body at least this long still to pass is spliced, not read
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
_NO_SPLICE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP)  # refused: read instead
FD_RESERVE = 64  # descriptors kept out of the connection budget: the listener, epoll, pipes, logs, the child
HANDSHAKE_S = 10.0  # a connection must finish its ZMTP handshake within this (NULL: its READY; CURVE: READY back)
PROGRESS_WINDOW_S = 5.0  # an unfinished message must finish, or bring PROGRESS_FLOOR_BYTES, in every such window
PROGRESS_FLOOR_BYTES = 64 * 1024  # 13 KB/s: a 40 MB gradient at this floor takes 51 min; a trickler is cut
MAX_READY_BYTES = 8 * 1024  # under NULL the client's first command (READY) is held whole to add X-Source
# Under CurveZMQ with the sealed data path (PROTOCOL.md §6.15) the front routes a connection by its
# greeting's mechanism, so it answers the greeting itself until it knows it: libzmq's signature and
# major version (what the daemon's ROUTER sends first: padding = routing id size 0 + 1), and for
# NULL the rest (minor 1, "NULL", as-server 0). The daemon's own greeting is then checked against
# what the client got and dropped (``_Pair.strip``).
SIGNATURE = bytes.fromhex("ff00000000000000017f03")
NULL_GREETING = SIGNATURE + b"\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
ROUTE_NONE, ROUTE_GREETING, ROUTE_READY, ROUTE_HAND = 0, 1, 2, 3
# Under NULL with the hand-over (ps/net/handover.py) the front is the server in the handshake: its
# greeting and READY (what the daemon's ROUTER would send), then the descriptor goes to the daemon.
HAND_GREETING = NULL_GREETING + zmtp_ready(b"ROUTER")
HAND_READ = 16 * 1024  # a client's reads in its handshake: what goes with its descriptor stays small
CHECK_EVERY_S = 0.5  # how often the handshake and progress deadlines are looked at
SOURCE_PROPERTY = b"X-Source"  # the READY property the front sets to the client's address (NULL only)


class Cut(Exception):
    """A client broke a bound; the text says which (one line)."""


@dataclass(frozen=True)
class Budget:
    """What the front spends on connections (SECURITY.md, "Limits and rates": the descriptors).

    Args:
        max_fds: descriptors connections may hold: two for each client (its socket and the
            front's socket to the daemon), one for each client gone whose daemon side drains.
        per_source: the most connections one source address may hold (0: no cap; many workers
            can share one address behind a NAT, and the scale benchmark runs 9,000 from 127.0.0.1).
        handshake_s: the ZMTP handshake's deadline from accept.
        window_s, floor_bytes: an unfinished message must finish, or bring ``floor_bytes``, in
            every ``window_s`` (counted only while the daemon takes what the front sends).
    """

    max_fds: int
    per_source: int = 0
    handshake_s: float = HANDSHAKE_S
    window_s: float = PROGRESS_WINDOW_S
    floor_bytes: int = PROGRESS_FLOOR_BYTES

    @classmethod
    def from_rlimit(cls, **kw) -> "Budget":
        """The budget the soft limit on open files leaves (raise it to the hard one first)."""
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        soft = 1 << 20 if soft == resource.RLIM_INFINITY else soft
        return cls(max_fds=max(4, soft - FD_RESERVE), **kw)

    @property
    def max_clients(self) -> int:
        return self.max_fds // 2


@dataclass(frozen=True)
class Limits:
    """What the front enforces on the bytes a client sends the daemon.

    Args:
        mechanism: the daemon's security mechanism, ``b"NULL"`` or ``b"CURVE"``; a greeting
            naming another is cut.
        max_frame_bytes: the daemon's ``ZMQ_MAXMSGSIZE`` (libzmq cuts a larger frame itself).
        max_message_bytes: the most one connection's unfinished message may declare.
        max_frames: the most frames one message may have.
        max_pending_bytes: the most all connections' unfinished messages may declare together.
        hb_repeat_s: under NULL, a heartbeat byte for byte the connection's previous message,
            which the front passed on less than this long ago, is dropped (0: never); see
            :meth:`Front._repeat`. The daemon's own rule (half its ``hb_refresh_s``).
        max_frame_rate: frames per second one connection may send (a burst of one second's
            worth); past it the front stops reading that connection until its budget is back
            (0: no bound); see :meth:`Front._throttle`.
    """

    mechanism: bytes
    max_frame_bytes: int
    max_message_bytes: int
    max_frames: int
    max_pending_bytes: int
    hb_repeat_s: float = 0.0  # NULL: a heartbeat repeating the connection's last message this recently is dropped
    max_frame_rate: float = 0.0  # frames/s per connection (burst: one second's worth); 0: no bound

    @property
    def max_command_bytes(self) -> int:
        if self.mechanism == b"CURVE":  # every frame travels in a MESSAGE command
            return self.max_frame_bytes + CURVE_OVERHEAD
        return MAX_COMMAND_BYTES


class InboundParser:
    """Follows one client's byte stream to the daemon: the 64-byte ZMTP 3 greeting, then frame
    headers (bodies are skipped, never copied). ``feed`` raises :class:`Cut` at the first byte
    that breaks a bound; ``unfinished`` is what the current message has declared so far."""

    __slots__ = ("limits", "alt", "greeting", "header", "header_need", "skip", "unfinished", "frames", "seen")

    def __init__(self, limits: Limits, alt: Limits | None = None) -> None:
        self.limits = limits
        self.alt = alt  # the sealed data path's limits: a greeting naming its mechanism takes them
        self.greeting = bytearray()
        self.header = bytearray()  # a frame header split across reads
        self.header_need = 0  # its bytes still to come (0: at a frame boundary)
        self.skip = 0  # body bytes of the current frame still to pass
        self.unfinished = 0  # bytes declared by the frames of the message in progress
        self.frames = 0  # its frames so far
        self.seen = 0  # frame headers read in all (commands included)

    def feed(self, data: memoryview | bytes) -> None:
        i, n = 0, len(data)
        if len(self.greeting) < GREETING_BYTES:
            i = min(n, GREETING_BYTES - len(self.greeting))
            start = len(self.greeting)
            self.greeting += data[:i]
            self._check_greeting(start)
        while i < n:
            if self.skip:
                k = min(self.skip, n - i)
                self.skip -= k
                i += k
            elif self.header_need:  # the rest of a split header
                k = min(self.header_need, n - i)
                self.header += data[i:i + k]
                self.header_need -= k
                i += k
                if not self.header_need:
                    self._frame(self.header[0], int.from_bytes(self.header[1:], "big"))
            else:
                flags = data[i]
                need = 9 if flags & LONG else 2
                if n - i >= need:  # the whole header is here (the common case)
                    size = int.from_bytes(data[i + 1:i + 9], "big") if need == 9 else data[i + 1]
                    i += need
                    self._frame(flags, size)
                else:
                    self.header = bytearray(data[i:n])
                    self.header_need = need - (n - i)
                    i = n

    def _check_greeting(self, start: int) -> None:
        g = self.greeting
        if start == 0 and g and g[0] != 0xFF:
            raise Cut("not a ZMTP 3 greeting (ZMTP 1.0 or not ZeroMQ)")
        if start <= 9 < len(g) and not g[9] & 0x01:
            raise Cut("not a ZMTP 3 greeting (ZMTP 1.0)")
        if start <= 10 < len(g) and g[10] < 3:
            raise Cut(f"ZMTP {g[10]}.x peers are not served (ZMTP 3 or later)")
        if start < 32 <= len(g):
            mech = bytes(g[12:32]).rstrip(b"\x00")
            if mech != self.limits.mechanism and self.alt is not None and mech == self.alt.mechanism:
                self.limits = self.alt
            elif mech != self.limits.mechanism:
                shown = mech.decode("ascii", "replace")[:20]
                raise Cut(f"security mechanism {shown!r}: this server speaks {self.limits.mechanism.decode()}")

    def _frame(self, flags: int, size: int) -> None:
        lim = self.limits
        self.seen += 1
        try:
            command = check_header(flags, size, lim.max_command_bytes)  # the codec's own rules
        except ZmtpError as e:
            raise Cut(str(e)) from None
        if command:
            pass
        elif lim.mechanism == b"CURVE":
            # libzmq sends CURVE MESSAGE boxes as frames; MORE is inside the box.
            if size > lim.max_command_bytes:
                raise Cut(f"a {size}-byte frame (at most {lim.max_command_bytes})")
        else:
            if size > lim.max_frame_bytes:
                raise Cut(f"a {size}-byte frame (at most {lim.max_frame_bytes})")
            self.frames += 1
            self.unfinished += size
            if self.frames > lim.max_frames:
                raise Cut(f"a message of more than {lim.max_frames} frames")
            if self.unfinished > lim.max_message_bytes:
                raise Cut(f"a message of more than {lim.max_message_bytes} bytes")
            if not flags & MORE:  # the last frame: the message is complete once its body passes;
                self.unfinished = self.frames = 0  # libzmq holds it then as a whole message (HWM)
        self.skip = size


_SOFT_ERRORS = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)
_IN, _OUT, _GONE = select.EPOLLIN, select.EPOLLOUT, select.EPOLLERR | select.EPOLLHUP


class _Pair:
    """One client connection and the front's connection to the daemon for it."""

    __slots__ = ("c", "d", "cfd", "dfd", "parser", "up", "down", "closing_since", "pending", "cmask", "dmask",
                 "short", "up_full", "down_full", "big_down", "src", "born", "last_done", "stage", "hs_buf",
                 "dscan", "win_start", "win_bytes", "hb_last", "hb_at", "dwin_start", "dwin_bytes", "dwin_q0",
                 "tokens", "tok_at", "paused_until", "route", "hs_pre", "strip", "token")

    def __init__(self, c: socket.socket, d: socket.socket | None, parser: InboundParser, now: float = 0.0) -> None:
        self.src: _Source | None = None  # the source address's tables while the client is there
        self.born = self.last_done = now  # accepted; the last complete inbound message (or the handshake)
        self.stage = HANDSHAKE  # HANDSHAKE, then OPEN (NULL) or AUTHED (CURVE: the daemon sent READY)
        self.hs_buf: bytearray | None = None  # NULL: the first command, held until it is whole
        self.dscan: bytearray | None = None  # CURVE: the daemon's bytes looked at until its READY
        self.win_start, self.win_bytes = 0.0, 0  # the progress window of an unfinished message
        self.hb_last: bytes | None = None  # NULL: the heartbeat passed on last, if nothing else came since
        self.hb_at = 0.0  # ... when
        # the window of a client leaving the daemon's bytes waiting: its start, the bytes written
        # to the client's socket since, and the bytes its send queue held then
        self.dwin_start, self.dwin_bytes, self.dwin_q0 = 0.0, 0, 0
        # the frame budget (Front._throttle): what is left of it, when it was last refilled, and
        # until when the client is not read (0.0: it is read)
        self.tokens, self.tok_at, self.paused_until = float("inf"), now, 0.0
        self.c: socket.socket | None = c
        self.d: socket.socket | None = d
        self.cfd, self.dfd = c.fileno(), (d.fileno() if d is not None else -1)
        # routing by mechanism (ROUTE_*): the client's bytes held until its side is known, and the
        # start of the daemon's greeting still to be checked and dropped (the front answered it)
        self.route, self.hs_pre, self.strip = ROUTE_NONE, None, b""
        self.token = b""  # a sealed data connection's token, once it checked out
        self.parser = parser
        self.up = b""  # read from the client, not yet written to the daemon
        self.down = b""  # read from the daemon, not yet written to the client
        self.closing_since: float | None = None  # the client went; draining the daemon side
        self.pending = 0  # this pair's share of Front.pending
        self.cmask = self.dmask = select.EPOLLIN  # what each side is registered for
        self.short = False  # the client sends large frames: read SPLICE_MIN at a time, splice their bodies
        # a splice found the daemon's (client's) socket full: read no more for it until it is
        # writable again, so the next splice is not read back out of the pipe at once
        self.up_full = self.down_full = False
        self.big_down = False  # the daemon's last read was large: splice the next (small ones are copied)


HANDSHAKE, OPEN, AUTHED = 0, 1, 2


class _Source:
    """The connections of one source address, in the order they would be shed."""

    __slots__ = ("name", "hs", "open", "total", "n")

    def __init__(self, name: str) -> None:
        self.name = name
        self.hs: dict[_Pair, None] = {}  # in their handshake, oldest first
        self.open: dict[_Pair, None] = {}  # past it (not authenticated), the oldest last message first
        self.total = 0  # every connection of this source (authenticated ones included)
        self.n = 0  # the ones that may be shed: len(hs) + len(open)

    def victim(self) -> _Pair:
        """The connection that has gone longest without a sign of life: the oldest handshake
        (from accept) or the oldest last complete message, whichever is older."""
        h = next(iter(self.hs), None)
        o = next(iter(self.open), None)
        if h is None or (o is not None and o.last_done < h.born):
            return o
        return h


class _Admission:
    """The front's side of accepting clients: the descriptor budget, shedding by source and silence,
    the handshake and progress deadlines (a mixin of :class:`Front`, which holds the state)."""

    def check_deadlines(self, now: float) -> None:
        """Cut the connections past the handshake deadline, and those whose unfinished message
        brought less than the floor in its last window while the daemon was taking their bytes."""
        b = self.budget
        while self.handshaking:
            p = next(iter(self.handshaking))
            if now - p.born < b.handshake_s:
                break
            self._cut(p, f"no ZMTP handshake within {b.handshake_s:g} s")
        for p in [p for p in self.mid if now - p.win_start >= b.window_s]:
            if p.up or p.up_full:  # the daemon is not reading: the slowness is not the client's
                p.win_start, p.win_bytes = now, 0
            elif p.win_bytes < b.floor_bytes:
                self._cut(p, f"an unfinished message brought {p.win_bytes} bytes in {b.window_s:g} s "
                             f"(at least {b.floor_bytes} per {b.window_s:g} s, or finish it)")
            else:
                p.win_start, p.win_bytes = now, 0
        for p in [p for p in self.stuck if now - p.dwin_start >= b.window_s]:
            queued = unsent_bytes(p.c)
            took = p.dwin_q0 + p.dwin_bytes - queued  # what left the socket's send queue for the client
            if took < b.floor_bytes:
                self._cut(p, f"took {took} bytes of what the server sent it in {b.window_s:g} s "
                             f"(at least {b.floor_bytes} per {b.window_s:g} s while bytes wait for it)")
            else:
                p.dwin_start, p.dwin_bytes, p.dwin_q0 = now, 0, queued

    def _down_progress(self, p: _Pair, sent: int) -> None:
        """``sent`` bytes of the daemon's went to the client; ``p.down`` is what it did not take.
        A client that leaves the daemon's bytes waiting (its socket full: it does not read) must
        take ``floor_bytes`` in every ``window_s`` while they wait, or it is cut
        (:meth:`check_deadlines`): what the daemon queues towards a peer that does not read
        (libzmq's pipe, up to its high-water mark) is then freed within a window, not held for as
        long as the peer likes, at any machine speed (the front writes what a client takes
        before it looks at the windows). What the client took is what left the socket's send
        queue (``SIOCOUTQ``), not what the front wrote: a slow reader frees the queue's room in
        large steps, and between them it still takes bytes."""
        if not p.down:
            self.stuck.discard(p)
        elif p in self.stuck:
            p.dwin_bytes += sent
        else:
            self.stuck.add(p)
            p.dwin_start, p.dwin_bytes, p.dwin_q0 = self.clock(), 0, unsent_bytes(p.c)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                c, addr = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self._shed_one(f"no descriptor left ({os.strerror(e.errno)})"):
                        continue  # room made at once: accept again
                    self._pause_accepts(f"cannot accept more connections ({os.strerror(e.errno)})")
                    return
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    continue
                raise
            source = _source_of(c, addr)
            per = self.budget.per_source
            held = (self.sources[source].total if source in self.sources else 0) + self.handed_by_source.get(source, 0)
            if per and held >= per:
                self.refused += 1
                c.close()
                self._log_cut(f"{source} holds {per} connections (serve --max-connections-per-source)")
                continue
            if not self._make_room():  # FD_RESERVE holds the accepted socket meanwhile
                self.refused += 1
                c.close()
                return
            if not self._connect(c, source):
                return

    def _make_room(self) -> bool:
        """Room for the client just accepted (two descriptors) within the budget, shedding
        connections that may be shed (:meth:`_shed_one`) until there is. False: none may be (it
        is closed, and accepts pause)."""
        while 2 * self.clients + len(self.draining) + 2 > self.budget.max_fds:
            if not self._shed_one(f"the front's {self.budget.max_clients} connections are taken"):
                self._pause_accepts(f"all {self.clients} connections are authenticated or draining")
                return False
        return True

    def _pause_accepts(self, why: str) -> None:
        """Nothing can be shed: further clients wait in the listen backlog for 0.2 s."""
        self._log_cut(f"{why}: pausing accepts for 0.2 s")
        self._set_accepting(False)
        self.accept_paused_until = self.clock() + 0.2

    def _shed_one(self, why: str) -> bool:
        """Cut the connection that has waited longest without a sign of life (see
        :meth:`_Source.victim`), from the source address with the most connections that may be
        shed. An authenticated connection (CURVE) is never shed. False: none may be."""
        while self.top_n and not self.by_n.get(self.top_n):
            self.top_n -= 1
        if not self.top_n:
            return False
        src = self.sources[next(iter(self.by_n[self.top_n]))]
        self.shed += 1
        self._cut(src.victim(), f"shed to make room ({why}; {src.name} holds {src.total})")
        return True

    def _connect(self, c: socket.socket, source: str) -> bool:
        """Pair an accepted client with a new connection to the daemon. False: stop accepting
        for now (no descriptor for the daemon's side). With the sealed data path the daemon's
        side waits for the client's mechanism (:meth:`_route`)."""
        if self.data is not None or self.hand is not None:
            c.setblocking(False)
            if c.family in (socket.AF_INET, socket.AF_INET6):
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _keepalive(c)
            if self.data is not None:
                p = _Pair(c, None, InboundParser(self.limits, self.data[1]), self.clock())
                p.route, p.hs_pre, p.down = ROUTE_GREETING, bytearray(), SIGNATURE
            else:  # the front does the handshake, then hands the connection over (_hand_over)
                p = _Pair(c, None, InboundParser(self.limits), self.clock())
                p.route, p.hs_pre, p.hs_buf, p.down = ROUTE_HAND, bytearray(), bytearray(), HAND_GREETING
            self.pairs[p.cfd] = p
            self.ep.register(p.cfd, select.EPOLLIN)
            self.accepted += 1
            self._track(p, source)
            self._write_client(p)
            return True
        try:
            d = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as e:
            c.close()
            log.warning("cannot open a connection to the daemon (%s)", e)
            return False
        d.setblocking(False)
        try:
            d.connect(self.backend)
        except OSError as e:  # the daemon's backlog is full or it is going: the client retries
            c.close()
            d.close()
            log.debug("connection to the daemon refused: %s", e)
            return True
        c.setblocking(False)
        if c.family in (socket.AF_INET, socket.AF_INET6):
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(c)
        p = _Pair(c, d, InboundParser(self.limits), self.clock())
        if self.limits.mechanism == b"NULL":
            p.hs_buf = bytearray()
        else:
            p.dscan = bytearray()
        self.pairs[p.cfd] = p
        self.pairs[p.dfd] = p
        self.ep.register(p.cfd, select.EPOLLIN)
        self.ep.register(p.dfd, select.EPOLLIN)
        self.accepted += 1
        self._track(p, source)
        return True

    def _bump(self, src: _Source, delta: int) -> None:
        """Move a source between the buckets of its sheddable count."""
        if src.n:
            bucket = self.by_n[src.n]
            del bucket[src.name]
            if not bucket:
                del self.by_n[src.n]
        src.n += delta
        if src.n:
            self.by_n.setdefault(src.n, {})[src.name] = None
            self.top_n = max(self.top_n, src.n)

    def _track(self, p: _Pair, source: str) -> None:
        src = self.sources.get(source)
        if src is None:
            src = self.sources[source] = _Source(source)
        p.src = src
        src.total += 1
        src.hs[p] = None
        self.handshaking[p] = None
        self.clients += 1
        self._bump(src, 1)

    def _untrack(self, p: _Pair) -> None:
        """The client is gone: out of every table (idempotent)."""
        src = p.src
        if src is None:
            return
        p.src = None
        self.clients -= 1
        if p.stage == AUTHED:
            if p.token:
                self.data_authed -= 1
            else:
                self.curve_authed -= 1
        if p.token and self.data_tokens.get(p.token) is p:
            del self.data_tokens[p.token]
        self.handshaking.pop(p, None)
        self.mid.discard(p)
        self.stuck.discard(p)
        self.paused.discard(p)
        src.total -= 1
        if src.hs.pop(p, 0) is None or src.open.pop(p, 0) is None:
            self._bump(src, -1)
        if not src.total:
            del self.sources[src.name]

    def _handshake_done(self, p: _Pair, stage: int) -> None:
        """The client finished its handshake: OPEN (NULL), or AUTHED (CURVE: never shed)."""
        src = p.src
        if src is None or p.stage != HANDSHAKE:
            return
        p.stage = stage
        self.handshaking.pop(p, None)
        del src.hs[p]
        p.last_done = self.clock()
        if stage == OPEN:
            src.open[p] = None
        else:
            self.curve_authed += 1
            self._bump(src, -1)

    def _promote(self, p: _Pair, token: bytes) -> None:
        """A data connection whose token checked out (PROTOCOL.md §6.15). One connection per
        token: a newer one replaces the older (the worker reconnected). It is never shed while
        there are fewer such connections than authenticated CURVE ones (one per worker); past
        that it stays sheddable, so tokens seen on the wire cannot fill the front."""
        old = self.data_tokens.get(token)
        if old is not None and old is not p:
            self._cut(old, "replaced by a newer connection with its token")
        p.token = token
        self.data_tokens[token] = p
        src = p.src
        if src is None or p.stage != OPEN or self.data_authed >= self.curve_authed:
            return
        del src.open[p]
        self._bump(src, -1)
        p.stage = AUTHED
        self.data_authed += 1

    def _progress(self, p: _Pair, n: int) -> None:
        """``n`` bytes of the client's arrived: a message finished (its last frame's body
        passed) or the unfinished one's window counts them."""
        if p.stage == HANDSHAKE or p.src is None:
            return
        parser = p.parser
        if parser.skip or parser.header_need or parser.frames:
            if p not in self.mid:
                self.mid.add(p)
                p.win_start, p.win_bytes = self.clock(), 0
            p.win_bytes += n
            return
        self.mid.discard(p)
        p.last_done = self.clock()
        if p.stage == OPEN:  # to the end of the shedding order
            del p.src.open[p]
            p.src.open[p] = None

class _Splicing:
    """Moving frame bodies and the daemon's bytes with splice(2) through the shared pipe (a mixin of
    :class:`Front`)."""

    def _splice_body(self, p: _Pair) -> bool:
        """Splice the next bytes of a frame body to the daemon (never past the body: the next
        header is read, and parsed, in userspace). False: splice was refused."""
        p.short = True
        n = self._splice_in(p.cfd, min(p.parser.skip, CHUNK))
        if n is None:
            return False
        if n > 0:
            p.parser.skip -= n  # a body changes nothing the bounds count
            self.spliced += n
            self._progress(p, n)
            p.up, failed = self._splice_out(p.dfd, n)
            if failed:
                self._daemon_gone(p)
                return True
            p.up_full = bool(p.up)
            self._mask(p)
        elif not n:
            self._client_gone(p)
        return True

    def _splice_in(self, fd: int, count: int) -> int | None:
        """Splice at most ``count`` bytes from ``fd`` into the (empty) pipe: how many (0: EOF or
        an error, the side is gone), -1 for nothing yet, None where splice is refused."""
        try:
            return os.splice(fd, self.pipe[1], count, flags=_SPLICE_FLAGS)
        except OSError as e:
            if e.errno in _SOFT_ERRORS:
                return -1
            if e.errno in _NO_SPLICE:
                self._no_splice(e)
                return None
            return 0

    def _splice_out(self, fd: int, n: int) -> tuple[bytes, bool]:
        """Move the ``n`` bytes in the pipe to ``fd``. Returns what ``fd`` did not take (read
        back out of the pipe, which is empty again) and whether writing ``fd`` failed."""
        sent, failed, refused = 0, False, None
        try:
            sent = os.splice(self.pipe[0], fd, n, flags=_SPLICE_FLAGS)
        except OSError as e:
            if e.errno in _NO_SPLICE:
                refused = e
            elif e.errno not in _SOFT_ERRORS:
                failed = True
        rest = b""
        while len(rest) < n - sent:  # the pipe holds exactly these bytes: each read returns some
            chunk = os.read(self.pipe[0], n - sent - len(rest))
            if not chunk:
                raise RuntimeError("the front's pipe held fewer bytes than were spliced into it")
            rest += chunk
        if refused is not None:
            self._no_splice(refused)
        return rest, failed

    def _no_splice(self, e: OSError | None) -> None:
        """Stop splicing (every connection goes on through the front's buffer)."""
        if e is not None:
            log.warning("splice refused (%s): relaying through the front's buffer", os.strerror(e.errno))
        if self.pipe is not None:
            for fd in self.pipe:
                os.close(fd)
            self.pipe = None

    def _splice_down(self, p: _Pair) -> bool:
        """Splice what the daemon sent to the client. False: splice was refused."""
        n = self._splice_in(p.dfd, CHUNK)
        if n is None:
            return False
        if n > 0:
            self.spliced += n
            p.big_down = n >= SPLICE_MIN
            p.down, failed = self._splice_out(p.cfd, n)
            if failed:
                self._client_gone(p)
                return True
            p.down_full = bool(p.down)
            self._down_progress(p, n - len(p.down))
            self._mask(p)
        elif not n:
            self._daemon_gone(p)
        return True


class _Handshakes:
    """The handshake as the front sees it (a mixin of :class:`Front`): X-Source in a NULL READY,
    a CURVE connection's authentication, and routing by mechanism to the sealed data path."""

    def _hold_handshake(self, p: _Pair, data: memoryview, greeting: int) -> bytes | None:
        """NULL: pass the greeting on as it comes (libzmq sends the rest of its greeting only
        once it has read the peer's first bytes), hold the client's first command until it is
        whole, then pass it on with ``X-Source`` set if it is a READY (:func:`with_source`).
        ``greeting``: how many bytes at the start of ``data`` are the greeting's. None: nothing
        to pass on yet."""
        p.hs_buf += data[greeting:]
        end = _frame_end(p.hs_buf, 0)
        if end is None and len(p.hs_buf) > 9 + MAX_READY_BYTES or end is not None and end > 9 + MAX_READY_BYTES:
            self._cut(p, f"a first command of more than {MAX_READY_BYTES} bytes")
            return None
        if end is None:
            return bytes(data[:greeting]) or None
        buf, p.hs_buf = p.hs_buf, None
        self._handshake_done(p, OPEN)
        return bytes(data[:greeting]) + with_source(bytes(buf[:end]), p.src.name) + bytes(buf[end:])

    def _scan_down(self, p: _Pair, data: memoryview) -> None:
        """CURVE: the daemon's READY command means ZAP accepted the client's key (libzmq sends it
        after INITIATE checked out): from then on the connection is authenticated."""
        p.dscan += data
        while True:
            if len(p.dscan) < GREETING_BYTES:
                return
            end = _frame_end(p.dscan, GREETING_BYTES)
            if end is None:
                return
            body = p.dscan[GREETING_BYTES + (9 if p.dscan[GREETING_BYTES] & LONG else 2):end]
            if p.dscan[GREETING_BYTES] & COMMAND and body[:6] == b"\x05READY":
                p.dscan = None
                self._handshake_done(p, AUTHED)
                return
            del p.dscan[GREETING_BYTES:end]  # WELCOME (or another command): look at the next

    def _attach(self, p: _Pair, backend: str) -> bool:
        """Connect a routed client's daemon side to ``backend``; False: the client was cut."""
        try:
            d = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as e:
            self._cut(p, f"no connection to the daemon ({e})")
            return False
        d.setblocking(False)
        try:
            d.connect(backend)
        except OSError as e:
            d.close()
            self._cut(p, f"connection to the daemon refused ({e})")
            return False
        p.d, p.dfd = d, d.fileno()
        self.pairs[p.dfd] = p
        self.ep.register(p.dfd, select.EPOLLIN)
        p.dmask = select.EPOLLIN
        return True

    def _route(self, p: _Pair, data: memoryview) -> bytes | None:
        """A client whose mechanism is not known yet (the sealed data path, PROTOCOL.md §6.15):
        ``data`` is held until its greeting names it. CURVE goes to the daemon's CURVE socket (the
        front answered the greeting's first 11 bytes). NULL gets the rest of a NULL greeting from
        the front, and its first command (READY) must carry a routing id that is a token of this
        daemon (an HMAC under the secret the two share, protocol/seal.py): only then does it go
        to the daemon's data socket, so a peer without a token never reaches the daemon. Returns
        the bytes to pass on now (None: nothing yet, or cut)."""
        if p.route == ROUTE_HAND:
            return self._hand_over(p, data)
        if p.route == ROUTE_GREETING:
            p.hs_pre += data
            if len(p.parser.greeting) < GREETING_BYTES:
                return None
            held, p.hs_pre = bytes(p.hs_pre), None
            if p.parser.limits.mechanism == self.limits.mechanism:  # CURVE
                if not self._attach(p, self.backend):
                    return None
                p.route, p.strip, p.dscan = ROUTE_NONE, SIGNATURE, bytearray(SIGNATURE)
                return held
            p.route, p.hs_pre, p.hs_buf = ROUTE_READY, bytearray(held[:GREETING_BYTES]), bytearray()
            p.down = p.down + NULL_GREETING[len(SIGNATURE):]
            self._write_client(p)
            data = memoryview(held)[GREETING_BYTES:]
        out = self._hold_handshake(p, data, 0)
        if out is None or p.c is None:
            return None
        ready = out[:_frame_end(bytearray(out), 0)]
        body = ready[9 if ready[0] & LONG else 2:]
        props = dict(_properties(body[6:]) or ()) if ready[0] & COMMAND and body[:6] == b"\x05READY" else {}
        token = props.get(b"Identity", b"")
        if not token_ok(self.data[2], token):
            self._cut(p, "a NULL connection without a token of this server's sealed data path")
            return None
        if self.hand is not None:  # the daemon reads it itself: the front's READY, then the descriptor
            p.down = p.down + zmtp_ready(b"ROUTER")
            p.hs_pre += out  # its greeting, then its READY and what followed
            self._write_client(p)
            return self._handing(p) if p.c is not None else None
        if not self._attach(p, self.data[0]):
            return None
        self._promote(p, token)
        pre, p.hs_pre = bytes(p.hs_pre), None
        p.route, p.strip = ROUTE_NONE, NULL_GREETING
        return pre + out


class _HandOvers:
    """Handing plaintext connections to the daemon once their handshake is done (ps/net/handover.py),
    and the frame rate and heartbeat repeats of a relayed one (a mixin of :class:`Front`)."""

    def _set_hand(self, hand: str | None) -> None:
        if self.hand is not None:
            self.unwatch(self.hand.fileno())
            self.hand.close()
            self.hand = None
            self._flush_hands()  # those waiting are cut
        self.hand_mask = select.EPOLLIN
        self.handed.clear()
        self.handed_by_source.clear()
        if hand is None:
            return
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(hand)
        except OSError as e:
            s.close()
            log.warning("the server process takes no connections handed over (%s): relaying them", e)
            return
        s.setblocking(False)
        self.hand = s
        self.watch(s.fileno(), self._hand_notices)

    def _hand_notices(self) -> None:
        """The hand-over socket is readable (the daemon closed connections it was handed: out of the
        count per source) or writable (connections wait to be handed over)."""
        if self.hand_wait:
            self._flush_hands()
        for _ in range(64):
            try:
                data = self.hand.recv(MAX_HAND_MESSAGE)
            except OSError as e:
                if e.errno in _SOFT_ERRORS:
                    return
                data = b""
            if not data:  # the daemon went: its connections with it
                self._set_hand(None)
                return
            if data[:1] != CLOSED:
                continue
            for i in range(1, len(data) - 7, 8):
                source = self.handed.pop(int.from_bytes(data[i:i + 8], "big"), None)
                if source is not None:
                    left = self.handed_by_source[source] - 1
                    if left:
                        self.handed_by_source[source] = left
                    else:
                        del self.handed_by_source[source]

    def _hand_over(self, p: _Pair, data: memoryview) -> None:
        """NULL with the hand-over: the client's bytes are held until its READY is whole (the
        front's checks, ``X-Source`` given apart), then its descriptor goes to the daemon with what
        was read and what of the front's greeting it has not taken, and the front lets it go."""
        greeting = max(0, min(len(data), GREETING_BYTES - len(p.hs_pre)))  # of data: the greeting's bytes
        p.hs_pre += data
        if self._hold_handshake(p, data, greeting) is None or p.c is None or p.hs_buf is not None:
            if p.c is not None:
                self._mask(p)
            return None
        return self._handing(p)

    def _handing(self, p: _Pair) -> None:
        """``p``'s handshake is done (``p.hs_pre``: all it sent, ``p.down``: what of the front's
        greeting and READY it has not taken): it waits for the hand-over socket."""
        p.up_full = True  # read no more of it: what comes next is the daemon's to read
        self._mask(p)
        self.hand_wait.append(p)
        self._flush_hands()
        return None

    def _flush_hands(self) -> None:
        """Hand over the connections waiting (the hand-over socket holds what its send buffer
        holds: 500 workers joining at once filled it): what it does not take now waits for the
        socket to be writable again (EPOLLOUT)."""
        while self.hand_wait:
            p = self.hand_wait[0]
            if p.c is None or self.hand is None:  # gone meanwhile, or the daemon is
                self.hand_wait.popleft()
                if p.c is not None:
                    self._cut(p, "the server process went before it took the connection")
                continue
            self.next_cid += 1
            cid, source = self.next_cid, p.src.name
            try:
                socket.send_fds(self.hand, [pack_hand(cid, source, bytes(p.down), bytes(p.hs_pre))], [p.cfd])
            except BlockingIOError:
                break
            except OSError as e:
                self.hand_wait.popleft()
                self._cut(p, f"the server process did not take the connection ({e.strerror or e})")
                continue
            self.hand_wait.popleft()
            self._handed(p, cid, source)
        want = select.EPOLLIN | (select.EPOLLOUT if self.hand_wait else 0)
        if self.hand is not None and want != self.hand_mask:
            self.ep.modify(self.hand.fileno(), want)
            self.hand_mask = want

    def _handed(self, p: _Pair, cid: int, source: str) -> None:
        """The daemon holds the connection now: the front keeps its source's count, nothing else."""
        self.handed[cid] = source
        self.handed_by_source[source] = self.handed_by_source.get(source, 0) + 1
        self.handed_over += 1
        self._release(p)
        self._untrack(p)
        self.pairs.pop(p.cfd, None)
        self.ep.unregister(p.cfd)
        p.c.close()  # the daemon's copy keeps the connection open
        p.c, p.up, p.down = None, b"", b""

    def _throttle(self, p: _Pair, frames: int) -> None:
        """``frames`` frame headers came in the client's last read: take them from its budget
        (a bucket of ``max_frame_rate`` a second, holding at most one second's worth); once it
        is spent the client is not read until the budget is back. What was read is passed on:
        nothing is dropped, the sender's own socket fills and its sends wait, so one connection's
        flood (heartbeats sent as fast as a peer can) costs its sender, not the daemon's loop
        that every worker's replies share. A worker's own pace is far below the bound (a reply
        and a heartbeat per job: a few thousand frames a second at the smallest sizes)."""
        rate = self.limits.max_frame_rate
        now = self.clock()
        p.tokens = min(rate, p.tokens + (now - p.tok_at) * rate) - frames
        p.tok_at = now
        if p.tokens < 0:
            p.paused_until = now - p.tokens / rate
            self.paused.add(p)
            self.throttled += 1

    def _repeat(self, p: _Pair, data: memoryview, boundary: bool) -> bool:
        """Whether ``data`` (a whole read, past the NULL handshake) is a heartbeat that repeats,
        byte for byte, the connection's previous message, passed on less than
        ``limits.hb_repeat_s`` ago: it is dropped here, one hop before the daemon would drop it
        unread (ps/net/connections.py, ``repeat_heartbeat``), which saves the daemon receiving it
        and the front sending it. Only a read that is exactly one short one-frame message
        counts; anything else passed on forgets the heartbeat. The window is half the daemon's:
        whatever a worker's pace, one of its heartbeats is passed on at least every half window
        plus its period, so the daemon still hands one to the core at least every
        ``1.5 * hb_refresh_s`` plus that period (2 s at the defaults, against a liveness of 3 s)."""
        n = len(data)
        if boundary and 2 < n <= 257 and data[0] == 0 and data[1] == n - 2:
            body = bytes(data[2:])
            if looks_like_heartbeat(body):
                now = self.clock()
                if body == p.hb_last and now - p.hb_at < p.parser.limits.hb_repeat_s:
                    self.hb_dropped += 1
                    return True
                p.hb_last, p.hb_at = body, now
                return False
        p.hb_last = None
        return False


class Front(_Admission, _Splicing, _Handshakes, _HandOvers):
    """The relay's event loop (epoll, level-triggered, one thread).

    Args:
        listener: the bound, listening public socket (TCP or Unix).
        limits: what a client may send (see :class:`Limits`).
        clock: monotonic clock.
    """

    def __init__(self, listener: socket.socket, limits: Limits | None = None,
                 clock: Callable[[], float] = time.monotonic, splice: bool = True,
                 budget: Budget | None = None) -> None:
        self.budget = budget if budget is not None else Budget.from_rlimit()
        self.sources: dict[str, _Source] = {}
        self.by_n: dict[int, dict[str, None]] = {}  # sheddable count -> the sources with it
        self.top_n = 0  # an upper bound on the largest sheddable count
        self.clients = 0  # client sockets open
        self.handshaking: dict[_Pair, None] = {}  # every connection in its handshake, oldest first
        self.mid: set[_Pair] = set()  # connections with an unfinished message (progress windows)
        self.stuck: set[_Pair] = set()  # connections whose client leaves the daemon's bytes waiting
        self.next_check = 0.0
        self.shed = self.refused = 0
        self.hb_dropped = 0  # heartbeat repeats dropped (_repeat)
        self.paused: set[_Pair] = set()  # connections not read until their frame budget is back (_throttle)
        self.curve_authed = self.data_authed = 0  # connections never shed: CURVE-authenticated, sealed data
        self.data_tokens: dict[bytes, _Pair] = {}  # a sealed data connection's token -> its connection
        self.throttled = 0  # times a connection was paused for its frame rate
        self.hand: socket.socket | None = None  # the daemon's hand-over socket (ps/net/handover.py), if it takes them
        self.hand_mask = select.EPOLLIN
        self.hand_wait: collections.deque[_Pair] = collections.deque()  # handshakes done, for the daemon to take
        self.handed: dict[int, str] = {}  # connections handed over and still open -> their source
        self.handed_by_source: dict[str, int] = {}
        self.next_cid = 0
        self.listener = listener
        listener.setblocking(False)
        self.limits = limits
        self.clock = clock
        self.ep = select.epoll()
        self.backend: str | None = None  # the daemon's Unix socket path while it is up
        self.data: tuple[str, Limits, bytes] | None = None  # its sealed data path (set_backend)
        self.pairs: dict[int, _Pair] = {}  # fd (either side) -> its pair
        self.watched: dict[int, Callable[[], None]] = {}  # other fds (signals, the child) -> callback
        self.accepting = False
        self.pending = 0  # bytes declared by all connections' unfinished messages
        self.accepted = self.cut = self.handed_over = 0
        self._log_cut = CutLog(log, clock)  # one line per second for cut, shed and refused connections
        self.accept_paused_until = 0.0
        self.draining: set[_Pair] = set()
        self.view = memoryview(bytearray(CHUNK))  # every read lands here; only an unsent rest is copied
        self.pipe: tuple[int, int] | None = _open_pipe() if splice else None  # shared, empty between calls
        self.spliced = 0  # bytes moved by splice (both directions)

    # ---------------------------------------------------------------- set-up
    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` when ``fd`` is readable (the supervisor's own fds)."""
        self.watched[fd] = callback
        self.ep.register(fd, select.EPOLLIN)

    def unwatch(self, fd: int) -> None:
        if self.watched.pop(fd, None) is not None:
            self.ep.unregister(fd)

    def set_backend(self, path: str | None, limits: Limits | None = None,
                    data: tuple[str, Limits, bytes] | None = None, hand: str | None = None) -> None:
        """The daemon is up at ``path`` (accept clients) or down (None: every connection is
        closed, new ones wait in the listen backlog). ``data``: its sealed data path under
        CurveZMQ (private endpoint, the NULL connections' limits, the tokens' secret): clients
        are then routed by their greeting's mechanism (:meth:`_route`). ``hand``: the daemon's
        hand-over socket: each client under NULL, each sealed data connection under CurveZMQ, is
        handed over once its handshake is done (:meth:`_hand_over`)."""
        if limits is not None:
            self.limits = limits
        self.data = data if path is not None else None
        self._set_hand(hand if path is not None else None)
        if path is None:
            for p in set(self.pairs.values()):
                self._close_pair(p)
            self.draining.clear()
        self.backend = path
        self._set_accepting(path is not None)

    def _set_accepting(self, on: bool) -> None:
        if on and not self.accepting:
            self.ep.register(self.listener.fileno(), select.EPOLLIN)
        elif not on and self.accepting:
            self.ep.unregister(self.listener.fileno())
        self.accepting = on

    # ---------------------------------------------------------------- the loop
    def run_once(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for events and handle them."""
        now = self.clock()
        if self.draining or self.handshaking or self.mid or self.stuck:
            timeout = min(timeout, CHECK_EVERY_S)
        if self.paused:
            timeout = max(0.0, min(timeout, min(p.paused_until for p in self.paused) - now))
        if not self.accepting and self.backend is not None and now >= self.accept_paused_until:
            self._set_accepting(True)
        try:
            events = self.ep.poll(timeout)
        except InterruptedError:
            return
        lfd = self.listener.fileno()
        for fd, ev in events:
            if fd == lfd:
                if self.accepting:
                    self._accept()
                continue
            cb = self.watched.get(fd)
            if cb is not None:
                cb()
                continue
            p = self.pairs.get(fd)
            if p is None:
                continue
            # A hang-up or error while a side is not read (what was read from it waits for the
            # other side) ends that side at once; with reading on, the read finds the end.
            if fd == p.cfd and p.c is not None:
                if ev & _OUT:
                    self._write_client(p)
                if p.c is not None:
                    if ev & _IN:
                        self._read_client(p)
                    elif ev & _GONE:
                        self._client_gone(p)
            elif fd == p.dfd and p.d is not None:
                if ev & _OUT:
                    self._write_daemon(p)
                if p.d is not None:
                    if ev & _IN:
                        self._read_daemon(p)
                    elif ev & _GONE:
                        self._daemon_gone(p)
        now = self.clock()
        if self.paused:
            for p in [p for p in self.paused if now >= p.paused_until]:
                self.paused.discard(p)
                p.paused_until = 0.0
                if p.c is not None:
                    self._mask(p)
        if self.draining:
            for p in [p for p in self.draining if now - p.closing_since > DRAIN_S]:
                self._close_pair(p)  # the daemon did not close in time: close (it has read our EOF or will)
        if now >= self.next_check:
            self.next_check = now + CHECK_EVERY_S
            self.check_deadlines(now)

    def close(self) -> None:
        self.set_backend(None)
        self.ep.close()
        self._no_splice(None)

    # ---------------------------------------------------------------- connections
    # ---------------------------------------------------------------- accounting per source
    def _mask(self, p: _Pair) -> None:
        """Read a side only when what was read from it has gone to the other side."""
        wait_up, wait_down = p.up or p.up_full, p.down or p.down_full
        if p.c is not None:
            wait_up = wait_up or p.paused_until
            m = (0 if wait_up else select.EPOLLIN) | (select.EPOLLOUT if wait_down else 0)
            if m != p.cmask:
                self.ep.modify(p.cfd, m)
                p.cmask = m
        if p.d is not None:
            m = (0 if wait_down and p.c is not None else select.EPOLLIN) | (select.EPOLLOUT if p.up or p.up_full else 0)
            if m != p.dmask:
                self.ep.modify(p.dfd, m)
                p.dmask = m

    def _read_client(self, p: _Pair) -> None:
        parser = p.parser
        if parser.skip >= SPLICE_MIN and self.pipe is not None and self._splice_body(p):
            return
        # after a spliced body, read little more than the next headers: a large body is spliced
        want = SPLICE_MIN if p.short and self.pipe is not None else CHUNK
        if p.route == ROUTE_HAND or p.route and self.hand is not None:  # a handshake that goes with its descriptor
            want = HAND_READ
        try:
            n = p.c.recv_into(self.view, want)
        except OSError as e:
            if e.errno in _SOFT_ERRORS:
                return
            n = 0
        if not n:
            self._client_gone(p)
            return
        data = self.view[:n]
        boundary = not (parser.skip or parser.header_need or parser.frames)  # a message may start here
        before, greeting, seen = parser.unfinished, GREETING_BYTES - len(parser.greeting), parser.seen
        try:
            parser.feed(data)
        except Cut as e:
            self._cut(p, str(e))
            return
        if self.limits.max_frame_rate and parser.seen > seen:
            self._throttle(p, parser.seen - seen)
        delta = parser.unfinished - before
        if delta:
            self.pending += delta
            p.pending += delta
            if delta > 0 and self.pending > self.limits.max_pending_bytes:
                self._cut(p, f"all connections' unfinished messages passed {self.limits.max_pending_bytes} bytes")
                return
        if n == want and p.short and parser.skip < SPLICE_MIN:
            p.short = False  # small frames queue up: read them CHUNK at a time again
        if p.route:
            data = self._route(p, data)
            if data is None:
                if p.c is not None:
                    self._mask(p)
                return
        elif p.hs_buf is not None:
            data = self._hold_handshake(p, data, min(n, greeting))
            if data is None:
                self._mask(p)
                return
        self._progress(p, n)
        if p.stage == OPEN and parser.limits.hb_repeat_s and self._repeat(p, data, boundary):
            return
        p.up = data
        self._write_daemon(p)

    def _write_daemon(self, p: _Pair) -> None:
        if p.up:
            try:
                n = p.d.send(p.up)
            except OSError as e:
                if e.errno in _SOFT_ERRORS:
                    n = 0
                else:
                    self._daemon_gone(p)
                    return
            p.up = bytes(p.up[n:]) if n < len(p.up) else b""  # the rest leaves the shared buffer
        else:
            p.up_full = False  # writable again with nothing left to write
        self._mask(p)

    def _read_daemon(self, p: _Pair) -> None:
        if p.big_down and p.dscan is None and p.c is not None and self.pipe is not None and self._splice_down(p):
            return
        try:
            n = p.d.recv_into(self.view, CHUNK)
        except OSError as e:
            if e.errno in _SOFT_ERRORS:
                return
            n = 0
        if not n:
            self._daemon_gone(p)
            return
        if p.c is None:  # draining after the client went: discard
            return
        p.big_down = n >= SPLICE_MIN
        p.down = self.view[:n]
        if p.strip:  # the start of the daemon's greeting, which the front answered the client with
            k = min(len(p.strip), n)
            if bytes(p.down[:k]) != p.strip[:k]:
                self._cut(p, "the daemon's greeting is not the one the front answered with")
                return
            p.strip, p.down = p.strip[k:], p.down[k:]
            if not p.down:
                return
        if p.dscan is not None:
            self._scan_down(p, p.down)
        self._write_client(p)

    def _write_client(self, p: _Pair) -> None:
        if p.down:
            try:
                n = p.c.send(p.down)
            except OSError as e:
                if e.errno in _SOFT_ERRORS:
                    n = 0
                else:
                    self._client_gone(p)
                    return
            p.down = bytes(p.down[n:]) if n < len(p.down) else b""
            self._down_progress(p, n)
        else:
            p.down_full = False
        self._mask(p)

    def _cut(self, p: _Pair, why: str) -> None:
        self.cut += 1
        self._log_cut(why)
        if p.c is not None:  # the client gets a reset: it broke a bound, nothing it sent is kept
            reset(p.c)
        self._client_gone(p)

    def _release(self, p: _Pair) -> None:
        if p.pending:
            self.pending -= p.pending
            p.pending = 0

    def _client_gone(self, p: _Pair) -> None:
        """Close the client; half-close the daemon side and drain it until the daemon closes
        (what the client sent and the daemon has not read is dropped with the connection)."""
        self._release(p)
        self._untrack(p)
        if p.c is not None:
            self.pairs.pop(p.cfd, None)
            self.ep.unregister(p.cfd)
            p.c.close()
            p.c = None
        p.up = p.down = b""
        p.up_full = p.down_full = False
        if p.d is None:
            return
        try:
            p.d.shutdown(socket.SHUT_WR)
        except OSError:
            self._close_pair(p)
            return
        p.closing_since = self.clock()
        self.draining.add(p)
        self._mask(p)

    def _daemon_gone(self, p: _Pair) -> None:
        """The daemon closed its end (libzmq dropped the connection, or it is stopping): the
        client gets what is already read, then an orderly close."""
        if p.c is not None and p.down:
            try:
                p.c.send(p.down)
            except OSError:
                pass
        self._close_pair(p)

    def _close_pair(self, p: _Pair) -> None:
        self._release(p)
        self._untrack(p)
        self.draining.discard(p)
        for attr in ("c", "d"):
            s = getattr(p, attr)
            if s is not None:
                self.pairs.pop(s.fileno(), None)
                try:
                    self.ep.unregister(s.fileno())
                except (OSError, ValueError):
                    pass
                s.close()
                setattr(p, attr, None)


def _source_of(c: socket.socket, addr) -> str:
    """The client's source address as text ("unix" for a Unix socket; an IPv4 address mapped
    into IPv6 by a dual-stack listener as plain IPv4)."""
    if c.family == socket.AF_UNIX:
        return "unix"
    host = str(addr[0])
    return host[7:] if host.startswith("::ffff:") and "." in host else host


def _frame_end(buf: bytearray, at: int) -> int | None:
    """Where the frame starting at ``at`` in ``buf`` ends, or None if it is not all here."""
    if len(buf) <= at:
        return None
    hl = 9 if buf[at] & LONG else 2
    if len(buf) < at + hl:
        return None
    end = at + hl + int.from_bytes(buf[at + 1:at + hl], "big")
    return end if len(buf) >= end else None


def _properties(data: bytes) -> list[tuple[bytes, bytes]] | None:
    """ZMTP metadata properties (name length, name, 4-byte value length, value), or None if
    they do not parse (the daemon's libzmq then rejects the command itself)."""
    out, i = [], 0
    while i < len(data):
        k = data[i]
        name = data[i + 1:i + 1 + k]
        i += 1 + k
        if k == 0 or len(name) < k or i + 4 > len(data):
            return None
        v = int.from_bytes(data[i:i + 4], "big")
        value = data[i + 4:i + 4 + v]
        i += 4 + v
        if len(value) < v:
            return None
        out.append((name, value))
    return out


def with_source(frame: bytes, source: str) -> bytes:
    """A client's first command frame with the ``X-Source`` property set to ``source`` if it is
    a READY (any ``X-Source`` the client sent itself is dropped: it cannot spoof its address);
    anything else unchanged. The daemon reads it as ``frame.get("X-Source")`` (zmq_msg_gets)."""
    flags = frame[0]
    body = frame[9 if flags & LONG else 2:]
    if not flags & COMMAND or body[:6] != b"\x05READY":
        return frame
    props = _properties(body[6:])
    if props is None:
        return frame
    value = source.encode()
    out = b"\x05READY" + b"".join(bytes([len(k)]) + k + len(v).to_bytes(4, "big") + v
                                  for k, v in props if k.lower() != SOURCE_PROPERTY.lower())
    out += bytes([len(SOURCE_PROPERTY)]) + SOURCE_PROPERTY + len(value).to_bytes(4, "big") + value
    head = bytes([COMMAND, len(out)]) if len(out) <= 255 else bytes([COMMAND | LONG]) + len(out).to_bytes(8, "big")
    return head + out


def _open_pipe() -> tuple[int, int] | None:
    """The pipe the front splices through (non-blocking, ``CHUNK`` bytes where the system lets
    a pipe grow that far); None without splice."""
    if not hasattr(os, "splice"):
        return None
    try:
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        log.warning("no pipe to splice through (%s): relaying through the front's buffer", e)
        return None
    try:
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, CHUNK)
    except (OSError, AttributeError):
        pass  # a smaller pipe moves less per call
    return r, w


def _keepalive(s: socket.socket) -> None:
    """TCP keepalive: a peer that vanished without a FIN or RST is detected in about 25 s."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        opt = getattr(socket, name, None)
        if opt is not None:
            s.setsockopt(socket.IPPROTO_TCP, opt, value)


def listen(endpoint: str) -> socket.socket:
    """Bind and listen on a ``tcp://HOST:PORT`` (port 0: any; ``*``: every interface; IPv6 in
    brackets) or ``ipc://PATH`` endpoint, as libzmq would. Raises OSError."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if path == "*":  # any path, as libzmq picks one
            import tempfile

            path = os.path.join(tempfile.mkdtemp(prefix="latecomer-"), "socket")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if os.path.exists(path) and not os.path.isdir(path):
                os.unlink(path)  # libzmq does the same with a stale socket file
            s.bind(path)
            s.listen(socket.SOMAXCONN)
        except OSError:
            s.close()
            raise
        return s
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    host = host.strip("[]")
    port_n = 0 if port in ("0", "*") else int(port)
    if host == "*":
        family, addr = socket.AF_INET6, ("::", port_n)
    else:  # a host name binds its IPv4 address, as libzmq does without ZMQ_IPV6
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        info = socket.getaddrinfo(host, port_n, family, socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        addr = info[0][4]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if host == "*":
            try:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 and IPv6
            except OSError:
                s.close()
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                addr = ("0.0.0.0", port_n)
        s.bind(addr)
        s.listen(socket.SOMAXCONN)
    except OSError:
        s.close()
        raise
    return s


def endpoint_of(s: socket.socket, requested: str) -> str:
    """The endpoint a bound socket listens on, written as libzmq's LAST_ENDPOINT would."""
    if s.family == socket.AF_UNIX:
        return f"ipc://{s.getsockname()}"
    host, port = s.getsockname()[:2]
    if s.family == socket.AF_INET6:
        if host == "::" and requested.startswith("tcp://*"):
            return f"tcp://0.0.0.0:{port}"
        if host.startswith("::ffff:"):
            return f"tcp://{host[7:]}:{port}"
        return f"tcp://[{host}]:{port}"
    return f"tcp://{host}:{port}"
