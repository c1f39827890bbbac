"""``serve`` on a terminal shows a progress bar (steps of --max-steps, rate, workers, the last
evaluation) with the log lines above it; piped, it logs as before."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

from tests.integration.util import wait_line

pytestmark = pytest.mark.slow

STEPS = 400


def test_serve_on_a_terminal_draws_a_bar_and_keeps_the_evaluation_lines(procs):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a terminal 160 wide
    server = subprocess.Popen([sys.executable, "-m", "ps", "serve", "--bind", "tcp://127.0.0.1:0", "--problem",
                               "quadratic", "--algorithm", "asgd", "--set", "lr=0.05", "--max-steps", str(STEPS),
                               "--eval-every", "100"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
                              start_new_session=True, text=True)
    os.close(slave)
    procs.children.append(server)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    worker = subprocess.Popen([sys.executable, "-m", "ps", "work", "--server", endpoint], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    procs.children.append(worker)
    seen, deadline = b"", time.monotonic() + 90
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the server closed its side
                break
            if not chunk:
                break
            seen += chunk
        elif server.poll() is not None:
            break
    os.close(master)
    assert server.wait(timeout=30) == 0
    text = seen.decode(errors="replace")
    assert re.search(rf"serve: +\d+%.*\b{STEPS}/{STEPS}\b", text), text[-2000:]
    assert re.search(r"rate=[\d.]+/s", text) and "workers=1" in text and "loss=" in text
    assert re.search(rf"INFO step {STEPS}  loss \S+ .*workers 1", text)  # the evaluation lines stay
