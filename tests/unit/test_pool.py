"""The iterate buffer pool: reuse only when nothing else refers to a buffer; bit-identical steps."""

import gc

import numpy as np
import pytest

from algorithms._pool import MIN_POOLED_BYTES, ArrayPool, step_into

D = MIN_POOLED_BYTES // 4  # float32 elements: the smallest pooled size


def test_small_arrays_bypass_the_pool():
    pool = ArrayPool()
    a = pool.empty((10,), np.float32)
    assert a.shape == (10,) and pool.size() == 0


def test_a_buffer_comes_back_only_when_unreferenced():
    pool = ArrayPool()
    a = pool.empty((D,), np.float32)
    b = pool.empty((D,), np.float32)
    assert a is not b  # a is still referenced
    view = a[5:]
    del a
    c = pool.empty((D,), np.float32)
    assert c is not view.base  # a view keeps its base busy
    assert pool.allocated == 3
    del view, c
    gc.collect()
    d = pool.empty((D,), np.float32)
    assert pool.allocated == 3 and d.flags.writeable  # reused, writable again


def test_a_frozen_iterate_held_elsewhere_is_never_overwritten():
    pool = ArrayPool()
    held = []
    for k in range(20):
        y = pool.empty((D,), np.float32)
        y[:] = k
        y.setflags(write=False)
        if k % 3 == 0:
            held.append((k, y))  # e.g. the iterate store or a pending zero-copy send
        del y
    for k, y in held:
        assert np.all(y == k)
    assert pool.size() <= len(held) + 3  # free buffers beyond KEEP_FREE + 1 are let go


@pytest.mark.parametrize("d", [7, D, 3 * D + 5])
def test_step_into_is_bit_identical_to_the_plain_expression(d):
    rng = np.random.default_rng(d)
    x = rng.standard_normal(d).astype(np.float32)
    g = (rng.standard_normal(d) * 1e3).astype(np.float32)
    for lr in (0.1, 1e-3, 3.7):
        want = x - np.asarray(lr, np.float32) * g
        got = step_into(x, lr, g)
        assert got.dtype == np.float32 and not got.flags.writeable
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("d", [7, 3 * D + 5])
def test_add_scaled_is_bit_identical_to_the_plain_update(d):
    from algorithms._pool import add_scaled

    rng = np.random.default_rng(d)
    m = rng.standard_normal(d).astype(np.float32)
    g = (rng.standard_normal(d) * 1e3).astype(np.float32)
    want = m.copy()
    want += np.asarray(0.37, np.float32) * g
    add_scaled(m, 0.37, g)
    assert np.array_equal(m.view(np.uint32), want.view(np.uint32))
