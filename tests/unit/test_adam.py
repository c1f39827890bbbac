"""adamw and adam (docs/ALGORITHMS.md §15): torch.optim.AdamW / Adam on the same gradient
sequence as the independent expectation, the worked example of §15 by hand, hyper-parameter
errors, max_age, the schedule wrapper, sharding, the state dict and the simulate command."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import algorithms
from algorithms import build
from algorithms._pool import BLOCKED_MIN
from algorithms.adam import Adam, AdamW
from algorithms.base import Result, bind_layout, state_arrays_equal
from algorithms.sharding import Sharded
from latecomer.testing import check_algorithm
from protocol.messages import JobKind


def reply(job_id: int, created_at: int, g: np.ndarray) -> Result:
    return Result(job_id=job_id, worker_id="w", created_at=created_at, kind=JobKind.GRAD,
                  iterate_ids=(created_at,), grads=(g,))


def run_ours(alg, x0: np.ndarray, grads: list[np.ndarray]):
    """Every gradient applied on arrival with zero delay (each created at the current version);
    the iterates after each step (copies) and the final state."""
    state, jobs = alg.init(x0, seed=0)
    assert jobs == []
    xs = []
    for i, g in enumerate(grads):
        state, out = alg.apply(state, [reply(i, alg.version(state), g)])
        assert out.applied == (i,) and out.updated and out.ages == (0,)
        xs.append(np.array(alg.params(state)))
    return xs, state


def run_torch(cls, x0: np.ndarray, grads: list[np.ndarray], lrs: list[float] | None = None, **kw):
    p = torch.tensor(x0, dtype=torch.float32, requires_grad=True)
    opt = cls([p], foreach=False, **kw)
    xs = []
    for i, g in enumerate(grads):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[i]
        p.grad = torch.tensor(g)
        opt.step()
        xs.append(p.detach().numpy().copy())
    return xs


def sequence(d: int, steps: int, seed: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal(d).astype(np.float32)
    grads = [(rng.standard_normal(d) * rng.uniform(0.1, 3.0)).astype(np.float32) for _ in range(steps)]
    grads[1][: d // 4] = 0.0  # some coordinates with no gradient: ε keeps 0/0 away
    return x0, grads


def assert_close_to_torch(ours: list[np.ndarray], theirs: list[np.ndarray]) -> None:
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-7, err_msg=f"step {k + 1}")


CASES = [("adamw", torch.optim.AdamW, 0.0), ("adamw", torch.optim.AdamW, 0.05),
         ("adam", torch.optim.Adam, 0.0), ("adam", torch.optim.Adam, 0.05)]


@pytest.mark.parametrize("name,cls,wd", CASES, ids=[f"{c[0]}-wd{c[2]}" for c in CASES])
@pytest.mark.parametrize("d", [37, BLOCKED_MIN + 1001], ids=["plain", "blocked"])
def test_zero_delay_sequence_equals_torch_optim(name, cls, wd, d):
    x0, grads = sequence(d, 6)
    kw = {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": wd}
    ours, state = run_ours(build(name, {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": wd}),
                           x0, grads)
    assert_close_to_torch(ours, run_torch(cls, x0, grads, **kw))
    assert state.m.dtype == state.v.dtype == np.float32 and state.version == 6
    assert not state.x.flags.writeable, "the published iterate is read-only"


def test_defaults_are_torchs_and_the_decay_differs_between_the_two():
    assert (AdamW().lr, AdamW().beta1, AdamW().beta2, AdamW().eps, AdamW().weight_decay) == (1e-3, 0.9, 0.999, 1e-8,
                                                                                            0.01)
    assert Adam().weight_decay == 0.0 and Adam().max_age is None
    x0, grads = sequence(20, 4, seed=3)
    for name, cls in (("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam)):
        ours, _ = run_ours(build(name, {"lr": 0.05, "weight_decay": 0.3}), x0, grads)
        assert_close_to_torch(ours, run_torch(cls, x0, grads, lr=0.05, weight_decay=0.3))
    a, _ = run_ours(build("adamw", {"lr": 0.05, "weight_decay": 0.3}), x0, grads)
    b, _ = run_ours(build("adam", {"lr": 0.05, "weight_decay": 0.3}), x0, grads)
    assert np.abs(a[-1] - b[-1]).max() > 1e-3, "decoupled decay and L2 are different algorithms"


def test_blocked_and_plain_paths_give_the_same_bits():
    """The blocked pass (d >= BLOCKED_MIN) and the whole-array calls are the same ufuncs per element."""
    x0, grads = sequence(BLOCKED_MIN + 77, 3, seed=1)
    alg = build("adamw", {"lr": 0.02})
    big, _ = run_ours(alg, x0, grads)
    cut = BLOCKED_MIN // 2  # each half is below BLOCKED_MIN: the plain path
    lo, _ = run_ours(alg, x0[:cut], [g[:cut] for g in grads])
    hi, _ = run_ours(alg, x0[cut:], [g[cut:] for g in grads])
    for k in range(3):
        assert np.concatenate([lo[k], hi[k]]).tobytes() == big[k].tobytes()


def test_worked_example_first_two_steps():
    """docs/ALGORITHMS.md §15: x0 = (1, −2), lr 0.1, λ 0.1, β = (0.9, 0.999), ε = 1e−8;
    g1 = (0.5, −1), g2 = (−0.5, 2).

    AdamW step 1: x·(1 − 0.01) = (0.99, −1.98); m = (0.05, −0.1); v = (0.00025, 0.001);
    m̂ = g1, √v̂ = |g1|, so the step is 0.1·sign(g1): x1 = (0.89, −1.88).
    Step 2: x·0.99 = (0.8811, −1.8612); m = (−0.005, 0.11); v = (0.00049975, 0.004999);
    1 − β1² = 0.19, 1 − β2² = 0.001999; m̂ = (−0.0263158, 0.5789474), √v̂ = (0.5, 1.5813763);
    x2 = (0.8811 + 0.0052632, −1.8612 − 0.0366104) = (0.8863632, −1.8978104).
    Adam (L2): g1 + λx0 = (0.6, −1.2): x1 = (0.9, −1.9); x2 = (0.8866836, −1.9250179).
    """
    x0 = np.array([1.0, -2.0], np.float32)
    grads = [np.array([0.5, -1.0], np.float32), np.array([-0.5, 2.0], np.float32)]
    (x1, x2), state = run_ours(build("adamw", {"lr": 0.1, "weight_decay": 0.1}), x0, grads)
    np.testing.assert_allclose(x1, [0.89, -1.88], atol=1e-6)
    np.testing.assert_allclose(x2, [0.8863632, -1.8978104], atol=1e-6)
    np.testing.assert_allclose(state.m, [-0.005, 0.11], atol=1e-7)
    np.testing.assert_allclose(state.v, [0.00049975, 0.004999], rtol=1e-6)
    (y1, y2), _ = run_ours(build("adam", {"lr": 0.1, "weight_decay": 0.1}), x0, grads)
    np.testing.assert_allclose(y1, [0.9, -1.9], atol=1e-6)
    np.testing.assert_allclose(y2, [0.8866836, -1.9250179], atol=1e-6)


def test_bias_correction_counts_the_servers_updates_not_the_replies_ages():
    """A stale reply (age 3) is applied as it comes, at t = version + 1: the same step as a fresh
    reply carrying the same gradient."""
    alg = build("adamw", {"lr": 0.1})
    x0, grads = sequence(8, 5, seed=2)
    fresh, _ = run_ours(alg, x0, grads)
    state, _ = alg.init(x0, seed=0)
    for i, g in enumerate(grads):
        created = max(0, state.version - 3)
        state, out = alg.apply(state, [reply(i, created, g)])
        assert out.applied == (i,) and out.ages == (state.version - 1 - created,)
    assert alg.params(state).tobytes() == fresh[-1].tobytes()


def test_max_age_drops_older_replies_and_changes_nothing():
    alg = build("adamw", {"lr": 0.1, "max_age": "2"})
    assert alg.max_age == 2
    x0, grads = sequence(8, 4, seed=4)
    state, _ = alg.init(x0, seed=0)
    for i in range(4):
        state, _ = alg.apply(state, [reply(i, state.version, grads[i])])
    before = alg.to_state_dict(state)
    state, out = alg.apply(state, [reply(10, 1, grads[0])])  # age 3 > 2
    assert out.dropped == (10,) and out.applied == () and not out.updated
    assert state_arrays_equal(alg.to_state_dict(state), before)
    state, out = alg.apply(state, [reply(11, 2, grads[0])])  # age 2: applied
    assert out.applied == (11,) and out.ages == (2,) and state.version == 5
    assert build("adamw", {"max_age": "none"}).max_age is None


@pytest.mark.parametrize("settings,message", [
    ({"lr": 0}, "Invalid lr: 0"), ({"lr": -1}, "Invalid lr"), ({"beta1": 1.0}, "Invalid beta1: 1.0 (must be < 1"),
    ({"beta1": -0.1}, "Invalid beta1"), ({"beta2": 1}, "Invalid beta2"), ({"beta2": float("nan")}, "Invalid beta2"),
    ({"eps": 0}, "Invalid eps: 0"), ({"weight_decay": -0.01}, "Invalid weight_decay"),
    ({"lr": 0.5, "weight_decay": 2.0}, "lr·weight_decay must be < 1"), ({"max_age": -1}, "Invalid max_age"),
    ({"max_age": "x"}, "Invalid max_age"), ({"beta1": "a"}, "Invalid beta1"), ({"betas": 0.9}, "unknown hyper-par"),
])
def test_hyper_parameter_errors_are_one_line_and_name_the_value(settings, message):
    for name in ("adamw", "adam"):
        if name == "adam" and "lr·weight_decay" in message:
            assert build(name, settings).weight_decay == 2.0  # L2 has no such bound
            continue
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("·", ".")) as info:
            build(name, settings)
        assert "\n" not in str(info.value)


def test_a_step_schedule_changes_the_lr_as_torch_would():
    """lr_schedule=step, gamma 0.5 every 2 updates, warmup 2: lr_k = lr·f(k); torch with the
    param group's lr set to the same lr_k before each step (the decay uses it too)."""
    alg = build("adamw", {"lr": 0.04, "weight_decay": 0.1, "lr_schedule": "step", "step_every": 2, "gamma": 0.5,
                          "warmup": 2})
    lrs = [0.04 * f for f in (0.5, 1.0, 1.0, 1.0, 0.5, 0.5, 0.25)]
    assert [alg.lr_at(k) for k in range(7)] == pytest.approx(lrs)
    x0, grads = sequence(30, 7, seed=5)
    ours, _ = run_ours(alg, x0, grads)
    assert_close_to_torch(ours, run_torch(torch.optim.AdamW, x0, grads, lrs=lrs, lr=0.04, weight_decay=0.1))
    constant, _ = run_ours(build("adamw", {"lr": 0.04, "weight_decay": 0.1}), x0, grads)
    assert np.abs(constant[-1] - ours[-1]).max() > 1e-3


def test_sharded_split_gives_the_unsharded_bits_and_one_global_count():
    layout = (("w", (40, 30)), ("b", (30,)), ("h", (7,)))
    d = 40 * 30 + 30 + 7
    x0, grads = sequence(d, 5, seed=6)
    alg = build("adamw", {"lr": 0.01, "lr_schedule": "cosine", "decay_steps": 5})
    plain, _ = run_ours(bind_layout(alg, layout), x0, grads)
    for s in (2, 3, 8):
        sharded = bind_layout(Sharded(alg, n_shards=s), layout)
        assert sharded.plan.shards == s
        xs, state = run_ours(sharded, x0, grads)
        assert [p.version for p in state.parts] == [5] * s and state.coordinator.version == 5
        assert xs[-1].tobytes() == plain[-1].tobytes(), f"S = {s}"


def test_state_dict_round_trip_is_exact_and_loads_are_checked():
    alg = build("adam", {"lr": 0.01, "weight_decay": 0.01})
    x0, grads = sequence(16, 3, seed=7)
    _, state = run_ours(alg, x0, grads)
    d = alg.to_state_dict(state)
    assert set(d) == {"version", "x", "m", "v"}
    back = alg.from_state_dict(d)
    assert state_arrays_equal(alg.to_state_dict(back), d) and not back.x.flags.writeable
    bad = dict(d, v=-np.abs(d["v"]) - 1.0)
    with pytest.raises(ValueError, match="second moment v must be >= 0"):
        alg.from_state_dict(bad)
    with pytest.raises(ValueError, match="m must match x"):
        alg.from_state_dict(dict(d, m=d["m"].astype(np.float64)))


def test_adamw_with_max_age_meets_the_contract():
    """The registry's runs are enrolled in tests/sim/test_contract.py; here the max_age option
    (with the contract's 6 heterogeneous workers a bound of 4 really drops replies: asserted)."""
    trace = check_algorithm(lambda: build("adamw", {"lr": 0.02, "max_age": 4}))
    assert trace.counters.get("dropped", 0) > 0


def test_simulate_runs_adamw_through_the_registry(tmp_path):
    from ps.cli.main import main

    out = tmp_path / "sim"
    r = CliRunner().invoke(main, ["simulate", "--algorithm", "adamw", "--workers", "4", "--time", "60",
                                  "--problem-opt", "d=8", "--set", "lr=0.05", "--set", "weight_decay=0.001",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert (out / "trace.csv").stat().st_size > 100
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counters"]["updates"] > 50
    first, last = map(float, re.search(r"loss: (\S+) -> (\S+)", r.output).groups())
    assert last == pytest.approx(summary["points"][-1]["loss"], rel=1e-5) and last < 0.2 * first, r.output
    r = CliRunner().invoke(main, ["simulate", "--algorithm", "adamw", "--set", "beta2=1.5"])
    assert r.exit_code == 2 and "Invalid beta2" in r.output and "Traceback" not in r.output


def test_registered():
    assert algorithms.ALGORITHMS["adamw"] is AdamW and algorithms.ALGORITHMS["adam"] is Adam
