"""The dashboard over plain HTTP (no browser): ``latecomer run --dashboard-port 0`` serves the
live state while it trains, and ``latecomer dashboard OUT`` serves the finished run's recorded
evaluations (an --out directory: summary.json, events.jsonl, problem.json)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.request

import pytest

from tests.integration.util import read_events, wait_line

pytestmark = pytest.mark.slow


def poll(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.1)


def state(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "api/state", timeout=5) as r:
            return json.loads(r.read())
    except OSError:
        return None


def log_match(path, pattern: str):
    with open(path, encoding="utf-8", errors="replace") as f:
        return re.search(pattern, f.read())


def test_run_serves_its_dashboard_and_the_finished_out_directory_is_served_again(procs, tmp_path):
    out, err = tmp_path / "out", tmp_path / "run.err"
    with open(err, "wb") as f:
        run = procs.start("run", "--problem", "quadratic", "--problem-opt", "d=16", "--algorithm", "asgd",
                          "--set", "lr=0.05", "-n", "2", "--delays", "0.004,0.008", "--steps", "1500",
                          "--eval-every", "100", "--out", str(out), "--no-progress", "--dashboard-port", "0",
                          stderr=f, stdout=subprocess.DEVNULL)
    url = poll(lambda: log_match(err, r"dashboard on (http://\S+/)"), 60, "the dashboard's address").group(1)
    first = poll(lambda: (s := state(url)) and s["header"]["step"] > 0 and s, 60, "a first step on the page")
    assert first["header"]["algorithm"] == "asgd" and first["header"]["problem"] == "quadratic"
    assert set(first["workers"]["rows"][i][0] for i in range(len(first["workers"]["rows"]))) <= {"w1", "w2"}
    later = poll(lambda: (s := state(url)) and s["header"]["step"] > first["header"]["step"] and s, 30,
                 "the step to increase")
    assert later["evaluations"][:len(first["evaluations"])] == first["evaluations"]
    assert run.wait(timeout=120) == 0

    with open(out / "summary.json", encoding="utf-8") as f:
        recorded = json.load(f)["evaluations"]
    assert recorded[-1]["version"] == 1500
    dash = procs.start("dashboard", str(out), "--port", "0")
    url = wait_line(dash, r"on (http://\S+/)", timeout=30).group(1)
    s = poll(lambda: state(url), 20, "the finished run's page")
    assert s["evaluations"] == recorded and s["header"]["step"] == 1500 and s["header"]["finished"] is True
    assert s["header"]["problem"] == "quadratic"
    events = read_events(str(out / "events.jsonl"))
    assert sum(n for _, _, n in s["ages"]) == sum(e["ev"] == "applied" for e in events) == 1500
    rows = {r[0]: dict(zip(s["workers"]["columns"], r, strict=True)) for r in s["workers"]["rows"]}
    assert {w: r["applied"] for w, r in rows.items()} == {
        w: sum(e["ev"] == "applied" and e["worker_id"] == w for e in events) for w in ("w1", "w2")}
    with urllib.request.urlopen(url, timeout=5) as r:
        assert b"latecomer dashboard" in r.read()
    dash.send_signal(signal.SIGINT)
    assert dash.wait(timeout=15) == 0
