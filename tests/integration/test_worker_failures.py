"""Real server, real workers, a user's problem module that fails: the worker says why, the server
records it (failed jobs, not lost ones), shows it in `latecomer status`, and benches a worker
whose every job fails. The module is written into a tmp dir put on PYTHONPATH of the processes
that should import it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.integration.test_status_metrics import scrape
from tests.integration.test_worker_lifecycle import free_port
from tests.integration.util import read_events, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

K = 5  # CoreConfig.max_failed_jobs, the default

FAILMOD = '''
"""Problems that fail on purpose (tests/integration/test_worker_failures.py)."""
import os

import numpy as np

from problems.base import GradResult, Problem


class Toy(Problem):
    """f(x) = |x|^2 / 2 on a layout; ``mode`` says how grad misbehaves."""

    def __init__(self, layout, mode):
        self.layout = layout
        self.mode = mode

    def init_params(self, seed):
        return np.ones(self.dim, np.float32)

    def grad(self, x, seed, batch_size):
        if self.mode == "env" and os.environ.get("FAILMOD_RAISE"):
            raise ValueError(f"boom at seed {seed}")
        if self.mode == "flaky" and seed % 4 == 0:
            raise ValueError(f"bad seed {seed}")
        if self.mode == "wrong_size":
            return GradResult(np.zeros(5, np.float32), 0.0)
        return GradResult(np.array(x, np.float32), float(0.5 * np.dot(x, x)))

    def evaluate(self, x):
        return {"loss": float(0.5 * np.dot(x, x))}


def make_env(d: int = 8):
    return Toy((("x", (d,)),), "env")


def make_flaky(d: int = 8):
    return Toy((("x", (d,)),), "flaky")


def make_wrong_size():
    return Toy((("w", (5, 6)), ("b", (1,))), "wrong_size")
'''


@pytest.fixture
def failmod(tmp_path):
    """A directory holding failmod.py; put it on PYTHONPATH to import it."""
    d = tmp_path / "usermods"
    d.mkdir()
    (d / "failmod.py").write_text(textwrap.dedent(FAILMOD), encoding="utf-8")
    return str(d)


def serve(procs, tmp_path, problem: str, failmod: str, *extra: str):
    events = str(tmp_path / "events.jsonl")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", problem, "--algorithm", "asgd",
                         "--set", "lr=0.1", "--events", events, "--out", str(tmp_path / "out"),
                         "--heartbeat-interval", "0.25", *extra, env={"PYTHONPATH": failmod})
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    return server, endpoint, events


def status_json(endpoint: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "ps", "status", "--server", endpoint, "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def rows_by_worker(st: dict) -> dict[str, dict]:
    return {r[0]: dict(zip(st["columns"], r, strict=True)) for r in st["rows"]}


def summary(tmp_path) -> dict:
    with open(tmp_path / "out" / "summary.json", encoding="utf-8") as f:
        return json.load(f)


def identity_holds(c: dict, outstanding: int) -> bool:
    return c["issued"] == (c["applied"] + c["dropped"] + c["lost"] + c["failed"] + c["cancelled"] + c["rejected"]
                           + outstanding)


def test_worker_without_the_problem_module_says_why_and_the_server_logs_it(procs, tmp_path, failmod):
    server, endpoint, events = serve(procs, tmp_path, "failmod:make_env", failmod, "--max-time", "120")
    # allowed, but no PYTHONPATH: no failmod here
    worker = procs.start("work", "--server", endpoint, "--worker-id", "w3", "--allow-problem", "failmod:*")
    assert wait_exit(worker, timeout=60) == 3
    err = worker.stderr.read().decode()
    lines = [line for line in err.splitlines() if "cannot load problem" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    prefix = "latecomer worker: cannot load problem failmod:make_env: "
    assert lines[0].startswith(prefix) and "No module named 'failmod'" in lines[0], lines[0]
    reason = lines[0][len(prefix):]
    ev = wait_events(events, lambda ev: [e for e in ev if e["ev"] == "left" and e["worker_id"] == "w3"], timeout=20)
    assert ev[0]["reason"] == "bye" and ev[0]["lost"] == 0
    told = [e for e in read_events(events) if e["ev"] == "problem_unavailable"]
    assert [(e["worker_id"], e["problem"], e["message"]) for e in told] == [("w3", "failmod:make_env", reason)]
    server.send_signal(signal.SIGTERM)
    assert wait_exit(server, timeout=30) == 0
    log = server.stderr.read().decode().splitlines()
    assert [line for line in log if line.endswith(f"worker w3 cannot load problem failmod:make_env: {reason}")], \
        "\n".join(log[-20:])
    c = summary(tmp_path)["counters"]
    assert c["issued"] == 0 and c["failed"] == 0 and c["worker_errors"] == 1


def test_worker_whose_grad_always_raises_is_benched_after_k_failed_jobs(procs, tmp_path, failmod):
    port = free_port()
    server, endpoint, events = serve(procs, tmp_path, "failmod:make_env", failmod, "--max-time", "120",
                                     "--metrics-port", str(port))
    bad = procs.start("work", "--server", endpoint, "--worker-id", "bad", "--allow-problem", "failmod:*",
                      env={"PYTHONPATH": failmod, "FAILMOD_RAISE": "1"})
    benched = wait_events(events, lambda ev: [e for e in ev if e["ev"] == "benched"], timeout=60)
    assert benched[0]["worker_id"] == "bad" and benched[0]["in_a_row"] == K
    # a healthy worker joins; it gets the jobs, the benched one gets none
    good = procs.start("work", "--server", endpoint, "--worker-id", "good", "--allow-problem", "failmod:*",
                       env={"PYTHONPATH": failmod})
    wait_events(events, lambda ev: sum(e["ev"] == "applied" and e["worker_id"] == "good" for e in ev) >= 20,
                timeout=60)
    st = status_json(endpoint)
    info, rows = st["info"], rows_by_worker(st)
    assert info["counter.failed"] == K and info["counter.lost"] == 0 and info["workers_benched"] == 1
    assert identity_holds({k[len("counter."):]: v for k, v in info.items() if k.startswith("counter.")},
                          info["outstanding"])
    assert (rows["bad"]["state"], rows["bad"]["failed"], rows["bad"]["jobs_done"]) == ("benched", K, 0)
    assert re.fullmatch(r"ValueError: boom at seed \d+", rows["bad"]["last_error"]), rows["bad"]
    assert (rows["good"]["state"], rows["good"]["failed"], rows["good"]["last_error"]) == ("ok", 0, "")
    ev = read_events(events)
    assert sum(e["ev"] == "issued" and e["worker_id"] == "bad" for e in ev) == K, "no job after the bench"
    failed = [e for e in ev if e["ev"] == "failed"]
    assert len(failed) == K and all(e["worker_id"] == "bad" and e["message"].startswith("ValueError: boom")
                                    for e in failed)
    deadline = time.monotonic() + 10  # the endpoint's snapshot is refreshed every 0.5 s
    while scrape(port).get('latecomer_jobs_total{outcome="failed"}') != K and time.monotonic() < deadline:
        time.sleep(0.2)  # polling interval of a bounded wait
    m = scrape(port)
    assert m['latecomer_jobs_total{outcome="failed"}'] == K and m["latecomer_workers_benched"] == 1
    server.send_signal(signal.SIGTERM)
    assert wait_exit(server, timeout=30) == 0
    assert wait_exit(bad, timeout=15) == 0 and wait_exit(good, timeout=15) == 0
    s = summary(tmp_path)
    c = s["counters"]
    assert c["failed"] == K and c["benched"] == 1 and identity_holds(c, s["outstanding"]) and s["accounted"]
    err = bad.stderr.read().decode()
    assert err.count("Traceback (most recent call last)") == 1, err
    assert "job 0 failed: ValueError: boom at seed" in err and 'raise ValueError(f"boom at seed {seed}")' in err
    assert "server refused: benched: 5 jobs in a row failed" in err
    log = server.stderr.read().decode()
    assert len(re.findall(r"worker bad benched: 5 jobs in a row failed \(last: ValueError: boom", log)) == 1, log
    assert len(re.findall(r"worker bad: job \d+ failed: ValueError: boom", log)) == 1, "only the first is logged"


def test_grad_that_raises_for_some_seeds_fails_those_jobs_and_training_completes(procs, tmp_path, failmod):
    # One worker: the jobs and their seeds follow from --seed 0; a quarter of the seeds fail, never
    # 5 jobs in a row within the first 120, so the worker is never benched.
    server, endpoint, events = serve(procs, tmp_path, "failmod:make_flaky", failmod, "--max-steps", "40")
    worker = procs.start("work", "--server", endpoint, "--worker-id", "w1", "--allow-problem", "failmod:*",
                         env={"PYTHONPATH": failmod})
    assert wait_exit(server, timeout=90) == 0
    assert wait_exit(worker, timeout=15) == 0
    s = summary(tmp_path)
    c = s["counters"]
    assert s["version"] == 40 and c["applied"] == 40 and "reached 40 steps" in s["stopped"]
    ev = read_events(events)
    seeds = {e["job_id"]: e["seed"] for e in ev if e["ev"] == "issued"}
    failed = [e for e in ev if e["ev"] == "failed"]
    applied = [e for e in ev if e["ev"] == "applied"]
    assert failed and all(seeds[e["job_id"]] % 4 == 0 for e in failed)
    assert all(e["message"] == f"ValueError: bad seed {seeds[e['job_id']]}" for e in failed)
    assert all(e["seed"] % 4 != 0 for e in applied)
    assert c["failed"] == len(failed) and c["lost"] == 0 and identity_holds(c, s["outstanding"])
    assert not [e for e in ev if e["ev"] == "benched"]
    assert worker.stderr.read().decode().count("Traceback (most recent call last)") == 1


def test_gradient_of_the_wrong_size_names_the_layout(procs, tmp_path, failmod):
    server, endpoint, events = serve(procs, tmp_path, "failmod:make_wrong_size", failmod, "--max-time", "120")
    worker = procs.start("work", "--server", endpoint, "--worker-id", "w1", "--allow-problem", "failmod:*",
                         env={"PYTHONPATH": failmod})
    want = "grad: expected 31 values (w (5, 6), b (1,)), got 5"
    failed = wait_events(events, lambda ev: [e for e in ev if e["ev"] == "failed"], timeout=60)
    assert failed[0]["message"] == want and failed[0]["worker_id"] == "w1"
    wait_events(events, lambda ev: any(e["ev"] == "benched" for e in ev), timeout=30)
    server.send_signal(signal.SIGTERM)
    assert wait_exit(server, timeout=30) == 0 and wait_exit(worker, timeout=15) == 0
    err = worker.stderr.read().decode()
    assert f"job 0 failed: {want}" in err and "Traceback" not in err, err
    c = summary(tmp_path)["counters"]
    assert c["failed"] == K and c["rejected"] == 0, "failed on the worker, before anything was sent"
