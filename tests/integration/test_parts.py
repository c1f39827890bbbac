"""Large arrays in parts (PROTOCOL.md §6.13) between a real daemon and a real worker over TCP."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from tests.integration.util import keyed_synthetic_run, make_keys, synthetic_after, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

D = 5_000_000  # 20 MB per vector: above the 16 MB threshold, so every job and reply goes in parts
LR = 0.5


def test_jobs_and_replies_in_parts_train_exactly(procs, tmp_path):
    events, out = str(tmp_path / "events.jsonl"), str(tmp_path / "out")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "synthetic", "--problem-opt",
                         f"d={D}", "--algorithm", "asgd", "--set", f"lr={LR}", "--max-time", "120",
                         "--eval-every", "0", "--events", events, "--out", out, "--shm", "off")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    worker = procs.start("work", "--server", endpoint, "--worker-id", "big", "--shm", "off")
    wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev) >= 12, timeout=90)
    server.send_signal(signal.SIGTERM)
    assert wait_exit(server, timeout=30) == 0
    assert wait_exit(worker, timeout=20) == 0
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    t = summary["transport"]
    k = summary["version"]
    assert k >= 12 and t["shm_workers"] == []
    # at least 5 parts (4 MB each) per 20 MB vector, both ways
    assert t["parts_out"] >= 5 * k and t["parts_in"] >= 5 * k, t
    # the synthetic gradient is the constant 1e-3: after k steps every entry is k float32 steps down
    x = np.load(os.path.join(out, "final_x.npy"))
    assert x.shape == (D,) and np.all(x == synthetic_after(k, LR))


def test_bf16_replies_in_parts_are_journaled_as_sent_and_replay_exactly(procs, tmp_path):
    """bf16 frames of 17 MB: over the threshold, so jobs and replies travel in parts. Every
    reply's payload is journaled (--log-payloads); replay converts them as the daemon did."""
    from ps.drivers.replay import replay_run

    d = 8_500_000
    state = str(tmp_path / "state")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "synthetic", "--problem-opt",
                         f"d={d}", "--algorithm", "asgd", "--set", f"lr={LR}", "--max-steps", "8", "--eval-every",
                         "0", "--state", state, "--log-payloads", "--wire-dtype", "bf16", "--shm", "off")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    worker = procs.start("work", "--server", endpoint, "--worker-id", "big", "--shm", "off")
    assert wait_exit(server, timeout=120) == 0
    assert wait_exit(worker, timeout=20) == 0
    with open(os.path.join(state, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["version"] == 8 and summary["transport"]["wire_dtype"] == "bf16"
    assert summary["transport"]["parts_in"] >= 5 * 8 and summary["transport"]["parts_out"] >= 5 * 8
    recorded = np.load(os.path.join(state, "final_x.npy"))
    # the bf16 gradient of 1e-3 is 0.00100040435791015625 (bits 0x3A83), applied 8 times
    g = np.float32(np.frombuffer(np.uint32(0x3A830000).tobytes(), np.float32)[0])
    assert np.all(recorded == synthetic_after(8, LR, g))
    replayed = replay_run(state)
    assert replayed.version == 8 and np.array_equal(replayed.final_x, recorded)


def test_under_curve_vectors_from_1_mib_travel_in_small_parts_and_train_exactly(procs, tmp_path):
    """Under CurveZMQ the threshold is 1 MiB and the parts 1 MiB, at most 16 a message
    (protocol.messages.CURVE_CHUNK_*): a 2 MB vector (d = 500,000) goes as 2 parts each way,
    a job through the daemon's CURVE socket and the reply through the worker's, reassembled,
    journaled whole and replayed exactly."""
    from ps.drivers.replay import replay_run

    d, steps = 500_000, 10
    keys, state = make_keys(tmp_path, "w"), str(tmp_path / "state")
    # --seal off: the arrays over CurveZMQ itself (the sealed path: test_sealed.py)
    summary = keyed_synthetic_run(procs, keys, state, d, steps, LR, "--seal", "off", timeout=120)
    t = summary["transport"]
    assert summary["version"] == steps and t["shm_workers"] == []
    assert t["parts_out"] >= 2 * steps and t["parts_in"] >= 2 * steps, t  # 2 MB: 2 parts of 1 MiB each way
    assert "sealed_sessions" not in t, t  # --seal off: no sealed path
    x = np.load(os.path.join(state, "final_x.npy"))
    assert x.shape == (d,) and np.all(x == synthetic_after(steps, LR))
    assert np.array_equal(replay_run(state).final_x, x), "the journal replays exactly"
