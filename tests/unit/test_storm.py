"""A11 (storm-vr) and A12 (snapshot-vr): docs/ALGORITHMS.md §7 rules, §11.6 worked examples.

The tests call the algorithm the way the round driver does (``Driver.round``: apply, cancel,
make_job for one free worker) with hand-made results. Toy oracle of §1: f(x) = x²/2,
∇f(x; ξ) = x + ξ at the job's points. Finite sum of A12: f_1 = x²/2, f_2 = 1.5 (x − 2)².
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms import ALGORITHMS, build, hyper_parameters
from algorithms.base import JobSpec, Result, state_arrays_equal
from algorithms.storm import DelayedStormVR, SnapshotVR
from protocol.messages import JobKind

RTOL = 1e-9  # terminating decimals of the spec tables


@dataclass(frozen=True)
class Outstanding:
    """What the driver passes to cancel(): no shard attribute on purpose (the strict interface)."""

    job_id: int
    created_at: int
    kind: JobKind
    iterate_ids: tuple[int, ...]
    worker_id: str


class Driver:
    """The demand-driven round driver, reduced to what the algorithm sees."""

    def __init__(self, alg, x0) -> None:
        self.alg = alg
        x0 = np.asarray(x0)
        self.state, init_jobs = alg.init(x0 if x0.dtype.kind == "f" else x0.astype(np.float64), seed=0)
        assert init_jobs == []
        self.next_id = 1
        self.specs: dict[int, JobSpec] = {}  # every job ever issued
        self.outstanding: dict[int, str] = {}  # job id -> worker
        self.cancelled: list[int] = []

    def round(self, results=(), worker: str = "w0", issue: bool = True):
        results = list(results)
        self.state, out = self.alg.apply(self.state, results)
        for r in results:
            self.outstanding.pop(r.job_id, None)
        jobs = [Outstanding(j, self.specs[j].created_at, self.specs[j].kind, self.specs[j].iterate_ids, w)
                for j, w in self.outstanding.items()]
        for j in self.alg.cancel(self.state, jobs):
            del self.outstanding[j]
            self.cancelled.append(j)
        jid = None
        if issue:
            self.state, spec = self.alg.make_job(self.state, worker)
            if spec is not None:
                jid = self.next_id
                self.next_id += 1
                self.specs[jid] = spec
                self.outstanding[jid] = worker
                for p in spec.points:
                    assert not p.flags.writeable
        return out, jid

    def lost(self, job_ids) -> None:
        self.state = self.alg.on_lost(self.state, list(job_ids))
        for j in job_ids:
            del self.outstanding[j]

    def result(self, jid: int, grads, count: int = 0) -> Result:
        s = self.specs[jid]
        return Result(job_id=jid, worker_id=self.outstanding.get(jid, "w0"), created_at=s.created_at, kind=s.kind,
                      iterate_ids=s.iterate_ids, grads=tuple(np.asarray(g) for g in grads),
                      count=count, shard=s.shard)

    def toy(self, jid: int, xi) -> Result:
        """Toy oracle ∇f(x; ξ) = x + ξ at each point of the job, same ξ."""
        return self.result(jid, [p + xi for p in self.specs[jid].points])


# ---------------------------------------------------------------- A11


def test_storm_vr_registered_with_hyper_parameters():
    assert ALGORITHMS["storm-vr"] is DelayedStormVR
    assert ALGORITHMS["snapshot-vr"] is SnapshotVR
    assert list(hyper_parameters(DelayedStormVR)) == ["lr", "a", "B_init", "tau_lost", "M_max", "on_excess"]
    assert list(hyper_parameters(SnapshotVR)) == ["lr", "a", "m", "D", "background", "on_deadline", "num_samples",
                                                  "shards", "batch"]
    alg = build("snapshot-vr", {"num_samples": "10", "on_deadline": "abandon", "background": "true"})
    assert alg.num_samples == 10 and alg.on_deadline == "abandon" and alg.mode == "round"
    assert build("storm-vr", {"on_excess": "block", "M_max": "2.5"}).M_max == 2.5


@pytest.mark.parametrize("lost_via", ["tau_lost", "written_off"])
def test_storm_vr_rounds_with_loss(lost_via):
    """§7 A11 table: a = 0.5, η = 0.5, x0 = 1, v_0 = 1; job 3 is lost."""
    alg = DelayedStormVR(lr=0.5, a=0.5, B_init=1, tau_lost=1 if lost_via == "tau_lost" else 100)
    d = Driver(alg, [1.0])
    out, j0 = d.round()  # the blocking initialization job
    init = d.specs[j0]
    assert (init.kind, init.iterate_ids, init.batch_size) == (JobKind.GRAD, (0,), 1)
    assert not out.updated and d.state.version == 0
    out, none = d.round(worker="w1")  # a second worker idles while v_0 is computed
    assert none is None and not out.updated and out.metrics["blocked"] == 1.0

    out, jid = d.round([d.toy(j0, 0.0)])  # round 0: v_0 = ∇f(1; 0) = 1, x_1 = 0.5
    assert out.updated and out.applied == (j0,)
    np.testing.assert_allclose(d.state.v, [1.0], rtol=RTOL)
    np.testing.assert_allclose(d.state.x, [0.5], rtol=RTOL)
    jobs = {1: jid}
    xi = {1: 0.1, 2: -0.2, 3: 0.3, 4: -0.1, 5: 0.0}
    table = [  # round k, replies received since round k-1, ages, v_k, x_{k+1}, M_k
        (1, [], (), 0.5, 0.25, 1.0),
        (2, [1, 2], (1, 0), 0.175, 0.1625, 0.0),
        (3, [], (), 0.0875, 0.11875, 1.0),
        (4, [4], (0,), 0.03125, 0.103125, 0.5),
        (5, [5], (0,), 0.059375, 0.0734375, 0.25),
    ]
    for k, arrivals, ages, v, x_next, mass in table:
        spec = d.specs[jobs[k]]
        assert (spec.kind, spec.created_at, spec.iterate_ids) == (JobKind.GRAD_PAIR, k, (k, k - 1))
        if lost_via == "written_off" and k == 4:
            d.lost([jobs[3]])  # the driver writes job 3 off (worker declared dead)
        out, jobs[k + 1] = d.round([d.toy(jobs[s], xi[s]) for s in arrivals])
        assert out.updated and d.state.version == k + 1
        assert out.applied == tuple(jobs[s] for s in arrivals) and out.ages == ages
        np.testing.assert_allclose(d.state.v, [v], rtol=RTOL)
        np.testing.assert_allclose(d.state.x, [x_next], rtol=RTOL)
        np.testing.assert_allclose(out.metrics["missing_mass"], mass, rtol=RTOL)
        np.testing.assert_allclose(d.alg.metrics(d.state)["missing_mass"], mass, rtol=RTOL)
        if lost_via == "tau_lost":  # age > τ_lost = 1: cancelled right after round 4 (version 5)
            assert (jobs.get(3) in d.cancelled) == (k >= 4)
            assert out.metrics["lost_total"] == (1.0 if k >= 4 else 0.0)
    m = d.alg.metrics(d.state)
    assert m["lost_total"] == 1.0 and m["written_off_total"] == (1.0 if lost_via == "written_off" else 0.0)
    assert m["applied_total"] == 5.0 and m["dropped_total"] == 0.0
    # Job 6 is on (x_6, x_5); job 3's iterates are released.
    assert d.alg.live_iterate_ids(d.state) == {5, 6}
    np.testing.assert_allclose(d.specs[jobs[6]].points[0], [0.0734375], rtol=RTOL)


def test_storm_vr_late_reply_to_lost_job_is_dropped():
    alg = DelayedStormVR(lr=0.5, a=0.5, B_init=1, tau_lost=0)
    d = Driver(alg, [1.0])
    _, j0 = d.round()
    _, j1 = d.round([d.toy(j0, 0.0)])  # round 0; job 1 could enter round 1 with age 0
    assert d.cancelled == []
    _, j2 = d.round()  # round 1 without it: now it could only enter round 2 with age 1 > τ_lost = 0
    assert d.cancelled == [j1] and d.alg.metrics(d.state)["lost_total"] == 1.0
    out, _ = d.round([d.toy(j1, 0.0), d.toy(j2, 0.0)])  # a late reply still reaching apply is dropped
    assert out.dropped == (j1,) and out.applied == (j2,) and j2 not in d.cancelled


def test_storm_vr_init_job_written_off_is_reissued():
    d = Driver(DelayedStormVR(lr=0.5, a=0.5, B_init=4), [1.0])
    _, j0 = d.round()
    d.lost([j0])  # the worker died before cancel() ever saw the job: matched to the oldest unplaced job
    out, j0b = d.round(worker="w1")
    assert j0b is not None and d.specs[j0b].kind == JobKind.GRAD and d.specs[j0b].batch_size == 4
    assert out.metrics["written_off_total"] == 1.0
    out, j1 = d.round([d.toy(j0b, 0.0)])
    assert out.updated and d.specs[j1].kind == JobKind.GRAD_PAIR
    np.testing.assert_allclose(d.state.x, [0.5], rtol=RTOL)


@pytest.mark.parametrize("told", [True, False])
def test_storm_vr_write_off_of_one_of_two_queued_jobs(told):
    """Clock rounds (issue 15 item 1): jobs 1 and 2 were made in two rounds with no cancel() in
    between and handed out later (ids 11, 12); job 2's worker dies. Told the ids at hand-out
    (``on_issued``, as the core does), the algorithm writes off job 2; a driver that does not tell
    gets the old guess, the oldest job made since (job 1), which is wrong here."""
    alg = DelayedStormVR(lr=0.5, a=0.5, B_init=1, tau_lost=100)
    state, _ = alg.init(np.array([1.0]), seed=0)
    state, init = alg.make_job(state, "")
    state = alg.on_issued(state, 10, init)
    r0 = Result(job_id=10, worker_id="w0", created_at=0, kind=init.kind, iterate_ids=init.iterate_ids,
                grads=(np.array([1.0]),))
    state, _ = alg.apply(state, [r0])  # round 0
    state, job1 = alg.make_job(state, "")
    state, _ = alg.apply(state, [])  # round 1 with no reply (a clock round)
    state, job2 = alg.make_job(state, "")
    assert (job1.created_at, job2.created_at) == (1, 2)
    if told:
        state = alg.on_issued(state, 11, job1)
        state = alg.on_issued(state, 12, job2)
    state = alg.on_lost(state, [12])
    assert (state.pending, state.gone) == (([1], [2]) if told else ([2], [1]))


def _closed_form(alg, d, v0, issued, xi, k):
    """v_k = (1−a)^k v_0 + Σ_{s≤k} (1−a)^{k−s} q_s, q_s from the job's own points."""
    c = 1.0 - alg.a
    v = c ** k * v0
    for s in range(1, k + 1):
        p_new, p_old = d.specs[issued[s]].points
        v = v + c ** (k - s) * ((p_new + xi[s]) - c * (p_old + xi[s]))
    return v


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_storm_vr_order_invariance(data):
    """Once every job s ≤ k has been received, v_k equals the closed form, whatever the order
    (also across rounds held by on_excess="block")."""
    a = data.draw(st.sampled_from([0.1, 0.3, 0.5, 0.9, 1.0]), label="a")
    n_jobs = data.draw(st.integers(1, 8), label="K")
    block = data.draw(st.booleans(), label="block")
    m_max = data.draw(st.floats(0.5, 3.0), label="M_max")
    alg = DelayedStormVR(lr=0.3, a=a, B_init=1, tau_lost=1000, M_max=m_max, on_excess="block" if block else "warn")
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    d = Driver(alg, rng.normal(size=3))
    _, j0 = d.round()
    xi0 = rng.normal(size=3)
    v0 = d.specs[j0].points[0] + xi0
    _, j1 = d.round([d.toy(j0, xi0)])
    issued, xi, received = {1: j1}, {1: rng.normal(size=3)}, set()
    in_flight, stuck = [j1], False

    def check(out):
        k = d.state.version - 1
        if out.updated and all(s in received for s in range(1, k + 1)):
            np.testing.assert_allclose(d.state.v, _closed_form(alg, d, v0, issued, xi, k), rtol=1e-12, atol=1e-12)
            assert out.metrics["missing_mass"] == 0.0

    while len(issued) < n_jobs:
        order = data.draw(st.permutations(in_flight), label="order")
        deliver = order[:data.draw(st.integers(1 if stuck else 0, len(order)), label="n")]
        out, jid = d.round([d.toy(j, xi[d.specs[j].created_at]) for j in deliver])
        received.update(d.specs[j].created_at for j in deliver)
        in_flight = [j for j in in_flight if j not in deliver]
        check(out)
        stuck = jid is None
        if jid is not None:
            s = d.specs[jid].created_at
            issued[s], xi[s] = jid, rng.normal(size=3)
            in_flight.append(jid)
    # Everything still in flight arrives before round K (in any order): v_K is complete.
    order = data.draw(st.permutations(in_flight), label="final")
    out, _ = d.round([d.toy(j, xi[d.specs[j].created_at]) for j in order], issue=False)
    received.update(d.specs[j].created_at for j in order)
    assert out.updated and d.state.version == n_jobs + 1
    check(out)


def test_storm_vr_on_excess_block_resumes_and_cannot_deadlock():
    alg = DelayedStormVR(lr=0.5, a=0.5, B_init=1, M_max=1.2, on_excess="block")
    d = Driver(alg, [1.0])
    _, j0 = d.round()
    _, j1 = d.round([d.toy(j0, 0.0)])
    out, j2 = d.round(worker="w1")  # round 1: M_1 = 1 <= 1.2
    assert j2 is not None
    out, none = d.round(worker="w2")  # round 2: M_2 = 0.5 + 1 > 1.2: job 3 withheld
    np.testing.assert_allclose(out.metrics["missing_mass"], 1.5, rtol=RTOL)
    assert none is None and out.metrics["excess"] == 1.0 and out.metrics["blocked"] == 1.0
    x3, v2 = d.state.x.copy(), d.state.v.copy()
    out, none = d.round(worker="w2")  # no reply: nothing moves
    assert none is None and not out.updated and d.state.version == 3
    out, j3 = d.round([d.toy(j2, 0.2)], worker="w1")  # job 2 arrives: M_2 = 0.5 <= 1.2, resume
    assert not out.updated and out.applied == (j2,) and out.ages == (1,)  # enters round 3 with age 3 - 2
    np.testing.assert_allclose(out.metrics["missing_mass"], 0.5, rtol=RTOL)
    assert j3 is not None and d.specs[j3].created_at == 3
    np.testing.assert_array_equal(d.specs[j3].points[0], x3)
    np.testing.assert_array_equal(d.state.v, v2)
    out, none = d.round(worker="w2")  # round 3: v_3 = (1-a) v_2 + (1-a) q_2; M_3 = 0.25 + 1 > 1.2
    p_new, p_old = d.specs[j2].points
    np.testing.assert_allclose(d.state.v, 0.5 * v2 + 0.5 * ((p_new + 0.2) - 0.5 * (p_old + 0.2)), rtol=RTOL)
    np.testing.assert_allclose(out.metrics["missing_mass"], 1.25, rtol=RTOL)
    assert none is None
    d.lost([j1, j3])  # every job in flight is lost: waiting cannot lower M_3 any more
    out, j4 = d.round(worker="w1")
    assert j4 is not None and d.specs[j4].created_at == 4  # issued anyway, counted as forced
    assert d.alg.metrics(d.state)["forced_rounds"] == 1.0 and out.metrics["lost_total"] == 2.0
    np.testing.assert_allclose(out.metrics["missing_mass"], 1.25, rtol=RTOL)  # lost jobs keep their weight
    out, _ = d.round(worker="w2")  # round 4: the lost mass decays again
    assert out.updated
    np.testing.assert_allclose(out.metrics["missing_mass"], 0.125 + 0.5 + 1.0, rtol=RTOL)


def test_storm_vr_on_excess_warn_only_counts():
    d = Driver(DelayedStormVR(lr=0.5, a=0.5, B_init=1, M_max=1.2, on_excess="warn"), [1.0])
    _, j0 = d.round()
    d.round([d.toy(j0, 0.0)])
    for _ in range(3):
        out, jid = d.round()
        assert jid is not None and out.updated
    assert out.metrics["excess_rounds"] == 2.0 and out.metrics["blocked"] == 0.0


# ---------------------------------------------------------------- A12


def comp_grad(i: int, x):
    """∇f_i for f_1 = x²/2, f_2 = 1.5 (x − 2)²."""
    x = np.asarray(x, dtype=np.float64)
    return x if i == 1 else 3.0 * (x - 2.0)


def pair(d: Driver, jid: int, i: int) -> Result:
    return d.result(jid, [comp_grad(i, p) for p in d.specs[jid].points])


def full(d: Driver, jid: int) -> Result:
    spec = d.specs[jid]
    lo, hi = spec.shard
    return d.result(jid, [sum(comp_grad(i + 1, spec.points[0]) for i in range(lo, hi))], count=hi - lo)


def _snapshot_start(alg):
    """Rounds 0 and 1 of the §7 A12 example; returns the driver, the FULL_GRAD job of anchor 2, job 2."""
    d = Driver(alg, [0.0])
    _, jg = d.round()
    g0 = d.specs[jg]
    assert (g0.kind, g0.iterate_ids, g0.shard, g0.deadline) == (JobKind.FULL_GRAD, (0,), (0, 2), 0)
    out, none = d.round(worker="w1")
    assert none is None and not out.updated
    out, j1 = d.round([full(d, jg)])  # round 0: v_0 = ∇F(0) = -3, x_1 = 0.6
    np.testing.assert_allclose(d.state.v, [-3.0], rtol=RTOL)
    np.testing.assert_allclose(d.state.x, [0.6], rtol=RTOL)
    out, jf = d.round([pair(d, j1, 2)])  # round 1: +q_1 = 1.8; x_2 formed: anchor 2 launched
    np.testing.assert_allclose(d.state.v, [-1.2], rtol=RTOL)
    np.testing.assert_allclose(d.state.x, [0.84], rtol=RTOL)
    assert out.metrics["snapshot_launched"] == 2.0
    return d, jf, out


def test_snapshot_switch_example():
    """§7 A12 table: N = 2, a = 0, η = 0.2, x0 = 0, i_s = 2, 1, 2, 1, 2, anchor 2, D = 2."""
    alg = SnapshotVR(lr=0.2, a=0.0, m=2, D=2, num_samples=2)
    d, jf, _ = _snapshot_start(alg)
    f = d.specs[jf]
    assert (f.kind, f.iterate_ids, f.shard, f.deadline) == (JobKind.FULL_GRAD, (2,), (0, 2), 4)
    np.testing.assert_allclose(f.points[0], [0.84], rtol=RTOL)
    out, j2 = d.round(worker="w1")  # the FULL_GRAD went first; the pair job 2 follows (no round between)
    assert not out.updated and d.specs[j2].iterate_ids == (2, 1)
    assert 2 in d.alg.live_iterate_ids(d.state)

    out, j3 = d.round(worker="w2")  # round 2: none
    assert out.updated
    np.testing.assert_allclose(d.state.v, [-1.2], rtol=RTOL)
    np.testing.assert_allclose(d.state.x, [1.08], rtol=RTOL)
    out, j4 = d.round([pair(d, j3, 2)])  # round 3: +q_3 = 0.72 (kept in S)
    np.testing.assert_allclose(d.state.v, [-0.48], rtol=RTOL)
    np.testing.assert_allclose(d.state.x, [1.176], rtol=RTOL)
    np.testing.assert_allclose(d.state.corr, [0.72], rtol=RTOL)
    np.testing.assert_allclose(out.metrics["missing_mass"], 1.0, rtol=RTOL)  # job 2, a = 0
    assert "snapshot_launched" not in out.metrics  # anchor 4 postponed: anchor 2 still in flight
    out, jf5 = d.round([pair(d, j4, 1), full(d, jf)])  # round 4: +q_4 = 0.096; G = -1.32 arrives
    assert out.updated and out.metrics["snapshot_applied"] == 2.0
    np.testing.assert_allclose(d.state.v, [-0.504], rtol=RTOL)
    np.testing.assert_allclose(d.state.x, [1.2768], rtol=RTOL)
    assert j2 in d.cancelled and out.metrics["missing_mass"] == 0.0  # job 2 is covered by G
    assert out.metrics["snapshot_launched"] == 5.0 and d.specs[jf5].iterate_ids == (5,)
    out, j5 = d.round(worker="w1")
    assert not out.updated and d.specs[j5].iterate_ids == (5, 4)
    # Round 5: job 2 arrives late (the driver cancelled it; delivered anyway it is dropped); +q_5 = 0.3024.
    out, _ = d.round([pair(d, j2, 1), pair(d, j5, 2)])
    assert out.dropped == (j2,) and out.applied == (j5,)
    np.testing.assert_allclose(d.state.v, [-0.2016], rtol=RTOL)
    np.testing.assert_allclose(d.state.x, [1.31712], rtol=RTOL)


def test_snapshot_deadline_block():
    """G of anchor 2 misses its deadline (round 3): no round runs until it arrives."""
    d, jf, _ = _snapshot_start(SnapshotVR(lr=0.2, a=0.0, m=2, D=1, num_samples=2, on_deadline="block"))
    assert d.specs[jf].deadline == 3
    _, j2 = d.round(worker="w1")
    _, j3 = d.round(worker="w2")  # round 2
    np.testing.assert_allclose(d.state.x, [1.08], rtol=RTOL)
    out, none = d.round([pair(d, j3, 2)])  # round 3 = s0 + D, G missing: held
    assert none is None and not out.updated and out.applied == (d.next_id - 1,)
    assert d.state.version == 3 and out.metrics["blocked"] == 1.0
    out, none = d.round(worker="w2")
    assert none is None and not out.updated
    assert 2 in d.alg.live_iterate_ids(d.state)
    d.lost([jf])  # the FULL_GRAD worker dies: the shard is handed out again
    out, jf2 = d.round(worker="w2")
    again = d.specs[jf2]
    assert (again.kind, again.iterate_ids, again.shard, again.deadline) == (JobKind.FULL_GRAD, (2,), (0, 2), 3)
    out, none = d.round(worker="w3")
    assert none is None and not out.updated
    out, nxt = d.round([full(d, jf2)])  # G arrives: round 3 runs with v_3 = G + S_3 = -1.32 + 0.72
    assert out.updated and out.metrics["snapshot_applied"] == 2.0 and out.metrics["blocked"] == 0.0
    np.testing.assert_allclose(d.state.v, [-0.6], rtol=RTOL)
    np.testing.assert_allclose(d.state.x, [1.2], rtol=RTOL)
    assert j2 in d.cancelled
    assert d.specs[nxt].kind == JobKind.FULL_GRAD and d.specs[nxt].iterate_ids == (4,)  # next anchor: 2 + m


def test_snapshot_deadline_abandon():
    """Same late G with on_deadline="abandon": round 3 runs with the current v, the anchor is released."""
    d, jf, _ = _snapshot_start(SnapshotVR(lr=0.2, a=0.0, m=2, D=1, num_samples=2, on_deadline="abandon"))
    _, j2 = d.round(worker="w1")
    _, j3 = d.round(worker="w2")  # round 2
    out, nxt = d.round([pair(d, j2, 1), pair(d, j3, 2)])  # round 3: +q_2 = 0.24, +q_3 = 0.72, no G
    assert out.updated and out.metrics["snapshot_abandoned"] == 2.0
    np.testing.assert_allclose(d.state.v, [-1.2 + 0.24 + 0.72], rtol=RTOL)
    np.testing.assert_allclose(d.state.x, [1.08 + 0.2 * 0.24], rtol=RTOL)
    assert jf in d.cancelled and 2 not in d.alg.live_iterate_ids(d.state)
    assert out.metrics["snapshot_launched"] == 4.0 and d.specs[nxt].iterate_ids == (4,)
    out, _ = d.round([full(d, jf)])  # a late G of the abandoned anchor is dropped
    assert out.dropped == (jf,)
    assert d.alg.metrics(d.state)["snapshots_abandoned"] == 1.0


def test_snapshot_basic_variant_waits_and_covers():
    """background=False: at anchor 2 the rounds stop, older corrections are cancelled, v_2 = G."""
    d = Driver(SnapshotVR(lr=0.2, a=0.0, m=2, num_samples=2, background=False), [0.0])
    _, jg = d.round()
    _, j1 = d.round([full(d, jg)])  # round 0: x_1 = 0.6
    out, jf = d.round()  # round 1 without a reply: v_1 = -3, x_2 = 1.2; anchor 2
    np.testing.assert_allclose(d.state.x, [1.2], rtol=RTOL)
    assert d.specs[jf].kind == JobKind.FULL_GRAD and d.specs[jf].deadline == 2
    assert j1 in d.cancelled  # q_1 is covered by G
    out, none = d.round(worker="w1")  # no pair job 2 in the basic variant; round 2 waits
    assert none is None and not out.updated and out.metrics["blocked"] == 1.0
    out, j3 = d.round([pair(d, j1, 2), full(d, jf)])  # G = ∇F(1.2) = -0.6
    assert out.updated and out.dropped == (j1,)
    np.testing.assert_allclose(d.state.v, [-0.6], rtol=RTOL)
    np.testing.assert_allclose(d.state.x, [1.32], rtol=RTOL)
    assert d.specs[j3].iterate_ids == (3, 2)


def test_snapshot_shards_sum_to_full_gradient():
    """Four components in three shards: G is Σ shard sums / N; written-off shards are reissued."""
    alg = SnapshotVR(lr=0.1, num_samples=4, shards=3)
    d = Driver(alg, [1.0])
    shards = [d.round(worker=f"w{i}")[1] for i in range(3)]
    assert [d.specs[j].shard for j in shards] == [(0, 1), (1, 2), (2, 4)]
    assert d.round(worker="w3")[1] is None
    d.lost([shards[1]])
    _, again = d.round(worker="w1")
    assert d.specs[again].shard == (1, 2)

    def shard_sum(jid):
        lo, hi = d.specs[jid].shard
        return d.result(jid, [np.array([float(sum(range(lo + 1, hi + 1)))])], count=hi - lo)

    out, _ = d.round([shard_sum(shards[0]), shard_sum(shards[2])])
    assert not out.updated
    out, _ = d.round([shard_sum(again)])
    assert out.updated
    np.testing.assert_allclose(d.state.v, [(1 + 2 + 3 + 4) / 4], rtol=RTOL)
    bad = SnapshotVR(lr=0.1, num_samples=4, shards=2)
    d = Driver(bad, [1.0])
    _, j = d.round()
    out, _ = d.round([d.result(j, [np.array([1.0])], count=3)])  # shard (0, 2) claims 3 components
    assert out.dropped == (j,) and d.alg.metrics(d.state)["snapshot_parts_left"] == 2.0


# ---------------------------------------------------------------- both


def _scenario(alg, x0, steps: int, save_at: int | None, finite: bool):
    """A seeded run with random arrivals and one write-off; optionally a state-dict round trip."""
    rng = np.random.default_rng(7)
    d = Driver(alg, x0)
    in_flight: list[int] = []
    trail = []

    def reply(jid):
        spec = d.specs[jid]
        if spec.kind == JobKind.FULL_GRAD:
            lo, hi = spec.shard
            return d.result(jid, [sum(comp_grad(1 + i % 2, spec.points[0]) for i in range(lo, hi))], count=hi - lo)
        if finite:
            return pair(d, jid, 1 + jid % 2)
        return d.toy(jid, 0.1 * (jid % 5) - 0.2)

    for step in range(steps):
        if step == save_at:
            sd = alg.to_state_dict(d.state)
            d.state = alg.from_state_dict(sd)
            assert state_arrays_equal(alg.to_state_dict(d.state), sd)
        if step == 9 and in_flight:
            d.lost([in_flight.pop(0)])
        n = int(rng.integers(0, len(in_flight) + 1))
        deliver = [in_flight[i] for i in rng.permutation(len(in_flight))[:n]]
        in_flight = [j for j in in_flight if j not in deliver]
        out, jid = d.round([reply(j) for j in deliver], worker=f"w{step % 3}")
        in_flight = [j for j in in_flight if j in d.outstanding]
        if jid is not None:
            in_flight.append(jid)
            spec = d.specs[jid]
            trail.append((spec.kind, spec.created_at, spec.iterate_ids, spec.shard, [p.copy() for p in spec.points]))
        trail.append((out.applied, out.dropped, out.updated, sorted(out.metrics.items())))
    return alg.to_state_dict(d.state), trail


@pytest.mark.parametrize("alg, finite", [
    (DelayedStormVR(lr=0.3, a=0.3, B_init=2, tau_lost=3, M_max=1.5, on_excess="block"), False),
    (SnapshotVR(lr=0.1, a=0.2, m=3, D=2, num_samples=4, shards=2), True),
    (SnapshotVR(lr=0.1, m=4, num_samples=4, background=False), True),
])
def test_state_dict_round_trip_continues_bit_identically(alg, finite):
    x0 = np.array([0.5, -1.0, 2.0])
    ref_state, ref_trail = _scenario(alg, x0, 30, None, finite)
    assert ref_state["version"] > 5
    for save_at in (4, 11, 17):
        state, trail = _scenario(alg, x0, 30, save_at, finite)
        assert state_arrays_equal(state, ref_state)
        assert len(trail) == len(ref_trail)
        for got, want in zip(trail, ref_trail, strict=True):
            if len(want) == 5:
                assert got[:4] == want[:4]
                assert all(np.array_equal(p, q) for p, q in zip(got[4], want[4], strict=True))
            else:
                assert got == want


def test_state_dict_rejects_inconsistent_state():
    alg = DelayedStormVR()
    d = Driver(alg, [1.0, 2.0])
    sd = alg.to_state_dict(d.state)
    with pytest.raises(ValueError):
        alg.from_state_dict({**sd, "v": np.zeros(3)})
    with pytest.raises(ValueError):
        alg.from_state_dict({**sd, "pending": [5]})
    with pytest.raises(ValueError):
        alg.from_state_dict({k: v for k, v in sd.items() if k != "acc"})
    loaded = alg.from_state_dict(sd)
    assert not loaded.x.flags.writeable and loaded.v.flags.writeable


@pytest.mark.parametrize("cls, kwargs", [
    (DelayedStormVR, {"lr": 0.0}),
    (DelayedStormVR, {"lr": float("nan")}),
    (DelayedStormVR, {"a": 0.0}),
    (DelayedStormVR, {"a": 1.5}),
    (DelayedStormVR, {"B_init": 0}),
    (DelayedStormVR, {"B_init": 2.5}),
    (DelayedStormVR, {"tau_lost": -1}),
    (DelayedStormVR, {"M_max": 0.0}),
    (DelayedStormVR, {"on_excess": "stop"}),
    (SnapshotVR, {"lr": -1.0}),
    (SnapshotVR, {"a": -0.1}),
    (SnapshotVR, {"m": 0}),
    (SnapshotVR, {"D": -1}),
    (SnapshotVR, {"background": "yes"}),
    (SnapshotVR, {"on_deadline": "skip"}),
    (SnapshotVR, {"background": False, "on_deadline": "abandon"}),
    (SnapshotVR, {"num_samples": -2}),
    (SnapshotVR, {"shards": 0}),
    (SnapshotVR, {"num_samples": 3, "shards": 4}),
    (SnapshotVR, {"batch": 0}),
])
def test_bad_hyper_parameters_raise(cls, kwargs):
    with pytest.raises(ValueError):
        cls(**kwargs)


def test_snapshot_vr_needs_num_samples():
    with pytest.raises(ValueError, match="num_samples"):
        SnapshotVR().init(np.zeros(2), seed=0)


def _simulate(alg, x0, grads, *, n_workers: int, events: int, seed: int, kill_every: int = 0):
    """A tiny event loop: a random busy worker replies, then every free worker gets a round.

    ``grads(spec, job_id)`` returns the Result grads (and count) of a job. Every ``kill_every``-th
    event a busy worker's job is written off instead of answered.
    """
    rng = np.random.default_rng(seed)
    d = Driver(alg, x0)
    busy: dict[str, int] = {}
    free = [f"w{i}" for i in range(n_workers)]
    for step in range(events):
        results = []
        if busy:
            w = sorted(busy)[int(rng.integers(len(busy)))]
            jid = busy.pop(w)
            if kill_every and step % kill_every == kill_every - 1:
                if jid in d.outstanding:
                    d.lost([jid])
            elif jid in d.outstanding:  # a cancelled job's reply never reaches apply
                g, count = grads(d.specs[jid], jid)
                results.append(d.result(jid, g, count=count))
            free.append(w)
        waiting = []
        for w in free:
            _, jid = d.round(results, worker=w)
            results = []
            if jid is None:
                waiting.append(w)
            else:
                busy[w] = jid
        free = waiting
        # cancelled jobs free their workers
        for w, jid in list(busy.items()):
            if jid not in d.outstanding:
                del busy[w]
                free.append(w)
    return d


def test_storm_vr_converges_with_random_delays_and_losses():
    dim = 5
    x0 = np.full(dim, 3.0, dtype=np.float32)

    def grads(spec, jid):
        noise = np.random.default_rng(jid).normal(scale=0.1, size=dim).astype(np.float32)
        return [p + noise for p in spec.points], 0

    for on_excess in ("warn", "block"):
        alg = DelayedStormVR(lr=0.2, a=0.2, B_init=4, tau_lost=20, M_max=2.0, on_excess=on_excess)
        d = _simulate(alg, x0, grads, n_workers=4, events=600, seed=3, kill_every=50)
        assert d.state.x.dtype == np.float32 and d.state.version > 300
        assert np.linalg.norm(d.state.x) < 0.05 * np.linalg.norm(x0)
        m = alg.metrics(d.state)
        assert m["written_off_total"] >= 5 and m["lost_total"] >= m["written_off_total"]
        assert m["excess_rounds"] > 0  # 4 jobs in flight: M_k hovers around 1 + 0.8 + 0.64 + 0.51
        assert len(alg.live_iterate_ids(d.state)) <= alg.tau_lost + 2


def test_snapshot_vr_converges_on_a_finite_sum():
    n_comp, dim = 8, 3
    b = np.random.default_rng(0).normal(size=(n_comp, dim))  # f_i = |x - b_i|² / 2, x* = mean b_i

    def grads(spec, jid):
        if spec.kind == JobKind.FULL_GRAD:
            lo, hi = spec.shard
            return [sum(spec.points[0] - b[i] for i in range(lo, hi))], hi - lo
        i = jid % n_comp
        return [p - b[i] for p in spec.points], 0

    for kw in ({"on_deadline": "block"}, {"on_deadline": "abandon", "D": 1}, {"background": False}):
        alg = SnapshotVR(**{"lr": 0.3, "m": 10, "D": 4, "num_samples": n_comp, "shards": 2, **kw})
        d = _simulate(alg, np.zeros(dim), grads, n_workers=3, events=400, seed=5, kill_every=37)
        assert np.linalg.norm(d.state.x - b.mean(axis=0)) < 1e-3, kw
        assert alg.metrics(d.state)["snapshots_applied"] >= 5
