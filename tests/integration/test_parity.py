"""Parity: the simulator and the real daemon give the same applied sequence and final iterate."""

from __future__ import annotations

import os

import numpy as np
import pytest

import algorithms
from problems import load_problem
from ps.core.config import CoreConfig
from ps.drivers.sim import DelayModel, simulate
from tests.integration.util import read_events, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

# Per-job delays chosen so that, over the first STEPS updates, no two workers finish within
# 80 ms of each other in the ideal schedule: real overheads (a millisecond or two per job, more
# on a loaded machine) cannot reorder arrivals.
DELAYS = (0.4, 1.52, 2.92)
STEPS = 14
ALG = ("ordered-momentum", {"lr": "0.2", "beta": "0.3"})
PROBLEM = ("quadratic", {"d": "16"})


def test_parity_simulator_vs_daemon(procs, tmp_path):
    events, out = str(tmp_path / "events.jsonl"), str(tmp_path / "out")
    args = ["serve", "--bind", "tcp://127.0.0.1:0", "--problem", PROBLEM[0], "--algorithm", ALG[0],
            "--batch-size", "1", "--max-steps", str(STEPS), "--min-workers", "3", "--seed", "0",
            "--events", events, "--out", out, "--liveness-timeout", "5", "--eval-every", "0"]
    for k, v in PROBLEM[1].items():
        args += ["--problem-opt", f"{k}={v}"]
    for k, v in ALG[1].items():
        args += ["--set", f"{k}={v}"]
    server = procs.start(*args)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    workers = []
    for i, d in enumerate(DELAYS, start=1):  # join in a fixed order, as the simulator does
        workers.append(procs.start("work", "--server", endpoint, "--worker-id", f"w{i}", "--delay", str(d)))
        wait_events(events, lambda ev, i=i: sum(e["ev"] == "ready" for e in ev) == i, timeout=60)
    assert wait_exit(server, timeout=60) == 0
    for w in workers:
        assert wait_exit(w, timeout=15) == 0
    real = [(e["job_id"], e["created_at"], e["worker_id"]) for e in read_events(events) if e["ev"] == "applied"]
    real_x = np.load(os.path.join(out, "final_x.npy"))

    problem = load_problem(PROBLEM[0], PROBLEM[1])
    alg = algorithms.build(*ALG)
    cfg = CoreConfig(problem=PROBLEM[0], problem_options=problem.options, batch_size=1, min_workers=3, seed=0,
                     liveness_timeout_s=5.0)
    trace = simulate(alg, problem, DelayModel.named("fixed", 3, fixed=DELAYS, noise="none"), cfg,
                     max_updates=STEPS)
    sim = [(a[0], a[1], a[2]) for a in trace.applied]
    assert len(real) == STEPS
    assert real == sim
    assert real_x.dtype == trace.final_x.dtype and np.array_equal(real_x, trace.final_x)
    assert len({a[1] for a in sim}) < STEPS, "some replies were stale: the test exercises ages > 0"
