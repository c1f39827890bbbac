"""The algorithm contract as a reusable check: run it against your own algorithm (and, at the
end of this module, :func:`check_problem`: the problem contract, for your own problem).

Every registered algorithm passes it (``tests/sim/test_contract.py``); a user's algorithm
(``--algorithm mypkg.mod:MyAlgorithm``) should too before it meets real workers::

    from latecomer.testing import check_algorithm
    from mypkg.mod import MyAlgorithm

    def test_my_algorithm_meets_the_contract():
        check_algorithm(lambda: MyAlgorithm(lr=0.1))

The scenario, in the simulator (``ps/drivers/sim.py``, the real server core and the real worker
computation, simulated time): 6 workers with heterogeneous delays τ_i = √i plus half-normal
noise; worker 2 crashes at t = 50 s and rejoins 10 s later as a new incarnation, worker 5
crashes for good at t = 120 s (so jobs are written off and ``on_lost`` is exercised).

1. Convergence (:func:`check_convergence`): within 300 simulated seconds the loss f(x) − f* of
   the d = 16 quadratic of docs/ALGORITHMS.md §8.1 falls to at most 5 % of its starting value (for
   ``problem="logreg"``, a finite sum, the squared gradient norm to at most 1 %); the crashes
   really wrote off workers and jobs, and every issued job is accounted for. Along the way,
   every point a job carries is watched: an iterate id always names the same point, and a
   point handed out is never written again (workers and the iterate store keep it by id).
2. State-dict round trip (:func:`check_state_dict_round_trip`): a third of the way in, the
   algorithm state goes through ``to_state_dict``/``from_state_dict``; the reloaded state has
   the same state dict, and the run continues bit for bit like one that was not reloaded
   (same applied jobs, same final iterate, same state).
3. Checkpoint round trip (:func:`check_checkpoint_round_trip`): the same with the whole server
   core written to a checkpoint file and restored from it (``ps/journal/checkpoints.py``).

Each check raises ``AssertionError`` with a message saying what broke. Runs are deterministic
(``seed``), so a failure reproduces. ``algorithm`` is an :class:`algorithms.Algorithm` instance
or a factory (a zero-argument callable, e.g. the class itself for its defaults) called once
per simulation; algorithms are immutable, so an instance is reused as is.
"""

from __future__ import annotations

import hashlib
import math
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np

from algorithms.base import Algorithm, bind_layout
from algorithms.wrappers import Wrapper

__all__ = ["check_algorithm", "check_problem", "check_convergence", "check_state_dict_round_trip",
           "check_checkpoint_round_trip", "make_simulator", "N_WORKERS", "HORIZON", "CRITERIA"]

AlgorithmOrFactory = Union[Algorithm, Callable[[], Algorithm]]

N_WORKERS = 6
HORIZON = 300.0  # simulated seconds
#: problem -> (evaluation figure, largest final/initial ratio that passes)
CRITERIA: dict[str, tuple[str, float]] = {"quadratic": ("loss", 0.05), "logreg": ("grad_norm_sq", 0.01)}
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {"quadratic": {"d": 16}, "logreg": {"n": 400, "p": 10}}


def _fresh(algorithm: AlgorithmOrFactory) -> Algorithm:
    """The instance itself, or a new one from the factory."""
    alg = algorithm if isinstance(algorithm, Algorithm) else algorithm() if callable(algorithm) else algorithm
    if not isinstance(alg, Algorithm):
        raise TypeError(f"expected an Algorithm or a factory returning one, got {type(alg).__name__}")
    return alg


def _label(alg: Algorithm) -> str:
    return alg.name or type(alg).__name__


def make_simulator(algorithm: AlgorithmOrFactory, *, seed: int = 0, problem: str = "quadratic",
                   problem_options: Mapping[str, Any] | None = None):
    """The contract's simulation (see the module docstring), not yet run.

    ``seed`` 0 is the registry's contract run: the core draws from ``seed + 1`` and the delays
    from ``seed + 2``.
    """
    from problems import load_problem
    from ps.core.config import CoreConfig
    from ps.drivers.sim import Crash, DelayModel, Simulator

    opts = dict(DEFAULT_OPTIONS.get(problem, {}) if problem_options is None else problem_options)
    prob = load_problem(problem, opts)
    cfg = CoreConfig(min_workers=N_WORKERS, liveness_timeout_s=5.0, seed=seed + 1)
    return Simulator(_fresh(algorithm), prob, DelayModel.named("sqrt", N_WORKERS), cfg, seed=seed + 2,
                     crashes=[Crash(1, 50.0, 10.0), Crash(4, 120.0)])


def _digest(a: np.ndarray) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).digest() + str((a.dtype.str, a.shape)).encode()


@dataclass(frozen=True)
class _Watch(Wrapper):
    """Records every point handed out in a JobSpec (transparent otherwise), for the checks of
    :func:`check_convergence`: one point per iterate id, and no point written after it went out."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "seen", {})  # iterate id -> (the array, its digest when handed out)
        object.__setattr__(self, "conflicts", [])

    def _record(self, spec: Any) -> None:
        if spec is None:
            return
        for iid, p in zip(spec.iterate_ids, spec.points, strict=False):
            d = _digest(p)
            if iid in self.seen:
                if self.seen[iid][1] != d:
                    self.conflicts.append(int(iid))
            else:
                self.seen[iid] = (p, d)

    def init(self, x0: np.ndarray, *, seed: int):
        state, jobs = self.inner.init(x0, seed=seed)
        for spec in jobs:
            self._record(spec)
        return state, jobs

    def make_job(self, state: Any, worker_id: str):
        state, spec = self.inner.make_job(state, worker_id)
        self._record(spec)
        return state, spec

    def bind(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> Algorithm:
        return _Watch(bind_layout(self.inner, layout, lmo_mask))

    def violations(self) -> list[str]:
        """What broke the iterate contract, in words (empty if nothing)."""
        out = []
        if self.conflicts:
            out.append(f"iterate ids {sorted(set(self.conflicts))[:5]} were handed out with different points "
                       "(an iterate id must always name the same point)")
        written = sorted(int(i) for i, (p, d) in self.seen.items() if _digest(p) != d)
        if written:
            out.append(f"the points of iterate ids {written[:5]} changed after they were handed out (publish a "
                       "new array per version: workers and the iterate store keep them by id)")
        return out


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two state dicts (nested dicts, lists, arrays, scalars) first differ, bitwise; None if nowhere."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path or 'state'}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            d = _first_difference(a[k], b[k], f"{path}.{k}" if path else str(k))
            if d:
                return d
        return None
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return f"{path}: array vs {type(b if isinstance(a, np.ndarray) else a).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        if not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"):
            return f"{path}: values differ"
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}"
        for i, (p, q) in enumerate(zip(a, b, strict=True)):
            d = _first_difference(p, q, f"{path}[{i}]")
            if d:
                return d
        return None
    if a != b and not (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
        return f"{path}: {a!r} vs {b!r}"
    return None


def check_convergence(algorithm: AlgorithmOrFactory, *, seed: int = 0, problem: str = "quadratic",
                      problem_options: Mapping[str, Any] | None = None,
                      criterion: tuple[str, float] | None = None, horizon: float = HORIZON):
    """Contract part 1: convergence with crashed and rejoining workers. Returns the trace.

    Args:
        criterion: ``(figure, fraction)``: the final value of the evaluation ``figure`` must be at
            most ``fraction`` of its initial value; default :data:`CRITERIA` of the problem.

    Raises:
        AssertionError: it did not converge, the crashes left no trace, or jobs went unaccounted.
        ValueError: a problem without a default criterion and none given.
    """
    if criterion is None:
        if problem not in CRITERIA:
            raise ValueError(f"no default criterion for problem {problem!r}: give criterion=(figure, fraction)")
        criterion = CRITERIA[problem]
    key, fraction = criterion
    sim = make_simulator(lambda: _Watch(_fresh(algorithm)), seed=seed, problem=problem,
                         problem_options=problem_options)
    watch = sim.core.alg
    label = _label(watch)
    trace = sim.run(max_time=horizon, eval_every=100)
    broken = watch.violations()
    assert not broken, f"{label}: " + "; ".join(broken)
    first, last = trace.points[0], trace.points[-1]
    assert np.isfinite(last[key]), f"{label}: {key} is {last[key]} after {horizon:g} simulated s (diverged)"
    assert last[key] <= fraction * first[key], (
        f"{label}: {key} {first[key]:.4g} -> {last[key]:.4g} in {horizon:g} simulated s with crashes; the contract "
        f"needs at most {fraction:.0%} of the start ({fraction * first[key]:.4g}) after "
        f"{trace.counters['updates']} updates")
    c = trace.counters
    assert c["workers_lost"] >= 2 and c["lost"] >= 1, (
        f"{label}: the scripted crashes should write off 2 workers and at least one job, got "
        f"workers_lost={c['workers_lost']}, lost={c['lost']} (does the algorithm keep the crashed workers busy?)")
    assert sim.core.accounted(), f"{label}: jobs unaccounted for: {sim.core.counters.as_dict()}"
    return trace


def _compare_continuations(label: str, what: str, a, b, plain_core, other_core) -> None:
    assert len(a.applied) > 0, f"{label}: no job applied after the {what}"
    if a.applied != b.applied:
        first = next(i for i in range(max(len(a.applied), len(b.applied)) + 1)
                     if a.applied[i:i + 1] != b.applied[i:i + 1])
        raise AssertionError(f"{label}: after the {what} the run applied other jobs than the uninterrupted run "
                             f"(first difference at applied job #{first})")
    assert np.array_equal(a.final_x, b.final_x), f"{label}: after the {what} the final iterate differs"
    diff = _first_difference(plain_core.alg.to_state_dict(plain_core.state),
                             other_core.alg.to_state_dict(other_core.state))
    assert diff is None, f"{label}: after the {what} the algorithm state differs at {diff}"


def check_state_dict_round_trip(algorithm: AlgorithmOrFactory, *, seed: int = 0, problem: str = "quadratic",
                                problem_options: Mapping[str, Any] | None = None, horizon: float = HORIZON) -> None:
    """Contract part 2: ``from_state_dict(to_state_dict(s))`` a third of the way in continues bit for bit.

    Raises:
        AssertionError: the reloaded state's dict differs, or the continued run does.
    """
    kw = dict(seed=seed, problem=problem, problem_options=problem_options)
    plain, reloaded = make_simulator(algorithm, **kw), make_simulator(algorithm, **kw)
    plain.run(max_time=horizon / 3)
    reloaded.run(max_time=horizon / 3)
    alg = reloaded.core.alg
    label = _label(alg)
    sd = alg.to_state_dict(reloaded.core.state)
    reloaded.core.state = alg.from_state_dict(sd)
    diff = _first_difference(alg.to_state_dict(reloaded.core.state), sd)
    assert diff is None, f"{label}: from_state_dict(to_state_dict(state)) is not the same state: {diff}"
    a = plain.run(max_time=horizon / 2)
    b = reloaded.run(max_time=horizon / 2)
    _compare_continuations(label, "state-dict round trip", a, b, plain.core, reloaded.core)


def check_checkpoint_round_trip(algorithm: AlgorithmOrFactory, *, seed: int = 0, problem: str = "quadratic",
                                problem_options: Mapping[str, Any] | None = None, horizon: float = HORIZON,
                                tmp_dir: str | None = None) -> None:
    """Contract part 3: the whole server core through a checkpoint file continues bit for bit.

    Args:
        tmp_dir: where the checkpoint file goes (default: a temporary directory, removed after).

    Raises:
        AssertionError: the restored core continues differently (jobs, iterate, state, counters).
    """
    from ps.core.server_core import ServerCore
    from ps.journal.checkpoints import read_checkpoint, write_checkpoint

    kw = dict(seed=seed, problem=problem, problem_options=problem_options)
    plain, restored = make_simulator(algorithm, **kw), make_simulator(algorithm, **kw)
    plain.run(max_time=horizon / 3)
    restored.run(max_time=horizon / 3)
    label = _label(restored.core.alg)
    with tempfile.TemporaryDirectory(dir=tmp_dir) as d:
        path = write_checkpoint(d, 7, restored.core.snapshot())
        lsn, snap = read_checkpoint(path)
    assert lsn == 7, f"{label}: checkpoint read back with lsn {lsn}, written with 7"
    restored.core = ServerCore.restore(restored.core.alg, snap, restored.core.cfg, server_boot=1)
    a = plain.run(max_time=horizon / 2)
    b = restored.run(max_time=horizon / 2)
    _compare_continuations(label, "checkpoint round trip", a, b, plain.core, restored.core)
    assert plain.core.counters == restored.core.counters, (
        f"{label}: after the checkpoint round trip the counters differ: {plain.core.counters.as_dict()} vs "
        f"{restored.core.counters.as_dict()}")


def check_algorithm(algorithm: AlgorithmOrFactory, *, seed: int = 0, problem: str = "quadratic",
                    problem_options: Mapping[str, Any] | None = None,
                    criterion: tuple[str, float] | None = None):
    """Run the whole contract (the three checks of the module docstring) against ``algorithm``.

    Args:
        algorithm: an Algorithm instance, or a zero-argument factory returning one.
        seed: seeds the simulation (0: the registry's contract run).
        problem: ``"quadratic"`` (default, d = 16) or ``"logreg"`` (finite sum, N = 400), or any
            problem spec together with ``problem_options`` and ``criterion``.
        problem_options: the problem's options (default: those of the contract).
        criterion: ``(figure, fraction)`` for :func:`check_convergence`.

    Returns:
        The :class:`ps.drivers.sim.Trace` of the convergence run (evaluations, applied jobs, metrics).

    Raises:
        AssertionError: with a message naming the algorithm and what broke.

    Example:
        >>> from algorithms.baselines import VanillaASGD
        >>> check_algorithm(lambda: VanillaASGD(lr=0.3))  # doctest: +SKIP
    """
    trace = check_convergence(algorithm, seed=seed, problem=problem, problem_options=problem_options,
                              criterion=criterion)
    check_state_dict_round_trip(algorithm, seed=seed, problem=problem, problem_options=problem_options)
    check_checkpoint_round_trip(algorithm, seed=seed, problem=problem, problem_options=problem_options)
    return trace


# --------------------------------------------------------------------------- a user's problem

def check_problem(problem: Any, options: Mapping[str, Any] | None = None, *, seed: int = 0,
                  batch_size: int = 8) -> None:
    """The problem contract (problems/base.py) as a check, for a user's own problem before it
    meets real workers::

        from latecomer.testing import check_problem

        def test_my_problem_meets_the_contract():
            check_problem("mypkg.mod:make", {"d": 100})

    It checks, at ``init_params(seed)`` and a point next to it:

    1. ``init_params`` is a finite float32 vector of the layout's size, the same on two calls.
    2. ``grad`` gives, through the worker's own computation, a finite float32 vector of that size
       (a wrong shape fails with the worker's one-line message naming the layout) and the same
       bits on a second call with the same arguments: the determinism on CPU that exact replay and
       the simulator need.
    3. ``grad_pair`` gives two such vectors, each the same on a second call.
    4. Where the problem declares ``fresh_gradients = True``, no call writes into an array an
       earlier call returned (the worker then sends it without a copy and keeps it for a resend).
    5. ``evaluate`` returns a finite ``loss``.

    Args:
        problem: a Problem instance, or a spec (``"quadratic"``, ``"mypkg.mod:make"``) loaded with
            ``options`` as a worker loads it.
        options: the spec's options.
        seed: the job seed of the first call (the others are derived from it).
        batch_size: the batch size of the calls.

    Raises:
        AssertionError: with a message naming the problem and what broke.
    """
    from problems.loader import load_problem

    p = load_problem(problem, options) if isinstance(problem, str) else problem
    name = getattr(p, "spec", "") or type(p).__name__
    x0, x1 = _initial_points(p, name, seed)
    kept: list[tuple[np.ndarray, np.ndarray]] = []  # (an array a call returned, its values then)

    def grads(pair: bool, s: int) -> tuple:
        out = _problem_grads(p, name, pair, s, (x1, x0) if pair else (x0,), batch_size)
        kept.extend((g, g.copy()) for g in out)
        return out

    a, b = grads(False, seed), grads(False, seed)
    assert np.array_equal(a[0], b[0]), \
        f"{name}: grad(x, seed={seed}) gave other bits on a second call: grad must be a pure function of " \
        f"(x, seed, batch_size) on CPU, or replay and the simulator cannot reproduce a run"
    grads(False, seed + 1)
    pair, again = grads(True, seed + 2), grads(True, seed + 2)
    assert all(np.array_equal(u, v) for u, v in zip(pair, again, strict=True)), \
        f"{name}: grad_pair(x_new, x_old, seed={seed + 2}) gave other bits on a second call"
    if getattr(p, "fresh_gradients", False):
        for i, (arr, then) in enumerate(kept):
            assert np.array_equal(arr, then), \
                f"{name}: declares fresh_gradients = True but a later call wrote into gradient {i + 1} of the " \
                f"check (return a new array per call, or leave fresh_gradients False: the worker then copies)"
    loss = p.evaluate(x0).get("loss")
    assert isinstance(loss, (int, float)) and math.isfinite(loss), f"{name}: evaluate gave loss {loss!r}"


def _initial_points(p: Any, name: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``init_params(seed)`` checked, and a point next to it; both read-only, as a worker passes them."""
    x0 = p.init_params(seed)
    assert isinstance(x0, np.ndarray) and x0.dtype == np.float32 and x0.shape == (p.dim,), \
        f"{name}: init_params gave {type(x0).__name__} {getattr(x0, 'dtype', '')} {getattr(x0, 'shape', '')}, " \
        f"expected a float32 vector of {p.dim} values (the layout's size)"
    assert np.isfinite(x0).all(), f"{name}: init_params gave non-finite values"
    assert np.array_equal(x0, p.init_params(seed)), f"{name}: init_params({seed}) differs between two calls"
    x1 = (x0 + np.float32(0.01)).astype(np.float32)
    for x in (x0, x1):
        x.setflags(write=False)
    return x0, x1


def _problem_grads(p: Any, name: str, pair: bool, s: int, points: tuple, batch_size: int) -> tuple:
    """A GRAD (or GRAD_PAIR) job's gradients through the worker's own computation, checked finite."""
    from protocol.messages import Job, JobKind
    from worker.compute import BadGradient, compute_grads

    kind = JobKind.GRAD_PAIR if pair else JobKind.GRAD
    job = Job(job_id=s, kind=kind, created_at=0, iterate_ids=(1, 0) if pair else (0,), seed=s, batch_size=batch_size)
    try:
        out, _, _ = compute_grads(job, points, p)
    except BadGradient as e:
        raise AssertionError(f"{name}: {e}") from None
    for g in out:
        assert np.isfinite(g).all(), f"{name}: {kind.name.lower()} at seed {s} gave non-finite values"
    return out
