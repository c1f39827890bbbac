"""Issue 17, first acceptance point: the parameter vector sharded over S server shards
(algorithms/sharding.py) is bit-identical to S = 1 in the simulator.

Each algorithm runs on the digits MLP (four blocks: two weight matrices, two bias vectors) with
5 workers of sqrt-heterogeneous speeds plus noise, a crash and rejoin, and replies lost in
transit (so write-offs reach ``on_lost``), for S = 1 (the algorithm itself, no wrapper), 2 and 5
(more shards than blocks: blocks whose vector work is elementwise are cut; Muon's matrices stay
whole).
The final iterates must be equal byte for byte and the applied (job id, created_at) sequences
equal. Also: the block assignment, the refusals, and that a shard deciding differently raises.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest

import algorithms
from algorithms.base import Algorithm, bind_layout
from algorithms.sharding import ShardDisagreement, Sharded, plan_shards
from problems.digits import make_digits
from ps.core.config import CoreConfig
from ps.drivers.sim import Crash, DelayModel, Simulator

N_WORKERS = 5
UPDATES = 240


@pytest.fixture(scope="module")
def digits():
    """The digits MLP, with torch on one thread while this module runs: its gradients are tiny
    (about 70 ms instead of 2 ms each were measured with torch's default threads on a loaded
    2-core machine); the thread count it had is restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield make_digits()
    finally:
        torch.set_num_threads(threads)


def cases(n_samples: int) -> dict[str, tuple[str, dict, int]]:
    """case -> (registry name, settings, model updates to run). The Rennala methods use B
    gradients (pairs) per update and restart the others' jobs, so they run fewer updates."""
    return {
        "asgd": ("asgd", {"lr": 0.1}, UPDATES),
        "ordered-momentum": ("ordered-momentum", {"lr": 0.2, "beta": 0.3}, UPDATES),
        "ordered-momentum+wrappers": ("ordered-momentum", {"lr": 0.2, "beta": 0.3, "lr_schedule": "cosine",
                                                           "decay_steps": UPDATES, "warmup": 10,
                                                           "weight_decay": 0.01}, UPDATES),
        "ringmaster": ("ringmaster", {"lr": 0.1, "R": 3}, UPDATES),
        "rennala": ("rennala", {"lr": 0.2, "B": 3}, 70),
        "rennala-mvr": ("rennala-mvr", {"lr": 0.1, "B": 3, "B_init": 6, "p": 0.3}, 50),
        "storm-vr": ("storm-vr", {"lr": 0.1, "a": 0.3, "B_init": 8, "tau_lost": 20}, 200),
        "snapshot-vr": ("snapshot-vr", {"lr": 0.1, "m": 25, "D": 6, "num_samples": n_samples, "shards": 2,
                                        "batch": 16}, 150),
        "ringmaster-lmo-sign": ("ringmaster-lmo", {"lmo": "sign", "lr": 0.002, "R": 3}, 150),
        "ringmaster-lmo-muon": ("ringmaster-lmo", {"lmo": "muon", "lr": 0.02, "R": 3}, 150),
        # beyond the list: the rest of the registry, which declares itself shardable too
        "naive-momentum": ("naive-momentum", {"lr": 0.1}, 100),
        "delay-adaptive": ("delay-adaptive", {"lr": 0.1, "n_workers": N_WORKERS}, 100),
        "delay-filtered": ("delay-filtered", {"lr": 0.1, "tau_max": 3}, 100),
        "ordered-mu2": ("ordered-mu2", {"lr": 0.1}, 100),
        "rennala-mvr-inexact": ("rennala-mvr-inexact", {"lr": 0.1, "B": 3, "B_init": 6}, 50),
        "rennala-muon": ("rennala-muon", {"lr": 0.05, "B": 3}, 50),
        "delay-adaptive-muon": ("delay-adaptive-muon", {"lr": 0.02, "n_workers": N_WORKERS}, 100),
        # the wrapped case first: the blocks test below reads the later (plain) case of a name
        "adamw+wrappers": ("adamw", {"lr": 0.01, "lr_schedule": "cosine", "decay_steps": UPDATES, "warmup": 10},
                           UPDATES),
        "adamw": ("adamw", {"lr": 0.01, "weight_decay": 0.05}, UPDATES),
        "adam": ("adam", {"lr": 0.01, "weight_decay": 1e-3}, 100),
    }


CASES = list(cases(0))


def run(problem, alg: Algorithm, shards: int, updates: int = UPDATES):
    cfg = CoreConfig(min_workers=N_WORKERS, liveness_timeout_s=4.0, seed=3, batch_size=16)
    sim = Simulator(alg, problem, DelayModel.named("sqrt", N_WORKERS), cfg, seed=5, shards=shards,
                    crashes=(Crash(worker=1, at=15.0, rejoin_after=6.0),), loss_prob=0.03)
    trace = sim.run(max_updates=updates, max_time=2000.0)
    return trace, [(a[0], a[1]) for a in trace.applied]


@pytest.mark.parametrize("case", CASES)
def test_sharded_runs_are_bit_identical_to_one_shard(digits, case):
    name, settings, updates = cases(digits.num_samples)[case]
    base, base_applied = run(digits, algorithms.build(name, settings), 1, updates)
    assert base.counters["updates"] == updates
    assert base.counters["lost"] > 0, "the scenario writes jobs off (on_lost is exercised)"
    assert len(set(base_applied)) == len(base_applied) > 0
    for s in (2, 5):
        trace, applied = run(digits, algorithms.build(name, settings), s, updates)
        assert trace.final_x.dtype == base.final_x.dtype
        assert trace.final_x.tobytes() == base.final_x.tobytes(), f"S = {s}: final iterate differs"
        assert applied == base_applied, f"S = {s}: applied (job id, created_at) sequence differs"
        assert trace.counters == base.counters


def test_every_registered_algorithm_is_checked():
    assert {name for name, _, _ in cases(0).values()} == set(algorithms.ALGORITHMS)


def test_the_wrapper_with_one_shard_is_the_algorithm_itself(digits):
    settings = cases(digits.num_samples)["ringmaster-lmo-muon"][1]
    plain, plain_applied = run(digits, algorithms.build("ringmaster-lmo", settings), 1, updates=80)
    alg = bind_layout(Sharded(algorithms.build("ringmaster-lmo", settings), n_shards=1), digits.layout)
    one, one_applied = run(digits, alg, 1, updates=80)
    assert one.final_x.tobytes() == plain.final_x.tobytes() and one_applied == plain_applied


LAYOUTS = [
    (("fc1.weight", (32, 64)), ("fc1.bias", (32,)), ("fc2.weight", (10, 32)), ("fc2.bias", (10,))),
    (("a", (3,)), ("b", (4, 5)), ("c", (1,)), ("d", (7, 2)), ("e", (6,)), ("f", (2, 2, 2))),
    (("only", (5, 5)),),
    (("z", (0,)), ("m", (3, 3)), ("v", (4,))),
]


def brute_force_best(sizes: list[int], s: int) -> int:
    best = math.inf
    for cuts in itertools.combinations(range(1, len(sizes)), s - 1):
        b = (0, *cuts, len(sizes))
        best = min(best, max(sum(sizes[b[i]:b[i + 1]]) for i in range(s)))
    return best


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_assignment_never_splits_a_block_and_covers_every_coordinate_once(layout):
    sizes = [math.prod(shape) for _, shape in layout]
    d = sum(sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for s in range(1, len(layout) + 1):
        plan = plan_shards(layout, s)
        assert plan.shards == s
        owner = np.full(d, -1)
        for i, ((a, b), (lo, hi)) in enumerate(zip(plan.blocks, plan.ranges, strict=True)):
            assert b > a, "every shard owns at least one block"
            assert (lo, hi) == (offsets[a], offsets[b]), "a shard's range is exactly its whole blocks"
            assert plan.sub_layout(i) == layout[a:b]
            assert (owner[lo:hi] == -1).all(), "no coordinate is owned twice"
            owner[lo:hi] = i
        assert (owner >= 0).all(), "every coordinate is owned"
        for k in range(len(sizes)):  # a block (a matrix) lies on one shard
            assert len(set(owner[offsets[k]:offsets[k + 1]].tolist())) <= 1
        assert [b - a for a, b in plan.blocks] and plan.blocks[0][0] == 0 and plan.blocks[-1][1] == len(layout)
        largest = max(hi - lo for lo, hi in plan.ranges)
        assert largest == brute_force_best(sizes, s), "balanced: the largest shard is as small as it can be"
    with pytest.raises(ValueError, match="never split"):
        plan_shards(layout, len(layout) + 1)


def test_lmo_mask_is_sliced_with_the_blocks():
    layout = LAYOUTS[1]
    mask = (False, True, False, True, False, True)
    alg = bind_layout(Sharded(algorithms.build("ringmaster-lmo"), n_shards=3), layout, mask)
    got = [part.lmo_mask for part in alg.parts]
    assert [m for p in got for m in p] == list(mask)
    assert [part.layout for part in alg.parts] == [alg.plan.sub_layout(i) for i in range(3)]


def test_a_shard_that_decides_differently_raises(digits):
    alg = bind_layout(Sharded(algorithms.build("ringmaster", {"lr": 0.1, "R": 3}), n_shards=2), digits.layout)
    other = bind_layout(algorithms.build("ringmaster", {"lr": 0.1, "R": 1}), alg.plan.sub_layout(1))
    with pytest.raises(ShardDisagreement, match="shard 1 disagrees with the coordinator"):
        run(digits, alg.with_parts([alg.parts[0], other]), 1, updates=60)


@dataclass(frozen=True)
class DropsLargeGradients(algorithms.ALGORITHMS["asgd"]):
    """Claims to be shardable, but decides from the vector: drops a reply whose |g|_1 is large."""

    name = "drops-large"

    def apply(self, state, results):
        keep = [r for r in results if float(np.abs(r.grads[0]).sum()) <= 5.0]
        state, out = super().apply(state, keep)
        return state, dataclasses.replace(out, dropped=tuple(r.job_id for r in results if r not in keep))


def test_a_decision_that_reads_the_vector_disagrees_with_the_coordinator_even_on_one_shard(digits):
    alg = bind_layout(Sharded(DropsLargeGradients(lr=0.1), n_shards=1), digits.layout)
    with pytest.raises(ShardDisagreement, match="shard 0 disagrees with the coordinator on the outcome"):
        run(digits, alg, 1, updates=60)


CLIPPED = {
    "asgd+clip": ("asgd", {"lr": 0.1, "clip_norm": 0.3}, 120),
    "storm-vr+clip": ("storm-vr", {"lr": 0.1, "a": 0.3, "B_init": 8, "tau_lost": 20, "clip_norm": 0.3}, 100),
    "ordered-momentum+clip+wrappers": ("ordered-momentum", {"lr": 0.2, "beta": 0.3, "clip_norm": 0.3,
                                                            "weight_decay": 0.01, "warmup": 10}, 120),
}


@pytest.mark.parametrize("case", list(CLIPPED))
def test_clip_norm_sharded_is_bit_identical_to_one_shard(digits, case):
    """Global-norm clipping is a reduction over every block: each instance gets the gradient's
    per-block squared norms (Result.block_sq), measured on the whole gradient, so every shard clips
    by the one factor. S = 2, 3, 4 (whole blocks: the digits MLP has 4) against S = 1, and the
    clip did act (the run differs from the unclipped one, and grad_norm passed clip_norm)."""
    name, settings, updates = CLIPPED[case]
    base, base_applied = run(digits, algorithms.build(name, settings), 1, updates)
    assert base.counters["updates"] == updates and base.counters["lost"] > 0
    norms = [m["grad_norm"] for m in base.metrics if "grad_norm" in m]
    assert norms and sum(n > settings["clip_norm"] for n in norms) > len(norms) // 2, "the clip must act"
    plain = {k: v for k, v in settings.items() if k != "clip_norm"}
    unclipped, _ = run(digits, algorithms.build(name, plain), 1, updates)
    assert unclipped.final_x.tobytes() != base.final_x.tobytes()
    for s in (2, 3, 4):
        trace, applied = run(digits, algorithms.build(name, settings), s, updates)
        assert trace.final_x.tobytes() == base.final_x.tobytes(), f"S = {s}: final iterate differs"
        assert applied == base_applied, f"S = {s}: applied (job id, created_at) sequence differs"
        assert trace.counters == base.counters


def test_clip_norm_keeps_blocks_whole(digits):
    """The norm's per-block sums are taken by the shard holding the block whole: with clip_norm a
    block is never cut, so 5 shards over the MLP's 4 blocks are refused with the count."""
    with pytest.raises(ValueError, match="at most 4"):
        bind_layout(Sharded(algorithms.build("asgd", {"clip_norm": 1.0}), n_shards=5), digits.layout)
    alg = bind_layout(Sharded(algorithms.build("asgd", {"clip_norm": 1.0}), n_shards=4), digits.layout)
    assert not alg.plan.split and alg.needs_block_norms()


L2 = {
    "ringmaster-lmo-l2": ("ringmaster-lmo", {"lmo": "l2", "lr": 0.05, "R": 3}, 120),
    "ringmaster-lmo-l2-nesterov+clip": ("ringmaster-lmo", {"lmo": "l2", "lr": 0.05, "R": 3, "nesterov": True,
                                                           "schedule": "agnostic", "clip_norm": 0.3}, 120),
}


@pytest.mark.parametrize("case", list(L2))
def test_lmo_l2_sharded_is_bit_identical_to_one_shard(digits, case):
    """lmo='l2' steps by u/‖u‖, the norm of the whole momentum (server state no worker sends): each
    shard's blocks' ‖u_b‖² on its state before the step are gathered per reply (Result.step_sq),
    so every shard divides by the one norm. S = 2, 3, 4 against S = 1; and the step is of length
    lr whatever S: ‖x_{k+1} − x_k‖ = η (an independent check that the norm is the whole u's)."""
    name, settings, updates = L2[case]
    base, base_applied = run(digits, algorithms.build(name, settings), 1, updates)
    assert base.counters["updates"] == updates and base.counters["lost"] > 0
    for s in (2, 3, 4):
        trace, applied = run(digits, algorithms.build(name, settings), s, updates)
        assert trace.final_x.tobytes() == base.final_x.tobytes(), f"S = {s}: final iterate differs"
        assert applied == base_applied, f"S = {s}: applied (job id, created_at) sequence differs"
        assert trace.counters == base.counters
    if case == "ringmaster-lmo-l2":  # one step by hand, S = 3: a step of length lr exactly (to float32)
        alg = bind_layout(Sharded(algorithms.build(name, settings), n_shards=3), digits.layout)
        state, _ = alg.init(digits.init_params(0), seed=0)
        x0 = alg.params(state).astype(np.float64)
        g = np.random.default_rng(1).standard_normal(x0.size).astype(np.float32)
        from algorithms.base import Result
        from protocol.messages import JobKind

        state, out = alg.apply(state, [Result(job_id=0, worker_id="w", created_at=0, kind=JobKind.GRAD,
                                              iterate_ids=(0,), grads=(g,))])
        assert out.applied == (0,)
        assert np.linalg.norm(alg.params(state).astype(np.float64) - x0) == pytest.approx(0.05, rel=1e-5)


@dataclass(frozen=True)
class Undeclared(Algorithm):
    name = "undeclared"


def test_an_algorithm_that_does_not_declare_per_block_work_is_refused(digits):
    with pytest.raises(ValueError, match="does not say"):
        bind_layout(Sharded(Undeclared(), n_shards=2), digits.layout)


def test_state_dict_round_trip_of_a_sharded_state(digits):
    alg = bind_layout(Sharded(algorithms.build("ordered-momentum"), n_shards=3), digits.layout)
    state, _ = alg.init(digits.init_params(0), seed=0)
    back = alg.from_state_dict(alg.to_state_dict(state))
    assert alg.params(back).tobytes() == alg.params(state).tobytes() and alg.version(back) == 0


def test_digits_full_gradient_is_the_sum_of_its_parts(digits):
    x = digits.init_params(0)
    n = digits.num_samples
    whole, count, loss_sum = digits.full_grad(x, 0, n)
    a, ca, la = digits.full_grad(x, 0, 500)
    b, cb, lb = digits.full_grad(x, 500, n)
    assert count == n == ca + cb and whole.shape == (digits.dim,) and whole.dtype == np.float32
    np.testing.assert_allclose(a + b, whole, rtol=1e-4, atol=1e-5)
    assert math.isclose(la + lb, loss_sum, rel_tol=1e-5)
    mean = digits.grad(x, seed=0, batch_size=n).grad  # a batch of every training image: the mean gradient
    np.testing.assert_allclose(whole / n, mean, rtol=1e-3, atol=1e-6)
    with pytest.raises(ValueError, match="not inside"):
        digits.full_grad(x, 0, n + 1)


def test_simulate_shards_writes_the_same_final_iterate(tmp_path):
    from click.testing import CliRunner

    from ps.cli.main import main

    outs = []
    for s in (1, 2, 7):  # 7 shards of digits' 4 blocks: ringmaster's work is elementwise, so blocks are cut
        out = tmp_path / f"s{s}"
        r = CliRunner().invoke(main, ["simulate", "--problem", "digits", "--algorithm", "ringmaster", "--workers", "3",
                                      "--max-steps", "40", "--shards", str(s), "--out", str(out)])
        assert r.exit_code == 0, r.output
        outs.append(np.load(out / "final_x.npy"))
    assert outs[0].dtype == np.float32 and outs[0].tobytes() == outs[1].tobytes() == outs[2].tobytes()
    # Muon keeps its two matrices whole (2 atoms) and may cut its biases (32 + 10 coordinates): 44 shards at most.
    r = CliRunner().invoke(main, ["simulate", "--problem", "digits", "--algorithm", "ringmaster-lmo", "--max-steps",
                                  "5", "--shards", "1000", "--out", str(tmp_path / "s1000")])
    assert r.exit_code != 0 and "cannot shard" in r.output and "at most 44" in r.output, r.output
    assert "whole: fc1.weight, fc2.weight" in r.output


@pytest.mark.parametrize("case", ["storm-vr", "ringmaster-lmo-muon"])
def test_a_sharded_core_through_a_checkpoint_file_continues_bit_for_bit(digits, case, tmp_path):
    from ps.core.server_core import ServerCore
    from ps.journal.checkpoints import read_checkpoint, write_checkpoint

    name, settings, _ = cases(digits.num_samples)[case]

    def make():
        cfg = CoreConfig(min_workers=N_WORKERS, liveness_timeout_s=4.0, seed=3, batch_size=16)
        return Simulator(algorithms.build(name, settings), digits, DelayModel.named("sqrt", N_WORKERS), cfg, seed=5,
                         shards=3, crashes=(Crash(worker=1, at=15.0, rejoin_after=6.0),), loss_prob=0.03)

    plain, restored = make(), make()
    plain.run(max_time=25.0)
    restored.run(max_time=25.0)
    at = restored.core.version
    _, snap = read_checkpoint(write_checkpoint(str(tmp_path), 1, restored.core.snapshot()))
    assert sorted(snap["alg_state"]) == ["coordinator", "shard0", "shard1", "shard2"], "one state per shard"
    restored.core = ServerCore.restore(restored.core.alg, snap, restored.core.cfg, server_boot=1)
    a, b = plain.run(max_time=60.0), restored.run(max_time=60.0)
    assert a.final_x.tobytes() == b.final_x.tobytes()
    assert [x[:2] for x in a.applied] == [x[:2] for x in b.applied]
    assert restored.core.version == plain.core.version > at > 0, "updates before and after the checkpoint"


def test_a_refused_algorithm_is_refused_with_one_shard_too(digits):
    """The coordinator runs it on no vector at all: a user's algorithm that does not say its vector
    work is per block is refused even with one shard."""
    with pytest.raises(ValueError, match="does not say"):
        bind_layout(Sharded(Undeclared(), n_shards=1), digits.layout)


def brute_force_split(sizes: list[int], splittable: list[bool], s: int) -> int:
    """The smallest largest shard over every way to cut at block boundaries or inside splittable blocks."""
    prefix = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
    allowed = set(prefix[1:-1])
    for k, sp in enumerate(splittable):
        if sp:
            allowed.update(range(prefix[k] + 1, prefix[k + 1]))
    allowed = sorted(c for c in allowed if 0 < c < prefix[-1])
    best = math.inf
    for cuts in itertools.combinations(allowed, s - 1):
        b = (0, *cuts, prefix[-1])
        best = min(best, max(b[i + 1] - b[i] for i in range(s)))
    return best


def test_blocks_are_cut_only_where_splittable_and_the_largest_shard_is_as_small_as_it_can_be():
    rng = np.random.default_rng(11)
    for _ in range(150):
        n = int(rng.integers(1, 5))
        sizes = [int(v) for v in rng.integers(1, 7, n)]
        splittable = [bool(v) for v in rng.random(n) < 0.5]
        splittable[int(rng.integers(n))] = True
        layout = tuple((f"b{k}", (v,)) for k, v in enumerate(sizes))
        atoms = sum(v if sp else 1 for v, sp in zip(sizes, splittable, strict=True))
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        for s in range(1, 6):
            if s > atoms:
                with pytest.raises(ValueError, match=f"at most {atoms}"):
                    plan_shards(layout, s, splittable)
                continue
            plan = plan_shards(layout, s, splittable)
            assert plan.shards == s and plan.ranges[0][0] == 0 and plan.ranges[-1][1] == sum(sizes)
            assert all(hi > lo for lo, hi in plan.ranges), "every shard owns a coordinate"
            assert all(plan.ranges[i][1] == plan.ranges[i + 1][0] for i in range(s - 1)), "contiguous, once each"
            for k in range(n):
                owners = {i for i, (lo, hi) in enumerate(plan.ranges) if lo < offsets[k + 1] and hi > offsets[k]}
                assert splittable[k] or len(owners) == 1, "a block that may not be split lies on one shard"
            for i in range(s):
                sub = plan.sub_layout(i)
                assert sum(math.prod(shape) for _, shape in sub) == plan.ranges[i][1] - plan.ranges[i][0]
            largest = max(hi - lo for lo, hi in plan.ranges)
            assert largest == brute_force_split(sizes, splittable, s), (sizes, splittable, s, plan.ranges)


def test_a_split_block_is_a_flat_piece_and_the_mask_follows_it():
    layout = (("w", (4, 3)), ("b", (3,)), ("v", (10,)))
    plan = plan_shards(layout, 4, (False, True, True))
    assert plan.ranges == ((0, 12), (12, 16), (16, 20), (20, 25))
    assert plan.sub_layout(0) == (("w", (4, 3)),)
    assert plan.sub_layout(1) == (("b", (3,)), ("v[0:1]", (1,)))
    assert plan.sub_layout(3) == (("v[5:10]", (5,)),)
    # without a problem's mask: the default rule read on the whole layout (w gets Newton-Schulz), not on the pieces
    assert [plan.sub_mask(i, None) for i in range(4)] == [(True,), (False, False), (False,), (False,)]
    assert plan.sub_mask(1, (False, True, False)) == (True, False)
    # one 40 MB vector over 4 shards: equal quarters
    assert plan_shards((("x", (10_000_000,)),), 4, (True,)).ranges == tuple(
        (q * 2_500_000, (q + 1) * 2_500_000) for q in range(4))


def test_each_algorithm_says_which_blocks_it_may_split():
    layout = LAYOUTS[0]
    settings = {name: kw for name, kw, _ in cases(100).values()}  # ringmaster-lmo: its Muon case (the later)
    for name in algorithms.ALGORITHMS:
        alg = algorithms.build(name, settings[name])
        got = alg.splittable_blocks(layout, None)
        muon = name in ("rennala-muon", "delay-adaptive-muon", "ringmaster-lmo")
        assert got == ((False, True, False, True) if muon else (True,) * 4), name
    assert algorithms.build("ringmaster-lmo", {"lmo": "sign"}).splittable_blocks(layout) == (True,) * 4
    assert algorithms.build("ringmaster-lmo").splittable_blocks(layout, (True, True, False, False)) == (
        False, False, True, True)

    class Mine(Algorithm):
        pass

    assert Mine().splittable_blocks(layout) == (False,) * 4, "an algorithm that says nothing is cut nowhere"
