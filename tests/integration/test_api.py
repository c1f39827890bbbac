"""The Python API (latecomer/api.py) with real processes and sockets.

- The README's "Python API" script (a user's MLP on scikit-learn's digits, defined in the
  script itself; at most 15 lines beyond the model and the data) runs as ``python script.py``,
  in thread and in process server mode: the ``nn.Module`` it gets back scores on the test split
  exactly the server's last evaluation (recomputed here, independently), and no worker is left.
- The same code in a notebook, executed headless by nbclient in a real kernel.
- ``run.evaluations()`` is live: evaluations arrive while the run is going.
- Leaving the ``with`` block mid-run stops the run early, in bounded time, every process gone;
  ``latecomer.connect(endpoint).status()`` reads the running server meanwhile.
- ``log_to`` reaches the loggers (skipped while ps.observe.loggers is absent).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import psutil
import pytest

import latecomer
from problems.quadratic import make_quadratic
from tests.conftest import REPO
from tests.integration.util import readme_block

pytestmark = pytest.mark.slow

STEPS = 2000  # the README script's
CHECK = '''
import glob, json, psutil
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
tb = EventAccumulator(glob.glob("runs/**/*tfevents*", recursive=True)[0])
tb.Reload()
x, y = digits()[1].tensors
with torch.no_grad():
    acc = float((net(x).argmax(1) == y).double().mean())
print("RESULT " + json.dumps({"accuracy": acc, "last": summary["evaluations"][-1], "workers": run.workers,
                              "children": [p.pid for p in psutil.Process().children(recursive=True)],
                              "stopped": summary["stopped"], "running": run.running,
                              "versions": [e["version"] for e in summary["evaluations"]],
                              "losses": [e["loss"] for e in summary["evaluations"]],
                              "tb": [(s.step, s.value) for s in tb.Scalars("eval/loss")]}))
'''


def readme_script() -> str:
    """The Python block of the README's "Python API" section."""
    return readme_block("Python API", "python")


def in_mode(script: str, server: str) -> str:
    return script if server == "thread" else script.replace("workers=2,", f'workers=2, server="{server}",', 1)


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1")  # this checkout's code, not another install


def gone(pids) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def check_result(out: str) -> dict:
    result = json.loads(re.search(r"^RESULT (.*)$", out, re.M).group(1))
    assert result["last"]["version"] == STEPS and result["stopped"] == f"reached {STEPS} steps"
    assert result["accuracy"] == result["last"]["accuracy"] > 0.9  # the module scores what the server scored
    assert len(result["workers"]) == 2 and not result["running"]
    assert result["children"] == [], "every worker (and a server process) reaped"
    assert gone(result["workers"])
    assert f"step {STEPS}: loss" in out  # the live loop printed the last evaluation
    # TensorBoard's event file holds the loss curve, step for step (float32, as TensorBoard keeps it)
    assert [step for step, _ in result["tb"]] == [int(v) for v in result["versions"]]
    assert [v for _, v in result["tb"]] == pytest.approx(result["losses"], rel=1e-6)
    return result


def test_the_readme_script_is_short_and_complete():
    script = readme_script()
    body = script[script.index("\nwith latecomer.start"):]
    imports = [s for s in script[:script.index("\ndef ")].splitlines() if s.strip()]
    assert len([s for s in body.splitlines() if s.strip()]) + len(imports) <= 15


@pytest.mark.parametrize("server", ["thread", "process"])
def test_a_script_trains_its_own_model_and_gets_the_trained_module_back(tmp_path, server):
    (tmp_path / "script.py").write_text(in_mode(readme_script(), server) + CHECK)
    p = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    result = check_result(p.stdout)
    assert (tmp_path / "model.pt").stat().st_size > 0
    if server == "thread":  # every evaluation, in order, as they came
        printed = [int(v) for v in re.findall(r"^step (\d+): loss", p.stdout, re.M)]
        assert printed == [int(v) for v in result["versions"]] and len(printed) == STEPS // 500 + 1


def test_the_same_in_a_notebook_run_headless(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    script = readme_script()
    cut = script.index("\nwith latecomer.start")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in (script[:cut], script[cut:], CHECK)]
    monkeypatch.setenv("PYTHONPATH", REPO)  # the kernel's environment
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    out = "".join(o.get("text", "") for c in nb.cells for o in c.outputs if o.output_type == "stream")
    check_result(out)


def quad(d: int = 50, device: str = "cpu"):
    """A factory of this module's own: the workers are forked to load it."""
    return make_quadratic(d=d)


def test_evaluations_arrive_while_the_run_goes_and_every_one_comes():
    seen = []
    with latecomer.start(quad, algorithm="asgd", settings={"lr": 0.05}, workers=2, steps=400, eval_every=100,
                         delays=[0.01, 0.02]) as run:
        for ev in run.evaluations():
            seen.append((ev, run.running, run.status()["info"].get("version")))
        summary = run.wait(60)
    versions = [ev["version"] for ev, _, _ in seen]
    assert versions == [e["version"] for e in summary["evaluations"]] and versions[-1] == 400
    live = [ev for ev, running, _ in seen if running and 0 < ev["version"] < 400]
    assert live, f"no evaluation came while the run was going: {seen}"
    assert gone(run.workers)


@pytest.mark.parametrize("server, problem", [("thread", quad), ("process", "quadratic")])
def test_leaving_the_block_mid_run_stops_it_and_reaps_everything_and_connect_reads_it(server, problem):
    steps = 10 ** 7
    with latecomer.start(problem, algorithm="asgd", settings={"lr": 0.01}, workers=2, steps=steps, server=server,
                         eval_every=500, delays=0.002) as run:
        deadline = time.monotonic() + 60
        client = latecomer.connect(run.endpoint)
        while time.monotonic() < deadline:
            st = client.status(timeout=5)
            if st["info"]["version"] >= 100 and {w["worker"] for w in st["workers"]} == {"w1", "w2"}:
                break
            time.sleep(0.1)  # polling a condition, with a deadline
        else:
            pytest.fail(f"the run did not reach step 100 with both workers: {st}")
        assert st["info"]["problem"].startswith("<local>:quad#" if server == "thread" else "quadratic")
        assert st["info"]["algorithm"] == "asgd" and st["running"]
        mine = run.status()
        assert mine["running"] and {w["worker"] for w in mine["workers"]} <= {"w1", "w2"}
        pids = list(run.workers)
        t0 = time.monotonic()
    exit_s = time.monotonic() - t0
    assert exit_s < 45, f"leaving the block took {exit_s:.1f} s"  # a bound (30 s server + 5 s workers), not a speed
    assert not run.running and gone(pids)
    ours = {p.pid for p in psutil.Process().children(recursive=True)} & set(pids)
    assert not ours
    summary = run.wait(0)
    assert 100 <= summary["version"] < steps
    assert summary["stopped"] == ("stopped from Python" if server == "thread" else "signal SIGTERM")
    assert summary["evaluations"][-1]["version"] == summary["version"]  # the final iterate was evaluated
    assert run.params().shape == (50 if server == "thread" else 64,)
    with pytest.raises(ValueError, match="no PyTorch model"):
        run.model()


def test_a_module_of_your_own_by_its_spec_and_the_outputs_of_out(tmp_path, monkeypatch):
    """A spec string of the user's module: the workers are `latecomer work` processes allowed to
    load exactly it; ``out`` gets what ``serve --out`` writes, and wait() returns its summary.json."""
    (tmp_path / "apimod.py").write_text("from problems.quadratic import make_quadratic\n\n"
                                        "def make(d=12, device='cpu'):\n    return make_quadratic(d=d)\n")
    monkeypatch.chdir(tmp_path)
    run = latecomer.train("apimod:make", problem_options={"d": 12}, algorithm="asgd", settings={"lr": 0.05},
                          workers=2, steps=150, eval_every=50, out=str(tmp_path / "out"))
    summary = run.wait()
    assert summary == json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["version"] == 150 and run.params().shape == (12,)
    import numpy as np

    assert np.array_equal(run.params(), np.load(tmp_path / "out" / "final_x.npy"))
    assert sorted(run.state_dict()) == ["x"] and gone(run.workers)
    assert "--allow-problem" not in (tmp_path / "out" / "w1.log").read_text()  # the worker loaded it: no refusal


@pytest.mark.parametrize("server", ["thread", "process"])
def test_log_to_reaches_a_logger(tmp_path, server):
    loggers = pytest.importorskip("ps.observe.loggers")
    spec = f"tensorboard:{tmp_path / 'tb'}"
    try:
        loggers.make_logger(spec).close()
    except ValueError as e:  # the package behind it is not installed here
        pytest.skip(str(e))
    run = latecomer.train("quadratic", algorithm="asgd", settings={"lr": 0.05}, workers=1, steps=200, eval_every=50,
                          server=server, log_to=[spec])
    assert run.wait()["version"] == 200
    files = [f for _, _, fs in os.walk(tmp_path / "tb") for f in fs if "tfevents" in f]
    assert files and sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path / "tb")
                         for f in fs) > 0
