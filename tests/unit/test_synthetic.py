"""The benchmark problem: fixed gradient, no compute, loadable by name."""

import numpy as np
import pytest

from problems import load_problem


def test_synthetic_problem_is_cheap_and_fixed():
    p = load_problem("synthetic", {"d": "7"})
    x = p.init_params(0)
    a, b = p.grad(x, 1, 1), p.grad(x + 1, 2, 4)
    assert p.dim == 7 and x.dtype == np.float32 and np.array_equal(a.grad, b.grad)
    assert p.evaluate(np.ones(7, np.float32))["loss"] == pytest.approx(3.5)
    with pytest.raises(ValueError):
        load_problem("synthetic", {"d": "0"})
