"""Momentum methods for data-dependent delays (ALGORITHMS.md §4: A6 Ordered Momentum).

Dahan, Reshef, Goldstein, Levy, "Bringing Order to Asynchronous SGD", arXiv 2605.02043.
Ordered μ²-SGD (A7) joins this module in issue 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from algorithms._common import frozen, grad_job
from algorithms.base import Algorithm, Outcome, Result, check_hyper


@dataclass(slots=True)
class OrderedMomentumState:
    version: int
    x: np.ndarray  # immutable per version
    m: np.ndarray  # momentum, updated in place


@dataclass(frozen=True)
class OrderedMomentum(Algorithm):
    """A6, Ordered Momentum: each gradient weighted by the decay it would have had on time.

    On a reply of age δ = k − created_at:

        m_{k+1} = (1 − β) m_k + β (1 − β)^δ g
        x_{k+1} = x_k − η m_{k+1}

    so a gradient created at version s weighs β(1−β)^{k−1−s} in m_k whatever its arrival
    order (invariant of §4). Nothing is discarded. With ``batched=True`` several results
    given to one ``apply`` make a single update, m ← (1−β) m + β Σ_j (1−β)^{δ_j} g_j [I].

    Choices where the spec is open (§10.1): m_0 = 0; the step uses m_{k+1} (the seed's
    formula); the n initial jobs all carry created_at = 0.

    Args:
        lr: η (> 0).
        beta: β ∈ (0, 1], the weight of a fresh gradient (β = 0.1 ≈ torch momentum 0.9 with
            dampening 0.9).
        batched: apply several results as one update (default False: one update per reply).
    """

    name = "ordered-momentum"
    lr: float = 0.1
    beta: float = 0.1
    batched: bool = False

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("beta", self.beta, lo=0.0, hi=1.0, lo_open=True)

    def state_class(self) -> type:
        return OrderedMomentumState

    def init(self, x0: np.ndarray, *, seed: int):
        x = frozen(np.array(x0, copy=True))
        return OrderedMomentumState(version=0, x=x, m=np.zeros_like(x)), []

    def make_job(self, state: OrderedMomentumState, worker_id: str):
        return state, grad_job(state.version, state.x)

    def _weight(self, age: int, dtype: np.dtype) -> np.ndarray:
        return np.asarray(self.beta * (1.0 - self.beta) ** age, dtype)

    def apply(self, state: OrderedMomentumState, results: Sequence[Result]):
        applied, ages = [], []
        dt = state.m.dtype
        if self.batched and results:
            state.m *= np.asarray(1.0 - self.beta, dt)
            for r in results:
                age = state.version - r.created_at
                state.m += self._weight(age, dt) * r.grads[0]
                applied.append(r.job_id)
                ages.append(age)
            state.x = frozen(state.x - np.asarray(self.lr, dt) * state.m)
            state.version += 1
        else:
            for r in results:
                age = state.version - r.created_at
                state.m *= np.asarray(1.0 - self.beta, dt)
                state.m += self._weight(age, dt) * r.grads[0]
                state.x = frozen(state.x - np.asarray(self.lr, dt) * state.m)
                state.version += 1
                applied.append(r.job_id)
                ages.append(age)
        return state, Outcome(applied=tuple(applied), updated=bool(applied), ages=tuple(ages))

    def validate_state(self, state: OrderedMomentumState) -> None:
        super().validate_state(state)
        if not isinstance(state.m, np.ndarray) or state.m.shape != state.x.shape or state.m.dtype != state.x.dtype:
            raise ValueError(f"{self.name}: momentum m must match x in shape and dtype")
