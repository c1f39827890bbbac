"""``latecomer advise``: which algorithm, with which settings, for this cluster, predicted from the
run's own recorded delays (docs/ADVISE.md).

The sans-I/O part: no sockets, no clock, no files. It

- fits each worker's job duration distribution from a run's events (:func:`fit_trace`: the
  empirical durations, issue to reply, and when each worker was there: its joins, leaves and
  crashes, on the clock of the run's evaluations, which starts at the first job issued);
- answers what-ifs on that trace (:func:`drop_slowest`, :func:`add_workers`, :func:`only_workers`);
- builds the stated grid of hyper-parameters per algorithm (:func:`grid`);
- predicts each candidate's time to a target by running the simulator (ps/drivers/sim.py, the
  same ServerCore and algorithms as the daemon) with delays drawn from the fitted distributions,
  one seed per draw (:func:`predict`), and synchronous SGD by its own loop (:func:`predict_sync`:
  a round waits for every worker);
- fits the cheap proxy oracle (:func:`fit_proxy`: a quadratic whose loss curve under the recorded
  step size is the recorded one, and whose gradient noise gives the recorded floor) for models too
  large to simulate;
- ranks (:func:`rank`).

Everything is deterministic given the seeds. The caller (ps/cli/advise.py) owns the clock: it
passes ``out_of_time`` to bound its own time (``--budget``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from problems.base import GradResult, Problem

# Kinds of job and their cost relative to one gradient (as ps/drivers/sim.py DelayModel counts them).
GRAD, GRAD_PAIR, FULL_GRAD = 1, 2, 3
PAIR_COST = 2.0
LR_FACTORS = (0.5, 1.0, 2.0, 4.0)  # the step-size grid, times the base step size
ADAM_LR_FACTORS = (1.0, 10.0, 30.0, 100.0)  # Adam's default lr (1e-3) is a floor, not a middle: its grid looks up
LMO_ALGORITHMS = ("ringmaster-lmo", "delay-adaptive-muon", "rennala-muon")


# --------------------------------------------------------------------------- the trace


@dataclass
class WorkerTrace:
    """One worker of a recorded run: its job durations (s, per unit of cost: a pair job counts
    twice) and the intervals it was there (seconds from the first job issued; ``None``: to the end)."""

    worker_id: str
    durations: list[float]
    present: list[tuple[float, float | None]] = field(default_factory=lambda: [(0.0, None)])
    lost: int = 0
    jobs: int = 0  # the jobs its durations stand for (a live server's: its mean of so many); 0: one each

    @property
    def seen(self) -> int:
        return self.jobs or len(self.durations)

    @property
    def mean(self) -> float:
        return float(np.mean(self.durations)) if self.durations else math.inf


@dataclass
class ClusterTrace:
    """The workers of a run and the span of its events (s)."""

    workers: list[WorkerTrace]
    span: float = 0.0
    note: str = ""  # what a what-if changed

    @property
    def ids(self) -> list[str]:
        return [w.worker_id for w in self.workers]


def _one_clock(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of every server session on one clock (a restarted server's clock is a new
    process's: each session is shifted to start where the one before ended)."""
    from ps.ops.report import split_sessions

    out: list[dict[str, Any]] = []
    end = None
    for evs in split_sessions(events):
        ts = [float(e["t"]) for e in evs if "t" in e]
        shift = 0.0 if end is None or not ts else end - min(ts)
        out += [{**e, "t": float(e["t"]) + shift} if "t" in e else e for e in evs]
        if ts:
            end = max(ts) + shift
    return out


def _job_cost(kind: Any) -> float:
    return PAIR_COST if kind == GRAD_PAIR else 1.0


def _durations(events: Sequence[dict[str, Any]]) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Per worker: the durations (issue to reply, per unit of cost) of its jobs that were applied
    or dropped (a reply came), and how many of its jobs were lost. Full-gradient jobs (their cost
    is the shard's, not comparable) and cancelled ones (no reply) are left out."""
    issued: dict[int, tuple[str, float, Any]] = {}
    out: dict[str, list[float]] = {}
    lost: dict[str, int] = {}
    for e in events:
        ev = e.get("ev")
        if ev == "issued" and "t" in e:
            issued[e["job_id"]] = (e["worker_id"], float(e["t"]), e.get("kind", GRAD))
        elif ev in ("applied", "dropped", "lost", "cancelled", "failed", "rejected") and "job_id" in e:
            start = issued.pop(e["job_id"], None)
            if start is None or "t" not in e:
                continue
            wid, t0, kind = start
            if ev == "lost":
                lost[wid] = lost.get(wid, 0) + 1
            elif ev in ("applied", "dropped") and kind != FULL_GRAD:
                out.setdefault(wid, []).append(max(0.0, float(e["t"]) - t0) / _job_cost(kind))
    return out, lost


def _presence(events: Sequence[dict[str, Any]], t0: float) -> dict[str, list[tuple[float, float | None]]]:
    """Per worker: the intervals from each join to the leave (or crash) that ended it."""
    out: dict[str, list[list[Any]]] = {}
    for e in events:
        wid, ev = e.get("worker_id"), e.get("ev")
        if wid is None or "t" not in e:
            continue
        t = max(0.0, float(e["t"]) - t0)
        spans = out.setdefault(wid, [])
        if ev == "joined" and (not spans or spans[-1][1] is not None):
            spans.append([t, None])
        elif ev == "left" and spans and spans[-1][1] is None:
            spans[-1][1] = t
    return {w: [(a, b) for a, b in s] for w, s in out.items()}


def fit_trace(events: Sequence[dict[str, Any]]) -> ClusterTrace:
    """The cluster of a recorded run, from its event log (ps/ops/report.py ``read_events``).

    Raises:
        ValueError: no job of the run got a reply (nothing to fit).
    """
    events = _one_clock(events)
    issued = [float(e["t"]) for e in events if e.get("ev") == "issued" and "t" in e]
    if not issued:
        raise ValueError("the run issued no job: no delays to fit")
    t0 = min(issued)
    durations, lost = _durations(events)
    if not durations:
        raise ValueError("no job of the run got a reply: no delays to fit")
    presence = _presence(events, t0)
    ts = [float(e["t"]) for e in events if "t" in e]
    workers = [WorkerTrace(w, d, presence.get(w) or [(0.0, None)], lost.get(w, 0))
               for w, d in durations.items()]
    workers.sort(key=lambda w: (len(w.worker_id), w.worker_id))
    return ClusterTrace(workers, span=max(ts) - t0)


def trace_from_means(means: dict[str, float], jobs: dict[str, int] | None = None) -> ClusterTrace:
    """A cluster known only by each worker's mean job time (a live server's ``status?``, over
    ``jobs[w]`` jobs): every job of a worker takes its mean (no spread)."""
    jobs = jobs or {}
    workers = [WorkerTrace(w, [float(m)], jobs=int(jobs.get(w, 0))) for w, m in means.items()
               if m and math.isfinite(m) and m > 0]
    if not workers:
        raise ValueError("no worker has finished a job yet: no delays to fit")
    return ClusterTrace(sorted(workers, key=lambda w: (len(w.worker_id), w.worker_id)))


# --------------------------------------------------------------------------- what-ifs


def drop_slowest(trace: ClusterTrace, k: int) -> ClusterTrace:
    """The cluster without its ``k`` slowest workers (by mean job time)."""
    if not 0 <= k < len(trace.workers):
        raise ValueError(f"--drop-slowest {k}: the run has {len(trace.workers)} workers (at least one must stay)")
    slow = sorted(trace.workers, key=lambda w: -w.mean)[:k]
    gone = {w.worker_id for w in slow}
    return dataclasses.replace(trace, workers=[w for w in trace.workers if w.worker_id not in gone],
                               note=f"without the {k} slowest ({', '.join(sorted(gone))})")


def add_workers(trace: ClusterTrace, n: int, like: str) -> ClusterTrace:
    """The cluster with ``n`` more workers whose jobs take as long as ``like``'s."""
    model = {w.worker_id: w for w in trace.workers}.get(like)
    if model is None:
        raise ValueError(f"--like {like}: no such worker in the run (it has {', '.join(trace.ids)})")
    taken = set(trace.ids)
    new = []
    i = 1
    while len(new) < n:
        wid = f"{like}+{i}"
        if wid not in taken:
            new.append(WorkerTrace(wid, list(model.durations)))
        i += 1
    return dataclasses.replace(trace, workers=[*trace.workers, *new], note=f"with {n} more workers like {like}")


def only_workers(trace: ClusterTrace, ids: Sequence[str]) -> ClusterTrace:
    """The cluster of the named workers only."""
    unknown = [w for w in ids if w not in trace.ids]
    if unknown or not ids:
        raise ValueError(f"--workers-only: {', '.join(unknown) or 'none given'} not in the run "
                         f"(it has {', '.join(trace.ids)})")
    return dataclasses.replace(trace, workers=[w for w in trace.workers if w.worker_id in ids],
                               note=f"with only {', '.join(ids)}")


# --------------------------------------------------------------------------- delays in the simulator


class EmpiricalDelays:
    """Job durations drawn from each worker's recorded ones (bootstrap, its own seeded stream):
    duck-types ps/drivers/sim.py ``DelayModel``. A pair job costs twice a gradient job."""

    def __init__(self, trace: ClusterTrace, seed: int) -> None:
        self.samples = [np.asarray(w.durations, dtype=float) for w in trace.workers]
        self.tau = tuple(float(s.mean()) for s in self.samples)
        self.rng = np.random.default_rng([seed, 0xADB15E])

    def duration(self, i: int, job: Any, sample_cost: float, rng: np.random.Generator) -> float:
        s = self.samples[i]
        d = float(s[self.rng.integers(len(s))])
        if job.kind == GRAD_PAIR:
            return d * PAIR_COST
        if job.kind == FULL_GRAD:
            lo, hi = job.shard or (0, 1)
            return d * (hi - lo) / max(1, job.batch_size)
        return d

    def draw(self, i: int) -> float:
        """One gradient job of worker ``i`` (synchronous SGD's rounds)."""
        s = self.samples[i]
        return float(s[self.rng.integers(len(s))])


def _simulator(alg: Any, problem: Problem, trace: ClusterTrace, cfg: Any, seed: int) -> Any:
    """A Simulator whose workers join, leave and come back when the recorded ones did."""
    from ps.drivers.sim import Crash, Simulator

    crashes = []
    late: dict[int, float] = {}
    for i, w in enumerate(trace.workers):
        spans = w.present
        if spans and spans[0][0] > 0:
            late[i] = spans[0][0]
        for (_, b), nxt in zip(spans, [*spans[1:], None], strict=True):
            if b is not None:
                crashes.append(Crash(i, b, None if nxt is None else max(0.0, nxt[0] - b)))
    sim = Simulator(alg, problem, EmpiricalDelays(trace, seed), cfg, seed=seed, crashes=crashes)
    if late:  # joins at the recorded time, not at 0
        import heapq

        sim.heap = [h for h in sim.heap if not (h[2] == "join" and h[3] in late)]
        heapq.heapify(sim.heap)
        for i, t in late.items():
            sim._push(t, "join", i)
    return sim


# --------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Candidate:
    algorithm: str
    settings: dict[str, Any]

    @property
    def label(self) -> str:
        return " ".join(f"{k}={_fmt(v)}" for k, v in self.settings.items())


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _applies(name: str, problem: Problem) -> str:
    """'' if ``name`` can run on ``problem``, else why not (docs/ALGORITHMS.md)."""
    if name in LMO_ALGORITHMS and not any(getattr(problem, "lmo_mask", None) or ()) and \
            not any(len(shape) == 2 for _, shape in getattr(problem, "layout", ()) or ()):
        return "needs matrix layers (an LMO/Muon method)"
    if name == "snapshot-vr" and not getattr(problem, "num_samples", None):
        return "needs a finite-sum problem (num_samples)"
    return ""


def _structure(name: str, n: int) -> list[dict[str, Any]]:
    """The structural knob of an algorithm, tried at about half, once and twice the worker count."""
    sizes = sorted({max(1, n // 2), max(1, n), 2 * max(1, n)})
    if name in ("ringmaster",):
        return [{"R": s} for s in sizes]
    if name == "delay-filtered":
        return [{"tau_max": s} for s in sizes]
    if name in ("rennala", "rennala-mvr", "rennala-mvr-inexact", "rennala-muon"):
        return [{"B": s} for s in sizes]
    if name in ("delay-adaptive", "delay-adaptive-muon"):
        return [{"n_workers": max(1, n)}]
    return [{}]


def grid(names: Sequence[str], problem: Problem, n_workers: int, base_lr: float | None,
         lr_factors: Sequence[float] = LR_FACTORS) -> tuple[list[Candidate], dict[str, str]]:
    """The candidates: for each algorithm that applies, its structural knob (:func:`_structure`)
    times the step-size grid ``lr_factors`` x the base step size (the recorded run's for the SGD
    family, else the algorithm's default). Returns (candidates, skipped algorithm -> why)."""
    import algorithms
    from algorithms.registry import hyper_parameters

    out, skipped = [], {}
    for name in names:
        why = _applies(name, problem)
        if why:
            skipped[name] = why
            continue
        hp = hyper_parameters(algorithms.ALGORITHMS[name])
        default_lr = hp["lr"][1] if "lr" in hp else None
        own = base_lr if base_lr is not None and name not in ("adam", "adamw", *LMO_ALGORITHMS) else default_lr
        extra = {"num_samples": int(problem.num_samples)} if name == "snapshot-vr" else {}
        for knob in _structure(name, n_workers):
            factors = ADAM_LR_FACTORS if name in ("adam", "adamw") else lr_factors
            for f in (factors if own is not None else (1.0,)):
                lr = {} if own is None else {"lr": float(own) * f}
                out.append(Candidate(name, {**lr, **knob, **extra}))
    return out, skipped


# --------------------------------------------------------------------------- predictions


@dataclass(frozen=True)
class Target:
    key: str  # "loss" or "accuracy"
    value: float

    def reached(self, ev: dict[str, float]) -> bool:
        v = ev.get(self.key)
        if v is None or not math.isfinite(v):
            return False
        return v <= self.value if self.key == "loss" else v >= self.value


@dataclass
class Prediction:
    """One candidate's simulated runs, one per seed: time to target (inf: not within the horizon)
    and the curves (t, figure)."""

    candidate: Candidate
    times: list[float] = field(default_factory=list)
    curves: list[list[tuple[float, float]]] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def median(self) -> float:
        return float(np.median(self.times)) if self.times else math.inf

    @property
    def spread(self) -> tuple[float, float]:
        return (min(self.times), max(self.times)) if self.times else (math.inf, math.inf)


def time_to_target(points: Sequence[dict[str, float]], target: Target) -> float:
    """The time of the first evaluation that reached the target (inf if none)."""
    for p in points:
        if target.reached(p):
            return float(p["t"])
    return math.inf


def predict(cand: Candidate, problem: Problem, trace: ClusterTrace, cfg: Any, target: Target, horizon: float,
            seed: int, *, eval_every: int = 10, max_updates: int | None = None, pred: Prediction | None = None
            ) -> Prediction:
    """Simulate ``cand`` on ``problem`` with the trace's delays (draw ``seed``) until the target or
    ``horizon`` simulated seconds; append the run to ``pred``."""
    import algorithms

    pred = pred or Prediction(cand)
    try:
        alg = algorithms.build(cand.algorithm, {k: str(v) for k, v in cand.settings.items()})
        run_cfg = dataclasses.replace(cfg, min_workers=1, seed=cfg.seed + seed)
        sim = _simulator(alg, problem, trace, run_cfg, seed)
        tr = sim.run(max_time=horizon, max_updates=max_updates, eval_every=eval_every, stop=target.reached)
    except (ValueError, ArithmeticError, FloatingPointError) as e:  # a setting the problem refuses
        pred.error = f"{type(e).__name__}: {e}"
        return pred
    pred.times.append(time_to_target(tr.points, target))
    pred.curves.append([(p["t"], p.get(target.key, math.nan)) for p in tr.points])
    pred.steps.append(int(tr.counters.get("updates", 0)))
    return pred


def predict_sync(problem: Problem, trace: ClusterTrace, lr: float, batch_size: int, target: Target, horizon: float,
                 seed: int, *, eval_every: int = 10, x0: np.ndarray | None = None) -> Prediction:
    """Synchronous minibatch SGD on the same cluster: each round every worker computes a gradient
    at the same iterate, the round lasts as long as its slowest job, and the step is ``lr`` times
    their mean. Its own loop (no ServerCore): the baseline the asynchronous methods are beaten
    against, computed independently of them."""
    pred = Prediction(Candidate("synchronous", {"lr": float(lr)}))
    delays = EmpiricalDelays(trace, seed)
    x = np.asarray(problem.init_params(seed) if x0 is None else x0, dtype=np.float32).copy()
    rng = np.random.default_rng([seed, 0x5C])
    t, k = 0.0, 0
    curve = [(0.0, problem.evaluate(x).get(target.key, math.nan))]
    reached = math.inf if not target.reached({target.key: curve[0][1]}) else 0.0
    n = len(trace.workers)
    while reached == math.inf and t <= horizon:
        g = np.zeros_like(x, dtype=np.float64)
        for _ in range(n):
            res: GradResult = problem.grad(x, int(rng.integers(2 ** 62)), batch_size)
            g += res.grad
        x = (x - lr * g / n).astype(np.float32)
        t += max(delays.draw(i) for i in range(n))
        k += 1
        if k % eval_every == 0:
            v = problem.evaluate(x).get(target.key, math.nan)
            curve.append((t, v))
            if not math.isfinite(v):
                break
            if target.reached({target.key: v}):
                reached = t
    pred.times.append(reached)
    pred.curves.append(curve)
    pred.steps.append(k)
    return pred


def rank(preds: Sequence[Prediction]) -> list[Prediction]:
    """Best first: by median predicted time to target, then the one run over more seeds (a tie
    with a candidate the budget left at one seed goes to the better-known one), then the worst
    seed, then the name."""
    return sorted(preds, key=lambda p: (p.median, -len(p.times), p.spread[1], p.candidate.algorithm,
                                        p.candidate.label))


def best_per_algorithm(preds: Sequence[Prediction]) -> list[Prediction]:
    """The best candidate (:func:`rank`) of each algorithm, ranked."""
    best: dict[str, Prediction] = {}
    for p in rank([p for p in preds if p.times]):
        best.setdefault(p.candidate.algorithm, p)
    return rank(list(best.values()))


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's τ-b of two equally long sequences (ties in either count as neither)."""
    n = len(a)
    conc = disc = ta = tb = 0
    for i in range(n):
        for j in range(i + 1, n):
            x, y = np.sign(a[i] - a[j]), np.sign(b[i] - b[j])
            if x == 0 and y == 0:
                continue
            if x == 0:
                ta += 1
            elif y == 0:
                tb += 1
            elif x == y:
                conc += 1
            else:
                disc += 1
    denom = math.sqrt((conc + disc + ta) * (conc + disc + tb))
    return (conc - disc) / denom if denom else math.nan


# --------------------------------------------------------------------------- the proxy oracle


@dataclass(frozen=True)
class ProxyFit:
    """L(k) = floor + (l0 − floor)·exp(−rate·k): the recorded loss against the step."""

    l0: float
    floor: float
    rate: float


def fit_proxy(points: Sequence[tuple[float, float]]) -> ProxyFit:
    """Fit :class:`ProxyFit` to (step, loss) points: for each floor on a grid below the lowest
    loss, a least-squares line through log(L − floor) against the step; the floor of least error.

    Raises:
        ValueError: fewer than three finite points, or a curve that does not fall.
    """
    pts = [(float(k), float(v)) for k, v in points if math.isfinite(v)]
    if len(pts) < 3:
        raise ValueError("the proxy oracle needs at least three evaluations of the recorded run")
    k = np.array([p[0] for p in pts])
    y = np.array([p[1] for p in pts])
    lo = float(y.min())
    if not y[0] > lo:
        raise ValueError("the recorded loss does not fall: nothing to fit the proxy oracle to")
    best = None
    span = float(y.max() - lo)
    for frac in np.linspace(0.0, 0.999, 200):  # the floor, as a fraction of the way up to the lowest loss
        floor = (lo * frac if lo > 0 else lo - span * (1 - frac)) - 1e-9 * max(1.0, abs(lo))
        slope, icpt = np.polyfit(k, np.log(y - floor), 1)
        err = float(np.sum((floor + np.exp(icpt + slope * k) - y) ** 2))
        if best is None or err < best[0]:
            best = (err, ProxyFit(l0=float(floor + math.exp(icpt)), floor=float(floor), rate=float(-slope)))
    fit = best[1]
    if not fit.rate > 0:
        raise ValueError("the recorded loss does not fall: nothing to fit the proxy oracle to")
    return fit


class ProxyQuadratic(Problem):
    """The cheap oracle: f(x) = floor_f + ½·h·‖x‖² in ``d`` dimensions with isotropic gradient noise σ.

    Built by :meth:`from_fit` so that SGD with the recorded step size ``lr`` falls as the recorded
    loss did (``(1 − lr·h)² = exp(−rate)``) from the recorded start (the expected loss is then
    floor + (start − floor)·exp(−rate·k)), and its stationary noise floor
    ``h·d·lr²σ² / (2(1 − (1 − lr·h)²))`` (per-gradient variance σ²/batch) is the recorded floor.
    It models the speed of the descent and the noise, not the model: docs/ADVISE.md says when it
    is wrong."""

    def __init__(self, d: int, h: float, sigma: float, scale0: float, floor: float = 0.0) -> None:
        self.d, self.h, self.sigma, self.scale0, self.floor = int(d), float(h), float(sigma), float(scale0), floor
        self.spec = "proxy-quadratic"
        self.options = {"d": self.d, "h": self.h, "sigma": self.sigma}
        self.layout = (("x", (self.d,)),)

    @staticmethod
    def from_fit(fit: ProxyFit, lr: float, batch_size: int, d: int = 16) -> ProxyQuadratic:
        q = math.exp(-fit.rate / 2.0)  # per-step contraction 1 − lr·h
        h = (1.0 - q) / lr
        scale0 = math.sqrt(2.0 * max(fit.l0, 1e-12) / (h * d))  # f(x0) = the recorded start
        var = max(fit.floor, 0.0) * 2.0 * (1.0 - q * q) / (h * d * lr * lr) * batch_size
        return ProxyQuadratic(d, h, math.sqrt(max(var, 0.0)), scale0)

    def init_params(self, seed: int) -> np.ndarray:
        return np.full(self.d, self.scale0, dtype=np.float32)

    def _f(self, x: np.ndarray) -> float:
        x64 = np.asarray(x, dtype=np.float64)
        return self.floor + 0.5 * self.h * float(x64 @ x64)

    def grad(self, x: np.ndarray, seed: int, batch_size: int) -> GradResult:
        g = self.h * np.asarray(x, dtype=np.float64)
        if self.sigma > 0:
            g += self.sigma / math.sqrt(batch_size) * np.random.default_rng(seed).standard_normal(self.d)
        return GradResult(grad=g.astype(np.float32), loss=self._f(x))

    def evaluate(self, x: np.ndarray) -> dict[str, float]:
        return {"loss": self._f(x)}
