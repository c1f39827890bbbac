"""Asynchronous SGD baselines without momentum correction (ALGORITHMS.md §3, A1).

The remaining baselines of §3–4 (naive momentum, delay-adaptive, delay-filtered) join this
module in issue 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from algorithms._common import IterateState, frozen, grad_job
from algorithms.base import Algorithm, Outcome, Result, check_hyper


@dataclass(frozen=True)
class VanillaASGD(Algorithm):
    """A1, vanilla asynchronous SGD.

    Every reply, whatever its age δ = k − created_at, is applied at once:

        x_{k+1} = x_k − lr · g

    Jobs are GRAD at the current iterate. The classic Hogwild!-style baseline of
    Ringmaster ASGD (Maranjyan, Tyurin, Richtárik, ICML 2025, arXiv 2501.16168) and of
    the other papers in ALGORITHMS.md.

    Args:
        lr: step size γ (> 0).
    """

    name = "asgd"
    lr: float = 0.1

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)

    def state_class(self) -> type:
        return IterateState

    def init(self, x0: np.ndarray, *, seed: int):
        return IterateState(version=0, x=frozen(np.array(x0, copy=True))), []

    def make_job(self, state: IterateState, worker_id: str):
        return state, grad_job(state.version, state.x)

    def apply(self, state: IterateState, results: Sequence[Result]):
        applied, ages = [], []
        for r in results:
            ages.append(state.version - r.created_at)
            state.x = frozen(state.x - np.asarray(self.lr, state.x.dtype) * r.grads[0])
            state.version += 1
            applied.append(r.job_id)
        return state, Outcome(applied=tuple(applied), updated=bool(applied), ages=tuple(ages))
