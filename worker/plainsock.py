"""A DEALER that speaks ZMTP itself on a plain socket: the worker's end of the sealed data connection.

libzmq moves every message through its I/O thread: a send wakes that thread, which writes the
socket; an arrival wakes it, which reads the socket and then wakes the caller. On the project's
2-core machine those hand-offs were most of a worker's time per small message (70 % of its busy
samples in ``zmq_send``, benchmarks/PROFILE.md), and a large one is read into a fresh buffer of
libzmq's own before the worker opens it into another. The sealed data connection (PROTOCOL.md
§6.15) is a plain NULL connection, read and written by the daemon itself once the front hands it
over; this is its other end, with the same codec (protocol/zmtp.py): one thread, the caller's,
a send is one ``sendmsg`` of the frames where they lie, and a large frame is read straight into a
buffer of the worker's pool.

It is used where the connection's life is simple: it connects once and never reconnects (when it
drops, the worker says hello again and gets a new session with a new connection, worker/sealed.py),
and what it cannot take at once beyond ``max_queued`` messages is refused with :class:`Full`
(the worker then sends over CurveZMQ). :attr:`lost` says it dropped: refused, reset, closed by the
peer, a protocol error, or no handshake within ``handshake_s``.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import time
from collections import deque
from typing import Any, Callable

from protocol import zmtp
from protocol.spin import SpinWindow

log = logging.getLogger("latecomer.worker")
_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)
_CONNECTING = (errno.EINPROGRESS, errno.EAGAIN, errno.EALREADY)
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK)
LOWAT_MAX = 1 << 20  # the most a wait for a large frame's body asks the kernel to gather first


class Full(Exception):
    """The connection holds ``max_queued`` messages not yet written: send elsewhere."""


def parse_endpoint(endpoint: str) -> tuple[int, Any]:
    """(address family, address) of a ``tcp://host:port`` (``[v6]`` literal or name) or ``ipc://path``."""
    if endpoint.startswith("ipc://"):
        return socket.AF_UNIX, endpoint[len("ipc://"):]
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"{endpoint!r}: a plain data connection needs tcp:// or ipc://")
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    info = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    family, _, _, _, addr = info[0]
    return family, addr


class ZmtpDealer:
    """One NULL ZMTP connection to ``endpoint`` as a DEALER whose routing id is ``identity``.

    ``send(frames)`` queues a message (raises :class:`Full` past ``max_queued``) and writes what the
    socket takes; ``recv(timeout_ms)`` returns one whole message (its frames) or None; ``fileno()``
    and :attr:`wants_write` let a poll loop wait on it; :meth:`flush` writes what is queued.
    ``alloc(n)`` gives the buffer of a frame of ``n`` bytes or more (protocol/zmtp.py COPY_BELOW).
    Messages sent before the handshake wait for it, as libzmq's clients do: READY goes once the
    peer's greeting came, messages once the peer's READY came (a libzmq ROUTER closed every
    connection whose first message came with its READY, before its own greeting, here: the front
    relays a data connection's handshake to one under ``serve --hand-over off``)."""

    def __init__(self, endpoint: str, identity: bytes, *, alloc: Callable[[int], Any] = bytearray,
                 max_queued: int = 64, handshake_s: float = 5.0, max_frames: int = 0x10000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        family, addr = parse_endpoint(endpoint)
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setblocking(False)
        if family != socket.AF_UNIX:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for name, v in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):  # as dealer_options
                if hasattr(socket, name):
                    self.sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), v)
        self.identity = identity
        self.max_queued = max_queued
        self.clock = clock
        self.deadline = clock() + handshake_s  # the handshake (greetings, READYs) done by then, or lost
        limits = zmtp.ZmtpLimits(max_frame_bytes=1 << 40, max_message_bytes=1 << 40, max_frames=max_frames)
        self.conn = zmtp.Connection(limits, alloc=alloc, idle_read=zmtp.IDLE_READ)
        self.out: deque = deque()  # buffers not yet written, in order
        self.pushed = self.popped = 0  # buffers put in ``out`` and written whole, ever
        self.ends: deque = deque()  # for each message in ``out``: the ``pushed`` count at its last buffer
        self.held: list = []  # messages sent before the peer's READY came (their buffers)
        self.inbox: deque = deque()  # whole messages read and not yet taken
        self.connected = False
        self.ready_sent = False
        self.lost: str | None = None  # why it dropped (None: it has not)
        self.bytes_in = self.bytes_out = 0
        self.lowat = 1  # the socket's SO_RCVLOWAT (:meth:`_lowat`)
        self.lowat_ok = True
        self.poller = select.poll()
        self.poll_events = select.POLLIN
        self.poller.register(self.sock, self.poll_events)
        self._push([zmtp.greeting()])
        try:
            self.sock.connect(addr)
            self.connected = True
        except OSError as e:
            if e.errno not in _CONNECTING:
                self._lose(f"connect: {e.strerror or e}")

    # ------------------------------------------------------------------ state
    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def up(self) -> bool:
        """The handshake is done (the peer's READY came)."""
        return self.conn.peer is not None and self.lost is None

    @property
    def queued(self) -> int:
        """Messages sent and not yet written whole."""
        return len(self.ends) + len(self.held)

    @property
    def wants_write(self) -> bool:
        return bool(self.out) and self.lost is None

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            self.out.clear()
            self.ends.clear()
            self.held.clear()

    def check(self) -> None:
        """Time the handshake out (call it now and then)."""
        if self.lost is None and self.conn.peer is None and self.clock() > self.deadline:
            self._lose("no handshake in time")

    def close(self, linger_ms: int = 0) -> None:
        """Close it, writing what it holds for up to ``linger_ms`` first (a bye); what comes in
        meanwhile is left unread."""
        end = self.clock() + linger_ms / 1000.0
        while self.wants_write and self.clock() < end:
            self.flush()
            if self.wants_write:
                select.select([], [self.sock], [], max(0.0, end - self.clock()))
        self._lose("closed")
        self.sock.close()

    # ------------------------------------------------------------------ out
    def _push(self, bufs: list, message: bool = False) -> None:
        self.out.extend(bufs)
        self.pushed += len(bufs)
        if message:
            self.ends.append(self.pushed)

    def send(self, frames: list) -> None:
        """Queue one message (its frames: bytes or buffers, not copied) and write what the socket
        takes now. Raises :class:`Full` (nothing queued) when ``max_queued`` messages wait or the
        connection is lost."""
        if self.lost is not None:
            raise Full(self.lost)
        if self.queued >= self.max_queued:
            raise Full("queue full")
        bufs = zmtp.frames_out(frames)
        if self.conn.peer is None:
            self.held.append(bufs)
            return
        self._push(bufs, True)
        self.flush()

    def flush(self) -> None:
        """Write what is queued, as far as the socket takes it without waiting."""
        out = self.out
        while out and self.lost is None:
            if not self.connected:
                if not select.select([], [self.sock], [], 0)[1]:
                    return
                err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    self._lose(f"connect: {os.strerror(err)}")
                    return
                self.connected = True
            try:
                n = self.sock.sendmsg([out[i] for i in range(min(len(out), _IOV_MAX))])
            except OSError as e:
                if e.errno in _AGAIN:
                    return
                self._lose(f"send: {e.strerror or e}")
                return
            self.bytes_out += n
            while n:
                b = out[0]
                size = b.nbytes if isinstance(b, memoryview) else len(b)
                if n < size:  # the rest of this buffer next time
                    out[0] = (b if isinstance(b, memoryview) else memoryview(b))[n:]
                    break
                n -= size
                out.popleft()
                self.popped += 1
                while self.ends and self.ends[0] <= self.popped:
                    self.ends.popleft()

    def _release(self) -> None:
        """The peer's READY came: the messages held for it."""
        for bufs in self.held:
            self._push(bufs, True)
        self.held = []

    # ------------------------------------------------------------------ in
    def _read(self) -> None:
        """Read what the socket holds now (without waiting); then the low-water mark for what is
        left of a large frame (any poll of this socket, the worker's loop's too, waits for it)."""
        self._read_some()
        if self.conn.big is not None or self.lowat > 1:
            self._lowat()

    def _read_some(self) -> None:
        conn = self.conn
        while self.lost is None:
            buf = conn.buffer()
            try:
                n = self.sock.recv_into(buf)
            except OSError as e:
                if e.errno not in _AGAIN and e.errno != errno.ENOTCONN:  # ENOTCONN: still connecting
                    self._lose(f"receive: {e.strerror or e}")
                return
            if n == 0:
                self._lose("closed by the peer")
                return
            self.bytes_in += n
            try:
                msgs = conn.advance(n)
            except zmtp.ZmtpError as e:
                self._lose(f"protocol: {e}")
                return
            if not self.ready_sent and conn.greeted:  # READY once the peer's greeting came
                self.ready_sent = True
                self._push([zmtp.ready(b"DEALER", Identity=self.identity)])
                self.flush()
            if self.held and conn.peer is not None:
                self._release()
                self.flush()
            if conn.pings:
                for ctx in conn.pings:
                    self._push([zmtp.pong(ctx)])
                conn.pings.clear()
                self.flush()
            if msgs:
                self.inbox.extend(msgs)
            if n < buf.nbytes:  # the socket had no more for now
                return

    def pending(self) -> bool:
        """Whether a whole message is ready to take now (reads what the socket holds)."""
        if self.out:
            self.flush()
        if not self.inbox and self.lost is None:
            self._read()
        return bool(self.inbox)

    def _lowat(self) -> None:
        """While a large frame's body arrives, wake only once most of it is there: the socket's
        receive low-water mark is set to what is left of it (at most LOWAT_MAX; Linux caps it at
        half the receive buffer), and back to 1 byte between frames. A 400 KB frame otherwise
        woke the worker once per segment the kernel delivered, each wake-up a pass through this
        loop (libzmq pays those in its I/O thread)."""
        big = self.conn.big
        want = 1 if big is None else max(1, min(memoryview(big).nbytes - self.conn.big_at, LOWAT_MAX))
        if want != self.lowat and self.lowat_ok:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            except OSError:  # a kernel (or sandbox) without it: a wake-up per delivery, as before
                self.lowat_ok = False
                return
            self.lowat = want

    def recv(self, timeout_ms: int, spin: SpinWindow | None = None) -> list | None:
        """One whole message within ``timeout_ms`` (None: none came, or the connection was lost),
        writing what is queued while it waits. With ``spin`` (a bound set), each wait with nothing
        left to write first reads without blocking for up to its window (protocol/spin.py)."""
        if self.inbox:
            return self.inbox.popleft()
        end = None
        while self.lost is None:
            if self.out:
                self.flush()
            self._read()
            if self.inbox:
                return self.inbox.popleft()
            now = self.clock()
            if end is None:
                end = now + timeout_ms / 1000.0
            left = end - now
            if left <= 0 or self.lost is not None:
                break
            self.check()
            if spin is None or not spin.bound or self.out:
                ready = self._wait(left)
            else:
                spin.spin(self._read_now, left)
                if self.inbox:
                    return self.inbox.popleft()
                if self.lost is not None:
                    break
                if self.conn.big is not None or self.lowat > 1:
                    self._lowat()
                ready = spin.block(lambda left=left: self._wait(left))
            if ready and ready[0][1] & select.POLLOUT:
                self.flush()
        return None

    def _read_now(self) -> bool:
        """A busy poll's look: read what the socket holds; whether a whole message came (or the
        connection dropped)."""
        self._read_some()
        return bool(self.inbox) or self.lost is not None

    def _wait(self, left: float) -> list:
        """Poll the socket for up to ``left`` seconds: to read, and to write while anything is queued."""
        events = select.POLLIN | (select.POLLOUT if self.out else 0)
        if events != self.poll_events:
            self.poller.modify(self.sock, events)
            self.poll_events = events
        return self.poller.poll(max(1, int(left * 1000 + 0.999)))


__all__ = ["Full", "ZmtpDealer", "parse_endpoint"]
