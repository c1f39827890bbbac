"""Bounded waits for real-process tests: readiness lines and event-log conditions."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import time
from typing import Any, Callable


def wait_line(p: subprocess.Popen, pattern: str, timeout: float) -> re.Match:
    """Read ``p.stdout`` until a line matches ``pattern``; fail after ``timeout`` seconds."""
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout
    buf = b""
    fd = p.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no line matching {pattern!r} within {timeout} s; got {buf[-500:]!r}")
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            err = p.stderr.read()[-2000:] if p.stderr else ""
            raise RuntimeError(f"process exited (rc={p.poll()}) before {pattern!r}: {buf[-500:]!r} {err!r}")
        buf += chunk
        for line in buf.decode(errors="replace").splitlines():
            m = rx.search(line)
            if m:
                return m


def read_events(path: str) -> list[dict[str, Any]]:
    out = []
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            out.append(json.loads(line))
    return out


def wait_events(path: str, cond: Callable[[list[dict]], Any], timeout: float, *, poll_s: float = 0.05) -> Any:
    """Poll the event log until ``cond(events)`` is truthy; return its value. Fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        ev = read_events(path)
        v = cond(ev)
        if v:
            return v
        if time.monotonic() > deadline:
            tail = [e.get("ev") for e in ev[-10:]]
            raise TimeoutError(f"condition not met within {timeout} s ({len(ev)} events, last {tail})")
        time.sleep(poll_s)  # polling interval of a bounded wait, not synchronisation


def wait_exit(p: subprocess.Popen, timeout: float) -> int:
    return p.wait(timeout=timeout)


def daemon_pid(p: subprocess.Popen) -> int:
    """The pid of the process that owns a ``latecomer serve``'s socket: its child when supervised
    (ps/net/supervise.py, the default), the process itself with ``--no-supervise``."""
    import psutil

    children = psutil.Process(p.pid).children()
    return children[0].pid if children else p.pid


def tree_rss(pid: int) -> int:
    """RSS of a process and its descendants (a supervised server is two processes)."""
    import psutil

    top = psutil.Process(pid)
    total = top.memory_info().rss
    for child in top.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def readme_block(heading: str, lang: str, readme: str = "README.md") -> str:
    """The first ``lang`` code block of the README's section ``## heading`` (``readme``: a path
    relative to the repository, e.g. ``deploy/README.md``)."""
    from tests.conftest import REPO

    with open(os.path.join(REPO, readme), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index(f"\n## {heading}"):]
    section = section[:section.index("\n## ", 1)]
    return re.search(rf"```{lang}\n(.*?)```", section, re.S).group(1)


def gradient_wrapper(expr: str) -> str:
    """A ``python -c`` program that is the real ``latecomer`` CLI with each computed gradient ``g``
    replaced by ``expr`` (numpy as ``np``): a deviant or hostile worker that speaks the real protocol.
    Run it as ``[sys.executable, "-c", gradient_wrapper(...), "work", ...]``."""
    return f"""
import sys
import numpy as np
import worker.runner as runner
real = runner.compute_grads
def wrapped(job, points, problem, *args):
    grads, loss, count = real(job, points, problem, *args)
    return tuple(({expr}) for g in grads), loss, count
runner.compute_grads = wrapped
from ps.cli.main import main
sys.argv[0] = "latecomer"
main()
"""


def make_keys(tmp_path, *names) -> str:
    """``latecomer keys init`` in ``tmp_path/keys`` and one allowed worker key per name."""
    from click.testing import CliRunner

    from ps.cli.main import main

    keys = str(tmp_path / "keys")
    r = CliRunner()
    assert r.invoke(main, ["keys", "init", keys]).exit_code == 0
    for n in names:
        assert r.invoke(main, ["keys", "add-worker", n, "--keys", keys]).exit_code == 0
    return keys


def synthetic_after(steps: int, lr: float, g: float = 1e-3):
    """Every coordinate of the synthetic problem's iterate after ``steps`` applied replies of the
    constant gradient ``g`` from 0, in float32 (the server's arithmetic)."""
    import numpy as np

    want = np.float32(0)
    for _ in range(steps):
        want = np.float32(want - np.float32(lr) * np.float32(g))
    return want


def keyed_synthetic_run(procs, keys: str, state: str, d: int, steps: int, lr: float, *serve_args: str,
                        timeout: float = 180) -> dict[str, Any]:
    """``serve --keys`` on asgd and ``synthetic`` (d, TCP arrays) with one worker ``w`` until
    ``steps`` updates; both exit 0. Returns the run's summary.json."""
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--keys", keys, "--problem", "synthetic",
                         "--problem-opt", f"d={d}", "--algorithm", "asgd", "--set", f"lr={lr}", "--max-steps",
                         str(steps), "--eval-every", "0", "--state", state, "--shm", "off", *serve_args)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    worker = procs.start("work", "--server", endpoint, "--worker-id", "w", "--shm", "off",
                         "--key", f"{keys}/workers/w.key_secret", "--server-key", f"{keys}/server.key")
    assert wait_exit(server, timeout=timeout) == 0
    assert wait_exit(worker, timeout=20) == 0
    with open(os.path.join(state, "summary.json"), encoding="utf-8") as f:
        return json.load(f)
