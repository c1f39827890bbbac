"""Server-side wrappers (algorithms/wrappers.py): schedules against their closed forms, the exact
effect of clipping and weight decay on one update of ordered-momentum and ringmaster, and the
wrapper being invisible to the core (name, mode, state, delegation, errors)."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pytest

import algorithms
from algorithms.base import Algorithm, Result, bind_layout
from algorithms.ordered import OrderedMomentum
from algorithms.registry import build as registry_build
from algorithms.ringmaster import RingmasterASGD
from algorithms.wrappers import (
    ClipGradNorm,
    LRSchedule,
    WeightDecay,
    block_sq_sums,
    global_norm,
    norm_from_block_sq,
    unwrap,
)
from protocol.messages import JobKind

F32 = np.float32


def grad_result(job_id: int, created_at: int, g, kind: JobKind = JobKind.GRAD, ids=None) -> Result:
    grads = tuple(np.asarray(a, F32) for a in (g if isinstance(g, tuple) else (g,)))
    return Result(job_id=job_id, worker_id="w", created_at=created_at, kind=kind,
                  iterate_ids=ids if ids is not None else (created_at,), grads=grads)


def x0(d: int = 4) -> np.ndarray:
    return np.arange(1, d + 1, dtype=F32)


def step_lr(settings: dict, k: int) -> tuple[float, float]:
    """(how far x_1 moved, the ``lr`` metric) when asgd applies g = e_1 at a state of version k."""
    alg = algorithms.build("asgd", settings)
    state, _ = alg.init(x0(), seed=0)
    state.version = k
    before = state.x.copy()
    g = np.array([1.0, 0, 0, 0], F32)
    state, out = alg.apply(state, [grad_result(0, k, g)])
    assert out.updated and state.version == k + 1
    return float(before[0] - state.x[0]), out.metrics["lr"]


# ---------------------------------------------------------------- schedules (closed forms)

COSINE = {"lr": 0.5, "lr_schedule": "cosine", "warmup": 10, "decay_steps": 110, "min_lr_ratio": 0.2}


@pytest.mark.parametrize("k,expected", [
    (0, 0.5 * 1 / 10),  # first update of the warmup: (k+1)/W
    (4, 0.5 * 5 / 10),  # mid-warmup
    (9, 0.5),  # last warmup update: full lr
    (10, 0.5),  # first decay step: cos(0) = 1
    (35, 0.5 * (0.2 + 0.8 * (1 + math.sqrt(0.5)) / 2)),  # a quarter of the decay: cos(π/4)
    (60, 0.5 * (0.2 + 0.8 * 0.5)),  # mid-decay: cos(π/2) = 0
    (110, 0.5 * 0.2),  # end: min_lr_ratio
    (500, 0.5 * 0.2),  # and after it
])
def test_cosine_with_warmup_matches_the_closed_form(k, expected):
    alg = algorithms.build("asgd", COSINE)
    assert alg.lr_at(k) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    moved, metric = step_lr(COSINE, k)
    assert metric == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # x_0 = 1 exactly: x_1 = fl32(1 - fl32(lr_k)), so the step moved by fl32(lr_k) up to one ulp of 1
    assert moved == pytest.approx(float(F32(expected)), abs=1.2e-7)


@pytest.mark.parametrize("settings,points", [
    ({"lr": 1.0, "lr_schedule": "linear", "decay_steps": 100},
     [(0, 1.0), (50, 0.5), (75, 0.25), (100, 0.0), (150, 0.0)]),
    ({"lr": 1.0, "lr_schedule": "linear", "warmup": 4, "decay_steps": 104, "min_lr_ratio": 0.5},
     [(0, 0.25), (3, 1.0), (4, 1.0), (54, 0.75), (104, 0.5), (1000, 0.5)]),
    ({"lr": 1.0, "lr_schedule": "step", "warmup": 2, "step_every": 10, "gamma": 0.5},
     [(0, 0.5), (1, 1.0), (2, 1.0), (11, 1.0), (12, 0.5), (21, 0.5), (22, 0.25), (32, 0.125)]),
    ({"lr": 0.2, "warmup": 5}, [(0, 0.04), (2, 0.12), (4, 0.2), (5, 0.2), (10_000, 0.2)]),
])
def test_linear_step_and_warmup_only_match_their_closed_forms(settings, points):
    alg = algorithms.build("asgd", settings)
    for k, expected in points:
        assert alg.lr_at(k) == pytest.approx(expected, rel=1e-12, abs=1e-15), k


def test_the_schedule_scales_what_the_algorithm_steps_with_in_every_update():
    """A whole run of per-reply updates: update k moves x by exactly fl32(lr_k)·g (same bits as
    the unwrapped algorithm built with lr = lr_k)."""
    s = {"lr": 0.3, "lr_schedule": "cosine", "warmup": 3, "decay_steps": 12}
    alg = algorithms.build("ringmaster", {**s, "R": 100})
    state, _ = alg.init(x0(), seed=0)
    rng = np.random.default_rng(0)
    for k in range(15):
        g = rng.standard_normal(4).astype(F32)
        before = state.x.copy()
        state, _ = alg.apply(state, [grad_result(k, k, g)])
        lr_k = 0.3 * alg.factor(k)
        assert np.array_equal(state.x, before - np.asarray(lr_k, F32) * g), k


# ---------------------------------------------------------------- clipping and weight decay

INNER = {"ordered-momentum": {"lr": 0.5, "beta": 0.3}, "ringmaster": {"lr": 0.5, "R": 3}}


def run_pair(name: str, wrappers: dict, replies):
    """(wrapped state, inner state) after feeding ``replies`` (list of (created_at, g_wrapped, g_inner))."""
    wrapped = algorithms.build(name, {**INNER[name], **wrappers})
    inner = algorithms.build(name, INNER[name])
    assert unwrap(wrapped) == inner
    sw, _ = wrapped.init(x0(), seed=0)
    si, _ = inner.init(x0(), seed=0)
    for j, (c, gw, gi) in enumerate(replies):
        sw, ow = wrapped.apply(sw, [grad_result(j, c, gw)])
        si, oi = inner.apply(si, [grad_result(j, c, gi)])
        assert ow.applied == oi.applied and ow.dropped == oi.dropped
    return wrapped, sw, si


@pytest.mark.parametrize("name", sorted(INNER))
def test_clipping_a_reply_of_norm_10_to_1_is_the_inner_update_with_g_over_10(name):
    small = np.array([0.1, -0.2, 0.3, 0.0], F32)  # ‖·‖ < 1: passed on unchanged
    big = np.array([6.0, 0.0, -8.0, 0.0], F32)  # ‖·‖ = 10 exactly
    assert global_norm(big) == 10.0
    wrapped, sw, si = run_pair(name, {"clip_norm": 1.0}, [(0, small, small), (0, big, big / F32(10))])
    assert sw.version == si.version == 2
    assert np.array_equal(sw.x, si.x)
    if name == "ordered-momentum":
        assert np.array_equal(sw.m, si.m)
    # and not the unclipped update (the test can tell the two apart)
    _, s_raw, _ = run_pair(name, {}, [(0, small, small), (0, big, big)])
    assert not np.array_equal(s_raw.x, sw.x)


@pytest.mark.parametrize("name", sorted(INNER))
def test_weight_decay_shrinks_x_by_exactly_lr_lambda_x_after_each_update(name):
    lam = 0.01
    g = np.array([0.5, -1.0, 0.25, 2.0], F32)
    wrapped = algorithms.build(name, {**INNER[name], "weight_decay": lam})
    inner = algorithms.build(name, INNER[name])
    sw, _ = wrapped.init(x0(), seed=0)
    for k in range(3):
        si = copy.deepcopy(sw)  # the inner algorithm from the same (decayed) state ...
        sw, _ = wrapped.apply(sw, [grad_result(k, k, g)])
        si, _ = inner.apply(si, [grad_result(k, k, g)])
        expected = si.x - np.asarray(0.5 * lam, F32) * si.x  # ... then x − lr·λ·x by hand
        assert sw.version == k + 1 and np.array_equal(sw.x, expected), k
        assert not np.array_equal(sw.x, si.x) and not sw.x.flags.writeable
        if name == "ordered-momentum":
            assert np.array_equal(sw.m, si.m)


def test_weight_decay_uses_the_scheduled_lr_and_skips_dropped_replies():
    lam = 0.1
    g = np.array([1.0, 1.0, 1.0, 1.0], F32)
    wrapped = algorithms.build("ringmaster", {"lr": 0.4, "R": 2, "warmup": 4, "weight_decay": lam})
    state, _ = wrapped.init(x0(), seed=0)
    state, out = wrapped.apply(state, [grad_result(0, 0, g)])  # k = 0: lr_0 = 0.4 · 1/4
    lr0 = 0.4 / 4
    stepped = x0() - np.asarray(lr0, F32) * g
    assert np.array_equal(state.x, stepped - np.asarray(lr0 * lam, F32) * stepped)
    state, _ = wrapped.apply(state, [grad_result(1, 1, g)])
    before = state.x
    state, out = wrapped.apply(state, [grad_result(2, 0, g)])  # age 2 >= R: dropped, no update, no decay
    assert out.dropped == (2,) and not out.updated and state.x is before


def test_weight_decay_outside_a_schedule_uses_the_scheduled_lr_too():
    """Either order of WeightDecay and LRSchedule decays with lr_k (chain puts the schedule outside)."""
    base = RingmasterASGD(lr=0.4, R=100)
    outer = WeightDecay(LRSchedule(base, warmup=4), weight_decay=0.1)
    inner = LRSchedule(WeightDecay(base, weight_decay=0.1), warmup=4)
    g = np.array([1.0, -1.0, 0.5, 2.0], F32)
    so, _ = outer.init(x0(), seed=0)
    si, _ = inner.init(x0(), seed=0)
    for k in range(6):
        so, _ = outer.apply(so, [grad_result(k, k, g)])
        si, _ = inner.apply(si, [grad_result(k, k, g)])
        assert np.array_equal(so.x, si.x), k


def test_weight_decay_and_clipping_compose_in_one_update():
    lam, big = 0.02, np.array([0.0, 30.0, 0.0, 40.0], F32)  # ‖·‖ = 50, clip_norm 5: g/10
    wrapped = algorithms.build("ordered-momentum", {"lr": 0.5, "beta": 0.3, "clip_norm": 5.0, "weight_decay": lam})
    inner = OrderedMomentum(lr=0.5, beta=0.3)
    sw, _ = wrapped.init(x0(), seed=0)
    si, _ = inner.init(x0(), seed=0)
    sw, ow = wrapped.apply(sw, [grad_result(0, 0, big)])
    si, _ = inner.apply(si, [grad_result(0, 0, big / F32(10))])
    assert np.array_equal(sw.x, si.x - np.asarray(0.5 * lam, F32) * si.x)
    assert np.array_equal(sw.m, si.m)
    assert ow.metrics["grad_norm"] == 50.0


def test_pair_replies_are_clipped_by_the_newer_gradient_and_full_gradients_not_at_all():
    clip = ClipGradNorm(RingmasterASGD(), clip_norm=1.0)
    newer = np.array([0.0, 6.0, 8.0, 0.0], F32)  # ‖·‖ = 10
    older = np.array([0.0, 60.0, 80.0, 0.0], F32)  # ‖·‖ = 100: must not set the factor
    pair = grad_result(0, 5, (newer, older), kind=JobKind.GRAD_PAIR, ids=(5, 4))
    out, norm = clip.clip(pair)
    assert norm == 10.0
    assert np.array_equal(out.grads[0], newer / F32(10)) and np.array_equal(out.grads[1], older / F32(10))
    small_newer = grad_result(1, 5, (newer / F32(20), older), kind=JobKind.GRAD_PAIR, ids=(5, 4))
    out, _ = clip.clip(small_newer)
    assert out is small_newer  # the newer gradient is within the bound: both pass unchanged
    full = Result(job_id=2, worker_id="w", created_at=0, kind=JobKind.FULL_GRAD, iterate_ids=(0,),
                  grads=(older,), count=100, shard=(0, 100))
    out, norm = clip.clip(full)
    assert out is full and norm is None


def test_the_clipping_norm_is_global_over_all_layout_blocks():
    """Blocks of norm 3 and 4 are each within clip_norm = 4; the whole vector (5) is not."""
    alg = algorithms.build("asgd", {"lr": 1.0, "clip_norm": 4.0}).bind((("a", (2,)), ("b", (2,))))
    state, _ = alg.init(np.zeros(4, F32), seed=0)
    g = np.array([3.0, 0.0, 0.0, 4.0], F32)
    state, _ = alg.apply(state, [grad_result(0, 0, g)])
    assert np.array_equal(state.x, np.zeros(4, F32) - g / F32(1.25))


def test_global_norm_is_the_float64_euclidean_norm():
    g = np.random.default_rng(3).standard_normal(200_003).astype(F32)
    assert global_norm(g) == pytest.approx(float(np.linalg.norm(g.astype(np.float64))), rel=1e-13)


# ---------------------------------------------------------------- transparency

def test_wrapped_algorithms_look_like_the_inner_one_to_the_core():
    w = algorithms.build("ringmaster", {"lr": 0.5, "R": 2, "lr_schedule": "cosine", "decay_steps": 50,
                                        "weight_decay": 1e-3, "clip_norm": 1.0})
    assert isinstance(w, LRSchedule) and isinstance(w.inner, WeightDecay) and isinstance(w.inner.inner, ClipGradNorm)
    inner = unwrap(w)
    assert (w.name, w.mode, w.state_class(), w.R, w.lr) == ("ringmaster", "per_reply", inner.state_class(), 2, 0.5)
    s, _ = w.init(x0(), seed=0)
    si, _ = inner.init(x0(), seed=0)
    assert w.to_state_dict(s).keys() == inner.to_state_dict(si).keys()
    s = w.from_state_dict(inner.to_state_dict(si))
    assert w.version(s) == 0 and np.array_equal(w.params(s), x0())

    @dataclass
    class Job:
        job_id: int
        created_at: int
        kind: JobKind = JobKind.GRAD

    s.version = 5
    assert w.cancel(s, [Job(1, 2), Job(2, 4), Job(3, 3)]) == inner.cancel(s, [Job(1, 2), Job(2, 4), Job(3, 3)]) \
        == [1, 3]
    assert w.live_iterate_ids(s) == inner.live_iterate_ids(s)
    assert w.metrics(s) == {"lr": w.lr_at(5)}
    storm = algorithms.build("storm-vr", {"clip_norm": 1.0, "weight_decay": 1e-4})
    assert storm.mode == "round" and storm.name == "storm-vr"


def test_a_schedule_keeps_a_bound_layout_when_it_sets_the_lr():
    layout = (("w", (2, 3)), ("b", (2,)))
    w = algorithms.build("rennala-muon", {"lr": 0.2, "B": 1, "warmup": 2}).bind(layout)
    inner = algorithms.build("rennala-muon", {"lr": 0.1, "B": 1}).bind(layout)  # lr_0 = 0.2 · 1/2
    assert unwrap(w).layout == layout
    g = np.random.default_rng(1).standard_normal(8).astype(F32)
    sw, _ = w.init(np.ones(8, F32), seed=0)
    si, _ = inner.init(np.ones(8, F32), seed=0)
    sw, ow = w.apply(sw, [grad_result(0, 0, g)])
    si, _ = inner.apply(si, [grad_result(0, 0, g)])
    assert ow.updated and np.array_equal(sw.x, si.x)
    assert ow.metrics["lr"] == 0.1 and "batch_fill" in ow.metrics


def test_an_algorithm_reporting_its_own_lr_keeps_that_figure():
    w = algorithms.build("delay-adaptive", {"lr": 0.4, "n_workers": 2, "warmup": 2})
    s, _ = w.init(x0(), seed=0)
    s.version = 8
    s, out = w.apply(s, [grad_result(0, 0, np.ones(4, F32))])  # age 8: lr·n/δ = 0.4 · 2/8
    assert out.metrics["lr"] == pytest.approx(0.1)


# ---------------------------------------------------------------- errors

@dataclass(frozen=True)
class NoLR(Algorithm):
    """An algorithm without an lr.

    Args:
        step: the step.
        gamma: its own gamma (wins over the wrapper key of the same name).
    """

    name = "no-lr"
    step: float = 0.1
    gamma: float = 0.5


@pytest.mark.parametrize("settings,needle", [
    ({"lr_schedule": "cosine", "decay_steps": 10}, "needs an algorithm with an lr hyper-parameter; no-lr has none"),
    ({"warmup": 5}, "needs an algorithm with an lr"),
    ({"weight_decay": 0.1}, "weight_decay needs an algorithm with an lr"),
])
def test_schedules_and_weight_decay_need_an_lr(settings, needle):
    with pytest.raises(ValueError, match=needle):
        registry_build({"no-lr": NoLR}, "no-lr", settings)


def test_an_own_hyper_parameter_wins_over_a_wrapper_key_of_the_same_name():
    alg = registry_build({"no-lr": NoLR}, "no-lr", {"gamma": "0.25", "clip_norm": "2"})
    assert isinstance(alg, ClipGradNorm) and unwrap(alg).gamma == 0.25


@pytest.mark.parametrize("name,settings,needle", [
    ("ordered-mu2", {"weight_decay": 0.1}, "weight_decay is not supported by ordered-mu2"),
    ("asgd", {"lr_schedule": "cosine"}, "lr_schedule=cosine needs decay_steps"),
    ("asgd", {"lr_schedule": "linear", "warmup": 10, "decay_steps": 10}, "must be > warmup=10"),
    ("asgd", {"lr_schedule": "step"}, "lr_schedule=step needs step_every"),
    ("asgd", {"lr_schedule": "exp"}, "Invalid lr_schedule: 'exp'"),
    ("asgd", {"gamma": 0.5}, "gamma does not apply to lr_schedule=constant"),
    ("asgd", {"lr_schedule": "cosine", "decay_steps": 9, "step_every": 3}, "step_every does not apply"),
    ("asgd", {"clip_norm": 0}, "Invalid clip_norm"),
    ("asgd", {"weight_decay": "much"}, "Invalid weight_decay: 'much' (expected float)"),
    ("asgd", {"min_lr_ratio": 2, "lr_schedule": "cosine", "decay_steps": 9}, "Invalid min_lr_ratio"),
    ("asgd", {"clip": 1}, "unknown hyper-parameter 'clip' for asgd (known: lr; wrappers: lr_schedule"),
])
def test_bad_wrapper_settings_are_one_line_errors(name, settings, needle):
    with pytest.raises(ValueError) as e:
        algorithms.build(name, settings)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_decay_steps_defaults_to_max_steps_and_is_recorded():
    from algorithms.registry import complete_settings

    alg = algorithms.build("asgd", {"lr_schedule": "cosine"}, max_steps=300)
    assert alg.decay_steps == 300
    done = complete_settings(algorithms.ALGORITHMS, "asgd", {"lr_schedule": "cosine"}, max_steps=300)
    assert done == {"lr_schedule": "cosine", "decay_steps": 300}
    assert complete_settings(algorithms.ALGORITHMS, "asgd", {"lr_schedule": "cosine", "decay_steps": "7"},
                             max_steps=300)["decay_steps"] == "7"
    assert complete_settings(algorithms.ALGORITHMS, "asgd", {"lr_schedule": "step"}, max_steps=300) == \
        {"lr_schedule": "step"}


def test_block_sq_sums_are_each_blocks_float64_squared_norm_and_the_norm_their_exact_sum():
    layout = (("w", (30, 70)), ("b", (30,)), ("e", (0,)), ("v", (200_000,)))
    rng = np.random.default_rng(3)
    g = rng.standard_normal(30 * 70 + 30 + 200_000).astype(np.float32)
    sums = block_sq_sums(g, layout)
    bounds = np.cumsum([0, 2100, 30, 0, 200_000])
    for s, lo, hi in zip(sums, bounds[:-1], bounds[1:], strict=True):
        assert s == pytest.approx(float(np.dot(g[lo:hi].astype(np.float64), g[lo:hi].astype(np.float64))), rel=1e-13)
    assert sums[2] == 0.0
    assert norm_from_block_sq(sums) == pytest.approx(float(np.linalg.norm(g.astype(np.float64))), rel=1e-13)
    assert norm_from_block_sq(sums[::-1]) == norm_from_block_sq(sums)  # exactly rounded: order-free
    # a copy elsewhere in memory, or the block alone, gives the same bits (what a shard measures)
    assert block_sq_sums(np.array(g[2130:], copy=True), layout[3:]) == sums[3:]
    with pytest.raises(ValueError, match="layout of"):
        block_sq_sums(g[:-1], layout)


def test_clip_uses_the_block_sq_it_is_given_else_measures_over_its_layout():
    layout = (("a", (3,)), ("b", (4,)))
    alg = bind_layout(ClipGradNorm(algorithms.build("asgd", {"lr": 1.0}), clip_norm=1.0), layout)
    g = np.array([3, 0, 0, 4, 0, 0, 0], np.float32)  # norm 5
    r = Result(job_id=0, worker_id="w", created_at=0, kind=JobKind.GRAD, iterate_ids=(0,), grads=(g,))
    out, norm = alg.clip(r)
    assert norm == 5.0 and np.array_equal(out.grads[0], g / np.float32(5))
    given, norm = alg.clip(dataclasses.replace(r, block_sq=(64.0, 36.0)))  # a shard's figures: norm 10
    assert norm == 10.0 and np.array_equal(given.grads[0], g / np.float32(10))
    assert alg.needs_block_norms() and not algorithms.build("asgd").needs_block_norms()
    assert LRSchedule(alg, warmup=2).needs_block_norms()
