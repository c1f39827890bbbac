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
from ps.net.front import CHUNK, SPLICE_MIN, Budget, Cut, Front, InboundParser, Limits, endpoint_of, listen
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

    def __init__(self, tmp_path, splice: bool = True, limits: Limits = LIMITS, budget: Budget | None = None,
                 clock=time.monotonic) -> None:
        self.backend = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.path = str(tmp_path / "d.sock")
        self.backend.bind(self.path)
        self.backend.listen(16)
        self.backend.settimeout(5)
        self.listener = listen("tcp://127.0.0.1:0")
        self.endpoint = endpoint_of(self.listener, "tcp://127.0.0.1:0")
        self.front = Front(self.listener, limits, splice=splice, budget=budget, clock=clock)
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

    def connect(self, source: str = "127.0.0.1") -> socket.socket:
        """A client connection from ``source`` (not yet accepted, perhaps)."""
        host, port = self.endpoint.removeprefix("tcp://").rsplit(":", 1)
        return socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))

    def client(self, source: str = "127.0.0.1") -> tuple[socket.socket, socket.socket]:
        """A client connection and the daemon's end of it."""
        c = self.connect(source)
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


# --------------------------------------------------------------------------- the connection budget

class Clock:
    """A clock the test moves (the front's deadlines read it)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def joined(relay: Relay, source: str = "127.0.0.1") -> tuple[socket.socket, socket.socket]:
    """A client past its NULL handshake (the daemon got its READY, with X-Source)."""
    c, d = relay.client(source)
    c.sendall(greeting() + ready())
    recv_exactly(d, len(forwarded(greeting() + ready(), source)))
    return c, d


def message(c: socket.socket, d: socket.socket) -> None:
    """One complete message from the client, seen by the daemon."""
    c.sendall(frame_header(5) + b"hello")
    assert recv_exactly(d, 7) == frame_header(5) + b"hello"


def was_cut(c: socket.socket) -> bool:
    c.settimeout(5)
    try:
        while c.recv(65536):
            pass
    except ConnectionResetError:
        return True
    return False


def is_open(c: socket.socket) -> bool:
    c.settimeout(0.2)
    try:
        return c.recv(1) != b""
    except TimeoutError:
        return True
    except ConnectionResetError:
        return False


@pytest.fixture
def clocked(tmp_path):
    """``make(budget, limits)``: a Relay on a clock the test moves; closed at the end."""
    made = []

    def make(budget: Budget, limits: Limits = LIMITS) -> tuple[Relay, Clock]:
        clock = Clock()
        made.append(Relay(tmp_path, budget=budget, limits=limits, clock=clock))
        return made[-1], clock
    yield make
    for r in made:
        r.close()


def test_a_full_front_sheds_the_connection_silent_longest(clocked):
    """Two clients fit (4 descriptors, one more for a draining daemon side): a third sheds the
    one whose last complete message is oldest; a handshake counts from accept."""
    relay, clock = clocked(Budget(max_fds=5))
    a = joined(relay)
    clock.t += 1
    b = joined(relay)
    clock.t += 1
    message(*a)  # a spoke last: b is silent longest
    clock.t += 1
    c, dc = relay.client()  # in its handshake since t=3
    assert was_cut(b[0]) and relay.front.shed == 1
    assert b[1].recv(65536) == b""  # the daemon gets an EOF
    b[1].close()
    wait_until(lambda: not relay.front.draining)
    clock.t += 1
    message(*a)  # t=4: c (accepted at 3, no handshake) is now silent longest
    relay.client()
    assert was_cut(c) and is_open(a[0]) and relay.front.shed == 2


def test_shedding_starts_at_the_source_holding_the_most(clocked):
    """The oldest connection is 127.0.0.1's, but 127.0.0.2 holds two: a new one sheds one of its."""
    relay, clock = clocked(Budget(max_fds=7))
    mine = joined(relay, "127.0.0.1")
    clock.t += 1
    theirs = [joined(relay, "127.0.0.2") for _ in range(2)]
    clock.t += 1
    relay.client("127.0.0.1")
    assert was_cut(theirs[0][0]) and is_open(mine[0]) and is_open(theirs[1][0])


def test_a_source_past_its_cap_is_refused(clocked):
    relay, _ = clocked(Budget(max_fds=100, per_source=2))
    first = [joined(relay, "127.0.0.2") for _ in range(2)]
    extra = relay.connect("127.0.0.2")
    extra.settimeout(5)
    assert extra.recv(1) == b""  # closed at once, before any byte
    wait_until(lambda: relay.front.refused == 1)
    other = joined(relay, "127.0.0.1")  # another source is let in
    assert all(is_open(c) for c, _ in first + [other])


def test_a_handshake_has_a_deadline(clocked):
    relay, clock = clocked(Budget(max_fds=100, handshake_s=10))
    c, d = relay.client()
    c.sendall(greeting())  # and no READY
    recv_exactly(d, 64)
    done = joined(relay)
    clock.t += 9.9
    time.sleep(0.1)  # the loop runs its deadlines at least every 0.5 s of the clock: none is due
    assert is_open(c)
    clock.t += 0.2 + front_module.CHECK_EVERY_S  # deadlines are looked at every CHECK_EVERY_S
    assert was_cut(c) and is_open(done[0])


def test_an_unfinished_message_must_bring_the_floor_in_each_window(clocked):
    relay, clock = clocked(Budget(max_fds=100, window_s=5, floor_bytes=1000))
    c, d = joined(relay)
    idle = joined(relay)  # no message in progress: no window
    c.sendall(frame_header(60_000, MORE) + bytes(1200))
    recv_exactly(d, 9 + 1200)
    clock.t += 5.1
    time.sleep(0.1)
    assert is_open(c)  # 1,209 bytes in the first window
    c.sendall(bytes(500))
    recv_exactly(d, 500)
    clock.t += 5.1
    assert was_cut(c) and relay.front.cut == 1
    assert is_open(idle[0])


def test_an_authenticated_curve_connection_is_never_shed(clocked):
    """Under CURVE the daemon's READY means ZAP accepted the key: a new (unauthenticated)
    connection does not displace it and is closed instead; one still in its handshake is shed."""
    curve = Limits(b"CURVE", 70_000, 100_000, 17, 150_000)
    relay, clock = clocked(Budget(max_fds=3), curve)
    c, d = relay.client()
    c.sendall(greeting(b"CURVE") + command(b"HELLO", bytes(194)))
    down = greeting(b"CURVE") + command(b"WELCOME", bytes(160)) + command(b"READY", bytes(40))
    d.sendall(down)
    recv_exactly(c, len(down))
    wait_until(lambda: relay.front.clients == 1 and not relay.front.handshaking)
    late = relay.connect()
    late.settimeout(5)
    assert late.recv(1) == b""  # closed, never paired
    assert is_open(c) and relay.front.shed == 0 and relay.front.refused == 1
    c.close()  # the authenticated client goes: a new one gets its place
    while d.recv(65536):  # what it sent, then the EOF
        pass
    d.close()
    wait_until(lambda: relay.front.clients == 0 and not relay.front.draining)
    clock.t += 1  # accepts paused for 0.2 s of the clock
    pending, dp = relay.client()
    pending.sendall(greeting(b"CURVE"))
    assert recv_exactly(dp, 64) == greeting(b"CURVE")
    relay.connect()  # the one in its handshake is shed for a newer one
    assert was_cut(pending) and relay.front.shed == 1


def test_with_source_replaces_what_the_client_sent_in_any_case():
    spoofed = ready() + b""
    for name in (b"X-Source", b"x-source", b"X-SOURCE"):
        props = bytes([len(name)]) + name + (7).to_bytes(4, "big") + b"1.2.3.4"
        raw = command(b"READY", b"\x0bSocket-Type\x00\x00\x00\x06DEALER" + props)
        out = front_module.with_source(raw, "10.0.0.9")
        assert b"1.2.3.4" not in out and out.endswith(b"\x08X-Source\x00\x00\x00\x0810.0.0.9")
        assert b"Socket-Type\x00\x00\x00\x06DEALER" in out
    assert front_module.with_source(spoofed, "unix").endswith(b"X-Source\x00\x00\x00\x04unix")
    ping = command(b"PING", b"\x00\x00")
    assert front_module.with_source(ping, "10.0.0.9") == ping  # not a READY: unchanged
    long = command(b"READY", b"\x0bSocket-Type\x00\x00\x00\x06DEALER" + b"\x06X-Long" + (300).to_bytes(4, "big")
                   + bytes(300))
    out = front_module.with_source(long, "10.0.0.9")
    assert out[0] == COMMAND | LONG and int.from_bytes(out[1:9], "big") == len(out) - 9


def test_the_daemon_reads_the_client_address_as_x_source(tmp_path):
    """A real libzmq ROUTER behind the front: ``frame.get("X-Source")`` is the client's address,
    whatever X-Source the client set in its own READY (zmq.METADATA)."""
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    path = str(tmp_path / "router.sock")
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{path}")
    listener = listen("tcp://127.0.0.1:0")
    front = Front(listener, LIMITS, budget=Budget(max_fds=100))
    front.set_backend(path)
    stop = threading.Event()
    th = threading.Thread(target=lambda: [front.run_once(0.02) for _ in iter(stop.is_set, True)], daemon=True)
    th.start()
    try:
        for spoof in (None, b"X-Source:1.2.3.4"):
            dealer = ctx.socket(zmq.DEALER)
            dealer.linger = 0
            if spoof:
                dealer.setsockopt(zmq.METADATA, spoof)
            dealer.connect(endpoint_of(listener, "tcp://127.0.0.1:0"))
            dealer.send(b"hi")
            assert router.poll(5000)
            frames = router.recv_multipart(copy=False)
            assert frames[-1].bytes == b"hi"
            assert frames[-1].get("X-Source") == "127.0.0.1", spoof
            dealer.close()
    finally:
        stop.set()
        th.join(5)
        front.close()
        listener.close()
        ctx.destroy(linger=0)


def test_a_repeated_heartbeat_is_dropped_within_half_the_daemons_window(clocked):
    """Under NULL, past the handshake, a heartbeat that repeats byte for byte the connection's
    previous message, passed on less than ``hb_repeat_s`` ago, is dropped by the front (the
    daemon would drop it unread: ConnectionLimits.hb_refresh_s, of which this is half). Once the
    window has passed, or after any other message, or with other bytes, it is passed on."""
    from dataclasses import replace

    from protocol.codec import encode
    from protocol.messages import Heartbeat

    relay, clock = clocked(Budget(max_fds=64), replace(LIMITS, hb_repeat_s=0.5))
    c, d = joined(relay)
    hb = bytes(encode(Heartbeat(boot=7, credit=1, busy=(3,), seen=3))[0])
    other_hb = bytes(encode(Heartbeat(boot=7, credit=1, busy=(), seen=4))[0])
    wire_hb, wire_other = frame_header(len(hb)) + hb, frame_header(len(other_hb)) + other_hb

    def passed(data: bytes) -> None:
        c.sendall(data)
        assert recv_exactly(d, len(data)) == data

    def dropped(data: bytes) -> None:
        n = relay.front.hb_dropped
        c.sendall(data)
        wait_until(lambda: relay.front.hb_dropped == n + 1)

    passed(wire_hb)
    dropped(wire_hb)
    clock.t += 0.49
    dropped(wire_hb)  # still within 0.5 s of the one passed on
    clock.t += 0.01
    passed(wire_hb)  # the window is over: passed on, and the window starts again
    dropped(wire_hb)
    passed(frame_header(5) + b"hello")  # anything else in between ...
    passed(wire_hb)  # ... and the next heartbeat is passed on whatever it repeats
    passed(wire_other)  # other bytes: passed on
    dropped(wire_other)
    passed(wire_other + frame_header(5) + b"hello")  # not one message a read: passed on as it is
    d.settimeout(0.2)
    with pytest.raises(TimeoutError):
        d.recv(1)  # nothing else reached the daemon: the dropped ones are gone
    assert relay.front.hb_dropped == 4


def test_without_a_window_every_heartbeat_is_passed_on(relay):
    """``hb_repeat_s`` 0 (CURVE, where the bytes are encrypted, or a daemon that asks none)."""
    from protocol.codec import encode
    from protocol.messages import Heartbeat

    c, d = joined(relay)
    hb = bytes(encode(Heartbeat(boot=7, credit=1))[0])
    for _ in range(3):
        c.sendall(frame_header(len(hb)) + hb)
        assert recv_exactly(d, len(hb) + 2) == frame_header(len(hb)) + hb
    assert relay.front.hb_dropped == 0


def test_a_client_that_leaves_the_daemons_bytes_waiting_is_cut_and_a_slow_reader_is_not(clocked):
    """What the daemon sends a client that does not read fills the client's socket, then the
    front holds it: the client must take ``floor_bytes`` in every ``window_s`` while bytes wait
    for it (what left the socket's send queue counts), or it is cut, and the daemon's side gets
    an EOF (libzmq then drops what it queued for that peer). A client reading above the floor,
    in whatever steps, stays."""
    relay, clock = clocked(Budget(max_fds=100, window_s=5, floor_bytes=100_000))
    (c, d), (slow, slow_d) = joined(relay), joined(relay)
    for s in (c, slow):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    senders = [send_in_thread(x, bytes(16 << 20)) for x in (d, slow_d)]  # more than the buffers hold
    wait_until(lambda: len(relay.front.stuck) == 2)
    recv_exactly(slow, 300_000)  # the slow reader takes 300 KB in this window, the other nothing
    clock.t += 5.1
    wait_until(lambda: relay.front.cut == 1)
    assert was_cut(c)
    d.settimeout(5)
    while d.recv(1 << 20):  # the daemon's side: what was in flight, then the EOF
        pass
    assert relay.front.cut == 1 and slow.recv(1) != b"", "the slow reader is still served"
    recv_exactly(slow, 50_000)  # too little in the next window: cut too
    clock.t += 5.1
    wait_until(lambda: relay.front.cut == 2)
    assert was_cut(slow)
    for t in senders:
        t.join(10)


def test_a_connection_past_its_frame_rate_is_not_read_until_its_budget_is_back(clocked):
    """``max_frame_rate`` frames a second per connection, a burst of one second's worth: the
    read that spends the budget is passed on whole (nothing is dropped), then the front reads
    that connection no more until the budget is back, so its bytes wait in its own socket (the
    sender's sends wait); other connections are read meanwhile."""
    from dataclasses import replace

    relay, clock = clocked(Budget(max_fds=64), replace(LIMITS, max_frame_rate=100.0))
    c, d = joined(relay)  # its READY: one frame of the 100
    other_c, other_d = joined(relay)
    hello = frame_header(5) + b"hello"
    c.sendall(hello * 109)  # 99 left, then 10 past the budget: read and passed on all the same
    assert recv_exactly(d, 109 * len(hello)) == hello * 109
    wait_until(lambda: relay.front.throttled == 1)
    c.sendall(hello * 5)
    d.settimeout(0.3)
    with pytest.raises(TimeoutError):
        d.recv(1)  # not read: 10 frames owed at 100 a second, and the clock has not moved
    message(other_c, other_d)  # another connection is read meanwhile
    clock.t += 0.2  # the 10 owed are paid, and 10 more earned: read again
    assert recv_exactly(d, 5 * len(hello)) == hello * 5
    assert relay.front.throttled == 1 and not relay.front.paused  # 5 left: not paused again


def test_without_a_frame_rate_a_connection_is_read_at_any_pace(relay):
    """``max_frame_rate`` 0 (the front of a test, or ``serve --max-frame-rate 0``)."""
    c, d = joined(relay)
    hello = frame_header(5) + b"hello"
    c.sendall(hello * 5000)
    assert recv_exactly(d, 5000 * len(hello)) == hello * 5000
    assert relay.front.throttled == 0


# ---------------------------------------------------------------- routing by mechanism (PROTOCOL.md §6.15)
SECRET = bytes(range(32))
CURVE_LIMITS = Limits(mechanism=b"CURVE", max_frame_bytes=70_000, max_message_bytes=100_000, max_frames=17,
                      max_pending_bytes=150_000)


def test_the_front_routes_by_mechanism_and_only_a_token_reaches_the_data_socket(tmp_path):
    """Real libzmq on both sides: a CURVE client reaches the daemon's CURVE socket as before; a NULL
    client whose routing id is a token of this daemon reaches its data socket (with X-Source);
    a NULL client with a forged token or none is cut and the data socket never hears of it."""
    zmq = pytest.importorskip("zmq")
    from protocol.seal import make_token

    ctx = zmq.Context()
    pub, sec = zmq.curve_keypair()
    curve = ctx.socket(zmq.ROUTER)
    curve.curve_server, curve.curve_secretkey, curve.curve_publickey = True, sec, pub
    curve.bind(f"ipc://{tmp_path}/curve.sock")
    data = ctx.socket(zmq.ROUTER)
    data.setsockopt(zmq.ROUTER_HANDOVER, 1)  # as the daemon's (ps/net/sealed.py)
    data.bind(f"ipc://{tmp_path}/data.sock")
    listener = listen("tcp://127.0.0.1:0")
    endpoint = endpoint_of(listener, "tcp://127.0.0.1:0")
    front = Front(listener, CURVE_LIMITS, budget=Budget(max_fds=100))
    front.set_backend(f"{tmp_path}/curve.sock", CURVE_LIMITS, (f"{tmp_path}/data.sock", LIMITS, SECRET))
    stop = threading.Event()
    th = threading.Thread(target=lambda: [front.run_once(0.02) for _ in iter(stop.is_set, True)], daemon=True)
    th.start()
    socks = []

    def dealer(routing_id: bytes | None = None, curve_client: bool = False):
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        if routing_id is not None:
            s.routing_id = routing_id
        if curve_client:
            cpub, csec = zmq.curve_keypair()
            s.curve_publickey, s.curve_secretkey, s.curve_serverkey = cpub, csec, pub
        s.connect(endpoint)
        socks.append(s)
        return s

    try:
        dealer(curve_client=True).send(b"over curve")
        assert curve.poll(5000)
        assert curve.recv_multipart()[-1] == b"over curve"
        token = make_token(SECRET)
        dealer(token).send(b"sealed bytes")
        assert data.poll(5000)
        frames = data.recv_multipart(copy=False)
        assert frames[0].bytes == token and frames[-1].bytes == b"sealed bytes"
        assert frames[-1].get("X-Source") == "127.0.0.1"
        forged = token[:-1] + bytes([token[-1] ^ 1])
        cut = front.cut
        dealer(forged).send(b"x")
        dealer().send(b"y")
        wait_until(lambda: front.cut >= cut + 2)
        assert not data.poll(0) and not curve.poll(0)
        # never shed: the CURVE connection the daemon authenticated, and one data connection per
        # token, at most as many as those; a newer connection with a token replaces the older
        wait_until(lambda: front.curve_authed == 1 and front.data_authed == 1)
        dealer(make_token(SECRET)).send(b"a second token")
        assert data.poll(5000) and data.recv_multipart()[-1] == b"a second token"
        assert front.data_authed == 1, "past one per authenticated connection a data connection may be shed"
        cut = front.cut
        dealer(token).send(b"reconnected")
        wait_until(lambda: front.cut == cut + 1)  # the older connection of that token
        assert data.poll(5000) and data.recv_multipart()[-1] == b"reconnected"
        assert front.data_authed == 1 and front.data_tokens[token].stage == front_module.AUTHED
    finally:
        stop.set()
        th.join(5)
        for s in socks:
            s.close()
        front.close()
        listener.close()
        ctx.destroy(linger=0)


def test_routing_follows_any_split_of_the_handshake_and_drops_the_daemons_greeting(tmp_path):
    """Raw bytes, one at a time: the front answers the signature, then (NULL) the rest of a NULL
    greeting; once the READY names a token it connects the data socket, passes on the greeting
    and the READY (with X-Source), and drops the daemon's own greeting, which the client already
    has; what the daemon says after it reaches the client untouched."""
    from protocol.seal import make_token

    curve_path, data_path = str(tmp_path / "c.sock"), str(tmp_path / "d.sock")
    backs = []
    for path in (curve_path, data_path):
        b = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        b.bind(path)
        b.listen(4)
        b.settimeout(5)
        backs.append(b)
    listener = listen("tcp://127.0.0.1:0")
    front = Front(listener, CURVE_LIMITS, budget=Budget(max_fds=100))
    front.set_backend(curve_path, CURVE_LIMITS, (data_path, LIMITS, SECRET))
    stop = threading.Event()
    th = threading.Thread(target=lambda: [front.run_once(0.02) for _ in iter(stop.is_set, True)], daemon=True)
    th.start()
    try:
        host, port = endpoint_of(listener, "tcp://127.0.0.1:0").removeprefix("tcp://").rsplit(":", 1)
        c = socket.create_connection((host, int(port)), timeout=5)
        assert recv_exactly(c, 11) == front_module.SIGNATURE
        hello = greeting(b"NULL") + ready(identity=make_token(SECRET))
        for i in range(64):
            c.sendall(hello[i:i + 1])
        assert recv_exactly(c, 53) == front_module.NULL_GREETING[11:]
        for i in range(64, len(hello)):
            c.sendall(hello[i:i + 1])
        d, _ = backs[1].accept()
        d.settimeout(5)
        assert recv_exactly(d, len(forwarded(hello))) == forwarded(hello)
        answer = ready(b"ROUTER")
        d.sendall(front_module.NULL_GREETING[:30])
        d.sendall(front_module.NULL_GREETING[30:] + answer)
        assert recv_exactly(c, len(answer)) == answer
        c.sendall(frame_header(5) + b"hello")
        assert recv_exactly(d, 7) == frame_header(5) + b"hello"
        backs[0].settimeout(0.01)
        with pytest.raises(TimeoutError):
            backs[0].accept()  # nothing went to the CURVE socket
        c.close()
        d.close()
    finally:
        stop.set()
        th.join(5)
        front.close()
        listener.close()
        for b in backs:
            b.close()
