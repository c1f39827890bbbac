"""The algorithm interface (docs/ALGORITHMS.md §2.2): pure state machines, no clock, no I/O.

An algorithm is a frozen dataclass of hyper-parameters. Everything that evolves lives in a
state object that the algorithm creates in :meth:`Algorithm.init` and that every other method
takes and returns. ``apply`` may update state arrays in place and return the same object; the
caller treats the input state as consumed ("pure-ish", as torch's functional optimizers).

Iterates handed out in a :class:`JobSpec` are immutable: once an array is given to the driver
it is never written again (the driver sends it zero-copy and caches it by id). Use
:func:`publish` to make such a snapshot.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Sequence

import numpy as np

from protocol.messages import JobKind

__all__ = [
    "Algorithm", "JobSpec", "Outcome", "Result", "publish", "check_hyper", "state_arrays_equal",
    "jobs_created_at_most", "bind_layout",
]


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A job as the algorithm asks for it; the driver adds job id, seed and worker.

    ``points`` are the arrays for ``iterate_ids``, same order, read-only. An iterate id is the
    version at which that iterate was (or is) the model, so never above the current version:
    the core trusts a worker's cached ids only up to its own version (after a restart, higher
    ids came from an old server process's unjournaled tail).
    ``batch_size`` None means the driver's default batch size.
    """

    kind: JobKind
    created_at: int
    iterate_ids: tuple[int, ...]
    points: tuple[np.ndarray, ...]
    batch_size: int | None = None
    shard: tuple[int, int] | None = None
    deadline: int | None = None


_NORM_CHUNK = 1 << 16


def _sq_sum(flat: np.ndarray) -> float:
    """Σ v² of a flat array in float64, summed in fixed chunks from its start: the same bits for
    the same values whatever the BLAS threads or where the array lies in memory (a replay, and
    every shard, must see the same bits), with a bounded temporary."""
    total = 0.0
    for lo in range(0, flat.size, _NORM_CHUNK):
        total += float(np.square(flat[lo:lo + _NORM_CHUNK], dtype=np.float64).sum())
    return total


def block_sq_sums(g: np.ndarray, layout: tuple) -> tuple[float, ...]:
    """‖g_b‖₂² for each block b of ``layout`` (in layout order), g flat; an empty layout (an
    algorithm not bound to one) is one block of everything.

    Raises:
        ValueError: ``g`` does not have the layout's size.
    """
    flat = np.asarray(g).reshape(-1)
    if not layout:
        return (_sq_sum(flat),)
    out, lo = [], 0
    for _, shape in layout:
        hi = lo + math.prod(shape)
        out.append(_sq_sum(flat[lo:hi]))
        lo = hi
    if lo != flat.size:
        raise ValueError(f"a gradient of {flat.size} values for a layout of {lo}")
    return tuple(out)


def norm_from_block_sq(block_sq: Sequence[float]) -> float:
    """‖g‖₂ from its blocks' squared norms: the exactly rounded sum (order does not matter)."""
    return math.sqrt(math.fsum(block_sq))


@dataclass(frozen=True, slots=True)
class Result:
    """A validated reply as the algorithm sees it (docs/ALGORITHMS.md §2.1).

    ``created_at``, ``kind``, ``iterate_ids`` and ``seed`` come from the server's own job
    ledger, never from the worker. ``grads`` has one array per iterate id, same order;
    for FULL_GRAD, ``grads[0]`` is the sum over the shard and ``count`` its size.

    ``block_sq``: the squared Euclidean norm of ``grads[0]`` per block of the *whole* layout
    (:func:`block_sq_sums`), for an algorithm whose vector work needs a norm
    over every block (``needs_block_norms``: ``clip_norm``). None: the algorithm computes it from
    ``grads[0]`` itself. A sharded server sets it, since a shard holds only its blocks' slice of
    the gradient: each shard measures its own blocks, and the coordinator gathers the figures in
    block order and journals them with the reply (docs/ALGORITHMS.md §14).

    ``step_sq``: the same for a vector of the algorithm's own *state* whose whole norm its step
    by this result divides by (``needs_step_norms``: ``ringmaster-lmo`` with ``lmo="l2"``,
    ‖u‖ of the momentum), per block of the whole layout, as :meth:`Algorithm.step_sq` measures
    it on the state before the step. None: the algorithm measures it itself.
    """

    job_id: int
    worker_id: str
    created_at: int
    kind: JobKind
    iterate_ids: tuple[int, ...]
    grads: tuple[np.ndarray, ...]
    seed: int = 0
    loss: float | None = None
    count: int = 0
    shard: tuple[int, int] | None = None
    block_sq: tuple[float, ...] | None = None
    step_sq: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one ``apply`` call did. ``ages`` has the age of each applied result, same order."""

    applied: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    updated: bool = False
    ages: tuple[int, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)


def publish(x: np.ndarray) -> np.ndarray:
    """Return a read-only copy of ``x`` suitable for a JobSpec (never mutated afterwards)."""
    y = np.array(x, copy=True)
    y.setflags(write=False)
    return y


def jobs_created_at_most(outstanding: Sequence[Any], created_at: int) -> list[int]:
    """Ids of the jobs among ``outstanding`` created at version ``created_at`` or before, in
    their order. The core passes an index (``ps.core.ledger.Outstanding``) that answers this at the
    cost of what it returns; any other sequence is scanned."""
    indexed = getattr(outstanding, "created_at_most", None)
    if indexed is not None:
        return indexed(created_at)
    return [j.job_id for j in outstanding if j.created_at <= created_at]


def bind_layout(alg: Any, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> Any:
    """``alg.bind(layout, lmo_mask=lmo_mask)``, or ``alg.bind(layout)`` when there is no mask or
    ``alg.bind`` takes no ``lmo_mask`` (an algorithm written before the mask existed). What the
    drivers (CLI, simulator, replay) call with ``problem.layout`` and ``problem.lmo_mask``."""
    if lmo_mask is None:
        return alg.bind(layout)
    try:
        params = inspect.signature(alg.bind).parameters.values()
    except (TypeError, ValueError):
        return alg.bind(layout)
    if any(p.name == "lmo_mask" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return alg.bind(layout, lmo_mask=lmo_mask)
    return alg.bind(layout)


def check_hyper(name: str, value: Any, *, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, hi_open: bool = False, integer: bool = False) -> None:
    """Raise ValueError with the bad value when a hyper-parameter is out of range.

    Mirrors torch.optim's ``"Invalid learning rate: {lr}"`` messages.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"Invalid {name}: {value!r} (expected a number)")
    if integer and int(value) != value:
        raise ValueError(f"Invalid {name}: {value!r} (expected an integer)")
    if not np.isfinite(value):
        raise ValueError(f"Invalid {name}: {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ValueError(f"Invalid {name}: {value!r} (must be {'>' if lo_open else '>='} {lo})")
    if hi is not None and (value > hi or (hi_open and value == hi)):
        raise ValueError(f"Invalid {name}: {value!r} (must be {'<' if hi_open else '<='} {hi})")


class NonFiniteGradient(ValueError):
    """Raised by the ``apply`` of a method that ``checks_finite``: a result's gradient holds a NaN
    or an Inf; the state is as it was."""


class Algorithm:
    """Base class of every algorithm. Subclasses are frozen dataclasses of hyper-parameters.

    Attributes:
        name: registry name (``--algorithm NAME``).
        mode: ``"per_reply"``: the driver calls ``apply`` with each result as it arrives.
            ``"round"``: the driver buffers results and calls ``apply`` with everything that
            arrived since the last round, once per round (possibly with an empty list); a
            round happens whenever a worker is ready for a job (demand-driven) or on the
            driver's clock if it has a round period.
        weight_decay_refusal: why the ``weight_decay`` wrapper (``algorithms/wrappers.py``) must
            not decay ``state.x`` after an update; empty (the default) accepts it.
        checks_finite: a per-reply method whose ``apply`` of one result tests the gradients
            finite in its own vector pass and raises :class:`NonFiniteGradient`, having changed
            nothing, if they are not; the server then leaves that test to it (one pass over g
            instead of two), calling :meth:`apply_checked`. False (the default): the server
            tests before ``apply``.
    """

    name: ClassVar[str] = ""
    mode: ClassVar[Literal["per_reply", "round"]] = "per_reply"
    weight_decay_refusal: ClassVar[str] = ""
    checks_finite: ClassVar[bool] = False

    # ---- required
    def init(self, x0: np.ndarray, *, seed: int) -> tuple[Any, list[JobSpec]]:
        """Create the state at x0. The list holds blocking initialization jobs (may be empty)."""
        raise NotImplementedError

    def make_job(self, state: Any, worker_id: str) -> tuple[Any, JobSpec | None]:
        """Ask for the next job for a free worker; None lets the worker idle."""
        raise NotImplementedError

    def apply(self, state: Any, results: Sequence[Result]) -> tuple[Any, Outcome]:
        """Consume results (per-reply: exactly one; round: zero or more)."""
        raise NotImplementedError

    def apply_checked(self, state: Any, result: Result, squares: bool = False) -> tuple[Any, Outcome]:
        """For a method that ``checks_finite``: ``apply(state, [result])``, raising
        :class:`NonFiniteGradient` with nothing changed where a gradient holds a NaN or an Inf,
        or, with ``squares`` (a run with ``refuse_overflow``), where the square of one of its
        values overflows (``algorithms._pool.squares_finite``). This default leaves the NaN/Inf
        test to ``apply`` and, with ``squares``, tests the squares before it (a method written
        before ``squares`` existed stays right, at a second pass over g);
        :class:`algorithms.baselines.VanillaASGD` tests both in its step's one pass."""
        from algorithms._pool import squares_finite

        if squares and not all(squares_finite(g) for g in result.grads):
            raise NonFiniteGradient(f"job {result.job_id}: gradient holds NaN or Inf")
        return self.apply(state, [result])

    def params(self, state: Any) -> np.ndarray:
        """The current iterate x_k (may be a live view; copy before keeping it)."""
        return state.x

    def version(self, state: Any) -> int:
        """k: the number of model updates applied so far."""
        return state.version

    # ---- optional, with defaults
    def bind(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> Algorithm:
        """Specialize to the problem's parameter layout; the driver calls it once, before init.

        ``layout`` is ``problem.layout`` (``((name, shape), ...)``); ``lmo_mask`` is the problem's
        optional ``lmo_mask`` (one bool per block: True where an LMO/Muon step applies, False
        for the momentum fallback), None when the problem has none. Drivers call it through
        :func:`bind_layout`, which leaves the mask out for a ``bind`` written without it. The
        default ignores both and returns ``self``; layout-aware methods (Muon) return a copy
        that holds them.
        """
        return self

    def cancel(self, state: Any, outstanding: Sequence[Any]) -> list[int]:
        """Job ids among ``outstanding`` (objects with job_id, created_at, kind, iterate_ids) to stop now.

        The core calls it after every apply with a read-only view of its outstanding jobs in
        job-id order (``ps.core.ledger.Outstanding``), valid during the call. Iterating it costs its
        length, which job hoarders can make large; its indexed queries (``created_at_most``,
        ``count_like``, ``oldest_created_at``; see :func:`jobs_created_at_most`) cost what they
        return. Tests may pass a plain list."""
        return []

    def on_issued(self, state: Any, job_id: int, spec: JobSpec) -> Any:
        """Told that ``spec`` (from ``make_job``) was handed out as job ``job_id``. Returns the state.

        The core calls it once per job, in hand-out order, when the job gets its id (with clock
        rounds that can be after later ``make_job`` calls: their specs wait in a queue). An
        algorithm that must place the ids ``on_lost`` names (A11, A12) learns them here; the
        default does nothing."""
        return state

    def on_lost(self, state: Any, job_ids: Sequence[int]) -> Any:
        """Told that these outstanding jobs were written off (worker dead). Returns the state."""
        return state

    def live_iterate_ids(self, state: Any) -> set[int]:
        """Iterate ids the algorithm itself needs the store to keep (besides outstanding jobs')."""
        return set()

    def metrics(self, state: Any) -> dict[str, float]:
        """Extra per-step figures to log (e.g. missing mass M_k, batch fill)."""
        return {}

    def shard_refusal(self) -> str:
        """Why this algorithm cannot run sharded over whole layout blocks (``algorithms/sharding.py``),
        "" when it can: when every decision depends only on the replies' metadata and the vector
        work is elementwise or per layout block (bound through :meth:`bind`), so that S copies,
        each on its own blocks, decide the same and compute the same bits. The default refuses:
        an algorithm says it is shardable by returning ""."""
        return "it does not say that its vector work is elementwise or per layout block (shard_refusal)"

    def needs_step_norms(self) -> bool:
        """Whether ``apply`` needs ``Result.step_sq``: a norm over every block of a vector of its
        own state (a sharded server gathers each shard's :meth:`step_sq` before the step, one
        reply at a time; algorithms/sharding.py). That vector must change only when a reply is
        applied (not in ``on_lost``, ``make_job`` or ``on_issued``): a multi-process coordinator
        lets other records pass between a shard's answer and the step (each shard checks its
        figures again when it applies the step, and stops on a difference). The default: no."""
        return False

    def step_sq(self, state: Any, result: Result) -> tuple[float, ...] | None:
        """For an algorithm that ``needs_step_norms``: the per-block squared norms (over the
        layout it is bound to, :func:`block_sq_sums`) of the vector whose whole norm its step by
        ``result`` divides by, measured on ``state`` as it is before that step, changing nothing;
        () when bound to no blocks. None: this result needs none."""
        return None

    def needs_block_norms(self) -> bool:
        """Whether ``apply`` needs ``Result.block_sq``, the gradient's squared norm per layout
        block over the whole layout (a reduction across shards: a sharded server gathers it from
        its shards, algorithms/sharding.py). The default: no."""
        return False

    def splittable_blocks(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> tuple[bool, ...]:
        """One bool per block of ``layout``: True where this algorithm's vector work on the block
        is elementwise, so that a sharded server may cut the block between any two coordinates
        (``algorithms/sharding.py``). The default splits nothing (whole blocks only); an
        elementwise algorithm says True everywhere, a per-block LMO/Muon step True on the blocks
        it steps elementwise."""
        return (False,) * len(tuple(layout))

    # ---- state save/load: plain arrays and numbers, validated on load
    def to_state_dict(self, state: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(state):
            v = getattr(state, f.name)
            if isinstance(v, np.random.Generator):
                v = {"__rng__": v.bit_generator.state}
            elif isinstance(v, np.ndarray):
                v = v.copy()
            elif isinstance(v, dict):
                v = {str(k): (a.copy() if isinstance(a, np.ndarray) else a) for k, a in v.items()}
            elif isinstance(v, list):
                v = [a.copy() if isinstance(a, np.ndarray) else a for a in v]
            out[f.name] = v
        return out

    def from_state_dict(self, d: dict[str, Any]) -> Any:
        state_cls = self.state_class()
        names = {f.name for f in dataclasses.fields(state_cls)}
        if set(d) != names:
            raise ValueError(f"{self.name}: state dict keys {sorted(d)} do not match {sorted(names)}")
        kwargs = {}
        for f in dataclasses.fields(state_cls):
            v = d[f.name]
            if isinstance(v, dict) and "__rng__" in v:
                rng = np.random.Generator(np.random.PCG64())
                rng.bit_generator.state = v["__rng__"]
                v = rng
            elif isinstance(v, np.ndarray):
                v = v.copy()
            kwargs[f.name] = v
        state = state_cls(**kwargs)
        self.validate_state(state)
        return state

    def state_class(self) -> type:
        raise NotImplementedError

    def validate_state(self, state: Any) -> None:
        """Raise ValueError if a loaded state is inconsistent (override to check more)."""
        if not isinstance(state.version, (int, np.integer)) or state.version < 0:
            raise ValueError(f"{self.name}: bad version {state.version!r}")
        x = state.x
        if not isinstance(x, np.ndarray) or x.ndim != 1 or not np.all(np.isfinite(x)):
            raise ValueError(f"{self.name}: state x must be a finite 1-D array")


def state_arrays_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bitwise equality of two state dicts (arrays compared with array_equal and dtype)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)) or x.dtype != y.dtype \
                    or not np.array_equal(x, y):
                return False
        elif isinstance(x, dict) and isinstance(y, dict):
            if not state_arrays_equal(x, y):
                return False
        elif isinstance(x, list) and isinstance(y, list):
            if len(x) != len(y) or not all(state_arrays_equal({"v": p}, {"v": q}) for p, q in zip(x, y, strict=True)):
                return False
        elif x != y:
            return False
    return True
