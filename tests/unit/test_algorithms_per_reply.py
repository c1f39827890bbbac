"""Per-reply algorithms (docs/ALGORITHMS.md §3, §4, §6; examples §11): worked examples, properties, contracts.

A small replay driver stands in for the server core: it follows the per-reply driver
contract (apply one result, then cancel, then make_job for every free worker) with the toy
oracle ∇f(x; ξ) = x + ξ evaluated at the job's own points. Tolerances: rtol=1e-9 for
terminating decimals, atol=1e-6 for rounded values (docs/ALGORITHMS.md §11).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from algorithms import ALGORITHMS, build
from algorithms.base import Algorithm, Outcome, Result, state_arrays_equal
from algorithms.baselines import (
    DelayAdaptiveASGD,
    DelayFilteredASGD,
    NaiveMomentumASGD,
    VanillaASGD,
)
from algorithms.lmo import NS_TABLES, muon_direction, pa_schedule
from algorithms.ordered import OrderedMomentum, OrderedMu2SGD
from algorithms.ringmaster import DelayAdaptiveMuon, RingmasterASGD, RingmasterLMO
from protocol.messages import JobKind

RTOL = 1e-9
ATOL = 1e-6


# ---------------------------------------------------------------------------------------------
# Replay driver


@dataclass(frozen=True)
class Job:
    """An outstanding job as the driver's ledger holds it."""

    job_id: int
    created_at: int
    kind: JobKind
    iterate_ids: tuple[int, ...]
    worker_id: str
    points: tuple[np.ndarray, ...]
    copies: tuple[np.ndarray, ...]  # to check the points are never mutated


@dataclass
class Event:
    job: Job
    version_before: int
    outcome: Outcome
    cancelled: list[int]
    grads: tuple[np.ndarray, ...]
    x: np.ndarray  # iterate after the event (copy)
    state: dict[str, Any]  # state dict after the event


@dataclass
class Replay:
    """Drives a per-reply algorithm through scripted arrivals (one job per worker)."""

    alg: Algorithm
    x0: Any
    workers: tuple[str, ...] = ("A", "B")
    noise: dict[int, Any] = field(default_factory=dict)  # job_id -> ξ (default 0)

    def __post_init__(self) -> None:
        self.state, init_jobs = self.alg.init(np.array(self.x0, dtype=np.float64, ndmin=1), seed=0)
        assert init_jobs == []
        self.outstanding: dict[int, Job] = {}
        self.issued: list[Job] = []
        self.events: list[Event] = []
        self.next_id = 0
        self.fill()

    def fill(self) -> None:
        busy = {j.worker_id for j in self.outstanding.values()}
        for w in self.workers:
            if w in busy:
                continue
            self.state, spec = self.alg.make_job(self.state, w)
            assert spec is not None
            assert len(spec.points) == len(spec.iterate_ids)
            for p in spec.points:
                assert not p.flags.writeable, "iterates handed out must be read-only"
            job = Job(self.next_id, spec.created_at, spec.kind, spec.iterate_ids, w, spec.points,
                      tuple(p.copy() for p in spec.points))
            self.outstanding[job.job_id] = job
            self.issued.append(job)
            self.next_id += 1

    def deliver(self, job_id: int) -> Event | None:
        """The reply to ``job_id`` arrives; None if that job is no longer outstanding (cancelled)."""
        job = self.outstanding.pop(job_id, None)
        if job is None:
            return None
        for p, c in zip(job.points, job.copies, strict=True):
            np.testing.assert_array_equal(p, c)  # never mutated while in flight
        xi = np.asarray(self.noise.get(job_id, 0.0), dtype=np.float64)
        grads = tuple(p + xi for p in job.points)
        result = Result(job_id=job.job_id, worker_id=job.worker_id, created_at=job.created_at, kind=job.kind,
                        iterate_ids=job.iterate_ids, grads=grads)
        version_before = self.state.version
        self.state, outcome = self.alg.apply(self.state, [result])
        cancelled = self.alg.cancel(self.state, list(self.outstanding.values()))
        for c in cancelled:
            del self.outstanding[c]
        self.fill()
        ev = Event(job, version_before, outcome, list(cancelled), grads, np.array(self.state.x, copy=True),
                   self.alg.to_state_dict(self.state))
        self.events.append(ev)
        return ev

    def run(self, arrivals) -> list[Event | None]:
        return [self.deliver(j) for j in arrivals]

    def job_of(self, worker: str) -> Job:
        (job,) = [j for j in self.outstanding.values() if j.worker_id == worker]
        return job


# Trace T1 (§3): A fast, B slow, x0 = 1; J0 → A, J1 → B at x0; A gets J2, J3 after events 1, 2.
T1_NOISE = {0: 0.0, 1: 0.2, 2: -0.1, 3: 0.1}
T1_ARRIVALS = [0, 2, 3, 1]


def replay_t1(alg: Algorithm) -> Replay:
    rp = Replay(alg, 1.0, noise=dict(T1_NOISE))
    rp.run(T1_ARRIVALS)
    return rp


def xs(rp: Replay) -> list[float]:
    return [float(ev.x[0]) for ev in rp.events]


# ---------------------------------------------------------------------------------------------
# T1 through A1–A6


def test_T1_vanilla():
    rp = replay_t1(VanillaASGD(lr=0.5))
    np.testing.assert_allclose(xs(rp), [0.5, 0.3, 0.1, -0.5], rtol=RTOL)
    np.testing.assert_allclose([ev.grads[0][0] for ev in rp.events], [1.0, 0.4, 0.4, 1.2], rtol=RTOL)
    assert [ev.outcome.ages for ev in rp.events] == [(0,), (0,), (0,), (3,)]


def test_T1_naive_momentum():
    rp = replay_t1(NaiveMomentumASGD(lr=0.5, beta=0.5))
    np.testing.assert_allclose([ev.grads[0][0] for ev in rp.events], [1.0, 0.65, 0.5625, 1.2], rtol=RTOL)
    np.testing.assert_allclose([ev.state["m"][0] for ev in rp.events], [0.5, 0.575, 0.56875, 0.884375], rtol=RTOL)
    np.testing.assert_allclose(xs(rp), [0.75, 0.4625, 0.178125, -0.2640625], rtol=RTOL)


def test_T1_delay_adaptive():
    rp = replay_t1(DelayAdaptiveASGD(lr=0.5, n_workers=2))
    np.testing.assert_allclose(xs(rp), [0.5, 0.3, 0.1, -0.3], rtol=RTOL)
    assert rp.events[-1].outcome.metrics["lr"] == pytest.approx(1 / 3, rel=RTOL)


def test_T1_delay_adaptive_koloskova_rule():
    alg = DelayAdaptiveASGD(lr=0.5, n_workers=2, rule="koloskova", smoothness=0.5)
    rp = replay_t1(alg)
    # δ = 3 > n = 2: min(0.5, 1/(4·0.5·3)) = 1/6.
    np.testing.assert_allclose(xs(rp), [0.5, 0.3, 0.1, -0.1], rtol=RTOL)
    assert [alg.step_size(d) for d in (0, 2)] == [0.5, 0.5]
    assert alg.step_size(100) == pytest.approx(1 / 200)
    assert DelayAdaptiveASGD(lr=0.01, n_workers=2, rule="koloskova").step_size(3) == 0.01


def test_T1_delay_filtered():
    rp = replay_t1(DelayFilteredASGD(lr=0.5, tau_max=2))
    np.testing.assert_allclose(xs(rp), [0.5, 0.3, 0.1, 0.1], rtol=RTOL)
    last = rp.events[-1]
    assert last.outcome.dropped == (1,) and last.outcome.applied == () and not last.outcome.updated
    assert rp.state.version == 3
    assert rp.job_of("B").created_at == 3  # B restarts at x_3


def test_T1_ringmaster_without_stops():
    rp = replay_t1(RingmasterASGD(lr=0.5, R=3, stops=False))
    np.testing.assert_allclose(xs(rp), [0.5, 0.3, 0.1, 0.1], rtol=RTOL)
    assert all(ev.cancelled == [] for ev in rp.events)
    assert rp.events[-1].outcome.dropped == (1,)
    job_b = rp.job_of("B")
    assert job_b.created_at == 3 and job_b.iterate_ids == (3,)
    np.testing.assert_allclose(job_b.points[0], [0.1], rtol=RTOL)


def test_T1_ringmaster_with_stops():
    rp = Replay(RingmasterASGD(lr=0.5, R=3, stops=True), 1.0, noise=dict(T1_NOISE))
    ev1, ev2, ev3, ev4 = rp.run(T1_ARRIVALS)
    assert ev1.cancelled == [] and ev2.cancelled == []  # J1 has age 1, then 2
    assert ev3.version_before == 2 and rp.state.version == 3
    assert ev3.cancelled == [1]  # cancelled exactly when version 3 is reached
    assert ev4 is None  # its result never reaches apply
    job_b = rp.job_of("B")
    assert job_b.created_at == 3 and job_b.job_id not in (0, 1, 2, 3)
    np.testing.assert_allclose(job_b.points[0], [0.1], rtol=RTOL)
    np.testing.assert_allclose(xs(rp), [0.5, 0.3, 0.1], rtol=RTOL)


def test_T1_ordered_momentum():
    rp = replay_t1(OrderedMomentum(lr=0.5, beta=0.5))
    np.testing.assert_allclose([ev.state["m"][0] for ev in rp.events], [0.5, 0.575, 0.56875, 0.359375], rtol=RTOL)
    np.testing.assert_allclose(xs(rp), [0.75, 0.4625, 0.178125, -0.0015625], rtol=RTOL)
    # Invariant check of §4: 0.5·(0.125·1 + 0.25·0.65 + 0.5·0.5625 + 0.125·1.2).
    assert 0.5 * (0.125 * 1 + 0.25 * 0.65 + 0.5 * 0.5625 + 0.125 * 1.2) == pytest.approx(0.359375, rel=RTOL)


@pytest.mark.parametrize("catch_up", [False, True])
def test_ordered_momentum_total_weight_of_a_late_reply(catch_up):
    """Issue 15 item 6: a reply of age δ moves x by η(1−β)^δ g in total under A6 (the missed
    share is lost); the opt-in catch-up variant (not the paper's method) applies the missed share
    η(1 − (1−β)^δ) g on arrival, so the total is η g."""
    from protocol.messages import JobKind

    beta, lr, delta = 0.1, 0.5, 7
    alg = OrderedMomentum(lr=lr, beta=beta, catch_up=catch_up)
    state, _ = alg.init(np.zeros(1), seed=0)
    state.version = delta  # the reply was created at version 0 and arrives δ versions later
    g = np.array([2.0])

    def reply(grad, created_at):
        return Result(job_id=0, worker_id="w", created_at=created_at, kind=JobKind.GRAD, iterate_ids=(0,),
                      grads=(grad,))

    state, _ = alg.apply(state, [reply(g, 0)])
    first = -state.x[0]
    for _ in range(600):  # on-time zero gradients: the momentum decays out
        state, _ = alg.apply(state, [reply(np.zeros(1), state.version)])
    kept = (1 - beta) ** delta
    assert first == pytest.approx(lr * (beta * kept + (1 - kept if catch_up else 0.0)) * 2.0, rel=1e-12)
    assert -state.x[0] == pytest.approx(lr * 2.0 * (1.0 if catch_up else kept), rel=1e-9)


def test_ordered_momentum_catch_up_is_opt_in_and_on_time_replies_are_unchanged():
    assert OrderedMomentum().catch_up is False
    plain, catch = replay_t1(OrderedMomentum(lr=0.5, beta=0.5)), replay_t1(OrderedMomentum(lr=0.5, beta=0.5,
                                                                                         catch_up=True))
    # the momentum is the same; x differs by η(1 − (1−β)^δ) g per reply, zero for age 0
    for a, b in zip(plain.events, catch.events, strict=True):
        assert a.outcome.ages == b.outcome.ages
    assert plain.events[0].outcome.ages == (0,) and xs(plain)[0] == xs(catch)[0]
    with pytest.raises(ValueError, match="catch_up"):
        OrderedMomentum(catch_up="yes")


# ---------------------------------------------------------------------------------------------
# A7 Ordered μ²-SGD


def test_mu2_ordered_example():
    # Job 1 (z=0) at t=1, job 2 (pair, z=0.1) at t=2, the slow worker's job 1 (z=0.2) at t=3.
    alg = OrderedMu2SGD(lr=0.1, weights="theory")
    rp = Replay(alg, 1.0, noise={0: 0.0, 1: 0.2, 2: 0.1})
    assert [j.kind for j in rp.issued] == [JobKind.GRAD, JobKind.GRAD]
    rp.run([0, 2, 1])
    job2 = rp.issued[2]
    assert job2.kind == JobKind.GRAD_PAIR and job2.created_at == 1 and job2.iterate_ids == (1, 0)
    np.testing.assert_allclose([job2.points[0][0], job2.points[1][0]], [0.9333333, 1.0], atol=ATOL)
    d = [ev.state["d"][0] for ev in rp.events]
    w = [ev.state["w"][0] for ev in rp.events]
    np.testing.assert_allclose(d, [1.0, 0.9833333, 1.0555556], atol=ATOL)
    np.testing.assert_allclose(w, [0.9, 0.7033333, 0.3866667], atol=ATOL)
    np.testing.assert_allclose(xs(rp), [0.9333333, 0.8183333, 0.6456667], atol=ATOL)
    assert [ev.outcome.ages for ev in rp.events] == [(0,), (0,), (2,)]
    # q_2 = ∇f(x_2; z) − (1 − 1/2)∇f(x_1; z) = 1.0333333 − 0.55.
    g_new, g_old = rp.events[1].grads
    assert g_new[0] - 0.5 * g_old[0] == pytest.approx(0.4833333, abs=ATOL)


def test_mu2_constant_weights_smoke():
    alg = OrderedMu2SGD(lr=0.1, weights="constant", beta=0.9, gamma_x=0.1)
    rp = Replay(alg, 1.0, noise={0: 0.0, 1: 0.2, 2: 0.1})
    rp.run([0, 2, 1])
    # t=1: d = q_1 = 1, w = 0.9, x = 0.9·1 + 0.1·0.9 = 0.99.
    # t=2: pair at (0.99, 1), z = 0.1: q = 1.09 − 0.1·1.1 = 0.98; d = 0.1·1 + 0.98 = 1.08;
    #      w = 0.9 − 0.108 = 0.792; x = 0.9·0.99 + 0.1·0.792 = 0.9702.
    # t=3: job 1 (z = 0.2) of age 2: ρ = 0.1² ; d = 0.1·1.08 + 0.01·1.2 = 0.12; w = 0.78;
    #      x = 0.9·0.9702 + 0.078 = 0.95118.
    np.testing.assert_allclose([ev.state["d"][0] for ev in rp.events], [1.0, 1.08, 0.12], rtol=RTOL)
    np.testing.assert_allclose([ev.state["w"][0] for ev in rp.events], [0.9, 0.792, 0.78], rtol=RTOL)
    np.testing.assert_allclose(xs(rp), [0.99, 0.9702, 0.95118], rtol=RTOL)


def test_mu2_converges_on_toy_quadratic():
    rng = np.random.default_rng(3)
    # Theory weights: lr scaled to the horizon (lr·delay·T ≲ 1), see the class docstring.
    for alg in (OrderedMu2SGD(), OrderedMu2SGD(lr=0.001, weights="theory")):
        rp = Replay(alg, [1.0, -2.0, 0.5], workers=("A", "B", "C"))
        for _ in range(300):
            rp.noise[max(rp.outstanding)] = 0.01 * rng.standard_normal(3)
            rp.deliver(min(rp.outstanding))  # oldest job first: every worker stays in play
        assert np.linalg.norm(rp.state.x) < 0.1


# ---------------------------------------------------------------------------------------------
# A10 Ringmaster LMO and Delay-adaptive Muon


SIGN_NOISE = {0: (0.0, 0.0), 2: (0.2, 0.1), 3: (-0.9, 0.8)}


#: The momenta of the sign example (docs/ALGORITHMS.md §11.3) after arrivals 1, 2 and 4, by start:
#: "first" is the specification's table (α_0 = 1: m_1 = g_1); "zero" starts from m_0 = 0 with α = 0.5
#: from the first reply: m_1 = 0.5·(1, −0.5), m_2 = 0.5·(1.1, −0.3) + 0.5·m_1 = (0.8, −0.275),
#: m_4 = 0.5·(−0.1, 0.5) + 0.5·m_2 = (0.35, 0.1125). The signs agree, so the iterates are the same.
SIGN_MOMENTA = {"first": ([1.0, -0.5], [1.05, -0.4], [0.475, 0.05]),
                "zero": ([0.5, -0.25], [0.8, -0.275], [0.35, 0.1125])}


@pytest.mark.parametrize("start", ["first", "zero"])
@pytest.mark.parametrize("stops", [False, True])
def test_lmo_sign_example(stops, start):
    alg = RingmasterLMO(lmo="sign", schedule="fixed", lr=0.1, alpha=0.5, R=2, nesterov=False, stops=stops,
                        momentum_start=start)
    m1, m2, m4 = SIGN_MOMENTA[start]
    rp = Replay(alg, [1.0, -0.5], noise=SIGN_NOISE)
    ev1, ev2, ev3, ev4 = rp.run([0, 2, 1, 3])
    np.testing.assert_allclose(ev1.grads[0], [1.0, -0.5], rtol=RTOL)
    np.testing.assert_allclose(ev1.state["m"], m1, rtol=RTOL)
    np.testing.assert_allclose(ev1.x, [0.9, -0.4], rtol=RTOL)
    np.testing.assert_allclose(ev2.grads[0], [1.1, -0.3], rtol=RTOL)
    np.testing.assert_allclose(ev2.state["m"], m2, rtol=RTOL)
    np.testing.assert_allclose(ev2.x, [0.8, -0.3], rtol=RTOL)
    if stops:
        assert ev2.cancelled == [1] and ev3 is None  # J1 reached age 2 = R at version 2
    else:
        assert ev3.outcome.dropped == (1,) and ev3.version_before == 2
        np.testing.assert_allclose(ev3.x, [0.8, -0.3], rtol=RTOL)
    job_b = rp.job_of("B")
    assert job_b.created_at == 2  # B restarts at x_2
    np.testing.assert_allclose(job_b.points[0], [0.8, -0.3], rtol=RTOL)
    assert ev4.job.created_at == 2 and ev4.outcome.ages == (0,)
    np.testing.assert_allclose(ev4.grads[0], [-0.1, 0.5], rtol=RTOL)
    np.testing.assert_allclose(ev4.state["m"], m4, rtol=RTOL)
    np.testing.assert_allclose(ev4.x, [0.7, -0.4], rtol=RTOL)


@pytest.mark.parametrize("start", ["first", "zero"])
def test_lmo_l2_and_nesterov_step(start):
    alg = RingmasterLMO(lmo="l2", lr=0.1, alpha=0.5, R=5, nesterov=True, momentum_start=start)
    rp = Replay(alg, [3.0, 4.0], noise={})
    ev1, ev2 = rp.run([0, 2])
    # "first" (α_0 = 1): m_1 = u = g; "zero": m_1 = 0.5 g, u = 0.75 g; the same direction g/‖g‖.
    np.testing.assert_allclose(ev1.x, [3.0 - 0.06, 4.0 - 0.08], rtol=RTOL)
    m1 = np.array([3.0, 4.0]) * (1.0 if start == "first" else 0.5)
    np.testing.assert_allclose(ev1.state["m"], m1, rtol=RTOL)
    g = np.array([2.94, 3.92])
    m = 0.5 * g + 0.5 * m1
    u = 0.5 * m + 0.5 * g
    np.testing.assert_allclose(ev2.state["m"], m, rtol=RTOL)
    np.testing.assert_allclose(ev2.x, ev1.x - 0.1 * u / np.linalg.norm(u), rtol=RTOL)


@pytest.mark.parametrize("start, m1_factor", [("first", 1.0), ("zero", 0.5)])
def test_lmo_muon_uses_layout_blocks(start, m1_factor):
    layout = (("w", (2, 3)), ("b", (3,)))
    alg = RingmasterLMO(lmo="muon", lr=0.1, alpha=0.5, R=4, nesterov=False, ns="classic",
                        momentum_start=start).bind(layout)
    assert alg.layout == layout and RingmasterLMO().layout == ()
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal(9)
    rp = Replay(alg, x0, workers=("A",))
    (ev,) = rp.run([0])
    # g = x0; m_1 = g ("first") or α g = 0.5 g ("zero"), and the box form steps on m_1.
    m1 = m1_factor * x0
    np.testing.assert_allclose(ev.x, x0 - 0.1 * muon_direction(m1, layout, coefficients=NS_TABLES["classic"]),
                               rtol=1e-12)
    # The bias block moves by the plain direction: x − η m_1 = 0.9 x ("first") or 0.95 x ("zero").
    np.testing.assert_allclose(ev.x[6:], (1 - 0.1 * m1_factor) * x0[6:], rtol=1e-12)
    with pytest.raises(ValueError):
        RingmasterLMO().bind((("w", (2, 2)),)).init(np.zeros(3), seed=0)
    with pytest.raises(ValueError):
        RingmasterLMO().bind([("w", [2, 2])])


def test_bind_layout_hands_the_mask_through_wrappers_and_spares_an_old_bind():
    from algorithms import build
    from algorithms.base import bind_layout
    from algorithms.wrappers import unwrap

    layout, mask = (("w", (2, 3)), ("b", (3,))), (False, False)
    wrapped = bind_layout(build("rennala-muon", {"lr": 0.2, "warmup": 2, "clip_norm": 1.0}), layout, mask)
    assert unwrap(wrapped).layout == layout and unwrap(wrapped).lmo_mask == mask
    assert bind_layout(RingmasterLMO(), layout).lmo_mask is None  # no mask: every matrix gets NS
    with pytest.raises(ValueError, match="lmo_mask"):
        RingmasterLMO().bind(layout, (True,))

    class OldBind(VanillaASGD):  # written before the mask existed: bind(layout) only
        def bind(self, layout):
            return self

    old = OldBind(lr=0.1)
    assert bind_layout(old, layout, mask) is old


def test_lmo_coupled_schedule_sets_r_to_floor_one_over_alpha():
    """Issue 15 item 5: the theorem's coupling R_k = ⌊1/α_k⌋ for a fixed α (R is ignored)."""
    alg = RingmasterLMO(lr=0.3, alpha=0.25, R=7, schedule="coupled")
    assert alg.schedule_at(0) == (0.25, 4, 0.3)  # the public code's start: α from the first step
    assert alg.schedule_at(5) == (0.25, 4, 0.3)
    first = RingmasterLMO(lr=0.3, alpha=0.25, R=7, schedule="coupled", momentum_start="first")
    assert first.schedule_at(0) == (1.0, 1, 0.3)  # the theorem's α_0 = 1, so R_0 = 1
    assert first.schedule_at(5) == (0.25, 4, 0.3)
    assert RingmasterLMO(alpha=0.05, schedule="coupled").schedule_at(3)[1] == 20
    # with stops, a job is cancelled once its age reaches ⌊1/α⌋ = 2
    rp = Replay(RingmasterLMO(lmo="sign", lr=0.1, alpha=0.5, R=100, schedule="coupled"), 1.0)
    ev = rp.run([0, 2])
    assert ev[0].cancelled == [] and ev[1].cancelled == [1], "job 1 (B, created at 0) reached age 2 at version 2"


def test_lmo_box_form_steps_on_the_momentum():
    """Issue 15 item 5: nesterov=False is the paper's algorithm box, x_{k+1} = x_k + η lmo(m_{k+1});
    the default (Nesterov blend u = (1−α) m_{k+1} + α g) is the public code's form."""
    assert RingmasterLMO().nesterov is True
    alg = RingmasterLMO(lmo="l2", lr=0.1, alpha=0.5, R=5, nesterov=False)
    rp = Replay(alg, [3.0, 4.0], noise={})
    ev1, ev2 = rp.run([0, 2])
    g = np.array([2.94, 3.92])
    m = 0.5 * g + 0.5 * np.array([3.0, 4.0])
    np.testing.assert_allclose(ev2.x, ev1.x - 0.1 * m / np.linalg.norm(m), rtol=RTOL)


def test_lmo_agnostic_schedule_drives_steps_and_threshold():
    alg = RingmasterLMO(lmo="sign", schedule="agnostic", lr=1.0, nesterov=False, stops=False)
    for k in (0, 1, 4, 9):
        a, r, f = pa_schedule(k)
        assert alg.schedule_at(k) == (a, r, f)
    # One worker: every reply is fresh; x moves by η/(k+1)^{3/4} per step (sign of a positive g).
    rp = Replay(alg, [100.0], workers=("A",))
    rp.run(range(6))
    steps = -np.diff([100.0] + xs(rp))
    np.testing.assert_allclose(steps, [(k + 1) ** -0.75 for k in range(6)], rtol=RTOL)
    # m_{k+1} = α_k g + (1 − α_k) m_k with α_0 = 1, α_1 = 1, α_2 = 1/√2.
    gs = [ev.grads[0][0] for ev in rp.events]
    m = gs[0]
    for k in (1, 2):
        a = pa_schedule(k)[0]
        m = a * gs[k] + (1 - a) * m
        assert rp.events[k].state["m"][0] == pytest.approx(m, rel=RTOL)


def test_lmo_fixed_schedule_start():
    """Issue 31: by default α from the first step (the public code's EMA from m_0 = 0);
    momentum_start="first" is the theorems' α_0 = 1. The agnostic schedule has α_0 = 1 under both."""
    alg = RingmasterLMO(lr=0.3, alpha=0.25, R=7)
    assert alg.momentum_start == "zero"
    assert alg.schedule_at(0) == (0.25, 7, 0.3)
    assert alg.schedule_at(5) == (0.25, 7, 0.3)
    first = RingmasterLMO(lr=0.3, alpha=0.25, R=7, momentum_start="first")
    assert first.schedule_at(0) == (1.0, 7, 0.3)
    assert first.schedule_at(5) == (0.25, 7, 0.3)
    for k in (0, 1, 2, 9):
        assert (RingmasterLMO(schedule="agnostic", lr=1.0).schedule_at(k)
                == RingmasterLMO(schedule="agnostic", lr=1.0, momentum_start="first").schedule_at(k)
                == pa_schedule(k))
    with pytest.raises(ValueError, match="momentum_start"):
        RingmasterLMO(momentum_start="one")
    with pytest.raises(ValueError, match="momentum_start"):
        DelayAdaptiveMuon(momentum_start="one")


def test_delay_adaptive_muon_step_size():
    # d = 1 and α = 1: every step is lr·n/max(n, δ) times sign(g).
    rp = replay_t1(DelayAdaptiveMuon(lr=0.5, n_workers=2, alpha=1.0))
    np.testing.assert_allclose(xs(rp), [0.5, 0.0, -0.5, -0.5 - 1 / 3], rtol=RTOL)
    assert rp.events[-1].outcome.ages == (3,) and rp.events[-1].outcome.dropped == ()


@pytest.mark.parametrize("start, u_factor", [("first", 1.0), ("zero", 0.75)])
def test_delay_adaptive_muon_layout(start, u_factor):
    layout = (("w", (2, 2)),)
    alg = DelayAdaptiveMuon(lr=0.1, alpha=0.5, nesterov=True, momentum_start=start).bind(layout)
    x0 = np.array([1.0, 2.0, 3.0, 4.0])
    rp = Replay(alg, x0, workers=("A",))
    (ev,) = rp.run([0])
    # u = g ("first": α_0 = 1), or u = 0.5·m_1 + 0.5·g with m_1 = 0.5 g, i.e. 0.75 g ("zero").
    np.testing.assert_allclose(ev.x, x0 - 0.1 * muon_direction(u_factor * x0, layout), rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# Properties (hypothesis): random arrival orders


def _ringmaster_algs(R: int, stops: bool) -> list[Algorithm]:
    return [RingmasterASGD(lr=0.1, R=R, stops=stops),
            RingmasterLMO(lmo="sign", lr=0.1, R=R, stops=stops),
            RingmasterLMO(lmo="l2", schedule="agnostic", lr=0.1, stops=stops)]


def _threshold(alg: Algorithm, version: int) -> int:
    return alg.schedule_at(version)[1] if isinstance(alg, RingmasterLMO) else alg.R


arrival_orders = st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 5), R=st.integers(1, 4), stops=st.booleans(), picks=arrival_orders)
def test_ringmaster_never_applies_delay_R(n, R, stops, picks):
    workers = tuple(f"w{i}" for i in range(n))
    for alg in _ringmaster_algs(R, stops):
        rp = Replay(alg, [1.0, -1.0], workers=workers)
        for p in picks:
            ids = sorted(rp.outstanding)
            ev = rp.deliver(ids[p % len(ids)])
            age = ev.version_before - ev.job.created_at
            if age < _threshold(alg, ev.version_before):
                assert ev.outcome.applied == (ev.job.job_id,) and ev.outcome.ages == (age,)
            else:
                assert not stops, "with stops a reply of age >= R must never arrive"
                assert ev.outcome.dropped == (ev.job.job_id,) and ev.outcome.applied == ()
            assert all(a < _threshold(alg, ev.version_before) for a in ev.outcome.ages)
        assert len(rp.outstanding) == n  # every worker busy again after each event


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 5), R=st.integers(1, 4), picks=arrival_orders)
def test_ringmaster_cancels_job_at_delay_R(n, R, picks):
    workers = tuple(f"w{i}" for i in range(n))
    for alg in _ringmaster_algs(R, True):
        rp = Replay(alg, [1.0, -1.0], workers=workers)
        for p in picks:
            ids = sorted(rp.outstanding)
            before = {j.job_id: j for j in rp.outstanding.values()}
            ev = rp.deliver(ids[p % len(ids)])
            k = rp.state.version
            threshold = _threshold(alg, k)
            # Exactly the jobs that reached age R_k with this update, and they reached it just now.
            expected = sorted(j for j, job in before.items() if j != ev.job.job_id and k - job.created_at >= threshold)
            assert sorted(ev.cancelled) == expected
            for j in expected:
                assert k - before[j].created_at == threshold
            # Everything still running is younger than the threshold; restarted workers start at x_k.
            assert all(k - job.created_at < threshold for job in rp.outstanding.values())
            for j in expected:
                assert rp.job_of(before[j].worker_id).created_at == k


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 4), beta=st.sampled_from([0.1, 0.5, 0.9, 1.0]), picks=arrival_orders,
       seed=st.integers(0, 2**16))
def test_ordered_momentum_invariant(n, beta, picks, seed):
    rng = np.random.default_rng(seed)
    alg = OrderedMomentum(lr=0.1, beta=beta)
    rp = Replay(alg, [0.5, -0.25], workers=tuple(f"w{i}" for i in range(n)))
    applied = []  # (created_at s, g_s)
    for p in picks:
        ids = sorted(rp.outstanding)
        jid = ids[p % len(ids)]
        rp.noise[jid] = rng.standard_normal(2)
        ev = rp.deliver(jid)
        applied.append((ev.job.created_at, ev.grads[0]))
        k = rp.state.version
        closed = sum(beta * (1 - beta) ** (k - 1 - s) * g for s, g in applied)
        np.testing.assert_allclose(rp.state.m, closed, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Contracts for every algorithm of this module family


NEW = [NaiveMomentumASGD, DelayAdaptiveASGD, DelayFilteredASGD, RingmasterASGD, OrderedMu2SGD,
       RingmasterLMO, DelayAdaptiveMuon]

BAD_HYPERS = {
    NaiveMomentumASGD: [{"lr": 0.0}, {"lr": -1.0}, {"lr": float("nan")}, {"beta": 0.0}, {"beta": 1.5},
                        {"beta": "0.5"}],
    DelayAdaptiveASGD: [{"lr": 0.0}, {"n_workers": 0}, {"n_workers": 1.5}, {"rule": "mishchenko"},
                        {"smoothness": 0.0}],
    DelayFilteredASGD: [{"lr": -0.1}, {"tau_max": -1}, {"tau_max": 1.5}, {"tau_max": True}],
    RingmasterASGD: [{"lr": 0.0}, {"R": 0}, {"R": 2.5}, {"stops": "yes"}, {"stops": 1}],
    OrderedMu2SGD: [{"lr": 0.0}, {"weights": "adaptive"}, {"beta": 0.0}, {"beta": 1.1}, {"gamma_x": 0.0},
                    {"gamma_x": 2.0}],
    RingmasterLMO: [{"lr": 0.0}, {"alpha": 0.0}, {"alpha": 1.5}, {"R": 0}, {"lmo": "nuclear"},
                    {"schedule": "cosine"}, {"ns": "polar"}, {"ns_steps": 0}, {"nesterov": "true"},
                    {"stops": None}, {"ns_dtype": "float16"}, {"ns_dtype": None}],
    DelayAdaptiveMuon: [{"lr": -1.0}, {"n_workers": 0}, {"alpha": 0.0}, {"ns": "exact"}, {"ns_steps": 0},
                        {"nesterov": 0}, {"ns_dtype": "bf16"}],
}


@pytest.mark.parametrize("cls", NEW, ids=lambda c: c.name)
def test_bad_hyper_parameters_raise(cls):
    cls()  # defaults are valid
    for kwargs in BAD_HYPERS[cls]:
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            cls(**kwargs)


def test_registry_has_every_new_algorithm():
    for cls in NEW:
        assert ALGORITHMS[cls.name] is cls
    assert build("ringmaster", {"R": "3", "stops": "false"}) == RingmasterASGD(R=3, stops=False)
    assert build("ringmaster-lmo", {"lmo": "sign", "schedule": "agnostic"}).schedule == "agnostic"
    with pytest.raises(ValueError, match="layout"):
        build("ringmaster-lmo", {"layout": "w"})  # set by the driver via bind, never from the CLI


def test_bind_default_returns_self():
    alg = RingmasterASGD()
    assert alg.bind((("w", (2, 2)),)) is alg


ROUND_TRIP = [
    NaiveMomentumASGD(lr=0.1, beta=0.3),
    DelayAdaptiveASGD(lr=0.1, n_workers=2),
    DelayAdaptiveASGD(lr=0.1, n_workers=2, rule="koloskova"),
    DelayFilteredASGD(lr=0.1, tau_max=1),
    RingmasterASGD(lr=0.1, R=2, stops=True),
    RingmasterASGD(lr=0.1, R=2, stops=False),
    OrderedMu2SGD(lr=0.1),
    OrderedMu2SGD(lr=0.05, weights="theory"),
    RingmasterLMO(lr=0.05, R=2).bind((("w", (2, 3)), ("b", (2,)))),
    RingmasterLMO(lmo="sign", schedule="agnostic", lr=0.05, stops=False).bind((("w", (2, 3)), ("b", (2,)))),
    DelayAdaptiveMuon(lr=0.05, n_workers=3).bind((("w", (2, 3)), ("b", (2,)))),
]


@pytest.mark.parametrize("alg", ROUND_TRIP, ids=lambda a: a.name)
def test_state_dict_round_trip_continues_bit_identically(alg):
    rng = np.random.default_rng(7)
    x0 = rng.standard_normal(8)
    picks = rng.integers(0, 10**6, size=30)
    noise = {j: 0.1 * rng.standard_normal(8) for j in range(200)}
    rp = Replay(alg, x0, workers=("A", "B", "C"), noise=noise)
    for p in picks[:15]:
        rp.deliver(sorted(rp.outstanding)[p % len(rp.outstanding)])
    d = alg.to_state_dict(rp.state)
    # A twin driver with the loaded state and the same ledger.
    twin = Replay.__new__(Replay)
    twin.__dict__.update({k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                          for k, v in rp.__dict__.items()})
    twin.state = alg.from_state_dict(d)
    assert state_arrays_equal(alg.to_state_dict(twin.state), d)
    for p in picks[15:]:
        ids = sorted(rp.outstanding)
        assert ids == sorted(twin.outstanding)
        a = rp.deliver(ids[p % len(ids)])
        b = twin.deliver(ids[p % len(ids)])
        assert state_arrays_equal(a.state, b.state)
        assert a.outcome == b.outcome and a.cancelled == b.cancelled
    assert rp.state.version > 15 // 2


@pytest.mark.parametrize("alg", ROUND_TRIP[:1] + ROUND_TRIP[6:7] + ROUND_TRIP[8:9], ids=lambda a: a.name)
def test_from_state_dict_validates(alg):
    state, _ = alg.init(np.zeros(8), seed=0)
    d = alg.to_state_dict(state)
    bad = dict(d)
    bad["x"] = np.zeros(7)
    with pytest.raises(ValueError):
        alg.from_state_dict(bad)
    with pytest.raises(ValueError):
        alg.from_state_dict({k: v for k, v in d.items() if k != "x"})


def test_loaded_iterates_are_read_only():
    alg = OrderedMu2SGD()
    state, _ = alg.init(np.ones(3), seed=0)
    state = alg.from_state_dict(alg.to_state_dict(state))
    assert not state.x.flags.writeable and not state.x_prev.flags.writeable


def test_every_new_algorithm_makes_progress_on_toy_quadratic():
    rng = np.random.default_rng(11)
    for cls in NEW:
        alg = cls()
        if isinstance(alg, (DelayAdaptiveASGD, DelayAdaptiveMuon)):
            alg = dataclasses.replace(alg, n_workers=3)
        rp = Replay(alg, np.full(4, 1.0), workers=("A", "B", "C"))
        for i in range(400):
            rp.noise[max(rp.outstanding)] = 0.01 * rng.standard_normal(4)
            rp.deliver(sorted(rp.outstanding)[i % 3 if i % 5 else 0])
        assert np.linalg.norm(rp.state.x) < 0.5 * math.sqrt(4), cls.name
