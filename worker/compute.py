"""Pure job execution, shared by the real worker and the simulator.

``run_job`` maps a job and the iterates it names to a :class:`protocol.Reply`. It performs
no I/O and reads no clock, so the simulator computes exactly the bits a real worker sends.

The gradients it returns are the caller's: a problem may write the next gradient into the array
it returned last time (``Problem.fresh_gradients`` is False unless the problem says otherwise),
while the worker still holds the last reply (a large frame is sent without a copy, libzmq reads
it later; replies are kept for a resend to a restarted server) and the simulator's core may keep
it. So unless the problem declares fresh gradients, each one is copied as it comes back.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from problems.base import Problem
from protocol.messages import Job, JobKind, Reply

MAX_LAYOUT_BLOCKS = 8  # blocks named in full by describe_layout; the rest are counted


class BadGradient(ValueError):
    """A problem returned a gradient that does not fit its layout (the job fails with this text)."""


def describe_layout(layout: Sequence[tuple[str, Any]], max_blocks: int = MAX_LAYOUT_BLOCKS) -> str:
    """The blocks of a layout with their shapes, for error messages: ``"w (5, 6), b (1,)"``;
    beyond ``max_blocks`` blocks, the first ones and ``"… N more"``.

    >>> describe_layout([("w", (5, 6)), ("b", (1,))])
    'w (5, 6), b (1,)'
    """
    blocks = [f"{name} {tuple(int(s) for s in shape)}" for name, shape in list(layout)[:max_blocks]]
    more = len(layout) - max_blocks
    return ", ".join(blocks + ([f"\u2026 {more} more"] if more > 0 else []))


def check_gradient(g: np.ndarray, dim: int, layout: Sequence[tuple[str, Any]], method: str) -> None:
    """Raise :class:`BadGradient` naming the layout unless ``g`` is a flat vector of ``dim`` values."""
    if g.shape == (dim,):
        return
    want = f"expected {dim} values ({describe_layout(layout)})" if len(layout) else f"expected {dim} values"
    if g.size == dim:
        raise BadGradient(f"{method}: {want} as a flat vector, got shape {g.shape}")
    raise BadGradient(f"{method}: {want}, got {g.size}")


def run_job(job: Job, points: Sequence[np.ndarray], problem: Problem) -> Reply:
    """Compute the gradients a job asks for.

    Args:
        job: the job (its ``points`` field is ignored; pass the resolved iterates instead).
        points: one array per ``job.iterate_ids``, same order.
        problem: the loaded problem.

    Returns:
        A Reply with one float32 gradient per point (FULL_GRAD: the shard's gradient sum and
        its count), the sample loss, and ``compute_s = 0`` (the caller times real work).

    Raises:
        BadGradient: a gradient is not a flat vector of the iterate's size; the text names
            the problem's layout, e.g. ``grad: expected 31 values (w (5, 6), b (1,)), got 5``.
        Exception: whatever the problem's ``grad`` raised.
    """
    grads, loss, count = compute_grads(job, points, problem)
    return Reply(job_id=job.job_id, created_at=job.created_at, grads=grads, loss=loss, count=count)


def compute_grads(job: Job, points: Sequence[np.ndarray], problem: Problem,
                  alloc: Callable[[tuple[int, ...], Any], np.ndarray] = np.empty) -> tuple[tuple, float | None, int]:
    """:func:`run_job`'s ``(grads, loss, count)`` without the Reply (the worker builds its reply
    once, with the compute time). Same arguments, same checks, same exceptions. ``alloc(shape,
    dtype)``: where a gradient the problem may write again is copied (the worker's pool)."""
    if len(points) != len(job.iterate_ids):
        raise ValueError(f"job {job.job_id}: {len(points)} points for {len(job.iterate_ids)} iterate ids")
    kind = job.kind
    if kind == JobKind.GRAD:
        r = problem.grad(points[0], job.seed, job.batch_size)
        grads, loss, count, method = (r.grad,), r.loss, job.batch_size, "grad"
    elif kind == JobKind.GRAD_PAIR:
        a, b = problem.grad_pair(points[0], points[1], job.seed, job.batch_size)
        grads, loss, count, method = (a.grad, b.grad), a.loss, job.batch_size, "grad_pair"
    elif kind == JobKind.FULL_GRAD:
        if job.shard is None:
            raise ValueError(f"job {job.job_id}: FULL_GRAD without a shard")
        lo, hi = job.shard
        g, count, loss_sum = problem.full_grad(points[0], lo, hi)
        grads, loss, method = (g,), (loss_sum / count if count else 0.0), "full_grad"
    else:  # pragma: no cover - JobKind is closed
        raise ValueError(f"unknown job kind {job.kind}")
    raw, g = grads, grads[0]
    if len(raw) != 1 or not (type(g) is np.ndarray and g.dtype is _F32 and g.ndim == 1 and g.flags.c_contiguous):
        # (one flat float32 vector, the common case, stays as it is: what this line does, without its calls)
        grads = tuple([g if _flat_f32(g) else np.ascontiguousarray(g, dtype=np.float32) for g in grads])
    p = points[0]
    dim = p.shape[0] if p.ndim == 1 else p.size
    for g in grads:
        if g.shape != (dim,):
            check_gradient(g, dim, getattr(problem, "layout", ()), method)
    if not getattr(problem, "fresh_gradients", False):
        grads = tuple([_owned(g, r, alloc) for g, r in zip(grads, raw, strict=True)])
    return grads, None if loss is None else float(loss), int(count)


_F32 = np.dtype(np.float32)


def _owned(g: np.ndarray, returned: Any, alloc: Callable[[tuple[int, ...], Any], np.ndarray]) -> np.ndarray:
    """``g`` (the float32 form of what the problem returned) as an array the problem cannot write
    again: itself when the conversion to float32 made it (a new array owning its memory), else a copy."""
    if g is not returned and g.flags.owndata:
        return g
    out = alloc(g.shape, _F32)
    np.copyto(out, g)
    return out


def _flat_f32(g: Any) -> bool:
    """``g`` is already what ``np.ascontiguousarray(g, dtype=np.float32)`` would return (the
    common case: no call into numpy)."""
    return type(g) is np.ndarray and g.dtype is _F32 and g.ndim == 1 and g.flags.c_contiguous
