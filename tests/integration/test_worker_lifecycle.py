"""Worker lifecycle with real processes: waiting for a server, graceful SIGTERM, give-up."""

from __future__ import annotations

import signal
import socket
import time

import pytest

from tests.integration.util import read_events, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(endpoint: str, events: str, *extra: str) -> list[str]:
    return ["serve", "--bind", endpoint, "--problem", "quadratic", "--problem-opt", "d=8", "--algorithm", "asgd",
            "--set", "lr=0.1", "--liveness-timeout", "2", "--heartbeat-interval", "0.25", "--events", events, *extra]


def test_worker_started_before_the_server_joins_when_it_comes_up(procs, tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    events = str(tmp_path / "events.jsonl")
    worker = procs.start("work", "--server", endpoint, "--worker-id", "early", "--delay", "0.01", "--give-up", "60")
    server = procs.start(*serve_args(endpoint, events, "--max-steps", "50"))
    wait_line(server, r"listening on", timeout=60)
    assert wait_exit(server, timeout=60) == 0
    assert wait_exit(worker, timeout=15) == 0, "told bye at the end, the worker exits"
    ev = read_events(events)
    assert sum(e["ev"] == "applied" and e["worker_id"] == "early" for e in ev) == 50


def test_worker_sigterm_says_bye_and_its_job_is_written_off_at_once(procs, tmp_path):
    events = str(tmp_path / "events.jsonl")
    server = procs.start(*serve_args("tcp://127.0.0.1:0", events, "--max-time", "60"))
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    slow = procs.start("work", "--server", endpoint, "--worker-id", "slow", "--delay", "5")
    fast = procs.start("work", "--server", endpoint, "--worker-id", "fast", "--delay", "0.01")
    wait_events(events, lambda ev: any(e["ev"] == "issued" and e["worker_id"] == "slow" for e in ev)
                and sum(e["ev"] == "applied" for e in ev) >= 5, timeout=60)
    t0 = time.monotonic()
    slow.send_signal(signal.SIGTERM)
    assert wait_exit(slow, timeout=10) == 0
    left = wait_events(events, lambda ev: [e for e in ev if e["ev"] == "left" and e["worker_id"] == "slow"],
                       timeout=10)
    assert left[0]["reason"] == "bye" and left[0]["lost"] == 1
    assert time.monotonic() - t0 < 2.0, "a bye is acted on at once, not after the liveness timeout"
    server.send_signal(signal.SIGTERM)
    assert wait_exit(server, timeout=30) == 0
    assert wait_exit(fast, timeout=15) == 0


def test_worker_gives_up_without_a_server(procs):
    worker = procs.start("work", "--server", f"tcp://127.0.0.1:{free_port()}", "--give-up", "1")
    assert wait_exit(worker, timeout=20) == 0
    assert b"no server for 1 s" in worker.stderr.read()
