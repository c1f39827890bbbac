"""Rennala family (docs/ALGORITHMS.md §5 A8, A9, A9b; §6.4 Rennala Muon baseline; examples §11.5).

Toy oracle of the worked examples: f(x) = x²/2, ∇f(x; ξ) = x + ξ at every point of the job.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms.base import Result, state_arrays_equal
from algorithms.lmo import muon_direction
from algorithms.rennala import RennalaMuon, RennalaMVR, RennalaMVRInexact, RennalaSGD
from protocol.messages import JobKind

RTOL = 1e-9  # terminating decimals of the spec tables


@dataclass
class Job:
    """What the driver keeps per outstanding job (the fields ``cancel`` may read)."""

    job_id: int
    worker_id: str
    created_at: int
    kind: JobKind
    iterate_ids: tuple[int, ...]
    points: tuple[np.ndarray, ...]


@dataclass
class Driver:
    """Minimal per-reply driver (docs/ALGORITHMS.md §2.3) with one job slot per worker.

    ``issue`` asks the algorithm for a job; ``reply`` computes g = x + ξ at the job's points,
    calls ``apply`` with that one result, then ``cancel``, and frees the worker(s).
    """

    alg: object
    x0: np.ndarray
    state: object = None
    jobs: dict[int, Job] = field(default_factory=dict)
    next_id: int = 0
    log: list = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.state, init_jobs = self.alg.init(self.x0, seed=0)
        assert init_jobs == []

    def issue(self, worker_id: str) -> Job | None:
        self.state, spec = self.alg.make_job(self.state, worker_id)
        if spec is None:
            return None
        for p in spec.points:
            assert not p.flags.writeable
        job = Job(self.next_id, worker_id, spec.created_at, spec.kind, spec.iterate_ids, spec.points)
        self.jobs[job.job_id] = job
        self.next_id += 1
        return job

    def reply(self, job_id: int, xi: float):
        job = self.jobs.pop(job_id)
        grads = tuple(np.asarray(p + xi) for p in job.points)
        res = Result(job_id=job.job_id, worker_id=job.worker_id, created_at=job.created_at, kind=job.kind,
                     iterate_ids=job.iterate_ids, grads=grads)
        version = self.alg.version(self.state)
        self.state, out = self.alg.apply(self.state, [res])
        stop = self.alg.cancel(self.state, list(self.jobs.values()))
        stopped = [self.jobs.pop(j) for j in stop]
        self.cancelled += stop
        self.log.append((version, job, grads, out, stopped))
        return out, stopped

    @property
    def x(self) -> np.ndarray:
        return self.alg.params(self.state)


def x0_one() -> np.ndarray:
    return np.array([1.0])


def run_rounds(d: Driver, rounds, workers=("A", "B")):
    """Each round: every worker gets a job, then they reply in order with the given ξ."""
    for xis in rounds:
        jobs = [d.issue(w) for w in workers]
        outs = [d.reply(j.job_id, xi)[0] for j, xi in zip(jobs, xis, strict=True)]
        assert [o.updated for o in outs] == [False] * (len(jobs) - 1) + [True]


# ---------------------------------------------------------------------------------------------
# A8 worked example


def test_rennala_example_keep_running():
    d = Driver(RennalaSGD(lr=0.5, B=2, restart=False), x0_one())
    a, b = d.issue("A"), d.issue("B")
    out, _ = d.reply(a.job_id, 0.1)  # g = 1.1
    assert out.applied == (a.job_id,) and not out.updated and out.metrics["batch_fill"] == 0.5
    a = d.issue("A")
    assert a.created_at == 0 and a.iterate_ids == (0,)
    out, stopped = d.reply(a.job_id, -0.3)  # g = 0.7
    assert out.updated and stopped == []
    np.testing.assert_allclose(d.x, [0.55], rtol=RTOL)
    assert d.alg.version(d.state) == 1 and d.alg.live_iterate_ids(d.state) == {1}
    a = d.issue("A")
    out, _ = d.reply(b.job_id, 0.0)  # B's old x_0 gradient: dropped (mode a)
    assert out.dropped == (b.job_id,) and out.applied == () and not out.updated
    b = d.issue("B")
    d.reply(a.job_id, 0.05)  # g = 0.6
    out, _ = d.reply(b.job_id, -0.25)  # g = 0.3
    assert out.updated
    np.testing.assert_allclose(d.x, [0.325], rtol=RTOL)


def test_rennala_example_restart_cancels_old_round():
    d = Driver(RennalaSGD(lr=0.5, B=2, restart=True), x0_one())
    a, b = d.issue("A"), d.issue("B")
    d.reply(a.job_id, 0.1)
    a = d.issue("A")
    out, stopped = d.reply(a.job_id, -0.3)
    assert out.updated and [j.job_id for j in stopped] == [b.job_id]
    np.testing.assert_allclose(d.x, [0.55], rtol=RTOL)
    a, b = d.issue("A"), d.issue("B")
    assert a.created_at == b.created_at == 1 and b.iterate_ids == (1,)
    np.testing.assert_allclose(b.points[0], [0.55], rtol=RTOL)
    d.reply(a.job_id, 0.05)
    out, stopped = d.reply(b.job_id, -0.25)
    assert out.updated and stopped == []
    np.testing.assert_allclose(d.x, [0.325], rtol=RTOL)


def test_rennala_several_results_in_one_apply():
    alg = RennalaSGD(lr=0.5, B=2, restart=False)
    state, _ = alg.init(x0_one(), seed=0)
    specs = [alg.make_job(state, w)[1] for w in "ABC"]
    res = [Result(job_id=i, worker_id="w", created_at=s.created_at, kind=s.kind, iterate_ids=s.iterate_ids,
                  grads=(s.points[0] + xi,)) for i, (s, xi) in enumerate(zip(specs, (0.1, -0.3, 0.0), strict=True))]
    state, out = alg.apply(state, res)
    assert out.applied == (0, 1) and out.dropped == (2,) and out.updated
    np.testing.assert_allclose(alg.params(state), [0.55], rtol=RTOL)


# ---------------------------------------------------------------------------------------------
# A9 worked example


def test_rennala_mvr_example():
    d = Driver(RennalaMVR(lr=0.5, B=2, B_init=2, p=0.5), x0_one())
    # Blocking initialization: GRAD jobs at x_0, created_at 0.
    a, b = d.issue("A"), d.issue("B")
    assert a.kind == JobKind.GRAD and a.created_at == 0 and a.iterate_ids == (0,)
    assert d.alg.live_iterate_ids(d.state) == {0}
    d.reply(a.job_id, 0.2)
    out, _ = d.reply(b.job_id, -0.2)
    assert out.updated
    np.testing.assert_allclose(d.state.g, [1.0], rtol=RTOL)
    np.testing.assert_allclose(d.x, [0.5], rtol=RTOL)
    assert d.alg.live_iterate_ids(d.state) == {1, 0}

    table = [  # (x_k, x_{k+1}), ξ, ḡ₊, ḡ₋, g_{k+1}, x_{k+2}
        ((1.0, 0.5), (0.1, -0.3), 0.4, 0.9, 0.45, 0.275),
        ((0.5, 0.275), (0.2, 0.0), 0.375, 0.6, 0.3, 0.125),
    ]
    for k, ((x_old, x_new), xis, gp, gm, g_next, x_next) in enumerate(table):
        jobs = [d.issue("A"), d.issue("B")]
        for job in jobs:
            assert job.kind == JobKind.GRAD_PAIR and job.iterate_ids == (k + 1, k) and job.created_at == k + 1
            np.testing.assert_allclose(job.points, [[x_new], [x_old]], rtol=RTOL)
        out, _ = d.reply(jobs[0].job_id, xis[0])
        assert not out.updated
        sum_new, sum_old = d.state.sum_new.copy(), d.state.sum_old.copy()
        out, _ = d.reply(jobs[1].job_id, xis[1])
        assert out.updated
        grads = [g for (_, _, g, _, _) in d.log[-2:]]
        np.testing.assert_allclose((grads[0][0] + grads[1][0]) / 2, [gp], rtol=RTOL)
        np.testing.assert_allclose((grads[0][1] + grads[1][1]) / 2, [gm], rtol=RTOL)
        np.testing.assert_allclose((sum_new + grads[1][0]) / 2, [gp], rtol=RTOL)
        np.testing.assert_allclose((sum_old + grads[1][1]) / 2, [gm], rtol=RTOL)
        np.testing.assert_allclose(d.state.g, [g_next], rtol=RTOL)
        np.testing.assert_allclose(d.x, [x_next], rtol=RTOL)
        assert d.alg.version(d.state) == k + 2


def test_rennala_mvr_init_leftovers_are_stale():
    # Three workers, B_init = 2: the third initial GRAD job is of an older round once x_1 exists.
    for restart in (True, False):
        d = Driver(RennalaMVR(lr=0.5, B=2, B_init=2, p=0.5, restart=restart), x0_one())
        a, b, c = d.issue("A"), d.issue("B"), d.issue("C")
        d.reply(a.job_id, 0.2)
        out, stopped = d.reply(b.job_id, -0.2)
        assert out.updated
        if restart:
            assert [j.job_id for j in stopped] == [c.job_id]
        else:
            assert stopped == []
            out, _ = d.reply(c.job_id, 0.0)
            assert out.dropped == (c.job_id,) and not out.updated
        np.testing.assert_allclose(d.x, [0.5], rtol=RTOL)


# ---------------------------------------------------------------------------------------------
# A9b worked example


@pytest.mark.parametrize("alpha, g1, x2, g_hat2, g2, x3", [
    (1.0, 0.4, 0.3, 0.4, 0.4, 0.1),
    (0.5, 0.55, 0.225, 0.325, 0.41875, 0.015625),
])
def test_mars_inexact_example(alpha, g1, x2, g_hat2, g2, x3):
    d = Driver(RennalaMVRInexact(lr=0.5, B=2, B_init=2, p=0.5, alpha=alpha), x0_one())
    for xis, g_exp, x_exp, g_hat_exp in [((0.2, -0.2), 1.0, 0.5, 1.0), ((0.1, -0.3), g1, x2, 0.4),
                                         ((0.2, 0.0), g2, x3, g_hat2)]:
        jobs = [d.issue("A"), d.issue("B")]
        for job in jobs:
            assert job.kind == JobKind.GRAD and len(job.points) == 1
        assert not d.reply(jobs[0].job_id, xis[0])[0].updated
        assert d.reply(jobs[1].job_id, xis[1])[0].updated
        np.testing.assert_allclose(d.state.g_hat_prev, [g_hat_exp], rtol=RTOL)
        np.testing.assert_allclose(d.state.g, [g_exp], rtol=RTOL)
        np.testing.assert_allclose(d.x, [x_exp], rtol=RTOL)
    assert d.alg.version(d.state) == 3 and d.alg.live_iterate_ids(d.state) == {3}


# ---------------------------------------------------------------------------------------------
# Rennala Muon (§6 baseline): no worked example in the spec; hand values and the NS5 vectors


def test_rennala_muon_without_layout_is_normalized_sgd():
    d = Driver(RennalaMuon(lr=0.5, B=2, beta=0.5), np.array([3.0, 4.0]))
    run_rounds(d, [(0.5, -0.5)])  # ḡ = (3, 4); m = (1.5, 2); u = 0.75 ḡ; O = u/‖u‖ = (0.6, 0.8)
    np.testing.assert_allclose(d.x, [2.7, 3.6], rtol=RTOL)
    np.testing.assert_allclose(d.state.m, [1.5, 2.0], rtol=RTOL)
    run_rounds(d, [(np.array([0.3, -0.6]),) * 2])  # ḡ = (3, 3); m = (2.25, 2.5); u = (2.625, 2.75)
    np.testing.assert_allclose(d.state.m, [2.25, 2.5], rtol=RTOL)
    u = np.array([2.625, 2.75])
    np.testing.assert_allclose(d.x, np.array([2.7, 3.6]) - 0.5 * u / np.linalg.norm(u), rtol=RTOL)


def test_rennala_muon_plain_momentum_direction():
    d = Driver(RennalaMuon(lr=1.0, B=1, beta=0.5, nesterov=False), np.array([3.0, 4.0]))
    run_rounds(d, [(0.0,), (np.array([-2.4, 1.2]),)], workers=("A",))
    # round 0: m = (1.5, 2), step (0.6, 0.8) -> (2.4, 3.2); round 1: ḡ = (0, 4.4), m = (0.75, 3.2)
    m = np.array([0.75, 3.2])
    np.testing.assert_allclose(d.state.m, m, rtol=RTOL)
    np.testing.assert_allclose(d.x, np.array([2.4, 3.2]) - m / np.linalg.norm(m), rtol=RTOL)


@pytest.mark.parametrize("ns, layout, x0, direction", [
    # Row vector [3, 4] as a 1×2 block, classic NS5 -> [0.417862, 0.557149] (the NS is scale-free).
    ("classic", (("w", (1, 2)),), [3.0, 4.0], [0.417862, 0.557149]),
    # diag(3, 1), Polar-Express-5 -> diag(1.017546, 1.130347).
    ("polar-express", (("w", (2, 2)),), [3.0, 0.0, 0.0, 1.0], [1.017546, 0.0, 0.0, 1.130347]),
    # [[1, 2], [3, 4]], classic NS5.
    ("classic", (("w", (2, 2)),), [1.0, 2.0, 3.0, 4.0], [-0.680661, 0.825540, 0.741295, 0.259440]),
])
def test_rennala_muon_newton_schulz_vectors(ns, layout, x0, direction):
    # β = 0: u = ḡ = x0 exactly (ξ cancels), so O = NS(x0). (NS is scale-free only up to the 1e-7
    # added to the norm: with Polar Express, NS(0.19·M) differs from NS(M) by 3e-6.)
    alg = RennalaMuon(lr=1.0, B=2, beta=0.0, ns=ns).bind(layout)
    d = Driver(alg, np.array(x0))
    run_rounds(d, [(0.25, -0.25)])
    np.testing.assert_allclose(d.x, np.array(x0) - np.array(direction), atol=1e-6)


def test_rennala_muon_layout_blocks():
    layout = (("w", (2, 3)), ("b", (2,)), ("s", ()))
    alg = RennalaMuon(lr=0.1, B=1, beta=0.0, nesterov=False).bind(layout)
    assert alg.layout == layout and RennalaMuon.layout == ()
    x0 = np.arange(1.0, 10.0)
    d = Driver(alg, x0)
    run_rounds(d, [(0.0,)], workers=("A",))  # β = 0: u = ḡ = x0
    np.testing.assert_allclose(d.x, x0 - 0.1 * muon_direction(x0, layout), rtol=1e-12)
    np.testing.assert_allclose(d.x[6:], 0.9 * x0[6:], rtol=RTOL)  # vector and scalar blocks: plain step
    o = (x0[:6] - d.x[:6]) / 0.1  # the 2×3 block is (nearly) orthogonal: O Oᵀ ≈ I
    np.testing.assert_allclose(o.reshape(2, 3) @ o.reshape(2, 3).T, np.eye(2), atol=0.35)


def test_rennala_muon_layout_checks():
    with pytest.raises(ValueError):
        RennalaMuon().bind((("w", (2, 2)),)).init(np.zeros(5), seed=0)
    with pytest.raises(ValueError):
        RennalaMuon().bind([("w", (2, 2))])
    with pytest.raises(ValueError):
        RennalaMuon().bind((("w", (2, -2)),))


# ---------------------------------------------------------------------------------------------
# Property: exactly B current results per update; dropped = stale; reference trajectory


def reference_rennala(alg, x0, batches):
    x = x0.copy()
    for batch in batches:
        x = x - alg.lr * (sum(g[0] for g in batch) / alg.B)
    return x


def reference_mvr(alg, x0, batches):
    x, g = x0.copy(), None
    for k, batch in enumerate(batches):
        if k == 0:
            g = sum(gr[0] for gr in batch) / alg.B_init
        else:
            gp = sum(gr[0] for gr in batch) / alg.B
            gm = sum(gr[1] for gr in batch) / alg.B
            g = gp + (1 - alg.p) * (g - gm)
        x = x - alg.lr * g
    return x


def reference_mvr_inexact(alg, x0, batches):
    x, g, g_hat_prev = x0.copy(), None, None
    for k, batch in enumerate(batches):
        g_hat = sum(gr[0] for gr in batch) / (alg.B_init if k == 0 else alg.B)
        if k == 0:
            g = g_hat
        else:
            g = (1 - alg.p) * g + alg.p * g_hat + alg.alpha * (1 - alg.p) * (g_hat - g_hat_prev)
        g_hat_prev = g_hat
        x = x - alg.lr * g
    return x


def reference_muon(alg, x0, batches):
    x, m = x0.copy(), np.zeros_like(x0)
    for batch in batches:
        g = sum(gr[0] for gr in batch) / alg.B
        m = alg.beta * m + (1 - alg.beta) * g
        u = alg.beta * m + (1 - alg.beta) * g if alg.nesterov else m
        x = x - alg.lr * muon_direction(u, alg.layout)
    return x


def make_alg(which: str, B: int, B_init: int, restart: bool):
    if which == "muon":
        alg = RennalaMuon(lr=0.3, B=B, beta=0.6, restart=restart).bind((("w", (1, 2)),))
        return alg, reference_muon
    if which == "rennala":
        return RennalaSGD(lr=0.3, B=B, restart=restart), reference_rennala
    if which == "mvr":
        return RennalaMVR(lr=0.3, B=B, B_init=B_init, p=0.4, restart=restart), reference_mvr
    return RennalaMVRInexact(lr=0.3, B=B, B_init=B_init, p=0.4, alpha=0.7, restart=restart), reference_mvr_inexact


def target(alg, version: int) -> int:
    return alg.B_init if version == 0 and hasattr(alg, "B_init") else alg.B


def run_and_check(alg, reference, n_workers: int, pick, xis, loss_every: int = 0):
    """Drive ``alg`` with ``pick(jobs, step) -> job_id``; check the Rennala invariants at every step."""
    d = Driver(alg, np.array([1.0, -2.0]))
    free = [f"w{i}" for i in range(n_workers)]
    batches, current = [], []
    for step, xi in enumerate(xis):
        for w in free:
            d.issue(w)
        free = []
        if loss_every and step % loss_every == loss_every - 1:
            lost = d.jobs.pop(min(d.jobs))
            d.state = alg.on_lost(d.state, [lost.job_id])
            free.append(lost.worker_id)
            continue
        job_id = pick(d.jobs, step)
        outstanding_before = set(d.jobs) - {job_id}
        version, k_before = alg.version(d.state), len(current)
        out, stopped = d.reply(job_id, xi)
        job, grads = d.log[-1][1], d.log[-1][2]
        stale = job.created_at != version
        # Each result is applied or dropped, and dropped exactly when stale.
        assert (out.dropped, out.applied) == (((job_id,), ()) if stale else ((), (job_id,)))
        assert out.ages == (0,) * len(out.applied)
        if not stale:
            current.append(grads)
        # An update happens exactly at the B-th current result and advances the version by one.
        assert out.updated == (not stale and k_before + 1 == target(alg, version))
        assert alg.version(d.state) == version + out.updated
        if out.updated:
            batches.append(current)
            current = []
        assert out.metrics["batch_fill"] == len(current) / target(alg, alg.version(d.state))
        # Cancel: only outstanding jobs, exactly the stale ones with restart, none without.
        assert {j.job_id for j in stopped} <= outstanding_before
        stale_left = {j.job_id for j in d.jobs.values() if j.created_at != alg.version(d.state)}
        if alg.restart:
            assert all(j.created_at != alg.version(d.state) for j in stopped) and not stale_left
        else:
            assert stopped == []
        free += [job.worker_id] + [j.worker_id for j in stopped]
    if alg.restart:
        assert all(not o.dropped for (_, _, _, o, _) in d.log)  # nothing stale ever arrives
    np.testing.assert_allclose(d.x, reference(alg, np.array([1.0, -2.0]), batches), rtol=1e-12)
    assert sum(len(b) for b in batches) + len(current) == sum(len(o.applied) for (_, _, _, o, _) in d.log)
    return d


ALGS = st.sampled_from(["rennala", "mvr", "mvr-inexact", "muon"])


@settings(max_examples=80, deadline=None)
@given(which=ALGS, B=st.integers(1, 4), B_init=st.integers(1, 5), restart=st.booleans(),
       n_workers=st.integers(1, 5), loss_every=st.sampled_from([0, 0, 7]),
       choices=st.lists(st.integers(0, 10**6), min_size=1, max_size=60),
       noise_seed=st.integers(0, 2**16))
def test_rennala_applies_exactly_B_current_version(which, B, B_init, restart, n_workers, loss_every, choices,
                                                   noise_seed):
    """Random arrival orders: any outstanding job may finish next."""
    alg, reference = make_alg(which, B, B_init, restart)
    xis = np.random.default_rng(noise_seed).normal(size=len(choices))
    run_and_check(alg, reference, n_workers, lambda jobs, step: sorted(jobs)[choices[step] % len(jobs)], xis,
                  loss_every)


@settings(max_examples=40, deadline=None)
@given(which=ALGS, B=st.integers(1, 4), B_init=st.integers(1, 5), restart=st.booleans(),
       speeds=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=5), steps=st.integers(1, 60),
       noise_seed=st.integers(0, 2**16))
def test_rennala_random_worker_speeds(which, B, B_init, restart, speeds, steps, noise_seed):
    """Workers of fixed speeds: the job that finishes first (then lowest job id) replies next."""
    alg, reference = make_alg(which, B, B_init, restart)
    finish: dict[int, tuple[float, int]] = {}
    clock = [0.0]

    def pick(jobs, step):
        for j in jobs.values():
            if j.job_id not in finish:
                finish[j.job_id] = (clock[0] + speeds[int(j.worker_id[1:])], j.job_id)
        t, job_id = heapq.nsmallest(1, (finish[j] for j in jobs))[0]
        clock[0] = t
        return job_id

    xis = np.random.default_rng(noise_seed).normal(size=steps)
    run_and_check(alg, reference, len(speeds), pick, xis)


# ---------------------------------------------------------------------------------------------
# Hyper-parameters and state save/load


@pytest.mark.parametrize("cls, kwargs", [
    (RennalaSGD, {"lr": 0.0}), (RennalaSGD, {"lr": -1.0}), (RennalaSGD, {"lr": float("nan")}),
    (RennalaSGD, {"B": 0}), (RennalaSGD, {"B": 2.5}), (RennalaSGD, {"restart": 1}),
    (RennalaMVR, {"B_init": 0}), (RennalaMVR, {"p": 0.0}), (RennalaMVR, {"p": 1.5}), (RennalaMVR, {"B": -1}),
    (RennalaMVR, {"restart": "yes"}), (RennalaMVRInexact, {"alpha": -0.1}), (RennalaMVRInexact, {"alpha": 2.0}),
    (RennalaMVRInexact, {"p": 0.0}), (RennalaMVRInexact, {"B_init": 1.5}), (RennalaMVRInexact, {"lr": "0.1"}),
    (RennalaMuon, {"beta": 1.0}), (RennalaMuon, {"beta": -0.1}), (RennalaMuon, {"ns": "quintic"}),
    (RennalaMuon, {"ns_steps": 0}), (RennalaMuon, {"nesterov": "yes"}), (RennalaMuon, {"B": 0}),
    (RennalaMuon, {"lr": float("inf")}), (RennalaMuon, {"ns_dtype": "half"}),
])
def test_rennala_rejects_bad_hyper_parameters(cls, kwargs):
    with pytest.raises(ValueError, match="Invalid"):
        cls(**kwargs)


@pytest.mark.parametrize("which", ["rennala", "mvr", "mvr-inexact", "muon"])
@pytest.mark.parametrize("restart", [True, False])
def test_rennala_state_dict_round_trip_mid_round(which, restart):
    alg, _ = make_alg(which, B=3, B_init=4, restart=restart)
    rng = np.random.default_rng(5)
    d = Driver(alg, np.array([1.0, -2.0]))
    for w in ("A", "B"):
        d.issue(w)
    order = ["A", "B", "A", "A", "B", "A", "B", "B", "A", "B"]

    def step(drv, w, xi):
        job = next((j for j in drv.jobs.values() if j.worker_id == w), None) or drv.issue(w)
        _, stopped = drv.reply(job.job_id, xi)
        for s in stopped:
            drv.issue(s.worker_id)
        drv.issue(w)

    for i in range(100):  # stop mid-round, past the initial batch
        step(d, order[i % len(order)], rng.normal())
        if d.state.count > 0 and alg.version(d.state) >= 2:
            break
    assert d.state.count > 0 and alg.version(d.state) >= 2
    saved = alg.to_state_dict(d.state)
    e = Driver(alg, np.zeros(2))
    e.state = alg.from_state_dict(saved)
    e.jobs = dict(d.jobs)
    e.next_id = d.next_id
    assert not alg.params(e.state).flags.writeable
    assert state_arrays_equal(alg.to_state_dict(e.state), saved)
    xis = rng.normal(size=12)
    for w, xi in zip(order + order[:2], xis, strict=True):
        step(d, w, xi)
        step(e, w, xi)
        assert state_arrays_equal(alg.to_state_dict(d.state), alg.to_state_dict(e.state))
    assert np.array_equal(d.x, e.x)


@pytest.mark.parametrize("which", ["rennala", "mvr", "mvr-inexact", "muon"])
def test_rennala_load_rejects_inconsistent_state(which):
    alg, _ = make_alg(which, B=3, B_init=4, restart=True)
    state, _ = alg.init(np.ones(2), seed=0)
    good = alg.to_state_dict(state)
    alg.from_state_dict(good)
    sum_key = "sum_new" if which == "mvr" else "grad_sum"
    for key, value in [("count", 4), ("count", -1), ("count", 1.5), (sum_key, np.zeros(3)),
                       (sum_key, np.zeros(2, np.float32)), (sum_key, np.array([0.0, np.nan])), ("version", -1),
                       ("x", np.zeros(3))]:
        bad = dict(good, **{key: value})
        with pytest.raises(ValueError):
            alg.from_state_dict(bad)
    with pytest.raises(ValueError):
        alg.from_state_dict({k: v for k, v in good.items() if k != "count"})


def test_rennala_registered():
    from algorithms import ALGORITHMS, build

    assert ALGORITHMS["rennala"] is RennalaSGD
    assert ALGORITHMS["rennala-mvr"] is RennalaMVR
    assert ALGORITHMS["rennala-mvr-inexact"] is RennalaMVRInexact
    assert ALGORITHMS["rennala-muon"] is RennalaMuon
    muon = build("rennala-muon", {"ns": "classic", "nesterov": "false", "beta": "0.9"})
    assert (muon.ns, muon.nesterov, muon.beta, muon.lr, muon.B) == ("classic", False, 0.9, 1.0, 2)
    with pytest.raises(ValueError):
        build("rennala-muon", {"layout": "()"})  # bound by bind(), not a hyper-parameter
    alg = build("rennala-mvr", {"lr": "0.2", "B": "3", "B_init": "9", "p": "0.5", "restart": "false"})
    assert (alg.lr, alg.B, alg.B_init, alg.p, alg.restart) == (0.2, 3, 9, 0.5, False)
