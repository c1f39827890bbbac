"""Exact replay of real runs from their journal: a per-reply method, a round method (Rennala)
and A11 with lost replies (a worker killed mid-run), recomputing gradients from the recorded
seeds; AdamW (its moments through checkpoints, a worker killed); and the digits MLP with payloads
logged. Also `latecomer stop` and delay-trace replay."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy as np
import pytest

from ps.drivers.replay import replay_run
from tests.integration.util import read_events, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

CASES = {
    "ordered-momentum": (["--problem", "quadratic", "--problem-opt", "d=32", "--set", "lr=0.2", "--set", "beta=0.3"],
                         False, False),
    "rennala": (["--problem", "quadratic", "--problem-opt", "d=32", "--set", "lr=0.5", "--set", "B=3"], False, False),
    "storm-vr": (["--problem", "quadratic", "--problem-opt", "d=32", "--set", "lr=0.2", "--set", "a=0.2",
                  "--set", "B_init=4", "--set", "tau_lost=1000"], True, False),
    "digits-payloads": (["--problem", "digits", "--set", "lr=0.3", "--set", "beta=0.3"], True, True),
    "adamw": (["--problem", "quadratic", "--problem-opt", "d=32", "--set", "lr=0.05", "--set", "weight_decay=0.01"],
              True, False),
}


def run_recorded(procs, state, algorithm, extra, *, kill_one, payloads, steps=400):
    args = ["serve", "--bind", "tcp://127.0.0.1:0", "--state", state, "--algorithm", algorithm, *extra,
            "--batch-size", "4", "--max-steps", str(steps), "--checkpoint-every", "100", "--liveness-timeout", "1.5",
            "--heartbeat-interval", "0.25", "--min-workers", "3", "--eval-every", "0"]
    if payloads:
        args.append("--log-payloads")
    server = procs.start(*args)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    workers = [procs.start("work", "--server", endpoint, "--worker-id", f"w{i}", "--delay", d)
               for i, d in ((1, "0.005"), (2, "0.02"), (3, "0.04"))]
    events = f"{state}/events.jsonl"
    if kill_one:
        wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev) >= steps // 3, timeout=60)
        workers[2].send_signal(signal.SIGKILL)
    assert wait_exit(server, timeout=120) == 0
    for w in workers[:2] if kill_one else workers:
        assert wait_exit(w, timeout=20) == 0
    return read_events(events)


@pytest.mark.parametrize("case", list(CASES))
def test_replay_reproduces_the_final_iterate_bit_for_bit(procs, tmp_path, case):
    extra, kill_one, payloads = CASES[case]
    algorithm = case.split("-payloads")[0].replace("digits", "ordered-momentum")
    state = str(tmp_path / "state")
    ev = run_recorded(procs, state, algorithm, extra, kill_one=kill_one, payloads=payloads)
    if kill_one:
        assert any(e["ev"] == "lost" for e in ev), "the killed worker's job was written off"
    result = replay_run(state)
    recorded = np.load(tmp_path / "state" / "final_x.npy")
    summary = json.loads((tmp_path / "state" / "summary.json").read_text())
    assert result.version == summary["version"] == 400
    assert result.counters == summary["counters"]
    assert recorded.dtype == result.final_x.dtype and np.array_equal(recorded, result.final_x)
    assert result.applied == [(e["job_id"], e["created_at"], e["worker_id"]) for e in ev if e["ev"] == "applied"]


def test_replay_cli_and_delay_trace_under_another_algorithm(procs, tmp_path):
    state = str(tmp_path / "state")
    run_recorded(procs, state, "ordered-momentum", CASES["ordered-momentum"][0], kill_one=False, payloads=False,
                 steps=200)
    r = subprocess.run([sys.executable, "-m", "ps", "replay", state], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "bit-identical to the recorded final iterate: yes" in r.stdout, r.stdout + r.stderr
    out = tmp_path / "other"
    r = subprocess.run([sys.executable, "-m", "ps", "replay", state, "--algorithm", "asgd", "--set", "lr=0.2",
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ordered-momentum" in r.stdout and "asgd" in r.stdout
    assert (out / "trace-asgd.csv").exists() and (out / "trace-ordered-momentum.csv").exists()


def test_latecomer_stop_drains_checkpoints_and_says_bye(procs, tmp_path):
    state = str(tmp_path / "state")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--state", state, "--problem", "quadratic",
                         "--algorithm", "asgd", "--set", "lr=0.1", "--checkpoint-every", "0",
                         "--checkpoint-interval", "0")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    worker = procs.start("work", "--server", endpoint, "--worker-id", "w1", "--delay", "0.01")
    wait_events(f"{state}/events.jsonl", lambda ev: sum(e["ev"] == "applied" for e in ev) >= 20, timeout=60)
    assert not list((tmp_path / "state").glob("ckpt-*.bin")), "no checkpoint before the drain"
    r = subprocess.run([sys.executable, "-m", "ps", "stop", "--state", state], capture_output=True, text=True,
                       timeout=90)
    assert r.returncode == 0 and "stopped" in r.stdout, r.stderr
    assert wait_exit(server, timeout=5) == 0
    assert wait_exit(worker, timeout=15) == 0, "told bye, the worker exits"
    assert len(list((tmp_path / "state").glob("ckpt-*.bin"))) == 1, "drained: one checkpoint at exit"
    assert np.array_equal(replay_run(state).final_x, np.load(tmp_path / "state" / "final_x.npy"))
    r = subprocess.run([sys.executable, "-m", "ps", "stop", "--state", state], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 1 and "no server.pid" in r.stderr


def test_a_run_recorded_before_momentum_start_replays_with_the_old_start(procs, tmp_path):
    """Issue 31: ringmaster-lmo's momentum start became a hyper-parameter whose default changed
    ("first", α_0 = 1, before; "zero" now). A new run.json records it; one written before has no
    such key and ran α_0 = 1, and replays so. Simulated here by recording a run with the old start
    and taking the key out of its run.json."""
    state = tmp_path / "state"
    extra = ["--problem", "quadratic", "--problem-opt", "d=32", "--set", "lr=0.05", "--set", "alpha=0.3",
             "--set", "R=3", "--set", "momentum_start=first"]
    run_recorded(procs, str(state), "ringmaster-lmo", extra, kill_one=False, payloads=False, steps=150)
    recorded = np.load(state / "final_x.npy")
    run = json.loads((state / "run.json").read_text())
    assert run["settings"]["momentum_start"] == "first"
    assert np.array_equal(replay_run(str(state)).final_x, recorded)
    del run["settings"]["momentum_start"]  # as run.json was written before the key existed
    (state / "run.json").write_text(json.dumps(run))
    assert np.array_equal(replay_run(str(state)).final_x, recorded), "a record without the key ran α_0 = 1"
    run["settings"]["momentum_start"] = "zero"  # the key is read: the other start replays otherwise
    (state / "run.json").write_text(json.dumps(run))
    assert not np.array_equal(replay_run(str(state)).final_x, recorded)


def test_a_new_ringmaster_lmo_run_records_the_momentum_start(procs, tmp_path):
    state = tmp_path / "state"
    run_recorded(procs, str(state), "ringmaster-lmo", ["--problem", "quadratic", "--problem-opt", "d=16",
                                                        "--set", "lr=0.05"], kill_one=False, payloads=False, steps=60)
    run = json.loads((state / "run.json").read_text())
    assert run["settings"] == {"lr": "0.05", "momentum_start": "zero"}  # --set values as given, the pin as a default
    assert np.array_equal(replay_run(str(state)).final_x, np.load(state / "final_x.npy"))
