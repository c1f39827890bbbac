"""The cache-blocked vector kernels of algorithms/_pool.py: bit-identical to the plain whole-array
numpy formulas at every size around the block boundaries, the fused finiteness check exact, and
the pooled buffers handed back."""

import gc
import math

import numpy as np
import pytest

from algorithms import _pool
from algorithms._pool import add_scaled, finite, momentum_into, momentum_step, step_into, step_into_checked

B = _pool.BLOCK
SIZES = [1, 7, 1000, B - 1, B, B + 1, _pool.BLOCKED_MIN - 1, _pool.BLOCKED_MIN, _pool.BLOCKED_MIN + 1,
         3 * B + 5, 4 * B]
SMALL_B = 1024  # the same kernels with a small block: many blocks and a short last one at small d
SMALL_SIZES = [SMALL_B - 1, SMALL_B, SMALL_B + 1, 2 * SMALL_B, 2 * SMALL_B + 1, 7 * SMALL_B + 13]
DTYPES = [np.float32, np.float64]


@pytest.fixture
def small_block(monkeypatch):
    monkeypatch.setattr(_pool, "BLOCK", SMALL_B)
    monkeypatch.setattr(_pool, "BLOCKED_MIN", 2 * SMALL_B)


@pytest.fixture
def pool(monkeypatch):
    p = _pool.ArrayPool()
    monkeypatch.setattr(_pool, "POOL", p)
    return p


def _vec(rng, d, dtype, scale=1.0):
    # magnitudes over many binades, so products and sums round in every direction
    return (rng.standard_normal(d) * np.exp(rng.uniform(-8, 8, d)) * scale).astype(dtype)


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


def _same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(_bits(got), _bits(want))


def plain_step(x, lr, d):
    y = d * np.asarray(-lr, x.dtype)
    return x + y


def plain_add_scaled(m, a, g):
    return m + np.asarray(a, m.dtype) * g


def _cases(sizes):
    return [(d, dt) for d in sizes for dt in DTYPES]


def _check_step(d, dtype):
    rng = np.random.default_rng(d)
    x, g = _vec(rng, d, dtype), _vec(rng, d, dtype, 1e3)
    for lr in (0.1, 1e-3, 3.7, np.float32(0.3)):
        got = step_into(x, lr, g)
        assert not got.flags.writeable
        _same(got, plain_step(x, lr, g))
        _same(got, x - np.asarray(lr, x.dtype) * g)


@pytest.mark.parametrize("d,dtype", _cases(SIZES))
def test_step_into_is_bit_identical(d, dtype):
    _check_step(d, dtype)


@pytest.mark.parametrize("d,dtype", _cases(SMALL_SIZES))
def test_step_into_is_bit_identical_with_many_blocks(small_block, d, dtype):
    _check_step(d, dtype)


def test_step_into_with_a_float64_direction_on_a_float32_iterate(small_block):
    rng = np.random.default_rng(1)
    x, g = _vec(rng, 5000, np.float32), _vec(rng, 5000, np.float64)
    want = np.empty_like(x)
    np.multiply(g, np.asarray(-0.1, np.float32), out=want)  # the plain form's dtype rules
    np.add(x, want, out=want)
    _same(step_into(x, 0.1, g), want)


def _check_add_scaled(d, dtype):
    rng = np.random.default_rng(d + 1)
    m0, g = _vec(rng, d, dtype), _vec(rng, d, dtype)
    for a in (0.1, 0.9, np.asarray(0.37, dtype)):
        m = m0.copy()
        add_scaled(m, a, g)
        _same(m, plain_add_scaled(m0, a, g))


@pytest.mark.parametrize("d,dtype", _cases(SIZES))
def test_add_scaled_is_bit_identical(d, dtype):
    _check_add_scaled(d, dtype)


@pytest.mark.parametrize("d,dtype", _cases(SMALL_SIZES))
def test_add_scaled_is_bit_identical_with_many_blocks(small_block, d, dtype):
    _check_add_scaled(d, dtype)


def test_add_scaled_of_itself_and_of_an_overlapping_view(small_block):
    rng = np.random.default_rng(2)
    m0 = _vec(rng, 5 * SMALL_B + 3, np.float32)
    m = m0.copy()
    add_scaled(m, 0.3, m)
    _same(m, plain_add_scaled(m0, 0.3, m0))
    m = m0.copy()
    add_scaled(m[1:], 0.3, m[:-1])  # overlapping, shifted: must read the old values, as the plain form does
    want = m0.copy()
    want[1:] = plain_add_scaled(m0[1:], 0.3, m0[:-1])
    _same(m, want)


def _check_momentum(d, dtype):
    rng = np.random.default_rng(d + 2)
    x, m0, g = _vec(rng, d, dtype), _vec(rng, d, dtype), _vec(rng, d, dtype, 1e2)
    for c, a, lr in ((0.9, 0.1, 0.01), (1.0 - 0.37, np.asarray(0.37 * 0.63 ** 3, dtype), 2.5)):
        m = m0.copy()
        y = momentum_step(x, lr, m, c, a, g)
        want_m = m0 * np.asarray(c, dtype)
        want_m = plain_add_scaled(want_m, a, g)
        _same(m, want_m)
        assert not y.flags.writeable
        _same(y, plain_step(x, lr, want_m))


@pytest.mark.parametrize("d,dtype", _cases(SIZES))
def test_momentum_step_is_bit_identical(d, dtype):
    _check_momentum(d, dtype)


@pytest.mark.parametrize("d,dtype", _cases(SMALL_SIZES))
def test_momentum_step_is_bit_identical_with_many_blocks(small_block, d, dtype):
    _check_momentum(d, dtype)


def _check_momentum_into(d, dtype):
    rng = np.random.default_rng(d + 3)
    m0, g = _vec(rng, d, dtype), _vec(rng, d, dtype, 1e2)
    for c, a, blend in ((0.95, 0.05, (0.95, 0.05)), (0.5, 0.5, None), (1.0 - 0.3, np.asarray(0.3, dtype), (0.7, 0.3))):
        m = m0.copy()
        u = momentum_into(m, c, a, g, blend)
        want_m = plain_add_scaled(m0 * np.asarray(c, dtype), a, g)
        _same(m, want_m)
        if blend is None:
            _same(u, want_m)
            assert u is not m and not np.may_share_memory(u, m)
        else:  # the Nesterov blend as ringmaster-lmo wrote it: (1 − α) m + α g, scalars in m's dtype
            _same(u, np.asarray(blend[0], dtype) * want_m + np.asarray(blend[1], dtype) * g)
        assert u.flags.writeable


@pytest.mark.parametrize("d,dtype", _cases(SIZES))
def test_momentum_into_is_bit_identical(d, dtype):
    _check_momentum_into(d, dtype)


@pytest.mark.parametrize("d,dtype", _cases(SMALL_SIZES))
def test_momentum_into_is_bit_identical_with_many_blocks(small_block, d, dtype):
    _check_momentum_into(d, dtype)


def _bad_positions(d):
    return sorted({0, 1, SMALL_B - 1, SMALL_B, SMALL_B + 1, d // 2, d - 2, d - 1} & set(range(d)))


@pytest.mark.parametrize("d,dtype", _cases(SMALL_SIZES))
def test_step_into_checked_steps_finite_and_refuses_nan_or_inf_anywhere(small_block, d, dtype):
    rng = np.random.default_rng(d + 3)
    x, g = _vec(rng, d, dtype), _vec(rng, d, dtype)
    got = step_into_checked(x, 0.05, g)
    assert got is not None and not got.flags.writeable
    _same(got, plain_step(x, 0.05, g))
    x_bits = _bits(x).copy()
    for pos in _bad_positions(d):
        for bad in (np.nan, np.inf, -np.inf):
            h = g.copy()
            h[pos] = bad
            assert step_into_checked(x, 0.05, h) is None, (pos, bad)
            assert finite(h) is False
    assert np.array_equal(_bits(x), x_bits)  # x never written


@pytest.mark.parametrize("d", [B - 1, _pool.BLOCKED_MIN, 3 * B + 5])
def test_step_into_checked_at_the_real_block_size(d):
    rng = np.random.default_rng(d + 4)
    x, g = _vec(rng, d, np.float32), _vec(rng, d, np.float32)
    _same(step_into_checked(x, 0.2, g), plain_step(x, 0.2, g))
    for pos in (0, B - 1, B, d - 1):
        if pos < d:
            h = g.copy()
            h[pos] = np.nan
            assert step_into_checked(x, 0.2, h) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_finite_gradient_whose_sum_of_squares_overflows_still_steps(small_block, dtype):
    d = 3 * SMALL_B + 7
    huge = math.sqrt(float(np.finfo(dtype).max)) * 4  # finite; its square is not
    rng = np.random.default_rng(5)
    x, g = _vec(rng, d, dtype), _vec(rng, d, dtype)
    g[SMALL_B + 3] = huge
    g[-1] = -huge
    with np.errstate(over="ignore"):
        assert not math.isfinite(np.dot(g, g))  # the case where the dot alone would refuse it
        assert finite(g) is True
        want = plain_step(x, 0.1, g)
        got = step_into_checked(x, 0.1, g)
        assert got is not None
        _same(got, want)
        g[2 * SMALL_B] = np.inf
        assert finite(g) is False and step_into_checked(x, 0.1, g) is None


def test_finite_agrees_with_isfinite():
    rng = np.random.default_rng(6)
    for dtype in (np.float16, np.float32, np.float64):
        for d in (1, 10, 3000):
            g = rng.standard_normal(d).astype(dtype)
            assert finite(g) is True
            for bad in (np.nan, np.inf, -np.inf):
                h = g.copy()
                h[rng.integers(d)] = bad
                assert finite(h) is False
    with np.errstate(over="ignore"):
        assert finite(np.full((3, 4), 1e200)) is True  # any shape; overflowing squares looked at exactly


def test_refused_step_hands_its_buffer_back(small_block, pool, monkeypatch):
    monkeypatch.setattr(_pool, "MIN_POOLED_BYTES", 1024)  # so that these sizes are pooled
    d = 5 * SMALL_B
    rng = np.random.default_rng(7)
    x, g = _vec(rng, d, np.float32), _vec(rng, d, np.float32)
    g[3 * SMALL_B + 2] = np.nan
    for _ in range(5):
        assert step_into_checked(x, 0.1, g) is None
    gc.collect()
    assert pool.allocated == 1 and pool.size() == 1  # one buffer, taken and handed back each time
    kept = [step_into_checked(x, 0.1, np.zeros_like(g)), step_into(x, 0.1, x), momentum_step(x, 0.1, x * 0, 1, 1, x)]
    assert all(k is not None for k in kept)
    assert pool.allocated == 3  # the first reuses the refused one; held results are never handed out again
    del kept
    gc.collect()
    for _ in range(4):
        step_into(x, 0.1, x)
        step_into_checked(x, 0.1, x)
        momentum_step(x, 0.1, np.ones_like(x), 0.5, 0.5, x)
    add_scaled(np.ones_like(x), 0.5, x)
    assert pool.allocated == 3  # results dropped at once: the same buffers come round


def test_the_momentum_methods_step_as_the_plain_formulas_say(small_block):
    """The call sites that use momentum_step (momentum ASGD, ordered momentum per reply), at a
    size that takes the blocked path, against the update written out with whole-array numpy."""
    from algorithms.base import Result
    from algorithms.baselines import NaiveMomentumASGD
    from algorithms.ordered import OrderedMomentum
    from protocol.messages import JobKind

    d, lr, beta = 5 * SMALL_B + 9, 0.01, 0.3
    for alg in (NaiveMomentumASGD(lr=lr, beta=beta), OrderedMomentum(lr=lr, beta=beta)):
        rng = np.random.default_rng(8)
        state, _ = alg.init(_vec(rng, d, np.float32), seed=0)
        x, m = state.x.copy(), state.m.copy()
        for k in range(6):
            age = k % 3 if k >= 2 else 0
            g = _vec(rng, d, np.float32)
            r = Result(job_id=k, worker_id="w", created_at=state.version - age, kind=JobKind.GRAD,
                       iterate_ids=(state.version - age,), grads=(g,))
            state, _ = alg.apply(state, [r])
            w = beta if isinstance(alg, NaiveMomentumASGD) else beta * (1.0 - beta) ** age
            m = m * np.asarray(1.0 - beta, np.float32)
            m = plain_add_scaled(m, w, g)
            x = plain_step(x, lr, m)
            _same(state.m, m)
            _same(state.x, x)
