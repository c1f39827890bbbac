"""The measuring instrument of benchmarks/transport_paths.py: its ZMTP framing and one real round trip
with a libzmq DEALER, so that the figures it writes come from a server that speaks the protocol."""

from __future__ import annotations

import socket
import struct
import threading

import msgpack
import numpy as np
import pytest
import zmq

from benchmarks.common import LR
from benchmarks.transport_paths import GREETING, LONG, MORE, _Conn, compact, command, frame_header, parse, serve_zmtp


def _feed(c: _Conn, data: bytes) -> list:
    """``data`` into the connection's buffer one byte at a time; every message parsed on the way."""
    out = []
    for b in data:
        if c.have == len(c.buf):
            c.buf.extend(bytes(len(c.buf)))
        c.buf[c.have] = b
        c.have += 1
        out += [[bytes(f) for f in m] for m in parse(c)]
        compact(c)
    return out


def test_frame_header_short_and_long():
    assert frame_header(255, MORE) == bytes([MORE, 255])
    assert frame_header(256) == bytes([LONG]) + struct.pack(">Q", 256)


def test_parse_reassembles_messages_split_at_every_byte_with_short_long_and_command_frames():
    big = bytes(range(256)) * 40  # 10,240 bytes: a long frame, and parsed as a view of the buffer
    wire = (GREETING + command(b"READY", {b"Socket-Type": b"DEALER"}) + frame_header(3, MORE) + b"abc"
            + frame_header(len(big)) + big + command(b"PING", {}) + frame_header(0))
    c = _Conn(socket.socket())
    try:
        c.buf = bytearray(16)  # smaller than the long frame: the buffer must grow
        assert _feed(c, wire) == [[b"abc", big], [b""]]
        assert c.have == 0 and c.frames == []
    finally:
        c.s.close()


def test_parse_refuses_what_is_not_a_zmtp3_greeting():
    c = _Conn(socket.socket())
    try:
        c.buf[:64] = b"GET / HTTP/1.1\r\n".ljust(64, b" ")
        c.have = 64
        with pytest.raises(ValueError, match="ZMTP 3"):
            parse(c)
    finally:
        c.s.close()


@pytest.mark.parametrize("d", [10, 100_000])
def test_a_libzmq_dealer_gets_the_updated_iterate_back(d):
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(4)
    stop = threading.Event()
    server = threading.Thread(target=serve_zmtp, args=(ls, d, stop), daemon=True)
    server.start()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.rcvtimeo = 10_000
    try:
        s.connect("tcp://127.0.0.1:%d" % ls.getsockname()[1])
        g = np.arange(d, dtype=np.float32)
        expect = np.zeros(d, np.float32)
        for v in (1, 2):
            s.send_multipart([msgpack.packb({"w": 0}), g])
            head, x = s.recv_multipart()
            expect = expect - np.float32(LR) * g
            assert msgpack.unpackb(head) == {"v": v, "dtype": "<f4", "shape": [d]}
            np.testing.assert_array_equal(np.frombuffer(x, "<f4"), expect)
    finally:
        s.close()
        ctx.term()
        stop.set()
        server.join(10)
        ls.close()
    assert not server.is_alive()
