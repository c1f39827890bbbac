"""Built-in problems (quadratic, digits, logreg) and the problem loader."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from sklearn.metrics import f1_score, recall_score

from problems import BUILTIN_PROBLEMS, GradResult, load_problem
from problems.mlp import macro_f1_and_recall

HERE = "tests.unit.test_problems"


# -- user problems for the loader tests ----------------------------------------------------------
class ToyProblem:
    """A minimal object with the problem interface (no base class on purpose)."""

    layout = (("x", (2,)),)

    def __init__(self, **settings):
        self.settings = settings

    def init_params(self, seed):
        return np.zeros(2, dtype=np.float32)

    def grad(self, x, seed, batch_size):
        return GradResult(grad=np.asarray(x, dtype=np.float32), loss=0.0)

    def evaluate(self, x):
        return {"loss": 0.0}


def make_toy(scale: float = 1.0, n: int = 3, name: str = "toy", flag: bool = False, device: str = "cpu"):
    return ToyProblem(scale=scale, n=n, name=name, flag=flag, device=device)


def make_toy_without_device(k=None):
    return ToyProblem(k=k)


def make_toy_required(path):
    return ToyProblem(path=path)


def make_not_a_problem():
    return type("NotAProblem", (), {"layout": ()})()


NOT_CALLABLE = 42


# -- quadratic -----------------------------------------------------------------------------------
def dense_quadratic(d: int, L: float) -> tuple[np.ndarray, np.ndarray]:
    a = (L / 4) * (2 * np.eye(d) - np.eye(d, k=1) - np.eye(d, k=-1))
    b = np.zeros(d)
    b[0] = -L / 4
    return a, b


def test_quadratic_grad_matches_dense_matrix():
    d, L = 7, 2.0
    p = load_problem("quadratic", {"d": d, "L": L, "sigma": 0.0})
    a, b = dense_quadratic(d, L)
    x = np.random.default_rng(1).standard_normal(d).astype(np.float32)
    x64 = x.astype(np.float64)
    x_star = np.linalg.solve(a, b)
    f = lambda z: 0.5 * z @ a @ z - b @ z
    r = p.grad(x, seed=3, batch_size=1)
    assert r.grad.dtype == np.float32 and r.grad.shape == (d,)
    np.testing.assert_allclose(r.grad, a @ x64 - b, rtol=1e-6, atol=1e-7)
    assert r.loss == pytest.approx(f(x64) - f(x_star), rel=1e-10)
    ev = p.evaluate(x)
    assert ev["loss"] == pytest.approx(f(x64) - f(x_star), rel=1e-10)
    assert ev["grad_norm_sq"] == pytest.approx(float(np.sum((a @ x64 - b) ** 2)), rel=1e-10)


def test_quadratic_minimizer_has_zero_gradient():
    d, L = 9, 1.0
    p = load_problem("quadratic", {"d": d, "L": L})
    a, b = dense_quadratic(d, L)
    np.testing.assert_allclose(p.x_star, np.linalg.solve(a, b), rtol=1e-12)
    ev = p.evaluate(p.x_star)
    assert ev["grad_norm_sq"] < 1e-28 and abs(ev["loss"]) < 1e-15
    assert p.f_star == pytest.approx(-L * d / (8 * (d + 1)), rel=1e-12)
    assert p.evaluate(p.init_params(0))["loss"] > 0


def test_quadratic_init_is_nesterov_start_and_ignores_seed():
    p = load_problem("quadratic", {"d": 16})
    x0 = p.init_params(0)
    assert x0.dtype == np.float32
    np.testing.assert_array_equal(x0, p.init_params(123))
    np.testing.assert_array_equal(x0, np.r_[4.0, np.zeros(15)].astype(np.float32))
    assert not load_problem("quadratic", {"x0": "zeros"}).init_params(0).any()


@pytest.mark.parametrize("noise", ["scalar", "isotropic"])
def test_quadratic_noise_is_centred_and_variance_scales_with_batch(noise):
    d, sigma, draws = 3, 0.5, 4000
    p = load_problem("quadratic", {"d": d, "sigma": sigma, "noise": noise})
    # At x* the exact gradient is ~1e-17, so the float32 reply is pure noise.
    samples = {b: np.array([p.grad(p.x_star, seed, b).grad for seed in range(draws)], dtype=np.float64)
               for b in (1, 16)}
    for b, s in samples.items():
        std = sigma / math.sqrt(b)
        assert np.all(np.abs(s.mean(axis=0)) < 5 * std / math.sqrt(draws))
        np.testing.assert_allclose(s.var(axis=0), std ** 2, rtol=0.12)
    one = samples[1]
    if noise == "scalar":
        np.testing.assert_array_equal(one[:, 0], one[:, 1])  # one ξ on every coordinate
    else:
        assert abs(np.corrcoef(one[:, 0], one[:, 1])[0, 1]) < 0.1


def test_quadratic_grad_is_bit_identical_per_seed():
    p = load_problem("quadratic", {"d": 32, "sigma": 0.1, "noise": "isotropic"})
    x = p.init_params(0)
    a, b = p.grad(x, 7, 4), p.grad(x.copy(), 7, 4)
    assert a.grad.tobytes() == b.grad.tobytes() and a.loss == b.loss
    assert p.grad(x, 8, 4).grad.tobytes() != a.grad.tobytes()


# -- digits --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits():
    return load_problem("digits")


def numpy_mlp_loss(p, x: np.ndarray, idx: np.ndarray, cubic: bool) -> float:
    """Independent float64 reference of the MLP's mean cross-entropy on train rows ``idx``."""
    (_, (h, f)), _, _, _ = p.layout
    x = x.astype(np.float64)
    w1, b1 = x[:h * f].reshape(h, f), x[h * f:h * f + h]
    w2, b2 = x[h * f + h:h * f + h + 10 * h].reshape(10, h), x[-10:]
    inputs = p._x_train.cpu().numpy().astype(np.float64)[idx]
    z = np.maximum(inputs @ w1.T + b1, 0) @ w2.T + b2
    if cubic:
        z = z ** 3
    z_max = z.max(axis=1, keepdims=True)
    logsumexp = np.log(np.exp(z - z_max).sum(axis=1)) + z_max[:, 0]
    return float(np.mean(logsumexp - z[np.arange(len(idx)), p.y_train_np[idx]]))


def test_digits_layout_and_init(digits):
    assert digits.layout == (("fc1.weight", (32, 64)), ("fc1.bias", (32,)), ("fc2.weight", (10, 32)),
                             ("fc2.bias", (10,)))
    assert digits.dim == 32 * 64 + 32 + 10 * 32 + 10
    assert len(digits.y_train_np) + len(digits.y_test_np) == 1797
    x0 = digits.init_params(5)
    assert x0.dtype == np.float32 and x0.shape == (digits.dim,)
    np.testing.assert_array_equal(x0, digits.init_params(5))
    assert not np.array_equal(x0, digits.init_params(6))
    assert np.abs(x0[:32 * 64]).max() <= 1 / 8 and np.abs(x0[-10:]).max() <= 1 / math.sqrt(32)


@pytest.mark.parametrize("cubic", [False, True])
def test_digits_grad_matches_finite_differences(cubic):
    p = load_problem("digits", {"cubic": cubic, "hidden": 8})
    x = p.init_params(0)
    seed, batch = 11, 16
    _, idx = p.batch_indices(seed, batch)
    r = p.grad(x, seed, batch)
    assert r.grad.dtype == np.float32 and r.grad.shape == (p.dim,)
    assert r.loss == pytest.approx(numpy_mlp_loss(p, x, idx, cubic), rel=1e-5)
    # The largest-magnitude coordinate of each block, plus a few random ones.
    bounds = np.cumsum([0] + [math.prod(s) for _, s in p.layout])
    coords = [lo + int(np.argmax(np.abs(r.grad[lo:hi]))) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    coords += list(np.random.default_rng(0).choice(p.dim, 4, replace=False))
    eps = 1e-5
    for i in coords:
        e = np.zeros(p.dim)
        e[i] = eps
        fd = (numpy_mlp_loss(p, x + e, idx, cubic) - numpy_mlp_loss(p, x - e, idx, cubic)) / (2 * eps)
        assert r.grad[i] == pytest.approx(fd, rel=1e-3, abs=1e-5), f"coordinate {i}"


def test_digits_cubic_changes_the_loss(digits):
    cubic = load_problem("digits", {"cubic": "true"})
    x = digits.init_params(0) * 8  # large enough logits that z ≠ z³ matters
    assert cubic.grad(x, 3, 32).loss != pytest.approx(digits.grad(x, 3, 32).loss, rel=1e-3)


def test_digits_sgd_beats_chance_by_far(digits):
    x = digits.init_params(0)
    for seed in range(300):
        x = x - 0.5 * digits.grad(x, seed, 32).grad
    ev = digits.evaluate(x)
    assert set(ev) == {"loss", "accuracy", "f1", "recall_slow", "train_loss"}
    assert ev["accuracy"] > 0.8 and ev["f1"] > 0.8
    assert ev["loss"] < digits.evaluate(digits.init_params(0))["loss"] / 3


def test_digits_batch_larger_than_train_set_uses_all_of_it(digits):
    x = digits.init_params(1)
    r = digits.grad(x, 0, 10 ** 6)
    assert r.loss == pytest.approx(digits.evaluate(x)["train_loss"], rel=1e-5)


def test_digits_grad_is_deterministic_and_accepts_read_only_input(digits):
    x = digits.init_params(2)
    x.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a, b = digits.grad(x, 4, 32), digits.grad(x, 4, 32)
    assert a.grad.tobytes() == b.grad.tobytes() and a.loss == b.loss
    assert a.grad.tobytes() != digits.grad(x, 5, 32).grad.tobytes()


def test_digits_sample_cost_is_kappa_exactly_for_slow_class_batches():
    p = load_problem("digits", {"homogeneous": True, "kappa": "7.5", "slow_class": 3})
    x = p.init_params(0)
    classes = []
    for seed in range(300):
        cls, idx = p.batch_indices(seed, 16)
        assert np.all(p.y_train_np[idx] == cls) and len(idx) == 16
        assert p.sample_cost(seed, 16) == (7.5 if cls == 3 else 1.0)
        classes.append(cls)
        if seed < 5:  # grad trains on exactly that batch
            assert p.grad(x, seed, 16).loss == pytest.approx(numpy_mlp_loss(p, x, idx, False), rel=1e-5)
    counts = np.bincount(classes, minlength=10)
    assert counts.min() > 10 and counts[3] > 0  # every class is drawn, roughly 30 times each
    assert load_problem("digits").sample_cost(0, 16) == 1.0


def test_macro_f1_and_recall_match_sklearn():
    rng = np.random.default_rng(0)
    y_true = rng.integers(0, 10, 200)
    y_pred = np.where(rng.random(200) < 0.6, y_true, rng.integers(0, 9, 200))  # class 9 rarely predicted
    f1, recall = macro_f1_and_recall(y_true, y_pred, 10)
    assert f1 == pytest.approx(f1_score(y_true, y_pred, average="macro", labels=range(10), zero_division=0))
    np.testing.assert_allclose(recall, recall_score(y_true, y_pred, average=None, labels=range(10),
                                                    zero_division=0))


# -- logreg --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def logreg():
    return load_problem("logreg", {"n": 500, "p": 5, "reg": 0.01})


def test_logreg_full_grad_matches_dense_computation(logreg):
    w = np.random.default_rng(3).standard_normal(5).astype(np.float32)
    a, y, n = logreg.features, logreg.labels, 500
    w64 = w.astype(np.float64)
    per_sample = np.array([-yi * ai / (1 + np.exp(yi * ai @ w64)) + 0.01 * w64 for ai, yi in zip(a, y, strict=True)])
    g, count, loss = logreg.full_grad(w, 0, n)
    assert g.dtype == np.float32 and count == n
    np.testing.assert_allclose(g / n, per_sample.mean(axis=0), rtol=1e-5, atol=1e-7)
    dense_loss = np.mean(np.log1p(np.exp(-y * (a @ w64)))) + 0.005 * w64 @ w64
    assert loss / n == pytest.approx(dense_loss, rel=1e-10)
    ev = logreg.evaluate(w)
    assert ev["loss"] == pytest.approx(dense_loss, rel=1e-10)
    assert ev["grad_norm_sq"] == pytest.approx(float(np.sum(per_sample.mean(axis=0) ** 2)), rel=1e-8)
    assert 0 <= ev["accuracy"] <= 1


def test_logreg_shard_sums_add_up(logreg):
    w = logreg.init_params(0) + 0.3
    parts = [logreg.full_grad(w, lo, hi) for lo, hi in ((0, 123), (123, 124), (124, 124), (124, 500))]
    g, count, loss = logreg.full_grad(w, 0, 500)
    np.testing.assert_allclose(sum(p[0].astype(np.float64) for p in parts), g, rtol=1e-5, atol=1e-5)
    assert sum(p[1] for p in parts) == count == 500
    assert sum(p[2] for p in parts) == pytest.approx(loss, rel=1e-12)
    with pytest.raises(ValueError, match="shard"):
        logreg.full_grad(w, 10, 501)


def test_logreg_minibatch_grad_is_unbiased_and_seeded(logreg):
    w = np.zeros(5, dtype=np.float32)
    mean = np.mean([logreg.grad(w, seed, 50).grad for seed in range(400)], axis=0)
    full = logreg.full_grad(w, 0, 500)[0] / 500
    assert np.linalg.norm(mean - full) < 0.2 * np.linalg.norm(full)
    assert logreg.grad(w, 1, 8).grad.tobytes() == logreg.grad(w, 1, 8).grad.tobytes()
    assert logreg.num_samples == 500 and load_problem("logreg").num_samples == 10000


# -- loader --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(set(BUILTIN_PROBLEMS) - {"mnist"}))  # mnist: test_mnist_idx.py
def test_builtin_problems_honour_the_interface(name):
    p = load_problem(name)
    x = p.init_params(0)
    assert x.dtype == np.float32 and x.shape == (p.dim,)
    r = p.grad(x, 0, 4)
    assert r.grad.dtype == np.float32 and r.grad.shape == (p.dim,) and math.isfinite(r.loss)
    assert "loss" in p.evaluate(x) and p.spec == name and p.options == {}


def test_loader_user_callable_with_string_options():
    p = load_problem(f"{HERE}:make_toy", {"scale": "2.5", "n": "4", "flag": "Yes", "name": "abc"}, device="meta")
    assert p.settings == {"scale": 2.5, "n": 4, "name": "abc", "flag": True, "device": "meta"}
    assert p.spec == f"{HERE}:make_toy"
    assert p.options == {"scale": 2.5, "n": 4, "flag": True, "name": "abc"}
    assert type(load_problem(f"{HERE}:make_toy", {"scale": 3}).settings["scale"]) is float
    assert load_problem(f"{HERE}:make_toy_without_device", {"k": "x"}).settings == {"k": "x"}  # untyped: as is
    assert load_problem(f"{HERE}:ToyProblem", {"a": 1}).settings == {"a": 1, "device": "cpu"}  # **kwargs


def test_loader_coerces_builtin_options_and_round_trips():
    p = load_problem("quadratic", {"d": "16", "sigma": "0.5", "noise": "isotropic", "L": 2})
    assert p.dim == 16 and p.options == {"d": 16, "sigma": 0.5, "noise": "isotropic", "L": 2.0}
    q = load_problem(p.spec, p.options)
    x = p.init_params(0)
    assert p.grad(x, 9, 2).grad.tobytes() == q.grad(x, 9, 2).grad.tobytes()
    d = load_problem("digits", {"cubic": "TRUE", "hidden": "8", "homogeneous": "0"})
    assert d.cubic is True and d.homogeneous is False and d.layout[0][1] == (8, 64)


@pytest.mark.parametrize("spec, options, message", [
    ("nosuch", None, "unknown problem 'nosuch'"),
    (":make_toy", None, "unknown problem"),
    ("no_such_module_xyz:make", None, "cannot import module 'no_such_module_xyz'"),
    (f"{HERE}:nope", None, "has no attribute 'nope'"),
    (f"{HERE}:NOT_CALLABLE", None, "'NOT_CALLABLE' is not callable"),
    (f"{HERE}:make_not_a_problem", None, "without init_params, grad, evaluate"),
    (f"{HERE}:make_toy_required", None, "missing required option(s) path"),
    (f"{HERE}:make_toy", {"n": "4.5"}, "option 'n'"),
    ("quadratic", {"dd": 3}, "unknown option 'dd'"),
    ("quadratic", {"d": "sixty"}, "invalid value 'sixty' for option 'd'"),
    ("quadratic", {"d": 2.5}, "option 'd'"),
    ("quadratic", {"d": True}, "option 'd'"),
    ("quadratic", {"d": [1, 2]}, "options must be str, int, float or bool"),
    ("quadratic", {"device": "cpu"}, "'device' is not an option"),
    ("quadratic", {"d": 0}, "d must be >= 1"),
    ("quadratic", {"noise": "pink"}, "noise must be one of scalar, isotropic"),
    ("quadratic", {"sigma": "-1"}, "sigma must be >= 0"),
    ("digits", {"cubic": "maybe"}, "option 'cubic'"),
    ("digits", {"test_fraction": 1.5}, "test_fraction"),
    ("digits", {"slow_class": 10}, "slow_class"),
    ("logreg", {"n": -1}, "n must be >= 1"),
    ("mnist", None, "missing option(s) images, labels"),
])
def test_loader_user_mistakes_raise_one_line_value_errors(spec, options, message):
    with pytest.raises(ValueError) as info:
        load_problem(spec, options)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_digits_split_is_cached_and_read_back_without_importing_sklearn(tmp_path, monkeypatch):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from problems.digits import digits_split

    monkeypatch.setenv("LATECOMER_CACHE", str(tmp_path))
    data = load_digits()
    expected = train_test_split((data.data / 16.0).astype(np.float32), data.target.astype(np.int64), test_size=0.25,
                                stratify=data.target, random_state=3)
    first = digits_split(0.25, 3)
    (path,) = tmp_path.iterdir()
    assert path.name.endswith("-0.25-3.npz")
    for a, b in zip(first, expected, strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    code = ("import sys; from problems.digits import digits_split; s = digits_split(0.25, 3); "
            "print('sklearn' in sys.modules, sum(len(a) for a in s))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "LATECOMER_CACHE": str(tmp_path)},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out == ["False", str(2 * 1797)]
    path.write_bytes(path.read_bytes()[:100])  # damaged: ignored, computed and written again
    again = digits_split(0.25, 3)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(again, expected, strict=True))
    assert path.stat().st_size > 100
