"""Large AEGIS frames sealed as they are written and opened as they arrive (protocol/seal.py
``Streamed`` and ``Opener.early``, protocol/zmtp.py ``send_streamed`` and ``Connection.progress``):
the same bytes on the wire as the one-call seal, the same plaintext, the same refusals."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from protocol import zmtp
from protocol.seal import (
    AEGIS,
    DOWN,
    STREAM_MIN,
    BufferPool,
    Opener,
    Sealer,
    SealError,
    Streamed,
    available_ciphers,
)

if AEGIS not in available_ciphers():
    if os.environ.get("LATECOMER_REQUIRE_AEGIS") == "1":  # CI: make setup built pyaegis
        raise RuntimeError("LATECOMER_REQUIRE_AEGIS=1 but AEGIS-256X4 is not available (pyaegis)")
    pytest.skip("AEGIS-256X4 is not available here (pyaegis)", allow_module_level=True)

KEY = bytes(range(32))
LIMITS = zmtp.ZmtpLimits(max_frame_bytes=1 << 30, max_message_bytes=1 << 30, max_frames=64)


def _frames(rng: np.random.Generator, sizes: tuple[int, ...]) -> list:
    return [b"header-frame"] + [rng.standard_normal(n // 4).astype(np.float32) for n in sizes]


def _pair(segments: bool = True) -> tuple[Sealer, Opener]:
    opener = Opener(KEY, DOWN, alloc=BufferPool(), cipher=AEGIS)
    opener.in_place = True
    return Sealer(KEY, DOWN, BufferPool(), segments=segments, cipher=AEGIS), opener


class _Socket:
    """A non-blocking socket's ``sendmsg`` that takes a random share of what it is offered (now
    and then nothing: EAGAIN), recording the bytes and how many of a lazy body were made when."""

    def __init__(self, rng: random.Random, block_after: int | None = None) -> None:
        self.rng, self.wire, self.calls, self.block_after = rng, bytearray(), 0, block_after

    def sendmsg(self, bufs: list) -> int:
        self.calls += 1
        if self.block_after is not None and self.calls > self.block_after:
            raise BlockingIOError(11, "EAGAIN")
        data = b"".join(bytes(b) for b in bufs)
        n = len(data) if self.rng.random() < 0.7 else self.rng.randrange(0, len(data) + 1)
        self.wire += data[:n]
        return n


def _wire(frames: list) -> bytes:
    return b"".join(bytes(b) for b in zmtp.finish_all(zmtp.frames_out(frames)))


def _read(opener: Opener, wire: bytes, rng: random.Random) -> list:
    """``wire`` (a greeting, READY, then messages) through a Connection whose progress opens early,
    in reads of random sizes: the messages it makes whole."""
    conn = zmtp.Connection(LIMITS, alloc=lambda n: np.empty(n, np.uint8), idle_read=zmtp.IDLE_READ)
    conn.progress = opener.early
    data = zmtp.greeting(True) + zmtp.ready(b"ROUTER") + wire
    at, msgs = 0, []
    while at < len(data):
        buf = conn.buffer()
        k = min(len(buf), len(data) - at, rng.choice((1, 100, 70_000, 300_000, 1 << 22)))
        buf[:k] = data[at:at + k]
        del buf
        msgs += conn.advance(k)
        at += k
    return msgs


@pytest.mark.parametrize("sizes", [(STREAM_MIN + 4096,), (4_000_000,), (400_000, 4_000_000), (64, 1_200_000)])
@pytest.mark.parametrize("segments", [True, False])
def test_a_streamed_frame_goes_out_as_the_same_bytes_whatever_the_socket_takes(sizes, segments):
    rng = np.random.default_rng(1)
    frames = _frames(rng, sizes)
    whole, _ = _pair(segments)
    expected = _wire(whole.seal(frames))
    for seed in range(6):
        streaming, _ = _pair(segments)
        sealed = streaming.seal(frames, streamed=True)
        assert streaming.lazy == sum(n >= STREAM_MIN for n in sizes)
        assert all(isinstance(f, Streamed) == (f is not sealed[0] and len(f) - 16 >= STREAM_MIN) for f in sealed[1:])
        sock = _Socket(random.Random(seed), block_after=None if seed % 2 else 3)
        bufs = zmtp.frames_out(sealed)
        n = zmtp.send_streamed(sock.sendmsg, bufs)
        assert not any(isinstance(b, zmtp.LazyBody) for b in bufs)  # made whole on return, whatever was sent
        assert bytes(sock.wire) == expected[:n]
        assert b"".join(bytes(b) for b in bufs) == expected  # what the caller would queue: the rest, intact
        assert streaming.counter == whole.counter


def test_a_streamed_frame_is_sealed_a_chunk_at_a_time_as_the_socket_takes_it():
    """The point of it: the bytes sent before the last sendmsg are what had been sealed then, in
    several writes (the peer reads and opens one chunk while the next is sealed)."""
    frames = _frames(np.random.default_rng(2), (4_000_000,))
    sealer, _ = _pair()
    sealed = sealer.seal(frames, streamed=True)
    body = sealed[2]
    seen = []

    def sendmsg(bufs: list) -> int:
        seen.append(body.ready)
        return sum(memoryview(b).nbytes for b in bufs)

    zmtp.send_streamed(sendmsg, zmtp.frames_out(sealed))
    assert len(seen) >= 8 and seen[0] < len(body) // 4
    assert seen == sorted(seen) and seen[-1] == len(body)


@pytest.mark.parametrize("sizes", [(4_000_000,), (300_000, 4_000_000, 1_500_000), (64, 1_200_000)])
def test_frames_opened_as_they_arrive_give_the_plaintext_and_count_as_early(sizes):
    rng = np.random.default_rng(3)
    frames = _frames(rng, sizes)
    sealer, opener = _pair()
    wire = b"".join(_wire(sealer.seal(frames, streamed=True)) for _ in range(3))
    msgs = _read(opener, wire, random.Random(4))
    assert len(msgs) == 3
    for m in msgs:
        out = opener.open(m)
        assert bytes(out[0]) == frames[0]
        for got, want in zip(out[1:], frames[1:], strict=True):
            assert np.array_equal(np.frombuffer(got, np.float32), want)
    big = sum(n >= STREAM_MIN for n in sizes)
    assert opener.opened_early == 3 * big and not opener.verdicts and opener.current is None


@pytest.mark.parametrize("where", ["start", "middle", "tag"])
def test_a_changed_byte_in_a_frame_opened_early_refuses_the_message_and_leaves_no_plaintext(where):
    frames = _frames(np.random.default_rng(5), (1_200_000,))
    sealer, opener = _pair()
    wire = bytearray(_wire(sealer.seal(frames)))
    at = {"start": 100, "middle": len(wire) // 2, "tag": len(wire) - 3}[where]
    wire[at] ^= 0x40
    (msg,) = _read(opener, bytes(wire), random.Random(6))
    (verdict,) = opener.verdicts.values()  # opened as it came, its tag found wanting then
    assert verdict.ok is False
    with pytest.raises(SealError):
        opener.open(msg)
    assert opener.next == 0 and opener.opened_early == 0 and not opener.verdicts
    assert not np.any(msg[2][:1_200_000])  # zeroed, not left opened to what the forger chose
    good = _wire(sealer.seal(frames))  # the next genuine message still opens
    (msg,) = _read(opener, good, random.Random(7))
    assert np.array_equal(np.frombuffer(opener.open(msg)[1], np.float32), frames[1])


def test_a_replay_of_a_frame_opened_early_is_refused_and_a_cut_message_leaves_nothing_behind():
    frames = _frames(np.random.default_rng(8), (1_500_000,))
    sealer, opener = _pair()
    wire = _wire(sealer.seal(frames))
    (msg,) = _read(opener, wire, random.Random(9))
    opener.open(msg)
    (again,) = _read(opener, wire, random.Random(10))  # counter already taken: not opened early at all
    with pytest.raises(SealError, match="a repeat"):
        opener.open(again)
    assert not opener.verdicts
    # a message cut in its large frame (the connection dropped): the next message opens
    conn = zmtp.Connection(LIMITS, alloc=lambda n: np.empty(n, np.uint8), idle_read=zmtp.IDLE_READ)
    conn.progress = opener.early
    data = zmtp.greeting(True) + zmtp.ready(b"ROUTER") + _wire(sealer.seal(frames))[:400_000]
    at = 0
    while at < len(data):
        buf = conn.buffer()
        k = min(len(buf), len(data) - at)
        buf[:k] = data[at:at + k]
        del buf
        assert not conn.advance(k)
        at += k
    assert opener.current is not None and 0 < opener.current.done < 400_000
    (msg,) = _read(opener, _wire(sealer.seal(frames)), random.Random(11))
    assert np.array_equal(np.frombuffer(opener.open(msg)[1], np.float32), frames[1])
    assert opener.opened_early == 2 and not opener.verdicts


def test_the_nonce_of_a_frame_after_a_frame_of_several_segments_is_counted_from_its_segments():
    """A peer may cut one frame in segments and send the next whole: the early open must take the
    nonce after the first frame's segments (1 MiB segments: a 3 MB frame is 3 of them), and the
    receiver's path for messages of several segments takes its verdict."""
    frames = _frames(np.random.default_rng(12), (3_000_000, 1 << 20))
    sealer, opener = _pair()
    sealer.parallel_min = 0  # every message in 1 MiB segments
    sealed = sealer.seal(frames)
    assert len(sealed[2]) == 3_000_000 + 3 * 16 and len(sealed[3]) == (1 << 20) + 16
    (msg,) = _read(opener, _wire(sealed), random.Random(13))
    out = opener.open(msg)
    assert np.array_equal(np.frombuffer(out[1], np.float32), frames[1])
    assert np.array_equal(np.frombuffer(out[2], np.float32), frames[2])
    assert opener.opened_early == 1  # the 1 MiB frame, one segment


def test_a_socket_that_blocks_at_once_still_leaves_the_whole_sealed_message_to_queue():
    frames = _frames(np.random.default_rng(14), (2_000_000,))
    whole, _ = _pair()
    expected = _wire(whole.seal(frames))
    streaming, _ = _pair()
    bufs = zmtp.frames_out(streaming.seal(frames, streamed=True))

    def blocked(bufs: list) -> int:
        raise BlockingIOError(11, "EAGAIN")

    assert zmtp.send_streamed(blocked, bufs) == 0
    assert b"".join(bytes(b) for b in bufs) == expected

    def broken(bufs: list) -> int:
        raise ConnectionResetError(104, "reset")

    bufs = zmtp.frames_out(_pair()[0].seal(frames, streamed=True))
    with pytest.raises(ConnectionResetError):
        zmtp.send_streamed(broken, bufs)
    assert not any(isinstance(b, zmtp.LazyBody) for b in bufs)


def test_the_codec_reports_each_read_into_a_large_frame_from_progress_min_and_the_last_with_it_whole():
    calls = []
    conn = zmtp.Connection(LIMITS, alloc=lambda n: np.empty(n, np.uint8), idle_read=zmtp.IDLE_READ)
    conn.progress, conn.progress_min = lambda parts, big, filled, first: calls.append((len(parts), filled, first)), \
        500_000
    data = zmtp.greeting(True) + zmtp.ready(b"ROUTER") + _wire([b"p", bytes(400_000), bytes(600_000)])
    at, msgs = 0, []
    while at < len(data):
        buf = conn.buffer()
        k = min(len(buf), len(data) - at, 150_000)
        buf[:k] = data[at:at + k]
        del buf
        msgs += conn.advance(k)
        at += k
    assert len(msgs) == 1 and [len(f) for f in msgs[0]] == [1, 400_000, 600_000]
    assert all(n == 2 for n, _, _ in calls)  # only the 600 KB frame, after the prefix and the 400 KB one
    assert [first for _, _, first in calls] == [True] + [False] * (len(calls) - 1)
    assert calls[-1][1] == 600_000 and [f for _, f, _ in calls] == sorted(f for _, f, _ in calls)


def test_verdicts_are_bounded_and_a_message_whose_verdict_was_dropped_is_refused_not_misread():
    """Frames opened early whose messages are never taken (a hostile peer, a message cut after its
    large frame) leave at most MAX_EARLY verdicts, none holding its buffer; a message whose verdict
    was dropped cannot be opened again from bytes already opened, so it is refused."""
    import gc

    from protocol.seal import MAX_EARLY

    frames = _frames(np.random.default_rng(15), (1_100_000,))
    sealer, opener = _pair()
    first = _read(opener, _wire(sealer.seal(frames)), random.Random(16))
    held = []
    for k in range(MAX_EARLY + 5):  # messages read, never opened
        held += _read(opener, _wire(sealer.seal(frames)), random.Random(17 + k))
    assert len(opener.verdicts) == MAX_EARLY
    with pytest.raises(SealError):
        opener.open(first[0])  # its verdict was the oldest: dropped, its frame already opened in place
    del held
    gc.collect()
    assert all(e.ref() is None and e.buf is None for e in opener.verdicts.values())  # no buffer kept alive
    (msg,) = _read(opener, _wire(sealer.seal(frames)), random.Random(99))
    assert np.array_equal(np.frombuffer(opener.open(msg)[1], np.float32), frames[1])
