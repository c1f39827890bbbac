"""`latecomer advise` on a real recorded run: a `latecomer serve --state` daemon with three local
workers of injected heterogeneous delays; advise's JSON and its table, the plot, and the printed
`latecomer serve` command line, which is then started and trains."""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys

import pytest

from tests.integration.util import wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

DELAYS = ("0.005", "0.01", "0.03")


def record(procs, state):
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--state", state, "--problem", "quadratic",
                         "--problem-opt", "d=16", "--algorithm", "asgd", "--set", "lr=0.1", "--batch-size", "4",
                         "--max-steps", "150", "--eval-every", "10", "--min-workers", "3")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    workers = [procs.start("work", "--server", endpoint, "--worker-id", f"w{i}", "--delay", d)
               for i, d in enumerate(DELAYS, 1)]
    assert wait_exit(server, timeout=120) == 0
    for w in workers:
        assert wait_exit(w, timeout=30) == 0


def advise(state, out, *extra):
    r = subprocess.run([sys.executable, "-m", "ps", "advise", state, "--algorithms", "asgd,ringmaster,rennala",
                        "--seeds", "2", "--budget", "20", "--out", out, *extra], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_advise_a_recorded_run_and_start_its_winner(procs, tmp_path):
    state = str(tmp_path / "state")
    record(procs, state)
    d = json.loads(advise(state, str(tmp_path / "adv"), "--json"))
    assert [w["worker"] for w in d["cluster"]["workers"]] == ["w1", "w2", "w3"]
    means = [w["mean_job_s"] for w in d["cluster"]["workers"]]
    assert means == sorted(means) and means[0] >= 0.005 and means[2] >= 0.03, "the injected delays, fitted"
    assert {r["algorithm"] for r in d["ranking"]} == {"asgd", "ringmaster", "rennala"}
    assert d["recorded"]["algorithm"] == "asgd" and d["recorded"]["time_to_target_s"] > 0
    assert all(r["predicted_s"] and r["seeds"] >= 1 for r in d["ranking"][:1]) and d["oracle"].startswith("exact")
    import matplotlib.image

    assert matplotlib.image.imread(d["plot"]).shape[0] > 100, "the plot is a PNG that opens"
    table = advise(state, str(tmp_path / "adv2"))
    lines = table.splitlines()
    for r in d["ranking"]:
        assert any(line.split()[1:2] == [r["algorithm"]] for line in lines), table
    assert any(line.split()[:1] == ["synchronous"] for line in lines) and "oracle: exact" in table
    command = lines[lines.index("winner:") + 1].strip()
    assert command == d["command"]
    recorded = json.loads((tmp_path / "state" / "run.json").read_text())
    check_the_command_trains(procs, tmp_path, command, d["target"]["value"], recorded["problem_options"])


def check_the_command_trains(procs, tmp_path, command, target, problem_options):
    args = shlex.split(command)
    assert args[:2] == ["latecomer", "serve"]
    out = tmp_path / "winner"
    server = procs.start(*args[1:], "--bind", "tcp://127.0.0.1:0", "--max-steps", "150", "--eval-every", "10",
                         "--out", str(out))
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    worker = procs.start("work", "--server", endpoint, "--worker-id", "w1")
    assert wait_exit(server, timeout=120) == 0
    assert wait_exit(worker, timeout=30) == 0
    assert json.loads((out / "problem.json").read_text())["problem_options"] == problem_options, \
        "the recorded run's problem, options included"
    summary = json.loads((out / "summary.json").read_text())
    loss = summary["evaluations"][-1]["loss"]
    assert summary["version"] > 0 and math.isfinite(loss)
    assert loss <= 2 * target, f"the winner's command trains towards the target ({loss} vs {target})"


def test_advise_live_from_a_running_servers_status(procs, tmp_path):
    events = str(tmp_path / "events.jsonl")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--problem-opt", "d=16",
                         "--algorithm", "asgd", "--set", "lr=0.1", "--batch-size", "4", "--eval-every", "10",
                         "--max-time", "120", "--events", events)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    procs.start("work", "--server", endpoint, "--worker-id", "w1", "--delay", "0.01")
    wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev) >= 30, timeout=60)
    r = subprocess.run([sys.executable, "-m", "ps", "advise", "--live", endpoint, "--problem-opt", "d=16",
                        "--set", "lr=0.1", "--target-loss", "0.5", "--algorithms", "asgd", "--seeds", "1",
                        "--budget", "10", "--out", str(tmp_path / "adv"), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    (w,) = d["cluster"]["workers"]
    assert w["worker"] == "w1" and w["mean_job_s"] >= 0.01 and w["jobs"] >= 30, "status?'s job times"
    assert d["source"] == endpoint and d["recorded"]["algorithm"] == "asgd" and d["ranking"][0]["predicted_s"]
