"""Pure job execution, shared by the real worker and the simulator.

``run_job`` maps a job and the iterates it names to a :class:`protocol.Reply`. It performs
no I/O and reads no clock, so the simulator computes exactly the bits a real worker sends.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from problems.base import Problem
from protocol.messages import Job, JobKind, Reply


def run_job(job: Job, points: Sequence[np.ndarray], problem: Problem) -> Reply:
    """Compute the gradients a job asks for.

    Args:
        job: the job (its ``points`` field is ignored; pass the resolved iterates instead).
        points: one array per ``job.iterate_ids``, same order.
        problem: the loaded problem.

    Returns:
        A Reply with one float32 gradient per point (FULL_GRAD: the shard's gradient sum and
        its count), the sample loss, and ``compute_s = 0`` (the caller times real work).
    """
    if len(points) != len(job.iterate_ids):
        raise ValueError(f"job {job.job_id}: {len(points)} points for {len(job.iterate_ids)} iterate ids")
    if job.kind == JobKind.GRAD:
        r = problem.grad(points[0], job.seed, job.batch_size)
        grads, loss, count = (r.grad,), r.loss, job.batch_size
    elif job.kind == JobKind.GRAD_PAIR:
        a, b = problem.grad_pair(points[0], points[1], job.seed, job.batch_size)
        grads, loss, count = (a.grad, b.grad), a.loss, job.batch_size
    elif job.kind == JobKind.FULL_GRAD:
        if job.shard is None:
            raise ValueError(f"job {job.job_id}: FULL_GRAD without a shard")
        lo, hi = job.shard
        g, count, loss_sum = problem.full_grad(points[0], lo, hi)
        grads, loss = (g,), (loss_sum / count if count else 0.0)
    else:  # pragma: no cover - JobKind is closed
        raise ValueError(f"unknown job kind {job.kind}")
    grads = tuple(np.ascontiguousarray(g, dtype=np.float32) for g in grads)
    return Reply(job_id=job.job_id, created_at=job.created_at, grads=grads,
                 loss=None if loss is None else float(loss), count=int(count))
