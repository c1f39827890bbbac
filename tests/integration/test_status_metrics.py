"""`latecomer status`, the Prometheus endpoint and JSON logs, checked against the event log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.integration.test_worker_lifecycle import free_port
from tests.integration.util import read_events, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([-+0-9.eE]+|NaN|\+Inf)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def status(endpoint: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ps", "status", "--server", endpoint, *extra],
                          capture_output=True, text=True, timeout=60)


def test_status_metrics_and_json_logs_agree_with_the_event_log(procs, tmp_path):
    events = str(tmp_path / "events.jsonl")
    port = free_port()
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--problem-opt", "d=16",
                         "--algorithm", "asgd", "--set", "lr=0.1", "--events", events, "--max-time", "120",
                         "--metrics-port", str(port), "--log-format", "json", "--log-level", "info",
                         "--eval-every", "20")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    w1 = procs.start("work", "--server", endpoint, "--worker-id", "w1", "--delay", "0.02", "--max-jobs", "150")
    w2 = procs.start("work", "--server", endpoint, "--worker-id", "w2", "--delay", "0.03", "--max-jobs", "100")
    wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev) >= 10, timeout=60)
    live = status(endpoint)
    assert live.returncode == 0, live.stderr
    assert "asgd on quadratic" in live.stdout and re.search(r"^w1\s+cpu", live.stdout, re.M), live.stdout
    assert wait_exit(w1, timeout=60) == 0 and wait_exit(w2, timeout=60) == 0
    wait_events(events, lambda ev: sum(e["ev"] == "left" for e in ev) == 2, timeout=20)

    ev = read_events(events)
    count = {k: sum(e["ev"] == k for e in ev) for k in ("issued", "applied", "lost", "dropped", "joined")}
    assert count["applied"] == 250, "each worker answered exactly its --max-jobs"
    r = status(endpoint, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)["info"]
    assert info["counter.applied"] == count["applied"] and info["counter.issued"] == count["issued"]
    assert info["counter.lost"] == count["lost"] and info["workers"] == 0 and info["version"] == 250
    assert info["counter.issued"] == info["counter.applied"] + info["counter.lost"] + info["outstanding"]

    deadline = time.monotonic() + 10  # the endpoint's snapshot is refreshed every 0.5 s: one taken
    while True:  # after the last reply but before the second worker left would lack its lost job
        m = scrape(port)
        if (m.get('latecomer_jobs_total{outcome="applied"}'), m.get('latecomer_jobs_total{outcome="lost"}')) == \
                (count["applied"], count["lost"]) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert m['latecomer_jobs_total{outcome="applied"}'] == count["applied"]
    assert m['latecomer_jobs_total{outcome="lost"}'] == count["lost"]
    assert m["latecomer_jobs_issued_total"] == count["issued"]
    assert m["latecomer_version"] == 250 and m["latecomer_workers_alive"] == 0
    assert m["latecomer_workers_joined_total"] == count["joined"] == 2
    assert m["latecomer_staleness_count"] == count["applied"]
    ages = [e["age"] for e in ev if e["ev"] == "applied"]
    assert m["latecomer_staleness_sum"] == sum(ages)
    assert m['latecomer_staleness_bucket{le="0"}'] == sum(a == 0 for a in ages)
    assert "latecomer_eval_loss" in m

    server.send_signal(2)  # SIGINT drains like SIGTERM
    assert wait_exit(server, timeout=30) == 0
    logs = [json.loads(line) for line in server.stderr.read().decode().splitlines() if line.startswith("{")]
    joined = [entry for entry in logs if entry.get("ev") == "joined"]
    assert sorted(entry["worker_id"] for entry in joined) == ["w1", "w2"]
    assert all({"ts", "level", "logger", "msg"} <= entry.keys() for entry in logs)
    left = [entry for entry in logs if entry.get("ev") == "left"]
    assert len(left) == 2


def test_status_of_a_server_that_is_not_there_fails_cleanly():
    r = status(f"tcp://127.0.0.1:{free_port()}", "--timeout", "1")
    assert r.returncode == 1 and "no answer" in r.stderr and "Traceback" not in r.stderr


def _lockstep_run(procs, tmp_path, name: str, *serve_args: str):
    """One worker, credit 1, asgd on quadratic for 300 steps: the jobs, their seeds and so the final
    iterate are the same however fast the loop turns. Returns (final iterate, summary.json)."""
    out = tmp_path / name
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--problem-opt", "d=16",
                         "--algorithm", "asgd", "--set", "lr=0.05", "--max-steps", "300", "--eval-every", "0",
                         "--out", str(out), "--shm", "off", *serve_args)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    procs.start("work", "--server", endpoint, "--worker-id", "w1", "--credit", "1", "--shm", "off")
    assert wait_exit(server, timeout=120) == 0
    import numpy as np

    return np.load(out / "final_x.npy"), json.loads((out / "summary.json").read_text())


def _cpus() -> int:
    """This process's CPUs: its affinity, under its cgroup's quota (cpu.max) where one is set."""
    n = len(os.sched_getaffinity(0))
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        return n if quota == "max" else min(n, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        return n


def test_busy_poll_serves_the_same_run_and_reports_its_window(procs, tmp_path):
    """`serve --busy-poll-us` changes when the loop sleeps, nothing it computes: the same lockstep run
    ends at the same iterate bit for bit, and reports its busy polls within their bound (whether
    replies come back within it depends on this machine's speed, so no hit count is required;
    tests/unit/test_loopwait.py checks the window's rules on a fake clock); summary.json has them.
    By default (auto) it polls with the bound 400 µs only while this host has a CPU for the server
    and each worker on it: here one worker, so on with two CPUs or more."""
    import numpy as np

    x_plain, plain = _lockstep_run(procs, tmp_path, "plain", "--busy-poll-us", "0")
    x_busy, busy = _lockstep_run(procs, tmp_path, "busy", "--busy-poll-us", "300")
    x_auto, auto = _lockstep_run(procs, tmp_path, "auto")
    assert plain["version"] == busy["version"] == auto["version"] == 300
    assert np.array_equal(x_plain, x_busy) and np.array_equal(x_plain, x_auto)
    assert "loop" not in plain  # 0: off
    loop = busy["loop"]
    assert loop["busy_poll"] == "300" and loop["busy_poll_on"] is True and "busy_poll_cpus" not in loop
    assert 0 <= loop["busy_poll_hits"] <= loop["busy_polls"] and 0 <= loop["busy_poll_window_us"] <= 300
    loop = auto["loop"]
    assert loop["busy_poll"] == "auto" and loop["busy_poll_cpus"] == _cpus(), loop
    # the worker has left by the end: the last check (every second) may have counted it or not
    assert loop["busy_poll_local_processes"] in (0, 1), loop
    assert loop["busy_poll_on"] is (1 + loop["busy_poll_local_processes"] <= _cpus()), loop
    assert 0 <= loop["busy_poll_hits"] <= loop["busy_polls"] and 0 <= loop["busy_poll_window_us"] <= 400


def test_busy_poll_figures_in_status(procs):
    """`latecomer status --json` shows the busy poll's figures while the server runs (none without it)."""
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--problem-opt", "d=16",
                         "--algorithm", "asgd", "--set", "lr=0.05", "--max-time", "60", "--eval-every", "0",
                         "--busy-poll-us", "300")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    procs.start("work", "--server", endpoint, "--worker-id", "w1", "--delay", "0.005")
    deadline = time.monotonic() + 60
    while True:
        r = status(endpoint, "--json")
        info = json.loads(r.stdout)["info"] if r.returncode == 0 else {}
        if info.get("version", 0) >= 5:
            break
        assert time.monotonic() < deadline, r.stderr
        time.sleep(0.1)
    assert 0 <= info["loop.busy_poll_hits"] <= info["loop.busy_polls"]
    assert 0 <= info["loop.busy_poll_window_us"] <= 300
    assert info["loop.busy_poll"] == "300" and info["loop.busy_poll_on"] is True
    server.send_signal(2)
    assert wait_exit(server, timeout=60) == 0


def test_busy_poll_auto_counts_the_local_shards(procs, tmp_path):
    """`serve --shards 2` starts its two shards on this host: with one worker that is three
    processes beside the server, so auto does not poll on a machine of fewer than four CPUs."""
    _, s = _lockstep_run(procs, tmp_path, "sharded", "--shards", "2", "--state", str(tmp_path / "state"))
    loop = s["loop"]
    assert loop["busy_poll"] == "auto" and loop["busy_poll_cpus"] == _cpus(), loop
    assert loop["busy_poll_local_processes"] in (2, 3), loop  # the shards, and the worker until it left
    assert loop["busy_poll_on"] is (1 + loop["busy_poll_local_processes"] <= _cpus()), loop
