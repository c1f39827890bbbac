"""`latecomer launch` over a fake ssh against a real server, and `latecomer report` on a real run."""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO
from tests.integration.util import read_events, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

PR_SET_CHILD_SUBREAPER = 36


def latecomer(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ps", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture
def subreaper():
    """Workers detached by `setsid nohup ... &` are orphaned when the fake ssh exits: become their
    subreaper so they are reparented to this process and can be waited for (no zombies left)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip("prctl(PR_SET_CHILD_SUBREAPER) not available")
    pids: list[int] = []
    try:
        yield pids
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:
            reap(pid, timeout=5)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def reap(pid: int, timeout: float) -> bool:
    """Wait (bounded) for our child ``pid`` to exit; True once reaped or not our child."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        if done:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # polling interval of a bounded wait


def fake_ssh(tmp_path) -> str:
    """`ssh [-n] [-o OPT]... HOST COMMAND`: run COMMAND locally with bash, log the host."""
    path = tmp_path / "fake-ssh"
    path.write_text('#!/bin/bash\nwhile [[ $# -gt 0 ]]; do case "$1" in -n) shift;; -o) shift 2;; *) break;; esac; '
                    'done\nhost=$1; shift\necho "$host" >> "$FAKE_SSH_LOG"\nexec bash -c "$*"\n')
    path.chmod(0o755)
    return str(path)


def test_launch_starts_workers_over_ssh_and_stops_them(procs, tmp_path, subreaper, monkeypatch):
    events = str(tmp_path / "events.jsonl")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--problem-opt", "d=8",
                         "--algorithm", "asgd", "--set", "lr=0.05", "--liveness-timeout", "2",
                         "--heartbeat-interval", "0.25", "--max-time", "60", "--events", events)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    hosts = tmp_path / "hosts"
    hosts.write_text("# two fake hosts\nhostA 1 cpu\n\nhostB 2   # two workers\n")
    launch_file = str(tmp_path / "launch.json")
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "ssh.log"))
    remote = f"{shlex.quote(sys.executable)} -m ps"
    r = latecomer("launch", "--hosts", str(hosts), "--server", endpoint, "--ssh", fake_ssh(tmp_path),
                  "--remote-cmd", remote, "--launch-file", launch_file, "--log-dir", str(tmp_path))
    record = json.load(open(launch_file, encoding="utf-8")) if os.path.exists(launch_file) else {"workers": []}
    subreaper.extend(w["pid"] for w in record["workers"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 workers started" in r.stdout
    assert [(w["host"], w["worker_id"], w["device"]) for w in record["workers"]] == [
        ("hostA", "hostA-0", "cpu"), ("hostB", "hostB-0", "cpu"), ("hostB", "hostB-1", "cpu")]
    assert (tmp_path / "ssh.log").read_text().split() == ["hostA", "hostB", "hostB"]
    ids = {"hostA-0", "hostB-0", "hostB-1"}
    for w in record["workers"]:
        p = psutil.Process(w["pid"])
        assert " work " in " ".join(p.cmdline()) and w["worker_id"] in p.cmdline()

    def trained(ev):
        applied = {e["worker_id"] for e in ev if e["ev"] == "applied"}
        return ids <= applied
    wait_events(events, trained, timeout=60)

    r = latecomer("launch", "--stop", "--launch-file", launch_file, "--ssh", fake_ssh(tmp_path), "--grace", "5")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith(("stopped", "killed"))) == \
        sorted(ids)
    assert "stopped hostA-0 on hostA" in r.stdout, "SIGTERM was enough"
    assert not os.path.exists(launch_file)
    for w in record["workers"]:
        assert reap(w["pid"], timeout=10), f"{w['worker_id']} (pid {w['pid']}) still running"
    left = wait_events(events, lambda ev: {e["worker_id"] for e in ev if e["ev"] == "left"} >= ids and ev,
                       timeout=10)
    reasons = {e["worker_id"]: e["reason"] for e in left if e["ev"] == "left"}
    # SIGTERM: each worker says bye and closes its socket; the daemon may notice the closed
    # connection ("unreachable") before it reads the bye. Either way not a liveness timeout.
    assert set(reasons.values()) <= {"bye", "unreachable"}, reasons
    server.send_signal(signal.SIGTERM)
    assert wait_exit(server, timeout=30) == 0
    for w in record["workers"]:
        assert os.path.exists(w["log"])


def md_table(md: str, header_start: str) -> list[list[str]]:
    lines = md.splitlines()
    i = next(n for n, ln in enumerate(lines) if ln.startswith(header_start))
    rows = []
    for ln in lines[i + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows


def test_report_from_a_real_run(procs, tmp_path):
    state = tmp_path / "state"
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--state", str(state), "--problem", "quadratic",
                         "--problem-opt", "d=8", "--algorithm", "asgd", "--set", "lr=0.05", "--max-steps", "200",
                         "--eval-every", "50", "--min-workers", "2", "--liveness-timeout", "2",
                         "--heartbeat-interval", "0.25")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    w1 = procs.start("work", "--server", endpoint, "--worker-id", "w1", "--give-up", "20")
    w2 = procs.start("work", "--server", endpoint, "--worker-id", "w2", "--delay", "0.01", "--give-up", "20")
    assert wait_exit(server, timeout=60) == 0
    assert wait_exit(w1, timeout=15) == 0 and wait_exit(w2, timeout=15) == 0
    ev = read_events(str(state / "events.jsonl"))
    summary = json.loads((state / "summary.json").read_text())

    r = subprocess.run([sys.executable, "-m", "ps", "report", str(state)], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    out = state / "report"
    for name in ("evaluations.png", "ages.png", "utilisation.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    md = (out / "report.md").read_text()
    counters = dict(md_table(md, "| counter |"))
    assert int(counters["applied"]) == summary["counters"]["applied"] == 200
    assert int(counters["issued"]) == summary["counters"]["issued"]
    events = dict(md_table(md, "| event |"))
    assert int(events["applied"]) == 200 and int(events["issued"]) == sum(e["ev"] == "issued" for e in ev)
    header = next(ln for ln in md.splitlines() if ln.startswith("| worker |"))
    col = {name.strip(): j for j, name in enumerate(header.strip("|").split("|"))}
    rows = {r[0]: r for r in md_table(md, "| worker |")}
    assert set(rows) == {"w1", "w2"}
    for wid in ("w1", "w2"):
        applied = [e for e in ev if e["ev"] == "applied" and e["worker_id"] == wid]
        assert int(rows[wid][col["applied"]]) == len(applied) > 0
        assert int(rows[wid][col["issued"]]) == sum(e["ev"] == "issued" and e["worker_id"] == wid for e in ev)
        assert rows[wid][col["failed"]] == "0"
        ages = [e["age"] for e in applied]
        assert rows[wid][col["age max"]] == f"{max(ages):.0f}"
        assert float(rows[wid][col["mean job time (ms)"]]) > 0
    assert float(rows["w2"][col["mean job time (ms)"]]) >= 10 * 0.9, "w2's injected 10 ms shows in its mean job time"
    assert "![utilisation.png](utilisation.png)" in md

    other = tmp_path / "elsewhere"
    r = subprocess.run([sys.executable, "-m", "ps", "report", str(state), "--out", str(other)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and (other / "report.md").exists()
    r = subprocess.run([sys.executable, "-m", "ps", "report", str(tmp_path)], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "no " in r.stderr and "events.jsonl" in r.stderr and "Traceback" not in r.stderr
