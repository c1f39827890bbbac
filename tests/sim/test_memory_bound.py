"""The server's iterate store stays bounded through runs with crashes, rejoins and lost replies
(issue 7; docs/ALGORITHMS.md §2.4, "Iterate retention").

The core keeps an iterate (``core.store``) while an outstanding job references it or the
algorithm says it still needs it (``live_iterate_ids``). After every message the core handles
and every tick (the simulator's calls are wrapped) the test checks:

* exactness: the store holds exactly the iterates of the outstanding jobs plus (some of) the
  algorithm's live ids, nothing else, and the reference counts match the ledger; hence
  ``len(store) <= distinct ids of outstanding jobs + len(live ids)``;
* the absolute bound ``len(store) <= m * outstanding + K`` (m = iterates per job: 1 for GRAD
  algorithms, 2 for GRAD_PAIR ones; K = what the algorithm itself keeps, §2.4), and jobs in
  flight <= credit * workers (a round algorithm's buffered results are outstanding too);
* the per-algorithm bound of the §2.4 table (Ringmaster: only ids younger than R; STORM-VR:
  at most τ_lost + 2 consecutive ids besides the snapshot anchor; plain GRAD methods: at most
  one iterate per job slot, credit * n).

At the end the server stops issuing and the run drains: once no job is outstanding, the store
holds only live ids (for plain GRAD methods: nothing at all). A demand-driven round algorithm
(STORM-VR) applies buffered results only when it hands out the next job, so after draining its
buffered results are still outstanding; it is also run with clock-driven rounds, which do drain
to zero.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest

import algorithms
from problems import load_problem
from ps.core.config import CoreConfig
from ps.drivers.sim import Crash, DelayModel, Simulator

N_WORKERS = 6
HORIZON = 200.0
DRAIN = 60.0  # simulated seconds after the server stops issuing (> liveness timeout + slowest job)
CRASHES = (
    Crash(1, 20.0, 4.0),  # dies, rejoins after the liveness timeout (its jobs written off by timeout)
    Crash(3, 35.0, 0.5),  # dies, rejoins before the timeout: the new incarnation's hello writes them off
    Crash(0, 50.0, 12.0),  # the fastest worker, away a while
    Crash(3, 70.0, 1.0),  # the same worker again
    Crash(4, 90.0),  # gone for good
)


@dataclass(frozen=True)
class Case:
    name: str
    settings: dict
    per_job: int  # iterate ids per job (GRAD 1, GRAD_PAIR 2)
    keep: int  # K: iterates the algorithm itself may keep beyond outstanding jobs' (docs/ALGORITHMS.md §2.4)
    round_period: float | None = None


CASES = [
    Case("asgd", {"lr": 0.3}, 1, 0),
    Case("ordered-momentum", {"lr": 0.5, "beta": 0.3}, 1, 0),
    Case("ringmaster", {"lr": 0.5, "R": 3}, 1, 0),
    Case("rennala", {"lr": 1.0, "B": 3}, 1, 1),  # A8: x_k
    Case("rennala-mvr", {"lr": 1.0, "B": 3, "B_init": 6, "p": 0.3}, 2, 2),  # A9: x_k, x_{k-1}
    # A11: x_k, x_{k-1} and the anchor besides the pairs in flight; demand-driven rounds run about n
    # per job time, so tau_lost = 10 > n keeps most jobs (a smaller one expires nearly all)
    Case("storm-vr", {"lr": 0.3, "a": 0.1, "B_init": 4, "tau_lost": 10}, 2, 3),
    Case("storm-vr", {"lr": 0.3, "a": 0.1, "B_init": 4, "tau_lost": 10}, 2, 3, round_period=0.8),
]


class StoreWatch:
    """Wraps the core's entry points; checks the store after each call."""

    def __init__(self, sim: Simulator, case: Case, credit: int) -> None:
        self.sim, self.case, self.credit = sim, case, credit
        self.core = core = sim.core
        self.checks = 0
        self.max_store = 0
        self.max_outstanding = 0
        self.max_over_live = 0  # most ids kept beyond the outstanding jobs' (the algorithm's own need, seen)
        handle, tick = core.handle, core.on_tick

        def checked_handle(*a, **kw):
            out = handle(*a, **kw)
            self.check(f"handle {type(a[1]).__name__} from {a[0]} at t={a[2]:.3f}")
            return out

        def checked_tick(*a, **kw):
            out = tick(*a, **kw)
            self.check(f"on_tick at t={a[0]:.3f}")
            return out

        core.handle, core.on_tick = checked_handle, checked_tick

    def check(self, where: str) -> None:
        core, case = self.core, self.case
        store = set(core.store)
        uses = Counter(i for e in core.ledger.values() for i in e.iterate_ids)
        refd = set(uses)
        live = set(core.alg.live_iterate_ids(core.state))
        k = core.version
        ctx = (f"{case.name} after {where}: version {k}, store {sorted(store)}, outstanding jobs' ids "
               f"{sorted(refd)}, live {sorted(live)}, outstanding {core.outstanding}")
        # exactness: nothing kept that neither a job nor the algorithm needs; every job's iterate readable
        assert store <= refd | live, f"leaked {sorted(store - refd - live)}: {ctx}"
        assert refd <= store, f"missing {sorted(refd - store)}: {ctx}"
        assert {i: n for i, n in core.refs.items() if n} == dict(uses), f"refcounts {core.refs}: {ctx}"
        assert all(n >= 0 for n in core.refs.values()), ctx
        assert len(store) <= len(refd) + len(live), ctx
        # absolute bounds
        in_flight = sum(not e.received for e in core.ledger.values())  # (received = buffered for a round)
        assert in_flight <= self.credit * N_WORKERS, ctx
        assert len(store) <= case.per_job * core.outstanding + case.keep, ctx
        # the §2.4 table, per algorithm
        if case.name in ("asgd", "ordered-momentum"):
            assert len(store) <= self.credit * N_WORKERS, ctx
        elif case.name == "ringmaster":  # A5: only ids of age < R (older jobs are cancelled at once)
            assert all(k - i < case.settings["R"] for i in store), ctx
        elif case.name == "storm-vr":  # A11: <= tau_lost + 2 consecutive ids, + the anchor (A12 part)
            anchor = core.state.snap_anchor
            pairs = store - {anchor} if anchor >= 0 else store
            if pairs:
                assert max(pairs) - min(pairs) + 1 <= case.settings["tau_lost"] + 2, ctx
                assert max(pairs) <= k and min(pairs) >= k - case.settings["tau_lost"] - 1, ctx
        self.checks += 1
        self.max_store = max(self.max_store, len(store))
        self.max_outstanding = max(self.max_outstanding, core.outstanding)
        self.max_over_live = max(self.max_over_live, len(store - refd))


def make(case: Case, credit: int, loss_prob: float = 0.05, seed: int = 3,
         cache_size: int = 4) -> tuple[Simulator, StoreWatch]:
    problem = load_problem("quadratic", {"d": 16})
    alg = algorithms.build(case.name, case.settings)
    cfg = CoreConfig(min_workers=N_WORKERS, liveness_timeout_s=5.0, seed=1, round_period_s=case.round_period)
    sim = Simulator(alg, problem, DelayModel.named("sqrt", N_WORKERS), cfg, seed=seed, crashes=CRASHES,
                    loss_prob=loss_prob, credit=credit, cache_size=cache_size)
    return sim, StoreWatch(sim, case, credit)


@pytest.mark.parametrize("case", [c for c in CASES if c.name == "storm-vr"],
                         ids=lambda c: c.name + ("-clock" if c.round_period else ""))
def test_a_small_worker_cache_with_prefetch_keeps_what_queued_jobs_need(case):
    """Regression: credit 2, a 2-iterate cache and GRAD_PAIR jobs. Finishing one job used to evict
    an iterate that the queued job still needed (KeyError in the simulated worker)."""
    sim, watch = make(case, credit=2, loss_prob=0.05, seed=4, cache_size=2)
    sim.run(max_time=HORIZON)
    assert sim.core.counters.applied >= 30 and watch.checks > 500


@pytest.mark.parametrize(("credit", "loss_prob", "seed"), [(1, 0.05, 3), (2, 0.05, 4), (2, 0.2, 5)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name + ("-clock" if c.round_period else ""))
def test_store_bounded_through_crashes_and_drains_to_live_ids(case, credit, loss_prob, seed):
    sim, watch = make(case, credit, loss_prob, seed)
    sim.run(max_time=HORIZON)
    core = sim.core
    c = core.counters
    # the scenario did what it says: crashes noticed, jobs lost, the store was exercised
    assert c.workers_joined >= N_WORKERS + 3 and c.workers_lost >= 2 and c.lost >= 3, c.as_dict()
    assert c.updates >= 30 and c.applied >= 30, c.as_dict()
    assert watch.checks > 500 and watch.max_store >= 1
    assert core.store_peak >= watch.max_store  # the core's own peak (taken inside _issue) is no lower
    assert core.store_peak <= case.per_job * credit * N_WORKERS + case.keep
    assert watch.max_over_live <= case.keep, watch.max_over_live
    # drain: stop issuing; every job is answered, lost (heartbeat reconciliation) or timed out
    core.issuing = False
    sim.run(max_time=HORIZON + DRAIN)
    assert core.accounted()
    live = set(core.alg.live_iterate_ids(core.state))
    if case.round_period is None and core.alg.mode == "round":
        # demand-driven rounds: buffered results wait for the round that the next job would trigger
        assert all(e.received for e in core.ledger.values()), [e for e in core.ledger.values() if not e.received]
        held = {i for e in core.ledger.values() for i in e.iterate_ids}
        assert set(core.store) <= live | held
    else:
        assert not core.ledger, sorted(core.ledger)
        assert set(core.store) <= live, (sorted(core.store), sorted(live))
        assert len(core.store) <= case.keep  # K = 0 (plain GRAD methods): empty
        assert all(n == 0 for n in core.refs.values()), core.refs
    assert all(np.isfinite(core.params()))


def test_store_check_catches_a_leak():
    """The watch is not vacuous: a core that forgets to release one iterate fails it."""
    case = CASES[0]
    sim, watch = make(case, 1, loss_prob=0.0)
    core = sim.core
    sweep = core._sweep_store
    leaked = []

    def leaky_sweep():  # keep the first iterate ever released
        before = set(core.store)
        sweep()
        gone = before - set(core.store)
        if gone and not leaked:
            leaked.append(min(gone))
            core.store[leaked[0]] = np.zeros(1)
    core._sweep_store = leaky_sweep
    with pytest.raises(AssertionError, match="leaked"):
        sim.run(max_time=30.0)
    assert leaked and math.isfinite(leaked[0])
