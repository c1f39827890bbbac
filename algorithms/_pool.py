"""A pool of large iterate buffers, reused once nothing references them any more.

Every step of a per-reply method publishes a new immutable iterate (it may still be in
flight, zero-copy, to a worker, or held by the job ledger). Allocating a fresh 40 MB array
per step costs page faults that dominate the step itself at d = 10^7 (9 ms against 3.7 ms
for the arithmetic into a warm buffer, measured on the 2-core test machine). The pool hands
back an old buffer only when the pool is its sole owner: no iterate store entry, algorithm
state, numpy view or pending ZeroMQ frame (pyzmq keeps a reference until libzmq has sent
the bytes) points at it. Reference counts make that exact, with no release calls to forget.

``factory`` decides where new buffers live: plain numpy memory by default; the daemon
installs a shared-memory allocator for the same-host path (protocol/shm.py) so that publishing an
iterate to same-host workers costs no copy. Small arrays bypass the pool (malloc is cheaper
than a scan). Used by one server loop at a time (not thread-safe; the core is single-threaded).
"""

from __future__ import annotations

import math
import sys
from typing import Callable

import numpy as np

MIN_POOLED_BYTES = 256 * 1024  # below this, np.empty (malloc, no page faults) wins
KEEP_FREE = 2  # free buffers kept per shape; more are let go


class ArrayPool:
    """Buffers by dtype and shape, handed out again when only the pool refers to them."""

    # references getrefcount sees to a buffer nobody else holds: the list, its copy, the loop variable, the argument
    UNSHARED = 4

    def __init__(self, factory: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None = None) -> None:
        self.factory = factory
        self._arrays: dict[tuple, list[np.ndarray]] = {}
        self.allocated = 0  # buffers created (a test and the benchmark read it)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A writable array of ``shape`` and ``dtype`` with arbitrary contents."""
        dtype = np.dtype(dtype)
        nbytes = dtype.itemsize * math.prod(shape)
        if nbytes < MIN_POOLED_BYTES:
            return np.empty(shape, dtype)
        key = (tuple(shape), dtype.str)
        arrays = self._arrays.setdefault(key, [])
        found = None
        spare = 0
        for a in list(arrays):
            if sys.getrefcount(a) > self.UNSHARED:
                continue
            if found is None:
                found = a
            elif spare < KEEP_FREE:
                spare += 1
            else:
                arrays[:] = [b for b in arrays if b is not a]  # let it go (shared memory unmaps with it)
        if found is not None:
            found.setflags(write=True)
            return found
        a = self.factory(tuple(shape), dtype) if self.factory is not None else np.empty(shape, dtype)
        arrays.append(a)
        self.allocated += 1
        return a

    def clear(self) -> None:
        self._arrays.clear()

    def size(self) -> int:
        """Buffers held (in use or free)."""
        return sum(len(v) for v in self._arrays.values())


POOL = ArrayPool()


# Cache blocking. The vector kernels below walk their arrays BLOCK elements at a time and do,
# per block, exactly the numpy ufunc calls (same operands, same order) that the plain form does
# over the whole arrays: the ufuncs are elementwise, so every element is rounded the same way and
# the results are bit-identical; what changes is that a block's intermediate (y after the
# multiply, the scratch of add_scaled, g for the finiteness dot) is still in cache when the next
# operation reads it. Below BLOCKED_MIN elements, or for arrays that are not equal-length 1-D
# vectors, the plain whole-array form runs. Sizes measured with benchmarks/kernels.py on the
# 2-core test machine (512 KiB L2 per core, 32 MiB L3, memory ~9 GB/s): blocks of 32K-256K
# float32 were within the machine's noise of each other at d = 1e6-1e7, 32K the slowest (the
# Python cost per block is about 2-4 us: the ufunc calls, the slices, the BLAS dot); 128K
# (512 KiB per float32 array, the block's x, g and y in L3) was the best or tied.
BLOCK = 131072
BLOCKED_MIN = 2 * BLOCK


# Block scratch, one per dtype (a fresh 256-512 KiB malloc per call would fault pages). Like
# POOL, it belongs to the one thread that runs the core (the daemon's loop, the simulator).
_SCRATCH: dict[str, np.ndarray] = {}


def _scratch(dtype: np.dtype) -> np.ndarray:
    """A BLOCK-element scratch array of ``dtype`` (contents arbitrary)."""
    cache = _SCRATCH
    t = cache.get(dtype.str)
    if t is None or t.shape[0] != BLOCK:
        t = cache[dtype.str] = np.empty(BLOCK, dtype)
    return t


def _blocked(n: int, *arrays: np.ndarray) -> bool:
    return n >= BLOCKED_MIN and all(a.ndim == 1 and a.shape[0] == n for a in arrays)


def step_into(x: np.ndarray, lr: float, d: np.ndarray) -> np.ndarray:
    """A new read-only iterate ``x - lr·d`` in a pooled buffer.

    Bit-identical to ``x - np.asarray(lr, x.dtype) * d`` (fl(x + fl(-lr·d)), and negation is
    exact), with no temporary: per block of BLOCK elements ``np.multiply(d, -lr, out=y)`` then
    ``np.add(x, y, out=y)``, so d and x are read once and y written once, its block still in
    cache for the add.
    """
    # below MIN_POOLED_BYTES the pool's answer is np.empty: taken here without its call
    y = np.empty(x.shape, x.dtype) if x.nbytes < MIN_POOLED_BYTES else POOL.empty(x.shape, x.dtype)
    c = np.asarray(-lr, x.dtype)
    n = x.shape[0] if x.ndim == 1 else 0
    if n >= BLOCKED_MIN and _blocked(n, d):
        for i in range(0, n, BLOCK):
            j = i + BLOCK
            yb = y[i:j]
            np.multiply(d[i:j], c, out=yb)
            np.add(x[i:j], yb, out=yb)
    else:
        np.multiply(d, c, out=y)
        np.add(x, y, out=y)
    y.setflags(write=False)
    return y


def finite(g: np.ndarray) -> bool:
    """True iff every element of the floating-point array ``g`` is finite (no NaN, no ±Inf).

    Exact, and the same test as ``math.isfinite(np.dot(g, g)) or np.isfinite(g).all()``: one BLAS
    pass over g, whose dot with itself is finite unless g holds NaN/Inf or the sum of squares
    overflows; only then is g looked at element by element (so a huge but finite g is still True).
    Any shape (the dot is taken over ``g.reshape(-1)``)."""
    v = g if g.ndim == 1 else g.reshape(-1)
    return math.isfinite(np.dot(v, v)) or bool(np.isfinite(v).all())


def squares_finite(g: np.ndarray) -> bool:
    """True iff the square of every element of ``g`` is finite in g's dtype (so no NaN, no ±Inf,
    and no value of magnitude past the square root of the dtype's largest: about 1.8e19 in
    float32, 1.3e154 in float64). The refusal rule of runs with ``refuse_overflow``
    (ps/core/config.py): a value that large, stepped, puts the iterate where honest gradients
    overflow, and it is never a gradient of a model one trains.

    Exact and cheap like :func:`finite`: one BLAS dot of g with itself. The dot, in any summation
    order, is at least the largest rounded square (rounding is monotone and every term is >= 0),
    so a finite dot proves every square finite; only otherwise are the squares looked at one by one."""
    v = g if g.ndim == 1 else g.reshape(-1)
    if math.isfinite(np.dot(v, v)):
        return True
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.square(v)).all())


def _block_ok(gb: np.ndarray, squares: bool) -> bool:
    """The refusal test of one block whose dot with itself is not finite (the rare path)."""
    if not squares:
        return bool(np.isfinite(gb).all())
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.square(gb)).all())


def step_into_checked(x: np.ndarray, lr: float, g: np.ndarray, squares: bool = False) -> np.ndarray | None:
    """``step_into(x, lr, g)`` if ``finite(g)``, else None; one pass over g instead of two.

    Contract: returns None exactly when g holds a NaN or an Inf (the test of :func:`finite`,
    exact: a finite g whose sum of squares overflows still steps). Otherwise returns a new
    read-only pooled array bit-identical to ``step_into(x, lr, g)`` (and so to
    ``x - np.asarray(lr, x.dtype) * g``, computed with the same dtype rules: pass g already in
    x's dtype if that is what the algorithm would see). x is never written; on None the partly
    written buffer is dropped, and the pool hands it out again. Blocked like step_into: per block
    the dot of g's block with itself (and, only if that is not finite, ``np.isfinite`` of the
    block) while the block is in cache, then the multiply and the add. Stops at the first block
    that is not finite. Shapes other than equal-length 1-D vectors, and short ones, run
    ``finite`` then ``step_into``. ``squares``: the test is :func:`squares_finite` instead (None
    also when a value's square overflows), at the same cost: the block's dot is taken anyway.
    """
    n = x.shape[0] if x.ndim == 1 else 0
    if n < BLOCKED_MIN or not _blocked(n, g):
        return step_into(x, lr, g) if (squares_finite(g) if squares else finite(g)) else None
    y = POOL.empty(x.shape, x.dtype)
    c = np.asarray(-lr, x.dtype)
    isfinite = math.isfinite
    for i in range(0, n, BLOCK):
        j = i + BLOCK
        gb = g[i:j]
        if not isfinite(np.dot(gb, gb)) and not _block_ok(gb, squares):
            return None  # y's last reference goes with this frame: the pool reuses it
        yb = y[i:j]
        np.multiply(gb, c, out=yb)
        np.add(x[i:j], yb, out=yb)
    y.setflags(write=False)
    return y


def add_scaled(m: np.ndarray, a: float, g: np.ndarray) -> None:
    """``m += a·g`` in place, without an array-sized temporary; bit-identical to
    ``m += np.asarray(a, m.dtype) * g``: per block ``np.multiply(g, a, out=t)`` into a block-sized
    scratch then ``m += t`` (the plain form below BLOCKED_MIN, through a pooled scratch)."""
    c = np.asarray(a, m.dtype)
    n = m.shape[0] if m.ndim == 1 else 0
    if _blocked(n, g) and (g is m or not np.may_share_memory(m, g)):
        t = _scratch(m.dtype)
        for i in range(0, n, BLOCK):
            j = i + BLOCK
            mb = m[i:j]
            tb = t[:mb.shape[0]]
            np.multiply(g[i:j], c, out=tb)
            np.add(mb, tb, out=mb)
        return
    t = POOL.empty(m.shape, m.dtype)
    np.multiply(g, c, out=t)
    m += t


def momentum_step(x: np.ndarray, lr: float, m: np.ndarray, c: float, a: float, g: np.ndarray) -> np.ndarray:
    """``m *= c; add_scaled(m, a, g); return step_into(x, lr, m)`` in one blocked pass.

    Bit-identical to those three calls (``m *= np.asarray(c, m.dtype)``, then
    ``m += np.asarray(a, m.dtype) * g``, then ``x - np.asarray(lr, x.dtype) * m``): per block the
    same five ufunc calls in that order, so m's block is read and written once and the new
    iterate's block written once. m is updated in place; the new read-only iterate is returned
    in a pooled buffer. Falls back to the three calls below BLOCKED_MIN, for other shapes, or
    when m shares memory with x or g."""
    n = m.shape[0] if m.ndim == 1 else 0
    if not (_blocked(n, x, g) and not np.may_share_memory(m, g) and not np.may_share_memory(m, x)):
        m *= np.asarray(c, m.dtype)
        add_scaled(m, a, g)
        return step_into(x, lr, m)
    cm, ca, cl = np.asarray(c, m.dtype), np.asarray(a, m.dtype), np.asarray(-lr, x.dtype)
    y = POOL.empty(x.shape, x.dtype)
    t = _scratch(m.dtype)
    for i in range(0, n, BLOCK):
        j = i + BLOCK
        mb = m[i:j]
        tb = t[:mb.shape[0]]
        yb = y[i:j]
        np.multiply(mb, cm, out=mb)
        np.multiply(g[i:j], ca, out=tb)
        np.add(mb, tb, out=mb)
        np.multiply(mb, cl, out=yb)
        np.add(x[i:j], yb, out=yb)
    y.setflags(write=False)
    return y


def momentum_into(m: np.ndarray, c: float, a: float, g: np.ndarray, blend: tuple[float, float] | None = None
                  ) -> np.ndarray:
    """``m *= c; add_scaled(m, a, g)``, then the direction u in a new pooled buffer, in one blocked pass.

    u is ``bm·m + bg·g`` for ``blend = (bm, bg)`` (a Nesterov direction), else a copy of m; the
    caller owns it and may overwrite it (the LMO steps write their direction into it in place).
    Bit-identical to ``m *= np.asarray(c, m.dtype)``, ``m += np.asarray(a, m.dtype) * g`` and
    ``u = np.asarray(bm, m.dtype) * m + np.asarray(bg, m.dtype) * g`` (or ``u = m.copy()``): per
    block the same ufunc calls in that order, so m and g are read once, m and u written once,
    with no array-sized temporary. The plain calls run below BLOCKED_MIN, for other shapes, or
    when m shares memory with g."""
    n = m.shape[0] if m.ndim == 1 else 0
    u = POOL.empty(m.shape, m.dtype)
    cm, ca = np.asarray(c, m.dtype), np.asarray(a, m.dtype)
    cb = None if blend is None else (np.asarray(blend[0], m.dtype), np.asarray(blend[1], m.dtype))
    if not (_blocked(n, g) and not np.may_share_memory(m, g)):
        m *= cm
        add_scaled(m, a, g)
        if cb is None:
            np.copyto(u, m)
        else:
            np.multiply(m, cb[0], out=u)
            t = POOL.empty(m.shape, m.dtype)
            np.multiply(g, cb[1], out=t)
            np.add(u, t, out=u)
        return u
    t = _scratch(m.dtype)
    for i in range(0, n, BLOCK):
        j = i + BLOCK
        mb = m[i:j]
        gb = g[i:j]
        tb = t[:mb.shape[0]]
        ub = u[i:j]
        np.multiply(mb, cm, out=mb)
        np.multiply(gb, ca, out=tb)
        np.add(mb, tb, out=mb)
        if cb is None:
            np.copyto(ub, mb)
        else:
            np.multiply(mb, cb[0], out=ub)
            np.multiply(gb, cb[1], out=tb)
            np.add(ub, tb, out=ub)
    return u
