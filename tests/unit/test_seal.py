"""Sealed messages (protocol/seal.py, PROTOCOL.md §6.15): what opens, what is refused, and that a
refusal changes nothing; tokens; the buffer pool's bounds; the daemon's sealed path over real
ZeroMQ sockets (ps/net/sealed.py)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import zmq

import protocol.seal as seal_mod
from protocol.codec import decode, encode
from protocol.errors import RemoteProtocolError
from protocol.messages import SEAL_SESSION_BYTES, Heartbeat, Job, JobKind, Welcome
from protocol.seal import (
    AEGIS,
    GCM,
    SEGMENT_LOG2,
    TAG_BYTES,
    TOKEN_BYTES,
    BufferPool,
    SealError,
    Session,
    available_ciphers,
    choose_cipher,
    cipher_threads,
    make_token,
    sealer_opener,
    set_cipher_threads,
    token_ok,
)
from ps.net.sealed import SealedPath

SECRET = bytes(range(32))
HAVE_AEGIS = AEGIS in available_ciphers()
_sealer_opener = sealer_opener


@pytest.fixture(autouse=True, params=[GCM, AEGIS])
def cipher(request, monkeypatch):
    """Every test here under each cipher a session can have (PROTOCOL.md §6.15): the format, the
    refusals and the threads are the same for both."""
    if request.param == AEGIS and not HAVE_AEGIS:
        if os.environ.get("LATECOMER_REQUIRE_AEGIS") == "1":  # CI: make setup built pyaegis
            pytest.fail("LATECOMER_REQUIRE_AEGIS=1 but AEGIS-256X4 is not available (pyaegis)")
        pytest.skip("AEGIS-256X4 is not available here (pyaegis)")
    monkeypatch.setitem(globals(), "sealer_opener",
                        lambda *a, **k: _sealer_opener(*a, **{"cipher": request.param, **k}))
    return request.param


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


def test_an_allocator_of_the_callers_gives_every_buffer_and_a_pool_only_the_large_ones():
    """The sealer and the opener make a buffer themselves only where their allocator would have
    given a plain ``np.empty`` (a BufferPool below its ``min_bytes``, the default allocator); any
    other allocator is asked for every sealed frame, and by the opener for every frame of a size
    a genuine frame had (whole and in segments alike)."""
    for segments in (False, True):
        calls: list[int] = []

        def alloc(n: int, calls: list = calls) -> np.ndarray:
            calls.append(n)
            return np.empty(n, np.uint8)

        s = Session.new(make_token(SECRET))
        sealer, _ = sealer_opener(s, server=True, alloc=alloc, segments=segments)
        _, opener = sealer_opener(s, server=False, alloc=alloc)
        frames = [b"header", np.arange(1000, dtype=np.float32)]
        first = plain(sealer.seal(frames))
        assert calls == [6 + TAG_BYTES, 4000 + TAG_BYTES]
        calls.clear()
        assert plain(opener.open(first)) == plain(frames) and calls == []  # sizes not yet known genuine
        assert plain(opener.open(plain(sealer.seal(frames)))) == plain(frames)
        assert calls == [6 + TAG_BYTES, 4000 + TAG_BYTES, 6, 4000]
    pool = BufferPool(min_bytes=4096)
    (sealer, _), (_, opener) = sealer_opener(s, server=True, alloc=pool, segments=True), \
        sealer_opener(s, server=False, alloc=pool)
    for _ in range(3):
        opener.open(sealer.seal([b"h", np.zeros(2000, np.float32), np.zeros(100, np.uint8)]))
    assert pool.allocated == 2 and sorted(pool.lists) == [8000, 8000 + TAG_BYTES]  # the 8 KB frames only


def test_the_daemons_sealed_path_opens_refuses_and_falls_back(tmp_path, cipher):
    """Real sockets: a DEALER whose routing id is a session's token. What opens comes out as the
    CURVE connection's message; an unknown token, a replay and a tampered message are refused and
    counted (a message of a session that ended is counted apart, late); the first message that
    opens binds the data connection (the path then sends sealed); once that connection is gone a
    send reports None (the transport sends over CURVE)."""
    ctx = zmq.Context()
    path = SealedPath(ctx, f"ipc://{tmp_path}/seal.sock", SECRET, 1 << 20, 64, clock=lambda: 0.0, ciphers=(cipher,))
    try:
        rid = b"curve-rid"
        session = Session.unpack(bytes.fromhex(path.offer(rid, "keyfp", False, (AEGIS,))[0]))
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
        # a message of the ended session read after its end (sent before the worker's new hello,
        # on the other connection): counted late, not refused; a token of no session still refused
        sealed = w_seal.seal(encode(Heartbeat(boot=11)))
        late = [zmq.Frame(session.token), *(zmq.Frame(bytes(memoryview(f))) for f in sealed)]
        assert list(path.opened(iter([late]))) == [] and path.stale == 1 and path.refused == 3
        assert list(path.opened(iter([[zmq.Frame(make_token(SECRET)), *late[1:]]]))) == [] and path.refused == 4
        assert path.figures()["sealed_stale"] == 1 and path.figures()["sealed_refused"] == 4
        stranger.close()
    finally:
        path.close()
        ctx.destroy(linger=0)


# --------------------------------------------------------------------------- segments

MiB = 1 << 20


@pytest.fixture(params=[1, 3], ids=["one-thread", "three-threads"])
def threads(request):
    """Seal and open on the caller alone, and spread over helper threads (the parallel path)."""
    set_cipher_threads(request.param)
    yield request.param
    set_cipher_threads(None)


def seg_pair():
    s = Session.new(make_token(SECRET))
    return sealer_opener(s, server=True, segments=True), sealer_opener(s, server=False, segments=True)


def plain(frames: list) -> list:
    return [bytes(memoryview(f).cast("B")) for f in frames]


def test_frames_sealed_in_segments_open_to_the_same_bytes_on_any_number_of_threads(threads, cipher):
    (s_seal, _), (_, w_open) = seg_pair()
    rng = np.random.default_rng(0)
    sizes = [0, 1, MiB - 1, MiB, MiB + 1, 3 * MiB + 5, 17]
    frames = [b"header", *(rng.integers(0, 256, n, dtype=np.uint8) for n in sizes)]
    sealed = s_seal.seal(frames)
    # AES-GCM: 1 MiB segments. AEGIS (opened in place) below its threshold for threads (5 MiB < 8 MiB):
    # one segment per frame, of the power of two that holds the largest (3 MiB + 5: 2^22)
    log2 = 22 if cipher == AEGIS else SEGMENT_LOG2
    segs = [max(1, -(-memoryview(f).cast("B").nbytes // (1 << log2))) for f in frames]
    assert len(sealed[0]) == 11 and sealed[0][10] == log2 and SEGMENT_LOG2 == 20  # prefix: counter, count, log2
    assert [memoryview(f).nbytes for f in sealed[1:]] == [
        memoryview(f).cast("B").nbytes + m * TAG_BYTES for f, m in zip(frames, segs, strict=True)]
    assert s_seal.counter == sum(segs) == (1 + 1 + 1 + 1 + 1 + 2 + 4 + 1 if cipher == GCM else 8)  # a nonce a segment
    opened = w_open.open(sealed)
    assert [f.tobytes() for f in opened] == plain(frames)
    assert w_open.next == s_seal.counter and w_open.segmented == 1
    assert w_open.opened_bytes == sum(map(len, plain(frames)))
    job = decode(w_open.open(s_seal.seal(job_frames(2_000_000))))  # an 8 MB job: decodes as ever
    assert np.array_equal(job.points[0], np.arange(2_000_000, dtype=np.float32))


def test_threads_seal_exactly_the_bytes_one_thread_seals(monkeypatch):
    """The helper threads only share the work out: the same key and counter give the same bytes,
    and what threads sealed, threads open (10 MB: past either cipher's threshold for threads, so
    they do share it; AEGIS then calls the library through the twin that lets go of the GIL)."""
    s = Session.new(make_token(SECRET))
    frames = [b"h", np.random.default_rng(1).random(2_500_000).astype(np.float32)]
    spread, real = [], seal_mod._pool
    monkeypatch.setattr(seal_mod, "_pool", lambda: spread.append(1) or real())
    released = []
    if HAVE_AEGIS:
        for name in ("encrypt_into_released", "decrypt_into_released"):
            twin = getattr(seal_mod._Aegis256X4, name)
            monkeypatch.setattr(seal_mod._Aegis256X4, name,
                                lambda self, *a, _t=twin, _n=name: released.append(_n) or _t(self, *a))
    out = []
    for n in (1, 3):
        set_cipher_threads(n)
        try:
            assert cipher_threads() == n
            (seal, _), (_, w_open) = sealer_opener(s, server=True, segments=True), sealer_opener(s, server=False)
            sealed = seal.seal(frames)
            out.append(plain(sealed))
            assert plain(w_open.open(sealed)) == plain(frames)
        finally:
            set_cipher_threads(None)
    assert out[0] == out[1] and len(spread) >= 4  # the pool was asked for each seal and open
    if seal.cipher == AEGIS:  # 11 segments each way (the header, 10 of 1 MiB), shared through the GIL-free twins
        assert released.count("encrypt_into_released") == released.count("decrypt_into_released") == 11
    else:
        assert not released


def test_a_worker_that_did_not_say_segments_gets_whole_frames_and_an_opener_takes_both(cipher):
    s = Session.new(make_token(SECRET))
    whole, _ = sealer_opener(s, server=True)
    parted, _ = sealer_opener(s, server=True, segments=True)
    _, w_open = sealer_opener(s, server=False)
    frames = [b"h", np.zeros(3 * MiB, np.uint8)]
    a = whole.seal(frames)
    assert len(a[0]) == 10 and memoryview(a[2]).nbytes == 3 * MiB + TAG_BYTES  # one tag: the first format
    assert plain(w_open.open(a)) == plain(frames) and w_open.next == 2 and w_open.segmented == 0
    parted.counter = whole.counter  # one session's sender changing format: the counter goes on
    b = parted.seal(frames)
    segments = 3 if cipher == GCM else 1  # AEGIS: a segment per frame below its threads' threshold
    assert plain(w_open.open(b)) == plain(frames) and w_open.next == 2 + 1 + segments and w_open.segmented == 1


def _segments_of(frame) -> list[bytes]:
    raw = bytes(memoryview(frame).cast("B"))
    step = MiB + TAG_BYTES
    return [raw[i:i + step] for i in range(0, len(raw), step)]


@pytest.mark.parametrize("attack", ["segment moved to the next frame", "last segment cut", "segments swapped",
                                    "segment size changed", "a byte of a middle segment", "tag shortened"])
def test_a_segment_moved_cut_swapped_or_changed_refuses_the_whole_message(attack, threads, monkeypatch):
    # 1 MiB segments under either cipher (AEGIS cuts a message this small a segment per frame)
    monkeypatch.setattr(seal_mod.Sealer, "_segment_log2", lambda self, sizes, total: SEGMENT_LOG2)
    (s_seal, _), (_, w_open) = seg_pair()
    frames = [b"h", np.full(3 * MiB, 7, np.uint8), np.full(2 * MiB, 9, np.uint8)]
    sealed = [bytes(memoryview(f).cast("B")) for f in s_seal.seal(frames)]
    one, two = _segments_of(sealed[2]), _segments_of(sealed[3])
    prefix = sealed[0]
    if attack == "segment moved to the next frame":  # same nonces in the same order, boundaries moved
        bad = [prefix, sealed[1], b"".join(one[:-1]), b"".join([one[-1], *two])]
    elif attack == "last segment cut":
        bad = [prefix, sealed[1], sealed[2], two[0]]
    elif attack == "segments swapped":
        bad = [prefix, sealed[1], b"".join([one[1], one[0], one[2]]), sealed[3]]
    elif attack == "segment size changed":  # the same ciphertext read as 2^19-byte segments
        bad = [prefix[:10] + bytes([19]), *sealed[1:]]
    elif attack == "a byte of a middle segment":
        mid = bytearray(one[1])
        mid[12345] ^= 0x80
        bad = [prefix, sealed[1], b"".join([one[0], bytes(mid), one[2]]), sealed[3]]
    else:
        bad = [prefix, sealed[1], sealed[2][:-TAG_BYTES] + sealed[2][-TAG_BYTES:-8], sealed[3]]
    before = (w_open.next, w_open.opened_bytes, w_open.segmented)
    with pytest.raises(SealError):
        w_open.open(bad)
    assert (w_open.next, w_open.opened_bytes, w_open.segmented) == before
    assert plain(w_open.open(sealed)) == plain(frames)  # the original still opens


@pytest.mark.parametrize("prefix, error", [
    ((2**64 - 1).to_bytes(8, "big") + (2).to_bytes(2, "big"), "past the last nonce"),
    ((2**64 - 1).to_bytes(8, "big") + (2).to_bytes(2, "big") + bytes([20]), "past the last nonce"),
    (bytes(8) + (2).to_bytes(2, "big") + bytes([15]), "segments of 2\\^15"),
    (bytes(8) + (2).to_bytes(2, "big") + bytes([25]), "segments of 2\\^25"),
    (bytes(9), "prefix has 10 or 11 bytes"),
])
def test_a_hostile_prefix_is_a_seal_error_not_a_crash(prefix, error):
    """An authenticated peer may still send anything: a counter at the end of the nonce space (the
    nonce would not fit its 8 bytes) or a segment size out of range is refused as a SealError,
    which the daemon counts and drops, never another exception."""
    _, (_, w_open) = seg_pair()
    with pytest.raises(SealError, match=error):
        w_open.open([prefix, bytes(40), bytes(40)])
    with pytest.raises(SealError, match="shorter than its tag"):
        w_open.open([bytes(8) + (1).to_bytes(2, "big") + bytes([16]), bytes((1 << 16) + TAG_BYTES + 5)])
    assert w_open.next == 0 and w_open.opened_bytes == 0


def test_a_small_message_takes_the_one_segment_path_with_the_very_bytes_and_refusals_of_the_other(monkeypatch):
    """A message every frame of which is one segment and that no thread shares (every job and
    reply below 2 MiB; under AEGIS below 8 MiB) is sealed and opened by one cipher call a frame
    (Sealer._seal_each, Opener._open_each): the same bytes as the segment-by-segment path, which
    a sealer or opener whose threshold for threads is 0 takes, and the same refusals."""
    s = Session.new(make_token(SECRET))
    frames = [b"header", np.arange(1000, dtype=np.float32), b"", np.zeros(3, np.uint8)]
    (short, _), (_, short_open) = sealer_opener(s, server=True, segments=True), sealer_opener(s, server=False)
    (general, _), (_, general_open) = sealer_opener(s, server=True, segments=True), sealer_opener(s, server=False)
    general.parallel_min = general_open.parallel_min = 0
    calls = []
    for cls, name in ((seal_mod.Sealer, "_seal_each"), (seal_mod.Opener, "_open_each")):
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, _r=real, _n=name: calls.append(_n) or _r(self, *a))
    a, b = plain(short.seal(frames)), plain(general.seal(frames))
    assert a == b and short.counter == general.counter == 4 and a[0][10] == SEGMENT_LOG2
    assert calls == ["_seal_each"]  # the general sealer did not take the short path
    assert plain(short_open.open(a)) == plain(frames) and calls[-1] == "_open_each"
    assert plain(general_open.open(b)) == plain(frames) and calls.count("_open_each") == 1
    assert (short_open.next, short_open.opened_bytes) == (general_open.next, general_open.opened_bytes) == (4, 4009)
    for i in range(1, 5):  # a flipped bit in any frame (the tag of the empty one) refuses the message whole
        bad = [bytearray(f) for f in short.seal(frames)]
        bad[i][0] ^= 1
        before = (short_open.next, short_open.opened_bytes)
        with pytest.raises(SealError, match="does not authenticate"):
            short_open.open([bytes(f) for f in bad])
        assert (short_open.next, short_open.opened_bytes) == before
    cut = [bytes(f) for f in short.seal(frames)]
    with pytest.raises(SealError, match="frame 2 of a sealed message: a segment shorter than its tag"):
        short_open.open([*cut[:3], cut[3][:TAG_BYTES - 1], cut[4]])
    assert plain(short_open.open(cut)) == plain(frames)  # the original still opens


def test_hello_and_welcome_say_segments_and_leave_the_field_out_at_its_default():
    from protocol.messages import Hello

    for msg in (Hello("w", 1, 1, seal=True, seal_segments=True), Welcome(1, 1, "quadratic", seal_segments=True)):
        assert decode(encode(msg)).seal_segments is True
    assert b"seal_segments" not in bytes(encode(Hello("w", 1, 1, seal=True))[0])


def test_the_daemons_sealed_path_seals_in_segments_only_for_a_worker_that_said_so(tmp_path, cipher):
    ctx = zmq.Context()
    path = SealedPath(ctx, f"ipc://{tmp_path}/seal.sock", SECRET, 16 << 20, 64, clock=lambda: 0.0,
                      ciphers=(cipher,))
    try:
        for rid, segments in ((b"old", False), (b"new", True)):
            session = Session.unpack(bytes.fromhex(path.offer(rid, "k", segments, (AEGIS,))[0]))
            assert path.by_rid[rid].sealer.segments is segments
            w_seal, _ = sealer_opener(session, server=False, segments=segments)
            msg = path._open([zmq.Frame(session.token), *(zmq.Frame(memoryview(f)) for f in
                                                          w_seal.seal([b"h", np.zeros(3 * MiB, np.uint8)]))], True)
            assert msg is not None and msg[0] == rid and msg[2].nbytes == 3 * MiB
        f = path.figures()
        assert f["sealed_sessions_in_segments"] == 1 and f["sealed_segmented_live_in"] == 1
        assert path.sock.getsockopt(zmq.MAXMSGSIZE) >= (16 << 20) + 16 * 256  # tags of 64 KiB segments fit
    finally:
        path.close()
        ctx.destroy(linger=0)


# --------------------------------------------------------------------------- the cipher


def test_aegis_gives_the_drafts_test_vectors_and_a_library_that_does_not_is_not_used(monkeypatch, cipher):
    """AEGIS-256X4 is offered only if the library gives draft-irtf-cfrg-aegis-aead's test vectors."""
    if cipher != AEGIS:
        pytest.skip("about AEGIS")
    assert seal_mod._aegis_passes()
    real = seal_mod._lib

    class Off:  # a library whose ciphertext is one bit off
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def aegis256x4_encrypt_detached(c, mac, maclen, m, mlen, ad, adlen, npub, k):
            r = real.aegis256x4_encrypt_detached(c, mac, maclen, m, mlen, ad, adlen, npub, k)
            tag = seal_mod._ffi.cast("uint8_t *", mac)
            tag[0] ^= 1
            return r

    monkeypatch.setattr(seal_mod, "_lib", Off())
    assert not seal_mod._aegis_passes()


def test_the_two_ciphers_seal_the_same_frames_differently_and_neither_opens_the_other(cipher):
    if not HAVE_AEGIS:
        pytest.skip("needs AEGIS-256X4")
    s = Session.new(make_token(SECRET))
    frames = job_frames()
    gcm, _ = _sealer_opener(s, server=True, cipher=GCM)
    aegis, _ = _sealer_opener(s, server=True, cipher=AEGIS)
    _, w_gcm = _sealer_opener(s, server=False, cipher=GCM)
    _, w_aegis = _sealer_opener(s, server=False, cipher=AEGIS)
    a, b = gcm.seal(frames), aegis.seal(frames)
    assert bytes(memoryview(a[2]))[:64] != bytes(memoryview(b[2]))[:64]
    with pytest.raises(SealError):
        w_aegis.open(a)
    with pytest.raises(SealError):
        w_gcm.open(b)
    assert plain(w_gcm.open(a)) == plain(w_aegis.open(b)) == plain(frames)


def test_the_server_takes_the_first_of_its_ciphers_the_worker_can_use(monkeypatch, cipher):
    assert choose_cipher((), (AEGIS, GCM)) == GCM  # a worker of an earlier revision: AES-256-GCM
    assert choose_cipher(("aegis256x4", "future-cipher"), (AEGIS, GCM)) == AEGIS
    assert choose_cipher(("future-cipher",), (AEGIS, GCM)) == GCM  # names it does not know are ignored
    assert choose_cipher(("aegis256x4",), (GCM,)) == GCM  # serve --seal-cipher aes256gcm
    assert choose_cipher((), (AEGIS,)) is None  # serve --seal-cipher aegis256x4, a worker without it
    # auto (both allowed) for a run whose arrays are small: AES-GCM, whose calls cost less per frame
    assert choose_cipher((AEGIS,), (AEGIS, GCM), seal_mod.AEGIS_MIN_BYTES - 1) == GCM
    assert choose_cipher((AEGIS,), (AEGIS, GCM), seal_mod.AEGIS_MIN_BYTES) == AEGIS
    assert choose_cipher((AEGIS,), (AEGIS,), 4_000) == AEGIS  # asked for by name: AEGIS whatever the size
    monkeypatch.setenv("LATECOMER_SEAL_CIPHERS", "aes256gcm")
    assert available_ciphers() == (GCM,)
    monkeypatch.setenv("LATECOMER_SEAL_CIPHERS", "aes256gcm,rot13")
    with pytest.raises(ValueError, match="unknown cipher 'rot13'"):
        available_ciphers()


def test_hello_and_welcome_carry_the_cipher_and_leave_it_out_at_its_default(cipher):
    from protocol.messages import SEAL_CIPHERS, Hello

    assert set(SEAL_CIPHERS) == {GCM, AEGIS}
    h = decode(encode(Hello("w", 1, 1, seal=True, seal_ciphers=("aegis256x4", "later-one"))))
    assert h.seal_ciphers == ("aegis256x4", "later-one")
    assert decode(encode(Welcome(1, 1, "quadratic", seal_cipher="aegis256x4"))).seal_cipher == "aegis256x4"
    assert b"seal_ciphers" not in bytes(encode(Hello("w", 1, 1, seal=True))[0])
    assert b"seal_cipher" not in bytes(encode(Welcome(1, 1, "quadratic"))[0])
    with pytest.raises(RemoteProtocolError, match="seal_cipher"):  # a welcome naming a cipher nobody has
        decode([bytes(encode(Welcome(1, 1, "quadratic", seal_cipher="aegis256x4"))[0]).replace(
            b"aegis256x4", b"aegis999x4")])


def test_the_daemons_sealed_path_offers_each_worker_the_cipher_it_can_use(tmp_path, cipher):
    if not HAVE_AEGIS:
        pytest.skip("needs AEGIS-256X4")
    ctx = zmq.Context()
    path = SealedPath(ctx, f"ipc://{tmp_path}/seal.sock", SECRET, 16 << 20, 64, clock=lambda: 0.0,
                      ciphers=(AEGIS, GCM))
    try:
        for rid, offered, want in ((b"old", (), GCM), (b"new", (AEGIS,), AEGIS)):
            hexed, got = path.offer(rid, "k", True, offered)
            assert got == want and path.by_rid[rid].opener.cipher == want
            w_seal, _ = _sealer_opener(Session.unpack(bytes.fromhex(hexed)), server=False, segments=True, cipher=got)
            msg = path._open([zmq.Frame(path.by_rid[rid].token), *(zmq.Frame(memoryview(f)) for f in
                                                                   w_seal.seal([b"h", np.ones(MiB, np.uint8)]))], True)
            assert msg is not None and msg[0] == rid and np.all(np.asarray(msg[2]) == 1)
        f = path.figures()
        assert f["sealed_offered_aegis256x4"] == 1 and f["sealed_offered_aes256gcm"] == 1
        assert f["sealed_sessions_aegis256x4"] == 1 and f["sealed_refused"] == 0
    finally:
        path.close()
        ctx.destroy(linger=0)


def test_aegis_opens_a_frame_of_its_own_where_it_lies_and_nothing_else(cipher):
    """Opener.in_place (the daemon's handed connections, the worker's data connection): a
    one-segment frame in a writable uint8 array of the caller's is opened over itself (AEGIS),
    its plaintext a view of it; bytes, read-only buffers, frames of several segments and AES-GCM
    (which refuses overlap) go into a buffer of their own. Under AEGIS a message below the threads'
    threshold is sealed a segment per frame, so a 3 MiB frame opens in place too; past it (9 MiB)
    it comes in 1 MiB segments. A frame that does not authenticate is refused as ever, and the
    opener is left as it was."""
    s = Session.new(make_token(SECRET))
    seal, _ = sealer_opener(s, server=True, segments=True)
    _, w_open = sealer_opener(s, server=False)
    w_open.in_place = True
    x = np.random.default_rng(3).random(100_000).astype(np.float32)
    big = np.zeros(3 * MiB, np.uint8)

    def own(frames):  # as a connection's reader hands them over: large frames in arrays of its own
        views = [memoryview(f).cast("B") for f in frames]
        return [bytes(v) if v.nbytes < 1024 else np.array(v, np.uint8) for v in views]

    sealed = own(seal.seal([b"header", x, big]))
    opened = w_open.open(sealed)
    assert plain(opened) == plain([b"header", x, big])
    shared = [np.shares_memory(o, f) for o, f in zip(opened, sealed[1:], strict=True)]
    assert shared == [False, cipher == AEGIS, cipher == AEGIS]  # bytes; one segment; AES-GCM: three segments
    assert w_open.opened_in_place == (2 if cipher == AEGIS else 0)
    huge = np.arange(9 * MiB, dtype=np.uint8)
    sealed = own(seal.seal([b"h", huge]))
    assert len(sealed[2]) == huge.nbytes + 9 * TAG_BYTES  # 1 MiB segments (shared by the threads)
    opened = w_open.open(sealed)
    assert np.array_equal(opened[1], huge) and not np.shares_memory(opened[1], sealed[2])
    assert w_open.opened_in_place == (2 if cipher == AEGIS else 0)
    ro = own(seal.seal([b"h", x]))
    ro[2].setflags(write=False)
    assert not np.shares_memory(w_open.open(ro)[1], ro[2])
    bad = own(seal.seal([b"h", x]))
    bad[2][5] ^= 1
    before = (w_open.next, w_open.opened_bytes)
    with pytest.raises(SealError):
        w_open.open(bad)
    assert (w_open.next, w_open.opened_bytes) == before


def test_aegis_keeps_the_gil_for_a_message_it_seals_on_one_thread(monkeypatch, cipher):
    """Below the threads' threshold AEGIS is called through the GIL-holding calls only (letting go
    of the GIL for microseconds hands it to any runnable thread for up to the switch interval)."""
    if cipher != AEGIS:
        pytest.skip("about AEGIS")

    class NoCffi:
        def __getattr__(self, name):
            raise AssertionError(f"cffi's {name} called for a message sealed on one thread")

    monkeypatch.setattr(seal_mod, "_lib", NoCffi())
    s = Session.new(make_token(SECRET))
    (seal, _), (_, w_open) = sealer_opener(s, server=True, segments=True), sealer_opener(s, server=False)
    frames = [b"header", np.ones(3 * MiB, np.uint8)]
    assert plain(w_open.open(seal.seal(frames))) == plain(frames)


def test_a_process_whose_aegis_library_misses_the_test_vectors_seals_with_aes_gcm_only(cipher):
    """The gate at import (protocol/seal.py): a libaegis whose output is one bit off is not used,
    in a fresh interpreter where that library is the one ``pyaegis`` gives."""
    import subprocess
    import sys

    if cipher != AEGIS:
        pytest.skip("about AEGIS")
    code = """
import sys, types
import pyaegis._aegis_ffi as real
class Lib:
    def __getattr__(self, name):
        return getattr(real.lib, name)
    @staticmethod
    def aegis256x4_encrypt_detached(c, mac, maclen, *rest):
        rc = real.lib.aegis256x4_encrypt_detached(c, mac, maclen, *rest)
        real.ffi.cast("uint8_t *", mac)[0] ^= 1
        return rc
fake = types.ModuleType("pyaegis._aegis_ffi")
fake.ffi, fake.lib, fake.__file__ = real.ffi, Lib(), real.__file__
sys.modules["pyaegis._aegis_ffi"] = fake
import protocol.seal as s
print(",".join(s.available_ciphers()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == GCM
