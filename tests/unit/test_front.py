"""The front (ps/net/front.py): its ZMTP frame-header parser and the relay's bounds and closing rules,
against a plain Unix socket standing in for the daemon."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
import termios
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ps.net import front as front_module
from ps.net.front import CHUNK, SPLICE_MIN, Cut, Front, InboundParser, Limits, endpoint_of, listen
from tests.integration.zmtp_raw import COMMAND, LONG, MORE, command, frame_header, greeting, ready

LIMITS = Limits(mechanism=b"NULL", max_frame_bytes=70_000, max_message_bytes=100_000, max_frames=17,
                max_pending_bytes=150_000)


def forwarded(data: bytes, source: str = "127.0.0.1") -> bytes:
    """What the daemon gets for ``data`` (greeting, READY, ...) under NULL: the READY with the
    front's ``X-Source`` property (front.with_source), the rest byte for byte."""
    end = front_module._frame_end(bytearray(data), 64)
    return data[:64] + front_module.with_source(data[64:end], source) + data[end:]


def wire(messages: list[list[bytes]]) -> bytes:
    out = greeting() + ready()
    for m in messages:
        out += b"".join(frame_header(len(f), MORE if i < len(m) - 1 else 0) + f for i, f in enumerate(m))
    return out


sizes = st.lists(st.lists(st.sampled_from([0, 1, 254, 255, 256, 4000, 25_000]), min_size=1, max_size=4),
                 max_size=20)  # at most 100,000 bytes a message: legal under LIMITS


@given(sizes, st.lists(st.integers(1, 70_000), max_size=30))
def test_the_parser_follows_any_split_of_a_legal_stream(messages, cuts):
    data = wire([[bytes(n) for n in m] for m in messages])
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    p = InboundParser(LIMITS)
    for a, b in zip(points, points[1:], strict=False):
        p.feed(memoryview(data)[a:b])
    assert (p.skip, p.header_need, p.unfinished, p.frames) == (0, 0, 0, 0)


def test_a_message_in_progress_is_what_it_declared():
    p = InboundParser(LIMITS)
    p.feed(greeting() + ready() + frame_header(1000, MORE) + bytes(10))  # the header declares it all
    assert p.unfinished == 1000 and p.frames == 1
    p.feed(bytes(990) + frame_header(5) + b"12345")
    assert p.unfinished == 0 and p.frames == 0


@pytest.mark.parametrize("data,why", [
    (b"\x00" * 64, "not a ZMTP 3 greeting"),
    (b"\xff" + bytes(8) + b"\x7e", "not a ZMTP 3 greeting (ZMTP 1.0)"),
    (b"\xff" + bytes(8) + b"\x7f\x01\x00", "ZMTP 1.x peers are not served"),
    (greeting(b"PLAIN"), "security mechanism 'PLAIN': this server speaks NULL"),
    (greeting() + bytes([0x08, 1, 0]), "reserved bits"),
    (greeting() + bytes([COMMAND | MORE, 1, 0]), "a command frame with MORE set"),
    (greeting() + bytes([COMMAND | LONG]) + (70_000).to_bytes(8, "big"), "a 70000-byte command frame"),
    (greeting() + bytes([LONG]) + (70_001).to_bytes(8, "big"), "a 70001-byte frame (at most 70000)"),
    (greeting() + (frame_header(0, MORE)) * 17 + frame_header(0), "a message of more than 17 frames"),
    (greeting() + (frame_header(60_000, MORE) + bytes(60_000)) * 2, "a message of more than 100000 bytes"),
])
def test_the_parser_cuts_what_breaks_a_bound(data, why):
    p = InboundParser(LIMITS)
    with pytest.raises(Cut, match=why.replace("(", r"\(").replace(")", r"\)")):
        for i in range(0, len(data), 7):
            p.feed(data[i:i + 7])


def test_under_curve_frames_are_bounded_one_by_one():
    limits = Limits(b"CURVE", 70_000, 100_000, 17, 150_000)
    p = InboundParser(limits)
    p.feed(greeting(b"CURVE") + (frame_header(60_000) + bytes(60_000)) * 3)  # MORE is inside the box
    assert p.unfinished == 0
    with pytest.raises(Cut, match="a 70065-byte frame"):
        p.feed(frame_header(70_065))


# --------------------------------------------------------------------------- the relay

class Relay:
    """A Front between a TCP listener and a Unix socket we hold the other end of (the daemon)."""

    def __init__(self, tmp_path, splice: bool = True, limits: Limits = LIMITS) -> None:
        self.backend = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.path = str(tmp_path / "d.sock")
        self.backend.bind(self.path)
        self.backend.listen(16)
        self.backend.settimeout(5)
        self.listener = listen("tcp://127.0.0.1:0")
        self.endpoint = endpoint_of(self.listener, "tcp://127.0.0.1:0")
        self.front = Front(self.listener, limits, splice=splice)
        self.front.set_backend(self.path)
        self.stop = threading.Event()
        self.resume()

    def pause(self) -> None:
        """Stop the loop (between two events: nothing is half-relayed) to look at the front."""
        self.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()

    def resume(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.front.run_once(0.02)

    def client(self) -> tuple[socket.socket, socket.socket]:
        """A client connection and the daemon's end of it."""
        host, port = self.endpoint.removeprefix("tcp://").rsplit(":", 1)
        c = socket.create_connection((host, int(port)), timeout=5)
        d, _ = self.backend.accept()
        d.settimeout(5)
        return c, d

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.front.close()
        self.listener.close()
        self.backend.close()


@pytest.fixture(params=[True, False], ids=["splice", "buffer"])
def relay(tmp_path, request):
    r = Relay(tmp_path, splice=request.param)
    try:
        yield r
    finally:
        r.close()


def wait_until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)  # polling interval of a bounded wait


def recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(min(n - len(buf), 1 << 20))
        assert chunk, f"closed after {len(buf)} of {n} bytes"
        buf += chunk
    return bytes(buf)


def test_bytes_pass_both_ways_untouched(relay):
    c, d = relay.client()
    up = wire([[b"a" * 300, b"b" * 60_000], [b"c"]])
    c.sendall(up)
    seen = forwarded(up)
    assert recv_exactly(d, len(seen)) == seen and len(seen) > len(up)
    down = os.urandom(300_000)
    d.sendall(down)
    assert recv_exactly(c, len(down)) == down


def test_a_client_reset_reaches_the_daemon_as_an_orderly_end(relay):
    """What aborts libzmq is a reset or hang-up while its input is stopped: the daemon's end sees
    an EOF instead, and the front keeps reading it until the daemon closes."""
    c, d = relay.client()
    c.sendall(greeting() + ready() + command(b"PING", b"\x00\x00"))
    recv_exactly(d, 64)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    c.close()  # RST
    rest = b""
    while True:
        chunk = d.recv(65536)  # never ConnectionResetError
        if not chunk:
            break
        rest += chunk
    d.sendall(b"x" * 100_000)  # the daemon still writes (its answers): the front reads them away
    d.close()
    wait_until(lambda: not relay.front.pairs)


def test_a_cut_client_gets_a_reset_and_the_daemon_an_eof(relay):
    c, d = relay.client()
    c.sendall(greeting() + ready())
    recv_exactly(d, len(forwarded(greeting() + ready())))
    for _ in range(2):
        c.sendall(frame_header(60_000, MORE) + bytes(60_000))
    with pytest.raises(ConnectionResetError):
        while c.recv(65536):
            pass
    while d.recv(65536):  # EOF, no reset
        pass
    d.close()
    assert relay.front.cut == 1


def test_all_unfinished_messages_together_are_bounded(relay):
    (c1, d1), (c2, d2) = relay.client(), relay.client()
    for c, d in ((c1, d1), (c2, d2)):
        c.sendall(greeting() + ready() + frame_header(50_000, MORE) + bytes(10))
        recv_exactly(d, len(forwarded(greeting() + ready())) + 9 + 10)
    # 2 x 50,000 declared; a third connection's 60,000 passes 150,000
    c3, d3 = relay.client()
    c3.sendall(greeting() + ready() + frame_header(60_000, MORE))
    with pytest.raises(ConnectionResetError):
        while c3.recv(65536):
            pass
    assert relay.front.cut == 1
    c1.sendall(bytes(49_990) + frame_header(1) + b"z")  # finishing a message frees its share
    recv_exactly(d1, 49_990 + 3)
    assert relay.front.pending == 50_000
    for s in (c1, c2, d1, d2, d3):
        s.close()


# --------------------------------------------------------------------------- splice

def spliced_is_used(relay) -> bool:
    return relay.front.pipe is not None


def pipe_is_empty(front: Front) -> bool:
    if front.pipe is None:
        return True
    held = struct.unpack("i", fcntl.ioctl(front.pipe[0], termios.FIONREAD, b"\0\0\0\0"))[0]
    return held == 0


def send_in_thread(s: socket.socket, data: bytes) -> threading.Thread:
    t = threading.Thread(target=s.sendall, args=(data,), daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("splice", [True, False], ids=["splice", "buffer"])
def test_large_frames_pass_intact_both_ways(tmp_path, splice):
    """The body of a large frame is spliced (without splice: copied) once its header is parsed,
    and the headers after it are parsed again: the bytes arrive in order, unchanged."""
    big = Limits(b"NULL", 8_000_000, 8_100_000, 17, 16_000_000)
    relay = Relay(tmp_path, splice=splice, limits=big)
    try:
        c, d = relay.client()
        frame = os.urandom(4_000_000)
        up = wire([[b"h" * 100, frame], [b"x" * 5000], [b"h" * 100, frame[::-1]]])
        t = send_in_thread(c, up)
        assert recv_exactly(d, len(forwarded(up))) == forwarded(up)
        t.join(5)
        before = relay.front.spliced
        d.sendall(b"s" * 100)
        assert recv_exactly(c, 100) == b"s" * 100
        assert relay.front.spliced == before, "a small read from the daemon is copied, not spliced"
        down = os.urandom(3 * CHUNK + 12_345)
        t = send_in_thread(d, down)
        assert recv_exactly(c, len(down)) == down
        t.join(5)
        relay.pause()
        p = next(iter(relay.front.pairs.values()))
        assert (p.parser.skip, p.parser.header_need, p.parser.unfinished, p.parser.frames) == (0, 0, 0, 0)
        assert relay.front.pending == 0
        if splice:  # all of down but its first read (a small read is copied, a large one makes
            # the next spliced), and each big body but what the reads around its header took:
            # up to CHUNK for the first; after a spliced body the front reads SPLICE_MIN at a time
            assert relay.front.spliced >= (len(down) - CHUNK) + (len(frame) - CHUNK - SPLICE_MIN) + (
                len(frame) - 3 * SPLICE_MIN)
            assert pipe_is_empty(relay.front)
        else:
            assert relay.front.spliced == 0
    finally:
        relay.close()


def test_a_bound_is_cut_after_a_spliced_body(relay):
    """The header after a spliced body is parsed: the second 60,000-byte frame of one message
    passes max_message_bytes and the client is cut; what the daemon got is exactly what came before."""
    c, d = relay.client()
    head = greeting() + ready() + frame_header(60_000, MORE)
    c.sendall(head + bytes(100))
    recv_exactly(d, len(forwarded(head)) + 100)
    body = os.urandom(59_900)  # skip >= SPLICE_MIN: spliced
    c.sendall(body)
    assert recv_exactly(d, len(body)) == body
    assert relay.front.spliced == (len(body) if spliced_is_used(relay) else 0)
    c.sendall(frame_header(60_000, MORE) + bytes(SPLICE_MIN))
    with pytest.raises(ConnectionResetError):
        while c.recv(65536):
            pass
    assert d.recv(65536) == b""  # EOF: nothing of the frame that broke the bound
    d.close()
    assert relay.front.cut == 1
    wait_until(lambda: relay.front.pending == 0)


def test_a_side_that_does_not_read_leaves_at_most_chunk_in_the_front(relay):
    """A daemon (or client) that does not read: what its socket did not take is held in the
    connection's buffer, at most CHUNK bytes, and the shared pipe is empty; then all of it passes."""
    c, d = relay.client()
    up = wire([[os.urandom(70_000)] for _ in range(60)])  # 4.2 MB: more than the sockets hold
    t_up = send_in_thread(c, up)
    down = os.urandom(16_000_000)  # the kernel's TCP buffers on loopback take several MB
    t_down = send_in_thread(d, down)
    p = next(iter(relay.front.pairs.values()))
    # Both directions stop at a side that does not read. Until the kernel's buffers stop growing
    # (loopback autotuning) a buffer can drain between the look and the pause: look again paused.
    deadline = time.monotonic() + 10
    while True:
        wait_until(lambda: p.up and p.down)
        relay.pause()
        if p.up and p.down:
            break
        relay.resume()
        assert time.monotonic() < deadline, "both directions never held bytes at once while paused"
    assert 0 < len(p.up) <= CHUNK and 0 < len(p.down) <= CHUNK
    assert pipe_is_empty(relay.front)
    relay.resume()
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("down", recv_exactly(c, len(down))), daemon=True)
    reader.start()
    assert recv_exactly(d, len(forwarded(up))) == forwarded(up)
    reader.join(10)
    assert got["down"] == down
    t_up.join(5)
    t_down.join(5)


@pytest.mark.parametrize("where", ["in", "out"])
def test_a_refused_splice_falls_back_to_the_buffer(tmp_path, monkeypatch, where):
    """EINVAL (a socket type splice does not serve) from the socket into the pipe, or from the
    pipe to the socket (bytes are in the pipe then: they are read back out): the front stops
    splicing and relays the same bytes through its buffer."""
    real = os.splice
    calls = []

    def refusing(src, dst, count, *args, **kw):
        calls.append((src, dst))
        into_pipe = relay.front.pipe is not None and dst == relay.front.pipe[1]
        if into_pipe == (where == "in"):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(src, dst, count, *args, **kw)

    monkeypatch.setattr(front_module.os, "splice", refusing)
    relay = Relay(tmp_path, splice=True)
    try:
        assert relay.front.pipe is not None
        c, d = relay.client()
        down = os.urandom(CHUNK + 1000)
        t = send_in_thread(d, down)
        assert recv_exactly(c, len(down)) == down
        t.join(5)
        up = wire([[os.urandom(60_000)] for _ in range(5)])
        c.sendall(up)
        assert recv_exactly(d, len(forwarded(up))) == forwarded(up)
        assert relay.front.pipe is None and calls
        if where == "in":
            assert relay.front.spliced == 0
        else:  # the first splice into the pipe worked; its bytes were read back and sent from the buffer
            assert 0 < relay.front.spliced <= CHUNK
    finally:
        relay.close()


@pytest.mark.parametrize("peer", ["closed", "full"])
def test_what_a_socket_does_not_take_is_read_back_out_of_the_pipe(peer):
    """A splice from the pipe that fails (the peer went: EPIPE) or moves nothing (the socket is
    full: EAGAIN) leaves the pipe empty: the bytes come back to be buffered (or dropped with the side)."""
    listener = listen("tcp://127.0.0.1:0")
    front = Front(listener, LIMITS)
    a, b = socket.socketpair()
    try:
        if front.pipe is None:
            pytest.skip("no splice on this system")
        a.setblocking(False)
        if peer == "closed":
            b.close()
        else:
            while True:
                try:
                    a.send(bytes(65536))
                except BlockingIOError:
                    break
        data = os.urandom(30_000)  # fits any pipe (64 KiB at least)
        assert os.write(front.pipe[1], data) == len(data)
        rest, failed = front._splice_out(a.fileno(), len(data))
        assert rest == data and failed == (peer == "closed")
        assert pipe_is_empty(front)
    finally:
        a.close()
        b.close()
        front.close()
        listener.close()
