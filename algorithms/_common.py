"""Small shared pieces of the per-reply algorithms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from algorithms._pool import step_into, step_into_checked
from algorithms.base import JobSpec, NonFiniteGradient, Outcome, Result
from protocol.messages import JobKind

_GRAD = JobKind.GRAD  # read once (a class attribute of an enum costs a lookup each time)


def grad_job(version: int, x: np.ndarray) -> JobSpec:
    """A GRAD job at the current iterate x_k (x must already be read-only)."""
    return JobSpec(kind=_GRAD, created_at=version, iterate_ids=(version,), points=(x,))


def frozen(x: np.ndarray) -> np.ndarray:
    """Mark a freshly computed iterate read-only: it may now be sent zero-copy and cached."""
    x.setflags(write=False)
    return x


@dataclass(slots=True)
class IterateState:
    """State of a momentum-free per-reply method: the version and the (immutable) iterate."""

    version: int
    x: np.ndarray


def sgd_steps(state: IterateState, results: Sequence[Result], lr: float, *, max_age: float = np.inf,
              checked: bool = False, squares: bool = False) -> Outcome:
    """x <- x - lr·g for each result of age <= max_age, one version each; older ones are dropped.

    The update of A1 (max_age = inf), A4 (max_age = tau_max) and A5 (max_age = R - 1).
    ``checked`` (one result only): the step tests g finite in its pass (``step_into_checked``)
    and raises NonFiniteGradient before anything changes; ``squares``: the test is
    ``squares_finite`` (a run with ``refuse_overflow``), not ``finite``.
    """
    if checked and len(results) != 1:
        raise ValueError("a checked step takes exactly one result")
    applied, dropped, ages = [], [], []
    for r in results:
        age = state.version - r.created_at
        if age > max_age:
            dropped.append(r.job_id)
            continue
        if checked:
            y = step_into_checked(state.x, lr, r.grads[0], squares)
            if y is None:
                raise NonFiniteGradient(f"job {r.job_id}: gradient holds NaN or Inf")
            state.x = y
        else:
            state.x = step_into(state.x, lr, r.grads[0])
        state.version += 1
        applied.append(r.job_id)
        ages.append(age)
    return Outcome(applied=tuple(applied), dropped=tuple(dropped), updated=bool(applied), ages=tuple(ages))


def sgd_step_checked(state: IterateState, r: Result, lr: float, squares: bool = False) -> Outcome:
    """``sgd_steps(state, [r], lr, checked=True, squares=squares)`` (max_age = inf: applied
    whatever its age), without the work of a list of results: what A1 does with each reply."""
    age = state.version - r.created_at
    y = step_into_checked(state.x, lr, r.grads[0], squares)
    if y is None:
        raise NonFiniteGradient(f"job {r.job_id}: gradient holds NaN or Inf")
    state.x = y
    state.version += 1
    return Outcome(applied=(r.job_id,), dropped=(), updated=True, ages=(age,))
