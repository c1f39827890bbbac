"""Asynchronous SGD baselines (docs/ALGORITHMS.md §3–4): A1 vanilla, A2 naive momentum,
A3 delay-adaptive, A4 delay-filtered. Ringmaster ASGD (A5) lives in ``ringmaster.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Sequence

import numpy as np

from algorithms._common import IterateState, frozen, grad_job, sgd_step_checked, sgd_steps
from algorithms._pool import momentum_step, step_into
from algorithms.base import Algorithm, Outcome, Result, check_hyper


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    """Raise ValueError naming the bad value unless ``value`` is one of ``choices``.

    For Literal and bool hyper-parameters when a class is built directly (the registry
    already checks Literal values it parses).
    """
    if type(value) is not type(choices[0]) or value not in choices:
        raise ValueError(f"Invalid {name}: {value!r} (choose one of {', '.join(map(repr, choices))})")


class PerReplyAlgorithm(Algorithm):
    """Base of the per-reply methods: iterates stay read-only after a state-dict load too.

    ``iterate_fields`` names the state arrays that are handed out in JobSpecs.
    """

    iterate_fields: ClassVar[tuple[str, ...]] = ("x",)

    def shard_refusal(self) -> str:
        return ""  # elementwise steps (A1-A7), per-block LMO/Muon (A10, its baseline); see RingmasterLMO

    def splittable_blocks(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> tuple[bool, ...]:
        return (True,) * len(tuple(layout))  # elementwise (the LMO methods override it)

    def from_state_dict(self, d: dict[str, Any]) -> Any:
        state = super().from_state_dict(d)
        for name in self.iterate_fields:
            frozen(getattr(state, name))
        return state


class PlainSGDMethod(PerReplyAlgorithm):
    """Base of the momentum-free per-reply methods (A1, A3, A4, A5): state = (version, x), and
    every job is a GRAD job at the current iterate."""

    def state_class(self) -> type:
        return IterateState

    def init(self, x0: np.ndarray, *, seed: int):
        return IterateState(version=0, x=frozen(np.array(x0, copy=True))), []

    def make_job(self, state: IterateState, worker_id: str):
        return state, grad_job(state.version, state.x)


@dataclass(frozen=True)
class VanillaASGD(PlainSGDMethod):
    """A1, vanilla asynchronous SGD.

    Every reply, whatever its age δ = k − created_at, is applied at once:

        x_{k+1} = x_k − lr · g

    Jobs are GRAD at the current iterate. The classic Hogwild!-style baseline of
    Ringmaster ASGD (Maranjyan, Tyurin, Richtárik, ICML 2025, arXiv 2501.16168) and of
    the other papers in docs/ALGORITHMS.md §9.

    Args:
        lr: step size γ (> 0).
    """

    name = "asgd"
    checks_finite = True  # one pass over g: the finiteness test rides in the step
    lr: float = 0.1

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)

    def apply(self, state: IterateState, results: Sequence[Result]):
        return state, sgd_steps(state, results, self.lr, checked=len(results) == 1)

    def apply_checked(self, state: IterateState, result: Result, squares: bool = False):
        """``apply`` of one result, the test of g in the step's own pass (``squares``: the
        ``refuse_overflow`` rule, see :meth:`Algorithm.apply_checked`)."""
        return state, sgd_step_checked(state, result, self.lr, squares)


@dataclass(slots=True)
class MomentumState:
    """Version, the (immutable) iterate and a momentum buffer updated in place."""

    version: int
    x: np.ndarray
    m: np.ndarray


@dataclass(frozen=True)
class NaiveMomentumASGD(PerReplyAlgorithm):
    """A2, naive asynchronous momentum: heavy-ball EMA that ignores the delay.

    On every reply, whatever its age:

        m_{k+1} = (1 − β) m_k + β g
        x_{k+1} = x_k − lr · m_{k+1}

    with m_0 = 0. The baseline that Ordered Momentum corrects (Dahan, Reshef, Goldstein, Levy,
    "Bringing Order to Asynchronous SGD", arXiv 2605.02043, docs/ALGORITHMS.md §4.1).

    Args:
        lr: step size η (> 0).
        beta: β ∈ (0, 1], weight of the new gradient (β = 0.1 ≈ torch momentum 0.9 with
            dampening 0.9).
    """

    name = "naive-momentum"
    lr: float = 0.1
    beta: float = 0.1

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("beta", self.beta, lo=0.0, hi=1.0, lo_open=True)

    def state_class(self) -> type:
        return MomentumState

    def init(self, x0: np.ndarray, *, seed: int):
        x = frozen(np.array(x0, copy=True))
        return MomentumState(version=0, x=x, m=np.zeros_like(x)), []

    def make_job(self, state: MomentumState, worker_id: str):
        return state, grad_job(state.version, state.x)

    def apply(self, state: MomentumState, results: Sequence[Result]):
        applied, ages = [], []
        for r in results:
            ages.append(state.version - r.created_at)
            state.x = momentum_step(state.x, self.lr, state.m, 1.0 - self.beta, self.beta, r.grads[0])
            state.version += 1
            applied.append(r.job_id)
        return state, Outcome(applied=tuple(applied), updated=bool(applied), ages=tuple(ages))

    def validate_state(self, state: MomentumState) -> None:
        super().validate_state(state)
        if not isinstance(state.m, np.ndarray) or state.m.shape != state.x.shape or state.m.dtype != state.x.dtype:
            raise ValueError(f"{self.name}: momentum m must match x in shape and dtype")


@dataclass(frozen=True)
class DelayAdaptiveASGD(PlainSGDMethod):
    """A3, delay-adaptive asynchronous SGD: every reply applied, the step shrinks with its age δ.

        x_{k+1} = x_k − lr_δ · g

    ``rule="code"`` (default, public Ringmaster code [C]): lr_δ = lr · n / max(n, δ), i.e.
    lr · min(1, n/δ) with n = ``n_workers``.
    ``rule="koloskova"`` (Koloskova, Stich, Jaggi 2022; Mishchenko et al. 2022 [M], not
    re-verified): lr_δ = lr while δ ≤ n, else min(lr, 1/(4 L δ)) with L = ``smoothness``.
    Choice (§10.4): the literature form needs L, so it is a hyper-parameter used by that rule
    only. Baseline of Ringmaster ASGD (Maranjyan, Tyurin, Richtárik, ICML 2025, arXiv 2501.16168).

    Args:
        lr: base step size γ (> 0).
        n_workers: n, the number of concurrent jobs (>= 1); set it to the worker count.
        rule: ``"code"`` or ``"koloskova"``.
        smoothness: L (> 0), only for ``rule="koloskova"``.
    """

    name = "delay-adaptive"
    lr: float = 0.1
    n_workers: int = 1
    rule: Literal["code", "koloskova"] = "code"
    smoothness: float = 1.0

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("n_workers", self.n_workers, lo=1, integer=True)
        check_choice("rule", self.rule, ("code", "koloskova"))
        check_hyper("smoothness", self.smoothness, lo=0.0, lo_open=True)

    def step_size(self, age: int) -> float:
        """lr_δ for a reply of age δ (see the class docstring)."""
        n = self.n_workers
        if self.rule == "code":
            return self.lr * n / max(n, age)
        if age <= n:
            return self.lr
        return min(self.lr, 1.0 / (4.0 * self.smoothness * age))

    def apply(self, state: IterateState, results: Sequence[Result]):
        applied, ages = [], []
        lr = self.lr
        for r in results:
            age = state.version - r.created_at
            lr = self.step_size(age)
            state.x = step_into(state.x, lr, r.grads[0])
            state.version += 1
            applied.append(r.job_id)
            ages.append(age)
        return state, Outcome(applied=tuple(applied), updated=bool(applied), ages=tuple(ages),
                              metrics={"lr": float(lr)} if applied else {})


@dataclass(frozen=True)
class DelayFilteredASGD(PlainSGDMethod):
    """A4, delay-filtered ("staleness-aware filtering") asynchronous SGD.

    A reply of age δ ≤ τ_max is applied, x_{k+1} = x_k − lr · g; a reply with δ > τ_max is
    dropped (k unchanged) and its worker gets a new job at the current x_k. Equivalent to
    Ringmaster ASGD without stops with R = τ_max + 1. Baseline in Dahan, Reshef, Goldstein,
    Levy, arXiv 2605.02043 (docs/ALGORITHMS.md §3.4 [S][I]).

    Args:
        lr: step size γ (> 0).
        tau_max: τ_max (integer >= 0), the largest age still applied. Default 4 has no source:
            tune it (about the number of workers).
    """

    name = "delay-filtered"
    lr: float = 0.1
    tau_max: int = 4

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("tau_max", self.tau_max, lo=0, integer=True)

    def apply(self, state: IterateState, results: Sequence[Result]):
        return state, sgd_steps(state, results, self.lr, max_age=self.tau_max)
