"""The wire codec: round trips, hostile input, zero-copy and the size caps (protocol/PROTOCOL.md).

``decode`` is where trust stops, so the properties here are: every valid message survives
``decode(encode(m))`` whatever the frames are made of (numpy arrays, bytes, memoryviews,
``zmq.Frame``); anything else fed to ``decode`` raises :class:`RemoteProtocolError` and nothing
else; whatever ``decode`` accepts is a valid message (it re-encodes); and ``encode`` refuses
invalid messages with :class:`LocalProtocolError`.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol.codec import decode, encode, encode_reference, looks_like_heartbeat
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from protocol.messages import (
    ALLOWED_DTYPES,
    DEFAULT_MAX_ARRAY_BYTES,
    MAX_ARRAYS,
    MAX_HEADER_BYTES,
    MAX_ID_LEN,
    MAX_LIST_LEN,
    MAX_MAP_LEN,
    MAX_NDIM,
    MAX_STR_LEN,
    TYPE_NAMES,
    Bye,
    Cancel,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Job,
    JobKind,
    Ready,
    Reply,
    Status,
    StatusRequest,
    Welcome,
)

U64_MAX = (1 << 64) - 1
I64_MAX = (1 << 63) - 1
I64_MIN = -(1 << 63)
DTYPES = sorted(ALLOWED_DTYPES)
ARRAY_FIELDS = {"points", "grads"}

# Local settings only: tests/conftest.py owns the profiles (derandomized "ci", "dev").
MAIN = settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ = settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --------------------------------------------------------------------------- helpers

def pack(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def header_of(msg: Any) -> dict:
    return msgpack.unpackb(encode(msg)[0], raw=False)


def rejects(frames: Any, **kw: Any) -> RemoteProtocolError:
    """Decode must raise RemoteProtocolError (any other exception fails the test)."""
    with pytest.raises(RemoteProtocolError) as info:
        decode(frames, **kw)
    return info.value


def decode_or_none(frames: Any, **kw: Any) -> Any:
    """Decode, turning RemoteProtocolError into None; every other exception escapes (a bug).

    What decode accepts must be a valid message: it has to encode again.
    """
    try:
        msg = decode(frames, **kw)
    except RemoteProtocolError:
        return None
    assert type(msg) in TYPE_NAMES
    encode(msg)
    return msg


def as_frames(encoded: list, kind: str) -> list:
    """The frames of ``encode`` as a receiver could hold them."""
    out: list[Any] = []
    for f in encoded:
        raw = f.tobytes() if isinstance(f, np.ndarray) else f
        if kind == "as-is":
            out.append(f)
        elif kind == "bytes":
            out.append(bytes(raw))
        elif kind == "bytearray":
            out.append(bytearray(raw))
        elif kind == "memoryview":
            out.append(memoryview(f))  # for arrays: an N-D view with the array's own format
        elif kind == "frame":
            out.append(zmq.Frame(bytes(raw)))
        else:
            raise AssertionError(kind)
    return out


FRAME_KINDS = ["as-is", "bytes", "bytearray", "memoryview", "frame"]


def assert_same(sent: Any, got: Any) -> None:
    assert type(got) is type(sent)
    for f in fields(sent):
        a, b = getattr(sent, f.name), getattr(got, f.name)
        if f.name in ARRAY_FIELDS:
            assert type(b) is tuple and len(b) == len(a)
            for x, y in zip(a, b, strict=True):
                assert isinstance(y, np.ndarray)
                assert y.dtype == x.dtype and y.dtype.str in ALLOWED_DTYPES
                assert y.shape == x.shape
                assert y.tobytes() == x.tobytes()  # bit-exact, NaN payloads included
                assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f")
                assert y.flags.aligned
        elif isinstance(a, float) and a != a:  # NaN (a loss): the same NaN, not an equal number
            assert isinstance(b, float) and b != b, f.name
        else:
            assert b == a, f.name
            if isinstance(a, tuple):
                assert type(b) is tuple
            if isinstance(a, float):
                assert type(b) is float and math.copysign(1, a) == math.copysign(1, b)


# --------------------------------------------------------------------------- strategies

# str.isprintable() is False exactly for these categories (and True for the ASCII space).
_NONPRINTABLE = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs")
printable_chars = st.characters(exclude_categories=_NONPRINTABLE) | st.just(" ")


def text(max_size: int, min_size: int = 0) -> st.SearchStrategy[str]:
    return st.text(printable_chars, min_size=min_size, max_size=max_size)


nat = st.integers(0, I64_MAX)
u64 = st.integers(0, U64_MAX)
finite = st.floats(allow_nan=False, allow_infinity=False)
id_list = st.lists(nat, max_size=MAX_LIST_LEN).map(tuple)
credit = st.integers(1, MAX_LIST_LEN)
ascii_ids = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), min_size=1,
                    max_size=MAX_ID_LEN)


@st.composite
def shapes(draw: Any, max_elems: int = 300) -> tuple[int, ...]:
    """Up to 4-D, at most ``max_elems`` elements, zero-sized dims included."""
    ndim = draw(st.integers(0, MAX_NDIM))
    shape, budget = [], max_elems
    for _ in range(ndim):
        s = draw(st.integers(0, budget))
        shape.append(s)
        budget //= max(s, 1)
    return tuple(shape)


arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: shapes().flatmap(lambda sh: hnp.arrays(np.dtype(dt), sh)))

option_values = (text(MAX_STR_LEN) | st.integers(I64_MIN, U64_MAX) | finite | st.booleans())

hellos = st.builds(Hello, worker_id=ascii_ids, boot=u64, credit=credit, vmin=st.integers(0, 0xFFFF),
                   vmax=st.integers(0, 0xFFFF), device=text(MAX_ID_LEN), host_id=text(MAX_STR_LEN), holds=id_list,
                   busy=id_list, seen=st.integers(-1, I64_MAX), run_id=u64, cpus=st.integers(0, 0xFFFF))
welcomes = st.builds(Welcome, server_boot=u64, run_id=u64, version=st.integers(0, 0xFFFF), problem=text(MAX_STR_LEN, 1),
                     problem_options=st.dictionaries(text(MAX_ID_LEN, 1), option_values, max_size=8),
                     heartbeat_interval_s=finite, liveness_timeout_s=finite)
readies = st.builds(Ready, credit=st.integers(0, MAX_LIST_LEN), holds=id_list)


SOME_POINTS = st.lists(arrays, max_size=2)
SOME_GRADS = st.lists(arrays, max_size=MAX_ARRAYS)


@st.composite
def jobs(draw: Any, points: st.SearchStrategy = SOME_POINTS) -> Job:
    points = tuple(draw(points))
    shard = draw(st.none() | st.tuples(nat, nat).map(lambda p: (min(p), max(p))))
    return Job(job_id=draw(nat), kind=draw(st.sampled_from(JobKind)), created_at=draw(nat),
               iterate_ids=tuple(draw(st.lists(nat, max_size=2))), seed=draw(u64),
               batch_size=draw(st.integers(1, 1 << 30)), shard=shard, deadline=draw(st.none() | nat),
               point_ids=tuple(draw(st.lists(nat, min_size=len(points), max_size=len(points)))), points=points,
               spin_us=draw(st.sampled_from([0, 0, 1, 400, 100_000])))


def replies(grads: st.SearchStrategy = SOME_GRADS) -> st.SearchStrategy[Reply]:
    return st.builds(Reply, job_id=nat, created_at=nat, grads=grads.map(tuple), loss=st.none() | finite,
                     count=nat, compute_s=finite, holds=id_list)


heartbeats = st.builds(Heartbeat, boot=u64, credit=st.integers(0, MAX_LIST_LEN), busy=id_list,
                       seen=st.integers(-1, I64_MAX))
cancels = st.builds(Cancel, job_ids=id_list)
byes = st.builds(Bye, reason=text(MAX_STR_LEN))
errors = st.builds(Error, code=st.sampled_from(ErrorCode), message=text(MAX_STR_LEN),
                   job_id=st.none() | nat, iterate_ids=id_list)

status_requests = st.builds(StatusRequest, token=u64)
statuses = st.builds(Status, token=u64, info=st.dictionaries(text(MAX_ID_LEN, 1), option_values, max_size=8))
MESSAGES = {Hello: hellos, Welcome: welcomes, Ready: readies, Job: jobs(), Reply: replies(),
            Heartbeat: heartbeats, Cancel: cancels, Bye: byes, Error: errors, StatusRequest: status_requests,
            Status: statuses}
messages = st.one_of(*MESSAGES.values())

# Arbitrary msgpack values that the unpacker accepts (bin and ext only when empty: longer ones
# are refused by msgpack itself, and RAW_HEADERS covers those), i.e. what reaches the schema checks.
msgpack_scalars = (st.none() | st.booleans() | st.integers(I64_MIN, U64_MAX) | st.floats() | st.text(max_size=12)
                   | st.just(b"") | st.builds(msgpack.ExtType, st.integers(0, 127), st.just(b"")))
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12)
dims = st.integers(0, 4) | st.sampled_from([2**31, 2**40, 2**62, 2**63, U64_MAX])
FIELD_NAMES = sorted({f.name for cls in TYPE_NAMES for f in fields(cls)} | {"v", "t", "arrays"})


# --------------------------------------------------------------------------- (a) round trips

@pytest.mark.parametrize("cls", list(MESSAGES), ids=lambda c: c.__name__)
@MAIN
@given(data=st.data())
def test_round_trip_every_type(cls: type, data: st.DataObject) -> None:
    msg = data.draw(MESSAGES[cls])
    kind = data.draw(st.sampled_from(FRAME_KINDS))
    encoded = encode(msg)
    assert isinstance(encoded[0], bytes) and len(encoded[0]) <= MAX_HEADER_BYTES
    assert all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in encoded[1:])
    assert_same(msg, decode(as_frames(encoded, kind)))


@pytest.mark.parametrize("cls", list(MESSAGES), ids=lambda c: c.__name__)
@MAIN
@given(data=st.data())
def test_looks_like_heartbeat_is_true_of_heartbeats_alone(cls: type, data: st.DataObject) -> None:
    """The server's raw-bytes test (a connection's identical queued heartbeats are one,
    ps/drivers/daemon.py) recognises every heartbeat encode writes and no other message."""
    msg = data.draw(MESSAGES[cls])
    assert looks_like_heartbeat(bytes(encode(msg)[0])) == (cls is Heartbeat)
    assert looks_like_heartbeat(bytes(encode_reference(msg)[0])) == (cls is Heartbeat)


@MAIN
@given(a=arrays, kind=st.sampled_from(FRAME_KINDS))
def test_round_trip_arrays_every_dtype_and_shape(a: np.ndarray, kind: str) -> None:
    msg = Reply(job_id=1, created_at=0, grads=(a,))
    assert_same(msg, decode(as_frames(encode(msg), kind)))


@given(a=arrays.filter(lambda a: a.ndim >= 1 and a.size >= 2))
@settings(max_examples=100)
def test_non_contiguous_arrays_travel_as_their_c_order_copy(a: np.ndarray) -> None:
    for view in (a[::-1], a[::2], a.T, np.asfortranarray(a)):
        got = decode(as_frames(encode(Reply(job_id=0, created_at=0, grads=(view,))), "bytes")).grads[0]
        assert got.shape == view.shape and got.tobytes() == np.ascontiguousarray(view).tobytes()


def test_native_byte_order_names_are_the_little_endian_ones() -> None:
    for name in ("=f4", "float32", "f8", "float16", "uint16"):
        a = np.arange(3).astype(name)
        got = decode(encode(Reply(job_id=0, created_at=0, grads=(a,)))).grads[0]
        assert got.dtype.str in ALLOWED_DTYPES and np.array_equal(got, a)


def test_defaults_fill_absent_optional_fields() -> None:
    assert decode([pack({"v": 1, "t": "bye"})]) == Bye()
    assert decode([pack({"v": 1, "t": "hb", "boot": 7})]) == Heartbeat(boot=7)
    h = decode([pack({"v": 1, "t": "hello", "worker_id": "w", "boot": 1, "credit": 2})])
    assert h == Hello(worker_id="w", boot=1, credit=2, vmin=1, vmax=1, device="cpu", host_id="", holds=())
    j = decode([pack({"v": 1, "t": "job", "job_id": 3, "kind": 1, "created_at": 0, "iterate_ids": [5], "seed": 9})])
    assert (j.batch_size, j.shard, j.deadline, j.point_ids, j.points) == (1, None, None, (), ())
    r = decode([pack({"v": 1, "t": "reply", "job_id": 3, "created_at": 0})])
    assert (r.grads, r.loss, r.count, r.compute_s, r.holds) == ((), None, 0, 0.0, ())


def test_busy_poll_fields_travel_only_when_set_and_refuse_past_their_range() -> None:
    """Job.spin_us (the server's busy-poll advice) and Hello.cpus came after version 1's first
    release: at 0 they are left out, so an older peer sees the bytes it always saw, and a worker
    or server that does not know them ignores them as unknown keys (§9)."""
    job = Job(job_id=3, kind=JobKind.GRAD, created_at=0, iterate_ids=(5,), seed=9)
    assert "spin_us" not in header_of(job) and decode(encode(job)).spin_us == 0
    advised = Job(job_id=3, kind=JobKind.GRAD, created_at=0, iterate_ids=(5,), seed=9, spin_us=400)
    assert header_of(advised)["spin_us"] == 400 and decode(encode(advised)) == advised
    hello = Hello(worker_id="w", boot=1, credit=1)
    assert "cpus" not in header_of(hello) and decode(encode(Hello("w", 1, 1, cpus=8))).cpus == 8
    for bad in (-1, 100_001, 1.5, True, "400"):
        with pytest.raises(RemoteProtocolError, match="job.spin_us"):
            decode([pack({**header_of(job), "spin_us": bad})])
        with pytest.raises(LocalProtocolError, match="Job.spin_us"):
            encode(Job(job_id=3, kind=JobKind.GRAD, created_at=0, iterate_ids=(5,), seed=9, spin_us=bad))
    with pytest.raises(RemoteProtocolError, match="hello.cpus"):
        decode([pack({**header_of(hello), "cpus": 1 << 16})])


def test_numbers_decode_to_the_field_types() -> None:
    """An int where a float is expected is accepted and becomes a float; enums become enums."""
    r = decode([pack({"v": 1, "t": "reply", "job_id": 0, "created_at": 0, "loss": 2, "compute_s": U64_MAX})])
    assert type(r.loss) is float and r.loss == 2.0 and type(r.compute_s) is float
    j = decode([pack({"v": 1, "t": "job", "job_id": 0, "kind": 2, "created_at": 0, "iterate_ids": [1, 0],
                      "seed": 0})])
    assert j.kind is JobKind.GRAD_PAIR
    assert decode([pack({"v": 1, "t": "err", "code": 8})]).code is ErrorCode.MISSING_ITERATE


def test_unknown_keys_are_ignored() -> None:
    h = header_of(Bye("x"))
    h.update({"future_field": [1, {"a": None}], "zz": b"", "": 1.5})
    assert decode([pack(h)]) == Bye("x")
    # a key that one type does not have is just another unknown key
    assert decode([pack({"v": 1, "t": "bye", "job_id": "not even an int"})]) == Bye()


@pytest.mark.parametrize("s", ["é" * MAX_STR_LEN, "\U0001f600" * MAX_STR_LEN, "a" * MAX_STR_LEN])
def test_longest_strings_round_trip_whatever_their_utf8_length(s: str) -> None:
    """Lengths count code points; a 1024-character string may take up to 4096 UTF-8 bytes."""
    for msg in (Bye(s), Error(ErrorCode.REFUSED, s), Hello(worker_id="w" * MAX_ID_LEN, boot=0, credit=1, host_id=s)):
        assert decode(encode(msg)) == msg


def test_limits_are_inclusive() -> None:
    big = tuple(range(I64_MAX - MAX_LIST_LEN + 1, I64_MAX + 1))
    for msg in (Cancel(big), Heartbeat(boot=U64_MAX, credit=MAX_LIST_LEN, busy=big, seen=I64_MAX),
                Hello(worker_id="w" * MAX_ID_LEN, boot=U64_MAX, credit=MAX_LIST_LEN, vmin=0xFFFF, vmax=0xFFFF,
                      device="d" * MAX_ID_LEN, host_id="h" * MAX_STR_LEN, holds=big, busy=big, seen=I64_MAX,
                      run_id=U64_MAX),
                Welcome(server_boot=0, run_id=U64_MAX, version=0, problem="p" * MAX_STR_LEN,
                        problem_options={f"k{i}": i for i in range(MAX_MAP_LEN)}),
                Job(job_id=I64_MAX, kind=JobKind.FULL_GRAD, created_at=I64_MAX, iterate_ids=(I64_MAX, 0),
                    seed=U64_MAX, batch_size=1 << 30, shard=(I64_MAX, I64_MAX), deadline=I64_MAX)):
        assert decode(encode(msg)) == msg
    grads = tuple(np.zeros((1, 1, 1, 2), "<f4") for _ in range(MAX_ARRAYS))
    assert len(decode(encode(Reply(job_id=0, created_at=0, grads=grads))).grads) == MAX_ARRAYS


# --------------------------------------------------------------------------- (b) arbitrary input

@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_header_bytes_are_rejected_cleanly(b: bytes) -> None:
    decode_or_none([b])
    decode_or_none(b)  # not even a list of frames
    decode_or_none([zmq.Frame(b)])


@FUZZ
@given(st.lists(st.binary(max_size=64) | st.builds(bytearray, st.binary(max_size=16))
                | st.builds(memoryview, st.binary(max_size=16)), max_size=2 + MAX_ARRAYS))
def test_arbitrary_frame_lists_are_rejected_cleanly(frames: list) -> None:
    decode_or_none(frames)


@FUZZ
@given(st.lists(st.none() | st.integers() | st.text(max_size=4) | st.floats() | st.binary(max_size=4), max_size=4))
def test_frames_that_are_not_buffers_are_rejected(frames: list) -> None:
    decode_or_none(frames)
    decode_or_none([pack({"v": 1, "t": "reply", "job_id": 0, "created_at": 0,
                          "arrays": [{"dtype": "<f4", "shape": [0]}] * len(frames)}), *frames])


@pytest.mark.parametrize("frames", [None, 3, 1.5, object(), iter([b"x"]), [], (), {}])
def test_non_sequences_and_empty_input_are_rejected(frames: Any) -> None:
    rejects(frames)


@st.composite
def schema_fuzz(draw: Any) -> list:
    """The header of a valid message with some fields (or v, t, unknown keys) replaced by arbitrary
    values, plus array descriptors and frames that almost fit."""
    with_arrays = draw(st.booleans())
    others = st.one_of(hellos, welcomes, readies, heartbeats, cancels, byes, errors)
    bare = jobs(st.just(())) | replies(st.just(()))
    h = header_of(draw(bare if with_arrays else others | bare))
    h.pop("arrays", None)
    if draw(st.booleans()):
        for name in draw(st.lists(st.sampled_from(FIELD_NAMES), max_size=4)):
            h[name] = draw(msgpack_values)
    if draw(st.integers(0, 7)) == 7:  # mostly keep v and t, so that the fields get checked
        h["v"] = draw(msgpack_values)
    if draw(st.integers(0, 7)) == 7:
        h["t"] = draw(st.sampled_from(sorted(TYPE_NAMES.values())) | msgpack_values)
    frames: list[Any] = []
    if with_arrays or draw(st.integers(0, 7)) == 7:
        metas = []
        for _ in range(draw(st.integers(0, 4))):
            odd = draw(st.integers(0, 3)) == 3  # one field in four is off the rails
            dtype = draw(st.sampled_from([">f4", "O", "|V8", "<i8", "f4", ""]) | msgpack_values if odd
                         else st.sampled_from(DTYPES))
            shape = draw(st.lists(dims | st.integers(I64_MIN, U64_MAX), max_size=5) | msgpack_values
                         if draw(st.integers(0, 3)) == 3 else st.lists(dims, max_size=MAX_NDIM))
            metas.append(draw(msgpack_values) if draw(st.integers(0, 7)) == 7 else {"dtype": dtype, "shape": shape})
            n = 1  # the frame length the descriptor asks for, when that is small
            if type(dtype) is str and dtype in ALLOWED_DTYPES and type(shape) is list \
                    and all(type(s) is int and s >= 0 for s in shape):
                if 0 in shape:
                    n = 0
                elif math.prod(shape) <= 4096:
                    n = math.prod(shape) * ALLOWED_DTYPES[dtype].itemsize
            frames.append(draw(st.just(bytes(n)) | st.binary(max_size=16)))
        h["arrays"] = metas
        if h.get("t") == "job" and draw(st.integers(0, 7)) != 7:
            h["point_ids"] = list(range(len(frames)))
    try:
        header = pack(h)
    except (OverflowError, ValueError, TypeError):  # not representable in msgpack: not a wire message
        assume(False)
    return [header, *frames]


@FUZZ
@given(schema_fuzz(), st.sampled_from(["bytes", "frame", "memoryview"]))
def test_header_shaped_garbage_is_rejected_cleanly(frames: list, kind: str) -> None:
    decode_or_none(as_frames(frames, kind))


@FUZZ
@given(dtype=st.sampled_from(DTYPES + [">f4", ">f8", "O", "|V8", "<i8", "<c8", "f4", "float32", ""]),
       shape=st.lists(dims | st.integers(I64_MIN, U64_MAX), max_size=MAX_NDIM + 1),
       frame=st.sampled_from(["fits", "empty", "short", "long"]), limit=st.sampled_from([None, 0, 1, 64, 2**40]))
def test_array_descriptors_are_checked_cleanly(dtype: str, shape: list, frame: str, limit: int | None) -> None:
    """One array: any dtype string, any integer dims, a frame that fits the descriptor or not."""
    item = ALLOWED_DTYPES[dtype].itemsize if dtype in ALLOWED_DTYPES else 4
    n = math.prod(shape) * item if all(s >= 0 for s in shape) else 8
    n = n if n <= 1 << 16 else 8
    n = {"fits": n, "empty": 0, "short": max(n - 1, 0), "long": n + 1}[frame]
    h = pack({"v": 1, "t": "reply", "job_id": 0, "created_at": 0, "arrays": [{"dtype": dtype, "shape": shape}]})
    kw = {} if limit is None else {"max_array_bytes": limit}
    msg = decode_or_none([h, bytes(n)], **kw)
    if msg is not None:
        (g,) = msg.grads
        assert g.dtype.str == dtype and list(g.shape) == shape and g.nbytes == n
        assert g.nbytes <= (DEFAULT_MAX_ARRAY_BYTES if limit is None else limit)


# --------------------------------------------------------------------------- (c) mutations

@FUZZ
@given(msg=messages, data=st.data())
def test_flipped_header_bytes_never_escape(msg: Any, data: st.DataObject) -> None:
    header, *rest = as_frames(encode(msg), "bytes")
    h = bytearray(header)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(h) - 1))
        h[i] ^= data.draw(st.integers(1, 255))
    decode_or_none([bytes(h), *rest])


@FUZZ
@given(msg=messages, data=st.data())
def test_truncated_or_padded_header_is_rejected(msg: Any, data: st.DataObject) -> None:
    header, *rest = as_frames(encode(msg), "bytes")
    cut = data.draw(st.integers(0, len(header) - 1))
    rejects([header[:cut], *rest])
    rejects([header + data.draw(st.binary(min_size=1, max_size=8)), *rest])  # trailing bytes


@FUZZ
@given(msg=st.one_of(jobs(), replies()), data=st.data())
def test_array_frames_of_the_wrong_length_are_rejected(msg: Any, data: st.DataObject) -> None:
    frames = as_frames(encode(msg), "bytes")
    assume(len(frames) > 1)
    i = data.draw(st.integers(1, len(frames) - 1))
    f = frames[i]
    if f:
        rejects(frames[:i] + [f[: data.draw(st.integers(0, len(f) - 1))]] + frames[i + 1:])
    rejects(frames[:i] + [f + data.draw(st.binary(min_size=1, max_size=8))] + frames[i + 1:])


@FUZZ
@given(msg=messages, data=st.data())
def test_dropped_or_added_frames_are_rejected(msg: Any, data: st.DataObject) -> None:
    frames = as_frames(encode(msg), data.draw(st.sampled_from(["bytes", "frame"])))
    extra = zmq.Frame(data.draw(st.binary(max_size=8)))
    at = data.draw(st.integers(1, len(frames)))
    rejects(frames[:at] + [extra] + frames[at:])
    if len(frames) > 1:
        i = data.draw(st.integers(1, len(frames) - 1))
        rejects(frames[:i] + frames[i + 1:])
    decode_or_none(frames[1:])  # header dropped: the first array becomes the header


_DELETE = object()  # an override value that removes the key


def _job_frames(**override: Any) -> list:
    points = (np.arange(3, dtype="<f4"),)
    frames = encode(Job(job_id=4, kind=JobKind.GRAD, created_at=2, iterate_ids=(7,), seed=11, point_ids=(7,),
                        points=points))
    h = msgpack.unpackb(frames[0])
    h.update(override)
    return [pack({k: v for k, v in h.items() if v is not _DELETE}), *(a.tobytes() for a in frames[1:])]


def _desc(**override: Any) -> list:
    d = {"dtype": "<f4", "shape": [3]}
    d.update(override)
    return [{k: v for k, v in d.items() if v is not _DELETE}]


BAD_JOB_HEADERS = {
    # version and type
    "v=0": {"v": 0}, "v=2": {"v": 2}, "v='1'": {"v": "1"}, "v=1.0": {"v": 1.0}, "v=true": {"v": True},
    "no v": {"v": _DELETE}, "t unknown": {"t": "jobs"}, "t=JOB": {"t": "Job"}, "t int": {"t": 4},
    "no t": {"t": _DELETE}, "t=cancel": {"t": "cancel"},  # a cancel carries no arrays
    # dtypes
    "dtype >f4": {"arrays": _desc(dtype=">f4")}, "dtype O": {"arrays": _desc(dtype="O")},
    "dtype |V8": {"arrays": _desc(dtype="|V8", shape=[1])}, "dtype <i8": {"arrays": _desc(dtype="<i8")},
    "dtype f4": {"arrays": _desc(dtype="f4")}, "dtype float32": {"arrays": _desc(dtype="float32")},
    "dtype int": {"arrays": _desc(dtype=4)}, "dtype bytes": {"arrays": _desc(dtype=b"<f4")},
    "dtype missing": {"arrays": _desc(dtype=_DELETE)}, "dtype None": {"arrays": _desc(dtype=None)},
    # shapes
    "shape 2**40": {"arrays": _desc(shape=[2**40])}, "shape -1": {"arrays": _desc(shape=[-1])},
    "shape [3,-1]": {"arrays": _desc(shape=[3, -1])}, "shape [-3,-1]": {"arrays": _desc(shape=[-3, -1])},
    "shape 5-D": {"arrays": _desc(shape=[3, 1, 1, 1, 1])}, "shape '3'": {"arrays": _desc(shape="3")},
    "shape [3.0]": {"arrays": _desc(shape=[3.0])}, "shape [true]": {"arrays": _desc(shape=[True, 3])},
    "shape missing": {"arrays": _desc(shape=_DELETE)}, "shape map": {"arrays": _desc(shape={"0": 3})},
    "shape [2] (8 of 12 bytes)": {"arrays": _desc(shape=[2])}, "shape [4] (16 of 12)": {"arrays": _desc(shape=[4])},
    "shape [0, 2**63]": {"arrays": _desc(shape=[0, 2**63])},
    "shape [0, 2**64-1]": {"arrays": _desc(shape=[0, U64_MAX])},
    "shape [2**40, 0]": {"arrays": _desc(shape=[2**40, 0])},
    "shape [0, 2**30 x3]": {"arrays": _desc(shape=[0, 2**30, 2**30, 2**30])},
    "shape [u64max]": {"arrays": _desc(shape=[U64_MAX])},
    "desc not a map": {"arrays": [[3]]}, "arrays not a list": {"arrays": {"dtype": "<f4", "shape": [3]}},
    "two descs one frame": {"arrays": _desc() * 2}, "no descs": {"arrays": []},
    # fields of the wrong type or out of range
    "job_id str": {"job_id": "4"}, "job_id -1": {"job_id": -1}, "job_id 2**63": {"job_id": 2**63},
    "job_id float": {"job_id": 4.0}, "job_id bool": {"job_id": True}, "job_id None": {"job_id": None},
    "job_id bin": {"job_id": b"\x04"}, "job_id missing": {"job_id": _DELETE}, "kind 0": {"kind": 0},
    "kind 4": {"kind": 4}, "kind str": {"kind": "GRAD"}, "iterate_ids 3": {"iterate_ids": [7, 8, 9]},
    "iterate_ids str": {"iterate_ids": "7"}, "iterate_ids neg": {"iterate_ids": [-7]},
    "iterate_ids floats": {"iterate_ids": [7.0]}, "seed -1": {"seed": -1}, "seed str": {"seed": "11"},
    "batch_size 0": {"batch_size": 0}, "batch_size 2**30+1": {"batch_size": 2**30 + 1},
    "shard reversed": {"shard": [3, 1]}, "shard 1": {"shard": [1]}, "shard 3": {"shard": [1, 2, 3]},
    "shard int": {"shard": 1}, "shard neg": {"shard": [-1, 2]}, "deadline -1": {"deadline": -1},
    "deadline str": {"deadline": "x"}, "point_ids none": {"point_ids": []}, "point_ids 2": {"point_ids": [7, 8]},
    "point_ids 3": {"point_ids": [1, 2, 3]}, "created_at float": {"created_at": 2.5},
    "ext value": {"seed": msgpack.ExtType(1, b"")},
}


@pytest.mark.parametrize("override", BAD_JOB_HEADERS.values(), ids=BAD_JOB_HEADERS.keys())
def test_bad_job_headers_are_rejected(override: dict) -> None:
    rejects(_job_frames(**override))
    rejects(as_frames(_job_frames(**override), "frame"))


def test_job_reference_encoding_decodes() -> None:
    """The base of the mutations above is itself valid."""
    j = decode(_job_frames())
    assert j.job_id == 4 and np.array_equal(j.points[0], np.arange(3, dtype="<f4"))


def _nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]


RAW_HEADERS = {
    "deep list in an unknown key": b"\x83\xa1v\x01\xa1t\xa3bye\xa1x" + _nested(5000),
    "deep map in an unknown key": b"\x83\xa1v\x01\xa1t\xa3bye\xa1x" + b"\x81\xa1a" * 5000 + b"\xc0",
    "deep list as the header": _nested(100_000),
    "int key": b"\x83\xa1v\x01\xa1t\xa3bye\x01\x02",
    "nested int key": b"\x83\xa1v\x01\xa1t\xa3bye\xa1x\x81\x01\x02",
    "float key": b"\x83\xa1v\x01\xa1t\xa3bye\xcb" + bytes(8) + b"\xc0",
    "nil key": b"\x83\xa1v\x01\xa1t\xa3bye\xc0\xc0",
    "bin value": b"\x83\xa1v\x01\xa1t\xa3bye\xa6reason\xc4\x01x",
    "ext value": b"\x83\xa1v\x01\xa1t\xa3bye\xa6reason\xd4\x01\x00",
    "timestamp ext": b"\x83\xa1v\x01\xa1t\xa3bye\xa6reason\xd6\xff" + bytes(4),
    "invalid utf-8": b"\x83\xa1v\x01\xa1t\xa3bye\xa6reason\xa2\xc3\x28",
    "str32 length lie": b"\x83\xa1v\x01\xa1t\xa3bye\xa6reason\xdb\xff\xff\xff\xff",
    "array32 length lie": b"\x83\xa1v\x01\xa1t\xa3bye\xa1x\xdd\xff\xff\xff\xff",
    "map32 length lie": b"\xdf\xff\xff\xff\xff",
    "reserved byte 0xc1": b"\x81\xa1v\xc1",
    "not a map: list": pack([1, "bye"]),
    "not a map: int": pack(1),
    "not a map: str": pack("bye"),
    "empty": b"",
    "trailing bytes": pack({"v": 1, "t": "bye"}) + b"\x00",
    "two headers": pack({"v": 1, "t": "bye"}) * 2,
    "header over 64 KiB": pack({"v": 1, "t": "bye", "x": ["x" * MAX_STR_LEN] * 64}),
    "string over 1024 code points": pack({"v": 1, "t": "bye", "reason": "x" * (MAX_STR_LEN + 1)}),
    "string over 4096 bytes": pack({"v": 1, "t": "bye", "x": "x" * (4 * MAX_STR_LEN + 1)}),
    "list over 256": pack({"v": 1, "t": "cancel", "job_ids": list(range(MAX_LIST_LEN + 1))}),
    "unknown key list over 256": pack({"v": 1, "t": "bye", "x": [0] * (MAX_LIST_LEN + 1)}),
    "map over 64": pack({"v": 1, "t": "bye", **{f"k{i}": 0 for i in range(MAX_MAP_LEN)}}),
    "non-printable string": pack({"v": 1, "t": "bye", "reason": "a\nb"}),
    "NaN float": pack({"v": 1, "t": "reply", "job_id": 0, "created_at": 0, "compute_s": float("nan")}),
    "inf float": pack({"v": 1, "t": "reply", "job_id": 0, "created_at": 0, "compute_s": float("-inf")}),
    "bool as float": pack({"v": 1, "t": "reply", "job_id": 0, "created_at": 0, "compute_s": True}),
    "empty worker_id": pack({"v": 1, "t": "hello", "worker_id": "", "boot": 0, "credit": 1}),
    "worker_id 65": pack({"v": 1, "t": "hello", "worker_id": "w" * 65, "boot": 0, "credit": 1}),
    "credit 0 in hello": pack({"v": 1, "t": "hello", "worker_id": "w", "boot": 0, "credit": 0}),
    "credit 1025": pack({"v": 1, "t": "hb", "boot": 0, "credit": 1025}),
    "boot 2**64 as float": pack({"v": 1, "t": "hb", "boot": 2.0**64}),
    "seen -2": pack({"v": 1, "t": "hb", "boot": 0, "seen": -2}),
    "vmax 65536": pack({"v": 1, "t": "hello", "worker_id": "w", "boot": 0, "credit": 1, "vmax": 65536}),
    "err code 0": pack({"v": 1, "t": "err", "code": 0}),
    "err code 11": pack({"v": 1, "t": "err", "code": max(ErrorCode) + 1}),
    "err no code": pack({"v": 1, "t": "err"}),
    "options not a map": pack({"v": 1, "t": "welcome", "server_boot": 0, "version": 1, "problem": "q",
                               "problem_options": [["a", 1]]}),
    "option list value": pack({"v": 1, "t": "welcome", "server_boot": 0, "version": 1, "problem": "q",
                               "problem_options": {"a": [1]}}),
    "option None value": pack({"v": 1, "t": "welcome", "server_boot": 0, "version": 1, "problem": "q",
                               "problem_options": {"a": None}}),
    "option empty key": pack({"v": 1, "t": "welcome", "server_boot": 0, "version": 1, "problem": "q",
                              "problem_options": {"": 1}}),
    "option NaN": pack({"v": 1, "t": "welcome", "server_boot": 0, "version": 1, "problem": "q",
                        "problem_options": {"a": float("nan")}}),
    "empty problem": pack({"v": 1, "t": "welcome", "server_boot": 0, "version": 1, "problem": ""}),
    "arrays on a bye": pack({"v": 1, "t": "bye", "arrays": [{"dtype": "<f4", "shape": [0]}]}),
}


@pytest.mark.parametrize("header", RAW_HEADERS.values(), ids=RAW_HEADERS.keys())
def test_bad_headers_are_rejected(header: bytes) -> None:
    rejects([header])
    rejects([memoryview(header)])


def test_too_many_frames_are_rejected() -> None:
    h = pack({"v": 1, "t": "reply", "job_id": 0, "created_at": 0,
              "arrays": [{"dtype": "<f4", "shape": [0]}] * (MAX_ARRAYS + 1)})
    rejects([h] + [b""] * (MAX_ARRAYS + 1))
    rejects([pack({"v": 1, "t": "bye"})] + [b""] * (MAX_ARRAYS + 1))
    rejects([pack({"v": 1, "t": "bye"}), b""])  # no arrays on a bye, not even empty ones


def test_non_contiguous_buffers_are_rejected() -> None:
    h = pack({"v": 1, "t": "reply", "job_id": 0, "created_at": 0, "arrays": [{"dtype": "<f4", "shape": [2]}]})
    rejects([h, memoryview(bytes(16))[::2]])
    rejects([memoryview(h * 2)[::2]])
    rejects([h, memoryview(np.zeros((2, 2), "<f4")[:, :1])])


# --------------------------------------------------------------------------- (d) encode refuses bad messages

def _pts(*arrays: np.ndarray) -> dict:
    return {"point_ids": tuple(range(len(arrays))), "points": arrays}


_J = {"job_id": 0, "kind": JobKind.GRAD, "created_at": 0, "iterate_ids": (0,), "seed": 0}
_F4 = np.zeros(3, "<f4")
BAD_MESSAGES = {
    "not a message": {"x": 1},
    "a message class": Bye,
    "hello credit 0": Hello(worker_id="w", boot=0, credit=0),
    "hello credit 1025": Hello(worker_id="w", boot=0, credit=1025),
    "hello boot -1": Hello(worker_id="w", boot=-1, credit=1),
    "hello boot 2**64": Hello(worker_id="w", boot=2**64, credit=1),
    "hello empty id": Hello(worker_id="", boot=0, credit=1),
    "hello id 65": Hello(worker_id="w" * 65, boot=0, credit=1),
    "hello id newline": Hello(worker_id="w\n", boot=0, credit=1),
    "hello id bytes": Hello(worker_id=b"w", boot=0, credit=1),
    "hello lone surrogate": Hello(worker_id="\ud800", boot=0, credit=1),
    "hello vmin -1": Hello(worker_id="w", boot=0, credit=1, vmin=-1),
    "hello holds 257": Hello(worker_id="w", boot=0, credit=1, holds=tuple(range(257))),
    "hello holds numpy int": Hello(worker_id="w", boot=0, credit=1, holds=(np.int64(1),)),
    "hello credit bool": Hello(worker_id="w", boot=0, credit=True),
    "welcome NaN interval": Welcome(server_boot=0, version=1, problem="q", heartbeat_interval_s=math.nan),
    "welcome inf timeout": Welcome(server_boot=0, version=1, problem="q", liveness_timeout_s=math.inf),
    "welcome empty problem": Welcome(server_boot=0, version=1, problem=""),
    "welcome option list": Welcome(server_boot=0, version=1, problem="q", problem_options={"a": [1]}),
    "welcome option int key": Welcome(server_boot=0, version=1, problem="q", problem_options={1: 1}),
    "welcome option 2**64": Welcome(server_boot=0, version=1, problem="q", problem_options={"a": 2**64}),
    "welcome option -2**63-1": Welcome(server_boot=0, version=1, problem="q", problem_options={"a": I64_MIN - 1}),
    "welcome 65 options": Welcome(server_boot=0, version=1, problem="q",
                                  problem_options={f"k{i}": 0 for i in range(MAX_MAP_LEN + 1)}),
    "welcome header > 64 KiB": Welcome(server_boot=0, version=1, problem="q",
                                       problem_options={f"k{i}": "x" * MAX_STR_LEN for i in range(MAX_MAP_LEN)}),
    "ready credit -1": Ready(credit=-1),
    "job kind 9": Job(**{**_J, "kind": 9}),
    "job 3 iterate ids": Job(**{**_J, "iterate_ids": (0, 1, 2)}),
    "job batch 0": Job(**{**_J, "batch_size": 0}),
    "job shard reversed": Job(**{**_J, "shard": (5, 3)}),
    "job shard list": Job(**{**_J, "shard": (1,)}),
    "job seed 2**64": Job(**{**_J, "seed": 2**64}),
    "job point not an array": Job(**_J, point_ids=(0,), points=([0.0, 1.0],)),
    "job point memoryview": Job(**_J, point_ids=(0,), points=(memoryview(_F4),)),
    "job point float64 big-endian": Job(**_J, **_pts(np.zeros(3, ">f8"))),
    "job point float32 big-endian": Job(**_J, **_pts(np.zeros(3, ">f4"))),
    "job point int64": Job(**_J, **_pts(np.zeros(3, "<i8"))),
    "job point object": Job(**_J, **_pts(np.array([None, 1]))),
    "job point complex": Job(**_J, **_pts(np.zeros(3, "<c8"))),
    "job point 5-D": Job(**_J, **_pts(np.zeros((1, 1, 1, 1, 3), "<f4"))),
    "job points without ids": Job(**_J, point_ids=(), points=(_F4,)),
    "job ids without points": Job(**_J, point_ids=(0,), points=()),
    "job 2 ids 1 point": Job(**_J, point_ids=(0, 1), points=(_F4,)),
    "job 3 points": Job(**_J, point_ids=(0, 1, 2), points=(_F4, _F4, _F4)),
    "reply 17 grads": Reply(job_id=0, created_at=0, grads=(_F4,) * (MAX_ARRAYS + 1)),
    "reply NaN compute_s": Reply(job_id=0, created_at=0, grads=(), compute_s=math.nan),
    "reply compute_s 2**70": Reply(job_id=0, created_at=0, grads=(), compute_s=2**70),
    "reply compute_s 10**400": Reply(job_id=0, created_at=0, grads=(), compute_s=10**400),
    "reply count -1": Reply(job_id=0, created_at=0, grads=(), count=-1),
    "reply loss str": Reply(job_id=0, created_at=0, grads=(), loss="0.5"),
    "hb seen -2": Heartbeat(boot=0, seen=-2),
    "hb busy 257": Heartbeat(boot=0, busy=tuple(range(257))),
    "cancel not ints": Cancel(job_ids=("1",)),
    "cancel a set": Cancel(job_ids={1}),
    "bye reason 1025": Bye("x" * (MAX_STR_LEN + 1)),
    "bye reason tab": Bye("a\tb"),
    "bye reason None": Bye(None),
    "err code 0": Error(code=0),
    "err job_id -1": Error(code=ErrorCode.REFUSED, job_id=-1),
}


@pytest.mark.parametrize("msg", BAD_MESSAGES.values(), ids=BAD_MESSAGES.keys())
def test_encode_refuses_invalid_messages(msg: Any) -> None:
    with pytest.raises(LocalProtocolError):
        encode(msg)


def test_error_classes() -> None:
    assert issubclass(LocalProtocolError, ProtocolError) and issubclass(RemoteProtocolError, ProtocolError)
    assert not issubclass(LocalProtocolError, RemoteProtocolError)


# --------------------------------------------------------------------------- (e) zero-copy and alignment

def _big_reply(dtype: str = "<f4", n: int = 1 << 18) -> tuple[Reply, np.ndarray]:
    g = np.arange(n, dtype=dtype)  # 1 MiB as float32
    return Reply(job_id=1, created_at=0, grads=(g,)), g


def test_encode_hands_out_the_array_itself() -> None:
    msg, g = _big_reply()
    frames = encode(msg)
    assert frames[1] is g


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "frame"])
def test_large_arrays_decode_without_a_copy(kind: str) -> None:
    msg, g = _big_reply()
    frames = as_frames(encode(msg), kind)
    got = decode(frames).grads[0]
    assert got.nbytes >= 1 << 20
    backing = frames[1].buffer if kind == "frame" else frames[1]
    assert np.shares_memory(got, np.frombuffer(backing, np.uint8))
    assert np.array_equal(got, g)


def test_large_arrays_decode_without_a_copy_over_a_socket() -> None:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.linger = b.linger = 0
        a.bind("inproc://codec-zero-copy")
        b.connect("inproc://codec-zero-copy")
        msg, g = _big_reply()
        a.send_multipart(encode(msg), copy=False)
        assert b.poll(5000)
        frames = b.recv_multipart(copy=False)
        got = decode(frames).grads[0]
        assert np.shares_memory(got, np.frombuffer(frames[1].buffer, np.uint8))
        assert np.array_equal(got, g) and got.flags.aligned
    finally:
        a.close()
        b.close()
        ctx.term()


@pytest.mark.parametrize("dtype", ["<f4", "<f8", "<f2", "<u2"])
def test_misaligned_frames_are_copied_into_aligned_arrays(dtype: str) -> None:
    msg, g = _big_reply(dtype, 16)
    header, payload = encode(msg)[0], g.tobytes()
    backing = bytearray(len(payload) + 1)
    backing[1:] = payload
    frame = memoryview(backing)[1:]  # one byte past an aligned allocation: misaligned for every allowed dtype
    assert not np.frombuffer(frame, dtype).flags.aligned
    got = decode([header, frame]).grads[0]
    assert got.flags.aligned and got.dtype == np.dtype(dtype)
    assert not np.shares_memory(got, np.frombuffer(backing, np.uint8))
    assert got.tobytes() == payload


def test_aligned_small_frames_are_not_copied() -> None:
    msg, g = _big_reply("<f8", 16)
    payload = bytearray(g.tobytes())
    got = decode([encode(msg)[0], payload]).grads[0]
    assert np.shares_memory(got, np.frombuffer(payload, np.uint8))


def test_arrays_over_read_only_frames_are_read_only() -> None:
    msg, _ = _big_reply("<f4", 8)
    assert not decode(as_frames(encode(msg), "bytes")).grads[0].flags.writeable
    assert decode(as_frames(encode(msg), "bytearray")).grads[0].flags.writeable


# --------------------------------------------------------------------------- (f) max_array_bytes

def _reply_frames(dtype: str, shape: list[int], nbytes: int | None = None) -> list:
    h = pack({"v": 1, "t": "reply", "job_id": 0, "created_at": 0, "arrays": [{"dtype": dtype, "shape": shape}]})
    n = math.prod(shape) * ALLOWED_DTYPES[dtype].itemsize if nbytes is None else nbytes
    return [h, bytes(n)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_max_array_bytes_is_inclusive(dtype: str) -> None:
    item = ALLOWED_DTYPES[dtype].itemsize
    limit = 10 * item
    assert decode(_reply_frames(dtype, [10]), max_array_bytes=limit).grads[0].shape == (10,)
    assert decode(_reply_frames(dtype, [2, 5]), max_array_bytes=limit).grads[0].shape == (2, 5)
    rejects(_reply_frames(dtype, [11]), max_array_bytes=limit)
    rejects(_reply_frames(dtype, [11, 1]), max_array_bytes=limit)
    rejects(_reply_frames(dtype, [1, 1, 1, 11]), max_array_bytes=limit)


def test_max_array_bytes_checks_the_shape_before_the_frame() -> None:
    """A huge shape is refused from the header alone, whatever the frame holds."""
    rejects(_reply_frames("<f4", [2**40], nbytes=0))
    rejects(_reply_frames("<f4", [2**16, 2**16], nbytes=16))
    rejects(_reply_frames("<f4", [DEFAULT_MAX_ARRAY_BYTES // 4 + 1], nbytes=0))


def test_zero_sized_arrays_count_their_other_dims_against_the_limit() -> None:
    assert decode(_reply_frames("<f4", [0, 10]), max_array_bytes=40).grads[0].shape == (0, 10)
    assert decode(_reply_frames("<f4", [10, 0, 0]), max_array_bytes=40).grads[0].shape == (10, 0, 0)
    rejects(_reply_frames("<f4", [0, 11]), max_array_bytes=40)
    rejects(_reply_frames("<f4", [11, 0]), max_array_bytes=40)


def test_max_array_bytes_applies_to_every_array() -> None:
    h = pack({"v": 1, "t": "reply", "job_id": 0, "created_at": 0,
              "arrays": [{"dtype": "<f4", "shape": [2]}, {"dtype": "<f4", "shape": [3]}]})
    assert len(decode([h, bytes(8), bytes(12)], max_array_bytes=12).grads) == 2
    rejects([h, bytes(8), bytes(12)], max_array_bytes=11)


# --------------------------------------------------------------------------- PROTOCOL.md examples

HELLO_EXAMPLE = Hello(worker_id="gpu7-4242", boot=0x5EED, credit=2, device="cuda:0", host_id="h1", holds=(3,),
                      busy=(16,), seen=16, run_id=0x3C5A9E01D2B4F687)
JOB_EXAMPLE = Job(job_id=17, kind=JobKind.GRAD, created_at=5, iterate_ids=(5,), seed=123456789, batch_size=32,
                  point_ids=(5,), points=(np.array([1.0, -2.0, 0.5], dtype="<f4"),))
REPLY_EXAMPLE = Reply(job_id=17, created_at=5, grads=(np.array([0.25, 0.0, -1.5], dtype="<f4"),), loss=0.75,
                      count=32, compute_s=0.003, holds=(5,))

# The bytes shown in protocol/PROTOCOL.md section 11; if the encoding changes, the document must change too.
EXAMPLE_HEX = {
    "hello": ("8da17601a174a568656c6c6fa9776f726b65725f6964a9677075372d34323432a4626f6f74cd5eeda663726564697402"
              "a4766d696e01a4766d617801a6646576696365a6637564613a30a7686f73745f6964a26831a5686f6c64739103"
              "a4627573799110a47365656e10a672756e5f6964cf3c5a9e01d2b4f687",),
    "job": ("8ca17601a174a36a6f62a66a6f625f696411a46b696e6401aa637265617465645f617405ab697465726174655f696473"
            "9105a473656564ce075bcd15aa62617463685f73697a6520a57368617264c0a8646561646c696e65c0a9706f696e745f"
            "6964739105a66172726179739182a56474797065a33c6634a573686170659103",
            "0000803f000000c00000003f",),
    "reply": ("89a17601a174a57265706c79a66a6f625f696411aa637265617465645f617405a46c6f7373cb3fe8000000000000a563"
              "6f756e7420a9636f6d707574655f73cb3f689374bc6a7efaa5686f6c64739105a66172726179739182a56474797065a3"
              "3c6634a573686170659103",
              "0000803e000000000000c0bf",),
}


@pytest.mark.parametrize("name,msg", [("hello", HELLO_EXAMPLE), ("job", JOB_EXAMPLE), ("reply", REPLY_EXAMPLE)])
def test_protocol_md_examples_are_what_the_codec_produces(name: str, msg: Any) -> None:
    frames = encode(msg)
    got = [frames[0].hex(), *(a.tobytes().hex() for a in frames[1:])]
    assert got == list(EXAMPLE_HEX[name])
    assert_same(msg, decode([bytes.fromhex(h) for h in EXAMPLE_HEX[name]]))
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "protocol" / "PROTOCOL.md").read_text(encoding="utf-8").split()
    for h in EXAMPLE_HEX[name]:
        assert h in doc, f"{name}: {h[:16]}... is not among the hex strings of PROTOCOL.md section 11"


def test_non_finite_loss_travels_so_the_server_can_judge_it() -> None:
    """A worker's NaN loss must not crash the worker's encoder; the server rejects the reply."""
    for loss in (math.nan, math.inf, -math.inf):
        got = decode(encode(Reply(job_id=0, created_at=0, grads=(), loss=loss)))
        assert got.loss is not None and not math.isfinite(got.loss) and (math.isnan(loss) == math.isnan(got.loss))


def test_ids_are_ascii_so_routing_ids_fit_in_255_bytes() -> None:
    with pytest.raises(LocalProtocolError):
        encode(Hello(worker_id="\U0001f600" * 10, boot=0, credit=1))
    header = msgpack.packb({"v": 1, "t": "hello", "worker_id": "é", "boot": 0, "credit": 1})
    with pytest.raises(RemoteProtocolError):
        decode([header])


def test_other_protocol_version_raises_unsupported_version() -> None:
    from protocol.errors import UnsupportedVersion

    with pytest.raises(UnsupportedVersion):
        decode([msgpack.packb({"v": 2, "t": "hello", "worker_id": "w", "boot": 0, "credit": 1})])


# --------------------------------------------------------------------------- worker failures (codes 9, 10)

def test_worker_failure_codes_keep_their_numbers() -> None:
    assert (ErrorCode.COMPUTE_FAILED, ErrorCode.PROBLEM_UNAVAILABLE) == (9, 10)
    got = decode([pack({"v": 1, "t": "err", "code": 9, "message": "ValueError: boom", "job_id": 4})])
    assert got == Error(ErrorCode.COMPUTE_FAILED, "ValueError: boom", job_id=4)
    assert decode([pack({"v": 1, "t": "err", "code": 10})]).code is ErrorCode.PROBLEM_UNAVAILABLE


@MAIN
@given(code=st.sampled_from([ErrorCode.COMPUTE_FAILED, ErrorCode.PROBLEM_UNAVAILABLE]),
       raw=st.text(max_size=3 * MAX_STR_LEN), job_id=st.none() | nat, kind=st.sampled_from(FRAME_KINDS))
def test_any_exception_text_becomes_an_err_that_round_trips(code: ErrorCode, raw: str, job_id: Any,
                                                            kind: str) -> None:
    """Whatever a problem raises (tracebacks, control characters, any length), error_text makes
    it a message that encodes and decodes unchanged: printable, at most MAX_ERROR_TEXT long."""
    from protocol.codec import error_text
    from protocol.messages import MAX_ERROR_TEXT

    msg = Error(code, error_text(raw), job_id=job_id)
    assert msg.message.isprintable() and len(msg.message) <= MAX_ERROR_TEXT
    if len(raw) <= MAX_ERROR_TEXT and raw.isprintable():
        assert msg.message == raw, "a short printable text travels as it is"
    else:
        assert len(raw) <= MAX_ERROR_TEXT or msg.message.endswith("\u2026")
    assert_same(msg, decode(as_frames(encode(msg), kind)))


worker_rows = st.tuples(ascii_ids, text(MAX_ID_LEN), nat, finite, finite, st.integers(0, 256), nat,
                        st.sampled_from(["loading", "ok", "failing", "benched"]), nat, text(200))


@MAIN
@given(rows=st.lists(worker_rows, max_size=8), failed=nat)
def test_status_with_worker_failures_round_trips(rows: list, failed: int) -> None:
    from ps.drivers.outputs import WORKER_COLUMNS

    msg = Status(token=1, info={"counter.failed": failed, "workers_benched": len(rows)}, columns=WORKER_COLUMNS,
                 rows=tuple(rows))
    assert_same(msg, decode(encode(msg)))


HELLO_HEADER = {"v": 1, "t": "hello", "worker_id": "w", "boot": 0, "credit": 1}
BAD_MSGPACK = {
    "trailing bytes": (msgpack.packb(HELLO_HEADER) + b"\x00", "trailing bytes after the one header object"),
    "cut short": (msgpack.packb(HELLO_HEADER)[:-1], "cut short"),
    "empty frame": (b"", "cut short"),
    "int key": (msgpack.packb({1: 2}), "a map key that is not a str"),
    "bad utf-8": (b"\x81\xa1v\xa2\xff\xfe", "a str that is not valid UTF-8"),
    "bin": (msgpack.packb({**HELLO_HEADER, "x": b"ab"}, use_bin_type=True), "a bin value with data bytes"),
    "ext": (msgpack.packb({**HELLO_HEADER, "x": msgpack.ExtType(1, b"ab")}), "an ext value with data bytes"),
    "timestamp": (b"\x81\xa1a\xc7\x00\xff", "a timestamp ext"),
    "long list": (msgpack.packb({**HELLO_HEADER, "holds": list(range(257))}), "a list longer than 256 elements"),
    "big map": (msgpack.packb({f"k{i}": i for i in range(65)}), "a map of more than 64 entries"),
    "long str": (msgpack.packb({**HELLO_HEADER, "x": "é" * 2049}), "a str longer than 4096 bytes of UTF-8"),
    "deep": (b"\x91" * 1100 + b"\xc0", "nested deeper than 1024 containers"),
    "reserved byte": (b"\xc1", "a byte that starts no msgpack value"),
}


@pytest.mark.parametrize("name", sorted(BAD_MSGPACK))
def test_a_header_that_is_not_msgpack_is_refused_naming_the_rule(name: str) -> None:
    """The error names the rule the header breaks and keeps the library's words, not just
    "header is not valid msgpack: ValueError" (issue 14)."""
    raw, rule = BAD_MSGPACK[name]
    with pytest.raises(RemoteProtocolError) as e:
        decode([raw])
    text = str(e.value)
    assert text.startswith(f"header is not valid msgpack: {rule}"), text
    assert not text.endswith(": ValueError") and len(text) < 400


@pytest.mark.parametrize("frames,why", [
    ([], "message has 0 frames"), ((), "message has 0 frames"),
    ([b"\x80"] * (MAX_ARRAYS + 2), f"message has {MAX_ARRAYS + 2} frames"),
    (tuple([b"\x80"] * (MAX_ARRAYS + 2)), f"message has {MAX_ARRAYS + 2} frames"),
    (5, "frames is not a sequence"), (None, "frames is not a sequence"),
])
def test_the_frame_count_is_refused_whatever_holds_the_frames(frames, why):
    """decode checks a list's frame count itself and anything else's by _frame_count: the same
    refusal either way."""
    with pytest.raises(RemoteProtocolError, match=why):
        decode(frames)


def test_a_message_decodes_the_same_from_a_list_or_a_tuple_of_frames():
    frames = encode(Reply(job_id=3, created_at=4, grads=(np.arange(3, dtype=np.float32),), loss=0.5, count=2,
                          compute_s=0.1))
    a, b = decode(list(frames)), decode(tuple(frames))
    assert a.job_id == b.job_id == 3 and np.array_equal(a.grads[0], b.grads[0])
