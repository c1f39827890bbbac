"""Deterministic discrete-event simulator driving the same ServerCore and algorithms.

The fake clock is the event heap. Simulated workers receive the core's ``Job`` messages,
compute them with the same :func:`worker.compute.run_job` a real worker uses, and answer
after a simulated duration drawn from a :class:`DelayModel` (docs/ALGORITHMS.md §8.2). Crashes,
rejoins and lost replies are scripted. Same seed, same trace.

``wire_dtype`` (PROTOCOL.md §6.12) quantizes what the real transport would: a simulated worker
computes on ``roundtrip(iterate, wire)`` and its reply gradients reach the core as
``roundtrip(grad, wire)``; the core keeps float32 iterates. ``"f32"`` changes nothing.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import numpy as np

from algorithms.base import Algorithm, bind_layout
from algorithms.sharding import Sharded
from problems.base import Problem
from protocol.messages import Bye, Cancel, Error, ErrorCode, Heartbeat, Hello, Job, JobKind, Ready, Reply
from protocol.wire import check_wire, roundtrip
from ps.core.commands import Disconnect, Send
from ps.core.config import CoreConfig
from ps.core.server_core import ServerCore
from worker.compute import run_job

DelayName = Literal["sqrt", "sqrt1", "linear", "uniform", "mixture", "fixed"]


@dataclass(frozen=True)
class DelayModel:
    """Per-worker computation times (docs/ALGORITHMS.md §8.2).

    A job of worker i (1-based) takes ``tau[i] * cost(kind) * sample_cost + |N(0, noise[i]^2)|
    + latency`` simulated seconds, where cost(GRAD)=1, cost(GRAD_PAIR)=2, cost(FULL_GRAD) =
    shard size / batch, and ``sample_cost`` is the problem's data-dependent factor.

    Build one with :meth:`named`.
    """

    tau: tuple[float, ...]
    noise: tuple[float, ...]
    latency: float = 0.0
    pair_cost: float = 2.0
    data_dependent: bool = True

    @staticmethod
    def named(name: DelayName | str, n: int, *, base: float = 1.0, noise: str = "sqrt",
              latency: float = 0.0, fixed: Sequence[float] | None = None, permute_seed: int | None = None,
              straggler: float | None = None) -> DelayModel:
        """Standard models: ``sqrt`` τ_i = base·√i; ``sqrt1`` τ_i = base·(1 + √(i−1)) (quadratic scripts);
        ``linear`` τ_i = base·i; ``uniform`` τ_i = base; ``mixture`` half the workers base, half 10·base
        (placeholder, §8.2); ``fixed`` the given list.

        Noise (per-job half-normal scale): ``sqrt`` s_i = base·√i (quadratic scripts); ``frac``
        s_i = 0.05·τ_i (NanoChat); ``none``.
        ``straggler``: make the last worker this many times slower than the slowest.
        """
        i = np.arange(1, n + 1, dtype=float)
        if name == "sqrt":
            tau = base * np.sqrt(i)
        elif name == "sqrt1":
            tau = base * (1 + np.sqrt(i - 1))
        elif name == "linear":
            tau = base * i
        elif name == "uniform":
            tau = np.full(n, base)
        elif name == "mixture":
            tau = np.where(i <= (n + 1) // 2, base, 10 * base)
        elif name == "fixed":
            if fixed is None or len(fixed) != n:
                raise ValueError("fixed delays need one value per worker")
            tau = np.asarray(fixed, float)
        else:
            raise ValueError(f"unknown delay model {name!r} (sqrt, sqrt1, linear, uniform, mixture, fixed)")
        if permute_seed is not None:
            tau = np.random.default_rng(permute_seed).permutation(tau)
        if straggler:
            tau[-1] = straggler * tau.max()
        if noise == "sqrt":
            s = base * np.sqrt(i)
        elif noise == "frac":
            s = 0.05 * tau
        elif noise == "none":
            s = np.zeros(n)
        else:
            raise ValueError(f"unknown noise model {noise!r} (sqrt, frac, none)")
        return DelayModel(tau=tuple(float(t) for t in tau), noise=tuple(float(v) for v in s), latency=latency)

    def duration(self, i: int, job: Job, sample_cost: float, rng: np.random.Generator) -> float:
        if job.kind == JobKind.GRAD:
            cost = 1.0
        elif job.kind == JobKind.GRAD_PAIR:
            cost = self.pair_cost
        else:
            lo, hi = job.shard or (0, 1)
            cost = (hi - lo) / max(1, job.batch_size)
        if self.data_dependent:
            cost *= sample_cost
        d = self.tau[i] * cost + self.latency
        if self.noise[i] > 0:
            d += abs(rng.normal(0.0, self.noise[i]))
        return d


@dataclass(frozen=True)
class Crash:
    """Worker ``worker`` (0-based) dies at ``at``; rejoins as a new incarnation after ``rejoin_after``."""

    worker: int
    at: float
    rejoin_after: float | None = None


@dataclass
class Trace:
    """What a simulation produced."""

    points: list[dict[str, float]] = field(default_factory=list)  # t, version, evaluation figures, counters
    applied: list[tuple[int, int, str, int, float]] = field(default_factory=list)  # job_id, created_at, wid, age, t
    counters: dict[str, int] = field(default_factory=dict)
    metrics: list[dict[str, float]] = field(default_factory=list)  # algorithm metrics per update (t, version, ...)
    final_x: np.ndarray | None = None
    final_t: float = 0.0
    store_peak: int = 0

    def ages(self) -> np.ndarray:
        return np.array([a[3] for a in self.applied], dtype=np.int64)


@dataclass
class _SimWorker:
    index: int
    worker_id: str
    boot: int
    alive: bool = True
    queue: deque = field(default_factory=deque)  # jobs waiting (credit > 1)
    current: Job | None = None
    token: int = 0
    cache: OrderedDict = field(default_factory=OrderedDict)
    seen: int = -1
    waiting: dict = field(default_factory=dict)  # job_id -> Job waiting for a missing iterate


class Simulator:
    """Run a ServerCore with simulated workers.

    Args:
        algorithm: the algorithm; bound here to the problem's layout and ``lmo_mask`` (if any).
        problem: the problem (its ``grad`` is computed for real; only time is simulated).
        delays: per-worker computation-time model.
        config: core settings (liveness timeout in simulated seconds).
        seed: seeds the delay noise and the lost-reply draws (the core's own seed is in config).
        crashes: scripted crashes and rejoins.
        loss_prob: probability that a finished reply is lost in transit.
        credit: jobs each worker may hold.
        cache_size: iterates a simulated worker caches (evicting least recently used).
        wire_dtype: how iterates and gradients travel (``"f32"``, ``"f16"``, ``"bf16"``): job
            points are quantized on their way to a worker, reply gradients on their way back.
        shards: S, the parameter vector sharded over S server shards (contiguous ranges; a block
            cut only where the algorithm's work is elementwise)
            (``algorithms.sharding.Sharded``: one decision, checked equal on every shard); 1, the
            default, runs the algorithm itself. Same seed, same bits for every S.
    """

    def __init__(self, algorithm: Algorithm, problem: Problem, delays: DelayModel, config: CoreConfig | None = None,
                 *, seed: int = 0, crashes: Sequence[Crash] = (), loss_prob: float = 0.0, credit: int = 1,
                 cache_size: int = 4, heartbeat_s: float | None = None, x0: np.ndarray | None = None,
                 wire_dtype: str = "f32", shards: int = 1) -> None:
        self.wire_dtype = check_wire(wire_dtype)
        self.problem = problem
        self.delays = delays
        self.cfg = config or CoreConfig(min_workers=len(delays.tau))
        if shards != 1:
            algorithm = Sharded(algorithm, n_shards=shards)
        bind = getattr(algorithm, "bind", None)
        if bind is not None:
            algorithm = bind_layout(algorithm, problem.layout, getattr(problem, "lmo_mask", None))
        self.core = ServerCore(algorithm, problem.init_params(self.cfg.seed) if x0 is None else x0, self.cfg,
                               server_boot=1)
        self.rng = np.random.default_rng(seed)
        self.loss_prob = loss_prob
        self.credit = credit
        self.cache_size = max(cache_size, 2)
        self.heartbeat_s = heartbeat_s or self.cfg.liveness_timeout_s / 3
        self.now = 0.0
        self.heap: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.workers = [_SimWorker(i, f"w{i + 1}", boot=1) for i in range(len(delays.tau))]
        self.by_id = {w.worker_id: w for w in self.workers}
        self.trace = Trace()
        for c in crashes:
            self._push(c.at, "crash", c)
        for w in self.workers:
            self._push(0.0, "join", w.index)
        self._push(self.heartbeat_s, "heartbeat", None)
        if self.cfg.round_period_s:  # clock-driven rounds (round-mode algorithms)
            self._push(self.cfg.round_period_s, "round", None)

    # ------------------------------------------------------------------ events
    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.heap, (t, self.seq, kind, payload))
        self.seq += 1

    def _deliver(self, cmds: list) -> None:
        """Carry out the core's commands (transport is instantaneous in the simulator)."""
        for c in cmds:
            if isinstance(c, Disconnect):
                continue
            assert isinstance(c, Send)
            w = self.by_id.get(c.worker_id)
            if w is None or not w.alive:
                continue
            m = c.msg
            if isinstance(m, Job):
                for iid, p in zip(m.point_ids, m.points, strict=True):
                    w.cache[iid] = roundtrip(p, self.wire_dtype)  # what the worker decodes
                w.seen = max(w.seen, m.job_id)
                self._accept_job(w, m)
            elif isinstance(m, Cancel):
                cancelled = set(m.job_ids)
                w.queue = deque(j for j in w.queue if j.job_id not in cancelled)
                for jid in cancelled:
                    w.waiting.pop(jid, None)
                if w.current is not None and w.current.job_id in cancelled:
                    w.current = None
                    w.token += 1
                    self._start_next(w)
            elif isinstance(m, Bye):
                self._kill(w)

    def _accept_job(self, w: _SimWorker, job: Job) -> None:
        missing = tuple(i for i in job.iterate_ids if i not in w.cache)
        if missing:
            w.waiting[job.job_id] = job
            self._deliver(self.core.handle(w.worker_id, Error(ErrorCode.MISSING_ITERATE, "cache miss",
                                                               job_id=job.job_id, iterate_ids=missing), self.now))
            return
        w.waiting.pop(job.job_id, None)
        w.queue.append(job)
        if w.current is None:
            self._start_next(w)

    def _start_next(self, w: _SimWorker) -> None:
        if not w.queue or not w.alive:
            return
        job = w.queue.popleft()
        w.current = job
        w.token += 1
        cost = self.problem.sample_cost(job.seed, job.batch_size) if job.kind != JobKind.FULL_GRAD else 1.0
        d = self.delays.duration(w.index, job, cost, self.rng)
        self._push(self.now + d, "finish", (w.index, w.token, d))

    def _finish(self, w: _SimWorker, token: int, duration: float) -> None:
        if not w.alive or token != w.token or w.current is None:
            return
        job = w.current
        w.current = None
        points = []
        for iid in job.iterate_ids:
            w.cache.move_to_end(iid)
            points.append(w.cache[iid])
        reply = run_job(job, points, self.problem)
        if len(w.cache) > self.cache_size:  # least recently used first, never what a queued job needs
            pinned = {i for j in (*w.queue, *w.waiting.values()) for i in j.iterate_ids}
            for iid in [i for i in w.cache if i not in pinned][: len(w.cache) - self.cache_size]:
                del w.cache[iid]
        grads = reply.grads
        if self.wire_dtype != "f32":  # what the server decodes
            grads = tuple(roundtrip(g, self.wire_dtype) for g in grads)
        reply = Reply(job_id=reply.job_id, created_at=reply.created_at, grads=grads, loss=reply.loss,
                      count=reply.count, compute_s=duration, holds=tuple(w.cache))
        self._start_next(w)
        if self.loss_prob and self.rng.random() < self.loss_prob:
            return  # lost in transit; the next heartbeat reveals it
        self._deliver(self.core.handle(w.worker_id, reply, self.now))

    def _kill(self, w: _SimWorker) -> None:
        w.alive = False
        w.current = None
        w.queue.clear()
        w.waiting.clear()
        w.cache.clear()
        w.token += 1

    def _join(self, w: _SimWorker) -> None:
        w.alive = True
        self._deliver(self.core.handle(w.worker_id, Hello(worker_id=w.worker_id, boot=w.boot, credit=self.credit),
                                       self.now))
        self._deliver(self.core.handle(w.worker_id, Ready(credit=self.credit, holds=tuple(w.cache)), self.now))

    def _heartbeats(self) -> None:
        for w in self.workers:
            if w.alive:
                busy = tuple(j.job_id for j in w.queue) + tuple(w.waiting)
                if w.current is not None:
                    busy += (w.current.job_id,)
                self._deliver(self.core.handle(w.worker_id, Heartbeat(boot=w.boot, credit=self.credit, busy=busy,
                                                                      seen=w.seen), self.now))
        self._deliver(self.core.on_tick(self.now))

    # ------------------------------------------------------------------ run
    def run(self, *, max_time: float = math.inf, max_updates: int | None = None, eval_every: int = 0,
            eval_interval: float = 0.0, stop: Callable[[dict[str, float]], bool] | None = None,
            progress: Callable[[ServerCore, float], None] | None = None) -> Trace:
        """Advance until ``max_time`` (simulated), ``max_updates`` versions, or ``stop(evaluation)``.

        Evaluates the problem at x every ``eval_every`` versions and/or every ``eval_interval``
        simulated seconds (and at the start and the end).
        """
        if max_time == math.inf and max_updates is None and stop is None:
            raise ValueError("give a stop condition: max_time, max_updates or stop")
        core = self.core
        self._record()
        next_eval_v = eval_every or math.inf
        next_eval_t = eval_interval or math.inf
        last_v = core.version
        while self.heap:
            if self.heap[0][0] > max_time:
                self.now = max_time  # leave the event for a later run() call
                break
            t, _, kind, payload = heapq.heappop(self.heap)
            self.now = t
            self._event(t, kind, payload)
            self._collect()
            v = core.version
            if v != last_v:
                last_v = v
                if core.last_metrics:
                    self.trace.metrics.append({"t": t, "version": v, **core.last_metrics})
                done = max_updates is not None and v >= max_updates
                if v >= next_eval_v or t >= next_eval_t or done:
                    ev = self._record()
                    while next_eval_v <= v:
                        next_eval_v += eval_every
                    while next_eval_t <= t:
                        next_eval_t += eval_interval
                    if stop is not None and stop(ev):
                        break
                if progress is not None:
                    progress(core, t)
                if done:
                    break
        if not self.trace.points or self.trace.points[-1]["version"] != core.version:
            self._record()
        self.trace.counters = core.counters.as_dict()
        self.trace.final_x = np.array(core.params(), copy=True)
        self.trace.final_t = self.now
        self.trace.store_peak = core.store_peak
        return self.trace

    def _event(self, t: float, kind: str, payload: Any) -> None:
        """One simulated event at time ``t``: a job finished, heartbeats, a round's clock, a
        worker joining or crashing."""
        if kind == "finish":
            idx, token, d = payload
            self._finish(self.workers[idx], token, d)
        elif kind == "heartbeat":
            self._heartbeats()
            self._push(t + self.heartbeat_s, "heartbeat", None)
        elif kind == "round":
            self._deliver(self.core.on_tick(t))
            self._push(t + self.cfg.round_period_s, "round", None)
        elif kind == "join":
            self._join(self.workers[payload])
        elif kind == "crash":
            w = self.workers[payload.worker]
            self._kill(w)
            if payload.rejoin_after is not None:
                w.boot += 1
                self._push(t + payload.rejoin_after, "join", w.index)

    def _collect(self) -> None:
        for ev in self.core.drain_events():
            if ev["ev"] == "applied":
                self.trace.applied.append((ev["job_id"], ev["created_at"], ev["worker_id"], ev["age"], ev["t"]))

    def _record(self) -> dict[str, float]:
        ev = self.problem.evaluate(self.core.params())
        c = self.core.counters
        point = {"t": self.now, "version": self.core.version, **{k: float(v) for k, v in ev.items()},
                 "applied": c.applied, "dropped": c.dropped, "lost": c.lost, "issued": c.issued}
        self.trace.points.append(point)
        return point


def simulate(algorithm: Algorithm, problem: Problem, delays: DelayModel, config: CoreConfig | None = None,
             **run_kwargs: Any) -> Trace:
    """One-call form: build a :class:`Simulator` and run it. Keyword arguments not accepted by
    ``Simulator`` go to :meth:`Simulator.run`."""
    sim_keys = {"seed", "crashes", "loss_prob", "credit", "cache_size", "heartbeat_s", "x0", "wire_dtype", "shards"}
    sim_kw = {k: v for k, v in run_kwargs.items() if k in sim_keys}
    run_kw = {k: v for k, v in run_kwargs.items() if k not in sim_keys}
    return Simulator(algorithm, problem, delays, config, **sim_kw).run(**run_kw)
