"""A slow evaluation does not stall the server (issue 24): the loop goes on while it runs.

A user's problem whose ``evaluate`` holds the GIL in a Python loop for EVAL_S seconds, longer
than the liveness timeout (3 s) after which a worker that hears nothing from the server
reconnects. Its gradient is the constant 1, so the iterate of version v is exactly
``-LR * v`` (float32 multiples of 0.5: no rounding), and each evaluation reports the iterate it
saw. Two workers train with ASGD while the server evaluates, and:

- no worker logs ``server silent ... reconnecting``, none is written off (no ``lost`` event, a
  lost count of 0): heartbeats kept flowing both ways;
- replies were applied during every evaluation (the loop went on), and more than a
  liveness timeout's worth of the run was spent evaluating;
- every recorded evaluation is of exactly the iterate of the version it names (``w`` =
  ``-LR * version``), its ``t`` before the evaluation's end, and the final iterate is evaluated.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.integration.test_own_model import start
from tests.integration.util import read_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

EVAL_S, LR, STEPS = 4.0, 0.5, 2500

SLOW = '''
import os
import time

import numpy as np

import latecomer


class SlowEval(latecomer.Problem):
    layout = (("w", (4,)),)

    def __init__(self, log_dir, eval_s):
        self.log_dir, self.eval_s = log_dir, eval_s

    def init_params(self, seed):
        return np.zeros(4, np.float32)

    def grad(self, x, seed, batch_size):
        return latecomer.GradResult(grad=np.ones(4, np.float32), loss=float(x[0]))

    def evaluate(self, x):
        w = float(x[0])
        t0 = time.monotonic()
        n = 0
        while time.monotonic() - t0 < self.eval_s:  # Python code: holds the GIL but for its switches
            n += sum(i * i for i in range(1000)) & 1
        with open(os.path.join(self.log_dir, "evals.txt"), "a") as f:
            f.write(f"{t0} {time.monotonic()} {w}\\n")
        return {"loss": abs(w), "w": w}


def make(log_dir: str = "", eval_s: float = 1.0, device: str = "cpu"):
    return SlowEval(log_dir, eval_s)
'''


def test_a_slow_evaluation_leaves_heartbeats_replies_and_jobs_flowing(procs, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "slowmod.py").write_text(SLOW)
    logs = tmp_path / "logs"
    logs.mkdir()
    events = tmp_path / "events.jsonl"
    server = start(procs, project, "serve", "--bind", "tcp://127.0.0.1:0", "--problem", "slowmod:make",
                   "--problem-opt", f"log_dir={logs}", "--problem-opt", f"eval_s={EVAL_S}", "--algorithm", "asgd",
                   "--set", f"lr={LR}", "--max-steps", str(STEPS), "--eval-every", "500", "--min-workers", "2",
                   "--events", str(events), "--out", "out")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    workers = [start(procs, project, "work", "--server", endpoint, "--worker-id", f"w{i}", "--delay", "0.004",
                     "--allow-problem", "slowmod:make", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
               for i in (1, 2)]
    assert wait_exit(server, timeout=180) == 0
    errs = []
    for w in workers:
        assert wait_exit(w, timeout=30) == 0
        errs.append(w.stderr.read().decode())
    summary = json.loads((project / "out" / "summary.json").read_text())
    ev = read_events(str(events))

    for err in errs:
        assert "server silent" not in err and "reconnecting" not in err, err
    assert not [e for e in ev if e["ev"] in ("lost", "left")], [e for e in ev if e["ev"] in ("lost", "left")]
    assert summary["counters"]["lost"] == 0 and summary["version"] == STEPS

    windows = [tuple(float(v) for v in line.split()) for line in (logs / "evals.txt").read_text().splitlines()]
    applied_t = sorted(e["t"] for e in ev if e["ev"] == "applied")
    first, last = applied_t[0], applied_t[-1]
    during = [(t0, t1) for t0, t1, _ in windows if first < t0 and t1 < last]  # evaluations inside training
    assert during, (windows, first, last)
    for t0, t1 in during:
        inside = sum(t0 <= t <= t1 for t in applied_t)
        assert inside >= 50, f"{inside} replies applied during the evaluation of {t0:.2f}-{t1:.2f}"
    assert sum(t1 - t0 for t0, t1 in during) > 3.0  # more than a liveness timeout spent evaluating

    evals = summary["evaluations"]
    assert [e["w"] for e in evals] == [-LR * e["version"] for e in evals]  # each of the iterate it names
    assert evals[-1]["version"] == STEPS and evals[0]["version"] == 0
    assert sorted(w for _, _, w in windows) == sorted(e["w"] for e in evals)  # each evaluation recorded once
