"""Reduced-precision transfer of iterates and gradients (``--wire-dtype``, PROTOCOL.md §6.12).

The server and the algorithms always compute in float32. Only the array frames of ``Job.points``
and ``Reply.grads`` travel in the run's wire dtype (``Welcome.wire_dtype``):

============  ==================  ==========================================================
wire dtype    frame dtype         conversion
============  ==================  ==========================================================
``"f32"``     ``<f4`` (float32)   none (the identity; no copy)
``"f16"``     ``<f2`` (float16)   IEEE round-to-nearest-even; |x| beyond 65504 becomes ±inf
``"bf16"``    ``<u2`` (uint16)    the bfloat16 bits (upper half of the float32 bits), rounded
                                  to nearest, ties to even; ±inf kept; NaN kept NaN (quiet)
============  ==================  ==========================================================

Overflow in f16 is visible, never silent: a gradient beyond the f16 range arrives as ±inf and
the server refuses it (``NON_FINITE``); an iterate beyond it makes the worker's gradient
non-finite, which is refused the same way. bfloat16 has float32's exponent range, so only
values within half a bf16 ulp of float32's largest finite value round up to ±inf.

The transport layers (daemon, worker, simulator) call these functions; nothing else sees the
wire representation. Numpy only.
"""

from __future__ import annotations

import numpy as np

from protocol.messages import WIRE_DTYPES

#: The frame dtype of each wire dtype (the codec's allow-list holds all three).
WIRE_NUMPY: dict[str, np.dtype] = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype("<u2")}

_F32 = np.dtype("<f4")
_BF16_QUIET = np.uint32(0x0040)  # the top mantissa bit of a bfloat16: set on every NaN


def check_wire(wire: str) -> str:
    """Return ``wire`` if it names a wire dtype (``"f32"``, ``"f16"``, ``"bf16"``).

    Raises:
        ValueError: any other value.
    """
    if not isinstance(wire, str) or wire not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {wire!r} (choose one of {', '.join(WIRE_DTYPES)})")
    return wire


def _check_out(out: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, what: str) -> None:
    if not isinstance(out, np.ndarray) or out.dtype != dtype or out.shape != shape:
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(f"{what}: out must be a {dtype} array of shape {shape}, got {got}")
    if not out.flags.writeable:
        raise ValueError(f"{what}: out is read-only")


def to_wire(x: np.ndarray, wire: str, out: np.ndarray | None = None) -> np.ndarray:
    """The wire representation of a float32 array.

    Args:
        x: float32 array (any shape; need not be contiguous).
        wire: ``"f32"``, ``"f16"`` or ``"bf16"``.
        out: optional preallocated result (dtype ``WIRE_NUMPY[wire]``, shape ``x.shape``).

    Returns:
        ``"f32"``: ``x`` itself (no copy), or ``out`` filled with a copy. ``"f16"``: a float16
        array (``x.astype("<f2")``: nearest-even; values beyond ±65504 become ±inf).
        ``"bf16"``: a uint16 array of bfloat16 bits, rounded to nearest with ties to even; ±inf
        stay ±inf, NaN stays NaN (quiet, sign kept), subnormals round like any other value.

    Raises:
        ValueError: unknown ``wire``, ``x`` not float32, or an ``out`` of the wrong dtype/shape.
    """
    check_wire(wire)
    if not isinstance(x, np.ndarray) or x.dtype != _F32:
        raise ValueError(f"to_wire expects a float32 array, got {getattr(x, 'dtype', type(x).__name__)}")
    if out is not None:
        _check_out(out, x.shape, WIRE_NUMPY[wire], "to_wire")
    if wire == "f32":
        if out is None:
            return x
        np.copyto(out, x)
        return out
    if wire == "f16":
        with np.errstate(over="ignore"):  # overflow to ±inf is the documented behaviour
            if out is None:
                return x.astype("<f2")
            np.copyto(out, x, casting="same_kind")
        return out
    # bf16: round to nearest even on the bits. For every non-NaN float32 the sum stays below
    # 2^32 (the largest is -inf = 0xFF800000 + 0x8000), so uint32 arithmetic does not wrap there;
    # NaNs, where it may, are overwritten below.
    u = x.view(np.uint32)
    t = u >> 16
    t &= 1
    t += np.uint32(0x7FFF)
    t += u
    t >>= 16
    if out is None:
        out = t.astype("<u2")
    else:
        np.copyto(out, t, casting="unsafe")  # t < 2^16 after the shift: exact
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((u[nan] >> 16) | _BF16_QUIET).astype("<u2")
    return out


def from_wire(a: np.ndarray, wire: str, out: np.ndarray | None = None) -> np.ndarray:
    """Back to float32 (exact: every f16 and bf16 value is a float32 value).

    Args:
        a: an array of the dtype ``wire`` implies (``"f32"``: float32, ``"f16"``: float16,
            ``"bf16"``: uint16 bfloat16 bits), little-endian, as the codec decodes it.
        wire: ``"f32"``, ``"f16"`` or ``"bf16"``.
        out: optional preallocated float32 result of shape ``a.shape``.

    Returns:
        ``"f32"``: ``a`` itself (no copy), or ``out`` filled with a copy; otherwise a new float32
        array (or ``out``).

    Raises:
        ValueError: unknown ``wire``, ``a`` of another dtype (e.g. a reply in float32 when the
            run's wire dtype is bf16), or an ``out`` of the wrong dtype/shape.
    """
    check_wire(wire)
    want = WIRE_NUMPY[wire]
    if not isinstance(a, np.ndarray) or a.dtype != want:
        got = getattr(a, "dtype", type(a).__name__)
        raise ValueError(f"wire dtype {wire} expects {want.str} ({want.name}) frames, got {got}")
    if out is not None:
        _check_out(out, a.shape, _F32, "from_wire")
    if wire == "f32":
        if out is None:
            return a
        np.copyto(out, a)
        return out
    if wire == "f16":
        if out is None:
            return a.astype(np.float32)
        np.copyto(out, a)
        return out
    if out is None:
        return (a.astype(np.uint32) << 16).view(np.float32)
    ou = out.view(np.uint32)
    np.copyto(ou, a)
    ou <<= 16
    return out


def roundtrip(x: np.ndarray, wire: str) -> np.ndarray:
    """What the receiver sees of ``x`` (float32): ``from_wire(to_wire(x, wire), wire)``.
    ``"f32"`` returns ``x`` itself."""
    return from_wire(to_wire(x, wire), wire)


def grads_from_wire(grads: tuple, wire: str) -> tuple[tuple, str | None]:
    """A reply's gradient frames as float32, or why they cannot be: ``(grads, None)`` when every
    frame has the wire's dtype (converted), else ``(grads unchanged, reason)``. Under ``"f32"``
    any float frame passes unchanged (the server converts and checks it, PROTOCOL.md §8.2)."""
    if wire == "f32":
        return grads, None
    try:
        return tuple(from_wire(g, wire) for g in grads), None
    except ValueError as e:
        return grads, f"gradient frame dtype does not match the wire dtype: {e}"


def frame_nbytes(n: int, wire: str) -> int:
    """Bytes of an ``n``-element array frame in ``wire`` (4·n for f32, 2·n for f16 and bf16)."""
    return n * WIRE_NUMPY[check_wire(wire)].itemsize


__all__ = ["WIRE_DTYPES", "WIRE_NUMPY", "check_wire", "frame_nbytes", "from_wire", "grads_from_wire", "roundtrip",
           "to_wire"]
