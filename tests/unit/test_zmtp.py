"""protocol/zmtp.py: the sans-I/O ZMTP 3.1 NULL codec.

Messages come out the same however the bytes are cut; every bound is checked at a frame's header,
before its body is held (an ``alloc`` that records what it was asked for shows nothing was); the
writer's bytes are what libzmq reads (a real ROUTER takes our greeting, READY with an Identity, and
frames), and what libzmq writes is what the reader reads (a real DEALER's messages and PINGs)."""

from __future__ import annotations

import random
import socket
import struct
import time

import numpy as np
import pytest
import zmq

from protocol.zmtp import (
    COMMAND,
    COPY_BELOW,
    IDLE_READ,
    LONG,
    MORE,
    Connection,
    ZmtpError,
    ZmtpLimits,
    command,
    frame_header,
    frames_out,
    greeting,
    parse_properties,
    pong,
    ready,
)

LIM = ZmtpLimits(max_frame_bytes=1 << 20, max_message_bytes=(1 << 20) + 4096, max_frames=4)
BIG = bytes(range(256)) * 400  # 102,400 bytes: a large frame (its own buffer)


def _wire(*msgs: list[bytes], pings: tuple[bytes, ...] = ()) -> bytes:
    out = greeting() + ready(b"DEALER", Identity=b"w1")
    for ctx in pings:
        out += command(b"PING", struct.pack(">H", 10) + ctx)
    for m in msgs:
        out += b"".join(bytes(b) for b in frames_out(m))
    return out


def _feed(c: Connection, data: bytes, cuts: list[int]) -> list[list[bytes]]:
    """``data`` into ``c`` in pieces ending at ``cuts``, each piece no larger than the room offered."""
    out, i = [], 0
    for end in [*cuts, len(data)]:
        while i < end:
            room = c.buffer()
            k = min(len(room), end - i)
            room[:k] = data[i:i + k]
            i += k
            out += [[bytes(f) for f in m] for m in c.advance(k)]
    return out


def test_writer_headers_short_long_and_commands():
    assert frame_header(255, MORE) == bytes([MORE, 255])
    assert frame_header(256) == bytes([LONG]) + struct.pack(">Q", 256)
    assert command(b"PING") == bytes([COMMAND, 5]) + b"\x04PING"
    assert pong(b"x" * 20) == command(b"PONG", b"x" * 16)
    g = greeting(as_server=True)
    assert len(g) == 64 and g[:10] == bytes.fromhex("ff00000000000000017f") and g[10:12] == b"\x03\x01"
    assert g[12:32].rstrip(b"\0") == b"NULL" and g[32] == 1
    r = ready(b"ROUTER", Identity=b"abc")
    assert parse_properties(r[2 + 6:]) == {"Socket-Type": b"ROUTER", "Identity": b"abc"}


@pytest.mark.parametrize("idle_read", [0, IDLE_READ, 100])
@pytest.mark.parametrize("seed", range(6))
def test_messages_are_the_same_however_the_bytes_are_cut(seed, idle_read):
    msgs = [[b"head", BIG], [b""], [b"a", b"b", b"c"], [BIG[:COPY_BELOW]], [b"x" * (COPY_BELOW - 1)]]
    data = _wire(*msgs, pings=(b"ctx1",))
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(data)), 40)) if seed else list(range(1, len(data)))[:3000]
    c = Connection(LIM, idle_read=idle_read)
    assert _feed(c, data, cuts) == msgs
    assert c.peer == {"Socket-Type": b"DEALER", "Identity": b"w1"}
    assert c.pings == [b"ctx1"] and c.parts == [] and c.unfinished == 0 and c.big is None


def test_small_frames_are_bytes_and_large_ones_their_own_buffers():
    got = []
    c = Connection(LIM, alloc=lambda n: got.append(n) or np.empty(n, np.uint8))
    room = c.buffer()
    data = _wire([b"h", BIG, b"y" * (COPY_BELOW - 1)])
    room[:len(data)] = data
    (m,) = c.advance(len(data))
    assert type(m[0]) is bytes and type(m[2]) is bytes
    assert isinstance(m[1], np.ndarray) and m[1].tobytes() == BIG and got == [len(BIG)]
    nxt = c.buffer()  # the next read does not touch what was handed out
    nxt[:8] = b"\xff" * 8
    assert m[1].tobytes() == BIG


def test_idle_read_takes_a_large_frames_header_and_leaves_its_body_to_its_own_buffer():
    """With ``idle_read`` a read with nothing unparsed held is offered at most that much, so a
    large frame's body past it is read straight into the frame's own buffer (no copy through the
    read buffer); with part of a frame held, the whole read buffer is offered."""
    body = bytes(range(256)) * 1024  # 262,144 bytes
    frames = [b"h" * 150, body]
    wire = b"".join(bytes(b) for b in frames_out(frames))
    c = Connection(LIM, idle_read=IDLE_READ)
    hello = greeting() + ready(b"DEALER")
    c.buffer()[:len(hello)] = hello
    assert c.advance(len(hello)) == [] and c.peer is not None
    room = c.buffer()
    assert room.nbytes == IDLE_READ  # nothing held: the bound
    room[:] = wire[:IDLE_READ]
    assert c.advance(IDLE_READ) == []
    rest = c.buffer()  # the frame's own buffer, from where the read left it
    assert c.big is not None and c.big_at == IDLE_READ - (len(wire) - len(body)) and rest.nbytes == len(body) - c.big_at
    rest[:] = wire[IDLE_READ:]
    (m,) = c.advance(rest.nbytes)
    assert m[0] == frames[0] and bytes(m[1]) == body
    partial = b"".join(bytes(b) for b in frames_out([b"x" * 100]))[:50]  # half a small frame held
    c.buffer()[:50] = partial
    assert c.advance(50) == [] and c.buffer().nbytes > IDLE_READ
    unbounded = Connection(LIM)
    assert unbounded.buffer().nbytes > IDLE_READ


@pytest.mark.parametrize("wire,why", [
    (b"GET / HTTP/1.1\r\n", "not a ZMTP 3 greeting"),
    (bytes.fromhex("ff00000000000000017f") + b"\x02\x00", "ZMTP 2.x peers are not served"),
    (bytes.fromhex("ff00000000000000017f") + b"\x03\x00" + b"CURVE".ljust(20, b"\0"), "'CURVE'"),
    (greeting() + frame_header(1) + b"x", "before the peer's READY"),
    (greeting() + command(b"PING", b"\0\1"), "the first command is b'PING', not READY"),
    (greeting() + command(b"READY", b"\x05Ident"), "runs past the command"),
    (greeting() + ready(b"DEALER") + bytes([0x08, 1, 0]), "reserved bits"),
    (greeting() + ready(b"DEALER") + bytes([COMMAND | MORE, 1, 0]), "command frame with MORE"),
    (greeting() + ready(b"DEALER") + command(b"ERROR", b"\x04nope"), "the peer sent ERROR: b'nope'"),
    (greeting() + ready(b"DEALER") + command(b"PING"), "PING without its TTL"),
])
def test_protocol_errors_are_one_line(wire, why):
    c = Connection(LIM)
    with pytest.raises(ZmtpError, match=None) as e:
        c.buffer()[:len(wire)] = wire
        c.advance(len(wire))
    assert why in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("frames_hdr,why", [
    ([(0, (1 << 20) + 1)], "a 1048577-byte frame (at most 1048576)"),
    ([(MORE, 1 << 20), (MORE, 4096), (0, 1)], "a message of more than 1052672 bytes"),
    ([(MORE, 1)] * 4 + [(0, 1)], "a message of more than 4 frames"),
    ([(COMMAND, 64 * 1024 + 1)], "a 65537-byte command frame"),
])
def test_bounds_are_checked_at_the_header_before_the_body_is_held(frames_hdr, why):
    """Headers only (bodies of whole frames as zeros): the bound breaks when the offending header
    arrives; nothing of its size was allocated."""
    asked = []
    c = Connection(LIM, alloc=lambda n: asked.append(n) or bytearray(n))
    data = greeting() + ready(b"DEALER")
    for i, (flags, size) in enumerate(frames_hdr):
        last = i == len(frames_hdr) - 1
        data += frame_header(size, flags) + (b"" if last else bytes(size))
    with pytest.raises(ZmtpError, match="at most|more than|command frame") as e:
        _feed(c, data, [])
    assert why in str(e.value)
    assert all(n <= 1 << 20 for n in asked) and sum(asked) <= LIM.max_message_bytes
    assert len(c.buf) <= 2 * 64 * 1024 + 16  # the read buffer never grew


def test_pings_held_are_bounded():
    c = Connection(LIM)
    data = greeting() + ready(b"DEALER") + command(b"PING", b"\0\1ctx") * 100
    _feed(c, data, [])
    assert c.pings == [b"ctx"] * 16


def test_a_libzmq_dealer_s_messages_and_pings_read_back():
    """A real DEALER (with ZMTP heartbeats on) connects to a plain socket: its greeting, READY,
    messages and PINGs go through the reader; our greeting and READY satisfy it (it sends)."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.linger = 0
    d.routing_id = b"worker-7"
    d.heartbeat_ivl = 50
    try:
        d.connect("tcp://127.0.0.1:%d" % ls.getsockname()[1])
        ls.settimeout(10)
        s, _ = ls.accept()
        s.settimeout(10)
        s.sendall(greeting(as_server=True) + ready(b"ROUTER"))
        arr = np.arange(50_000, dtype=np.float32)
        d.send_multipart([b"hdr", arr])
        c, got, deadline = Connection(LIM), [], time.monotonic() + 10
        while (not got or not c.pings) and time.monotonic() < deadline:
            n = s.recv_into(c.buffer())
            assert n, "the DEALER hung up"
            got += c.advance(n)
        assert c.peer["Socket-Type"] == b"DEALER" and c.peer["Identity"] == b"worker-7"
        (m,) = got
        assert m[0] == b"hdr" and bytes(m[1]) == arr.tobytes()
        assert c.pings  # libzmq's heartbeat PING reached us as a command, not a message
        s.close()
    finally:
        d.close()
        ctx.term()
        ls.close()


def test_what_the_writer_sends_a_libzmq_router_reads():
    """Our side as the client: greeting, READY with an Identity, then frames_out of a two-frame
    message (a numpy array among them, not copied); a real ROUTER sees the identity and the frames,
    and what it sends back reads back here."""
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.linger = 0
    r.rcvtimeo = 10_000
    port = r.bind_to_random_port("tcp://127.0.0.1")
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        arr = np.arange(3000, dtype=np.float32)
        # In libzmq's own order: the greeting, the server's greeting read whole, then READY. A
        # client that sent its READY before the server's greeting came was dropped by a libzmq
        # ROUTER (connection reset) in 5 of 40 and 6 of 30 tries here; waiting, in 0 of 40.
        s.sendall(greeting())
        c, got, deadline = Connection(LIM), [], time.monotonic() + 10
        while not c.greeted and time.monotonic() < deadline:
            n = s.recv_into(c.buffer(), 64 - c.have)
            assert n, "the ROUTER hung up"
            assert c.advance(n) == []
        s.sendall(ready(b"DEALER", Identity=b"me"))
        s.sendmsg(frames_out([b"head", arr]))
        rid, head, body = r.recv_multipart()
        assert rid == b"me" and head == b"head" and body == arr.tobytes()
        r.send_multipart([b"me", b"back", b"y" * 300])
        while not got and time.monotonic() < deadline:
            n = s.recv_into(c.buffer())
            assert n
            got += c.advance(n)
        assert c.peer["Socket-Type"] == b"ROUTER"
        assert [bytes(f) for f in got[0]] == [b"back", b"y" * 300]
    finally:
        s.close()
        r.close()
        ctx.term()


def test_frames_out_headers_are_frame_header_s():
    """frames_out's headers (the short ones made once, a long one packed with its flags) are
    frame_header's, MORE on all but the last frame, whatever the sizes and buffer types."""
    for sizes in ([], [0], [255], [256], [0, 255, 256, 70_000], [1, 2, 3]):
        frames = [bytes(n) if i % 3 == 0 else bytearray(n) if i % 3 == 1 else np.zeros(n, np.uint8)
                  for i, n in enumerate(sizes)]
        out = frames_out(frames)
        assert len(out) == 2 * len(frames)
        for i, n in enumerate(sizes):
            assert out[2 * i] == frame_header(n, MORE if i < len(sizes) - 1 else 0)
            assert bytes(out[2 * i + 1]) == bytes(n)
    for n in (0, 255, 256, 1 << 40):
        assert frame_header(n, COMMAND) == (bytes([COMMAND, n]) if n < 256 else
                                            bytes([COMMAND | LONG]) + struct.pack(">Q", n))


def test_the_message_bound_counts_each_message_s_own_frames():
    """The size a message has declared (``unfinished``) is its own frames' and the header's now:
    each whole message starts the count again, so messages that together pass
    ``max_message_bytes`` but each stay within it are read."""
    lim = ZmtpLimits(max_frame_bytes=1 << 20, max_message_bytes=6000, max_frames=4)
    c = Connection(lim)
    msgs = [[b"a" * 2000, b"b" * 3000], [b"c" * 3000, b"d" * 2900], [b"e" * 5999]]
    assert _feed(c, _wire(*msgs), []) == msgs
    head = _wire([b"a" * 2000, b"b" * 3000])
    c = Connection(lim)
    _feed(c, head[:len(head) - 3000 + 5], [])  # the first frame whole, the second's header and 5 bytes read
    assert c.parts_bytes == 2000 and c.unfinished == 5000
    with pytest.raises(ZmtpError, match="more than 6000 bytes"):
        _feed(Connection(lim), _wire([b"a" * 2000, b"b" * 3000, b"c" * 1001]), [])
