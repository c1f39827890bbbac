"""Every registered algorithm, wrapped in a cosine schedule with warmup, gradient clipping and
(where it is accepted) weight decay, still meets the algorithm contract of
``latecomer.testing.check_algorithm``: convergence with crashes, state-dict and checkpoint round
trips bit for bit. The clipping bound is below the starting gradient norm, so it really clips."""

from __future__ import annotations

import pytest

import algorithms
from latecomer.testing import check_algorithm
from tests.sim.test_contract import QUAD, SETTINGS

# The starting gradient norm is about 2.5 on the quadratic and 0.9 on the logistic regression.
CLIP = {"quadratic": 2.0, "logreg": 0.5}
WRAPPERS = {"lr_schedule": "cosine", "warmup": 10, "decay_steps": 2000, "min_lr_ratio": 0.5, "weight_decay": 1e-3}


@pytest.mark.parametrize("name", sorted(algorithms.ALGORITHMS))
def test_wrapped_algorithm_meets_the_contract(name):
    (pname, popts), settings = SETTINGS.get(name, (QUAD, {}))
    wrappers = {**WRAPPERS, "clip_norm": CLIP[pname]}
    if algorithms.ALGORITHMS[name].weight_decay_refusal:
        del wrappers["weight_decay"]
    trace = check_algorithm(lambda: algorithms.build(name, {**settings, **wrappers}), problem=pname,
                            problem_options=popts)
    clipped = [m["grad_norm"] for m in trace.metrics if m.get("grad_norm", 0.0) > wrappers["clip_norm"]]
    assert clipped, f"{name}: no update saw a gradient above clip_norm={wrappers['clip_norm']}"
    lrs = [m["lr"] for m in trace.metrics if "lr" in m]
    assert lrs and min(lrs) < max(lrs), f"{name}: the scheduled lr never changed"
