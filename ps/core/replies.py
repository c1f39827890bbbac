"""Reply validation: what the core checks of a worker's reply before its gradients reach the
algorithm (the count and shapes of the gradients, their dtype, finiteness in the run's dtype, the
shard's count, the loss), and the :class:`algorithms.base.Result` a valid reply becomes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from algorithms._pool import finite
from algorithms.base import Algorithm, NonFiniteGradient, Result
from protocol.messages import ErrorCode, JobKind, Reply
from ps.core.ledger import LedgerEntry


def check_grads(entry: LedgerEntry, reply: Reply, grads: tuple, dim: int, layout_text: str = "",
                deferred: bool = False) -> tuple[ErrorCode, str] | None:
    """Why the reply's gradients are refused, or None. ``grads``: them in the run's dtype (a
    float64 gradient finite as sent can overflow to Inf in float32: the test is of what the
    algorithm would get). ``dim``: the run's parameter count; ``layout_text``: the problem's
    layout as error texts name it. ``deferred``: the algorithm tests finiteness in its step."""
    want = 1 if entry.kind == JobKind.FULL_GRAD else len(entry.iterate_ids)
    if len(reply.grads) != want:
        return ErrorCode.BAD_SHAPE, f"expected {want} gradient(s), got {len(reply.grads)}"
    for i, g in enumerate(reply.grads):
        if g.shape != (dim,):
            layout = f" ({layout_text})" if layout_text else ""
            return ErrorCode.BAD_SHAPE, f"gradient {i}: expected shape ({dim},){layout}, got {g.shape}"
        if g.dtype.kind != "f":
            return ErrorCode.BAD_SHAPE, f"gradient dtype {g.dtype} is not floating point"
        if not deferred and not finite(grads[i]):  # one BLAS pass, exact where it overflows (_pool.py)
            return ErrorCode.NON_FINITE, "gradient holds NaN or Inf"
    if entry.kind == JobKind.FULL_GRAD and entry.shard is not None:
        if reply.count != entry.shard[1] - entry.shard[0]:
            return ErrorCode.BAD_SHAPE, f"count {reply.count} != shard size {entry.shard[1] - entry.shard[0]}"
    if reply.loss is not None and not math.isfinite(reply.loss):
        if deferred and not all(finite(g) for g in grads):  # the gradient's refusal comes first
            return ErrorCode.NON_FINITE, "gradient holds NaN or Inf"
        return ErrorCode.NON_FINITE, "loss is not finite"
    return None


def in_run_dtype(reply: Reply, dtype: np.dtype) -> tuple:
    """The reply's gradients in the run's dtype (what the algorithm gets); a value past its
    range becomes Inf, which the finiteness test then refuses (no warning per message)."""
    if all(g.dtype == dtype for g in reply.grads):
        return reply.grads
    with np.errstate(over="ignore", invalid="ignore"):
        return tuple(g if g.dtype == dtype else g.astype(dtype) for g in reply.grads)


def result_of(entry: LedgerEntry, worker_id: str, reply: Reply, grads: tuple) -> Result:
    """What the algorithm gets of a valid reply to ``entry`` (``grads`` in the run's dtype)."""
    return Result(job_id=entry.job_id, worker_id=worker_id, created_at=entry.created_at, kind=entry.kind,
                  iterate_ids=entry.iterate_ids, grads=grads, seed=entry.seed, loss=reply.loss,
                  count=reply.count, shard=entry.shard, block_sq=reply.block_sq,
                  step_sq=reply.step_sq)


def checked_apply(alg: Algorithm, state: Any, result: Result) -> tuple[tuple | None, tuple[ErrorCode, str] | None]:
    """An algorithm that ``checks_finite`` applies ``result`` now, testing its gradients in
    the step's own pass: ((the version before, what apply returned), None), or (None, the
    refusal) with nothing changed."""
    v_before = int(alg.version(state))
    try:
        return (v_before, alg.apply(state, [result])), None
    except NonFiniteGradient:
        return None, (ErrorCode.NON_FINITE, "gradient holds NaN or Inf")
