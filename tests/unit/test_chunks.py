"""Large messages in parts: split and reassembly give back the same arrays; bad parts are refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.chunks import Reassembler, chunking, split
from protocol.codec import decode, encode
from protocol.errors import RemoteProtocolError
from protocol.messages import MAX_PARTS, Job, JobKind, Part, Reply


def deliver(messages, reassembler):
    """What a receiver does with the messages ``split`` produced (bytes, as off the wire)."""
    out = None
    for frames in messages:
        wire = [bytes(memoryview(f)) for f in frames]
        msg = decode(wire, payload=reassembler.take)
        if isinstance(msg, Part):
            reassembler.add(msg)
        else:
            out = msg
    return out


def job(*points):
    return Job(job_id=7, kind=JobKind.GRAD_PAIR if len(points) == 2 else JobKind.GRAD, created_at=3,
               iterate_ids=tuple(range(len(points))), seed=11, point_ids=tuple(range(len(points))), points=points)


def test_small_messages_travel_whole():
    msgs = split(job(np.ones(10, np.float32)), xfer=1)
    assert len(msgs) == 1 and len(msgs[0]) == 2


@given(n1=st.integers(1, 5000), n2=st.integers(0, 5000), chunk=st.integers(1, 3000), bf16=st.booleans())
def test_split_then_reassemble_is_the_identity(n1, n2, chunk, bf16):
    rng = np.random.default_rng(n1 * 7919 + n2)
    g1 = rng.standard_normal(n1).astype(np.float32)
    g2 = (rng.integers(0, 2**16, n2).astype(np.uint16) if bf16 else rng.standard_normal(n2).astype(np.float32))
    rep = Reply(job_id=5, created_at=2, grads=(g1, g2), loss=0.5, count=3)
    msgs = split(rep, xfer=42, threshold=0, chunk=chunk * 4)
    parts = msgs[:-1]
    assert 1 <= len(parts) <= MAX_PARTS and len(msgs[-1]) == 1  # parts, then the header alone
    got = deliver(msgs, Reassembler(1 << 30))
    assert got.xfer == 42 and got.loss == 0.5 and len(got.grads) == 2
    assert np.array_equal(got.grads[0], g1) and got.grads[1].dtype == g2.dtype and np.array_equal(got.grads[1], g2)


def test_a_huge_message_never_needs_more_than_max_parts():
    x = np.zeros(3_000_000, np.float32)
    msgs = split(job(x, x), xfer=3, threshold=0, chunk=4096)
    assert len(msgs) - 1 <= MAX_PARTS
    got = deliver(msgs, Reassembler(1 << 30))
    assert [p.shape for p in got.points] == [(3_000_000,), (3_000_000,)]


@given(n=st.integers(1, 200_000), chunk=st.integers(1, 5000), max_parts=st.integers(3, MAX_PARTS), pair=st.booleans())
def test_a_message_takes_at_most_max_parts_and_arrives_whole(n, chunk, max_parts, pair):
    """``max_parts`` (a sender's bound below MAX_PARTS: under CurveZMQ a job in parts stays a
    few messages, within the server's send high-water mark at any credit a worker asks)."""
    x = np.arange(n, dtype=np.float32)
    msgs = split(job(x, x + 1) if pair else job(x), xfer=9, threshold=0, chunk=chunk * 4, max_parts=max_parts)
    assert 1 <= len(msgs) - 1 <= max_parts
    got = deliver(msgs, Reassembler(1 << 30))
    assert np.array_equal(got.points[0], x) and (not pair or np.array_equal(got.points[1], x + 1))


def test_under_curve_parts_are_small_and_few_in_plaintext_large():
    """The sender's choice per connection (PROTOCOL.md §6.13): a 4 MB vector (d = 10^6) goes
    whole in plaintext and in CURVE_MAX_PARTS parts of CURVE_CHUNK_BYTES under CurveZMQ; a
    40 MB one in at most CURVE_MAX_PARTS larger parts."""
    from protocol.messages import CHUNK_THRESHOLD, CURVE_CHUNK_BYTES, CURVE_MAX_PARTS

    plain, curve = chunking(False), chunking(True)
    assert plain.threshold == CHUNK_THRESHOLD and curve.threshold < 4_000_000
    x = np.zeros(1_000_000, np.float32)
    assert len(plain.split(job(x), 1)) == 1
    parts = curve.split(job(x), 1)[:-1]
    assert len(parts) == -(-x.nbytes // CURVE_CHUNK_BYTES) <= CURVE_MAX_PARTS
    big = np.zeros(10_000_000, np.float32)
    assert len(curve.split(job(big), 2)) - 1 <= CURVE_MAX_PARTS


def test_out_of_order_oversized_or_missing_parts_are_refused():
    x = np.arange(1000, dtype=np.float32)
    msgs = split(job(x), xfer=9, threshold=0, chunk=1000)
    decoded = [decode([bytes(memoryview(f)) for f in m], payload=lambda x, n: b"") for m in msgs[:-1]]
    r = Reassembler(1 << 20)
    r.add(decoded[0])
    with pytest.raises(RemoteProtocolError, match="out of order"):
        r.add(decoded[2])
    small = Reassembler(3000)
    with pytest.raises(RemoteProtocolError, match="larger than"):
        for p in decoded:
            small.add(p)
    r = Reassembler(1 << 20)
    for p in decoded[:-1]:
        r.add(p)
    with pytest.raises(RemoteProtocolError, match="incomplete"):
        decode([bytes(f) for f in msgs[-1]], payload=r.take)
    # a new transfer drops an unfinished one
    r = Reassembler(1 << 20)
    r.add(decoded[0])
    again = split(job(x * 2), xfer=10, threshold=0, chunk=1000)
    got = deliver(again, r)
    assert np.array_equal(got.points[0], x * 2) and r.dropped == 1


def test_a_carrier_without_its_parts_or_with_frames_is_invalid():
    x = np.arange(100, dtype=np.float32)
    carrier = split(job(x), xfer=5, threshold=0, chunk=100)[-1]
    with pytest.raises(RemoteProtocolError, match="not accepted"):
        decode([bytes(carrier[0])])
    with pytest.raises(RemoteProtocolError, match="header only"):
        decode([bytes(carrier[0]), x.tobytes()], payload=lambda x, n: b"")
    with pytest.raises(RemoteProtocolError, match="need"):
        decode([bytes(carrier[0])], payload=lambda x, n: b"\0" * (n - 4))


@pytest.mark.parametrize("header", [
    {"xfer": 0, "index": 0, "count": 1},  # xfer 0 is "not in parts"
    {"xfer": 1, "index": 1, "count": 1},
    {"xfer": 1, "index": 0, "count": MAX_PARTS + 1},
])
def test_bad_part_headers(header):
    import msgpack

    h = msgpack.packb({"v": 1, "t": "part", **header})
    with pytest.raises(RemoteProtocolError):
        decode([h, b"abcd"])


def test_a_part_has_exactly_one_nonempty_frame():
    frames = encode(Part(xfer=1, index=0, count=1, data=b"abcd"))
    assert decode(frames).data.tobytes() == b"abcd"
    with pytest.raises(RemoteProtocolError):
        decode([frames[0]])
    with pytest.raises(RemoteProtocolError):
        decode([frames[0], b""])
    with pytest.raises(RemoteProtocolError):
        decode([frames[0], b"ab", b"cd"])
    with pytest.raises(RemoteProtocolError):
        decode(frames, max_array_bytes=3)
