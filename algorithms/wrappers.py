"""Server-side wrappers that compose with any algorithm (optax's ``chain`` as the model).

Three transformations, each an :class:`Algorithm` around another one, stack in a fixed order
(:func:`chain`): ``LRSchedule(WeightDecay(ClipGradNorm(algorithm)))``. On the command line
they are ``--set`` keys given next to the algorithm's own hyper-parameters; ``build`` in
``algorithms/registry.py`` splits them off and calls :func:`chain`.

Step-size schedule (``lr_schedule``, ``warmup``, ``decay_steps``, ``min_lr_ratio``,
``step_every``, ``gamma``). The step size of the update that turns x_k into x_{k+1}, with k the
algorithm's model version (``version(state)``) and lr the algorithm's own ``lr``
hyper-parameter, is lr_k = lr · f(k) with, for W = ``warmup``, T = ``decay_steps``,
r = ``min_lr_ratio``, t = k − W:

    warmup     k < W:    f = (k + 1) / W          (the first update already moves; f = 1 at k = W − 1)
    constant   k >= W:   f = 1
    linear     k >= W:   f = 1 − (1 − r) · min(t, T − W) / (T − W)
    cosine     k >= W:   f = r + (1 − r) · (1 + cos(π · min(t, T − W) / (T − W))) / 2
    step       k >= W:   f = gamma ^ floor(t / step_every)

``decay_steps`` counts the warmup too (the run's length: optax's ``warmup_cosine_decay_schedule``
convention); from k = T on, linear and cosine stay at r. It defaults to the server's
``--max-steps`` where the command line knows it, and is recorded in the run's settings. The
schedule sets the ``lr`` attribute of a copy of the algorithm for each ``apply`` call (in the
driver a per-reply ``apply`` gets exactly one reply and a round ``apply`` makes at most one
update), so an algorithm only has to read ``self.lr`` when it steps. Delay-adaptive step sizes
(``delay-adaptive``: lr·n/max(n, δ)) scale the scheduled lr.

Decoupled weight decay (``weight_decay`` = λ, AdamW's form): after each model update,
x ← x − lr_k · λ · x, with lr_k the scheduled lr of that update (the base lr without a schedule,
not a delay-adapted one). It replaces ``state.x`` by a new read-only array, and every other state
field that is the very same array (an alias such as a snapshot anchor that was set to x during
the update) with it, so the iterate a job carries under id k+1 is the decayed one everywhere.
Per algorithm: plain SGD, momentum, Ringmaster, Rennala (SGD, MVR: the next pair (x_{k+1}, x_k)
is made of decayed published iterates), Muon/LMO methods and the delayed-VR methods (their
snapshot anchor is an alias of x) step x itself, so decaying x is AdamW's decay. ``ordered-mu2``
is refused: it steps a descent sequence w and publishes an average x of it, so decaying x would
not decay the model (w), and decaying w too would be a different algorithm. An algorithm class
refuses it the same way by setting the class attribute ``weight_decay_refusal`` to the reason.

Global gradient-norm clipping (``clip_norm`` = c): each stochastic gradient g of a reply
(GRAD) is divided by s = max(1, ‖g‖₂ / c), the norm taken over the whole flat vector (all
layout blocks together) in float64: ‖g‖₂² is the exactly rounded sum (``math.fsum``) of the
per-block squared norms (:func:`block_sq_sums`, each summed in fixed chunks from its block's
start), so a sharded server, whose shards each measure their own blocks, gets the same bits as
one process (``Result.block_sq``; with ``clip_norm`` a block is never split between shards).
A GRAD_PAIR reply is divided by one s for both gradients, taken from the newer point's
gradient (``grads[0]``), so a variance-reduction difference ∇f(x_k; ξ) − (1 − a) ∇f(x_{k−1}; ξ)
is scaled as a whole. FULL_GRAD shards (exact full-gradient sums, e.g. ``snapshot-vr``'s
snapshots) are not clipped. A reply within the bound is passed on unchanged (the same arrays).

The wrappers keep no state of their own: the state, its state dict, checkpoints and journals
are exactly the wrapped algorithm's, and ``name``, ``mode``, ``bind``, ``state_class``,
``live_iterate_ids``, ``cancel``, ``on_lost`` and ``metrics`` delegate (``metrics`` adds ``lr``,
the scheduled step size, unless the algorithm reports an ``lr`` of its own). Everything they
compute depends only on the version and the replies, so a replayed or resumed run is bit for
bit the recorded one.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import numpy as np

from algorithms._pool import POOL, step_into
from algorithms.base import (
    Algorithm,
    JobSpec,
    Result,
    _sq_sum,
    bind_layout,
    block_sq_sums,
    check_hyper,
    norm_from_block_sq,
)
from protocol.messages import JobKind

__all__ = ["WrapperSettings", "WRAPPER_KEYS", "LRSchedule", "WeightDecay", "ClipGradNorm", "Wrapper", "chain",
           "lr_factor", "global_norm", "block_sq_sums", "norm_from_block_sq", "needs_block_norms", "needs_step_norms",
           "unwrap"]

SCHEDULES = ("constant", "linear", "cosine", "step")


@dataclass(frozen=True)
class WrapperSettings:
    """The wrapper keys of ``--set`` and their defaults (a default means "no wrapper")."""

    lr_schedule: Literal["constant", "linear", "cosine", "step"] = field(default="constant", metadata={
        "help": "step-size schedule f(k) multiplying the algorithm's lr at model version k: constant, linear "
                "(to min_lr_ratio at decay_steps), cosine (to min_lr_ratio at decay_steps) or step "
                "(× gamma every step_every updates)."})
    warmup: int = field(default=0, metadata={
        "help": "W: linear warmup, f(k) = (k+1)/W for k < W, then the schedule (0: none; works with any schedule)."})
    decay_steps: int | None = field(default=None, metadata={
        "help": "T: linear/cosine reach min_lr_ratio at version T (counts the warmup; default the server's "
                "--max-steps)."})
    min_lr_ratio: float = field(default=0.0, metadata={
        "help": "r ∈ [0, 1]: the final lr of linear/cosine as a fraction of lr."})
    step_every: int | None = field(default=None, metadata={
        "help": "step schedule: multiply the lr by gamma every this many updates after the warmup (required)."})
    gamma: float = field(default=0.1, metadata={
        "help": "step schedule: the factor γ ∈ (0, 1], f = γ^floor((k − W)/step_every)."})
    weight_decay: float = field(default=0.0, metadata={
        "help": "λ >= 0: decoupled weight decay x ← x − lr_k·λ·x after each model update (AdamW; 0: none)."})
    clip_norm: float | None = field(default=None, metadata={
        "help": "c > 0: divide each stochastic gradient by max(1, ‖g‖₂/c), global norm over all blocks "
                "(pair replies: one factor from the newer gradient; FULL_GRAD shards unclipped)."})


WRAPPER_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(WrapperSettings))


def lr_factor(k: int, *, schedule: str = "constant", warmup: int = 0, decay_steps: int | None = None,
              min_lr_ratio: float = 0.0, step_every: int | None = None, gamma: float = 0.1) -> float:
    """f(k): the factor of the base lr at model version k (closed forms in the module docstring).

    Raises:
        ValueError: k < 0, or a schedule without the settings it needs.
    """
    if k < 0:
        raise ValueError(f"Invalid version: {k!r}")
    if k < warmup:
        return (k + 1) / warmup
    t = k - warmup
    if schedule == "constant":
        return 1.0
    if schedule == "step":
        if not step_every:
            raise ValueError("lr_schedule=step needs step_every")
        return float(gamma) ** (t // step_every)
    if decay_steps is None or decay_steps <= warmup:
        raise ValueError(f"lr_schedule={schedule} needs decay_steps > warmup")
    span = decay_steps - warmup
    p = min(t, span) / span
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * p
    if schedule == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 + math.cos(math.pi * p)) / 2.0
    raise ValueError(f"Invalid lr_schedule: {schedule!r} (choose one of {', '.join(SCHEDULES)})")


def global_norm(g: np.ndarray) -> float:
    """‖g‖₂ over every element as one block (:func:`algorithms.base.block_sq_sums`)."""
    return math.sqrt(_sq_sum(np.asarray(g).reshape(-1)))


def needs_block_norms(alg: Algorithm) -> bool:
    """``alg.needs_block_norms()`` (an algorithm without the method, a user's own, needs none)."""
    fn = getattr(alg, "needs_block_norms", None)
    return bool(fn()) if fn is not None else False


def needs_step_norms(alg: Algorithm) -> bool:
    """``alg.needs_step_norms()`` (an algorithm without the method needs none)."""
    fn = getattr(alg, "needs_step_norms", None)
    return bool(fn()) if fn is not None else False


def _base(alg: Algorithm) -> Algorithm:
    while isinstance(alg, Wrapper):
        alg = alg.inner
    return alg


def unwrap(alg: Algorithm) -> Algorithm:
    """The algorithm inside any wrappers (``alg`` itself if it is not wrapped)."""
    return _base(alg)


def _with_lr(alg: Algorithm, lr: float) -> Algorithm:
    """A copy of ``alg`` (through its wrappers) whose base algorithm has ``lr``; bound
    attributes such as a Muon layout are kept (a shallow copy, not a re-init)."""
    new = copy.copy(alg)
    if isinstance(alg, Wrapper):
        object.__setattr__(new, "inner", _with_lr(alg.inner, lr))
    else:
        object.__setattr__(new, "lr", lr)
    return new


def _lr_at(alg: Algorithm, k: int) -> float:
    """The step size ``alg`` uses for the update at version k (scheduled if a schedule wraps it)."""
    if isinstance(alg, Wrapper):
        return alg.lr_at(k)
    return float(alg.lr)


@dataclass(frozen=True)
class Wrapper(Algorithm):
    """Base of the wrappers: everything delegates to ``inner``; subclasses override ``apply``.

    Attribute reads that the wrapper does not answer (hyper-parameters such as ``lr`` or ``R``)
    go to ``inner``, so code that inspects an algorithm sees the wrapped one's values.
    """

    inner: Algorithm

    def __getattr__(self, item: str) -> Any:
        if item == "inner" or item.startswith("__"):
            raise AttributeError(item)
        return getattr(self.inner, item)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def mode(self) -> str:  # type: ignore[override]
        return self.inner.mode

    def lr_at(self, k: int) -> float:
        """The step size of the update at version k."""
        return _lr_at(self.inner, k)

    def bind(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> Algorithm:
        new = copy.copy(self)
        object.__setattr__(new, "inner", bind_layout(self.inner, layout, lmo_mask))
        return new

    def init(self, x0: np.ndarray, *, seed: int):
        return self.inner.init(x0, seed=seed)

    def make_job(self, state: Any, worker_id: str):
        return self.inner.make_job(state, worker_id)

    def apply(self, state: Any, results: Sequence[Result]):
        return self.inner.apply(state, results)

    def params(self, state: Any) -> np.ndarray:
        return self.inner.params(state)

    def version(self, state: Any) -> int:
        return self.inner.version(state)

    def cancel(self, state: Any, outstanding: Sequence[Any]) -> list[int]:
        return self.inner.cancel(state, outstanding)

    def on_issued(self, state: Any, job_id: int, spec: JobSpec) -> Any:
        return self.inner.on_issued(state, job_id, spec)

    def on_lost(self, state: Any, job_ids: Sequence[int]) -> Any:
        return self.inner.on_lost(state, job_ids)

    def live_iterate_ids(self, state: Any) -> set[int]:
        return self.inner.live_iterate_ids(state)

    def metrics(self, state: Any) -> dict[str, float]:
        return self.inner.metrics(state)

    def shard_refusal(self) -> str:
        return self.inner.shard_refusal()

    def needs_block_norms(self) -> bool:
        return needs_block_norms(self.inner)

    def needs_step_norms(self) -> bool:
        return needs_step_norms(self.inner)

    def step_sq(self, state: Any, result: Result) -> tuple[float, ...] | None:
        return self.inner.step_sq(state, result)  # a schedule or weight decay does not change u

    def splittable_blocks(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> tuple[bool, ...]:
        return self.inner.splittable_blocks(layout, lmo_mask)  # the wrappers' own work is elementwise

    def to_state_dict(self, state: Any) -> dict[str, Any]:
        return self.inner.to_state_dict(state)

    def from_state_dict(self, d: dict[str, Any]) -> Any:
        return self.inner.from_state_dict(d)

    def state_class(self) -> type:
        return self.inner.state_class()

    def validate_state(self, state: Any) -> None:
        self.inner.validate_state(state)


def _needs_lr(alg: Algorithm, what: str) -> None:
    """Raise ValueError unless the base algorithm has an ``lr`` hyper-parameter (a dataclass field)."""
    base = _base(alg)
    fields = {f.name for f in dataclasses.fields(base)} if dataclasses.is_dataclass(base) else set()
    if "lr" not in fields:
        raise ValueError(f"{what} needs an algorithm with an lr hyper-parameter; {base.name or type(base).__name__} "
                         "has none")


@dataclass(frozen=True)
class LRSchedule(Wrapper):
    """lr_k = lr · f(k) (see :func:`lr_factor`); put outermost so inner wrappers see lr_k."""

    schedule: str = "constant"
    warmup: int = 0
    decay_steps: int | None = None
    min_lr_ratio: float = 0.0
    step_every: int | None = None
    gamma: float = 0.1

    def __post_init__(self) -> None:
        _needs_lr(self.inner, f"lr_schedule={self.schedule}" if self.schedule != "constant" else "warmup")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Invalid lr_schedule: {self.schedule!r} (choose one of {', '.join(SCHEDULES)})")
        check_hyper("warmup", self.warmup, lo=0, integer=True)
        check_hyper("min_lr_ratio", self.min_lr_ratio, lo=0.0, hi=1.0)
        check_hyper("gamma", self.gamma, lo=0.0, hi=1.0, lo_open=True)
        if self.schedule in ("linear", "cosine"):
            if self.decay_steps is None:
                raise ValueError(f"lr_schedule={self.schedule} needs decay_steps (--set decay_steps=N; serve, run "
                                 "and simulate default it to their step limit)")
            check_hyper("decay_steps", self.decay_steps, lo=1, integer=True)
            if self.decay_steps <= self.warmup:
                raise ValueError(f"Invalid decay_steps: {self.decay_steps!r} (must be > warmup={self.warmup}; it "
                                 "counts the warmup)")
        if self.schedule == "step":
            if self.step_every is None:
                raise ValueError("lr_schedule=step needs step_every (--set step_every=N)")
            check_hyper("step_every", self.step_every, lo=1, integer=True)
        object.__setattr__(self, "_memo", {})  # lr -> the copy of inner with that lr (the last one)

    def factor(self, k: int) -> float:
        """f(k)."""
        return lr_factor(k, schedule=self.schedule, warmup=self.warmup, decay_steps=self.decay_steps,
                         min_lr_ratio=self.min_lr_ratio, step_every=self.step_every, gamma=self.gamma)

    def lr_at(self, k: int) -> float:
        return _lr_at(self.inner, k) * self.factor(k)

    def _inner_at(self, lr: float) -> Algorithm:
        memo = self.__dict__["_memo"]
        alg = memo.get(lr)
        if alg is None:
            memo.clear()
            alg = memo[lr] = _with_lr(self.inner, lr)
        return alg

    def bind(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> Algorithm:
        return dataclasses.replace(self, inner=bind_layout(self.inner, layout, lmo_mask))

    def apply(self, state: Any, results: Sequence[Result]):
        lr = self.lr_at(self.inner.version(state))
        state, outcome = self._inner_at(lr).apply(state, results)
        if outcome.updated:
            outcome = dataclasses.replace(outcome, metrics={"lr": lr, **outcome.metrics})
        return state, outcome

    def metrics(self, state: Any) -> dict[str, float]:
        return {"lr": self.lr_at(self.inner.version(state)), **self.inner.metrics(state)}


@dataclass(frozen=True)
class WeightDecay(Wrapper):
    """After each model update x ← x − lr_k · λ · x (AdamW's decoupled decay)."""

    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        check_hyper("weight_decay", self.weight_decay, lo=0.0)
        _needs_lr(self.inner, "weight_decay")
        base = _base(self.inner)
        reason = getattr(base, "weight_decay_refusal", "")
        if reason:
            raise ValueError(f"weight_decay is not supported by {base.name or type(base).__name__}: {reason}")

    def apply(self, state: Any, results: Sequence[Result]):
        k = self.inner.version(state)
        state, outcome = self.inner.apply(state, results)
        done = self.inner.version(state) - k
        if done <= 0 or self.weight_decay == 0.0:
            return state, outcome
        old = state.x
        x = old
        for i in range(done):  # one update per apply in the driver; several only from direct callers
            x = step_into(x, _lr_at(self.inner, k + i) * self.weight_decay, x)
        state.x = x
        if dataclasses.is_dataclass(state):
            for f in dataclasses.fields(state):
                if f.name != "x" and getattr(state, f.name) is old:
                    setattr(state, f.name, x)
        return state, outcome

    def init(self, x0: np.ndarray, *, seed: int):
        state, jobs = self.inner.init(x0, seed=seed)
        if getattr(state, "x", None) is None or self.inner.params(state) is not state.x:
            raise ValueError("weight_decay needs an algorithm whose state keeps its iterate in state.x")
        return state, jobs


@dataclass(frozen=True)
class ClipGradNorm(Wrapper):
    """Divide each stochastic gradient by max(1, ‖g‖₂/c) before the wrapped algorithm sees it."""

    clip_norm: float = 1.0

    def __post_init__(self) -> None:
        check_hyper("clip_norm", self.clip_norm, lo=0.0, lo_open=True)

    def bind(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> Algorithm:
        new = super().bind(layout, lmo_mask)
        object.__setattr__(new, "_layout", tuple(layout))  # the blocks its norm is summed over
        return new

    def shard_refusal(self) -> str:
        return self.inner.shard_refusal()  # the norm is a reduction of per-block figures (Result.block_sq)

    def needs_block_norms(self) -> bool:
        return True

    def step_sq(self, state: Any, result: Result) -> tuple[float, ...] | None:
        return self.inner.step_sq(state, self.clip(result)[0])  # the inner step sees the clipped gradient

    def splittable_blocks(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> tuple[bool, ...]:
        # A block's squared norm is summed by the shard that holds it whole: a block cut in two would
        # be summed in two pieces, other bits than one process's.
        return (False,) * len(tuple(layout))

    def norm(self, r: Result) -> float:
        """‖grads[0]‖₂: from ``r.block_sq`` when the driver gave it (a sharded server), else
        measured over the layout this wrapper is bound to."""
        if r.block_sq is not None:
            return norm_from_block_sq(r.block_sq)
        return norm_from_block_sq(block_sq_sums(r.grads[0], self.__dict__.get("_layout", ())))

    def clip(self, r: Result) -> tuple[Result, float | None]:
        """The reply with its gradients scaled (itself if within the bound) and the norm measured
        (None for a FULL_GRAD shard, which is not clipped)."""
        if r.kind == JobKind.FULL_GRAD or not r.grads:
            return r, None
        norm = self.norm(r)
        if not norm > self.clip_norm:
            return r, norm
        s = norm / self.clip_norm
        grads = []
        for g in r.grads:
            out = POOL.empty(g.shape, g.dtype)
            np.divide(g, np.asarray(s, g.dtype), out=out)
            grads.append(out)
        return dataclasses.replace(r, grads=tuple(grads)), norm

    def apply(self, state: Any, results: Sequence[Result]):
        clipped, norms = [], []
        for r in results:
            c, norm = self.clip(r)
            clipped.append(c)
            if norm is not None:
                norms.append(norm)
        state, outcome = self.inner.apply(state, clipped)
        if norms and outcome.updated:
            outcome = dataclasses.replace(outcome, metrics={**outcome.metrics, "grad_norm": norms[-1]})
        return state, outcome


def chain(alg: Algorithm, settings: WrapperSettings, *, given: Sequence[str] = ()) -> Algorithm:
    """Wrap ``alg`` as the settings ask: ``LRSchedule(WeightDecay(ClipGradNorm(alg)))``, each
    layer only when it changes something.

    Args:
        alg: the algorithm to wrap.
        settings: the wrapper settings (their defaults wrap nothing).
        given: the keys the user set explicitly; a key that its schedule does not use
            (``gamma`` with ``lr_schedule=cosine``) is refused instead of silently ignored.

    Raises:
        ValueError: a setting out of range, one that does not apply, a schedule or weight decay
            for an algorithm without ``lr``, or weight decay for an algorithm that refuses it.
    """
    s = settings
    uses = {"constant": {"warmup"}, "linear": {"warmup", "decay_steps", "min_lr_ratio"},
            "cosine": {"warmup", "decay_steps", "min_lr_ratio"}, "step": {"warmup", "step_every", "gamma"}}
    sched_keys = {"warmup", "decay_steps", "min_lr_ratio", "step_every", "gamma"}
    if s.lr_schedule not in SCHEDULES:
        raise ValueError(f"Invalid lr_schedule: {s.lr_schedule!r} (choose one of {', '.join(SCHEDULES)})")
    unused = sorted((set(given) & sched_keys) - uses[s.lr_schedule])
    if unused:
        raise ValueError(f"{', '.join(unused)} does not apply to lr_schedule={s.lr_schedule} "
                         f"({s.lr_schedule} uses {', '.join(sorted(uses[s.lr_schedule]))})")
    out = alg
    if s.clip_norm is not None:
        out = ClipGradNorm(out, clip_norm=s.clip_norm)
    if s.weight_decay != 0.0 or "weight_decay" in given:
        out = WeightDecay(out, weight_decay=s.weight_decay)
    if s.lr_schedule != "constant" or s.warmup:
        out = LRSchedule(out, schedule=s.lr_schedule, warmup=s.warmup, decay_steps=s.decay_steps,
                         min_lr_ratio=s.min_lr_ratio, step_every=s.step_every, gamma=s.gamma)
    return out
