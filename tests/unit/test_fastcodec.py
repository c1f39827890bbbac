"""The codec's fast path (protocol/fastcodec.py) against the reference codec.

The fast path may only accept or decline: whatever it accepts, the reference decoder accepts
too, with the same message; whatever it encodes, the reference encoder encodes to the same
bytes. And it must actually take the valid messages of the training loop (else it is dead
code and the speed is gone).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import fastcodec
from protocol.codec import decode, decode_reference, encode, encode_reference
from protocol.errors import RemoteProtocolError
from protocol.messages import Heartbeat, Job, JobKind, Ready, Reply
from tests.unit.test_codec import (
    FIELD_NAMES,
    I64_MAX,
    U64_MAX,
    assert_same,
    heartbeats,
    jobs,
    msgpack_values,
    readies,
    replies,
)

HOT = {"job": jobs(), "reply": replies(), "hb": heartbeats, "ready": readies}
hot_messages = st.one_of(*HOT.values())
CASES = settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Values at and past the schema's edges, and of the wrong kind, for the fields of the hot types.
edge_ints = st.sampled_from([-2, -1, 0, 1, 2, 3, 255, 256, 257, 100_000, 100_001, 1 << 30, (1 << 30) + 1, I64_MAX,
                             I64_MAX + 1, U64_MAX])
edge_values = (edge_ints | st.booleans() | st.none() | st.sampled_from([0.0, -0.0, 1.5, float("nan"), float("inf")])
               | st.lists(edge_ints, max_size=3) | st.sampled_from(["", "x", "<f4", "f4"])
               | st.lists(st.fixed_dictionaries({"dtype": st.sampled_from(["<f4", "<f8", ">f4", "<i4"]),
                                                 "shape": st.lists(edge_ints, max_size=5)}), max_size=2)
               | msgpack_values)


def same(want: Any, got: Any) -> None:
    """assert_same, with a NaN loss equal to a NaN loss (a worker may report one)."""
    import dataclasses
    import math

    if isinstance(want, Reply) and isinstance(got, Reply) and want.loss is not None and math.isnan(want.loss):
        assert got.loss is not None and math.isnan(got.loss)
        want, got = dataclasses.replace(want, loss=0.0), dataclasses.replace(got, loss=0.0)
    assert_same(want, got)


def frames_of(msg: Any, kind: str) -> list:
    out = []
    for f in encode_reference(msg):
        raw = f.tobytes() if isinstance(f, np.ndarray) else bytes(f)
        out.append(zmq.Frame(raw) if kind == "frame" else raw)
    return out


def outcome(fn: Any, frames: list) -> tuple[str, Any]:
    try:
        return "ok", fn(frames)
    except RemoteProtocolError as e:
        return "err", str(e)


@CASES
@given(msg=hot_messages, kind=st.sampled_from(["bytes", "frame"]))
def test_fast_path_takes_every_valid_hot_message(msg: Any, kind: str) -> None:
    frames = frames_of(msg, kind)
    fast = fastcodec.decode_fast(frames, 1 << 31)
    assert fast is not None, "a valid message fell to the slow path"
    assert_same(decode_reference(frames), fast)
    assert_same(msg, fast)


@CASES
@given(msg=hot_messages)
def test_fast_encoding_is_the_reference_bytes(msg: Any) -> None:
    fast = fastcodec.encode_fast(msg)
    assert fast is not None, "a valid message fell to the slow path"
    ref = encode_reference(msg)
    assert fast[0] == ref[0]
    assert len(fast) == len(ref) and all(a is b for a, b in zip(fast[1:], ref[1:], strict=True))


@CASES
@given(msg=hot_messages, data=st.data())
def test_mutated_headers_decode_as_the_reference_decides(msg: Any, data: st.DataObject) -> None:
    """A valid header with keys set to edge values, wrong kinds or garbage, or dropped: the
    fast path declines or returns the reference's message; decode's outcome is the reference's."""
    frames = frames_of(msg, "bytes")
    header = msgpack.unpackb(frames[0], raw=False)
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(sorted(header)) | st.sampled_from(FIELD_NAMES))
        if data.draw(st.booleans()) and key in header:
            del header[key]
        else:
            header[key] = data.draw(edge_values)
    frames[0] = msgpack.packb(header, use_bin_type=True)
    ref = outcome(decode_reference, frames)
    fast = fastcodec.decode_fast(frames, 1 << 31)
    if fast is not None:
        assert ref[0] == "ok", f"the fast path accepted what the reference refuses: {ref[1]}"
        assert_same(ref[1], fast)
    got = outcome(decode, frames)
    assert got[0] == ref[0]
    if got[0] == "ok":
        assert_same(ref[1], got[1])
    else:
        assert got[1] == ref[1]


@CASES
@given(msg=hot_messages, data=st.data())
def test_mutated_encodings_are_refused_as_the_reference_refuses(msg: Any, data: st.DataObject) -> None:
    """Fields of a message object set to edge values: encode raises iff the reference does,
    and what it encodes is the reference's bytes."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(msg) if f.name not in ("points", "grads")]
    changes = {n: data.draw(edge_values.map(lambda v: tuple(v) if isinstance(v, list) else v))
               for n in data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True))}
    bad = dataclasses.replace(msg, **changes)
    try:
        ref = ("ok", encode_reference(bad)[0])
    except Exception as e:  # noqa: BLE001  (the reference's verdict, whatever it is)
        ref = ("err", type(e))
    fast = fastcodec.encode_fast(bad)
    if fast is not None:
        assert ref == ("ok", fast[0])
    try:
        got = ("ok", encode(bad)[0])
    except Exception as e:  # noqa: BLE001
        got = ("err", type(e))
    assert got == ref


@CASES
@given(b=st.binary(max_size=64))
def test_arbitrary_header_bytes_never_escape_the_fast_path(b: bytes) -> None:
    fast = fastcodec.decode_fast([b], 1 << 31)
    if fast is not None:
        assert_same(decode_reference([b]), fast)


def test_the_fast_path_declines_what_it_does_not_know() -> None:
    g = np.ones(3, np.float32)
    declined = [
        [msgpack.packb({"v": 1, "t": "hello", "worker_id": "w", "boot": 1, "credit": 1})],  # another type
        [msgpack.packb({"v": 2, "t": "hb", "boot": 1})],  # another version
        [msgpack.packb({"v": 1, "t": "hb", "boot": 1, "extra": 0})],  # an unknown key (the reference ignores it)
        encode_reference(Reply(1, 0, (), xfer=7)),  # arrays in parts
        [encode_reference(Reply(1, 0, (g,)))[0], g[:2].tobytes()],  # a short frame
    ]
    for frames in declined:
        assert fastcodec.decode_fast(frames, 1 << 31) is None
    assert decode(declined[2]) == Heartbeat(boot=1)  # the reference takes it
    with pytest.raises(RemoteProtocolError, match="frame holds 8 bytes"):
        decode(declined[4])


def test_a_job_and_a_reply_with_arrays_round_trip_through_zmq_frames() -> None:
    x = np.arange(5, dtype=np.float32)
    job = Job(3, JobKind.GRAD_PAIR, 2, (2, 1), 99, point_ids=(2, 1), points=(x, x + 1))
    got = decode([zmq.Frame(bytes(f)) for f in encode(job)])
    assert_same(job, got)
    assert fastcodec.decode_fast([bytes(f) for f in encode(job)], 1 << 31) is not None
    assert decode(encode(Ready(2, (1,)))) == Ready(2, (1,))


EDGES = [-2, -1, 0, 1, 2, 3, 255, 256, 257, 100_000, 100_001, 1 << 30, (1 << 30) + 1, I64_MAX, I64_MAX + 1, U64_MAX,
         True, False, None, 0.0, 1.5, -1.5, float("nan"), float("inf"), float("-inf"), "", "x", "<f4", b"", [], [0],
         [1], [5, 3], [3, 5],
         [1, 2, 3], [-1], [0.5], [None], [True], {}, {"dtype": "<f4", "shape": [2]},
         [{"dtype": "<f4", "shape": [2]}], [{"dtype": "<f4", "shape": [-1]}], [{"dtype": ">f4", "shape": [2]}],
         [{"dtype": "<f4", "shape": [2], "x": 1}], [{"dtype": "<f4", "shape": [1, 1, 1, 1, 2]}]]
X2 = np.array([1.0, 2.0], np.float32)
BASES = [Job(4, JobKind.GRAD_PAIR, 3, (3, 2), 7, batch_size=2, shard=(1, 4), deadline=5, point_ids=(3,), points=(X2,)),
         Reply(4, 3, (X2,), loss=0.25, count=2, compute_s=0.5, holds=(3,)), Heartbeat(9, 2, (4,), 4),
         Ready(2, (3,), True)]


@pytest.mark.parametrize("base", BASES, ids=lambda m: type(m).__name__)
def test_every_field_at_every_edge_decodes_as_the_reference_decides(base: Any) -> None:
    """Exhaustive over (field, edge value) for each hot type: what random mutations find rarely."""
    frames = frames_of(base, "bytes")
    header = msgpack.unpackb(frames[0], raw=False)
    import dataclasses

    keys = sorted({f.name for f in dataclasses.fields(base)} | set(header) | {"xfer", "arrays"})
    for key in keys:
        for value in EDGES:
            h = {**header, key: value}
            fr = [msgpack.packb(h, use_bin_type=True), *frames[1:]]
            ref = outcome(decode_reference, fr)
            fast = fastcodec.decode_fast(fr, 1 << 31)
            if fast is not None:
                assert ref[0] == "ok", f"{key}={value!r}: the fast path accepted what the reference refuses: {ref[1]}"
                same(ref[1], fast)


@pytest.mark.parametrize("base", BASES, ids=lambda m: type(m).__name__)
def test_every_field_at_every_edge_encodes_as_the_reference_decides(base: Any) -> None:
    import dataclasses

    for f in dataclasses.fields(base):
        for value in EDGES:
            bad = dataclasses.replace(base, **{f.name: tuple(value) if isinstance(value, list) else value})
            try:
                ref = ("ok", encode_reference(bad)[0])
            except Exception as e:  # noqa: BLE001  (the reference's verdict, whatever it is)
                ref = ("err", type(e))
            fast = fastcodec.encode_fast(bad)
            if fast is not None:
                assert ref == ("ok", fast[0]), f"{f.name}={value!r}"


def test_the_field_orders_that_positional_constructions_rely_on() -> None:
    """protocol/fastcodec.py and ps/net/transport.py build Job and Reply positionally (a constructor
    costs a quarter of dataclasses.replace): a new or moved field must update them."""
    import dataclasses

    assert [f.name for f in dataclasses.fields(Job)] == [
        "job_id", "kind", "created_at", "iterate_ids", "seed", "batch_size", "shard", "deadline", "point_ids",
        "points", "refs", "grad_slots", "xfer", "spin_us"]
    assert [f.name for f in dataclasses.fields(Reply)] == [
        "job_id", "created_at", "grads", "loss", "count", "compute_s", "holds", "in_shm", "xfer", "block_sq",
        "step_sq"]
    assert [f.name for f in dataclasses.fields(Heartbeat)] == ["boot", "credit", "busy", "seen"]
    assert [f.name for f in dataclasses.fields(Ready)] == ["credit", "holds", "shm"]
