"""A process that stopped cleanly on SIGTERM exits with its own status, however many SIGTERMs
follow while it exits (ps/cli/main.py, ``_exit_deaf_to_stop_signals``).

SLURM sends scancel's SIGTERM to every process of the job and, at the job's end, another; the
server (supervisor and daemon), its shards and its workers stop on the first, but a SIGTERM that
arrived while the Python interpreter was tearing itself down met the default action again and
turned the server's status 0 into 143 (seen in the SLURM test under load: ``CANCELLED 143:0``).
Here the whole process group of a real ``latecomer serve`` and of a real worker gets a SIGTERM
every half millisecond from the first one until each has exited: both exit 0, having said so.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.integration.util import wait_events, wait_line

pytestmark = pytest.mark.slow


def signal_until_exit(p, timeout: float) -> int:
    """SIGTERM to ``p``'s process group every 0.5 ms until ``p`` exited (bounded); its status."""
    deadline = time.monotonic() + timeout
    while p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"still running {timeout} s after the first SIGTERM")
        time.sleep(0.0005)
    return p.wait(timeout=10)


def test_a_stream_of_sigterms_after_the_first_does_not_change_the_exit_status(procs, tmp_path):
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--problem-opt", "d=1000",
                         "--algorithm", "asgd", "--set", "lr=0.1", "--state", str(tmp_path / "state"),
                         "--events", str(tmp_path / "events.jsonl"))
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    worker = procs.start("work", "--server", endpoint, "--worker-id", "w", "--delay", "0.002")
    wait_events(str(tmp_path / "events.jsonl"), lambda ev: sum(e["ev"] == "applied" for e in ev) >= 20, timeout=60)
    assert signal_until_exit(worker, 60) == 0
    assert signal_until_exit(server, 60) == 0
    out = server.stdout.read().decode(errors="replace")
    assert "stopped (signal SIGTERM) at step" in out, out[-2000:]
