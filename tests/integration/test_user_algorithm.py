"""A user's own algorithm (examples/my_algorithm.py) through the real console script, run from
the module's folder with no PYTHONPATH: ``latecomer simulate``; ``latecomer serve`` with two real
workers, wrapped in a cosine schedule, clipping and weight decay, resumed from its state
directory and replayed bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from problems import load_problem
from tests.integration.util import read_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                       "my_algorithm.py")
LATECOMER = os.path.join(os.path.dirname(sys.executable), "latecomer")
ALG = ["--algorithm", "my_algorithm:MomentumSGD", "--set", "lr=0.1", "--set", "beta=0.5"]
QUAD = ["--problem", "quadratic", "--problem-opt", "d=16"]


@pytest.fixture
def folder(tmp_path):
    if not os.path.exists(LATECOMER):
        pytest.skip(f"no console script at {LATECOMER}")
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(EXAMPLE, work / "my_algorithm.py")
    return work


def user_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONUNBUFFERED": "1"}


def latecomer(cwd, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([LATECOMER, *args], cwd=cwd, env=user_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def start(procs, cwd, *args) -> subprocess.Popen:
    """A console-script child that the ``procs`` fixture reaps."""
    p = subprocess.Popen([LATECOMER, *args], cwd=cwd, env=user_env(), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    procs.children.append(p)
    return p


def initial_loss() -> float:
    """f(x_0) − f* of the d = 16 quadratic, computed here, not read from the run."""
    problem = load_problem("quadratic", {"d": 16})
    return float(problem.evaluate(problem.init_params(0))["loss"])


def final_loss(x: np.ndarray) -> float:
    return float(load_problem("quadratic", {"d": 16}).evaluate(x)["loss"])


def test_simulate_loads_the_user_algorithm_from_its_folder(folder, tmp_path):
    r = latecomer(folder, "simulate", *QUAD, *ALG, "--workers", "3", "--time", "1000", "--max-steps", "300",
                  "--out", "sim")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((folder / "sim" / "summary.json").read_text())
    assert summary["counters"]["updates"] == 300 and summary["points"][-1]["version"] == 300
    first = initial_loss()
    assert f"loss: {first:.6g} -> " in r.stdout  # the run started where the problem says it does
    assert summary["points"][-1]["loss"] <= 0.05 * first
    other = tmp_path / "elsewhere"
    other.mkdir()
    r = latecomer(other, "simulate", *QUAD, *ALG, "--time", "10")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "cannot import module 'my_algorithm': run from the folder that holds my_algorithm.py" in \
        " ".join(r.stderr.split())


def serve_and_work(procs, folder, state, *args, steps: int) -> None:
    server = start(procs, folder, "serve", "--bind", "tcp://127.0.0.1:0", "--state", str(state), "--max-steps",
                   str(steps), "--min-workers", "2", "--eval-every", "0", "--checkpoint-every", "100",
                   "--liveness-timeout", "1.5", "--heartbeat-interval", "0.25", *args)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    workers = [start(procs, folder, "work", "--server", endpoint, "--worker-id", f"w{i}", "--delay", d)
               for i, d in ((1, "0.002"), (2, "0.005"))]
    assert wait_exit(server, timeout=120) == 0, server.stderr.read()[-2000:]
    for w in workers:
        assert wait_exit(w, timeout=20) == 0


def test_serve_with_two_workers_trains_resumes_and_replays_bit_for_bit(procs, folder, tmp_path):
    state = tmp_path / "state"
    wrappers = ["--set", "lr_schedule=cosine", "--set", "warmup=20", "--set", "min_lr_ratio=0.1",
                "--set", "weight_decay=1e-3", "--set", "clip_norm=1.0"]
    serve_and_work(procs, folder, state, *QUAD, *ALG, *wrappers, steps=300)
    run = json.loads((state / "run.json").read_text())
    assert run["algorithm"] == "my_algorithm:MomentumSGD"
    assert run["settings"] == {"lr": "0.1", "beta": "0.5", "lr_schedule": "cosine", "warmup": "20",
                               "min_lr_ratio": "0.1", "weight_decay": "1e-3", "clip_norm": "1.0",
                               "decay_steps": 300}  # the schedule's length: --max-steps, recorded
    summary = json.loads((state / "summary.json").read_text())
    assert summary["version"] == 300 and summary["counters"]["applied"] == 300
    first = initial_loss()
    at_300 = final_loss(np.load(state / "final_x.npy"))
    assert at_300 <= 0.05 * first, (first, at_300)
    lr = {e["version"]: e["lr"] for e in read_events(str(state / "events.jsonl")) if e["ev"] == "metrics"}
    assert lr[1] == pytest.approx(0.1 / 20) and lr[20] == pytest.approx(0.1)  # warmup: (k+1)/W at k = 0, 19
    assert lr[300] == pytest.approx(0.1 * (0.1 + 0.9 * (1 + np.cos(np.pi * 279 / 280)) / 2))  # cosine, k = 299

    # resume the same state directory: run.json names code of the user's own, which runs only if the command
    # line names it too (one line otherwise); with --allow-algorithm the recorded spec is rebuilt, up to 400
    r = latecomer(folder, "serve", "--bind", "tcp://127.0.0.1:0", "--state", str(state), "--max-steps", "400")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"Error: {state}/run.json names the algorithm my_algorithm:MomentumSGD, code of your own: it runs only if "
        "the command line names it too: add --allow-algorithm my_algorithm:MomentumSGD (or --algorithm "
        "my_algorithm:MomentumSGD)"], r.stderr
    serve_and_work(procs, folder, state, "--allow-algorithm", "my_algorithm:*", steps=400)
    assert json.loads((state / "run.json").read_text()) == run
    summary = json.loads((state / "summary.json").read_text())
    assert summary["version"] == 400 and summary["counters"]["applied"] == 400
    assert final_loss(np.load(state / "final_x.npy")) <= 0.05 * first

    r = latecomer(folder, "replay", str(state))
    assert r.returncode == 1 and "add --allow-algorithm my_algorithm:MomentumSGD" in r.stderr, r.stderr
    allow = ("--allow-algorithm", "my_algorithm:MomentumSGD")
    r = latecomer(folder, "replay", str(state), *allow)
    assert r.returncode == 0 and "bit-identical to the recorded final iterate: yes" in r.stdout, \
        r.stdout + r.stderr[-2000:]
    r = latecomer(tmp_path, "replay", str(state), *allow)  # not the module's folder: one line saying what to do
    assert r.returncode == 1 and "Traceback" not in r.stderr and "run from the folder that holds my_algorithm.py" \
        in " ".join(r.stderr.split())
