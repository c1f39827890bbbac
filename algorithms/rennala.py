"""Rennala family (docs/ALGORITHMS.md §5: A8, A9, A9b) and the Rennala Muon baseline (§6.4).

Rennala methods work in rounds. Round k has one target (the iterate x_k, or the pair
(x_{k+1}, x_k) for MVR); every free worker gets a job for the current round, fast workers
come back for more, and only results of the current round count. After the B-th accepted
result the server makes one update and the next round starts.

Driver contract: ``mode`` is ``"per_reply"``. Each result is given to ``apply`` as it
arrives; ``apply`` accumulates it and returns ``Outcome(updated=False)`` until the batch is
full. Results of an older round are dropped. With ``restart=True`` (the public code,
``reset_all_nodes``) ``cancel`` names every outstanding job of an older round, so the driver
stops it and hands that worker a job of the new round; with ``restart=False`` (the original
algorithm) old jobs keep running and are dropped on arrival.

Versions and tags: ``version`` counts model updates (§1), the newest iterate is x_version
(iterate id = version) and every job made at version k carries ``created_at = k``; a result
is accepted iff its ``created_at``, ``kind`` and ``iterate_ids`` are those of the current round.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Sequence

import numpy as np

from algorithms._common import frozen, grad_job
from algorithms._pool import step_into
from algorithms.base import Algorithm, JobSpec, Outcome, Result, check_hyper
from algorithms.lmo import (
    NS_DTYPES,
    NS_TABLES,
    check_layout,
    check_lmo_mask,
    layout_numel,
    momentum_blocks,
    muon_direction,
    ns_coefficients,
)
from protocol.messages import JobKind

__all__ = ["RennalaSGD", "RennalaMVR", "RennalaMVRInexact", "RennalaMuon", "RennalaState", "RennalaMVRState",
           "RennalaMVRInexactState", "RennalaMuonState"]


def _initial_iterate(x0: np.ndarray) -> np.ndarray:
    """x_0 as a read-only floating-point copy (integer input becomes float64)."""
    x = np.array(x0, copy=True)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    return frozen(x)


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"Invalid {name}: {value!r} (expected a bool)")


def _check_like(name: str, alg: str, a: Any, x: np.ndarray) -> None:
    if not isinstance(a, np.ndarray) or a.shape != x.shape or a.dtype != x.dtype or not np.all(np.isfinite(a)):
        raise ValueError(f"{alg}: state {name} must be a finite array matching x in shape and dtype")


def _check_count(alg: str, count: Any, target: int) -> None:
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or not 0 <= count < target:
        raise ValueError(f"{alg}: batch count {count!r} must be an integer in [0, {target})")


class _Rennala(Algorithm):
    """Shared round bookkeeping: acceptance test, drop/cancel of old rounds, batch-fill metric.

    Subclasses define ``_target`` (batch size of the current round), ``_current`` (job kind
    and iterate ids of the current round), ``_accumulate`` and ``_update``. The state needs
    ``version`` and ``count``.
    """

    restart: bool

    def _target(self, state: Any) -> int:
        raise NotImplementedError

    def _current(self, state: Any) -> tuple[JobKind, tuple[int, ...]]:
        raise NotImplementedError

    def _accumulate(self, state: Any, result: Result) -> None:
        raise NotImplementedError

    def _update(self, state: Any) -> None:
        """Use the full batch: make the new iterate, version += 1, reset the sums and count."""
        raise NotImplementedError

    def _is_current(self, state: Any, created_at: int, kind: JobKind, iterate_ids: Sequence[int]) -> bool:
        cur_kind, cur_ids = self._current(state)
        return created_at == state.version and kind == cur_kind and tuple(iterate_ids) == cur_ids

    def apply(self, state: Any, results: Sequence[Result]):
        applied, dropped, updated = [], [], False
        for r in results:
            if not self._is_current(state, r.created_at, r.kind, r.iterate_ids):
                dropped.append(r.job_id)
                continue
            self._accumulate(state, r)
            state.count += 1
            applied.append(r.job_id)
            if state.count == self._target(state):
                self._update(state)
                updated = True
        return state, Outcome(applied=tuple(applied), dropped=tuple(dropped), updated=updated,
                              ages=(0,) * len(applied), metrics=self.metrics(state))

    def cancel(self, state: Any, outstanding: Sequence[Any]) -> list[int]:
        if not self.restart:
            return []
        kind, ids = self._current(state)
        count_like = getattr(outstanding, "count_like", None)  # the core's index: no scan when all are current
        if count_like is not None and count_like(state.version, kind, ids) == len(outstanding):
            return []
        return [j.job_id for j in outstanding
                if not self._is_current(state, j.created_at, j.kind, j.iterate_ids)]

    def shard_refusal(self) -> str:
        return ""  # elementwise sums and steps; Rennala Muon's Newton–Schulz is per block

    def splittable_blocks(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> tuple[bool, ...]:
        return (True,) * len(tuple(layout))  # Rennala Muon overrides it

    def metrics(self, state: Any) -> dict[str, float]:
        """``batch_fill`` = c/B: accepted results of the current round over its batch size
        (B_init while initializing); 0 right after an update."""
        return {"batch_fill": state.count / self._target(state)}

    def from_state_dict(self, d: dict[str, Any]) -> Any:
        state = super().from_state_dict(d)
        # Iterates are handed out in JobSpecs: keep them read-only after a load too.
        for name in ("x", "x_prev"):
            a = getattr(state, name, None)
            if isinstance(a, np.ndarray):
                frozen(a)
        return state


# ---------------------------------------------------------------------------------------------
# A8


class _PlainBatch:
    """Rounds of plain GRAD jobs at x_k whose gradients are averaged (A8 and Rennala Muon)."""

    def make_job(self, state: Any, worker_id: str):
        return state, grad_job(state.version, state.x)

    def live_iterate_ids(self, state: Any) -> set[int]:
        return {state.version}

    def _target(self, state: Any) -> int:
        return self.B

    def _current(self, state: Any) -> tuple[JobKind, tuple[int, ...]]:
        return JobKind.GRAD, (state.version,)

    def _accumulate(self, state: Any, result: Result) -> None:
        state.grad_sum += result.grads[0]


@dataclass(slots=True)
class RennalaState:
    version: int
    x: np.ndarray  # x_k, immutable
    grad_sum: np.ndarray  # Σ of the accepted gradients of round k, updated in place
    count: int  # accepted gradients in round k, 0 <= count < B


@dataclass(frozen=True)
class RennalaSGD(_PlainBatch, _Rennala):
    """A8, Rennala SGD (Tyurin & Richtárik, "Optimal Time Complexities of Parallel Stochastic
    Optimization Methods Under a Fixed Computation Model", NeurIPS 2023, arXiv 2305.12387).

    Round k: every free worker computes a GRAD job at x_k (``created_at = k``), and a worker
    that returns one immediately gets another. Only gradients of x_k are accepted; after the
    B-th one:

        x_{k+1} = x_k − lr · (1/B) Σ_{j=1..B} g_j

    Gradients of older iterates are dropped. Asynchronous minibatch SGD that waits for the
    fastest B gradients: time-optimal for B = max{1, ⌈σ²/ε⌉} and lr = Θ(1/L).

    Args:
        lr: step size γ (> 0).
        B: gradients per update (integer ≥ 1).
        restart: True (default, public code ``reset_all_nodes``): after an update cancel all
            outstanding jobs of the old round and restart those workers at x_{k+1}.
            False (paper): let them run and drop their results on arrival.
    """

    name = "rennala"
    lr: float = 0.1
    B: int = 4
    restart: bool = True

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("B", self.B, lo=1, integer=True)
        _check_flag("restart", self.restart)

    def state_class(self) -> type:
        return RennalaState

    def init(self, x0: np.ndarray, *, seed: int):
        x = _initial_iterate(x0)
        return RennalaState(version=0, x=x, grad_sum=np.zeros_like(x), count=0), []

    def _update(self, state: RennalaState) -> None:
        dt = state.x.dtype
        mean = state.grad_sum / np.asarray(self.B, dt)
        state.x = step_into(state.x, self.lr, mean)
        state.version += 1
        state.grad_sum[...] = 0
        state.count = 0

    def validate_state(self, state: RennalaState) -> None:
        super().validate_state(state)
        _check_like("grad_sum", self.name, state.grad_sum, state.x)
        _check_count(self.name, state.count, self.B)


# ---------------------------------------------------------------------------------------------
# A9


@dataclass(slots=True)
class RennalaMVRState:
    version: int  # model updates so far (the initial step x_0 -> x_1 counts as one)
    x: np.ndarray  # newest iterate x_{k+1} = x_version, immutable
    x_prev: np.ndarray  # x_k = x_{version-1} (equal to x at version 0), immutable
    g: np.ndarray  # estimator g_k (zero before the initial batch is in)
    sum_new: np.ndarray  # Σ ∇f(x_{k+1}; ξ_j) of the round (the initial batch at version 0)
    sum_old: np.ndarray  # Σ ∇f(x_k; ξ_j) of the round
    count: int  # accepted results in the current round


@dataclass(frozen=True)
class RennalaMVR(_Rennala):
    """A9, Rennala MVR, exact variant (Tovmasyan, Maranjyan, Richtárik, arXiv 2605.08871).

    Initialization (blocking, [I]): B_init GRAD jobs at x_0 (``created_at = 0``); with g_0
    their mean, x_1 = x_0 − lr · g_0. Then round k ≥ 0 hands out GRAD_PAIR jobs on
    (x_{k+1}, x_k) (``iterate_ids = (k+1, k)``, both points on one sample) and accepts only
    pairs of the current round. After the B-th pair:

        ḡ₊ = (1/B) Σ_j ∇f(x_{k+1}; ξ_j),   ḡ₋ = (1/B) Σ_j ∇f(x_k; ξ_j)
        g_{k+1} = ḡ₊ + (1 − p)(g_k − ḡ₋)
        x_{k+2} = x_{k+1} − lr · g_{k+1}

    A momentum-variance-reduced (STORM/PAGE-style, probability-free) Rennala: under
    mean-squared smoothness, B ≈ σ/√ε per round and B_init ≈ σ²/ε suffice.

    Choices where the spec is open or self-contradictory:
    - ``version`` counts model updates (§1), so the initial step is update 1 and round k of
      §5 runs at version k+1. Pair jobs of round k carry ``created_at = k + 1``, the id of
      the pair's newer iterate (§1 "for pair jobs, c is the index of the newer iterate"),
      not ``k`` as §5 writes. This keeps initial GRAD jobs (created_at 0) and round-0 pairs
      (created_at 1) apart; kind and iterate ids are checked as well.
    - Initial GRAD jobs still outstanding when the initial batch completes are stale like
      any old-round job (cancelled with ``restart``, dropped on arrival otherwise).
    - p ∈ (0, 1]; p = 1 gives plain Rennala SGD on x_{k+1} (the old point is wasted).

    Args:
        lr: step size γ (> 0).
        B: pairs per round (integer ≥ 1).
        B_init: gradients at x_0 for g_0 (integer ≥ 1).
        p: momentum/restart weight p ∈ (0, 1]; a consistent choice is p ≈ 1/B (pB = Θ(1)).
        restart: cancel old-round jobs after an update (default, as A8) or drop on arrival.
    """

    name = "rennala-mvr"
    lr: float = 0.1
    B: int = 4
    B_init: int = 16
    p: float = 0.25
    restart: bool = True

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("B", self.B, lo=1, integer=True)
        check_hyper("B_init", self.B_init, lo=1, integer=True)
        check_hyper("p", self.p, lo=0.0, hi=1.0, lo_open=True)
        _check_flag("restart", self.restart)

    def state_class(self) -> type:
        return RennalaMVRState

    def init(self, x0: np.ndarray, *, seed: int):
        x = _initial_iterate(x0)
        z = np.zeros_like(x)
        return RennalaMVRState(version=0, x=x, x_prev=x, g=z, sum_new=z.copy(), sum_old=z.copy(), count=0), []

    def make_job(self, state: RennalaMVRState, worker_id: str):
        kind, ids = self._current(state)
        points = (state.x,) if kind == JobKind.GRAD else (state.x, state.x_prev)
        return state, JobSpec(kind=kind, created_at=state.version, iterate_ids=ids, points=points)

    def live_iterate_ids(self, state: RennalaMVRState) -> set[int]:
        return set(self._current(state)[1])

    def _target(self, state: RennalaMVRState) -> int:
        return self.B_init if state.version == 0 else self.B

    def _current(self, state: RennalaMVRState) -> tuple[JobKind, tuple[int, ...]]:
        k = state.version
        return (JobKind.GRAD, (0,)) if k == 0 else (JobKind.GRAD_PAIR, (k, k - 1))

    def _accumulate(self, state: RennalaMVRState, result: Result) -> None:
        state.sum_new += result.grads[0]
        if state.version > 0:
            state.sum_old += result.grads[1]

    def _update(self, state: RennalaMVRState) -> None:
        dt = state.x.dtype
        if state.version == 0:
            state.g = state.sum_new / np.asarray(self.B_init, dt)
        else:
            b = np.asarray(self.B, dt)
            g_minus = state.sum_old / b
            state.g -= g_minus
            state.g *= np.asarray(1.0 - self.p, dt)
            state.g += state.sum_new / b
        state.x_prev = state.x
        state.x = step_into(state.x, self.lr, state.g)
        state.version += 1
        state.sum_new[...] = 0
        state.sum_old[...] = 0
        state.count = 0

    def validate_state(self, state: RennalaMVRState) -> None:
        super().validate_state(state)
        for name in ("x_prev", "g", "sum_new", "sum_old"):
            _check_like(name, self.name, getattr(state, name), state.x)
        _check_count(self.name, state.count, self._target(state))


# ---------------------------------------------------------------------------------------------
# A9b


@dataclass(slots=True)
class RennalaMVRInexactState:
    version: int
    x: np.ndarray  # x_{k+1} = x_version, immutable
    g: np.ndarray  # estimator g_k (zero before the initial batch is in)
    g_hat_prev: np.ndarray  # ĝ_k, mean of the previous batch (the initial batch after init)
    grad_sum: np.ndarray  # Σ ∇f(x_{k+1}; ξ_j) of the current round
    count: int


@dataclass(frozen=True)
class RennalaMVRInexact(_Rennala):
    """A9b, inexact "MARS-inspired" Rennala MVR (Tovmasyan, Maranjyan, Richtárik,
    arXiv 2605.08871; our reconstruction [I], docs/ALGORITHMS.md §5.4).

    Workers compute single GRAD jobs at the newest iterate only. Initialization: B_init
    gradients at x_0 give ĝ_0 = g_0 (their mean) and x_1 = x_0 − lr · g_0. Round k ≥ 0: with
    ĝ_{k+1} the mean of B gradients at x_{k+1} and ĝ_k the previous batch mean (other samples),

        g_{k+1} = (1 − p) g_k + p ĝ_{k+1} + α (1 − p)(ĝ_{k+1} − ĝ_k)
        x_{k+2} = x_{k+1} − lr · g_{k+1}

    This is MARS (Yuan et al. 2024) with β₁ = 1 − p and γ_M = α, without MARS's clipping of
    c_t. α = 1 is the exact A9 formula with a stale-sample difference; α = 0 is Rennala SGD
    with an EMA of batch means.

    Choices: as in :class:`RennalaMVR`, ``version`` counts updates (the initial step is one)
    and jobs made at version k carry ``created_at = k``, iterate id k. ``restart`` is offered
    as in A8/A9 (not listed for A9b in the brief; same default). α ∈ [0, 1], default 0.5
    [I: no default given; between the EMA and the exact-difference cases].

    Args:
        lr: step size γ (> 0).
        B: gradients per round (integer ≥ 1).
        B_init: gradients at x_0 for g_0 (integer ≥ 1).
        p: weight of the new batch mean, p ∈ (0, 1].
        alpha: scale α ∈ [0, 1] of the batch-difference correction.
        restart: cancel old-round jobs after an update (default) or drop them on arrival.
    """

    name = "rennala-mvr-inexact"
    lr: float = 0.1
    B: int = 4
    B_init: int = 16
    p: float = 0.25
    alpha: float = 0.5
    restart: bool = True

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("B", self.B, lo=1, integer=True)
        check_hyper("B_init", self.B_init, lo=1, integer=True)
        check_hyper("p", self.p, lo=0.0, hi=1.0, lo_open=True)
        check_hyper("alpha", self.alpha, lo=0.0, hi=1.0)
        _check_flag("restart", self.restart)

    def state_class(self) -> type:
        return RennalaMVRInexactState

    def init(self, x0: np.ndarray, *, seed: int):
        x = _initial_iterate(x0)
        z = np.zeros_like(x)
        return RennalaMVRInexactState(version=0, x=x, g=z, g_hat_prev=z.copy(), grad_sum=z.copy(), count=0), []

    def make_job(self, state: RennalaMVRInexactState, worker_id: str):
        return state, grad_job(state.version, state.x)

    def live_iterate_ids(self, state: RennalaMVRInexactState) -> set[int]:
        return {state.version}

    def _target(self, state: RennalaMVRInexactState) -> int:
        return self.B_init if state.version == 0 else self.B

    def _current(self, state: RennalaMVRInexactState) -> tuple[JobKind, tuple[int, ...]]:
        return JobKind.GRAD, (state.version,)

    def _accumulate(self, state: RennalaMVRInexactState, result: Result) -> None:
        state.grad_sum += result.grads[0]

    def _update(self, state: RennalaMVRInexactState) -> None:
        dt = state.x.dtype
        g_hat = state.grad_sum / np.asarray(self._target(state), dt)
        if state.version == 0:
            state.g = g_hat.copy()
        else:
            q = np.asarray(1.0 - self.p, dt)
            correction = np.asarray(self.alpha, dt) * q * (g_hat - state.g_hat_prev)
            state.g *= q
            state.g += np.asarray(self.p, dt) * g_hat
            state.g += correction
        state.g_hat_prev = g_hat
        state.x = step_into(state.x, self.lr, state.g)
        state.version += 1
        state.grad_sum[...] = 0
        state.count = 0

    def validate_state(self, state: RennalaMVRInexactState) -> None:
        super().validate_state(state)
        for name in ("g", "g_hat_prev", "grad_sum"):
            _check_like(name, self.name, getattr(state, name), state.x)
        _check_count(self.name, state.count, self._target(state))


# ---------------------------------------------------------------------------------------------
# Baseline: Rennala Muon


@dataclass(slots=True)
class RennalaMuonState:
    version: int
    x: np.ndarray  # x_k, immutable
    m: np.ndarray  # Muon momentum buffer (m_0 = 0), updated in place
    grad_sum: np.ndarray  # Σ of the accepted gradients of round k
    count: int


@dataclass(frozen=True)
class RennalaMuon(_PlainBatch, _Rennala):
    """Rennala Muon, the Rennala baseline of Ringmaster LMO (Sadiev, Maranjyan, Ilin,
    Richtárik, arXiv 2605.18174; public code ``RennalaMuonSGD``, docs/ALGORITHMS.md §6.4).

    Rounds as in :class:`RennalaSGD` (GRAD jobs at x_k, B gradients of the current round).
    With ḡ the batch mean, one Muon step per round:

        m_{k+1} = β m_k + (1 − β) ḡ
        u = β m_{k+1} + (1 − β) ḡ   (Nesterov)   or   u = m_{k+1}
        x_{k+1} = x_k − lr · O(u)

    O is :func:`algorithms.lmo.muon_direction` over the layout and ``lmo_mask`` given to
    :meth:`bind`: per block the mask flags (without a mask, every block with ≥ 2 dims),
    Newton–Schulz NS(u_blk) · √max(1, rows/cols) (a flagged vector block as a 1×n matrix); the
    other blocks step with u_blk itself (the momentum fallback). Without a layout (``()``) the
    whole vector is one 1×d matrix and O = u/‖u‖ exactly (normalized SGD; the group's quadratic
    script runs NS on it, ≈ 0.859·u/‖u‖: the ``quadratic`` problem's flagged vector block gets
    that). Newton–Schulz runs :func:`algorithms.lmo.ns_coefficients` (Polar
    Express: at most its 5 triples, as the public code).

    Choices: m is kept in the dtype of x (the public code keeps float64); ``restart`` is
    offered as in A8 (the public code restarts all workers, the default).

    Args:
        lr: step size γ (> 0); NanoChat default 1.
        B: gradients per update (integer ≥ 1); NanoChat default 2.
        beta: momentum β ∈ [0, 1), default 0.95.
        nesterov: use the Nesterov direction (default True, as the public code).
        ns: Newton–Schulz coefficient table, ``"polar-express"`` (Ringmaster-LMO code, default)
            or ``"classic"`` (Keller Jordan's (3.4445, −4.7750, 2.0315) at every step).
        ns_steps: Newton–Schulz iterations (integer ≥ 1, default 5; Polar Express runs at most 5).
        restart: cancel old-round jobs after an update (default) or drop them on arrival.
        ns_dtype: Newton–Schulz arithmetic, as ``ringmaster-lmo``'s: ``"auto"`` (default: per block,
            as there), ``"float32"``, ``"float64"`` or ``"bfloat16"`` (torch on the CPU).
    """

    name = "rennala-muon"
    lr: float = 1.0
    B: int = 2
    beta: float = 0.95
    nesterov: bool = True
    ns: Literal["polar-express", "classic"] = "polar-express"
    ns_steps: int = 5
    restart: bool = True
    ns_dtype: Literal["auto", "float32", "float64", "bfloat16"] = "auto"

    # Set by bind(), not hyper-parameters: ((name, shape), ...) of the problem's blocks and its
    # per-block LMO flags (None: every block with >= 2 dims gets Newton–Schulz).
    layout: ClassVar[tuple] = ()
    lmo_mask: ClassVar[tuple | None] = None

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("B", self.B, lo=1, integer=True)
        check_hyper("beta", self.beta, lo=0.0, hi=1.0, hi_open=True)
        _check_flag("nesterov", self.nesterov)
        if self.ns not in NS_TABLES:
            raise ValueError(f"Invalid ns: {self.ns!r} (choose one of {', '.join(NS_TABLES)})")
        check_hyper("ns_steps", self.ns_steps, lo=1, integer=True)
        _check_flag("restart", self.restart)
        if self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"Invalid ns_dtype: {self.ns_dtype!r} (choose one of {', '.join(NS_DTYPES)})")

    def bind(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> RennalaMuon:
        """A copy of this algorithm that steps each block of ``layout`` on its own (Newton–Schulz
        where ``lmo_mask`` says so, the momentum fallback elsewhere)."""
        check_layout(layout)
        mask = check_lmo_mask(tuple(layout), lmo_mask)
        bound = copy.copy(self)
        object.__setattr__(bound, "layout", tuple(layout))
        object.__setattr__(bound, "lmo_mask", mask)
        return bound

    def splittable_blocks(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> tuple[bool, ...]:
        return momentum_blocks(layout, lmo_mask)  # Newton–Schulz blocks stay whole

    def state_class(self) -> type:
        return RennalaMuonState

    def init(self, x0: np.ndarray, *, seed: int):
        x = _initial_iterate(x0)
        self._check_layout_size(x)
        z = np.zeros_like(x)
        return RennalaMuonState(version=0, x=x, m=z, grad_sum=z.copy(), count=0), []

    def _update(self, state: RennalaMuonState) -> None:
        dt = state.x.dtype
        mean = state.grad_sum / np.asarray(self.B, dt)
        beta, one_minus = np.asarray(self.beta, dt), np.asarray(1.0 - self.beta, dt)
        state.m *= beta
        state.m += one_minus * mean
        u = beta * state.m + one_minus * mean if self.nesterov else state.m.copy()
        coefficients = ns_coefficients(self.ns, self.ns_steps)
        o = muon_direction(u, self.layout, lmo_mask=self.lmo_mask, coefficients=coefficients, steps=len(coefficients),
                           dtype=self.ns_dtype, out=u)
        state.x = frozen(state.x - np.asarray(self.lr, dt) * o)
        state.version += 1
        state.grad_sum[...] = 0
        state.count = 0

    def _check_layout_size(self, x: np.ndarray) -> None:
        if self.layout and layout_numel(self.layout) != x.size:
            raise ValueError(f"{self.name}: layout of size {layout_numel(self.layout)} does not match x of size "
                             f"{x.size}")

    def validate_state(self, state: RennalaMuonState) -> None:
        super().validate_state(state)
        self._check_layout_size(state.x)
        _check_like("m", self.name, state.m, state.x)
        _check_like("grad_sum", self.name, state.grad_sum, state.x)
        _check_count(self.name, state.count, self.B)
