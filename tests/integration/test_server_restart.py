"""kill -9 the server mid-run; start it again on the same state directory: nothing logged is
lost, the step keeps increasing, workers reconnect by themselves, and replay is exact."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from ps.drivers.replay import replay_run
from tests.integration.test_worker_lifecycle import free_port
from tests.integration.util import read_events, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

STEPS = 700


def serve_cmd(endpoint, state, wire="f32"):
    return ["serve", "--bind", endpoint, "--state", state, "--wire-dtype", wire, "--problem", "quadratic",
            "--problem-opt", "d=32",
            "--algorithm", "ordered-momentum", "--set", "lr=0.2", "--set", "beta=0.3", "--batch-size", "1",
            "--max-steps", str(STEPS), "--checkpoint-every", "50", "--fsync", "always", "--liveness-timeout", "2",
            "--heartbeat-interval", "0.25", "--min-workers", "3", "--log-level", "info"]


@pytest.mark.parametrize("wire", ["f32", "bf16"])
def test_server_kill_minus_nine_and_restart(procs, tmp_path, wire):
    """f32: every worker on the same-host path. bf16: w1 on the same-host path (float32 through
    shared memory), w2 and w3 over TCP in bfloat16: recovery must know which reply travelled how."""
    state = str(tmp_path / "state")
    events = str(tmp_path / "state" / "events.jsonl")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = procs.start(*serve_cmd(endpoint, state, wire))
    wait_line(server, r"listening on", timeout=60)
    workers = [procs.start("work", "--server", endpoint, "--worker-id", f"w{i}", "--delay", d,
                           *(["--shm", "off"] if wire == "bf16" and i > 1 else []))
               for i, d in ((1, "0.01"), (2, "0.03"), (3, "0.07"))]
    wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev) >= 250, timeout=60)
    server.send_signal(signal.SIGKILL)
    assert wait_exit(server, timeout=10) == -signal.SIGKILL

    logged = replay_run(state)  # everything the journal holds at the crash
    seen = max(e["version"] for e in read_events(events) if e["ev"] == "applied")
    assert logged.version >= seen, "an update that was applied and logged would be lost"
    issued_before = max(e["job_id"] for e in read_events(events) if e["ev"] == "issued")

    server2 = procs.start(*serve_cmd(endpoint, state))  # no --wire-dtype: the run's own is kept
    wait_line(server2, r"listening on", timeout=60)
    assert wait_exit(server2, timeout=120) == 0
    err = server2.stderr.read().decode()
    m = re.search(r"resumed \S+ at step (\d+)", err)
    assert m and int(m.group(1)) == logged.version, err[-2000:]
    for w in workers:  # never restarted: they reconnected, finished, and were told bye
        assert wait_exit(w, timeout=20) == 0

    ev = read_events(events)
    after = [e for e in ev if e["ev"] == "applied" and e["version"] > logged.version]
    assert [e["version"] for e in after] == list(range(logged.version + 1, STEPS + 1)), "step keeps increasing"
    assert {e["worker_id"] for e in after} == {"w1", "w2", "w3"}, "every worker came back by itself"
    # a pre-crash job: one the restarted server did not issue (job ids only grow). Not the last
    # ``issued`` event on file before the crash: the event log is flushed every 50 ms, so a kill -9
    # may take the newest of them with it, and a reply to one of those counts too
    resumed = next(i for i, e in enumerate(ev) if e["ev"] == "resumed")
    first_new = min(e["job_id"] for e in ev[resumed:] if e["ev"] == "issued")
    assert first_new > issued_before, "job ids only grow across the restart"
    assert any(e["job_id"] < first_new for e in after), "a reply to a pre-crash job was accepted"

    summary = json.loads((tmp_path / "state" / "summary.json").read_text())
    c = summary["counters"]
    t = summary["transport"]
    assert t["wire_dtype"] == wire
    assert t["shm_workers"] == (["w1", "w2", "w3"] if wire == "f32" else ["w1"])
    if wire == "bf16":
        assert "with --wire-dtype bf16: resuming it with that" in err
    assert summary["version"] == STEPS and summary["accounted"]
    assert c["issued"] == c["applied"] + c["dropped"] + c["lost"] + c["failed"] + c["cancelled"] + c["rejected"] \
        + summary["outstanding"]

    final = replay_run(state)
    recorded = np.load(tmp_path / "state" / "final_x.npy")
    assert final.version == STEPS and np.array_equal(final.final_x, recorded)
    r = subprocess.run([sys.executable, "-m", "ps", "replay", state], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "bit-identical to the recorded final iterate: yes" in r.stdout, r.stdout + r.stderr
