"""Child processes of the operator commands (``run``'s local workers, ``chaos``, the benchmarks):
started one way, reaped one way, every wait bounded.

A child started by :func:`spawn` leads a process group of its own, so that a signal reaches what
it started too; :func:`reap` signals a group only when the child leads it (checked, never
assumed), else the child alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any, Iterable


def spawn(*args: str, stdout: Any = subprocess.DEVNULL, stderr: Any = subprocess.DEVNULL,
          env: dict | None = None, cwd: str | None = None) -> subprocess.Popen:
    """``python -m ps ARGS...`` (a latecomer command) in a process group of its own."""
    return subprocess.Popen([sys.executable, "-m", "ps", *args], stdin=subprocess.DEVNULL, stdout=stdout,
                            stderr=stderr, env=env, cwd=cwd, start_new_session=True)


def _signal(p: subprocess.Popen, sig: int) -> None:
    """``sig`` to ``p``'s process group if ``p`` leads one, else to ``p``; nothing once it is reaped."""
    if p.poll() is None:
        signal_group(p.pid, sig)


def signal_group(pid: int, sig: int) -> None:
    """``sig`` to the process group ``pid`` leads, or to ``pid`` alone if it leads none; a process
    that is gone (or not ours) is left alone. The caller checks first that ``pid`` is not reaped."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap(procs: Iterable[subprocess.Popen], grace_s: float = 5.0, *, terminate: bool = True) -> None:
    """End and wait for every process of ``procs``: with ``terminate``, SIGCONT and SIGTERM first
    (a stopped child must be able to act on it); each gets until ``grace_s`` from now to exit,
    then SIGKILL. Always waited for, so none is left a zombie."""
    procs = list(procs)
    if terminate:
        for p in procs:
            _signal(p, signal.SIGCONT)
            _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.wait(timeout=10)
