"""The worker's plain-socket DEALER for the sealed data connection (worker/plainsock.py), against
real libzmq ROUTERs and real TCP listeners: the handshake, large messages both ways written in
pieces, messages held until the peer's READY, the queue bound, every way it is lost, and the
worker's choice between trying again (a connection that never came up) and saying hello again."""

from __future__ import annotations

import select
import socket
import time

import numpy as np
import pytest
import zmq

from protocol.seal import BufferPool, Session, make_token
from worker.plainsock import Full, ZmtpDealer, parse_endpoint

DEADLINE_S = 10.0


@pytest.fixture()
def router():
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.linger = 0
    r.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = r.bind_to_random_port("tcp://127.0.0.1")
    yield r, f"tcp://127.0.0.1:{port}"
    r.close()
    ctx.term()


def until(cond, d: ZmtpDealer, what: str) -> None:
    """Drive ``d`` (its reads and writes) until ``cond()``, within DEADLINE_S."""
    end = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < end, f"no {what} within {DEADLINE_S} s (lost: {d.lost})"
        got = d.recv(0)  # reads and writes what it can now (its own clock may be a test's, frozen)
        if got is not None:
            d.inbox.appendleft(got)
            continue
        if d.lost is None:
            select.select([d], [d] if d.wants_write else [], [], 0.01)


def dealer_and_its_peer() -> tuple[socket.socket, ZmtpDealer, socket.socket]:
    """A listening socket, a dealer connected to it, and the accepted end (the test plays the server)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    d = ZmtpDealer(f"tcp://127.0.0.1:{srv.getsockname()[1]}", b"me")
    c, _ = srv.accept()
    return srv, d, c


def test_a_message_sent_at_once_waits_for_the_handshake_and_the_identity_is_the_routing_id(router):
    """A libzmq ROUTER closed every connection whose first message came with its READY before its
    own greeting (the front relays a data connection's handshake that way under --hand-over off);
    the dealer holds messages until the peer's READY (the relayed run of tests/integration/test_sealed.py
    fails without it), and 20 connections in a row get through."""
    r, ep = router
    for i in range(20):
        d = ZmtpDealer(ep, b"S" + bytes([i]) * 31)
        try:
            d.send([b"head", b"x" * 300])  # before anything came back: held
            assert d.held and not d.up
            until(lambda d=d: d.up and not d.held and not d.wants_write, d, "handshake")
            assert r.poll(int(DEADLINE_S * 1000))
            rid, head, body = r.recv_multipart()
            assert rid == b"S" + bytes([i]) * 31 and head == b"head" and body == b"x" * 300
            assert d.conn.peer["Socket-Type"] == b"ROUTER"
        finally:
            d.close()


def test_large_messages_go_both_ways_in_pieces_into_the_pool(router):
    r, ep = router
    pool = BufferPool(min_bytes=1024)
    d = ZmtpDealer(ep, b"me", alloc=pool)
    try:
        big = np.random.default_rng(0).integers(0, 256, 24 << 20, dtype=np.uint8)  # beyond any socket buffer
        d.send([b"h", big])
        until(lambda: d.up, d, "handshake")
        got = []
        end = time.monotonic() + DEADLINE_S
        while not got:  # the ROUTER reads while the dealer writes what the socket takes
            assert time.monotonic() < end
            d.flush()
            if r.poll(10):
                got = r.recv_multipart()
        assert not d.wants_write and d.queued == 0 and d.bytes_out > big.nbytes
        assert got[0] == b"me" and got[1] == b"h" and np.array_equal(np.frombuffer(got[2], np.uint8), big)
        r.send_multipart([b"me", b"small", big.tobytes()])
        msg = d.recv(int(DEADLINE_S * 1000))
        assert msg is not None and bytes(msg[0]) == b"small" and np.array_equal(msg[1], big)
        assert isinstance(msg[1], np.ndarray) and pool.allocated == 1  # read straight into a pool buffer
    finally:
        d.close()


def test_the_queue_is_bounded_and_a_full_queue_refuses_whole(router):
    r, ep = router
    r.rcvhwm = 1
    d = ZmtpDealer(ep, b"me", max_queued=3)
    try:
        until(lambda: d.up, d, "handshake")
        chunk = np.zeros(8 << 20, np.uint8)
        with pytest.raises(Full, match="queue full"):
            for _ in range(100):  # the ROUTER does not read: the kernel's buffers fill, then the queue
                d.send([chunk])
        assert d.queued == 3 and d.lost is None
        before = len(d.out)
        with pytest.raises(Full):
            d.send([b"more"])
        assert len(d.out) == before  # nothing of a refused message was queued
    finally:
        d.close()


def test_a_refused_connection_a_closing_peer_garbage_and_a_silent_peer_are_lost():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there now
    d = ZmtpDealer(f"tcp://127.0.0.1:{port}", b"me")
    until(lambda: d.lost is not None, d, "refusal")
    assert "refused" in d.lost.lower()
    with pytest.raises(Full):
        d.send([b"x"])
    d.close()

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    ep = f"tcp://127.0.0.1:{srv.getsockname()[1]}"
    try:
        d = ZmtpDealer(ep, b"me")
        c, _ = srv.accept()
        c.close()  # the peer hangs up
        until(lambda: d.lost is not None, d, "close")
        assert d.lost == "closed by the peer"
        d.close()

        d = ZmtpDealer(ep, b"me")
        c, _ = srv.accept()
        c.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(64))  # not ZMTP
        until(lambda: d.lost is not None, d, "protocol error")
        assert d.lost.startswith("protocol: not a ZMTP 3 greeting")
        c.close()
        d.close()

        now = [0.0]
        d = ZmtpDealer(ep, b"me", handshake_s=5.0, clock=lambda: now[0])
        c, _ = srv.accept()  # accepts, says nothing
        d.check()
        assert d.lost is None
        now[0] = 5.1
        d.check()
        assert d.lost == "no handshake in time"
        c.close()
        d.close()
    finally:
        srv.close()


def test_a_ping_gets_its_pong():
    from protocol import zmtp

    srv, d, c = dealer_and_its_peer()
    try:
        c.setblocking(False)
        c.sendall(zmtp.greeting(as_server=True) + zmtp.ready(b"ROUTER") + zmtp.command(b"PING", b"\x00\x10ctx"))
        seen, end = b"", time.monotonic() + DEADLINE_S
        while zmtp.pong(b"ctx") not in seen:  # after the dealer's greeting and READY
            assert time.monotonic() < end and d.lost is None
            d.recv(5)
            try:
                seen += c.recv(4096)
            except BlockingIOError:
                pass
        assert seen.startswith(zmtp.greeting()[:10]) and d.up
    finally:
        c.close()
        srv.close()
        d.close()


@pytest.mark.parametrize("endpoint, family", [("tcp://127.0.0.1:5555", socket.AF_INET),
                                              ("tcp://[::1]:5555", socket.AF_INET6),
                                              ("tcp://localhost:5555", None),
                                              ("ipc:///tmp/x.sock", socket.AF_UNIX)])
def test_endpoints(endpoint, family):
    f, addr = parse_endpoint(endpoint)
    assert family is None or f == family
    with pytest.raises(ValueError, match="tcp:// or ipc://"):
        parse_endpoint("inproc://x")


def test_a_data_connection_that_never_came_up_is_tried_again_and_one_that_dropped_says_hello():
    """The worker's side (worker/sealed.py): a connection the front cut before its handshake (the
    peer's READY never came) carried nothing, so the session is kept and the connection tried again
    later, with the same token, doubling the wait; one that came up and dropped may have lost jobs
    in flight: the worker says hello again (PROTOCOL.md §6.15)."""
    from worker.link import Worker, WorkerConfig

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    ep = f"tcp://127.0.0.1:{srv.getsockname()[1]}"
    now = [100.0]
    w = Worker(WorkerConfig(server=ep))
    w.clock = lambda: now[0]
    w.curve = object()  # as under CurveZMQ (only its presence is looked at here)
    session = Session.new(make_token(bytes(32)))
    try:
        w._open_seal(session.pack().hex(), segments=True)
        first = w.seal_sock
        c, _ = srv.accept()
        c.close()  # cut before the handshake
        until(lambda: first.lost is not None, first, "cut")
        assert w._seal_timers() is False  # no hello: the session stays
        assert w.seal_sock is None and w.sealer is not None and w.seal_retry_at == pytest.approx(100.1)
        assert w._seal_timers() is False and w.seal_sock is None  # not yet
        now[0] = 100.2
        assert w._seal_timers() is False and w.seal_sock is not None  # tried again
        assert w.seal_sock.identity == session.token and w.seal_retry_s == pytest.approx(0.2)  # the next wait doubled
        c, _ = srv.accept()
        # this time it comes up (the peer's greeting and READY), then drops
        from protocol import zmtp

        c.sendall(zmtp.greeting(as_server=True) + zmtp.ready(b"ROUTER"))
        second = w.seal_sock
        until(lambda: second.up, second, "handshake")
        c.close()
        until(lambda: second.lost is not None, second, "drop")
        assert w._seal_timers() is True  # the caller says hello again
        assert w.seal_sock is None and w.sealer is None and w.seal_retry_at is None
    finally:
        w._close_seal()
        srv.close()
        w.ctx.term()


def test_a_large_frame_sets_the_low_water_mark_to_its_rest_and_back():
    """While a large frame's body arrives the socket wakes only once most of it is there
    (SO_RCVLOWAT = the rest, at most 1 MiB), and between frames at the first byte."""
    from protocol import zmtp
    from worker.plainsock import LOWAT_MAX

    srv, d, c = dealer_and_its_peer()
    try:
        c.sendall(zmtp.greeting(as_server=True) + zmtp.ready(b"ROUTER"))
        until(lambda: d.up, d, "handshake")
        body = bytes(range(256)) * 1600  # 409,600 bytes
        wire = b"".join(bytes(b) for b in zmtp.frames_out([b"head", body]))
        c.sendall(wire[:5000])
        end = time.monotonic() + DEADLINE_S
        while d.conn.big is None or d.conn.big_at < 5000 - 15:
            assert time.monotonic() < end
            assert d.recv(5) is None
        rest = len(body) - d.conn.big_at
        lowat = d.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
        assert d.lowat == rest == lowat and rest < LOWAT_MAX
        c.sendall(wire[5000:])
        msg = d.recv(int(DEADLINE_S * 1000))
        assert msg is not None and bytes(msg[1]) == body
        assert d.lowat == 1 == d.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
    finally:
        c.close()
        srv.close()
        d.close()


def test_close_with_a_linger_writes_what_it_holds_first(router):
    """A worker's bye on its way out: ``close(linger_ms)`` writes the queue out before closing
    (libzmq's ROUTER reads it in its own thread); ``close()`` at once leaves it unsent."""
    r, ep = router
    for linger, delivered in ((10_000, True), (0, False)):
        d = ZmtpDealer(ep, b"L" + bytes([linger > 0]))
        until(lambda d=d: d.up, d, "handshake")
        sent = 0
        while not d.wants_write:  # until the socket's buffers are full and some of it is queued
            assert sent < 16, "the kernel took 384 MB without pushing back"
            d.send([b"bye", np.zeros(24 << 20, np.uint8)])
            sent += 1
        d.close(linger)
        got = 0
        while r.poll(2000 if delivered else 500):
            frames = r.recv_multipart()
            assert frames[1] == b"bye" and len(frames[2]) == 24 << 20
            got += 1
        assert (got == sent) is delivered, (got, sent)
