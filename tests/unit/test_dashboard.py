"""The dashboard's observer (ps/ops/dashboard.py): bounded histories, the published JSON, the HTTP
thread's bounds, a finished run's records read back; and its command-line flags."""

from __future__ import annotations

import json
import logging
import math
import re
import socket
import time
import urllib.error
import urllib.request

import pytest
from click.testing import CliRunner

from ps.cli.main import main
from ps.ops import dashboard as dmod
from ps.ops.dashboard import Dashboard, Series, age_bins, load_recorded, serve_dashboard

COLUMNS = ("worker", "device", "jobs_done", "mean_job_s", "last_seen_s_ago", "holding", "oldest_age", "state",
           "failed", "last_error")


def snap(version: int, rate: float = 1.0, workers=("w1",), **info) -> dict:
    rows = tuple((w, "cpu", version, 0.01, 0.0, 1, 0, "ok", 0, "") for w in workers)
    return {"info": {"version": version, "step_rate": rate, "workers": len(workers), "algorithm": "asgd",
                     "problem": "quadratic", **info}, "columns": COLUMNS, "rows": rows, "age_counts": {0: version},
            "shards": ()}


def jobs(dash: Dashboard, n: int, wid: str = "w1", t0: float = 100.0, start_id: int = 0, how: str = "applied",
         every: float = 0.1, took: float = 0.05):
    """``n`` jobs of ``wid``, one issued every ``every`` seconds from ``t0``, each settled ``took`` later."""
    evs = []
    for i in range(start_id, start_id + n):
        t = t0 + every * (i - start_id)
        evs += [{"ev": "issued", "job_id": i, "worker_id": wid, "t": t},
                {"ev": how, "job_id": i, "worker_id": wid, "age": 0, "t": t + took}]
    dash.on_events(evs, t0 + every * n)


# --------------------------------------------------------------------------- bounded histories

def test_a_series_keeps_at_most_cap_plus_one_points_evenly_spaced_with_the_first_and_the_latest():
    s = Series(cap=100)
    for i in range(100_000):
        s.add(i)
        assert len(s.values()) <= 101
    v = s.values()
    assert v[0] == 0 and v[-1] == 99_999 and v == sorted(v)
    gaps = {b - a for a, b in zip(v[:-2], v[1:-1], strict=True)}
    assert len(gaps) == 1 and gaps.pop() == s.stride  # one stride between kept points (the latest aside)
    assert 50 <= len(s) <= 100


def test_a_short_series_is_kept_whole():
    s = Series(cap=100)
    for i in range(37):
        s.add({"i": i})
    assert [p["i"] for p in s.values()] == list(range(37))


def test_age_bins_are_exact_below_32_then_powers_of_two_and_bounded_whatever_the_ages():
    counts = {0: 5, 1: 3, 31: 2, 32: 1, 63: 4, 64: 7, 1000: 1}
    bins = age_bins(counts)
    assert sum(n for _, _, n in bins) == sum(counts.values())
    by = {(lo, hi): n for lo, hi, n in bins}
    assert by[(0, 0)] == 5 and by[(1, 1)] == 3 and by[(31, 31)] == 2 and by[(32, 63)] == 5 and by[(64, 127)] == 7
    assert by[(512, 1023)] == 1 and by[(2, 2)] == 0  # empty bars in between are shown as 0
    assert [lo for lo, _, _ in bins] == sorted(lo for lo, _, _ in bins)
    assert all(b[1] + 1 == c[0] for b, c in zip(bins[:-1], bins[1:], strict=True))  # contiguous
    huge = age_bins({a: 1 for a in range(0, 10**6, 997)} | {10**12: 1})
    assert len(huge) <= 32 + 41 and sum(n for _, _, n in huge) == len(range(0, 10**6, 997)) + 1
    assert age_bins({}) == []


def test_the_timeline_keeps_the_last_bars_of_each_worker_and_a_bounded_number_in_flight():
    dash = Dashboard()
    jobs(dash, dmod.MAX_BARS + 50, "slow", t0=0.0, every=0.08)  # 80 ms apart: a bar each
    jobs(dash, 3, "other", t0=1.0, start_id=10**5, every=1.0)
    timeline = dash.build()["timeline"]
    lane = timeline["lanes"]["slow"]
    assert len(lane) == dmod.MAX_BARS and all(j[2] == "a" and j[3] == 1 for j in lane)
    assert lane[0][0] == pytest.approx(4.0) and lane[-1][1] == pytest.approx(0.08 * (dmod.MAX_BARS + 49) + 0.05)
    # shown from where every lane is complete: the full lane lost its bars before 4 s, so the others' go too
    assert timeline["since"] == pytest.approx(4.0) and "other" not in timeline["lanes"]
    dash.on_events([{"ev": "issued", "job_id": 10**6 + i, "worker_id": "w2", "t": 50.0} for i in range(
        dmod.MAX_OPEN_JOBS + 10)], 55.0)
    assert len(dash.open) == dmod.MAX_OPEN_JOBS
    assert len(dash.build()["timeline"]["in_flight"]["w2"]) == 64  # a worker's jobs in flight shown


def test_fast_jobs_are_merged_into_bars_no_shorter_than_a_pixel_and_every_job_is_counted():
    dash = Dashboard()
    jobs(dash, 5000, "fast", t0=0.0, every=0.001, took=0.0008)  # 1,000 jobs/s
    jobs(dash, 3, "fast", t0=5.5, start_id=10_000, how="lost", every=0.001, took=0.0008)
    lane = dash.build()["timeline"]["lanes"]["fast"]
    applied = [j for j in lane if j[2] == "a"]
    assert sum(j[3] for j in applied) == 5000 and len(applied) <= 5.0 / dmod.MERGE_MAX_S + 2
    assert all(j[1] - j[0] <= dmod.MERGE_MAX_S + 1e-9 for j in lane)
    assert [j[2] for j in lane[-1:]] == ["l"] and lane[-1][3] == 3  # another outcome: a bar of its own


def test_lanes_are_bounded_and_the_page_gets_the_last_window_only():
    dash = Dashboard()
    for i in range(dmod.MAX_LANES + 8):
        jobs(dash, 1, f"w{i:02d}", t0=float(i), start_id=i)
    lanes = dash.build()["timeline"]["lanes"]
    assert len(lanes) == dmod.MAX_LANES and set(lanes) == {f"w{i:02d}" for i in range(8, dmod.MAX_LANES + 8)}
    jobs(dash, 1, "late", t0=200.0, start_id=999)
    assert set(dash.build()["timeline"]["lanes"]) == {"late"}  # the others ended over WINDOW_S ago


def test_settled_jobs_are_coloured_by_outcome_and_a_worker_that_timed_out_is_marked_lost():
    dash = Dashboard()
    jobs(dash, 3, "w1")
    jobs(dash, 2, "w2", start_id=10, how="lost")
    jobs(dash, 1, "w2", start_id=20, how="failed")
    dash.on_events([{"ev": "left", "worker_id": "w2", "reason": "timeout", "t": 101.0},
                    {"ev": "left", "worker_id": "w3", "reason": "bye", "t": 101.0}], 101.0)
    dash.on_tick(snap(3, workers=("w1",)), 101.5)
    s = dash.build()
    assert [j[2] for j in s["timeline"]["lanes"]["w2"]] == ["l", "l", "f"]
    assert [j[2] for j in s["timeline"]["lanes"]["w1"]] == ["a", "a", "a"]
    rows = {r[0]: r for r in s["workers"]["rows"]}
    assert rows["w1"][7] == "ok" and rows["w2"][7] == "lost" and rows["w3"][7] == "left"
    assert "timeout" in rows["w2"][9]
    dash.on_events([{"ev": "joined", "worker_id": "w2", "t": 102.0}], 102.0)
    assert "w2" not in dash.build()["workers"]["gone"]  # back: no longer lost


def test_departed_workers_and_algorithm_figures_are_bounded():
    dash = Dashboard()
    dash.on_events([{"ev": "left", "worker_id": f"w{i}", "reason": "timeout", "t": 1.0}
                    for i in range(dmod.MAX_GONE * 3)], 1.0)
    assert len(dash.gone) == dmod.MAX_GONE
    for k in range(100):
        dash.on_tick(snap(k, **{f"alg.f{i}": float(i) for i in range(dmod.MAX_SERIES + 20)}), 2.0 + k)
    assert len(dash.figures) == dmod.MAX_SERIES
    assert all(len(s.values()) == 100 for s in dash.figures.values())


# --------------------------------------------------------------------------- the published snapshot

def test_the_snapshot_is_published_at_most_every_half_second_and_never_changes_after():
    dash = Dashboard()
    dash.on_tick(snap(1), 10.0)
    first = dash.state
    text = json.dumps(first, allow_nan=False)
    jobs(dash, 50, t0=10.0)
    dash.on_evaluation({"version": 1.0, "t": 0.1, "loss": 3.0})
    dash.on_tick(snap(2), 10.2)
    assert dash.state is first  # 0.2 s later: not yet
    assert json.dumps(first, allow_nan=False) == text  # what the HTTP thread holds was not touched
    dash.on_tick(snap(3), 10.5)
    assert dash.state is not first and dash.state["header"]["step"] == 3
    assert json.dumps(first, allow_nan=False) == text
    assert dash.state["evaluations"] == [{"version": 1.0, "t": 0.1, "loss": 3.0}]
    assert [p[1] for p in dash.state["rate"]] == [1, 2, 3]


def test_the_json_has_no_nan_and_the_header_says_what_the_run_is():
    dash = Dashboard()
    dash.on_start({"algorithm": "asgd", "problem": "quadratic", "alg.lr": 0.1})
    dash.on_evaluation({"version": 0.0, "t": 0.0, "loss": float("nan"), "accuracy": float("inf")})
    dash.on_evaluation({"version": 10.0, "t": 1.0, "loss": 0.5, "accuracy": 0.9})
    dash.on_tick(snap(10, rate=float("nan"), **{"alg.M_k": float("inf"), "alg.w": 0.25}), 5.0)
    dash.on_tick(snap(12, rate=4.0), 7.5)
    s = json.loads(dash.json_bytes())  # allow_nan=False: raises on any NaN left
    assert s["evaluations"][0]["loss"] is None and s["evaluations"][0]["accuracy"] is None
    assert s["header"] == {"algorithm": "asgd", "problem": "quadratic", "step": 12, "rate": 4.0, "workers": 1,
                           "elapsed_s": 2.5, "loss": 0.5, "finished": False}
    assert s["figures"]["alg.M_k"][0] == [0.0, 10, None] and s["figures"]["alg.w"][0] == [0.0, 10, 0.25]
    assert s["ages"] == [[0, 0, 12]] and s["settings"]["alg.lr"] == 0.1
    assert math.isnan(dmod.num(float("nan")) or math.nan) and dmod.num(3) == 3 and dmod.num("x") == "x"


# --------------------------------------------------------------------------- HTTP

@pytest.fixture
def served():
    dash = Dashboard()
    dash.on_tick(snap(7), 1.0)
    srv = serve_dashboard(dash, 0)
    try:
        yield dash, srv, f"http://127.0.0.1:{srv.port}"
    finally:
        srv.close()


def get(url: str, method: str = "GET", data: bytes | None = None):
    req = urllib.request.Request(url, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_the_page_and_the_state_are_served_and_the_page_loads_nothing_from_outside(served):
    dash, srv, url = served
    code, headers, body = get(url + "/")
    page = body.decode()
    assert code == 200 and headers["Content-Type"].startswith("text/html") and "<canvas" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "an external asset"
    assert not re.search(r"https?://", page) and "default-src 'none'" in headers["Content-Security-Policy"]
    code, headers, body = get(url + "/api/state")
    assert code == 200 and headers["Content-Type"] == "application/json"
    assert json.loads(body) == json.loads(json.dumps(dash.state)) and json.loads(body)["header"]["step"] == 7
    assert get(url + "/nope")[0] == 404
    assert get(url + "/api/state", "POST", b"x" * 100_000)[0] == 405  # read-only; the body is never read


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _ok(url: str) -> bool:
    try:
        return get(url + "/api/state")[0] == 200
    except OSError:
        return False


def test_a_slow_client_does_not_hold_the_server_and_too_many_are_turned_away(served):
    dash, srv, url = served
    idle = []
    try:
        for _ in range(dmod.MAX_CLIENTS - 1):  # each holds a thread: a request line never finished
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(b"GET /api/st")
            idle.append(s)
        wait_for(lambda: srv.active == dmod.MAX_CLIENTS - 1, 5, "the idle clients to be taken")
        assert get(url + "/api/state")[0] == 200  # the last free slot serves
        wait_for(lambda: srv.active == dmod.MAX_CLIENTS - 1, 5, "that request's slot to come free")
        idle.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        wait_for(lambda: srv.active == dmod.MAX_CLIENTS, 5, "every slot to be taken")
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(b"GET /api/state HTTP/1.0\r\n\r\n")
        assert s.recv(100) == b""  # closed unanswered
        s.close()
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: _ok(url), 10, "the server to answer again once the idle clients went")
    assert dmod._Handler.timeout == dmod.HTTP_TIMEOUT_S  # a client that stays is dropped after this


def test_a_non_loopback_address_is_served_with_a_warning(caplog):
    dash = Dashboard()
    with caplog.at_level(logging.INFO, logger="latecomer.server"):
        srv = serve_dashboard(dash, 0, "0.0.0.0")
    try:
        assert any(f"dashboard on http://0.0.0.0:{srv.port}/" in r.getMessage() for r in caplog.records)
        assert any(r.levelno == logging.WARNING and "reachable from the network" in r.getMessage()
                   for r in caplog.records)
    finally:
        srv.close()
    with pytest.raises(ValueError):
        serve_dashboard(dash, 0, "not-an-address")


# --------------------------------------------------------------------------- a finished run's records

def _write_run(d, sessions: list[list[dict]], evaluations: list[dict]) -> None:
    with open(d / "events.jsonl", "w", encoding="utf-8") as f:
        for evs in sessions:
            for e in evs:
                f.write(json.dumps(e) + "\n")
    (d / "summary.json").write_text(json.dumps({"version": 30, "elapsed_s": 3.0, "counters": {"applied": 30},
                                                "evaluations": evaluations}))
    (d / "run.json").write_text(json.dumps({"problem": "quadratic", "algorithm": "asgd", "settings": {"lr": 0.1},
                                            "problem_options": {}, "core": {}}))


def _session(t0: float, v0: int, n: int, wid: str, resumed: bool) -> list[dict]:
    evs = [{"ev": "resumed", "boot": f"b{v0}", "version": v0, "workers": 1, "outstanding": 0, "t": t0}] \
        if resumed else []
    evs.append({"ev": "joined", "worker_id": wid, "device": "cpu", "t": t0})
    for i in range(n):
        t = t0 + 0.1 * (i + 1)
        jid = v0 * 100 + i
        evs += [{"ev": "issued", "job_id": jid, "worker_id": wid, "t": t - 0.05},
                {"ev": "applied", "job_id": jid, "worker_id": wid, "age": i % 3, "created_at": v0 + i,
                 "version": v0 + i + 1, "t": t},
                {"ev": "metrics", "version": v0 + i + 1, "t": t, "lr": 0.1 * (i + 1)}]
    evs.append({"ev": "left", "worker_id": wid, "reason": "timeout", "lost": 0, "t": t0 + 0.1 * n + 1})
    return evs


def test_a_restarted_runs_records_are_read_back_on_one_clock(tmp_path):
    evals = [{"t": 0.0, "version": 0.0, "loss": 5.0}, {"t": 1.0, "version": 10.0, "loss": 1.0},
             {"t": 0.5, "version": 30.0, "loss": 0.25}]
    # the second session's clock (a new process) starts far below the first's
    _write_run(tmp_path, [_session(5000.0, 0, 10, "a", False), _session(3.0, 10, 20, "b", True)], evals)
    s = json.loads(load_recorded(str(tmp_path)).json_bytes())
    assert s["evaluations"] == evals
    assert s["header"]["algorithm"] == "asgd" and s["header"]["step"] == 30 and s["header"]["finished"] is True
    assert s["header"]["loss"] == 0.25
    lanes = s["timeline"]["lanes"]
    assert len(lanes["a"]) == 10 and len(lanes["b"]) == 20
    assert max(j[1] for j in lanes["a"]) <= min(j[0] for j in lanes["b"])  # session 2 follows session 1
    assert min(j[0] for j in lanes["a"]) >= 0 and s["header"]["elapsed_s"] == pytest.approx(1 + 1 + 2 + 1, abs=0.01)
    assert sum(n for _, _, n in s["ages"]) == 30 and {lo: n for lo, _, n in s["ages"]} == {0: 4 + 7, 1: 3 + 7, 2: 3 + 6}
    assert s["figures"]["alg.lr"][-1][2] == pytest.approx(2.0) and s["figures"]["alg.lr"][-1][1] == 30
    rows = {r[0]: dict(zip(s["workers"]["columns"], r, strict=True)) for r in s["workers"]["rows"]}
    assert rows["a"]["applied"] == 10 and rows["b"]["applied"] == 20 and rows["b"]["state"] == "lost"


def test_a_directory_without_records_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="neither events.jsonl nor summary.json"):
        load_recorded(str(tmp_path))
    r = CliRunner().invoke(main, ["dashboard", str(tmp_path), "--port", "0"])
    assert r.exit_code == 1 and "neither events.jsonl nor summary.json" in r.output


@pytest.mark.parametrize("cmd", [["serve"], ["run"], ["dashboard", "."]])
def test_the_dashboard_address_flag_refuses_what_is_not_an_address(cmd):
    flag = "--addr" if cmd[0] == "dashboard" else "--dashboard-addr"
    r = CliRunner().invoke(main, [*cmd, flag, "example.org"])
    assert r.exit_code == 2 and "expected an IP address or localhost" in r.output
    r = CliRunner().invoke(main, [*cmd, "--port" if cmd[0] == "dashboard" else "--dashboard-port", "70000"])
    assert r.exit_code == 2 and "70000" in r.output
