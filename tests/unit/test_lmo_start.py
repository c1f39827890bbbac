"""Issue 31: where Ringmaster LMO's (and Delay-adaptive Muon's) momentum starts.

The public Ringmaster-LMO code keeps an EMA from m_0 = 0 with its β from the first reply
(``momentum_start="zero"``, the default); the paper's theorems take α_0 = 1, m_1 = g
(``momentum_start="first"``, the default before issue 31). A run.json without the key ran the
old start.
"""

from __future__ import annotations

import numpy as np
import pytest

import algorithms
from algorithms.base import Result, bind_layout
from algorithms.registry import complete_settings, recorded_settings
from algorithms.sharding import Sharded
from protocol.messages import JobKind

LAYOUT = (("w", (2, 3)), ("b", (3,)))

#: W has orthogonal rows of norm 3 (W Wᵀ = 9 I): every matrix c·W has both singular values equal.
W = np.array([1.0, 2.0, 2.0, 2.0, -2.0, 1.0])

#: The three replies' gradients: w-block γ_k·W, bias b_k (given directly, one fresh reply at a time).
GAMMAS = (1.0, -3.0, 0.375)
BIASES = ((1.0, -2.0, 4.0), (0.0, 2.0, -2.0), (2.0, 0.0, 1.0))

#: x_1, x_2, x_3 from x_0 = 0, derived by hand (see the test's docstring); w-block as c·W.
EXPECTED = {
    "zero": (
        (-0.035381648, (-0.075, 0.15, -0.3)),
        (2.51e-8, (-0.0875, 0.025, -0.2)),
        (0.035380781, (-0.24375, 0.0125, -0.275)),
    ),
    "first": (
        (-0.035381658, (-0.1, 0.2, -0.4)),
        (1.45e-8, (-0.125, 0.1, -0.35)),
        (-0.035380742, (-0.2875, 0.1, -0.45)),
    ),
}


def _expected(start: str) -> list[np.ndarray]:
    return [np.concatenate([c * W, b]) for c, b in EXPECTED[start]]


def _grads() -> list[np.ndarray]:
    return [np.concatenate([gam * W, b]) for gam, b in zip(GAMMAS, BIASES, strict=True)]


def _three_steps(alg) -> list[np.ndarray]:
    state, _ = alg.init(np.zeros(9), seed=0)
    xs = []
    for i, g in enumerate(_grads()):
        v = alg.version(state)
        r = Result(job_id=i, worker_id="A", created_at=v, kind=JobKind.GRAD, iterate_ids=(v,), grads=(g,))
        state, out = alg.apply(state, [r])
        assert out.applied == (i,) and out.ages == (0,)
        xs.append(np.array(alg.params(state), dtype=np.float64))
    return xs


def _settings(start: str | None) -> dict:
    settings = {"lmo": "muon", "lr": 0.1, "alpha": 0.5, "R": 4, "nesterov": True, "ns": "polar-express",
                "ns_steps": 5}
    if start is not None:
        settings["momentum_start"] = start
    return settings


@pytest.mark.parametrize("start", [None, "zero", "first"])
@pytest.mark.parametrize("shards", [0, 2])
def test_worked_example_three_muon_steps_on_a_2x3_block_and_a_bias(start, shards):
    r"""Three Ringmaster-Muon steps, α = 0.5, Nesterov, lr = 0.1, Polar Express NS5, float64, x_0 = 0,
    layout w (2×3, Newton–Schulz) and b (3,) (the momentum fallback), one worker, every reply fresh.

    Gradients: g_k = (γ_k W, b_k) with W = [[1, 2, 2], [2, −2, 1]] (W Wᵀ = 9 I, ‖W‖_F = 3√2),
    γ = (1, −3, 3/8), b_1 = (1, −2, 4), b_2 = (0, 2, −2), b_3 = (2, 0, 1).

    Momentum (exact fractions; m ← α g + (1−α) m, u = (1−α) m + α g):

    - "zero" (default, the public code: m_0 = 0, α = 1/2 from the first reply):
      m_1 = (1/2 W; 1/2, −1, 2),      u_1 = (3/4 W; 3/4, −3/2, 3)
      m_2 = (−5/4 W; 1/4, 1/2, 0),    u_2 = (−17/8 W; 1/8, 5/4, −1)
      m_3 = (−7/16 W; 9/8, 1/4, 1/2), u_3 = (−1/32 W; 25/16, 1/8, 3/4)
    - "first" (α_0 = 1: m_1 = g_1):
      m_1 = u_1 = g_1 = (W; 1, −2, 4)
      m_2 = (−W; 1/2, 0, 1),          u_2 = (−2 W; 1/4, 1, −1/2)
      m_3 = (−5/16 W; 5/4, 0, 1),     u_3 = (1/32 W; 13/8, 0, 1)

    The momenta differ by (1−α)^k·(α−1)·g_1 = −(1/2)^{k+1} g_1 at every step, not only the first: the
    bias steps differ at all three, and the third w-step goes the other way (u_3 = −W/32 against +W/32).

    Newton–Schulz of c·W: X_0 = c W / (|c| 3√2 + 1e-7) has both singular values
    σ_0 = 3|c| / (3√2 |c| + 1e-7) ≈ 1/√2, and X Xᵀ = σ² I, so each Polar-Express step (a, b, c) maps
    σ ← a σ + b σ³ + c σ⁵ on the scalar; after the 5 triples NS(c W) = sign(c)·σ_5·W/3, with no
    transpose (2 ≤ 3) and √max(1, 2/3) = 1. The scalar recursion, five lines of plain floats::

        s = 3*abs(c) / (abs(c)*3*math.sqrt(2) + 1e-7)
        for p, q, r in POLAR_EXPRESS_TRIPLES: s = p*s + q*s**3 + r*s**5
        coefficient = copysign(s, c) / 3

    gives σ_5/3 = 0.3538164830 (c = 3/4), 0.3538167340 (c = 17/8), 0.3538075614 (c = 1/32),
    0.3538165800 (c = 1), 0.3538167254 (c = 2); 1e-7 is why they differ. The bias steps by u_b itself.
    x_{k+1} = x_k − 0.1·(coefficient·W; u_b):

    - "zero": x_1 = (−0.035381648 W; −0.075, 0.15, −0.3), x_2 = (2.51e-8 W; −0.0875, 0.025, −0.2),
      x_3 = (0.035380781 W; −0.24375, 0.0125, −0.275)
    - "first": x_1 = (−0.035381658 W; −0.1, 0.2, −0.4), x_2 = (1.45e-8 W; −0.125, 0.1, −0.35),
      x_3 = (−0.035380742 W; −0.2875, 0.1, −0.45)

    The same through the sharded path (``shards=2``: w on one shard, b on the other, as
    ``simulate --shards 2``), bit for bit the unsharded run.
    """
    alg = algorithms.build("ringmaster-lmo", _settings(start))
    alg = bind_layout(Sharded(alg, n_shards=shards) if shards else alg, LAYOUT)
    if shards:
        assert alg.plan.ranges == ((0, 6), (6, 9))
    xs = _three_steps(alg)
    for x, want in zip(xs, _expected(start or "zero"), strict=True):
        np.testing.assert_allclose(x, want, rtol=0, atol=1e-6)
    if shards:
        plain = _three_steps(bind_layout(algorithms.build("ringmaster-lmo", _settings(start)), LAYOUT))
        assert [x.tobytes() for x in xs] == [x.tobytes() for x in plain]


def test_the_two_starts_part_at_every_step():
    zero, first = _expected("zero"), _expected("first")
    for k in range(3):
        assert np.max(np.abs(zero[k][6:] - first[k][6:])) >= 0.025  # the bias block, every step
    assert np.sign(zero[2][0]) != np.sign(first[2][0])  # the third w-step: opposite directions


@pytest.mark.parametrize("name", ["ringmaster-lmo", "delay-adaptive-muon"])
def test_delay_adaptive_muon_starts_as_ringmaster_lmo(name):
    """Delay-adaptive Muon shares the momentum: with one worker (δ = 0, step lr) it makes the same
    three steps as Ringmaster Muon, for either start."""
    for start in ("zero", "first"):
        settings = _settings(start)
        if name == "delay-adaptive-muon":
            settings = {k: v for k, v in settings.items() if k not in ("lmo", "R")}
        xs = _three_steps(bind_layout(algorithms.build(name, settings), LAYOUT))
        for x, want in zip(xs, _expected(start), strict=True):
            np.testing.assert_allclose(x, want, rtol=0, atol=1e-6)


def test_new_records_pin_the_start_and_old_records_mean_the_old_one():
    reg = algorithms.ALGORITHMS
    for name in ("ringmaster-lmo", "delay-adaptive-muon"):
        # A new run records the key with today's default, so a later default cannot change it.
        assert complete_settings(reg, name, {"lr": 0.1}) == {"lr": 0.1, "momentum_start": "zero"}
        assert complete_settings(reg, name, {"momentum_start": "first"}) == {"momentum_start": "first"}
        # A record without the key predates it: it ran α_0 = 1.
        assert recorded_settings(reg, name, {"lr": 0.1}) == {"lr": 0.1, "momentum_start": "first"}
        assert recorded_settings(reg, name, {"momentum_start": "zero"}) == {"momentum_start": "zero"}
        assert algorithms.build(name, recorded_settings(reg, name, {})).momentum_start == "first"
    # Algorithms without the key are untouched either way.
    for name in ("rennala-muon", "ordered-momentum", "adamw"):
        assert complete_settings(reg, name, {"lr": 0.1}) == {"lr": 0.1}
        assert recorded_settings(reg, name, {"lr": 0.1}) == {"lr": 0.1}


def test_the_places_that_rebuild_a_recorded_run_read_an_old_record_as_the_old_start():
    from ps.drivers.replay import build_from_run
    from ps.journal.runfile import recorded_settings as run_settings

    core = {"problem": "quadratic", "problem_options": {"d": 8}, "batch_size": 1, "heartbeat_interval_s": 1.0,
            "liveness_timeout_s": 5.0, "min_workers": 1, "round_period_s": None, "seed": 0, "run_id": 1}
    old = {"problem": "quadratic", "problem_options": {"d": 8}, "algorithm": "ringmaster-lmo",
           "settings": {"lr": 0.1}, "core": core}
    assert run_settings(old) == {"lr": 0.1, "momentum_start": "first"}  # resume, and a shard joining
    assert run_settings({**old, "settings": {"momentum_start": "zero"}}) == {"momentum_start": "zero"}
    assert run_settings({**old, "algorithm": "no-such"}) == {"lr": 0.1}  # building it says why
    _, alg, _ = build_from_run(old)  # replay and export
    assert alg.momentum_start == "first"
    _, alg, _ = build_from_run({**old, "settings": {"lr": 0.1, "momentum_start": "zero"}})
    assert alg.momentum_start == "zero"
    # Another algorithm named by the caller gets exactly the settings given (today's defaults).
    _, alg, _ = build_from_run(old, algorithm="delay-adaptive-muon", settings={})
    assert alg.momentum_start == "zero"
