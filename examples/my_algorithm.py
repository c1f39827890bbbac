"""An algorithm of your own: heavy-ball momentum SGD, served with
``latecomer serve --algorithm my_algorithm:MomentumSGD --set lr=0.1`` from this folder.

Hyper-parameters are the dataclass fields (parsed and checked like a built-in's ``--set``);
everything that evolves lives in the state. Check it with ``latecomer.testing.check_algorithm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from latecomer import Algorithm, JobKind, JobSpec, Outcome, check_hyper, publish


@dataclass
class MomentumState:
    version: int  # k, model updates so far
    x: np.ndarray  # x_k, read-only once handed out in a job
    m: np.ndarray  # momentum buffer


@dataclass(frozen=True)
class MomentumSGD(Algorithm):
    """Heavy-ball SGD: m ← β m + g, x ← x − lr · m on every reply, whatever its age.

    Args:
        lr: step size (> 0).
        beta: momentum β ∈ [0, 1).
    """

    name = "my-momentum"
    lr: float = 0.1
    beta: float = 0.5

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("beta", self.beta, lo=0.0, hi=1.0, hi_open=True)

    def state_class(self) -> type:
        return MomentumState

    def init(self, x0, *, seed):
        x = publish(x0)
        return MomentumState(version=0, x=x, m=np.zeros_like(x)), []

    def make_job(self, state, worker_id):
        return state, JobSpec(kind=JobKind.GRAD, created_at=state.version, iterate_ids=(state.version,),
                              points=(state.x,))

    def apply(self, state, results):
        ages = []
        for r in results:
            ages.append(state.version - r.created_at)
            state.m = self.beta * state.m + r.grads[0]
            state.x = publish(state.x - self.lr * state.m)  # a new array: the old x may still be in flight
            state.version += 1
        return state, Outcome(applied=tuple(r.job_id for r in results), updated=bool(results), ages=tuple(ages))
