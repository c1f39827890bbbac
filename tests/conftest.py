"""Shared fixtures: a hypothesis profile for CI, and a reaper for real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Procs:
    """Starts ``python -m ps ...`` children and guarantees they are reaped (terminate, then kill)."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen] = []

    def start(self, *args: str, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """``env``: variables set (over this process's environment) for that child only."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        p = subprocess.Popen([sys.executable, "-m", "ps", *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                             stdout=stdout, stderr=stderr, start_new_session=True)
        self.children.append(p)
        return p

    def reap(self) -> None:
        for p in self.children:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5
        for p in self.children:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL) if p.poll() is None else None
                p.wait(timeout=5)
            for stream in (p.stdout, p.stderr):
                if stream:
                    stream.close()


@pytest.fixture
def procs():
    p = Procs()
    try:
        yield p
    finally:
        p.reap()
