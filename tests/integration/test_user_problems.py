"""A user's problem module with real processes: found in the folder the console script runs
from (no PYTHONPATH), and worker-local options overridden (or refused) per worker."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.integration.test_own_model import LATECOMER, start, user_env
from tests.integration.util import wait_exit, wait_line

pytestmark = pytest.mark.slow

TOY = '''
import os

import numpy as np

import latecomer


class Toy(latecomer.Problem):
    layout = (("w", (2,)),)

    def init_params(self, seed):
        return np.zeros(2, np.float32)

    def grad(self, x, seed, batch_size):
        return latecomer.GradResult(grad=(x - 1).astype(np.float32), loss=float(((x - 1) ** 2).sum()))

    def evaluate(self, x):
        return {"loss": float(((x - 1) ** 2).sum())}


@latecomer.worker_local("data_dir")
def make(data_dir: str = "", scale: float = 1.0, device: str = "cpu"):
    if data_dir:  # shows which value this process loaded the problem with
        with open(os.path.join(data_dir, f"loaded-{os.getpid()}"), "w") as f:
            f.write(data_dir)
    return Toy()
'''


def test_worker_local_override_and_refusal_with_the_console_script(procs, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "toymod.py").write_text(TOY)
    server_dir, local_dir = tmp_path / "server-data", tmp_path / "local-data"
    server_dir.mkdir()
    local_dir.mkdir()
    server = start(procs, project, "serve", "--bind", "tcp://127.0.0.1:0", "--problem", "toymod:make",
                   "--problem-opt", f"data_dir={server_dir}", "--algorithm", "asgd", "--set", "lr=0.1",
                   "--max-steps", "40", "--eval-every", "10", "--out", "out")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    refused = start(procs, project, "work", "--server", endpoint, "--problem-opt", "scale=3",
                    "--allow-problem", "toymod:make", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert wait_exit(refused, timeout=60) == 3
    err = refused.stderr.read().decode().strip().splitlines()
    assert len(err) == 1 and "scale: not a worker-local option, the server sets it (worker-local: data_dir)" \
        in err[0], err
    assert "ValueError" not in err[0] and err[0].count("toymod") == 1, f"the line says it once: {err[0]}"
    worker = start(procs, project, "work", "--server", endpoint, "--problem-opt", f"data_dir={local_dir}",
                   "--allow-problem", "toymod:*", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert wait_exit(server, timeout=60) == 0
    assert wait_exit(worker, timeout=30) == 0
    assert [p.read_text() for p in local_dir.iterdir()] == [str(local_dir)]  # the worker's own value
    assert [p.read_text() for p in server_dir.iterdir()] == [str(server_dir)]  # the server kept its own
    assert json.loads((project / "out" / "problem.json").read_text())["problem_options"] == \
        {"data_dir": str(server_dir)}


def test_a_module_that_is_not_in_the_folder_says_what_to_do(tmp_path):
    r = subprocess.run([LATECOMER, "serve", "--problem", "elsewhere_mod:make", "--max-steps", "1"], cwd=tmp_path,
                       env=user_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "run from the folder that holds elsewhere_mod.py (or its package elsewhere_mod/), or add that folder " \
           "to PYTHONPATH" in r.stderr and "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == []


REUSE = '''
import numpy as np

import latecomer


class Reuse(latecomer.Problem):
    """Writes every gradient into the one buffer it returned last time (seed-dependent values)."""

    def __init__(self, d):
        self.layout = (("w", (d,)),)
        self.g = np.empty(d, np.float32)

    def init_params(self, seed):
        return np.zeros(self.dim, np.float32)

    def grad(self, x, seed, batch_size):
        self.g.fill(np.float32((seed % 1000) * 1e-6))
        return latecomer.GradResult(grad=self.g, loss=0.0)

    def evaluate(self, x):
        return {"loss": float(np.ptp(x))}


def make(d: int = 2_000_000, device: str = "cpu"):
    return Reuse(int(d))
'''


def test_a_problem_that_writes_its_gradient_buffer_again_sends_each_gradient_as_computed(procs, tmp_path):
    """A user's problem that fills the same buffer on every call (nothing in the interface forbids
    it) with a worker holding 4 jobs: the next gradient is computed while the last reply, an 8 MB
    frame sent without a copy, may still wait in ZeroMQ's queue. Each reply must carry the
    gradient of its own job's sample: the final iterate is, bit for bit, what the applied jobs'
    seeds give in the order the server applied them (from its events), with all coordinates equal.
    Before the worker copied such gradients, 35 distinct values came out of this run."""
    import numpy as np

    from tests.integration.util import read_events

    project = tmp_path / "project"
    project.mkdir()
    (project / "reusemod.py").write_text(REUSE)
    steps = 150
    server = start(procs, project, "serve", "--bind", "tcp://127.0.0.1:0", "--problem", "reusemod:make",
                   "--algorithm", "asgd", "--set", "lr=1", "--max-steps", str(steps), "--eval-every", "0",
                   "--shm", "off", "--events", "events.jsonl", "--out", "out")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    worker = start(procs, project, "work", "--server", endpoint, "--credit", "4", "--shm", "off",
                   "--allow-problem", "reusemod:make")
    assert wait_exit(server, timeout=180) == 0
    assert wait_exit(worker, timeout=30) == 0
    x = np.load(project / "out" / "final_x.npy")
    want = np.float32(0)
    for e in read_events(str(project / "events.jsonl")):
        if e["ev"] == "applied":
            want = np.float32(want - np.float32(1) * np.float32((e["seed"] % 1000) * 1e-6))
    assert len(np.unique(x)) == 1, f"{len(np.unique(x))} distinct values: replies mixed gradients of other jobs"
    assert x[0] == want
