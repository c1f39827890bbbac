"""Large arrays in parts (PROTOCOL.md §6.13) between a real daemon and a real worker over TCP."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from tests.integration.util import wait_events, wait_exit, wait_line

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
    want = np.float32(0)
    for _ in range(k):
        want = np.float32(want - np.float32(LR) * np.float32(1e-3))
    assert x.shape == (D,) and np.all(x == want)
