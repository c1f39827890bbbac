"""Connections the front hands over (ps/net/handover.py, ps/net/front.py ``_hand_over``).

The front and the daemon's HandedPath are stepped in one thread here, each on its own epoll, with
real sockets: a real libzmq DEALER talks to the front's listener and ends up talking to the
daemon's side, which reads and writes its descriptor itself. The bounds the daemon takes over
from the front (frame and message sizes, all unfinished messages together, the progress floor
both ways, the send queue, the frame rate, the descriptor cap) are each driven past and must cut
with the front's own words."""

from __future__ import annotations

import errno
import socket
import time

import pytest
import zmq

from protocol.codec import decode, encode
from protocol.messages import Heartbeat
from protocol.zmtp import ZmtpLimits, command, frame_header, greeting, ready
from ps.net import handover as hmod
from ps.net.front import Budget, Front, Limits, endpoint_of, listen
from ps.net.handover import GENERATED, HandedPath, HandLimits, pack_hand, unpack_hand

MORE = 0x01
ZL = ZmtpLimits(max_frame_bytes=70_000, max_message_bytes=100_000, max_frames=17, max_command_bytes=64 * 1024)
HL = HandLimits(zmtp=ZL, max_pending_bytes=150_000, max_frame_rate=0.0, max_connections=100,
                max_out_messages=8, window_s=5.0, floor_bytes=64 * 1024)
FRONT_LIMITS = Limits(mechanism=b"NULL", max_frame_bytes=70_000, max_message_bytes=100_000, max_frames=17,
                      max_pending_bytes=150_000)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def wait_until(cond, step, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        step()


class Daemon:
    """The daemon's side alone: a HandedPath and a stand-in front that hands it sockets."""

    def __init__(self, tmp_path, limits: HandLimits = HL, clock=None, live=lambda rid: False) -> None:
        self.clock = clock or Clock()
        self.path = HandedPath(str(tmp_path / "hand.sock"), limits, self.clock, bytearray, live)
        self.front = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.front.connect(str(tmp_path / "hand.sock"))
        self.got: list[list] = []
        self.cid = 0
        self.clients: list[socket.socket] = []

    def step(self) -> None:
        self.got += list(self.path.pending())

    def hand(self, read: bytes = b"", unsent: bytes = b"", source: str = "10.0.0.7") -> socket.socket:
        """A connected pair: the client's end returned, the server's end handed over."""
        client, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.cid += 1
        socket.send_fds(self.front, [pack_hand(self.cid, source, unsent, read)], [server.fileno()])
        server.close()
        n = self.path.handed + self.path.cut
        wait_until(lambda: self.path.handed + self.path.cut > n, self.step)
        client.settimeout(5)
        self.clients.append(client)
        return client

    def closed_ids(self) -> list[int]:
        self.front.setblocking(False)
        out = []
        try:
            while True:
                data = self.front.recv(65536)
                out += [int.from_bytes(data[i:i + 8], "big") for i in range(1, len(data), 8)]
        except BlockingIOError:
            pass
        return out

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.front.close()
        self.path.close()


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.close()


def wire(*messages: list[bytes]) -> bytes:
    return b"".join(frame_header(len(f), MORE if i < len(m) - 1 else 0) + f for m in messages for i, f in enumerate(m))


HANDSHAKE = greeting() + ready(b"DEALER")


def push(d, c: socket.socket, data: bytes) -> None:
    """Send all of ``data`` while the daemon's side reads (a socket pair holds little)."""
    view = memoryview(data)
    while view:
        try:
            view = view[c.send(view, socket.MSG_DONTWAIT):]
        except BlockingIOError:
            pass
        d.step()


def was_reset(c: socket.socket) -> bool:
    try:
        while c.recv(65536):
            pass
        return True  # an orderly end also means the server let it go
    except ConnectionResetError:
        return True
    except OSError as e:
        return e.errno in (errno.ECONNRESET, errno.EPIPE)


def test_the_hand_over_message_round_trips_and_a_short_one_is_refused():
    data = pack_hand(7, "192.0.2.1", b"rest-of-greeting", b"client bytes")
    assert unpack_hand(data) == (7, "192.0.2.1", b"rest-of-greeting", b"client bytes")
    for bad in (b"", data[:5], data[:14]):
        with pytest.raises(ValueError):
            unpack_hand(bad)


def test_what_the_front_read_and_what_follows_come_out_as_messages_with_a_routing_id_of_their_own(daemon):
    c = daemon.hand(read=HANDSHAKE + wire([b"first"]), unsent=b"GREETING-REST")
    assert c.recv(13) == b"GREETING-REST"  # what the front had not written is written first
    push(daemon, c, wire([b"head", b"x" * 5000], [b"second"]))
    wait_until(lambda: len(daemon.got) == 3, daemon.step)
    rid = daemon.got[0][0]
    assert rid.bytes == GENERATED + (1).to_bytes(8, "big")  # no Identity: a zero byte and its id
    assert [[bytes(f) for f in m[1:]] for m in daemon.got] == [[b"first"], [b"head", b"x" * 5000], [b"second"]]
    assert daemon.got[0][1].bytes == b"first"  # zmq.Frame's attribute, as the transport reads it
    assert daemon.path.by_rid[rid].source == "10.0.0.7"
    assert daemon.path.send(rid, [b"answer", b"y" * 300]) is True
    assert c.recv(2 + 6 + 2 + 9 + 300, socket.MSG_WAITALL) == wire([b"answer", b"y" * 300])
    assert daemon.path.send(b"\x00abcd", [b"x"]) is None  # no handed connection: the caller's ROUTER


def test_the_identity_is_the_routing_id_and_a_reconnect_with_it_takes_it_over(daemon):
    """As libzmq's ROUTER with ROUTER_HANDOVER: the worker's routing id survives its reconnect."""
    old = daemon.hand(read=greeting() + ready(b"DEALER", Identity=b"w7/5eed") + wire([b"one"]))
    new = daemon.hand(read=greeting() + ready(b"DEALER", Identity=b"w7/5eed") + wire([b"two"]))
    assert [(m[0].bytes, bytes(m[1])) for m in daemon.got] == [(b"w7/5eed", b"one"), (b"w7/5eed", b"two")]
    assert daemon.path.taken_over == 1 and len(daemon.path.by_fd) == 1
    assert old.recv(10) == b""  # the old connection is closed
    assert daemon.path.send(b"w7/5eed", [b"to-new"])
    assert new.recv(10) == wire([b"to-new"])
    bad = greeting() + ready(b"DEALER", Identity=b"\x00bad") + wire([b"3"])  # an identity libzmq refuses
    daemon.hand(read=bad)
    assert daemon.got[-1][0].bytes != b"\x00bad" and len(daemon.path.by_fd) == 2


def test_a_ping_is_answered_with_pong(daemon):
    c = daemon.hand(read=HANDSHAKE)
    c.sendall(command(b"PING", b"\x00\x0actx"))
    wait_until(lambda: daemon.path.pongs == 1, daemon.step)
    assert c.recv(64) == command(b"PONG", b"ctx")


@pytest.mark.parametrize("data, why", [
    (wire([b"h", bytes(70_001)]), "a 70001-byte frame (at most 70000)"),
    (wire([b"h"] * 17 + [b"t"]), "a message of more than 17 frames"),
    (frame_header(60_000, MORE) + bytes(60_000) + frame_header(60_000), "a message of more than 100000 bytes"),
    (bytes([0x08, 1, 0]), "reserved bits set"),
])
def test_a_bound_broken_cuts_the_connection_with_the_fronts_words_and_the_front_is_told(daemon, caplog, data, why):
    c = daemon.hand(read=HANDSHAKE)
    try:
        push(daemon, c, data)
    except OSError:
        pass  # cut while it sent
    wait_until(lambda: daemon.path.cut == 1, daemon.step)
    assert was_reset(c)
    assert why in caplog.text and "cut a connection: " in caplog.text
    assert daemon.path.pending_bytes == 0 and not daemon.path.by_fd
    assert daemon.closed_ids() == [1]


def test_a_handshake_that_is_not_zmtp_null_is_cut_at_once(daemon, caplog):
    daemon.hand(read=greeting()[:12] + b"CURVE".ljust(20, b"\x00") + bytes(32))
    assert daemon.path.cut == 1 and "this connection speaks NULL" in caplog.text


def test_all_unfinished_messages_together_are_bounded(daemon, caplog):
    a, b = daemon.hand(read=HANDSHAKE), daemon.hand(read=HANDSHAKE)
    a.sendall(frame_header(70_000, MORE) + bytes(10))
    wait_until(lambda: daemon.path.pending_bytes == 70_000, daemon.step)
    b.sendall(frame_header(70_000, MORE) + bytes(10))
    wait_until(lambda: daemon.path.pending_bytes == 140_000, daemon.step)
    push(daemon, a, bytes(69_990) + frame_header(20_000, MORE))  # 160,000 declared: past 150,000
    wait_until(lambda: daemon.path.cut == 1, daemon.step)
    assert "all connections' unfinished messages passed 150000 bytes" in caplog.text
    assert daemon.path.pending_bytes == 70_000  # b's, still open
    push(daemon, b, bytes(69_990) + frame_header(1) + b"z")
    wait_until(lambda: daemon.got, daemon.step)
    assert daemon.path.pending_bytes == 0 and len(daemon.got[0]) == 3


def test_an_unfinished_message_must_bring_the_floor_in_each_window(daemon, caplog):
    clock = daemon.clock
    slow, fast = daemon.hand(read=HANDSHAKE), daemon.hand(read=HANDSHAKE)
    slow.sendall(frame_header(100, MORE) + bytes(10))
    fast.sendall(frame_header(70_000, MORE) + bytes(10))
    wait_until(lambda: len(daemon.path.mid) == 2, daemon.step)
    clock.t += 4.0
    push(daemon, fast, bytes(66_000))
    wait_until(lambda: max(h.win_bytes for h in daemon.path.mid) > 66_000 or daemon.path.cut, daemon.step)
    clock.t += 1.5
    daemon.path.service(clock.t)
    assert daemon.path.cut == 1 and len(daemon.path.by_fd) == 1  # the slow one went, the fast one stays
    assert "an unfinished message brought 12 bytes in 5 s (at least 65536 per 5 s, or finish it)" in caplog.text
    assert was_reset(slow)


def test_a_peer_that_leaves_the_daemons_bytes_waiting_is_cut_and_the_send_queue_is_bounded(daemon, caplog):
    c = daemon.hand(read=HANDSHAKE + wire([b"hello"]))
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    rid = daemon.got[0][0] if daemon.got else next(iter(daemon.path.by_rid))
    big = bytes(1 << 20)
    sent = [daemon.path.send(rid, [big]) for _ in range(HL.max_out_messages + 4)]
    assert sent[0] is True and sent[-1] is False  # past max_out_messages waiting: a send fails (HWM)
    assert daemon.path.stuck
    daemon.clock.t += 5.0
    daemon.path.next_check = 0.0
    daemon.path.service(daemon.clock.t)
    assert daemon.path.cut == 1
    assert "of what the server sent it in 5 s (at least 65536 per 5 s while bytes wait for it)" in caplog.text


def test_the_final_bye_waits_behind_a_large_message_and_its_answer_ends_the_drain(daemon):
    """The drain (transport.await_byes) flushes what waits for a handed connection: a bye queued
    behind 4 MB reaches the worker, whose answering bye ends the wait. (The poller answers with
    the descriptor, not the object registered: the drain once never flushed, and a worker behind
    a large job never heard its bye.)"""
    import threading

    from protocol.messages import Bye
    from ps.net.transport import await_byes

    c = daemon.hand(read=HANDSHAKE)
    rid = next(iter(daemon.path.by_rid))
    assert daemon.path.send(rid, [bytes(4 << 20)]) and daemon.path.send(rid, encode(Bye("stopping")))
    assert daemon.path.by_rid[rid].out  # the socket pair took only part of it
    bye = wire(encode(Bye("stopping")))

    def worker() -> None:
        got = b""
        while not got.endswith(bye):
            got += c.recv(1 << 20)
        c.sendall(wire(encode(Bye("ack"))))
    t = threading.Thread(target=worker, daemon=True)
    t.start()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    try:
        pending = {rid}
        await_byes(router, pending, Bye("again"), time.monotonic() + 10, time.monotonic, 1 << 20,
                   lambda r, m: daemon.path.send(r, encode(m)), handed=daemon.path)
        assert pending == set()
    finally:
        router.close(0)
        ctx.term()
        t.join(5)


def test_close_lingers_for_what_waits_to_be_sent(daemon):
    c = daemon.hand(read=HANDSHAKE)
    rid = next(iter(daemon.path.by_rid))
    assert daemon.path.send(rid, [bytes(4 << 20)]) and daemon.path.by_rid[rid].out
    got = []

    def reader() -> None:
        n = 0
        while chunk := c.recv(1 << 20):
            n += len(chunk)
        got.append(n)
    import threading

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    daemon.path.close()
    t.join(5)
    assert got == [9 + (4 << 20)]  # all of it, then the orderly end


def test_a_reader_that_takes_its_bytes_is_not_cut(daemon):
    c = daemon.hand(read=HANDSHAKE)
    rid = next(iter(daemon.path.by_rid))
    for _ in range(4):
        assert daemon.path.send(rid, [bytes(1 << 20)])
    got = 0
    while got < 4 * ((1 << 20) + 9):
        got += len(c.recv(1 << 20))
        daemon.step()
        daemon.clock.t += 0.5
        daemon.path.service(daemon.clock.t)
    assert daemon.path.cut == 0 and not daemon.path.stuck


def test_past_its_frame_rate_a_connection_is_not_read_until_its_budget_is_back(tmp_path):
    d = Daemon(tmp_path, HandLimits(zmtp=ZL, max_pending_bytes=150_000, max_frame_rate=100.0))
    try:
        c = d.hand(read=HANDSHAKE)
        push(d, c, wire(*[[b"m%d" % i] for i in range(150)]))  # one read: 150 frames, 50 past the burst
        wait_until(lambda: d.path.paused, d.step)
        h = next(iter(d.path.by_fd.values()))
        assert not h.mask & hmod._IN and h.paused_until == pytest.approx(d.clock.t + 0.5)
        push(d, c, wire(*[[b"n%d" % i] for i in range(50)]))
        for _ in range(20):
            d.step()
        assert len(d.got) == 150  # what it sent meanwhile waits in its socket
        d.clock.t = h.paused_until
        d.path.service(d.clock.t)
        wait_until(lambda: len(d.got) == 200, d.step)
        assert d.path.cut == 0
    finally:
        d.close()


def test_past_its_descriptors_the_one_silent_longest_that_is_no_live_workers_is_shed(tmp_path, caplog):
    live: set[bytes] = set()
    d = Daemon(tmp_path, HandLimits(zmtp=ZL, max_pending_bytes=150_000, max_connections=3),
               live=lambda rid: rid in live)
    try:
        a = d.hand(read=HANDSHAKE)
        d.clock.t += 1
        d.hand(read=HANDSHAKE)
        d.clock.t += 1
        d.hand(read=HANDSHAKE)
        live.add(d.path.by_fd[a.fileno()].rid if False else next(iter(d.path.by_rid)))  # the oldest: a live worker's
        d.clock.t += 1
        d.hand(read=HANDSHAKE)
        assert d.path.shed == 1 and len(d.path.by_fd) == 3
        assert d.closed_ids() == [2]  # the second: silent longest of those that are not a live worker's
        assert "shed to make room" in caplog.text
    finally:
        d.close()


# ------------------------------------------------------------------ the front hands over, a libzmq peer

class Stack:
    """The front and the daemon's HandedPath in one thread, a real libzmq DEALER as the client."""

    def __init__(self, tmp_path, per_source: int = 0) -> None:
        self.clock = time.monotonic
        self.path = HandedPath(str(tmp_path / "hand.sock"), HL, self.clock, bytearray)
        listener = listen("tcp://127.0.0.1:0")
        self.endpoint = endpoint_of(listener, "tcp://127.0.0.1:0")
        self.front = Front(listener, FRONT_LIMITS, budget=Budget(max_fds=200, per_source=per_source))
        self.front.set_backend(str(tmp_path / "unused.sock"), FRONT_LIMITS, None, str(tmp_path / "hand.sock"))
        self.got: list[list] = []

    def step(self) -> None:
        self.front.run_once(0.005)
        self.got += list(self.path.pending())
        self.path.service(self.clock())

    def close(self) -> None:
        self.front.close()
        self.path.close()


def test_a_libzmq_dealer_talks_to_the_daemon_through_a_handed_connection(tmp_path):
    s = Stack(tmp_path)
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.setsockopt(zmq.HEARTBEAT_IVL, 50)  # its PINGs reach the daemon and get their PONG
        dealer.connect(s.endpoint)
        dealer.send_multipart(encode(Heartbeat(boot=1, credit=2, busy=(), seen=-1)))
        wait_until(lambda: s.got, s.step)
        assert s.front.handed_over == 1 and not s.front.pairs  # the front holds nothing of it
        assert len(s.front.handed) == 1 and s.front.handed_by_source == {"127.0.0.1": 1}
        (rid, *frames), = s.got
        assert decode(frames) == Heartbeat(boot=1, credit=2, busy=(), seen=-1)
        assert s.path.by_rid[rid].source == "127.0.0.1"
        assert s.path.send(rid, [b"to", b"the dealer" * 1000])
        wait_until(lambda: dealer.poll(0), s.step)
        assert dealer.recv_multipart() == [b"to", b"the dealer" * 1000]
        wait_until(lambda: s.path.pongs, s.step)
        dealer.close()
        wait_until(lambda: not s.path.by_fd and not s.front.handed, s.step)  # closed: the front is told
        assert s.front.handed_by_source == {}
    finally:
        ctx.term()
        s.close()


def test_more_handshakes_at_once_than_the_daemons_queue_holds_all_wait_their_turn(tmp_path):
    """The hand-over socket holds what its send buffer holds (here shrunk to the least the kernel
    allows: a few hand-overs; 500 workers joining at once filled the default one): 40 clients
    finishing their handshake in one burst are queued by the front (EPOLLOUT), none is cut."""
    s = Stack(tmp_path)
    socks = []
    try:
        wait_until(lambda: s.path.front is not None, s.step)  # the daemon took the front's socket
        s.front.hand.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
        port = int(s.endpoint.rsplit(":", 1)[1])
        for _ in range(40):
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            c.sendall(greeting() + ready(b"DEALER"))
            socks.append(c)
        for _ in range(20):  # the front alone: the daemon takes nothing meanwhile
            s.front.run_once(0.01)
        assert s.front.cut == 0 and s.front.handed_over < 40 and s.front.hand_wait
        wait_until(lambda: len(s.path.by_fd) == 40, s.step)
        assert s.front.cut == 0 and s.front.handed_over == 40 and not s.front.hand_wait
    finally:
        for c in socks:
            c.close()
        s.close()


def test_the_cap_per_source_counts_connections_handed_over(tmp_path):
    s = Stack(tmp_path, per_source=2)
    socks = []
    try:
        for _ in range(3):
            c = socket.create_connection(("127.0.0.1", int(s.endpoint.rsplit(":", 1)[1])), timeout=5)
            c.sendall(greeting() + ready(b"DEALER"))
            socks.append(c)
            wait_until(lambda: s.front.handed_over + s.front.refused == len(socks), s.step)
        assert s.front.handed_over == 2 and s.front.refused == 1  # the third: past the cap of 2
        socks[0].close()
        wait_until(lambda: s.front.handed_by_source == {"127.0.0.1": 1}, s.step)
    finally:
        for c in socks:
            c.close()
        s.close()


def test_a_sealed_data_connection_is_handed_over_once_its_token_checks_out_and_opens_as_its_sessions(tmp_path):
    """Under CurveZMQ the front hands over a NULL data connection whose READY names a token of this
    server (PROTOCOL.md §6.15): the daemon reads it itself and its sealed path opens what comes and
    seals what goes under the session; a CURVE routing id named after the token gets nothing on
    the data connection in clear; a token the server never made is cut by the front, and once the
    data connection is gone a message falls back to CurveZMQ (None)."""
    import dataclasses

    from protocol.seal import Session, make_token, sealer_opener
    from ps.net.sealed import SealedPath
    from ps.net.transport import _Outbound

    secret = b"k" * 32
    clock = time.monotonic
    path = HandedPath(str(tmp_path / "hand.sock"), HL, clock, bytearray)
    ctx = zmq.Context()
    sealed = SealedPath(ctx, f"ipc://{tmp_path}/seal.sock", secret, 70_000, 16, clock)
    sealed.handed = path
    listener = listen("tcp://127.0.0.1:0")
    endpoint = endpoint_of(listener, "tcp://127.0.0.1:0")
    front = Front(listener, dataclasses.replace(FRONT_LIMITS, mechanism=b"CURVE"), budget=Budget(max_fds=200))
    front.set_backend(str(tmp_path / "curve.sock"), dataclasses.replace(FRONT_LIMITS, mechanism=b"CURVE"),
                      (f"{tmp_path}/seal.sock", FRONT_LIMITS, secret), str(tmp_path / "hand.sock"))
    got: list = []

    def step() -> None:
        front.run_once(0.005)
        got.extend(sealed.opened(path.pending()))
        path.service(clock())

    try:
        hexed, _ = sealed.offer(b"\x00curve-rid", "fp")
        session = Session.unpack(bytes.fromhex(hexed))
        up, down = sealer_opener(session, server=False)
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.routing_id = session.token
        dealer.connect(endpoint)
        hb = Heartbeat(boot=1, credit=2, busy=(), seen=-1)
        dealer.send_multipart(up.seal(encode(hb)))
        wait_until(lambda: got, step)
        assert front.handed_over == 1 and not front.pairs and path.by_rid.keys() == {session.token}
        (rid, *frames), = got
        assert rid == b"\x00curve-rid" and decode(frames) == hb  # as if it came over the CURVE connection
        assert sealed.is_bound(b"\x00curve-rid") and sealed.by_rid[b"\x00curve-rid"].handed
        assert sealed.send(b"\x00curve-rid", encode(hb)) is True
        wait_until(lambda: dealer.poll(0), step)
        assert decode(down.open(dealer.recv_multipart(copy=False))) == hb
        assert path.messages_out == sealed.messages_out == 1

        # A keyed worker may name its CURVE connection after a token it saw on the wire (a data
        # connection's READY carries it in clear). What the transport sends to that routing id
        # never takes the handed data connection unsealed: sealed to a session's CURVE routing
        # id, or over the ROUTER, which has no such peer.
        router = ctx.socket(zmq.ROUTER)
        router.linger = 0
        out = _Outbound.__new__(_Outbound)
        out.handed, out.sealed, out.sock, out.send_failures = path, sealed, router, 0
        assert out.send_frames(session.token, encode(hb)) is True and out.send_failures == 0
        step()
        assert path.messages_out == 1 and not dealer.poll(200)
        router.close()

        stranger = ctx.socket(zmq.DEALER)  # a token of another secret: the front cuts it
        stranger.linger = 0
        stranger.routing_id = make_token(b"x" * 32)
        stranger.connect(endpoint)
        stranger.send_multipart(up.seal(encode(hb)))
        wait_until(lambda: front.cut >= 1, step)
        assert front.handed_over == 1 and len(path.by_fd) == 1
        stranger.close()

        dealer.close()
        wait_until(lambda: not path.by_fd, step)
        assert sealed.send(b"\x00curve-rid", encode(hb)) is None  # gone: over CurveZMQ until the next sealed message
        assert sealed.fallbacks == 1 and not sealed.is_bound(b"\x00curve-rid")
    finally:
        front.close()
        path.close()
        sealed.close()
        ctx.destroy(linger=0)
