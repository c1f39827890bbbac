"""The finiteness test of a reply's gradients: in asgd's own step (one pass over g) or before
the algorithm, the same verdicts, texts and state; and of what the algorithm would get (a
float64 gradient that overflows float32 is refused)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import algorithms
from algorithms.baselines import VanillaASGD
from protocol.messages import Error, ErrorCode, Hello, Job, Ready, Reply
from ps.core.commands import Send
from ps.core.config import CoreConfig
from ps.core.server_core import ServerCore


@dataclasses.dataclass(frozen=True)
class UncheckedASGD(VanillaASGD):
    """asgd with the test left to the server (the path of every other algorithm)."""

    checks_finite = False


def run(alg, d: int, replies: list) -> tuple:
    """Feed one worker's replies (value for every coordinate, or an array, and a loss); return
    everything observable: the commands' messages, the events, the counters, x."""
    core = ServerCore(alg, np.ones(d, np.float32), CoreConfig(min_workers=1, liveness_timeout_s=1e9))
    cmds = core.handle("w", Hello(worker_id="w", boot=1, credit=1), 0.0) + core.handle("w", Ready(credit=1), 0.0)
    seen = []
    for t, (value, loss, dtype) in enumerate(replies, start=1):
        (job,) = [c.msg for c in cmds if isinstance(c, Send) and isinstance(c.msg, Job)]
        g = np.full(d, value, dtype) if np.isscalar(value) else value
        cmds = core.handle("w", Reply(job.job_id, job.created_at, (g,), loss=loss), float(t))
        seen.append([(type(c.msg).__name__, getattr(c.msg, "code", None), getattr(c.msg, "message", None))
                     for c in cmds if isinstance(c, Send)])
    events = [{k: v for k, v in e.items() if k != "t"} for e in core.drain_events()]
    return seen, events, core.counters.as_dict(), core.version, core.params().tobytes()


def spiked(d: int, where: int, value: float) -> np.ndarray:
    g = np.full(d, 0.25, np.float32)
    g[where] = value
    return g


@pytest.mark.parametrize("d", [8, 300_000])  # whole-array and cache-blocked (algorithms/_pool.py BLOCK)
def test_asgd_checking_in_its_step_decides_as_the_server_would(d):
    bad_block = d - 1 if d > 8 else 3  # past the first block: the blocked step has written part of its buffer
    replies = [(0.5, None, np.float32), (spiked(d, bad_block, np.nan), None, np.float32),
               (spiked(d, 0, np.inf), 1.0, np.float32), (np.nan, float("nan"), np.float32),
               (0.25, float("inf"), np.float32), (0.125, 0.5, np.float32), (1e39, None, np.float64),
               (-0.5, None, np.float64)]
    fused, plain = run(VanillaASGD(lr=0.1), d, replies), run(UncheckedASGD(lr=0.1), d, replies)
    assert fused == plain
    seen, events, counters, version, x = fused
    assert counters["rejected"] == 5 and counters["applied"] == 3 and version == 3
    errors = [m for cmds in seen for m in cmds if m[0] == "Error"]
    assert [e[2] for e in errors] == ["gradient holds NaN or Inf", "gradient holds NaN or Inf",
                                      "gradient holds NaN or Inf",  # NaN gradient and NaN loss: the gradient first
                                      "loss is not finite", "gradient holds NaN or Inf"]  # 1e39 in float32 is Inf
    assert all(e[1] == ErrorCode.NON_FINITE for e in errors)
    want = np.ones(d, np.float32)
    for v in (0.5, 0.125, -0.5):
        want = want + np.float32(-0.1) * np.full(d, v, np.float32)
    assert x == want.tobytes(), "the refused replies left x exactly as it was"


def test_a_float64_gradient_that_overflows_float32_is_refused_by_every_algorithm():
    for name in ("asgd", "ordered-momentum", "rennala"):
        seen, _, counters, version, x = run(algorithms.build(name, {}), 4, [(1e39, None, np.float64)])
        assert counters["rejected"] == 1 and version == 0, name
        assert np.isfinite(np.frombuffer(x, np.float32)).all()
        assert ("Error", ErrorCode.NON_FINITE, "gradient holds NaN or Inf") in seen[0], name


def test_wrappers_leave_the_test_to_the_server():
    """A wrapper may change g before the inner step: the server tests what the worker sent."""
    from algorithms.base import Algorithm

    assert VanillaASGD.checks_finite and not Algorithm.checks_finite
    wrapped = algorithms.build("asgd", {"lr": 0.1, "clip_norm": 1.0})
    assert wrapped.checks_finite is False
    assert Error  # the module's names are used
