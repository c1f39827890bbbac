"""Reply validation: what the core checks of a worker's reply before its gradients reach the
algorithm (the count and shapes of the gradients, their dtype, finiteness in the run's dtype, the
shard's count, the loss), the :class:`algorithms.base.Result` a valid reply becomes, and what
follows a reply: rejected, buffered for the next round or applied (:func:`on_reply`).

The ``core`` argument below is a :class:`ps.core.server_core.ServerCore`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from algorithms._pool import finite, squares_finite
from algorithms.base import Algorithm, NonFiniteGradient, Result
from protocol.messages import Error, ErrorCode, JobKind, Reply
from ps.core.commands import Command, Send
from ps.core.faults import quarantine_worker, unbench
from ps.core.ledger import LedgerEntry, mark_received
from ps.core.settlement import apply_results, settle
from ps.core.workers import WorkerInfo, reindex, trusted_holds

_FULL_GRAD = JobKind.FULL_GRAD  # read once (a class attribute of an enum costs a lookup each time)


def refusal_text(grads: tuple) -> str:
    """The text of a NON_FINITE refusal of ``grads``: NaN/Inf, else (``refuse_overflow``) a
    value whose square overflows the run's dtype. Computed only when a reply is refused."""
    if all(finite(g) for g in grads):
        return f"gradient holds a value whose square overflows {grads[0].dtype} (|g| >= sqrt of its largest)"
    return "gradient holds NaN or Inf"


def check_grads(entry: LedgerEntry, reply: Reply, grads: tuple, dim: int, layout_text: str = "",
                deferred: bool = False, overflow: bool = False) -> tuple[ErrorCode, str] | None:
    """Why the reply's gradients are refused, or None. ``grads``: them in the run's dtype (a
    float64 gradient finite as sent can overflow to Inf in float32: the test is of what the
    algorithm would get). ``dim``: the run's parameter count; ``layout_text``: the problem's
    layout as error texts name it. ``deferred``: the algorithm tests finiteness in its step.
    ``overflow`` (``CoreConfig.refuse_overflow``): a value whose square overflows the run's dtype
    is refused like a NaN (:func:`algorithms._pool.squares_finite`), at the same place and cost."""
    ok = squares_finite if overflow else finite
    full = entry.kind == _FULL_GRAD
    want = 1 if full else len(entry.iterate_ids)
    if len(reply.grads) != want:
        return ErrorCode.BAD_SHAPE, f"expected {want} gradient(s), got {len(reply.grads)}"
    for i, g in enumerate(reply.grads):
        if g.shape != (dim,):
            layout = f" ({layout_text})" if layout_text else ""
            return ErrorCode.BAD_SHAPE, f"gradient {i}: expected shape ({dim},){layout}, got {g.shape}"
        if g.dtype.kind != "f":
            return ErrorCode.BAD_SHAPE, f"gradient dtype {g.dtype} is not floating point"
        if not deferred and not ok(grads[i]):  # one BLAS pass, exact where it overflows (_pool.py)
            return ErrorCode.NON_FINITE, refusal_text((grads[i],))
    if full and entry.shard is not None:
        if reply.count != entry.shard[1] - entry.shard[0]:
            return ErrorCode.BAD_SHAPE, f"count {reply.count} != shard size {entry.shard[1] - entry.shard[0]}"
    if reply.loss is not None and not math.isfinite(reply.loss):
        bad = [g for g in grads if not ok(g)] if deferred else []
        if bad:  # the gradient's refusal comes first
            return ErrorCode.NON_FINITE, refusal_text((bad[0],))
        return ErrorCode.NON_FINITE, "loss is not finite"
    return None


def in_run_dtype(reply: Reply, dtype: np.dtype) -> tuple:
    """The reply's gradients in the run's dtype (what the algorithm gets); a value past its
    range becomes Inf, which the finiteness test then refuses (no warning per message)."""
    for g in reply.grads:
        if g.dtype != dtype:
            break
    else:
        return reply.grads
    with np.errstate(over="ignore", invalid="ignore"):
        return tuple(g if g.dtype == dtype else g.astype(dtype) for g in reply.grads)


def result_of(entry: LedgerEntry, worker_id: str, reply: Reply, grads: tuple) -> Result:
    """What the algorithm gets of a valid reply to ``entry`` (``grads`` in the run's dtype)."""
    return Result(job_id=entry.job_id, worker_id=worker_id, created_at=entry.created_at, kind=entry.kind,
                  iterate_ids=entry.iterate_ids, grads=grads, seed=entry.seed, loss=reply.loss,
                  count=reply.count, shard=entry.shard, block_sq=reply.block_sq,
                  step_sq=reply.step_sq)


def checked_apply(alg: Algorithm, state: Any, result: Result, overflow: bool = False,
                  v_before: int | None = None) -> tuple[tuple | None, tuple[ErrorCode, str] | None]:
    """An algorithm that ``checks_finite`` applies ``result`` now, testing its gradients in
    the step's own pass (``overflow``: the ``refuse_overflow`` rule too): ((the version before,
    what apply returned), None), or (None, the refusal) with nothing changed. ``v_before``: the
    version now, where the caller has it (else read here)."""
    if v_before is None:
        v_before = int(alg.version(state))
    try:
        return (v_before, alg.apply_checked(state, result, overflow)), None
    except NonFiniteGradient:
        return None, (ErrorCode.NON_FINITE, refusal_text(result.grads))


def reject(core: Any, w: WorkerInfo, entry: LedgerEntry, reply: Reply, problem: tuple[ErrorCode, str],
           now: float) -> list[Command]:
    """``w``'s ``reply`` to ``entry`` is refused (``problem``: the code and text it is told): the
    job is rejected, the algorithm told; ``max_bad_replies`` in a row quarantine ``w``."""
    code, text = problem
    out = [Send(w.worker_id, Error(code, text, job_id=reply.job_id))]
    settle(core, entry, "rejected")
    core.counters.rejected += 1
    core.state = core.alg.on_lost(core.state, [entry.job_id])
    core._sweep_store()
    core.events.append({"ev": "rejected", "job_id": entry.job_id, "worker_id": w.worker_id,
                        "code": int(code), "message": text})
    w.bad_in_a_row += 1
    if core.cfg.max_bad_replies and w.bad_in_a_row >= core.cfg.max_bad_replies:
        out += quarantine_worker(core, w, now)
    return out + core.dispatch(now)


def on_reply(core: Any, w: WorkerInfo, reply: Reply, now: float,
             refusal: tuple[ErrorCode, str] | None = None) -> list[Command]:
    """A reply from joined worker ``w``: late, unknown, refused (``refusal``, or a failed check:
    the job is rejected) or accepted (applied now, or buffered for the next round)."""
    entry = core.ledger.get(reply.job_id)
    if entry is None or entry.received:
        how = core.closed.get(reply.job_id)
        if how is not None or (entry is not None and entry.received):
            core.counters.late += 1
            core.events.append({"ev": "late", "job_id": reply.job_id, "worker_id": w.worker_id,
                                "was": how or "duplicate"})
            return core.dispatch(now)
        core.counters.unknown += 1
        return [Send(w.worker_id, Error(ErrorCode.UNKNOWN_JOB, "job id not outstanding", job_id=reply.job_id))]
    if entry.worker_id != w.worker_id or entry.created_at != reply.created_at:
        core.counters.unknown += 1
        return [Send(w.worker_id, Error(ErrorCode.UNKNOWN_JOB, "job was given to another worker"
                                        if entry.worker_id != w.worker_id else "created_at does not match the job",
                                        job_id=reply.job_id))]
    grads = in_run_dtype(reply, core.dtype)
    alg = core.alg
    round_mode = alg.mode == "round"
    fused = refusal is None and alg.checks_finite and not round_mode
    overflow = core.cfg.refuse_overflow
    problem = refusal or check_grads(entry, reply, grads, core.dim, core.layout_text, fused, overflow)
    pre = None
    if problem is None and fused:
        result = result_of(entry, w.worker_id, reply, grads)
        pre, problem = checked_apply(alg, core.state, result, overflow, core.version)
    if problem is not None:
        return reject(core, w, entry, reply, problem, now)
    w.bad_in_a_row = 0
    w.failed_in_a_row = 0
    w.resends_in_a_row = 0
    if w.benched:  # not every job of it fails after all
        unbench(core, w, "success", now)
    w.jobs_done += 1
    w.compute_s += reply.compute_s
    if reply.holds:
        w.holds = trusted_holds(core, reply.holds)
    if pre is None:
        result = result_of(entry, w.worker_id, reply, grads)
    if round_mode:
        w.outstanding.discard(entry.job_id)
        reindex(core, w)
        mark_received(core, entry)
        core.buffer.append(result)
        core.round_blocked = False
        return core.dispatch(now)
    # apply_results settles the entry (applied or dropped): that takes it off w's jobs
    return apply_results(core, [result], now, pre) + core.dispatch(now)


def reply_verdict(core: Any, worker_id: str, reply: Reply) -> str:
    """Without changing anything: ``"ok"`` if ``reply`` answers an outstanding job of this
    worker with valid gradients, ``"bad"`` if it answers one with invalid gradients,
    ``"other"`` if it would be ignored (late, unknown, another worker's)."""
    entry = core.ledger.get(reply.job_id)
    if worker_id not in core.workers or entry is None or entry.received or entry.worker_id != worker_id \
            or entry.created_at != reply.created_at:
        return "other"
    grads = in_run_dtype(reply, core.dtype)
    problem = check_grads(entry, reply, grads, core.dim, core.layout_text, overflow=core.cfg.refuse_overflow)
    return "ok" if problem is None else "bad"
