"""Pure encode/decode between message dataclasses and ZeroMQ frames.

Layout of one message: ``[header, a0, a1, ...]`` where ``header`` is a msgpack map and each
``a_i`` is the raw little-endian bytes of one array (no copy on send: the numpy array itself
is handed to pyzmq; no copy on receive: ``np.frombuffer`` over the frame's buffer).

``decode`` is where trust stops. It accepts anything (bytes, memoryviews, zmq.Frame objects)
and either returns a fully validated message or raises :class:`RemoteProtocolError`, never
anything else. No pickle, no ``np.dtype()`` on peer strings.

Both directions try the fast path first (protocol/fastcodec.py: msgspec structs for ``job``,
``reply``, ``hb`` and ``ready``), which accepts or declines and never decides an error; what
it declines goes through :func:`decode_reference` / :func:`encode_reference`, the schema
below, which define the result.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, fields
from typing import Any, Callable, Sequence

import msgpack
import numpy as np

from protocol.errors import LocalProtocolError, RemoteProtocolError, UnsupportedVersion
from protocol.fastcodec import decode_fast, encode_fast
from protocol.messages import (
    ALLOWED_DTYPES,
    DEFAULT_MAX_ARRAY_BYTES,
    MAX_ARRAYS,
    MAX_ERROR_TEXT,
    MAX_HEADER_BYTES,
    MAX_ID_LEN,
    MAX_LIST_LEN,
    MAX_MAP_LEN,
    MAX_NDIM,
    MAX_PARTS,
    MAX_SPIN_US,
    MAX_STR_LEN,
    PROTOCOL_VERSION,
    SEAL_CIPHERS,
    SEAL_SESSION_BYTES,
    TYPE_NAMES,
    TYPES_BY_NAME,
    WIRE_DTYPES,
    Bye,
    Cancel,
    Error,
    ErrorCode,
    Fetch,
    Heartbeat,
    Hello,
    Job,
    JobKind,
    Part,
    Ready,
    Reply,
    Status,
    StatusRequest,
    Welcome,
)

_DTYPE_NAMES = {v: k for k, v in ALLOWED_DTYPES.items()}
U64_MAX = (1 << 64) - 1
I64_MAX = (1 << 63) - 1
I64_MIN = -(1 << 63)


# --------------------------------------------------------------------------- field checkers
# Each checker takes the raw msgpack value and returns the Python value or raises ValueError.

def _int(lo: int, hi: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if type(v) is not int or not lo <= v <= hi:
            raise ValueError(f"expected an integer in [{lo}, {hi}], got {v!r:.80}")
        return v
    return check


def _str(max_len: int, *, nonempty: bool = False) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if type(v) is not str or len(v) > max_len or (nonempty and not v):
            raise ValueError(f"expected a string of at most {max_len} characters, got {v!r:.80}")
        if not v.isprintable():
            raise ValueError("string holds non-printable characters")
        return v
    return check


def _float(v: Any) -> float:
    if type(v) is int and not I64_MIN <= v <= U64_MAX:  # msgpack cannot carry it (nor float() some of them)
        raise ValueError(f"expected a finite number, got an integer out of range {v!r:.80}")
    if type(v) not in (int, float) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"expected a finite number, got {v!r:.80}")
    return float(v)


def _number(v: Any) -> float:
    """Any float, NaN and infinities included (a worker's loss: the server judges it)."""
    if type(v) is float:
        return v
    return _float(v)


def _ascii_id(v: Any) -> str:
    s = _str(MAX_ID_LEN, nonempty=True)(v)
    if not s.isascii():
        raise ValueError("ids are printable ASCII")
    return s


def _optional(inner: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        return None if v is None else inner(v)
    return check


def _int_tuple(lo: int, hi: int, max_len: int = MAX_LIST_LEN) -> Callable[[Any], tuple]:
    item = _int(lo, hi)

    def check(v: Any) -> tuple:
        if type(v) is not list or len(v) > max_len:
            raise ValueError(f"expected a list of at most {max_len} integers")
        return tuple(item(x) for x in v)
    return check


def _pair(v: Any) -> tuple[int, int]:
    t = _int_tuple(0, I64_MAX, 2)(v)
    if len(t) != 2 or t[0] > t[1]:
        raise ValueError(f"expected a range [lo, hi] with lo <= hi, got {v!r:.80}")
    return t


def _enum(cls: type) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if type(v) is not int:
            raise ValueError(f"expected a {cls.__name__} code")
        try:
            return cls(v)
        except ValueError:
            raise ValueError(f"unknown {cls.__name__} code {v}") from None
    return check


def _options(v: Any) -> dict:
    if type(v) is not dict or len(v) > MAX_MAP_LEN:
        raise ValueError("expected a map of options")
    out = {}
    for k, val in v.items():
        _str(MAX_ID_LEN, nonempty=True)(k)
        if type(val) is str:
            _str(MAX_STR_LEN)(val)
        elif type(val) in (int, float):
            _float(val)
        elif type(val) is not bool:
            raise ValueError(f"option {k!r} must be a string, number or boolean")
        out[k] = val
    return out


_ID = _ascii_id


def _names(v: Any) -> tuple:
    if type(v) is not list or len(v) > 16:
        raise ValueError("expected a list of at most 16 column names")
    return tuple(_str(MAX_ID_LEN, nonempty=True)(x) for x in v)


def _scalar(v: Any) -> Any:
    if type(v) is str:
        return _str(MAX_STR_LEN)(v)
    if type(v) is float:
        return _number(v)
    if type(v) in (int, bool):
        return v if type(v) is bool else _int(I64_MIN, U64_MAX)(v)
    raise ValueError("row values are strings, numbers or booleans")


def _rows(v: Any) -> tuple:
    if type(v) is not list or len(v) > MAX_LIST_LEN:
        raise ValueError(f"expected a list of at most {MAX_LIST_LEN} rows")
    out = []
    for row in v:
        if type(row) is not list or len(row) > 16:
            raise ValueError("a row is a list of at most 16 values")
        out.append(tuple(_scalar(x) for x in row))
    return tuple(out)
def _bool(v: Any) -> bool:
    if type(v) is not bool:
        raise ValueError(f"expected a boolean, got {v!r:.80}")
    return v


def _choice(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if type(v) is not str or v not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {v!r:.80}")
        return v
    return check


def _shards(v: Any) -> tuple:
    """Welcome.shards: at most 64 (endpoint, lo, hi), contiguous ranges from 0 in order."""
    if type(v) is not list or len(v) > 64:
        raise ValueError("expected a list of at most 64 shards")
    out, end = [], 0
    for s in v:
        if type(s) is not list or len(s) != 3:
            raise ValueError("a shard is [endpoint, lo, hi]")
        ep, lo, hi = _str(MAX_STR_LEN, nonempty=True)(s[0]), _int(0, I64_MAX)(s[1]), _int(0, I64_MAX)(s[2])
        if lo != end or hi < lo:
            raise ValueError(f"shard ranges must be contiguous from 0, got [{lo}, {hi}) after {end}")
        out.append((ep, lo, hi))
        end = hi
    return tuple(out)


def _session(v: Any) -> str:
    """Welcome.seal: empty, or a session's keys and token in hex (protocol/seal.py)."""
    if not isinstance(v, str) or len(v) not in (0, 2 * SEAL_SESSION_BYTES) or v.strip("0123456789abcdef"):
        raise RemoteProtocolError(f"seal must be empty or {SEAL_SESSION_BYTES} bytes in lowercase hex")
    return v


_U64 = _int(0, U64_MAX)
_NAT = _int(0, I64_MAX)
_CREDIT = _int(1, MAX_LIST_LEN)  # busy lists are capped at MAX_LIST_LEN
_VER = _int(0, 0xFFFF)
_IDS = _int_tuple(0, I64_MAX)

# Per message type: field name -> checker. Array-valued fields are listed in _ARRAY_FIELD.
_SCHEMA: dict[type, dict[str, Callable[[Any], Any]]] = {
    Hello: {"worker_id": _ID, "boot": _U64, "credit": _CREDIT, "vmin": _VER, "vmax": _VER,
            "device": _str(MAX_ID_LEN), "host_id": _str(MAX_STR_LEN), "holds": _IDS, "busy": _IDS,
            "seen": _int(-1, I64_MAX), "run_id": _U64, "shm": _bool, "parts": _bool,
            "shards": _bool, "seal": _bool, "seal_segments": _bool, "seal_ciphers": _names,
            "cpus": _int(0, 0xFFFF)},
    Welcome: {"server_boot": _U64, "run_id": _U64, "version": _VER, "problem": _str(MAX_STR_LEN, nonempty=True),
              "problem_options": _options, "heartbeat_interval_s": _float, "liveness_timeout_s": _float,
              "wire_dtype": _choice(WIRE_DTYPES), "shm": _str(MAX_ID_LEN), "parts": _bool, "shards": _shards,
              "seal": _session, "seal_segments": _bool, "seal_cipher": _choice(("", *SEAL_CIPHERS))},
    Ready: {"credit": _int(0, MAX_LIST_LEN), "holds": _IDS, "shm": _bool},
    Job: {"job_id": _NAT, "kind": _enum(JobKind), "created_at": _NAT, "iterate_ids": _int_tuple(0, I64_MAX, 2),
          "seed": _U64, "batch_size": _int(1, 1 << 30), "shard": _optional(_pair),
          "deadline": _optional(_NAT), "point_ids": _int_tuple(0, I64_MAX, 2),
          "refs": _int_tuple(0, I64_MAX, 2), "grad_slots": _int_tuple(0, I64_MAX, 2), "xfer": _U64,
          "spin_us": _int(0, MAX_SPIN_US)},
    Reply: {"job_id": _NAT, "created_at": _NAT, "loss": _optional(_number), "count": _NAT,
            "compute_s": _float, "holds": _IDS, "in_shm": _bool, "xfer": _U64},
    Part: {"xfer": _int(1, U64_MAX), "index": _int(0, MAX_PARTS - 1), "count": _int(1, MAX_PARTS)},
    Heartbeat: {"boot": _U64, "credit": _int(0, MAX_LIST_LEN), "busy": _IDS, "seen": _int(-1, I64_MAX)},
    Cancel: {"job_ids": _IDS},
    Bye: {"reason": _str(MAX_STR_LEN)},
    Error: {"code": _enum(ErrorCode), "message": _str(MAX_STR_LEN), "job_id": _optional(_NAT),
            "iterate_ids": _IDS},
    Fetch: {"job_id": _NAT, "created_at": _NAT, "iterate_ids": _int_tuple(0, I64_MAX, 2)},
    StatusRequest: {"token": _U64},
    Status: {"token": _U64, "info": _options, "columns": _names, "rows": _rows},
}
_ARRAY_FIELD: dict[type, str] = {Job: "points", Reply: "grads"}
# Fields added after the first release of version 1 (same-host path, wire dtype): left out of
# the header while at their default.
_OMIT_DEFAULT: dict[str, tuple] = {"shm": (False, ""), "wire_dtype": ("f32",), "refs": ([],), "grad_slots": ([],),
                                   "in_shm": (False,), "parts": (False,), "xfer": (0,),
                                   "shards": ([], False), "seal": (False, ""),
                                   "seal_segments": (False,), "seal_ciphers": ([],), "seal_cipher": ("",),
                                   "cpus": (0,), "spin_us": (0,)}
_DEFAULTS: dict[type, dict[str, Any]] = {
    cls: {f.name: f for f in fields(cls)} for cls in _SCHEMA
}


# --------------------------------------------------------------------------- text

def error_text(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """``text`` as a protocol string: non-printable characters (the newlines of a traceback, odd
    bytes) become spaces, and a text longer than ``limit`` characters is cut to ``limit`` with a
    final "…". The result always encodes (``limit`` is capped at MAX_STR_LEN).

    >>> error_text("line 1\nline 2", 10)
    'line 1 li…'
    """
    limit = max(1, min(limit, MAX_STR_LEN))
    text = "".join(c if c.isprintable() else " " for c in str(text))
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


# --------------------------------------------------------------------------- encode

def _wire_value(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_wire_value(x) for x in v]
    if isinstance(v, (JobKind, ErrorCode)):
        return int(v)
    return v


_HB_ENTRIES = msgpack.packb("v") + msgpack.packb(PROTOCOL_VERSION) + msgpack.packb("t") + msgpack.packb("hb")


def looks_like_heartbeat(header: bytes) -> bool:
    """Whether the header of a one-frame message is a heartbeat as :func:`encode` writes it: a
    msgpack fixmap whose first two entries are ``v`` = PROTOCOL_VERSION and ``t`` = ``"hb"``.
    A test on raw bytes, for the server's receive path (ps/drivers/daemon.py: a connection's identical
    heartbeats queued in a row are one); it decides nothing about validity (the message is
    decoded when it is handled), and a heartbeat encoded otherwise is only not recognised."""
    return len(header) > len(_HB_ENTRIES) and 0x80 <= header[0] <= 0x8F and header.startswith(_HB_ENTRIES, 1)


def encode(msg: Any) -> list[Any]:
    """Encode a message as ``[header_bytes, *arrays]``.

    Arrays are returned as the (C-contiguous) numpy arrays themselves so that
    ``send_multipart(frames, copy=False)`` sends them without a copy. The caller must not
    mutate them until the send has completed (iterates are immutable by design).

    Raises:
        LocalProtocolError: the message is not valid (a bug in the caller).
    """
    fast = encode_fast(msg)  # job, reply, hb, ready: the same bytes, checked in C (protocol/fastcodec.py)
    return fast if fast is not None else encode_reference(msg)


def encode_reference(msg: Any) -> list[Any]:
    """What :func:`encode` returns, by the schema alone (the fast path's reference)."""
    cls = type(msg)
    schema = _SCHEMA.get(cls)
    if schema is None:
        raise LocalProtocolError(f"not a protocol message: {cls.__name__}")
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": TYPE_NAMES[cls]}
    for name, check in schema.items():
        value = _wire_value(getattr(msg, name))
        if name in _OMIT_DEFAULT and value in _OMIT_DEFAULT[name]:
            continue  # optional extensions travel only when used: older peers see the same bytes
        try:
            check(value)
        except ValueError as e:
            raise LocalProtocolError(f"{cls.__name__}.{name}: {e}") from None
        header[name] = value
    arrays: list[Any] = []
    if cls is Part:
        if msg.index >= msg.count:
            raise LocalProtocolError(f"part {msg.index} of {msg.count}")
        arrays.append(msg.data)
    afield = _ARRAY_FIELD.get(cls)
    if afield is not None:
        metas = []
        for a in getattr(msg, afield):
            if not isinstance(a, np.ndarray):
                raise LocalProtocolError(f"{cls.__name__}.{afield} must hold numpy arrays")
            name = _DTYPE_NAMES.get(a.dtype)
            if name is None or a.ndim > MAX_NDIM:
                raise LocalProtocolError(f"array dtype {a.dtype} / ndim {a.ndim} not allowed on the wire")
            if not a.flags.c_contiguous:
                a = np.ascontiguousarray(a)
            metas.append({"dtype": name, "shape": list(a.shape)})
            arrays.append(a)
        if len(arrays) > MAX_ARRAYS:
            raise LocalProtocolError(f"too many arrays ({len(arrays)} > {MAX_ARRAYS})")
        if cls is Job and len(arrays) != len(msg.point_ids):
            raise LocalProtocolError("Job.points and Job.point_ids differ in length")
        header["arrays"] = metas
    hb = msgpack.packb(header, use_bin_type=True)
    if len(hb) > MAX_HEADER_BYTES:
        raise LocalProtocolError(f"header too large ({len(hb)} bytes)")
    return [hb, *arrays]


# --------------------------------------------------------------------------- decode

def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame (copy=False)
    if buf is None:
        try:
            buf = memoryview(frame)
        except TypeError:
            raise RemoteProtocolError(f"frame of type {type(frame).__name__} is not a buffer") from None
    if not buf.c_contiguous:
        raise RemoteProtocolError("frame buffer is not contiguous")
    if buf.ndim != 1 or buf.itemsize != 1:
        buf = buf.cast("B") if buf.nbytes else memoryview(b"")  # cast() refuses zeros in the shape
    return buf


# The msgpack library's texts for the caps of PROTOCOL.md §5 (and §3, §10 step 2), as the rules name them.
_MSGPACK_CAPS = (("max_str_len", "a str longer than 4096 bytes of UTF-8"),
                 ("max_bin_len", "a bin value with data bytes (bin is never valid)"),
                 ("max_ext_len", "an ext value with data bytes (ext values must be empty)"),
                 ("max_array_len", f"a list longer than {MAX_LIST_LEN} elements"),
                 ("max_map_len", f"a map of more than {MAX_MAP_LEN} entries"),
                 ("is not allowed for map key", "a map key that is not a str"),
                 ("incomplete input", "cut short (the header ends inside a value)"),
                 ("invalid timestamp", "a timestamp ext (always refused)"))


def _msgpack_reason(e: BaseException) -> str:
    """Which rule a header that msgpack refused breaks, then the library's own words."""
    text = str(e)
    if isinstance(e, msgpack.ExtraData):
        rule = "trailing bytes after the one header object"
    elif isinstance(e, (msgpack.StackError, RecursionError)):
        rule = "nested deeper than 1024 containers"
    elif isinstance(e, msgpack.FormatError):
        rule = "a byte that starts no msgpack value (0xc1 is reserved)"
    elif isinstance(e, UnicodeDecodeError):
        rule = "a str that is not valid UTF-8"
    else:
        rule = next((r for key, r in _MSGPACK_CAPS if key in text), "")
    detail = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return f"{rule} ({detail:.200})" if rule else f"{detail:.200}"


def _unpack_header(buf: memoryview) -> dict:
    if len(buf) > MAX_HEADER_BYTES:
        raise RemoteProtocolError(f"header frame too large ({len(buf)} bytes)")
    try:
        header = msgpack.unpackb(
            # max_str_len counts UTF-8 bytes; the schema counts code points (at most 4 bytes each).
            buf, raw=False, strict_map_key=True, use_list=True, max_str_len=4 * MAX_STR_LEN, max_bin_len=0,
            max_array_len=MAX_LIST_LEN, max_map_len=MAX_MAP_LEN, max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise RemoteProtocolError(f"header is not valid msgpack: {_msgpack_reason(e)}") from None
    if type(header) is not dict:
        raise RemoteProtocolError("header is not a map")
    return header


def _array_meta(meta: Any, max_array_bytes: int) -> tuple[np.dtype, list, int]:
    """(dtype, shape, bytes) of a valid descriptor."""
    if type(meta) is not dict:
        raise RemoteProtocolError("array descriptor is not a map")
    dtype = ALLOWED_DTYPES.get(meta.get("dtype")) if type(meta.get("dtype")) is str else None
    if dtype is None:
        raise RemoteProtocolError(f"array dtype {meta.get('dtype')!r:.40} not allowed")
    shape = meta.get("shape")
    if type(shape) is not list or len(shape) > MAX_NDIM or any(type(s) is not int or s < 0 for s in shape):
        raise RemoteProtocolError(f"bad array shape {shape!r:.80}")
    # Zero dims count as 1 in the bound: numpy refuses the shape [0, 2**63] as it refuses [2**63].
    bound = dtype.itemsize * math.prod(max(s, 1) for s in shape)
    if bound > max_array_bytes:
        raise RemoteProtocolError(f"array larger than the limit of {max_array_bytes} bytes")
    return dtype, shape, 0 if 0 in shape else bound


def _decode_array(meta: Any, frame: Any, max_array_bytes: int) -> np.ndarray:
    dtype, shape, nbytes = _array_meta(meta, max_array_bytes)
    buf = _buffer(frame)
    if len(buf) != nbytes:
        raise RemoteProtocolError(f"frame holds {len(buf)} bytes, shape {shape} needs {nbytes}")
    a = np.frombuffer(buf, dtype=dtype).reshape(shape)
    if not a.flags.aligned:  # small frames can point into libzmq's receive buffer (PROTOCOL_NOTES 2.2)
        a = a.copy()
    return a


def _frame_count(frames: Any) -> int:
    """How many frames a message has, if that is a valid number (else RemoteProtocolError)."""
    try:
        n = len(frames)
    except TypeError:
        raise RemoteProtocolError("frames is not a sequence") from None
    if not 1 <= n <= 1 + MAX_ARRAYS:
        raise RemoteProtocolError(f"message has {n} frames (1..{1 + MAX_ARRAYS} allowed)")
    return n


def decode(frames: Sequence[Any], *, max_array_bytes: int = DEFAULT_MAX_ARRAY_BYTES,
           payload: Callable[[int, int], Any] | None = None) -> Any:
    """Decode ``[header, *arrays]`` into a message.

    Args:
        frames: the frames after the routing id: bytes, memoryviews or ``zmq.Frame``.
        max_array_bytes: reject any array frame larger than this.
        payload: for a ``job`` or ``reply`` whose arrays came in ``part`` messages (``xfer`` set):
            ``payload(xfer, nbytes)`` returns the reassembled bytes (one contiguous buffer of
            ``nbytes``) or raises RemoteProtocolError; without it such a message is invalid.

    Returns:
        The message dataclass. Arrays are read-only or writable views over the frames
        (no copy), except misaligned small frames, which are copied.

    Raises:
        RemoteProtocolError: for anything that is not a valid message, and only that.
    """
    if type(frames) is not list or not 1 <= len(frames) <= 1 + MAX_ARRAYS:
        _frame_count(frames)  # raises for a count that is not valid (a list's is checked here)
    msg = decode_fast(frames, max_array_bytes)  # job, reply, hb, ready, when valid (protocol/fastcodec.py)
    return msg if msg is not None else decode_reference(frames, max_array_bytes=max_array_bytes, payload=payload)


def decode_reference(frames: Sequence[Any], *, max_array_bytes: int = DEFAULT_MAX_ARRAY_BYTES,
                     payload: Callable[[int, int], Any] | None = None) -> Any:
    """What :func:`decode` returns or raises, by the schema alone: every rule of PROTOCOL.md
    §10 and the error that names the first one broken (the fast path's reference)."""
    n = _frame_count(frames)
    header = _unpack_header(_buffer(frames[0]))
    v = header.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise UnsupportedVersion(f"unsupported protocol version {v!r:.20}")
    t = header.get("t")
    cls = TYPES_BY_NAME.get(t) if type(t) is str else None
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {t!r:.40}")
    kwargs: dict[str, Any] = {}
    defaults = _DEFAULTS[cls]
    for name, check in _SCHEMA[cls].items():
        if name in header:
            try:
                kwargs[name] = check(header[name])
            except ValueError as e:
                raise RemoteProtocolError(f"{t}.{name}: {e}") from None
        elif defaults[name].default is MISSING and defaults[name].default_factory is MISSING:
            raise RemoteProtocolError(f"{t}: missing field {name!r}")
    afield = _ARRAY_FIELD.get(cls)
    metas = header.get("arrays", [])
    if cls is Part:
        if n != 2 or metas:
            raise RemoteProtocolError(f"part carries one data frame, got {n - 1}")
        if kwargs["index"] >= kwargs["count"]:
            raise RemoteProtocolError(f"part {kwargs['index']} of {kwargs['count']}")
        data = _buffer(frames[1])
        if not 0 < len(data) <= max_array_bytes:
            raise RemoteProtocolError(f"part of {len(data)} bytes (1..{max_array_bytes} allowed)")
        kwargs["data"] = data
    elif afield is None:
        if n != 1 or metas:
            raise RemoteProtocolError(f"{t} carries no arrays, got {n - 1} frames")
    elif kwargs.get("xfer"):  # the arrays came before, in parts
        if n != 1 or type(metas) is not list or not 0 < len(metas) <= MAX_ARRAYS:
            raise RemoteProtocolError(f"{t} in parts: header only, with 1..{MAX_ARRAYS} array descriptors")
        specs = [_array_meta(m, max_array_bytes) for m in metas]
        total = sum(nb for _, _, nb in specs)
        if payload is None:
            raise RemoteProtocolError(f"{t} in parts, but parts are not accepted here")
        buf = _buffer(payload(kwargs["xfer"], total))
        if len(buf) != total:
            raise RemoteProtocolError(f"{t}: parts hold {len(buf)} bytes, the arrays need {total}")
        arrays, off = [], 0
        for dtype, shape, nb in specs:
            a = np.frombuffer(buf[off:off + nb], dtype=dtype).reshape(shape)
            arrays.append(a if a.flags.aligned else a.copy())
            off += nb
        kwargs[afield] = tuple(arrays)
        if cls is Job and len(kwargs.get("point_ids", ())) != len(arrays):
            raise RemoteProtocolError("job: point_ids and arrays differ in length")
        return cls(**kwargs)
    else:
        if type(metas) is not list or len(metas) != n - 1:
            raise RemoteProtocolError(f"{t}: header describes {len(metas) if type(metas) is list else '?'} "
                                      f"arrays, {n - 1} frames follow")
        kwargs[afield] = tuple(_decode_array(m, f, max_array_bytes) for m, f in zip(metas, frames[1:], strict=True))
    if cls is Job and len(kwargs.get("point_ids", ())) != n - 1:
        raise RemoteProtocolError("job: point_ids and array frames differ in length")
    return cls(**kwargs)
