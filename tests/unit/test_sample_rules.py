"""PROTOCOL.md §8.12: how a job's ``seed`` becomes the sample for the built-in problems, computed
here the documented way and compared with the problems' own code (a third-party worker that
follows §8.12 reproduces the oracle, so its runs replay without --log-payloads)."""

import math

import numpy as np
import pytest

from problems.logreg import LogisticRegression
from problems.quadratic import NesterovQuadratic


@pytest.mark.parametrize("noise", ["scalar", "isotropic"])
def test_quadratic_noise_is_one_default_rng_draw_in_float64(noise):
    p = NesterovQuadratic(d=16, sigma=0.3, noise=noise)
    x = np.linspace(-1, 1, 16).astype(np.float32)
    for seed, b in ((0, 1), (12345, 7), (2**40 + 3, 32)):
        rng = np.random.default_rng(seed)
        z = rng.standard_normal() if noise == "scalar" else rng.standard_normal(16)
        want = (p._residual(x.astype(np.float64)) + (0.3 / math.sqrt(b)) * z).astype(np.float32)
        assert np.array_equal(p.grad(x, seed, b).grad, want)


def test_logreg_batch_is_integers_with_replacement():
    p = LogisticRegression(n=200, p=5)
    x = np.full(5, 0.1, np.float32)
    for seed, b in ((1, 4), (99, 16)):
        idx = np.random.default_rng(seed).integers(0, 200, size=b)
        g, _ = p._sums(x.astype(np.float64), p.features[idx], p.labels[idx])
        assert np.array_equal(p.grad(x, seed, b).grad, (g / b).astype(np.float32))
