"""ZMTP 3.1 under the NULL mechanism, sans I/O: bytes in, whole messages out; frames out as buffers.

The framing of rfc.zeromq.org/spec/23 (a 64-byte greeting, then frames: a flags byte, a 1- or
8-byte size, the body; commands are frames flagged COMMAND) and the NULL mechanism's handshake
(spec/37: each side sends READY with its properties, ``Socket-Type`` and an optional
``Identity``). Like h11, :class:`Connection` never touches a socket: the caller reads into
:meth:`Connection.buffer`, says how much came with :meth:`Connection.advance`, and takes what it
yields; it sends what :func:`greeting`, :func:`ready`, :func:`pong` and :func:`frames_out` return.
A server may send its greeting and READY at once; a client sends READY only once the server's
greeting has come (:attr:`Connection.greeted`), as libzmq's clients do: a libzmq ROUTER resets
some connections whose READY came before it had sent its own greeting (tests/unit/test_zmtp.py).

This is the codec a server needs to read and write its peers' sockets itself, without libzmq and
its I/O thread (benchmarks/PROFILE.md, "Five server paths": 0.86-1.87x of raw pyzmq's ROUTER on the
same workload). The bounds are the front's (ps/net/front.py, :class:`~ps.net.front.Limits`),
checked when a frame's header arrives, before its body is held: a frame above
``max_frame_bytes``, an unfinished message above ``max_message_bytes`` or ``max_frames``, a
command above ``max_command_bytes``, reserved flag bits, a command flagged MORE, a greeting that
is not ZMTP 3 NULL, or a first frame that is not READY raise :class:`ZmtpError` (one line); the
caller then closes the connection. A connection holds its read buffer (``MIN_READ`` plus the
largest command) and its unfinished message (at most ``max_message_bytes``), nothing more.

Frames below ``COPY_BELOW`` bytes come out as ``bytes``; a larger one is read into a buffer of its
own (``alloc``), which :meth:`Connection.buffer` offers for the rest of its body, so a gradient is
copied once, by the kernel, and whoever takes the message owns it (but for the part the read that
brought its header took into the read buffer: at most ``idle_read`` bytes where the reader bounds
that read, as the daemon's handed connections and the worker's data connection do).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MORE, LONG, COMMAND = 0x01, 0x02, 0x04
RESERVED = 0xF8
SIGNATURE = bytes.fromhex("ff00000000000000017f")
GREETING_BYTES = 64
COPY_BELOW = 4096  # frames below this are copied out (bytes); larger ones are views of the buffer
MIN_READ = 64 * 1024  # the room the read buffer has beyond the largest command
# What a reader that passes it offers a read with nothing unparsed in the buffer (Connection's
# ``idle_read``): enough for a whole small message (a job or reply at d = 10^3, a few pipelined
# ones), little of a large frame's body, which then goes straight into its own buffer rather than
# through the read buffer and a copy (a 400 KB frame: 27 instead of 33 µs to read from loopback).
IDLE_READ = 16 * 1024
_Q = struct.Struct(">Q")
_FLAGS_Q = struct.Struct(">BQ")  # a long frame's header: its flags, then its size
# The short headers, by [more][size]: the last frame's (flags 0), then the others' (MORE)
_SHORT = (tuple(bytes((0, n)) for n in range(256)), tuple(bytes((MORE, n)) for n in range(256)))
_I = struct.Struct(">I")


class ZmtpError(Exception):
    """The peer broke the protocol or a bound; the text says how (one line)."""


@dataclass(frozen=True)
class ZmtpLimits:
    """What one peer may send (see the module docstring).

    Args:
        max_frame_bytes: the largest frame.
        max_message_bytes: the most an unfinished message's frames may declare together.
        max_frames: the most frames in one message.
        max_command_bytes: the largest command (READY with its properties, PING).
    """

    max_frame_bytes: int
    max_message_bytes: int
    max_frames: int = 16
    max_command_bytes: int = 64 * 1024


def check_header(flags: int, size: int, max_command_bytes: int) -> bool:
    """The rules every frame header obeys, whatever the bounds on messages: no reserved flag bits,
    a command neither flagged MORE nor above ``max_command_bytes``. True: the frame is a command.
    Raises ZmtpError (one line). The codec's check and the front's (ps/net/front.py) are this one."""
    if flags & RESERVED:
        raise ZmtpError(f"frame flags {flags:#04x} have reserved bits set")
    if flags & COMMAND:
        if flags & MORE:
            raise ZmtpError("a command frame with MORE set")
        if size > max_command_bytes:
            raise ZmtpError(f"a {size}-byte command frame (at most {max_command_bytes})")
        return True
    return False


def greeting(as_server: bool = False) -> bytes:
    """This side's greeting: ZMTP 3.1, NULL."""
    return SIGNATURE + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + bytes([as_server]) + bytes(31)


def frame_header(size: int, flags: int = 0) -> bytes:
    """A frame's flags and size (the short form below 256 bytes)."""
    return bytes((flags, size)) if size < 256 else _FLAGS_Q.pack(flags | LONG, size)


def command(name: bytes, body: bytes = b"") -> bytes:
    """A whole command frame: header, the name's length and the name, then ``body``."""
    data = bytes((len(name),)) + name + body
    return frame_header(len(data), COMMAND) + data


def ready(socket_type: bytes, **properties: bytes) -> bytes:
    """NULL's READY with ``Socket-Type`` and further properties (``Identity=b"..."``)."""
    body = b""
    for k, v in (("Socket-Type", socket_type), *properties.items()):
        kb = k.encode("ascii")
        body += bytes((len(kb),)) + kb + _I.pack(len(v)) + v
    return command(b"READY", body)


def pong(context: bytes) -> bytes:
    """The answer to a PING whose context was ``context`` (spec/37: at most 16 bytes echoed)."""
    return command(b"PONG", context[:16])


class LazyBody:
    """A frame body whose bytes are made as they are written (protocol/seal.py's ``Streamed``: a
    large frame sealed a chunk at a time, so that the peer reads and opens one chunk while the
    next is sealed). ``len()`` is its size from the start (the frame's header says it); the
    first :attr:`ready` bytes are final; :meth:`more` makes the next ones, :meth:`finish` all of
    them and returns the whole body. :func:`frames_out` passes it on as it is, and
    :func:`send_streamed` writes it."""

    __slots__ = ()
    ready = 0

    def __len__(self) -> int:
        raise NotImplementedError

    def more(self) -> None:
        raise NotImplementedError

    def finish(self) -> memoryview:
        raise NotImplementedError

    def view(self, lo: int, hi: int) -> memoryview:
        raise NotImplementedError


def finish_all(bufs: list) -> list:
    """``bufs`` with each :class:`LazyBody` made whole and replaced by its bytes (in place)."""
    for k, b in enumerate(bufs):
        if isinstance(b, LazyBody):
            bufs[k] = b.finish()
    return bufs


def send_streamed(sendmsg, bufs: list, iov_max: int = 512) -> int:
    """Write ``bufs`` (:func:`frames_out`'s, some of them :class:`LazyBody`) with a non-blocking
    ``sendmsg``, each lazy body's next bytes made just after its last ones went, so that the peer
    takes them meanwhile. Returns the bytes written: all of them, or fewer where the socket took
    no more (EAGAIN, a short write); the caller queues the rest as for any message. On return
    (or raise: an error other than EAGAIN) every lazy body in ``bufs`` is whole and replaced by
    its bytes, so the rest is plain buffers."""
    sent, idx, off, count = 0, 0, 0, len(bufs)
    try:
        while idx < count:
            iov, j, o, lazy, want = [], idx, off, None, 0
            while j < count and len(iov) < iov_max:
                b = bufs[j]
                if isinstance(b, LazyBody):
                    size, ready = len(b), b.ready
                    if ready < size:
                        lazy = b
                        if ready > o:
                            iov.append(b.view(o, ready))
                            want += ready - o
                        break
                    iov.append(b.view(o, size))
                    want += size - o
                else:
                    iov.append(memoryview(b)[o:] if o else b)
                    want += len(b) - o
                j, o = j + 1, 0
            if not iov:  # the next bytes are a lazy body's, not made yet
                lazy.more()
                continue
            try:
                n = sendmsg(iov)
            except (BlockingIOError, InterruptedError):
                return sent
            sent += n
            left = n
            while left:
                size = len(bufs[idx]) - off
                if left >= size:
                    left -= size
                    idx, off = idx + 1, 0
                else:
                    off += left
                    left = 0
            if n < want:  # the socket took no more for now
                return sent
            if lazy is not None:
                lazy.more()
        return sent
    finally:
        finish_all(bufs)


def frames_out(frames: list) -> list:
    """One message as buffers for ``sendmsg``: each frame's header, then the frame itself (not
    copied: bytes, memoryviews, numpy arrays, a :class:`LazyBody`). The headers are
    :func:`frame_header`'s, the short ones made once (:data:`_SHORT`), as every message sent pays this."""
    out: list = []
    append, last = out.append, len(frames) - 1
    for i, f in enumerate(frames):
        m = f if isinstance(f, (bytes, bytearray, LazyBody)) else memoryview(f).cast("B")
        n, more = len(m), i < last
        append(_SHORT[more][n] if n < 256 else _FLAGS_Q.pack((MORE | LONG) if more else LONG, n))
        append(m)
    return out


def parse_properties(data: bytes) -> dict[str, bytes]:
    """A READY command's properties (names as ASCII text, first occurrence wins). Raises ZmtpError."""
    props: dict[str, bytes] = {}
    i, n = 0, len(data)
    while i < n:
        k = data[i]
        if k == 0 or i + 1 + k + 4 > n:
            raise ZmtpError("a READY property runs past the command")
        name = bytes(data[i + 1:i + 1 + k])
        i += 1 + k
        (v,) = _I.unpack_from(data, i)
        i += 4
        if i + v > n:
            raise ZmtpError("a READY property's value runs past the command")
        try:
            props.setdefault(name.decode("ascii"), bytes(data[i:i + v]))
        except UnicodeDecodeError:
            raise ZmtpError("a READY property's name is not ASCII") from None
        i += v
    return props


class Connection:
    """One peer's inbound byte stream (see the module docstring).

    ``peer``: the properties of its READY once it came (None before). ``pings``: contexts of
    PINGs received and not yet answered (the caller sends :func:`pong` for each and clears it).
    ``unfinished``: bytes the current message has declared so far (for a bound over all
    connections). ``alloc(n)``: a writable buffer of ``n`` bytes for a large frame (default
    ``bytearray``), which then belongs to whoever takes the message; ``small(view)``: a frame below
    ``COPY_BELOW`` made from a view of the read buffer (default ``bytes``: a copy). ``idle_read``
    (e.g. ``IDLE_READ``; 0: no bound): the most :meth:`buffer` offers while nothing unparsed is
    held, so that the first read of a large frame takes its header and little of its body.
    ``progress`` (None, or set by the owner): called as ``progress(parts, big, filled, first)``
    after each read into a large frame's own buffer (``parts``: the message's frames before it;
    ``filled``: its bytes so far; ``first``: the read that began it), the last time with the
    frame whole, before the message is, so that its owner can work on each part as it comes (the
    sealed layer opens it, protocol/seal.py ``Opener.early``). A frame read whole at once does not
    call it, nor does a frame below ``progress_min`` bytes. It must not raise."""

    __slots__ = ("limits", "alloc", "small", "cap", "buf", "have", "used", "greeted", "peer", "pings", "parts",
                 "parts_bytes", "unfinished", "big", "big_at", "big_flags", "seen", "idle_read", "progress",
                 "progress_min")

    def __init__(self, limits: ZmtpLimits, alloc=bytearray, small=bytes, first_read: int = 0,
                 idle_read: int = 0) -> None:
        self.limits, self.alloc, self.small, self.idle_read = limits, alloc, small, idle_read
        self.cap = MIN_READ + limits.max_command_bytes + 16  # the read buffer's most: headers, small frames, commands
        self.buf = bytearray(max(COPY_BELOW + 16, min(first_read or self.cap, self.cap)))  # grows as reads fill it
        self.have = 0  # bytes in buf
        self.used = 0  # of which parsed
        self.greeted = False
        self.peer: dict[str, bytes] | None = None
        self.pings: list[bytes] = []
        self.parts: list = []  # the unfinished message's frames
        self.parts_bytes = 0  # their size
        self.unfinished = 0
        self.big = None  # a large frame's own buffer while its body arrives
        self.big_at = 0  # its bytes filled
        self.big_flags = 0
        self.seen = 0  # frames read whole so far, commands included (a bound on a peer's frame rate)
        self.progress = None
        self.progress_min = 0  # the least frame size progress is called for

    def buffer(self) -> memoryview:
        """Where the next read goes: the rest of a large frame's own buffer, or the read buffer."""
        if self.big is not None:
            return memoryview(self.big).cast("B")[self.big_at:]
        if self.used:
            rest = self.have - self.used
            self.buf[:rest] = self.buf[self.used:self.have]
            self.have, self.used = rest, 0
        size = len(self.buf)
        if size - self.have < COPY_BELOW and size < self.cap:  # reads fill it: room for more (a command)
            self.buf.extend(bytes(min(self.cap, 2 * size) - size))
        if self.have or not self.idle_read:
            return memoryview(self.buf)[self.have:]
        return memoryview(self.buf)[:self.idle_read]

    def advance(self, n: int) -> list[list]:
        """``n`` bytes were read into :meth:`buffer`: the messages now whole, each a list of frames
        (``bytes`` below COPY_BELOW, else the buffer ``alloc`` made). Raises ZmtpError."""
        if self.big is None:
            self.have += n
            return self._parse()
        self.big_at += n
        msgs: list[list] = []
        size = memoryview(self.big).nbytes
        if self.progress is not None and size >= self.progress_min:
            self.progress(self.parts, self.big, self.big_at, False)
        if self.big_at == size:
            self._whole(self.big, self.big_flags, msgs)
            self.big = None
        return msgs

    @property
    def mid(self) -> bool:
        """Whether a message (or a frame, or a command) has begun and is not whole yet."""
        return bool(self.parts) or self.big is not None or self.have > self.used

    def _whole(self, frame, flags: int, msgs: list) -> None:
        self.seen += 1
        self.parts.append(frame)
        if flags & MORE:
            self.parts_bytes += memoryview(frame).nbytes
        else:
            msgs.append(self.parts)
            self.parts, self.parts_bytes, self.unfinished = [], 0, 0

    def _parse(self) -> list[list]:
        msgs: list[list] = []
        buf, at, lim = self.buf, self.used, self.limits
        if not self.greeted:
            if self.have < GREETING_BYTES:
                self._check_greeting(bytes(buf[:self.have]))
                return msgs
            self._check_greeting(bytes(buf[:GREETING_BYTES]))
            at, self.greeted = GREETING_BYTES, True
        while self.have - at >= 2:
            flags = buf[at]
            if flags & LONG:
                if self.have - at < 9:
                    break
                size, hl = _Q.unpack_from(buf, at + 1)[0], 9
            else:
                size, hl = buf[at + 1], 2
            self._check_frame(flags, size, lim)
            if not flags & COMMAND and size >= COPY_BELOW:  # its own buffer; the rest is read into it
                if self.peer is None:
                    raise ZmtpError("a message before the peer's READY")
                body_at = at + hl
                k = min(size, self.have - body_at)
                big = self.alloc(size)
                memoryview(big).cast("B")[:k] = buf[body_at:body_at + k]
                at = body_at + k
                if k == size:
                    self._whole(big, flags, msgs)
                    continue
                self.big, self.big_at, self.big_flags = big, k, flags
                if self.progress is not None and size >= self.progress_min:
                    self.progress(self.parts, big, k, True)
                break
            if self.have - at < hl + size:
                break
            body_at = at + hl
            at = body_at + size
            if flags & COMMAND:
                self._command(bytes(buf[body_at:at]))
                continue
            if self.peer is None:
                raise ZmtpError("a message before the peer's READY")
            self._whole(self.small(memoryview(buf)[body_at:at]), flags, msgs)
        self.used = at
        return msgs

    def _check_greeting(self, g: bytes) -> None:
        if g[:1] and g[0] != 0xFF:
            raise ZmtpError("not a ZMTP 3 greeting (ZMTP 1.0 or not ZeroMQ)")
        if len(g) > 9 and not g[9] & 0x01:
            raise ZmtpError("not a ZMTP 3 greeting (ZMTP 1.0)")
        if len(g) > 10 and g[10] < 3:
            raise ZmtpError(f"ZMTP {g[10]}.x peers are not served (ZMTP 3 or later)")
        if len(g) >= 32 and g[12:32].rstrip(b"\x00") != b"NULL":
            shown = g[12:32].rstrip(b"\x00").decode("ascii", "replace")
            raise ZmtpError(f"security mechanism {shown!r}: this connection speaks NULL")

    def _check_frame(self, flags: int, size: int, lim: ZmtpLimits) -> None:
        """A frame's header, before its body is held (a small frame's header is looked at again
        after each read until its body is whole: the figures are recomputed, not added to)."""
        if flags & (RESERVED | COMMAND) and check_header(flags, size, lim.max_command_bytes):
            return  # check_header raises or says "a command" only for these flags
        if size > lim.max_frame_bytes:
            raise ZmtpError(f"a {size}-byte frame (at most {lim.max_frame_bytes})")
        if len(self.parts) + 1 > lim.max_frames:
            raise ZmtpError(f"a message of more than {lim.max_frames} frames")
        unfinished = self.parts_bytes + size  # its whole frames and this one
        if unfinished > lim.max_message_bytes:
            raise ZmtpError(f"a message of more than {lim.max_message_bytes} bytes")
        self.unfinished = unfinished

    def _command(self, data: bytes) -> None:
        self.seen += 1
        if not data or 1 + data[0] > len(data):
            raise ZmtpError("a command without a name")
        name, body = data[1:1 + data[0]], data[1 + data[0]:]
        if self.peer is None:
            if name != b"READY":
                raise ZmtpError(f"the first command is {name[:20]!r}, not READY")
            self.peer = parse_properties(body)
        elif name == b"PING":  # TTL (2 bytes), then a context of at most 16 bytes
            if len(body) < 2:
                raise ZmtpError("a PING without its TTL")
            if len(self.pings) < 16:  # a peer that never reads our PONGs holds at most 16
                self.pings.append(bytes(body[2:18]))
        elif name == b"ERROR":
            raise ZmtpError(f"the peer sent ERROR: {bytes(body[1:1 + body[:1][0]] if body else b'')[:80]!r}")
        # READY again, PONG, SUBSCRIBE and unknown commands: nothing to do (spec/23 ignores them)


__all__ = ["Connection", "LazyBody", "ZmtpError", "ZmtpLimits", "check_header", "command", "finish_all", "frame_header",
           "frames_out", "greeting", "parse_properties", "pong", "ready", "send_streamed"]
