"""The codec's fast path: the messages of the training loop decoded and validated in C.

``job``, ``reply``, ``hb`` and ``ready`` are nearly every message a server or worker handles.
Their headers are decoded by msgspec straight into typed structs whose constraints are the
rules of ``protocol/codec.py``'s schema (PROTOCOL.md §10): integer ranges, list lengths,
enum codes, no unknown keys. What msgspec cannot say (finite numbers, a range's order, the
array descriptors against the frames) is checked here after it.

The fast path only ever *accepts* or *declines*; it never refuses. A message it declines
(anything it is not sure of: another type, an unknown key, a value out of range, a bad
frame) goes to the reference decoder, :func:`protocol.codec.decode`, which accepts it or
raises the error the rules name. So for every input, ``decode`` returns what the reference
decoder returns, or raises what it raises (tests/unit/test_fastcodec.py checks both on valid
and on mutated messages); the fast path decides only how quickly.

Encoding the same four types builds the header map in the reference encoder's order (so the
bytes are the same), validates it with the same structs (``msgspec.convert``) and packs it
with msgspec. Should the validation fail, the reference encoder runs and raises its error.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Union

import msgspec
import numpy as np

from protocol.messages import (
    ALLOWED_DTYPES,
    MAX_ARRAYS,
    MAX_HEADER_BYTES,
    MAX_LIST_LEN,
    MAX_NDIM,
    MAX_SPIN_US,
    PROTOCOL_VERSION,
    Heartbeat,
    Job,
    JobKind,
    Ready,
    Reply,
)

_I64_MAX = (1 << 63) - 1
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # the integers msgpack carries

Nat = Annotated[int, msgspec.Meta(ge=0, le=_I64_MAX)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack carries at most 2**64 - 1; the encoder refuses more
Ids = Annotated[tuple[Nat, ...], msgspec.Meta(max_length=MAX_LIST_LEN)]
Ids2 = Annotated[tuple[Nat, ...], msgspec.Meta(max_length=2)]
Credit0 = Annotated[int, msgspec.Meta(ge=0, le=MAX_LIST_LEN)]
Seen = Annotated[int, msgspec.Meta(ge=-1, le=_I64_MAX)]
BatchSize = Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]
SpinUs = Annotated[int, msgspec.Meta(ge=0, le=MAX_SPIN_US)]
Number = Union[float, int]  # noqa: UP007  (msgspec reads the typing form)


class _Array(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_NDIM)]


_Arrays = Annotated[list[_Array], msgspec.Meta(max_length=MAX_ARRAYS)]


class _ReplyH(msgspec.Struct, tag="reply", tag_field="t", forbid_unknown_fields=True):
    v: int
    job_id: Nat
    created_at: Nat
    loss: Union[Number, None] = None  # noqa: UP007
    count: Nat = 0
    compute_s: Number = 0.0
    holds: Ids = ()
    in_shm: bool = False
    xfer: U64 = 0
    arrays: _Arrays = []


class _JobH(msgspec.Struct, tag="job", tag_field="t", forbid_unknown_fields=True):
    v: int
    job_id: Nat
    kind: JobKind
    created_at: Nat
    iterate_ids: Ids2
    seed: U64
    batch_size: BatchSize = 1
    shard: Union[tuple[Nat, Nat], None] = None  # noqa: UP007
    deadline: Union[Nat, None] = None  # noqa: UP007
    point_ids: Ids2 = ()
    refs: Ids2 = ()
    grad_slots: Ids2 = ()
    xfer: U64 = 0
    spin_us: SpinUs = 0
    arrays: _Arrays = []


class _HeartbeatH(msgspec.Struct, tag="hb", tag_field="t", forbid_unknown_fields=True):
    v: int
    boot: U64
    credit: Credit0 = 0
    busy: Ids = ()
    seen: Seen = -1


class _ReadyH(msgspec.Struct, tag="ready", tag_field="t", forbid_unknown_fields=True):
    v: int
    credit: Credit0
    holds: Ids = ()
    shm: bool = False


_HEADERS = Union[_ReplyH, _JobH, _HeartbeatH, _ReadyH]  # noqa: UP007
_DECODER = msgspec.msgpack.Decoder(_HEADERS)
_ENCODER = msgspec.msgpack.Encoder()
_STRUCT_OF = {Reply: _ReplyH, Job: _JobH, Heartbeat: _HeartbeatH, Ready: _ReadyH}
_DTYPE_NAMES = {v: k for k, v in ALLOWED_DTYPES.items()}


# --------------------------------------------------------------------------- decode

def _rules_past_types(h: Any) -> bool:
    """The schema's rules that the struct types do not state: a finite compute time, a
    shard range with lo <= hi."""
    if type(h) is _ReplyH:
        c, loss = h.compute_s, h.loss
        return ((math.isfinite(c) if type(c) is float else _INT_MIN <= c <= _INT_MAX)
                and (type(loss) is not int or _INT_MIN <= loss <= _INT_MAX))
    if type(h) is _JobH:
        return h.shard is None or h.shard[0] <= h.shard[1]
    return True


def _frame_buffer(frame: Any) -> memoryview | None:
    buf = getattr(frame, "buffer", None)  # zmq.Frame (copy=False)
    if buf is None:
        try:
            buf = memoryview(frame)
        except TypeError:
            return None
    if not buf.c_contiguous or buf.ndim != 1 or buf.itemsize != 1:
        return None  # the reference decoder casts or refuses it
    return buf


def _arrays(metas: list, frames: Any, n: int, max_array_bytes: int) -> tuple | None:
    """The arrays of frames[1:] as the descriptors say, or None (declined)."""
    if len(metas) != n - 1:
        return None
    out = []
    for i, m in enumerate(metas):
        dtype = ALLOWED_DTYPES.get(m.dtype)
        if dtype is None:
            return None
        shape = m.shape
        if len(shape) == 1:  # vectors: no reshape
            bound = dtype.itemsize * max(shape[0], 1)
            nbytes = dtype.itemsize * shape[0]
        else:
            bound = dtype.itemsize * math.prod(max(s, 1) for s in shape)
            nbytes = 0 if 0 in shape else bound
        if bound > max_array_bytes:
            return None
        buf = _frame_buffer(frames[i + 1])
        if buf is None or len(buf) != nbytes:
            return None
        a = np.frombuffer(buf, dtype=dtype)
        if len(shape) != 1:
            a = a.reshape(shape)
        out.append(a if a.flags.aligned else a.copy())  # small frames can point into libzmq's buffer
    return tuple(out)


def decode_fast(frames: Any, max_array_bytes: int) -> Any:
    """The message, if it is a valid ``reply``, ``job``, ``hb`` or ``ready`` with its arrays in
    frames (no parts); else None (the reference decoder decides)."""
    n = len(frames)
    if not 1 <= n <= 1 + MAX_ARRAYS:
        return None
    head = _frame_buffer(frames[0])
    if head is None or len(head) > MAX_HEADER_BYTES:
        return None
    try:
        h = _DECODER.decode(head)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if h.v != PROTOCOL_VERSION or not _rules_past_types(h):
        return None
    cls = type(h)
    if cls is _ReplyH:
        if h.xfer:
            return None
        grads = _arrays(h.arrays, frames, n, max_array_bytes)
        if grads is None:
            return None
        loss = h.loss if h.loss is None or type(h.loss) is float else float(h.loss)
        return Reply(h.job_id, h.created_at, grads, loss, h.count, float(h.compute_s), h.holds, h.in_shm, 0)
    if cls is _JobH:
        if h.xfer or len(h.point_ids) != n - 1:
            return None
        points = _arrays(h.arrays, frames, n, max_array_bytes)
        if points is None:
            return None
        return Job(h.job_id, h.kind, h.created_at, h.iterate_ids, h.seed, h.batch_size, h.shard, h.deadline,
                   h.point_ids, points, h.refs, h.grad_slots, 0, h.spin_us)
    if n != 1:
        return None
    if cls is _HeartbeatH:
        return Heartbeat(h.boot, h.credit, h.busy, h.seen)
    return Ready(h.credit, h.holds, h.shm)


# --------------------------------------------------------------------------- encode

def _w(v: Any) -> Any:
    """A list of ids as the header holds it. Its items are left as they are: anything but plain
    integers fails the struct check, and the reference encoder decides."""
    return list(v) if type(v) is tuple else v


def _header(msg: Any) -> dict | None:
    """The header map the reference encoder builds for ``msg`` (same keys, same order), without
    its checks; None for the types the fast path does not encode."""
    cls = type(msg)
    if cls is Reply:
        holds = msg.holds
        h = {"v": PROTOCOL_VERSION, "t": "reply", "job_id": msg.job_id, "created_at": msg.created_at,
             "loss": msg.loss, "count": msg.count, "compute_s": msg.compute_s,
             "holds": list(holds) if type(holds) is tuple else holds}  # _w inline, as every reply pays this
        if msg.in_shm not in (False,):
            h["in_shm"] = msg.in_shm
        if msg.xfer not in (0,):
            h["xfer"] = msg.xfer
        return h
    if cls is Job:  # the lists inline (_w), as every job sent pays this
        kind = int(msg.kind) if isinstance(msg.kind, JobKind) else msg.kind
        its, shard, pids, refs, slots = msg.iterate_ids, msg.shard, msg.point_ids, msg.refs, msg.grad_slots
        h = {"v": PROTOCOL_VERSION, "t": "job", "job_id": msg.job_id, "kind": kind,
             "created_at": msg.created_at, "iterate_ids": list(its) if type(its) is tuple else its,
             "seed": msg.seed, "batch_size": msg.batch_size, "shard": list(shard) if type(shard) is tuple else shard,
             "deadline": msg.deadline, "point_ids": list(pids) if type(pids) is tuple else pids}
        refs, slots = list(refs) if type(refs) is tuple else refs, list(slots) if type(slots) is tuple else slots
        if refs not in ([],):
            h["refs"] = refs
        if slots not in ([],):
            h["grad_slots"] = slots
        if msg.xfer not in (0,):
            h["xfer"] = msg.xfer
        if msg.spin_us not in (0,):
            h["spin_us"] = msg.spin_us
        return h
    if cls is Heartbeat:
        return {"v": PROTOCOL_VERSION, "t": "hb", "boot": msg.boot, "credit": msg.credit, "busy": _w(msg.busy),
                "seen": msg.seen}
    if cls is Ready:
        h = {"v": PROTOCOL_VERSION, "t": "ready", "credit": msg.credit, "holds": _w(msg.holds)}
        if msg.shm not in (False, ""):
            h["shm"] = msg.shm
        return h
    return None


def encode_fast(msg: Any) -> list | None:
    """``[header_bytes, *arrays]`` as :func:`protocol.codec.encode` makes them, for a valid
    ``reply``, ``job``, ``hb`` or ``ready``; None for anything else or anything in doubt (the
    reference encoder then encodes it or raises)."""
    h = _header(msg)
    if h is None:
        return None
    cls = type(msg)
    arrays: list = []
    if cls is Reply or cls is Job:
        metas, given = [], msg.grads if cls is Reply else msg.points
        if type(given) is not tuple:
            return None
        for a in given:
            if type(a) is not np.ndarray or a.ndim > MAX_NDIM or not a.flags.c_contiguous:
                return None
            name = _DTYPE_NAMES.get(a.dtype)
            if name is None:
                return None
            metas.append({"dtype": name, "shape": list(a.shape)})
            arrays.append(a)
        h["arrays"] = metas
    try:
        if not _rules_past_types(msgspec.convert(h, _STRUCT_OF[cls])):
            return None
    except msgspec.ValidationError:
        return None
    if cls is Job and len(arrays) != len(msg.point_ids):
        return None
    if cls is Reply and msg.loss is not None and type(msg.loss) is not float:
        return None  # the reference encoder's rules for an integer loss
    try:
        hb = _ENCODER.encode(h)
    except (OverflowError, msgspec.EncodeError):  # an integer past 2**64 - 1
        return None
    if len(hb) > MAX_HEADER_BYTES:
        return None
    return [hb, *arrays]
