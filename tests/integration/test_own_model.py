"""Acceptance test of "bring your own PyTorch model" (issue 12), with real processes.

A user's module (the example ``examples/own_model/mymodel.py``: an ``nn.Module`` with
Dropout and BatchNorm on a TensorDataset of scikit-learn's digits, written against the public
``latecomer`` API only) is copied into an empty folder. The console script serves it from
that folder without PYTHONPATH, three workers train it with ASGD, one is killed with SIGKILL
mid-run. Then:

- the server's last evaluation (of the final iterate) is within 0.02 accuracy of what plain
  PyTorch SGD reaches with the same model, learning rate, batch size and number of gradient
  evaluations (a shuffled DataLoader loop, ``model.eval()`` at the end);
- ``latecomer export`` gives a state dict that a fresh module loads and that scores exactly
  the server's last accuracy on the test set;
- ``latecomer replay`` reproduces the final iterate bit for bit (the server recomputes every
  gradient with the same TorchProblem code as the workers: seeded batches, seeded Dropout).

The second test runs the README's "Your own model" commands as they are written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.integration.util import readme_block, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

BIN = os.path.dirname(sys.executable)
LATECOMER = os.path.join(BIN, "latecomer")
EXAMPLE = os.path.join(REPO, "examples", "own_model", "mymodel.py")
LR, BATCH, STEPS = 0.05, 32, 2000
TOLERANCE = 0.02


def user_env() -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH pointing at the repository."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start(procs, cwd, *args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """``latecomer ARGS`` (the console script) in ``cwd``; reaped by the ``procs`` fixture."""
    p = subprocess.Popen([LATECOMER, *args], cwd=cwd, env=user_env(), stdin=subprocess.DEVNULL, stdout=stdout,
                         stderr=stderr, start_new_session=True)
    procs.children.append(p)
    return p


def run(cwd, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([LATECOMER, *args], cwd=cwd, env=user_env(), capture_output=True, text=True,
                          timeout=timeout)


def import_user_module(path):
    spec = importlib.util.spec_from_file_location(f"user_mymodel_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain_pytorch_accuracy(module, steps: int, seed: int = 0) -> float:
    """Test accuracy of the user's model after ``steps`` plain SGD steps (a shuffled DataLoader loop)."""
    import torch
    from torch.utils.data import DataLoader

    torch.manual_seed(seed)
    train, test = module.digits()
    net = module.Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    net.train()
    done = 0
    while done < steps:
        for xb, yb in DataLoader(train, batch_size=BATCH, shuffle=True):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
            done += 1
            if done == steps:
                break
    return accuracy_of(net, test)


def accuracy_of(net, test) -> float:
    """Accuracy of ``net`` in eval mode on a TensorDataset."""
    import torch

    net.eval()
    x, y = test.tensors
    with torch.no_grad():
        return float((net(x).argmax(1) == y).double().mean())




def applied(events) -> int:
    return sum(1 for e in events if e["ev"] == "applied")


def test_own_model_trains_like_plain_pytorch_exports_and_replays(procs, tmp_path):
    t0 = time.monotonic()
    user = tmp_path / "project"
    user.mkdir()
    shutil.copy(EXAMPLE, user / "mymodel.py")
    server_log = open(tmp_path / "serve.err", "wb")  # noqa: SIM115 (closed at the end)
    server = start(procs, user, "serve", "--bind", "tcp://127.0.0.1:0", "--problem", "mymodel:make",
                   "--algorithm", "asgd", "--set", f"lr={LR}", "--batch-size", str(BATCH), "--max-steps", str(STEPS),
                   "--eval-every", "250", "--min-workers", "3", "--state", "state", "--out", "out",
                   stderr=server_log)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=90).group(1)
    workers = {f"w{i}": start(procs, user, "work", "--server", endpoint, "--worker-id", f"w{i}",
                              "--allow-problem", "mymodel:make", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
               for i in (1, 2, 3)}
    events = str(user / "state" / "events.jsonl")
    wait_events(events, lambda ev: applied(ev) >= STEPS // 4, timeout=90)
    workers["w3"].send_signal(signal.SIGKILL)
    assert wait_exit(workers["w3"], timeout=10) == -signal.SIGKILL
    wait_events(events, lambda ev: any(e["ev"] in ("lost", "left") and e["worker_id"] == "w3" for e in ev),
                timeout=15)
    rc = wait_exit(server, timeout=120)
    server_log.close()
    assert rc == 0, (tmp_path / "serve.err").read_text()[-3000:]
    for w in ("w1", "w2"):  # told bye, the survivors exit by themselves
        assert wait_exit(workers[w], timeout=30) == 0
    trained_s = time.monotonic() - t0

    summary = json.loads((user / "out" / "summary.json").read_text())
    c, last = summary["counters"], summary["evaluations"][-1]
    assert c["applied"] == c["updates"] == STEPS and c["workers_lost"] >= 1
    assert last["version"] == STEPS  # the last evaluation is of the final iterate
    module = import_user_module(user / "mymodel.py")
    baseline = plain_pytorch_accuracy(module, c["applied"])  # one gradient evaluation per applied step
    print(f"\nlatecomer accuracy {last['accuracy']:.4f}, plain PyTorch SGD {baseline:.4f} "
          f"(training {trained_s:.1f} s, lost {c['lost']})")
    assert baseline > 0.9 and abs(last["accuracy"] - baseline) <= TOLERANCE

    r = run(user, "export", "state", "-o", "model.pt", "--allow-problem", "mymodel:make")
    assert r.returncode == 0, r.stderr
    assert f"at step {STEPS}" in r.stdout
    import torch

    net = module.Net()
    net.load_state_dict(torch.load(user / "model.pt"))
    assert accuracy_of(net, module.digits()[1]) == last["accuracy"]

    r = run(user, "replay", "state", "--allow-problem", "mymodel:*")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bit-identical to the recorded final iterate: yes" in r.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readme_commands() -> str:
    """The shell block of the README's "Your own model" section."""
    return readme_block("Your own model", "bash")


def test_readme_own_model_commands_run_as_written(tmp_path):
    script = readme_commands()
    assert script.startswith("cd examples/own_model\n")
    repo_copy = tmp_path / "repo"
    shutil.copytree(os.path.dirname(EXAMPLE), repo_copy / "examples" / "own_model",
                    ignore=shutil.ignore_patterns("state", "out", "*.pt", "__pycache__"))
    port = free_port()  # the only change: another port than the default 5555, which may be taken here
    script = script.replace("tcp://127.0.0.1:5555", f"tcp://127.0.0.1:{port}")
    script = script.replace("latecomer serve ", f"latecomer serve --bind tcp://127.0.0.1:{port} ", 1)
    env = user_env()
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")  # the activated virtual environment
    p = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=repo_copy, env=env, text=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=240)
    finally:
        try:  # whatever of the script's background jobs is left
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=10)
    assert p.returncode == 0, out[-3000:]
    acc = float(re.search(r"test accuracy (\d\.\d+)", out).group(1))
    assert acc > 0.95, out[-2000:]
    assert "bit-identical to the recorded final iterate: yes" in out
