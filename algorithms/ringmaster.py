"""Ringmaster methods (docs/ALGORITHMS.md §3.5 A5, §6.2 A10) and the Delay-adaptive Muon baseline.

Ringmaster ASGD: Maranjyan, Tyurin, Richtárik, "Ringmaster ASGD: The First Asynchronous SGD
with Optimal Time Complexity", ICML 2025, arXiv 2501.16168.
Ringmaster LMO: Sadiev, Maranjyan, Ilin, Richtárik, "Ringmaster LMO: Asynchronous Linear
Minimization Oracle Momentum Method", arXiv 2605.18174.

Both accept a reply only while its age δ = k − created_at is below a threshold R. "With
stops" (default, as the public code does) the driver cancels, after every update, each
outstanding job whose age reached R, and the freed worker restarts at the current iterate;
"without stops" such a reply is dropped on arrival instead.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Sequence

import numpy as np

from algorithms._common import IterateState, frozen, grad_job, sgd_steps
from algorithms._pool import POOL, momentum_into, step_into
from algorithms.base import (
    Algorithm,
    Outcome,
    Result,
    block_sq_sums,
    check_hyper,
    jobs_created_at_most,
    norm_from_block_sq,
)
from algorithms.baselines import PerReplyAlgorithm, PlainSGDMethod, check_choice
from algorithms.lmo import (
    NS_DTYPES,
    NS_TABLES,
    check_layout,
    check_lmo_mask,
    coupled_threshold,
    layout_numel,
    momentum_blocks,
    muon_direction,
    ns_coefficients,
    pa_schedule,
)

#: ``momentum_start`` choices of the LMO methods with a fixed α (docs/ALGORITHMS.md §6.2):
#: ``"zero"``: m_0 = 0 and α from the first step (the public Ringmaster-LMO code's EMA);
#: ``"first"``: α_0 = 1, i.e. m_1 = g (the paper's theorems, and this project before issue 31).
MOMENTUM_STARTS = ("zero", "first")


def _stale_jobs(version: int, outstanding: Sequence[Any], threshold: int) -> list[int]:
    """Ids of outstanding jobs whose age version − created_at reached ``threshold``, i.e.
    created_at <= version − threshold (the core's index answers that without a scan)."""
    return jobs_created_at_most(outstanding, version - threshold)


@dataclass(frozen=True)
class RingmasterASGD(PlainSGDMethod):
    """A5, Ringmaster ASGD: asynchronous SGD that never applies a reply of delay ≥ R.

    On a reply of age δ at version k:

        δ < R:  x_{k+1} = x_k − lr · g,  k ← k + 1
        δ ≥ R:  dropped, k unchanged (Alg. 4, ``stops=False``)

    With ``stops=True`` (Alg. 5, the public code's variant) ``cancel`` returns, after each
    update, every outstanding job whose age reached R; its worker restarts at x_k. Every
    arriving reply then has δ < R (a reply with δ ≥ R is still dropped, defensively).
    Theory [M]: R = max{1, ⌈σ²/ε⌉}, lr = min{1/(2RL), ε/(4Lσ²)}; in practice R and lr are
    tuned (code grid R ∈ {n, n/4, n/16, …, 1}, lr ∈ {5^i}).

    Args:
        lr: step size γ (> 0).
        R: delay threshold (integer >= 1). Default 4 has no source: tune it.
        stops: cancel jobs at age R (True, default) or drop them on arrival (False).
    """

    name = "ringmaster"
    lr: float = 0.1
    R: int = 4
    stops: bool = True

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("R", self.R, lo=1, integer=True)
        check_choice("stops", self.stops, (True, False))

    def apply(self, state: IterateState, results: Sequence[Result]):
        return state, sgd_steps(state, results, self.lr, max_age=self.R - 1)

    def cancel(self, state: IterateState, outstanding: Sequence[Any]) -> list[int]:
        return _stale_jobs(state.version, outstanding, self.R) if self.stops else []


@dataclass(slots=True)
class LMOMomentumState:
    """Version, the (immutable) iterate and the momentum m (updated in place)."""

    version: int
    x: np.ndarray
    m: np.ndarray


class _LMOMomentum(PerReplyAlgorithm):
    """Shared momentum + LMO step of RingmasterLMO and DelayAdaptiveMuon (needs the fields
    ``nesterov``, ``ns``, ``ns_steps``, ``ns_dtype``)."""

    nesterov: bool
    ns: str
    ns_steps: int
    ns_dtype: str
    momentum_start: str

    #: What a recorded run whose settings lack a key ran (run.json before the key existed): runs
    #: recorded before ``momentum_start`` started the momentum at m_1 = g (α_0 = 1).
    recorded_defaults: ClassVar[dict[str, Any]] = {"momentum_start": "first"}

    # Set by bind(), not hyper-parameters (so the CLI never sees them): ((name, shape), ...) and
    # the problem's per-block LMO flags (None: every block with >= 2 dims gets Newton–Schulz).
    layout: ClassVar[tuple] = ()
    lmo_mask: ClassVar[tuple | None] = None

    def _check_common(self) -> None:
        check_choice("nesterov", self.nesterov, (True, False))
        check_choice("ns", self.ns, tuple(NS_TABLES))
        check_hyper("ns_steps", self.ns_steps, lo=1, integer=True)
        check_choice("ns_dtype", self.ns_dtype, NS_DTYPES)
        check_choice("momentum_start", self.momentum_start, MOMENTUM_STARTS)

    def _first_alpha(self, k: int, alpha: float) -> float:
        """The momentum weight of a fixed α at version k: α itself (``momentum_start="zero"``,
        the public code's EMA from m_0 = 0), or 1 at k = 0 (``"first"``: m_1 = g, the theory's
        α_0 = 1)."""
        return 1.0 if k == 0 and self.momentum_start == "first" else alpha

    def bind(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> Algorithm:
        """A copy of this algorithm that steps each block of ``layout`` on its own (Muon): the
        blocks ``lmo_mask`` flags (without a mask, those with >= 2 dims) get Newton–Schulz, the
        others the momentum fallback."""
        check_layout(layout)
        mask = check_lmo_mask(tuple(layout), lmo_mask)
        bound = copy.copy(self)
        object.__setattr__(bound, "layout", tuple(layout))
        object.__setattr__(bound, "lmo_mask", mask)
        return bound

    def state_class(self) -> type:
        return LMOMomentumState

    def splittable_blocks(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> tuple[bool, ...]:
        lmo = getattr(self, "lmo", "muon")  # DelayAdaptiveMuon: always Muon
        if lmo == "sign":
            return (True,) * len(tuple(layout))
        if lmo == "l2":  # the norm of u is summed per whole block (Result.step_sq): no block is cut
            return (False,) * len(tuple(layout))
        return momentum_blocks(layout, lmo_mask)  # Newton–Schulz blocks stay whole

    def init(self, x0: np.ndarray, *, seed: int):
        x = frozen(np.array(x0, copy=True))
        if x.ndim != 1:
            raise ValueError(f"{self.name}: x0 must be a flat vector, got shape {x.shape}")
        if self.layout and layout_numel(self.layout) != x.shape[0]:
            raise ValueError(f"{self.name}: layout of size {layout_numel(self.layout)} does not match "
                             f"x0 of size {x.shape[0]}")
        return LMOMomentumState(version=0, x=x, m=np.zeros_like(x)), []

    def make_job(self, state: LMOMomentumState, worker_id: str):
        return state, grad_job(state.version, state.x)

    def _direction(self, lmo: str, u: np.ndarray, step_sq: Sequence[float] | None = None) -> np.ndarray:
        """D = −lmo(u) (or Muon's O), written over ``u`` (a buffer the step owns) and returned: the
        step is x − η D. ``sign``: into another pooled buffer (numpy's sign runs about 10x slower
        in place). ``l2``: u/‖u‖ with ‖u‖ from the per-block squared norms (``step_sq`` when a
        sharded server gathered them, else measured on u over the bound layout), float64, exactly
        rounded. ``muon``: Newton–Schulz in ``ns_dtype`` ("auto": per block, :func:`~algorithms.lmo.ns_dtype_for`)."""
        if lmo == "sign":
            return np.sign(u, out=POOL.empty(u.shape, u.dtype))
        if lmo == "l2":
            norm = norm_from_block_sq(self._u_sq(u) if step_sq is None else step_sq)
            if norm == 0.0:
                u[...] = 0
                return u
            return np.divide(u, norm, out=u)
        coefficients = ns_coefficients(self.ns, self.ns_steps)
        return muon_direction(u, self.layout, lmo_mask=self.lmo_mask, coefficients=coefficients,
                              steps=len(coefficients), dtype=self.ns_dtype, out=u)

    def _u_sq(self, u: np.ndarray) -> tuple[float, ...]:
        """‖u_b‖² per block of the bound layout (one block of everything when bound to none)."""
        if not self.layout:
            return block_sq_sums(u, ()) if u.size else ()
        return block_sq_sums(u, self.layout)

    def _advance(self, m: np.ndarray, g: np.ndarray, alpha: float) -> np.ndarray:
        """m ← α g + (1−α) m in place; returns u in a new buffer: (1−α) m + α g if Nesterov, else a
        copy of m (one blocked pass, :func:`algorithms._pool.momentum_into`)."""
        return momentum_into(m, 1.0 - alpha, alpha, g, (1.0 - alpha, alpha) if self.nesterov else None)

    def _step(self, state: LMOMomentumState, g: np.ndarray, alpha: float, eta: float, lmo: str,
              step_sq: Sequence[float] | None = None) -> None:
        """m ← α g + (1−α) m; u = (1−α) m + α g if Nesterov else m; x ← x − η D(u); k += 1."""
        u = self._advance(state.m, g, alpha)
        d = self._direction(lmo, u, step_sq)
        state.x = step_into(state.x, eta, d)
        state.version += 1

    def validate_state(self, state: LMOMomentumState) -> None:
        super().validate_state(state)
        if not isinstance(state.m, np.ndarray) or state.m.shape != state.x.shape or state.m.dtype != state.x.dtype:
            raise ValueError(f"{self.name}: momentum m must match x in shape and dtype")
        if self.layout and layout_numel(self.layout) != state.x.shape[0]:
            raise ValueError(f"{self.name}: state x does not match the layout")


@dataclass(frozen=True)
class RingmasterLMO(_LMOMomentum):
    """A10, Ringmaster LMO: momentum + linear minimization oracle, Ringmaster delay threshold.

    On a reply of age δ at version k, with schedule (α_k, R_k, η_k):

        δ < R_k:  m_{k+1} = α_k g + (1 − α_k) m_k
                  u = (1 − α_k) m_{k+1} + α_k g  if ``nesterov`` else m_{k+1}
                  x_{k+1} = x_k + η_k · lmo(u),  k ← k + 1
        δ ≥ R_k:  dropped (``stops=False``); with ``stops=True`` ``cancel`` stops every job
                  whose age reached R_k right after each update, so this never happens.

    Direction: ``nesterov=True`` (the default) is the public code's Nesterov blend u; the
    paper's algorithm box steps on the momentum itself, u = m_{k+1}: ``nesterov=False``. Runs
    that claim to reproduce the paper's algorithm (rather than its NanoChat code) set it.

    LMOs: ``"sign"`` lmo = −sign(u) (ℓ∞ ball); ``"l2"`` lmo = −u/‖u‖ (both on the whole
    vector; the mask below does not apply); ``"muon"`` per layout block: the blocks the
    problem's ``lmo_mask`` flags (without a mask, every block with ≥ 2 dims) get
    −NS5(u)·√max(1, rows/cols) (spectral ball, approximately; a flagged vector block is a 1×n
    matrix: ≈ −0.859·u/‖u‖ with Polar Express, as the group's quadratic script), the others −u
    (the public code's momentum fallback); an empty layout gives −u/‖u‖. Newton–Schulz runs
    :func:`algorithms.lmo.ns_coefficients` (Polar Express: at most its 5 triples, as the public
    code).
    Schedules: ``"fixed"``: α_k = ``alpha``, R_k = ``R``, η_k = ``lr``;
    ``"coupled"``: the same with the theorem's coupling R_k = ⌊1/α_k⌋ (``R`` is ignored);
    ``"agnostic"`` (parameter-agnostic theorem): α_0 = α_1 = 1, α_k = 1/√k,
    R_k = max(1, ⌊√k⌋), η_k = lr/(k+1)^{3/4}; ``alpha`` and ``R`` are then ignored.

    The momentum's start (§6.2, issue 31): m_0 = 0. ``momentum_start="zero"`` (default, the
    public code's EMA) weighs the first gradient by ``alpha`` too, m_1 = α g; ``"first"``
    sets α_0 = 1 in the fixed and coupled schedules, m_1 = g (the theorems' start; R_0 = 1
    under ``"coupled"``). The two momenta differ by (1−α)^k g_1 at every later step, not only
    at the first. The agnostic schedule has α_0 = 1 under both (the paper and the public code
    alike). A run.json recorded before the key existed means ``"first"``.

    Choices (§6, §10): the delay check and the cancel both use R at the current
    version, so a job is cancelled exactly when it would be dropped on arrival (the
    parameter-agnostic code cancels with the previous version's threshold). The layout
    comes from the driver through :meth:`bind` (problem.layout), never from the CLI.
    Defaults follow the public code's Ringmaster Muon (β = 0.95 ⇒ alpha = 0.05, Nesterov,
    Polar-Express NS5, R = 2); lr = 0.04 is its quadratic setting (NanoChat used 1).

    Args:
        lr: η, step size (fixed) or its scale (agnostic), > 0.
        alpha: α ∈ (0, 1], momentum weight of the new gradient (fixed schedule).
        R: delay threshold, integer >= 1 (fixed schedule).
        lmo: ``"muon"``, ``"sign"`` or ``"l2"``.
        schedule: ``"fixed"``, ``"coupled"`` or ``"agnostic"``.
        ns: Newton–Schulz table, ``"polar-express"`` (the paper's code) or ``"classic"``
            (Keller Jordan's (3.4445, −4.7750, 2.0315)); same names as ``rennala-muon``.
        ns_steps: Newton–Schulz iterations (integer >= 1; Polar Express runs at most its 5
            triples, as the public code; classic repeats its one triple).
        ns_dtype: Newton–Schulz arithmetic: ``"auto"`` (default: per block, float64 for a float64
            run; in a float32 run, the server's, bfloat16 for layer-sized matrices and float32
            for small ones: :func:`~algorithms.lmo.ns_dtype_for`), ``"float32"``, ``"float64"`` (numpy) or
            ``"bfloat16"`` (torch on the CPU, torch.optim.Muon's arithmetic).
        nesterov: use the Nesterov direction u (default True, the public code's form); False is
            the paper's algorithm box (step on m).
        stops: cancel jobs at age R_k (True) or drop them on arrival (False).
        momentum_start: ``"zero"`` (default: m_0 = 0, α from the first step, the public code)
            or ``"first"`` (α_0 = 1: m_1 = g, the theorems' start and the default before issue
            31); the agnostic schedule has α_0 = 1 either way.

    Not hyper-parameters: ``layout`` (``((name, shape), ...)``) and ``lmo_mask`` (one bool per
    block, or None), set by the driver with ``bind_layout(alg, problem.layout,
    problem.lmo_mask)`` before ``init``; unbound, the vector is one 1×d block.
    """

    name = "ringmaster-lmo"
    lr: float = 0.04
    alpha: float = 0.05
    R: int = 2
    lmo: Literal["muon", "sign", "l2"] = "muon"
    schedule: Literal["fixed", "coupled", "agnostic"] = "fixed"
    ns: Literal["polar-express", "classic"] = "polar-express"
    ns_steps: int = 5
    nesterov: bool = True
    stops: bool = True
    ns_dtype: Literal["auto", "float32", "float64", "bfloat16"] = "auto"
    momentum_start: Literal["zero", "first"] = "zero"

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("alpha", self.alpha, lo=0.0, hi=1.0, lo_open=True)
        check_hyper("R", self.R, lo=1, integer=True)
        check_choice("lmo", self.lmo, ("muon", "sign", "l2"))
        check_choice("schedule", self.schedule, ("fixed", "coupled", "agnostic"))
        check_choice("stops", self.stops, (True, False))
        self._check_common()

    def schedule_at(self, k: int) -> tuple[float, int, float]:
        """(α_k, R_k, η_k) at version k."""
        if self.schedule == "agnostic":
            alpha, r, factor = pa_schedule(k)
            return alpha, r, self.lr * factor
        alpha = self._first_alpha(k, self.alpha)
        if self.schedule == "coupled":
            return alpha, coupled_threshold(alpha), self.lr
        return alpha, self.R, self.lr

    def apply(self, state: LMOMomentumState, results: Sequence[Result]):
        applied, dropped, ages = [], [], []
        for r in results:
            age = state.version - r.created_at
            alpha, threshold, eta = self.schedule_at(state.version)
            if age >= threshold:
                dropped.append(r.job_id)
                continue
            self._step(state, r.grads[0], alpha, eta, self.lmo, r.step_sq)
            applied.append(r.job_id)
            ages.append(age)
        return state, Outcome(applied=tuple(applied), dropped=tuple(dropped), updated=bool(applied),
                              ages=tuple(ages))

    def cancel(self, state: LMOMomentumState, outstanding: Sequence[Any]) -> list[int]:
        if not self.stops:
            return []
        return _stale_jobs(state.version, outstanding, self.schedule_at(state.version)[1])

    def shard_refusal(self) -> str:
        return ""  # lmo='l2': the norm of the whole u travels as per-block scalars (needs_step_norms)

    def needs_step_norms(self) -> bool:
        return self.lmo == "l2"

    def step_sq(self, state: LMOMomentumState, result: Result) -> tuple[float, ...] | None:
        """lmo='l2': ‖u_b‖² per bound block of the u this result's step would divide by (u from a
        copy of the momentum, stepped as :meth:`_step` steps it: the same bits); None otherwise."""
        if self.lmo != "l2" or not result.grads:
            return None
        alpha = self.schedule_at(state.version)[0]
        return self._u_sq(self._advance(state.m.copy(), result.grads[0], alpha))


@dataclass(frozen=True)
class DelayAdaptiveMuon(_LMOMomentum):
    """Delay-adaptive Muon, the asynchronous baseline of Ringmaster LMO (arXiv 2605.18174 [C]).

    Every reply is applied, whatever its age δ, with the Muon step of :class:`RingmasterLMO`
    (``lmo="muon"``, fixed α) and step size lr · n / max(n, δ) = lr · min(1, n/δ):

        m_{k+1} = α g + (1 − α) m_k      (m_0 = 0; α_0 = 1 only with momentum_start="first")
        x_{k+1} = x_k − lr · n / max(n, δ) · O(u)

    The momentum starts as RingmasterLMO's (``momentum_start``): by default from m_0 = 0 with
    α from the first reply, as the public code's ``AsynchronousMuon``.

    Args:
        lr: base step size γ (> 0); 0.04 as RingmasterLMO (the code's quadratic default was 0.005).
        n_workers: n (>= 1); set it to the worker count.
        alpha: α ∈ (0, 1], momentum weight (0.05 ⇔ the code's β = 0.95).
        ns: ``"polar-express"`` or ``"classic"`` Newton–Schulz table.
        ns_steps: Newton–Schulz iterations (integer >= 1; Polar Express runs at most 5).
        nesterov: Nesterov direction (default True, the public code's form).
        ns_dtype: Newton–Schulz arithmetic, as :class:`RingmasterLMO`'s (default ``"auto"``).
        momentum_start: ``"zero"`` (default, the public code) or ``"first"`` (α_0 = 1), as
            :class:`RingmasterLMO`'s.

    ``layout`` and ``lmo_mask`` are set by the driver through ``bind``, as for RingmasterLMO.
    """

    name = "delay-adaptive-muon"
    lr: float = 0.04
    n_workers: int = 1
    alpha: float = 0.05
    ns: Literal["polar-express", "classic"] = "polar-express"
    ns_steps: int = 5
    nesterov: bool = True
    ns_dtype: Literal["auto", "float32", "float64", "bfloat16"] = "auto"
    momentum_start: Literal["zero", "first"] = "zero"

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("n_workers", self.n_workers, lo=1, integer=True)
        check_hyper("alpha", self.alpha, lo=0.0, hi=1.0, lo_open=True)
        self._check_common()

    def apply(self, state: LMOMomentumState, results: Sequence[Result]):
        applied, ages = [], []
        for r in results:
            age = state.version - r.created_at
            alpha = self._first_alpha(state.version, self.alpha)
            eta = self.lr * self.n_workers / max(self.n_workers, age)
            self._step(state, r.grads[0], alpha, eta, "muon")
            applied.append(r.job_id)
            ages.append(age)
        return state, Outcome(applied=tuple(applied), updated=bool(applied), ages=tuple(ages))
