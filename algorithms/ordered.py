"""Momentum methods for data-dependent delays (docs/ALGORITHMS.md §4: A6 Ordered Momentum,
A7 Ordered μ²-SGD).

Dahan, Reshef, Goldstein, Levy, "Bringing Order to Asynchronous SGD", arXiv 2605.02043.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from algorithms._common import frozen, grad_job
from algorithms._pool import add_scaled, momentum_step, step_into
from algorithms.base import JobSpec, Outcome, Result, check_hyper
from algorithms.baselines import PerReplyAlgorithm, check_choice
from protocol.messages import JobKind


@dataclass(slots=True)
class OrderedMomentumState:
    version: int
    x: np.ndarray  # immutable per version
    m: np.ndarray  # momentum, updated in place


@dataclass(frozen=True)
class OrderedMomentum(PerReplyAlgorithm):
    """A6, Ordered Momentum: each gradient weighted by the decay it would have had on time.

    On a reply of age δ = k − created_at:

        m_{k+1} = (1 − β) m_k + β (1 − β)^δ g
        x_{k+1} = x_k − η m_{k+1}

    so a gradient created at version s weighs β(1−β)^{k−1−s} in m_k whatever its arrival
    order (invariant of §4). Nothing is discarded. With ``batched=True`` several results
    given to one ``apply`` make a single update, m ← (1−β) m + β Σ_j (1−β)^{δ_j} g_j [I].

    Choices where the spec is open (§10.1): m_0 = 0; the step uses m_{k+1} (the seed's
    formula); the n initial jobs all carry created_at = 0.

    A reply of age δ thus moves x by η(1−β)^δ g in total (an on-time one by η g): the share it
    missed in flight is lost. ``catch_up=True`` is an opt-in extension of ours, **not the
    paper's method**: on arrival it also applies that missed share,

        x_{k+1} = x_k − η m_{k+1} − η (1 − (1−β)^δ) g,

    so every reply moves x by η g in total (batched: the sum over the results).

    Args:
        lr: η (> 0).
        beta: β ∈ (0, 1], the weight of a fresh gradient (β = 0.1 ≈ torch momentum 0.9 with
            dampening 0.9).
        batched: apply several results as one update (default False: one update per reply).
        catch_up: also apply the missed share on arrival (default False; not the paper's method).
    """

    name = "ordered-momentum"
    lr: float = 0.1
    beta: float = 0.1
    batched: bool = False
    catch_up: bool = False

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("beta", self.beta, lo=0.0, hi=1.0, lo_open=True)
        check_choice("catch_up", self.catch_up, (True, False))

    def state_class(self) -> type:
        return OrderedMomentumState

    def init(self, x0: np.ndarray, *, seed: int):
        x = frozen(np.array(x0, copy=True))
        return OrderedMomentumState(version=0, x=x, m=np.zeros_like(x)), []

    def make_job(self, state: OrderedMomentumState, worker_id: str):
        return state, grad_job(state.version, state.x)

    def _weight(self, age: int, dtype: np.dtype) -> np.ndarray:
        return np.asarray(self.beta * (1.0 - self.beta) ** age, dtype)

    def _step(self, state: OrderedMomentumState, late: Sequence[tuple[int, np.ndarray]]) -> None:
        """x ← x − η m (and, with catch-up, − η (1 − (1−β)^δ) g for each (δ, g) in ``late``)."""
        if not self.catch_up:
            state.x = step_into(state.x, self.lr, state.m)
            return
        d = np.array(state.m, copy=True)
        for age, g in late:
            missed = 1.0 - (1.0 - self.beta) ** age
            if missed:
                add_scaled(d, np.asarray(missed, d.dtype), g)
        state.x = step_into(state.x, self.lr, d)

    def apply(self, state: OrderedMomentumState, results: Sequence[Result]):
        applied, ages = [], []
        dt = state.m.dtype
        if self.batched and results:
            state.m *= np.asarray(1.0 - self.beta, dt)
            for r in results:
                age = state.version - r.created_at
                add_scaled(state.m, self._weight(age, dt), r.grads[0])
                applied.append(r.job_id)
                ages.append(age)
            self._step(state, [(a, r.grads[0]) for a, r in zip(ages, results, strict=True)])
            state.version += 1
        else:
            for r in results:
                age = state.version - r.created_at
                if not self.catch_up:  # the three passes below in one (bit-identical)
                    state.x = momentum_step(state.x, self.lr, state.m, 1.0 - self.beta, self._weight(age, dt),
                                            r.grads[0])
                else:
                    state.m *= np.asarray(1.0 - self.beta, dt)
                    add_scaled(state.m, self._weight(age, dt), r.grads[0])
                    self._step(state, [(age, r.grads[0])])
                state.version += 1
                applied.append(r.job_id)
                ages.append(age)
        return state, Outcome(applied=tuple(applied), updated=bool(applied), ages=tuple(ages))

    def validate_state(self, state: OrderedMomentumState) -> None:
        super().validate_state(state)
        if not isinstance(state.m, np.ndarray) or state.m.shape != state.x.shape or state.m.dtype != state.x.dtype:
            raise ValueError(f"{self.name}: momentum m must match x in shape and dtype")


@dataclass(slots=True)
class OrderedMu2State:
    """State of Ordered μ²-SGD at step t = version + 1 (the spec counts t from 1).

    ``x`` is the query point x_t and ``x_prev`` x_{t−1} (both immutable; at t = 1 both are
    x_1 = x0); ``w`` the descent sequence w_t and ``d`` the STORM estimate d_{t−1}
    (both updated in place).
    """

    version: int
    x: np.ndarray
    x_prev: np.ndarray
    w: np.ndarray
    d: np.ndarray


@dataclass(frozen=True)
class OrderedMu2SGD(PerReplyAlgorithm):
    """A7, Ordered μ²-SGD: STORM at anytime-averaged query points, each increment weighted
    by the decay it would have had on time.

    μ²-SGD (Dahan & Levy, ICLR 2025) made asynchronous as in Dahan, Reshef, Goldstein, Levy,
    "Bringing Order to Asynchronous SGD", arXiv 2605.02043 (docs/ALGORITHMS.md §4.3 [S][C][I]).
    Steps count from t = 1 (t = version + 1); x_1 = w_1 = x0, d_0 = 0. Job s is created at
    version s − 1 (``created_at = s − 1``): s = 1 is GRAD at x_1, s ≥ 2 is GRAD_PAIR on
    (x_s, x_{s−1}) with one sample z. On the reply of job s at step t:

        q_s     = ∇f(x_s; z) − (1 − β_s) ∇f(x_{s−1}; z)      (q_1 = ∇f(x_1; z))
        ρ       = Π_{r=s+1}^{t} (1 − β_r)
        d_t     = (1 − β_t) d_{t−1} + ρ q_s
        w_{t+1} = w_t − lr · α_t · d_t
        x_{t+1} = (1 − c_{t+1}) x_t + c_{t+1} w_{t+1}

    ``weights="theory"``: α_t = t, β_t = 1/t, so ρ = s/t and c_{t+1} = α_{t+1}/A_{t+1} =
    2/(t+2) (A_t = t(t+1)/2), i.e. x_{t+1} = (A_t x_t + α_{t+1} w_{t+1})/A_{t+1}.
    ``weights="constant"`` (the official μ²-SGD code's defaults [C]): β_t = ``beta``,
    α_t = 1, ρ = (1−β)^{t−s}, c = ``gamma_x``.

    Choices [I]: no projection (unconstrained); one update per reply (per-reply mode);
    with constant weights job 1 is still a single GRAD (q_1 = g, there is no x_0). Which
    weights the paper's experiments used is open (§10.2); the default is constant weights,
    as the official code. Default β = 0.1, not the synchronous code's 0.9: an increment of
    age δ weighs (1 − β)^δ, and with n workers nearly every reply is n − 1 old, so β = 0.9
    would shrink the step by 10^−(n−1). Theory weights need lr scaled to the horizon T
    (the w-step lr·t grows with t; with delays a fixed lr diverges once lr·δ·t ≫ 1).
    The official code's ``use_alpha_t`` leaves α_t out of the w-step; this class follows
    the spec's (paper's) w_{t+1} = w_t − lr α_t d_t.

    Args:
        lr: η (> 0).
        weights: ``"constant"`` (default) or ``"theory"``.
        beta: β ∈ (0, 1], weight of the new increment for constant weights (d keeps 1 − β
            of its old value; the code's ``gradient_momentum``).
        gamma_x: γ_x ∈ (0, 1], query-point averaging weight for constant weights (code: 0.1).
    """

    name = "ordered-mu2"
    iterate_fields = ("x", "x_prev")
    weight_decay_refusal = ("it steps the descent sequence w and publishes an average x of it, so decaying x would "
                            "not decay the model")
    lr: float = 0.1
    weights: Literal["constant", "theory"] = "constant"
    beta: float = 0.1
    gamma_x: float = 0.1

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_choice("weights", self.weights, ("constant", "theory"))
        check_hyper("beta", self.beta, lo=0.0, hi=1.0, lo_open=True)
        check_hyper("gamma_x", self.gamma_x, lo=0.0, hi=1.0, lo_open=True)

    def state_class(self) -> type:
        return OrderedMu2State

    def init(self, x0: np.ndarray, *, seed: int):
        x = frozen(np.array(x0, copy=True))
        return OrderedMu2State(version=0, x=x, x_prev=x, w=np.array(x, copy=True), d=np.zeros_like(x)), []

    def make_job(self, state: OrderedMu2State, worker_id: str):
        k = state.version
        if k == 0:
            return state, grad_job(k, state.x)
        return state, JobSpec(kind=JobKind.GRAD_PAIR, created_at=k, iterate_ids=(k, k - 1),
                              points=(state.x, state.x_prev))

    def _beta(self, t: int) -> float:
        """β_t (β_1 = 1 in both modes: d_0 = 0 and job 1 has no older point)."""
        if t == 1:
            return 1.0
        return 1.0 / t if self.weights == "theory" else self.beta

    def apply(self, state: OrderedMu2State, results: Sequence[Result]):
        applied, ages = [], []
        dt = state.d.dtype
        for r in results:
            t = state.version + 1
            s = r.created_at + 1
            if s == 1:
                q = r.grads[0]
            else:
                if len(r.grads) != 2:
                    raise ValueError(f"{self.name}: job {r.job_id} (s = {s}) needs a gradient pair")
                q = r.grads[0] - np.asarray(1.0 - self._beta(s), dt) * r.grads[1]
            if self.weights == "theory":
                rho, alpha_t, c_next = s / t, float(t), 2.0 / (t + 2)
            else:
                rho, alpha_t, c_next = (1.0 - self.beta) ** (t - s), 1.0, self.gamma_x
            state.d *= np.asarray(1.0 - self._beta(t), dt)
            state.d += np.asarray(rho, dt) * q
            state.w -= np.asarray(self.lr * alpha_t, dt) * state.d
            state.x_prev = state.x
            state.x = frozen(np.asarray(1.0 - c_next, dt) * state.x + np.asarray(c_next, dt) * state.w)
            state.version += 1
            applied.append(r.job_id)
            ages.append(t - s)
        return state, Outcome(applied=tuple(applied), updated=bool(applied), ages=tuple(ages))

    def validate_state(self, state: OrderedMu2State) -> None:
        super().validate_state(state)
        for name in ("x_prev", "w", "d"):
            a = getattr(state, name)
            if not isinstance(a, np.ndarray) or a.shape != state.x.shape or a.dtype != state.x.dtype:
                raise ValueError(f"{self.name}: {name} must match x in shape and dtype")
