"""The discrete-event simulator: determinism, crashes, lost replies, iterate retention."""

from __future__ import annotations

import numpy as np
import pytest

import algorithms
from problems import load_problem
from ps.core.config import CoreConfig
from ps.drivers.sim import Crash, DelayModel, Simulator, simulate


def run(seed=0, crashes=(), loss_prob=0.0, name="ordered-momentum", settings=None, n=6, t=150.0, **kw):
    problem = load_problem("quadratic", {"d": 32})
    alg = algorithms.build(name, settings or {"lr": 0.3, "beta": 0.3})
    cfg = CoreConfig(min_workers=n, liveness_timeout_s=5.0, seed=seed)
    return simulate(alg, problem, DelayModel.named("sqrt", n), cfg, seed=seed, crashes=crashes,
                    loss_prob=loss_prob, max_time=t, eval_every=25, **kw)


def test_sim_same_seed_same_trace():
    a = run(seed=3, crashes=[Crash(2, 30.0, 10.0)], loss_prob=0.05)
    b = run(seed=3, crashes=[Crash(2, 30.0, 10.0)], loss_prob=0.05)
    assert a.applied == b.applied and a.points == b.points and a.counters == b.counters
    assert np.array_equal(a.final_x, b.final_x)
    c = run(seed=4, crashes=[Crash(2, 30.0, 10.0)], loss_prob=0.05)
    assert c.applied != a.applied


def test_sim_crash_is_detected_and_training_goes_on():
    tr = run(crashes=[Crash(0, 20.0)])  # the fastest worker dies for good
    assert tr.counters["workers_lost"] == 1 and tr.counters["lost"] >= 1
    after = [a for a in tr.applied if a[4] > 20.0]
    assert after and all(a[2] != "w1" for a in after)
    assert tr.points[-1]["loss"] < 0.05 * tr.points[0]["loss"]


def test_sim_rejoin_is_a_new_incarnation():
    tr = run(crashes=[Crash(0, 20.0, 5.0)])
    assert tr.counters["workers_joined"] == 7
    assert any(a[2] == "w1" and a[4] > 25.0 for a in tr.applied)


def test_sim_lost_replies_are_written_off_by_heartbeat_reconciliation():
    tr = run(loss_prob=0.1)
    c = tr.counters
    assert c["lost"] > 5
    assert c["issued"] == c["applied"] + c["dropped"] + c["lost"] + c["failed"] + c["cancelled"] + c["rejected"] + 6


def test_sim_store_holds_at_most_outstanding_iterates():
    tr = run(crashes=[Crash(1, 10.0, 3.0), Crash(3, 40.0)])
    assert 1 <= tr.store_peak <= 6


def test_sim_worker_cache_misses_are_recovered():
    # a cache of 2 iterates with credit 2 forces MISSING_ITERATE round trips now and then
    problem = load_problem("quadratic", {"d": 8})
    alg = algorithms.build("asgd", {"lr": 0.2})
    sim = Simulator(alg, problem, DelayModel.named("linear", 4, noise="none"), CoreConfig(min_workers=4),
                    credit=2, cache_size=2)
    tr = sim.run(max_updates=300)
    assert tr.counters["applied"] == 300


def test_delay_models():
    m = DelayModel.named("sqrt", 4, noise="none")
    assert m.tau == pytest.approx((1, 2 ** 0.5, 3 ** 0.5, 2))
    assert DelayModel.named("mixture", 4).tau == (1.0, 1.0, 10.0, 10.0)
    assert DelayModel.named("linear", 3, straggler=50).tau == (1.0, 2.0, 150.0)
    with pytest.raises(ValueError):
        DelayModel.named("quadratic", 3)


@pytest.mark.parametrize("wire", ["f16", "bf16"])
def test_sim_wire_dtype_quantizes_points_and_replies_only(wire):
    """Workers compute on roundtrip(iterate); the core gets roundtrip(grad); its iterate stays float32."""
    from protocol.messages import Reply
    from protocol.wire import roundtrip

    problem = load_problem("quadratic", {"d": 32})
    seen_points, seen_grads = [], []
    grad = problem.grad

    def spy_grad(x, seed, batch_size):
        seen_points.append(np.array(x, copy=True))
        return grad(x, seed, batch_size)

    problem.grad = spy_grad
    alg = algorithms.build("asgd", {"lr": 0.3})
    sim = Simulator(alg, problem, DelayModel.named("sqrt", 4), CoreConfig(min_workers=4, liveness_timeout_s=5.0),
                    seed=1, wire_dtype=wire)
    handle = sim.core.handle

    def spy_handle(wid, msg, now, *a):
        if isinstance(msg, Reply):
            seen_grads.extend(msg.grads)
        return handle(wid, msg, now, *a)

    sim.core.handle = spy_handle
    tr = sim.run(max_time=60.0, eval_every=10)
    assert len(seen_points) > 20 and len(seen_grads) == len(seen_points)
    for arrays in (seen_points, seen_grads):
        assert all(a.dtype == np.float32 and np.array_equal(roundtrip(a, wire), a) for a in arrays)
    assert not np.array_equal(roundtrip(tr.final_x, wire), tr.final_x), "the server's iterate is not quantized"
    base = simulate(algorithms.build("asgd", {"lr": 0.3}), load_problem("quadratic", {"d": 32}),
                    DelayModel.named("sqrt", 4), CoreConfig(min_workers=4, liveness_timeout_s=5.0), seed=1,
                    max_time=60.0, eval_every=10)
    assert base.applied == tr.applied, "same delays, same schedule"
    assert not np.array_equal(base.final_x, tr.final_x)
    assert abs(tr.points[-1]["loss"] - base.points[-1]["loss"]) < 0.05 * base.points[0]["loss"]
    with pytest.raises(ValueError, match="unknown wire dtype"):
        Simulator(alg, problem, DelayModel.named("sqrt", 4), wire_dtype="f8")
