"""TorchProblem: layout, seeded gradients, BatchNorm re-estimation, evaluation, export, mistakes."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from problems.torch_problem import _FORWARD, TorchProblem, derive_seed, flat_state, job_seed

torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self, dropout: float = 0.3, features: int = 6):
        super().__init__()
        self.fc1 = nn.Linear(features, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def blobs(n: int = 240, seed: int = 0, features: int = 6) -> TensorDataset:
    """Three separable Gaussian blobs (a classification problem a few hundred steps solve)."""
    centres = torch.randn(3, features, generator=torch.Generator().manual_seed(100)) * 3
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = centres[y] + torch.randn(n, features, generator=g) + 5.0  # offset: BatchNorm's mean matters
    return TensorDataset(x, y)


def problem(**kw) -> TorchProblem:
    kw.setdefault("test", blobs(90, seed=1))
    return TorchProblem(kw.pop("model", Net), nn.functional.cross_entropy, kw.pop("train", blobs()), **kw)


def sgd(p: TorchProblem, steps: int = 300, lr: float = 0.1) -> np.ndarray:
    x = p.init_params(0)
    for s in range(steps):
        x = x - lr * p.grad(x, s, 32).grad
    return x


# --------------------------------------------------------------------------- layout and LMO mask

class WithEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mix = nn.Linear(4, 4)
        self.conv = nn.Conv1d(1, 2, 3)
        self.norm = nn.LayerNorm(4)
        self.out = nn.Linear(4, 10)
        self.post = nn.LayerNorm(10)  # after the head: a 1-D weight does not make it the head

    def forward(self, idx):
        return self.post(self.out(self.norm(self.mix(self.emb(idx)))))


def test_layout_is_named_parameters_and_default_lmo_rule():
    p = TorchProblem(WithEmbedding, nn.functional.cross_entropy, TensorDataset(torch.arange(10), torch.arange(10)),
                     TensorDataset(torch.arange(10), torch.arange(10)))
    m = WithEmbedding()
    assert p.layout == tuple((n, tuple(t.shape)) for n, t in m.named_parameters())
    mask = dict(zip((n for n, _ in p.layout), p.lmo_mask, strict=True))
    assert mask == {"emb.weight": False, "mix.weight": True, "mix.bias": False, "conv.weight": True,
                    "conv.bias": False, "norm.weight": False, "norm.bias": False, "out.weight": False,
                    "out.bias": False, "post.weight": False, "post.bias": False}
    assert p.dim == sum(t.numel() for t in m.parameters())


def test_lmo_override_by_names_and_by_callable():
    names = problem(lmo={"fc2.weight"})
    assert dict(zip((n for n, _ in names.layout), names.lmo_mask, strict=True))["fc2.weight"] is True
    assert sum(names.lmo_mask) == 1
    every_matrix = problem(lmo=lambda name, param: param.ndim == 2)
    assert every_matrix.lmo_mask == (True, False, False, False, True, False)
    with pytest.raises(ValueError, match="unknown parameter.*'nope'"):
        problem(lmo={"nope"})


def test_frozen_parameters_stay_out_of_the_layout():
    def frozen():
        net = Net()
        net.fc1.requires_grad_(False)
        return net
    p = problem(model=frozen)
    assert [n for n, _ in p.layout] == ["bn.weight", "bn.bias", "fc2.weight", "fc2.bias"]
    assert "fc1.weight" in p.state_dict(p.init_params(0))


# --------------------------------------------------------------------------- gradients

def test_grad_is_a_pure_function_of_x_seed_and_batch_size():
    a, b = problem(), problem()  # two builds stand for two processes
    x = a.init_params(3)
    r1, r2 = a.grad(x, 11, 32), b.grad(x, 11, 32)
    assert r1.grad.dtype == np.float32 and r1.grad.shape == (a.dim,)
    assert r1.grad.tobytes() == r2.grad.tobytes() and r1.loss == r2.loss
    assert a.grad(x, 11, 32).grad.tobytes() == r1.grad.tobytes()  # and again, after other jobs ran
    assert a.grad(x, 12, 32).grad.tobytes() != r1.grad.tobytes()
    assert a.grad(x, 11, 16).grad.tobytes() != r1.grad.tobytes()


def test_grad_is_the_gradient_of_the_model_on_the_seeded_batch_with_seeded_dropout():
    p = problem()
    x = p.init_params(0)
    seed = 77
    idx = p.batch_positions(seed, 20)
    assert len(set(idx.tolist())) == 20  # distinct indices
    net = Net()
    net.load_state_dict(p.state_dict(x))  # the parameters of x (buffers are irrelevant in train mode)
    net.train()
    xs, ys = blobs().tensors
    torch.manual_seed(derive_seed(seed, _FORWARD))
    loss = nn.functional.cross_entropy(net(xs[idx]), ys[idx])
    loss.backward()
    expected = torch.cat([t.grad.reshape(-1) for t in net.parameters()]).numpy()
    got = p.grad(x, seed, 20)
    np.testing.assert_array_equal(got.grad, expected)
    assert got.loss == float(loss.detach())


def test_dropout_draws_from_the_seeded_rng_and_leaves_the_global_rng_alone():
    p = problem(model=lambda: Net(dropout=0.5))
    x = p.init_params(0)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = p.grad(x, 5, 32)
    assert torch.equal(torch.get_rng_state(), before)  # forked: the caller's stream is untouched
    torch.manual_seed(999)  # whatever the global state, the same bits
    assert p.grad(x, 5, 32).grad.tobytes() == a.grad.tobytes()
    no_dropout = problem(model=lambda: Net(dropout=0.0))
    assert no_dropout.grad(x, 5, 32).grad.tobytes() != a.grad.tobytes()


def test_grad_pair_uses_one_batch_and_one_dropout_mask_for_both_points():
    p = problem(model=lambda: Net(dropout=0.5))
    x0, x1 = p.init_params(0), p.init_params(1)
    a, b = p.grad_pair(x1, x0, 9, 32)
    assert a.grad.tobytes() == p.grad(x1, 9, 32).grad.tobytes()
    assert b.grad.tobytes() == p.grad(x0, 9, 32).grad.tobytes()


class Deep(nn.Module):
    """Many blocks (a wide MLP of ``layers`` Linear layers), one of them unused by the loss."""

    def __init__(self, layers: int = 30, width: int = 256, features: int = 6):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, width),
                                  *(m for _ in range(layers - 2) for m in (nn.ReLU(), nn.Linear(width, width))),
                                  nn.ReLU(), nn.Linear(width, 3))
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.body(x)


def single_leaf_grad(p: TorchProblem, x: np.ndarray, seed: int, batch_size: int) -> np.ndarray:
    """The gradient as the first TorchProblem took it: one flat leaf seen through a slice per
    block (each slice's backward builds a full-size gradient)."""
    from torch.func import functional_call

    flat = torch.tensor(x).requires_grad_(True)
    state, off = {}, 0
    for (name, shape), n in zip(p.layout, p._sizes, strict=True):
        state["model." + name] = flat[off:off + n].view(shape)
        off += n
    idx = p.batch_positions(seed, batch_size)
    xs, ys = blobs().tensors
    torch.manual_seed(derive_seed(seed, _FORWARD))
    loss, _, _ = functional_call(p._caller, state, ((xs[idx], ys[idx]),))
    (g,) = torch.autograd.grad(loss, flat)
    return g.numpy()


def test_grad_of_many_blocks_is_the_single_leaf_gradient_bit_for_bit_and_unused_blocks_are_zero():
    p = problem(model=lambda: Deep(layers=12, width=32))
    x = p.init_params(0)
    got = p.grad(x, 4, 24).grad
    assert got.tobytes() == single_leaf_grad(p, x, 4, 24).tobytes()
    names = [n for n, _ in p.layout]
    off = sum(p._sizes[:names.index("unused.weight")])
    assert not got[off:off + 20].any() and got[:off].any()
    a, b = p.grad_pair(x, x * 0.5, 4, 24)
    assert a.grad.tobytes() == got.tobytes()
    assert b.grad.tobytes() == single_leaf_grad(p, x * 0.5, 4, 24).tobytes()
    assert not np.shares_memory(a.grad, b.grad)  # two results, two buffers


def test_gradient_buffers_are_reused_only_once_nobody_holds_them():
    """The copy of x and the flat gradient live in buffers used again (a fresh d-sized array per
    call costs page faults), never while a result is still held."""
    p = problem(model=lambda: Deep(layers=30, width=128))
    x = p.init_params(0)
    held = p.grad(x, 1, 32).grad
    kept = held.copy()
    pair = p.grad_pair(x, x * 0.5, 2, 32)
    assert held.tobytes() == kept.tobytes() and not np.shares_memory(held, pair[0].grad)
    del pair
    for s in range(20):
        p.grad(x, s, 32)
    assert held.tobytes() == kept.tobytes()
    assert 2 <= p._buffers.allocated <= 5  # x's copy, the held gradient, the pair's two, one for the rest


def _paired_ratio(fn, control, pairs: int = 7) -> tuple[float, float, float]:
    """The median over ``pairs`` back-to-back runs of ``fn`` and ``control`` (alternating which goes
    first) of fn's time over control's, and the two medians, after one warm-up run of each. Each
    ratio compares runs a few milliseconds apart, so a machine whose speed drifts (other processes
    taking its CPUs for seconds) moves both sides of it together."""
    fn(), control()
    ratios, ours, theirs = [], [], []
    for i in range(pairs):
        order = (fn, control) if i % 2 == 0 else (control, fn)
        took = {}
        for f in order:
            t0 = time.perf_counter()
            f()
            took[f] = time.perf_counter() - t0
        ours.append(took[fn])
        theirs.append(took[control])
        ratios.append(took[fn] / took[control])
    return float(np.median(ratios)), float(np.median(ours)), float(np.median(theirs))


def test_grad_of_sixty_blocks_costs_about_a_plain_forward_and_backward():
    """Against a control measured here, in alternation with it: the same forward and backward on
    the module itself. The single-leaf gradient cost blocks x d (12-17x a plain backward on a 62-block MLP); the
    bound leaves room for a noisy machine, not for that."""
    p = problem(model=lambda: Deep(layers=30, width=384))
    assert len(p.layout) == 62 and p.dim > 4_000_000
    x = p.init_params(0)
    net = p.model
    idx = p.batch_positions(1, 64)
    xs, ys = blobs().tensors
    xb, yb = xs[idx], ys[idx]

    def plain():
        net.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(xb), yb).backward()

    ratio, ours, control = _paired_ratio(lambda: p.grad(x, 1, 64), plain)
    assert ratio < 3.0, (f"grad / plain backward {ratio:.2f} (median of back-to-back pairs; grad {ours * 1e3:.1f} ms "
                         f"against {control * 1e3:.1f} ms)")


def test_full_grad_is_the_sum_of_the_items_gradients_over_the_shard():
    p = problem(model=lambda: Net(dropout=0.0), batch_size=16)
    x = sgd(p, 20)
    assert p.num_samples == p.num_train == 240
    g, count, loss_sum = p.full_grad(x, 10, 50)
    assert count == 40 and g.dtype == np.float32 and g.shape == (p.dim,)
    net = Net(dropout=0.0)
    net.load_state_dict(p.state_dict(x))
    net.train()
    xs, ys = blobs().tensors
    total, expected = 0.0, np.zeros(p.dim)
    for lo in (10, 26, 42):  # chunks of batch_size from lo
        hi = min(lo + 16, 50)
        net.zero_grad()
        loss = nn.functional.cross_entropy(net(xs[lo:hi]), ys[lo:hi]) * (hi - lo)
        loss.backward()
        total += float(loss.detach())
        expected += torch.cat([t.grad.reshape(-1) for t in net.parameters()]).double().numpy()
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-5)
    assert loss_sum == pytest.approx(total, rel=1e-6)
    assert p.full_grad(x, 10, 50)[0].tobytes() == g.tobytes()  # pure
    assert p.full_grad(x, 7, 7)[1:] == (0, 0.0)
    with pytest.raises(ValueError, match=r"shard \[0, 241\) is not inside \[0, 240\)"):
        p.full_grad(x, 0, 241)


class RandomShift(Dataset):
    """A transform drawing from torch's RNG, and one seeded from the job's seed."""

    def __init__(self, base: TensorDataset):
        self.base, self.seeds = base, []

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        self.seeds.append(job_seed())
        own = np.random.default_rng([job_seed(), i]).normal()
        return x + torch.randn(x.shape) * 0.1 + float(own), y


def test_random_transforms_are_reproduced_and_job_seed_is_the_jobs_seed():
    data = RandomShift(blobs())
    p = problem(train=data)
    x = p.init_params(0)
    a = p.grad(x, 21, 8)
    assert set(data.seeds) == {21}
    assert problem(train=RandomShift(blobs())).grad(x, 21, 8).grad.tobytes() == a.grad.tobytes()
    with pytest.raises(RuntimeError, match="only set while a TorchProblem computes"):
        job_seed()


def test_generic_datasets_and_the_tensor_fast_path_give_the_same_bits():
    class Items(Dataset):
        def __init__(self, base):
            self.base = base

        def __len__(self):
            return len(self.base)

        def __getitem__(self, i):
            return self.base[i]

    x = problem().init_params(0)
    assert problem(train=Items(blobs())).grad(x, 4, 32).grad.tobytes() == problem().grad(x, 4, 32).grad.tobytes()


def test_grad_leaves_the_modules_buffers_as_built():
    p = problem()
    before = {k: v.clone() for k, v in p.model.state_dict().items()}
    p.grad(p.init_params(0), 1, 32)
    after = p.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_float64_data_is_cast_to_the_models_float32():
    xs, ys = blobs().tensors
    p = problem(train=TensorDataset(xs.double(), ys))
    assert p.grad(p.init_params(0), 3, 32).grad.tobytes() == problem().grad(p.init_params(0), 3, 32).grad.tobytes()


def test_batch_larger_than_the_train_set_uses_all_of_it():
    p = problem(train=blobs(40))
    assert sorted(p.batch_positions(0, 500).tolist()) == list(range(40))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        p.grad(p.init_params(0), 0, 0)


# --------------------------------------------------------------------------- init

def test_init_params_rebuilds_a_callable_model_under_the_seed():
    p = problem()
    torch.manual_seed(4)
    expected = torch.cat([t.detach().reshape(-1) for t in Net().parameters()]).numpy()
    np.testing.assert_array_equal(p.init_params(4), expected)
    assert p.init_params(4).tobytes() != p.init_params(5).tobytes()


def test_init_params_of_a_module_instance_are_its_parameters_whatever_the_seed():
    net = Net()
    p = problem(model=net)
    expected = torch.cat([t.detach().reshape(-1) for t in net.parameters()]).numpy()
    np.testing.assert_array_equal(p.init_params(0), expected)
    np.testing.assert_array_equal(p.init_params(7), expected)


# --------------------------------------------------------------------------- BatchNorm, evaluate, export

def test_evaluate_reestimates_batchnorm_statistics_at_x():
    p = problem(bn_batches=8)
    x = sgd(p)
    buffers = p.estimate_buffers(x)
    # The cumulative average over 8 batches of 32 approximates the pre-BN activations' mean.
    net = Net()
    net.load_state_dict(p.state_dict(x))
    with torch.no_grad():
        pre = net.fc1(blobs().tensors[0])
    np.testing.assert_allclose(buffers["bn.running_mean"].numpy(), pre.mean(0).numpy(), rtol=0.15, atol=0.3)
    assert int(buffers["bn.num_batches_tracked"]) == 8
    figures = p.evaluate(x)
    assert figures["accuracy"] > 0.9 and figures["loss"] < 0.5
    # Without the re-estimation (running stats as built: mean 0, var 1) the model is far worse.
    stale = problem(bn_batches=0).evaluate(x)
    assert stale["accuracy"] < figures["accuracy"] - 0.2


def test_evaluate_is_pure_and_the_exported_state_dict_scores_the_same():
    p = problem()
    x = sgd(p, 200)
    first = p.evaluate(x)
    p.grad(x, 1, 32)
    assert p.evaluate(x) == first
    sd = p.state_dict(x)
    assert list(sd) == list(Net().state_dict())  # parameters and buffers, module order
    net = Net()
    net.load_state_dict(sd)
    net.eval()
    xs, ys = blobs(90, seed=1).tensors
    with torch.no_grad():
        out = net(xs)
    assert np.mean((out.argmax(1) == ys).numpy()) == first["accuracy"]
    assert float(nn.functional.cross_entropy(out, ys)) == pytest.approx(first["loss"], rel=1e-6)
    assert set(first) == {"loss", "accuracy", "f1"}


def test_holdout_split_is_fixed_disjoint_and_covers_train():
    p = TorchProblem(Net, nn.functional.cross_entropy, blobs(200), holdout=0.25, seed=3)
    q = TorchProblem(Net, nn.functional.cross_entropy, blobs(200), holdout=0.25, seed=3)
    train_idx, test_idx = set(p._train.index.tolist()), set(p._test.index.tolist())
    assert (p.num_train, p.num_test) == (150, 50)
    assert not train_idx & test_idx and train_idx | test_idx == set(range(200))
    assert q._test.index.tolist() == p._test.index.tolist()
    other = TorchProblem(Net, nn.functional.cross_entropy, blobs(200), holdout=0.25, seed=4)
    assert other._test.index.tolist() != p._test.index.tolist()


def test_user_metrics_see_the_whole_test_set():
    seen = []

    def count(out, target):
        seen.append((tuple(out.shape), tuple(target.shape)))
        return float((out.argmax(1) == target).sum())

    p = problem(metrics={"correct": count}, eval_batch_size=32)
    figures = p.evaluate(p.init_params(0))
    assert seen == [((90, 3), (90,))] and figures["correct"] == pytest.approx(figures["accuracy"] * 90)


def test_compute_loss_for_other_batches():
    base = blobs(60)

    class Dicts(Dataset):
        def __len__(self):
            return 60

        def __getitem__(self, i):
            x, y = base[i]
            return {"pixels": x, "label": y}

    def compute_loss(model, batch):
        return nn.functional.cross_entropy(model(batch["pixels"]), batch["label"])

    p = TorchProblem(Net, train=Dicts(), test=Dicts(), compute_loss=compute_loss)
    x = p.init_params(0)
    r = p.grad(x, 2, 16)
    assert r.grad.shape == (p.dim,) and np.isfinite(r.loss)
    assert set(p.evaluate(x)) == {"loss"}


def test_tied_weights_export_both_names():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.out = nn.Linear(4, 5, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx):
            return self.out(self.emb(idx))

    data = TensorDataset(torch.arange(5).repeat(4), torch.arange(5).repeat(4))
    p = TorchProblem(Tied, nn.functional.cross_entropy, data, data)
    assert [n for n, _ in p.layout] == ["emb.weight"]
    x = p.init_params(0) + 1.0
    sd = p.state_dict(x)
    assert set(sd) == {"emb.weight", "out.weight"} and torch.equal(sd["emb.weight"], sd["out.weight"])
    fresh = Tied()
    fresh.load_state_dict(sd)
    np.testing.assert_array_equal(fresh.emb.weight.detach().numpy().reshape(-1), x)


def test_flat_state_of_a_problem_without_a_model_is_its_layout():
    from problems import load_problem

    q = load_problem("quadratic", {"d": 4})
    x = np.arange(4, dtype=np.float32)
    out = flat_state(q, x)
    assert list(out) == [n for n, _ in q.layout] and np.concatenate([v.reshape(-1) for v in out.values()]).tolist() \
        == x.tolist()


# --------------------------------------------------------------------------- mistakes

class IntParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(2, 2)
        self.steps = nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of loss_fn"),
    ({"loss_fn": nn.functional.cross_entropy, "compute_loss": lambda m, b: 0}, "exactly one of loss_fn"),
    ({"loss_fn": nn.functional.cross_entropy, "model": nn.ReLU()}, "no trainable parameters"),
    ({"loss_fn": nn.functional.cross_entropy, "model": IntParam}, "parameter 'steps' is torch.int64"),
    ({"loss_fn": nn.functional.cross_entropy, "model": lambda: "net"}, "returned a str, not an nn.Module"),
    ({"loss_fn": nn.functional.cross_entropy, "model": 3}, "must be an nn.Module or a callable"),
    ({"loss_fn": nn.functional.cross_entropy, "train": [1, 2, 3][:0]}, "train dataset is empty"),
    ({"loss_fn": nn.functional.cross_entropy, "train": 5}, "train must be a map-style dataset"),
    ({"loss_fn": nn.functional.cross_entropy, "device": "cuda:0" if not torch.cuda.is_available() else "tpu"},
     "device"),
    ({"loss_fn": nn.functional.cross_entropy, "test": None, "holdout": 1.0}, "holdout must be in (0, 1)"),
    ({"loss_fn": nn.functional.cross_entropy, "batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"loss_fn": nn.functional.cross_entropy, "metrics": {"loss": len}}, "metric name 'loss' is taken"),
    ({"compute_loss": lambda m, b: 0, "metrics": {"m": len}}, "metrics=(output, target) need loss_fn"),
    ({"loss_fn": nn.functional.cross_entropy, "lmo": 3}, "lmo must be a callable"),
])
def test_mistakes_are_one_line_value_errors(kwargs, message):
    kw = {"model": Net, "train": blobs(), "test": blobs(30), **kwargs}
    with pytest.raises(ValueError) as info:
        TorchProblem(kw.pop("model"), kw.pop("loss_fn", None), kw.pop("train"), **kw)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_loss_that_is_not_a_scalar_is_a_one_line_error():
    p = problem()
    p.loss_fn = p._caller.loss_fn = nn.CrossEntropyLoss(reduction="none")
    with pytest.raises(ValueError, match=r"scalar tensor, got a tensor of shape \(32,\)"):
        p.grad(p.init_params(0), 0, 32)


def test_loss_fn_with_batches_that_are_not_pairs_names_compute_loss():
    data = TensorDataset(blobs().tensors[0])  # inputs only
    p = TorchProblem(Net, nn.functional.cross_entropy, data, data)
    with pytest.raises(ValueError, match="pass compute_loss"):
        p.grad(p.init_params(0), 0, 4)


# --------------------------------------------------------------------------- the public package

def test_import_latecomer_does_not_import_torch_until_torchproblem_is_used():
    code = ("import sys, latecomer\n"
            "assert 'torch' not in sys.modules, 'imported torch'\n"
            "assert latecomer.Problem.__name__ == 'Problem' and callable(latecomer.worker_local)\n"
            "assert callable(latecomer.state_dict) and latecomer.Algorithm.__name__ == 'Algorithm'\n"
            "assert 'torch' not in sys.modules, 'imported torch'\n"
            "latecomer.TorchProblem\n"
            "assert 'torch' in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_latecomer_names_are_the_internal_objects():
    import latecomer
    from algorithms.base import Algorithm, JobSpec, Outcome, Result, publish
    from problems.base import GradResult, Problem
    from problems.loader import load_problem, worker_local

    assert (latecomer.TorchProblem, latecomer.job_seed) == (TorchProblem, job_seed)
    assert (latecomer.Problem, latecomer.GradResult, latecomer.load_problem, latecomer.worker_local) == \
        (Problem, GradResult, load_problem, worker_local)
    assert (latecomer.Algorithm, latecomer.JobSpec, latecomer.Result, latecomer.Outcome, latecomer.publish) == \
        (Algorithm, JobSpec, Result, Outcome, publish)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        latecomer.nope  # noqa: B018
    assert "TorchProblem" in dir(latecomer)


# --------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gradient_matches_the_cpu_gradient():
    cpu = problem(model=lambda: Net(dropout=0.0))  # Dropout masks come from another generator on CUDA
    gpu = problem(model=lambda: Net(dropout=0.0), device="cuda")
    x = sgd(cpu, 50)
    a, b = cpu.grad(x, 3, 32), gpu.grad(x, 3, 32)
    assert b.grad.dtype == np.float32 and b.grad.shape == a.grad.shape
    np.testing.assert_allclose(b.grad, a.grad, rtol=1e-4, atol=1e-5)
    assert b.loss == pytest.approx(a.loss, rel=1e-5)
    e_cpu, e_gpu = cpu.evaluate(x), gpu.evaluate(x)
    assert e_gpu["loss"] == pytest.approx(e_cpu["loss"], rel=1e-4)
    assert {k: v.device.type for k, v in gpu.state_dict(x).items()} == dict.fromkeys(cpu.state_dict(x), "cpu")
