"""Adam and AdamW applied server-side, one reply at a time (docs/ALGORITHMS.md §15).

Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015; Loshchilov & Hutter,
"Decoupled Weight Decay Regularization", ICLR 2019; the arithmetic is torch.optim.Adam's and
torch.optim.AdamW's (single-tensor, non-capturable path). The server applies each reply as it
arrives, as ``asgd`` does: with t = version + 1 (the updates applied so far, plus one; one
global count, so every shard of a sharded server corrects by the same factors),

    AdamW:  x ← x · (1 − lr·λ)                          (first, as torch.optim.AdamW)
    Adam:   g ← g + λ·x                                 (L2, as torch.optim.Adam)
    m ← β1·m + (1 − β1)·g
    v ← β2·v + (1 − β2)·g²
    x ← x − (lr / (1 − β1^t)) · m / (√v / √(1 − β2^t) + ε)

(ε added to √v̂, outside the root, as torch). A reply of age τ is applied as it comes (the
plain asynchronous choice, hivemind's); ``max_age`` drops replies older than a bound instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np

from algorithms._common import frozen, grad_job
from algorithms._pool import BLOCK, POOL, _blocked
from algorithms.base import Outcome, Result, check_hyper
from algorithms.baselines import PerReplyAlgorithm

__all__ = ["AdamState", "AdamW", "Adam", "adam_step"]


@dataclass(slots=True)
class AdamState:
    """Version, the (immutable) iterate and the two moment estimates m, v (updated in place),
    all of x0's dtype."""

    version: int
    x: np.ndarray
    m: np.ndarray
    v: np.ndarray


# Two block-sized scratch arrays per dtype (the step needs the denominator and the direction at once);
# like algorithms/_pool.py's, they belong to the one thread that runs the core.
_SCRATCH: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _scratch(dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    got = _SCRATCH.get(dtype.str)
    if got is None:
        got = _SCRATCH[dtype.str] = tuple(np.empty(BLOCK, dtype) for _ in range(3))
    return got


def _block(x, m, v, g, y, t1, t2, t0, c) -> None:
    """One block of :func:`adam_step` (every array the same length; ``c`` the scalars in the
    arrays' dtype). The ufunc calls, in this order, define the arithmetic."""
    if c["l2"] is not None:  # Adam's L2: g ← g + λ·x (into t0, never into the reply's g)
        np.multiply(x, c["l2"], out=t0)
        np.add(g, t0, out=t0)
        g = t0
    np.multiply(m, c["b1"], out=m)          # m ← β1·m + (1 − β1)·g
    np.multiply(g, c["a1"], out=t1)
    np.add(m, t1, out=m)
    np.multiply(v, c["b2"], out=v)          # v ← β2·v + (1 − β2)·g·g
    np.multiply(g, g, out=t1)
    np.multiply(t1, c["a2"], out=t1)
    np.add(v, t1, out=v)
    np.sqrt(v, out=t1)                      # denominator √v / √(1 − β2^t) + ε
    np.divide(t1, c["bc2"], out=t1)
    np.add(t1, c["eps"], out=t1)
    np.divide(m, t1, out=t2)                # −(lr / (1 − β1^t)) · m / denominator
    np.multiply(t2, c["step"], out=t2)
    if c["decay"] is not None:              # AdamW: x · (1 − lr·λ) first
        np.multiply(x, c["decay"], out=y)
        np.add(y, t2, out=y)
    else:
        np.add(x, t2, out=y)


def adam_step(x: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, *, t: int, lr: float, beta1: float,
              beta2: float, eps: float, weight_decay: float, decoupled: bool) -> np.ndarray:
    """One Adam(W) step at count t: m and v updated in place, the new read-only iterate returned
    in a pooled buffer (x and g are only read).

    One blocked pass (BLOCK elements at a time, the block's intermediates in two scratch
    arrays), so x, m, v and g are read once and m, v and the new iterate written once; below
    BLOCKED_MIN elements, or for other shapes, the same ufunc calls over the whole arrays (the
    same bits: every call is elementwise). The scalars (bias corrections in float64, as
    torch's Python floats) are cast to x's dtype.
    """
    dt = x.dtype
    bc1, bc2 = 1.0 - beta1 ** t, 1.0 - beta2 ** t
    wd = float(weight_decay)

    def s(a: float) -> np.ndarray:
        return np.asarray(a, dt)

    c = {"b1": s(beta1), "a1": s(1.0 - beta1), "b2": s(beta2), "a2": s(1.0 - beta2), "bc2": s(math.sqrt(bc2)),
         "eps": s(eps), "step": s(-(lr / bc1)),
         "decay": s(1.0 - lr * wd) if decoupled and wd else None, "l2": s(wd) if not decoupled and wd else None}
    y = POOL.empty(x.shape, dt)
    n = x.shape[0] if x.ndim == 1 else 0
    if _blocked(n, m, v, g):
        s1, s2, s0 = _scratch(dt)
        for i in range(0, n, BLOCK):
            j = min(i + BLOCK, n)
            k = j - i
            _block(x[i:j], m[i:j], v[i:j], g[i:j], y[i:j], s1[:k], s2[:k], s0[:k], c)
    else:
        t1, t2, t0 = (np.empty(x.shape, dt) for _ in range(3))
        _block(x, m, v, g, y, t1, t2, t0, c)
    y.setflags(write=False)
    return y


@dataclass(frozen=True)
class AdamW(PerReplyAlgorithm):
    """AdamW applied by the server on each reply as it arrives (docs/ALGORITHMS.md §15).

    With t = version + 1, torch.optim.AdamW's step: x ← x·(1 − lr·λ), m ← β1 m + (1−β1) g,
    v ← β2 v + (1−β2) g², x ← x − lr/(1−β1^t) · m / (√v/√(1−β2^t) + ε). Kingma & Ba 2015;
    Loshchilov & Hutter 2019. A reply of any age is applied (the plain asynchronous choice)
    unless ``max_age`` bounds it.

    Args:
        lr: step size (> 0); a schedule (``lr_schedule``) scales it per update, decay included.
        beta1: β1 ∈ [0, 1), the decay of the first-moment estimate m.
        beta2: β2 ∈ [0, 1), the decay of the second-moment estimate v.
        eps: ε (> 0), added to √v̂ in the denominator.
        weight_decay: λ >= 0: decoupled decay x ← x·(1 − lr·λ) before each step (lr·λ < 1).
        max_age: drop replies older than this many versions (integer >= 0); none (default):
            apply every reply whatever its age.
    """

    name = "adamw"
    decoupled: ClassVar[bool] = True
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_age: int | None = None

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("beta1", self.beta1, lo=0.0, hi=1.0, hi_open=True)
        check_hyper("beta2", self.beta2, lo=0.0, hi=1.0, hi_open=True)
        check_hyper("eps", self.eps, lo=0.0, lo_open=True)
        check_hyper("weight_decay", self.weight_decay, lo=0.0)
        if self.decoupled and self.lr * self.weight_decay >= 1.0:
            raise ValueError(f"Invalid weight_decay: {self.weight_decay!r} (lr·weight_decay must be < 1, "
                             f"got {self.lr * self.weight_decay:g}: the decay factor 1 − lr·λ would not be positive)")
        if self.max_age is not None:
            check_hyper("max_age", self.max_age, lo=0, integer=True)

    def state_class(self) -> type:
        return AdamState

    def init(self, x0: np.ndarray, *, seed: int):
        x = frozen(np.array(x0, copy=True))
        return AdamState(version=0, x=x, m=np.zeros_like(x), v=np.zeros_like(x)), []

    def make_job(self, state: AdamState, worker_id: str):
        return state, grad_job(state.version, state.x)

    def apply(self, state: AdamState, results: Sequence[Result]):
        applied, dropped, ages = [], [], []
        for r in results:
            age = state.version - r.created_at
            if self.max_age is not None and age > self.max_age:
                dropped.append(r.job_id)
                continue
            state.x = adam_step(state.x, state.m, state.v, r.grads[0], t=state.version + 1, lr=self.lr,
                                beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay,
                                decoupled=self.decoupled)
            state.version += 1
            applied.append(r.job_id)
            ages.append(age)
        return state, Outcome(applied=tuple(applied), dropped=tuple(dropped), updated=bool(applied),
                              ages=tuple(ages))

    def validate_state(self, state: AdamState) -> None:
        super().validate_state(state)
        for name in ("m", "v"):
            a = getattr(state, name)
            if not isinstance(a, np.ndarray) or a.shape != state.x.shape or a.dtype != state.x.dtype:
                raise ValueError(f"{self.name}: {name} must match x in shape and dtype")
            if not np.all(np.isfinite(a)):
                raise ValueError(f"{self.name}: {name} must be finite")
        if np.any(state.v < 0):
            raise ValueError(f"{self.name}: the second moment v must be >= 0")


@dataclass(frozen=True)
class Adam(AdamW):
    """Adam applied by the server on each reply as it arrives (docs/ALGORITHMS.md §15).

    torch.optim.Adam's step, weight decay as L2 added to the gradient (g ← g + λ·x), then the
    Adam step of ``adamw`` at t = version + 1. Kingma & Ba 2015. A reply of any age is applied
    unless ``max_age`` bounds it.

    Args:
        lr: step size (> 0); a schedule (``lr_schedule``) scales it per update.
        beta1: β1 ∈ [0, 1), the decay of the first-moment estimate m.
        beta2: β2 ∈ [0, 1), the decay of the second-moment estimate v.
        eps: ε (> 0), added to √v̂ in the denominator.
        weight_decay: λ >= 0: L2 regularisation, g ← g + λ·x before the moments (0: none; for
            decoupled decay use adamw).
        max_age: drop replies older than this many versions (integer >= 0); none (default):
            apply every reply whatever its age.
    """

    name = "adam"
    decoupled: ClassVar[bool] = False
    weight_decay: float = 0.0
