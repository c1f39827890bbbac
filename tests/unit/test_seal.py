"""Sealed messages (protocol/seal.py, PROTOCOL.md §6.15): what opens, what is refused, and that a
refusal changes nothing; tokens; the buffer pool's bounds; the daemon's sealed path over real
ZeroMQ sockets (ps/net/sealed.py)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import zmq

from protocol.codec import decode, encode
from protocol.errors import RemoteProtocolError
from protocol.messages import SEAL_SESSION_BYTES, Heartbeat, Job, JobKind, Welcome
from protocol.seal import (
    TAG_BYTES,
    TOKEN_BYTES,
    BufferPool,
    SealError,
    Session,
    make_token,
    sealer_opener,
    token_ok,
)
from ps.net.sealed import SealedPath

SECRET = bytes(range(32))


def pair():
    s = Session.new(make_token(SECRET))
    server = sealer_opener(s, server=True, props={"key": "abc"})
    worker = sealer_opener(s, server=False)
    return s, server, worker


def job_frames(d: int = 1000) -> list:
    x = np.arange(d, dtype=np.float32)
    return encode(Job(7, JobKind.GRAD, 3, (3,), 99, point_ids=(3,), points=(x,)))


def test_a_sealed_message_opens_to_the_same_frames_and_decodes():
    _, (s_seal, s_open), (w_seal, w_open) = pair()
    frames = job_frames()
    sealed = s_seal.seal(frames)
    assert len(sealed) == len(frames) + 1 and len(sealed[0]) == 10  # the prefix: counter u64, count u16
    assert [memoryview(f).nbytes for f in sealed[1:]] == [memoryview(f).nbytes + TAG_BYTES for f in frames]
    assert memoryview(sealed[2]).tobytes()[:64] != memoryview(frames[1]).cast("B").tobytes()[:64]  # not in clear
    opened = w_open.open(sealed)
    assert [f.bytes for f in opened] == [bytes(memoryview(f).cast("B")) for f in frames]
    job = decode(opened)
    assert job.job_id == 7 and np.array_equal(job.points[0], np.arange(1000, dtype=np.float32))
    # the other direction, with the properties of the CURVE connection the session belongs to
    up = s_open.open(w_seal.seal(encode(Heartbeat(boot=1, credit=1))))
    assert decode(up) == Heartbeat(boot=1, credit=1) and up[0].get("key") == "abc"


@pytest.mark.parametrize("where", ["prefix", "header", "array", "tag"])
def test_a_changed_byte_anywhere_refuses_the_whole_message_and_changes_nothing(where):
    _, (s_seal, _), (_, w_open) = pair()
    sealed = [bytes(memoryview(f)) for f in s_seal.seal(job_frames())]
    i, at = {"prefix": (0, 3), "header": (1, 5), "array": (2, 100), "tag": (2, -1)}[where]
    bad = bytearray(sealed[i])
    bad[at] ^= 0x01
    tampered = [*sealed[:i], bytes(bad), *sealed[i + 1:]]
    before = (w_open.next, w_open.opened_bytes)
    with pytest.raises(SealError):
        w_open.open(tampered)
    assert (w_open.next, w_open.opened_bytes) == before
    assert decode(w_open.open(sealed)).job_id == 7  # the original still opens


def test_a_replay_an_older_message_a_cut_or_a_swapped_frame_is_refused_and_a_gap_is_not():
    _, (s_seal, _), (_, w_open) = pair()
    first = s_seal.seal(job_frames())
    second = s_seal.seal(job_frames())
    third = s_seal.seal(job_frames())
    assert decode(w_open.open(second)).job_id == 7  # the first was lost: a gap is allowed
    with pytest.raises(SealError, match="repeat or out of order"):
        w_open.open(second)  # a replay
    with pytest.raises(SealError, match="repeat or out of order"):
        w_open.open(first)  # older than what was taken
    with pytest.raises(SealError, match="names 2 frames"):
        w_open.open(third[:2])  # cut short
    with pytest.raises(SealError, match="does not authenticate"):
        w_open.open([third[0], third[2], third[1]])  # frames swapped
    assert decode(w_open.open(third)).job_id == 7


def test_a_message_under_another_session_or_direction_does_not_open():
    _, (s_seal, s_open), (w_seal, w_open) = pair()
    _, _, (_, other_open) = pair()
    with pytest.raises(SealError):
        other_open.open(s_seal.seal(job_frames()))  # another session's keys
    with pytest.raises(SealError):
        s_open.open(s_seal.seal(job_frames()))  # the server's own message reflected back to it


def test_the_counter_never_repeats_a_nonce():
    _, (s_seal, _), _ = pair()
    counters = []
    for n in (1, 2, 3, 1):
        prefix = s_seal.seal([b"x"] * n)[0]
        counters.append(int.from_bytes(prefix[:8], "big"))
    assert counters == [0, 1, 3, 6] and s_seal.counter == 7  # each frame its own nonce


def test_tokens_check_out_only_under_their_secret():
    t = make_token(SECRET)
    assert len(t) == TOKEN_BYTES and t[:1] == b"S" and token_ok(SECRET, t)
    assert not token_ok(bytes(32), t)
    assert not token_ok(SECRET, t[:-1] + bytes([t[-1] ^ 1]))
    assert not token_ok(SECRET, b"")
    assert not token_ok(SECRET, b"X" + t[1:])
    assert make_token(SECRET) != t


def test_a_session_travels_in_the_welcome_and_a_bad_one_is_refused():
    s = Session.new(make_token(SECRET))
    w = decode(encode(Welcome(1, 1, "quadratic", seal=s.pack().hex())))
    assert Session.unpack(bytes.fromhex(w.seal)) == s and len(s.pack()) == SEAL_SESSION_BYTES
    for bad in ("ab" * 95, "zz" * 96, "AB" * 96):
        with pytest.raises(RemoteProtocolError):
            decode(encode(Welcome(1, 1, "quadratic", seal=bad)))


def test_the_buffer_pool_reuses_a_buffer_once_unreferenced_and_is_bounded():
    pool = BufferPool(max_sizes=2, keep_free=1, min_bytes=1024)
    a = pool(4096)
    b = pool(4096)
    assert a is not b and pool.allocated == 2  # both in use
    ida = id(a)
    del a
    gc.collect()
    assert id(pool(4096)) == ida and pool.allocated == 2  # reused, warm
    pool(8192)
    pool(16384)  # a third size: the least recently asked-for list goes
    assert sorted(pool.lists) == [8192, 16384]
    assert type(pool(100)) is np.ndarray and pool.allocated == 4  # small: plain np.empty, not kept
    held = [pool(4096) for _ in range(4)]  # four in use at once
    del held
    gc.collect()
    pool(4096)  # one handed out, one kept idle, the other two let go
    assert len(pool.lists[4096]) == 2


def test_forged_frames_never_make_the_pool_keep_a_buffer():
    """A frame is opened into its buffer before it is known to be genuine: only sizes that a
    genuine frame of the session had come from the pool, so forged frames of new sizes leave
    nothing behind; a genuine one's size is warm from the next message on."""
    s = Session.new(make_token(SECRET))
    pool = BufferPool(min_bytes=1024)
    w_seal, _ = sealer_opener(s, server=False)
    _, s_open = sealer_opener(s, server=True, alloc=pool)
    for n in (5000, 6000, 7000):
        forged = [bytes(memoryview(f)) for f in w_seal.seal([b"h", np.zeros(n, np.uint8)])]
        forged[2] = forged[2][:-1] + bytes([forged[2][-1] ^ 1])
        with pytest.raises(SealError):
            s_open.open(forged)
    assert pool.allocated == 0 and not pool.lists
    s_open.open(w_seal.seal([b"h", np.zeros(5000, np.uint8)]))
    assert pool.allocated == 0  # the first genuine frame of a size: not yet known
    s_open.open(w_seal.seal([b"h", np.zeros(5000, np.uint8)]))
    assert pool.allocated == 1 and list(pool.lists) == [5000]


def test_the_daemons_sealed_path_opens_refuses_and_falls_back(tmp_path):
    """Real sockets: a DEALER whose routing id is a session's token. What opens comes out as the
    CURVE connection's message; an unknown token, a replay and a tampered message are refused and
    counted; the first message that opens binds the data connection (the path then sends sealed);
    once that connection is gone a send reports None (the transport sends over CURVE)."""
    ctx = zmq.Context()
    path = SealedPath(ctx, f"ipc://{tmp_path}/seal.sock", SECRET, 1 << 20, 64, clock=lambda: 0.0)
    try:
        rid = b"curve-rid"
        session = Session.unpack(bytes.fromhex(path.offer(rid, "keyfp")))
        assert path.send(rid, encode(Heartbeat(boot=1))) is None  # not bound yet: over CURVE
        w_seal, w_open = sealer_opener(session, server=False)
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.routing_id = session.token
        dealer.connect(f"ipc://{tmp_path}/seal.sock")

        def drain(n_expected: int) -> list:
            got = []
            assert path.sock.poll(5000)
            while len(got) + path.refused < n_expected:
                got += list(path.pending())
                if len(got) + path.refused < n_expected:
                    assert path.sock.poll(5000)
            return got

        good = w_seal.seal(encode(Heartbeat(boot=5, credit=2)))
        dealer.send_multipart(good)
        (msg,) = drain(1)
        assert msg[0].bytes == rid and decode(msg[1:]) == Heartbeat(boot=5, credit=2)
        assert msg[1].get("key") == "keyfp"
        dealer.send_multipart(good)  # a replay
        bad = [bytes(memoryview(f)) for f in w_seal.seal(encode(Heartbeat(boot=6)))]
        bad[1] = bad[1][:-1] + bytes([bad[1][-1] ^ 1])
        dealer.send_multipart(bad)  # tampered
        stranger = ctx.socket(zmq.DEALER)
        stranger.linger = 0
        stranger.routing_id = make_token(SECRET)  # a token of no session
        stranger.connect(f"ipc://{tmp_path}/seal.sock")
        stranger.send_multipart(w_seal.seal(encode(Heartbeat(boot=7))))
        assert drain(3) == [] and path.refused == 3 and path.messages_in == 1
        assert path.send(rid, encode(Heartbeat(boot=9))) is True  # bound: sealed
        assert dealer.poll(5000)
        assert decode(w_open.open(dealer.recv_multipart(copy=False))) == Heartbeat(boot=9)
        dealer.close()
        for _ in range(500):  # libzmq drops the peer's pipe once it sees the close
            sent = path.send(rid, encode(Heartbeat(boot=10)))
            if sent is None:
                break
            path.sock.poll(10)  # a bounded wait for the disconnect to reach the ROUTER
        assert sent is None and path.fallbacks == 1
        path.forget(rid)
        assert not path.by_rid and not path.by_token
        stranger.close()
    finally:
        path.close()
        ctx.destroy(linger=0)
