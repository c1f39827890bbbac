"""The character-level transformer problem (``charlm``): layout, determinism, learning, options."""

from __future__ import annotations

import math

import numpy as np
import pytest

from problems import BUILTIN_PROBLEMS, layout_size, load_problem, split_params

SMALL = {"d_model": 16, "heads": 2, "context": 16, "eval_windows": 16}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The caller's business (as the workers do): one torch thread, restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lm(one_thread):
    return load_problem("charlm", SMALL)


def test_layout_size_matches_the_parameter_vector_and_every_block_is_a_matrix(lm):
    x = lm.init_params(0)
    assert x.dtype == np.float32 and x.shape == (lm.dim,) == (layout_size(lm.layout),)
    blocks = split_params(x, lm.layout)
    assert all(len(shape) == 2 for _, shape in lm.layout)
    assert blocks["wte"].shape == (lm.vocab, 16) and blocks["wpe"].shape == (16, 16)
    assert blocks["lm_head"].shape == (lm.vocab, 16)
    assert sum(name.endswith("attn.qkv") for name, _ in lm.layout) == lm.layers == 2
    g = lm.grad(x, 1, 4)
    assert g.grad.dtype == np.float32 and g.grad.shape == x.shape and math.isfinite(g.loss)
    # the initial model predicts the uniform distribution (zero output matrix)
    assert lm.evaluate(x)["loss"] == pytest.approx(math.log(lm.vocab), rel=1e-5)


def test_vocabulary_and_split_come_from_the_standard_library_text(lm):
    text = "".join(lm.chars)
    assert "{" in text and "d" in text and lm.vocab == len(set(lm.chars))
    assert len(lm.train_ids) > 8 * len(lm.val_ids) > 0
    assert lm.train_ids.max() < lm.vocab and lm.val_ids.max() < lm.vocab


def test_same_seed_same_gradient_bits_and_other_seed_other_batch(lm):
    x = lm.init_params(3)
    x = x + np.float32(0.01) * np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    a, b = lm.grad(x, 42, 8), lm.grad(x.copy(), 42, 8)
    assert a.grad.tobytes() == b.grad.tobytes() and a.loss == b.loss
    again = load_problem("charlm", SMALL).grad(x, 42, 8)  # a fresh instance too
    assert again.grad.tobytes() == a.grad.tobytes()
    c = lm.grad(x, 43, 8)
    assert c.grad.tobytes() != a.grad.tobytes()
    assert np.array_equal(lm.init_params(3), lm.init_params(3))
    assert not np.array_equal(lm.init_params(3), lm.init_params(4))


def test_plain_sgd_reduces_the_loss(lm):
    x = lm.init_params(0)
    before = lm.evaluate(x)
    for step in range(40):
        x = x - np.float32(1.0) * lm.grad(x, 1000 + step, 8).grad
    after = lm.evaluate(x)
    assert after["loss"] < before["loss"] - 0.5
    assert after["train_loss"] < before["train_loss"] - 0.5


def test_options_are_coerced_through_the_loader():
    assert "charlm" in BUILTIN_PROBLEMS
    p = load_problem("charlm", {"layers": "1", "d_model": "24", "heads": "3", "context": "8", "val_frac": "0.2",
                                "eval_windows": "4", "package": "json"})
    assert (p.layers, p.d_model, p.heads, p.context) == (1, 24, 3, 8)
    assert p.options == {"layers": 1, "d_model": 24, "heads": 3, "context": 8, "val_frac": 0.2,
                         "eval_windows": 4, "package": "json"}
    assert len(p.val_ids) == pytest.approx(0.2 * (len(p.train_ids) + len(p.val_ids)), abs=1)
    assert len(p.layout) == 2 + 4 * 1 + 1


@pytest.mark.parametrize("opts, match", [
    ({"d_model": "30", "heads": "4"}, "multiple of heads"),
    ({"context": "1"}, "context"),
    ({"val_frac": "0.9"}, "val_frac"),
    ({"layers": "0"}, "layers"),
    ({"package": "no_such_pkg_xyz"}, "not a standard-library package"),
    ({"package": "numpy"}, "not a standard-library package"),  # installed, but not the standard library's
    ({"package": "../etc"}, "not a standard-library package"),
    ({"package": "math"}, "not a package"),
    ({"layers": "two"}, "invalid value"),
])
def test_bad_options_are_value_errors(opts, match):
    with pytest.raises(ValueError, match=match):
        load_problem("charlm", opts)


def test_evaluate_is_deterministic_and_rejects_a_wrong_shape(lm):
    x = lm.init_params(1)
    assert lm.evaluate(x) == lm.evaluate(x.copy())
    with pytest.raises(ValueError, match="expected"):
        lm.grad(x[:-1], 0, 2)


@pytest.mark.parametrize("name", ["ringmaster-lmo", "rennala-muon", "delay-adaptive-muon"])
def test_muon_run_gives_embeddings_and_head_the_fallback_step(lm, name):
    """Issue 15 item 2: as the official NanoChat code (Muon only on the hidden matrices), a
    char-transformer run's token and position embeddings and output head take the momentum
    fallback, the hidden matrices Newton–Schulz. The simulator binds the problem's lmo_mask."""
    import algorithms
    from algorithms.base import Result
    from algorithms.lmo import POLAR_EXPRESS_NS5, newton_schulz
    from protocol.messages import JobKind
    from ps.core.config import CoreConfig
    from ps.drivers.sim import DelayModel, Simulator

    mask = dict(zip((n for n, _ in lm.layout), lm.lmo_mask, strict=True))
    assert mask["wte"] is mask["wpe"] is mask["lm_head"] is False
    assert all(mask[n] for n in mask if n.startswith("h")) and sum(mask.values()) == 4 * lm.layers
    settings = {"lr": 0.1, "B": 1} if name == "rennala-muon" else {"lr": 0.1}
    sim = Simulator(algorithms.build(name, settings), lm, DelayModel.named("uniform", 1, noise="none"),
                    CoreConfig(min_workers=1, liveness_timeout_s=1e9, seed=0))
    alg = sim.core.alg
    assert alg.layout == lm.layout and alg.lmo_mask == lm.lmo_mask
    x0 = lm.init_params(0)
    state, _ = alg.init(x0, seed=0)
    g = lm.grad(x0, 7, 4).grad
    r = Result(job_id=0, worker_id="w", created_at=0, kind=JobKind.GRAD, iterate_ids=(0,), grads=(g,))
    state, out = alg.apply(state, [r])
    assert state.version == 1
    # First step, as the public code: m_0 = 0, m_1 = (1 − β) g, the Nesterov blend u = (1 − β²) g, for all
    # three (RingmasterLMO and Delay-adaptive Muon: momentum_start="zero", α = 0.05; issue 31).
    scale = 1 - 0.95 ** 2
    step = (np.asarray(x0, np.float64) - np.asarray(state.x, np.float64)) / 0.1
    off = 0
    for (block, shape), flagged in zip(lm.layout, lm.lmo_mask, strict=True):
        size = shape[0] * shape[1]
        u = scale * g[off:off + size].astype(np.float64)
        if flagged:
            want = newton_schulz(u.reshape(shape), POLAR_EXPRESS_NS5, 5) * math.sqrt(max(1.0, shape[0] / shape[1]))
        else:  # fallback: the direction itself, no orthogonalisation
            want = u.reshape(shape)
        np.testing.assert_allclose(step[off:off + size], want.ravel(), rtol=2e-3, atol=2e-6, err_msg=block)
        off += size
