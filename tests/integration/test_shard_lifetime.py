"""Shards never outlive their coordinator (issue 28), with real processes:

* kill -9 of a ``serve --shards 2``'s supervisor and daemon at the same moment: within 10 s no
  local shard of that run is left (PR_SET_PDEATHSIG, the lifeline behind it); SIGTERM of the
  daemon (``latecomer stop``): its local shards are told to stop and exit 0;
* a local shard whose prctl failed (switched off in that process only) stops by itself, cleanly,
  once the process that started it is killed: the lifeline alone; one whose parent died while it
  was starting (before its prctl) exits too;
* a shard started by hand with ``--coordinator-timeout 2`` against an endpoint nobody serves exits
  with status 1 and one line, after 2 s and within a bound.

Every wait is bounded; every process is reaped (a shard left over is killed in a finally).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from ps.ops.children import reap
from tests.integration.util import daemon_pid, wait_exit, wait_line

pytestmark = pytest.mark.slow

GONE_S = 10.0  # a shard whose coordinator died is gone within this


def spawn(*args: str, log: str | None = None) -> subprocess.Popen:
    out = open(log, "ab") if log else subprocess.PIPE  # noqa: SIM115 - the child's stdout for its life
    return subprocess.Popen([sys.executable, "-m", "ps", *args], stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def alive(p: psutil.Process) -> bool:
    """Running, and not a zombie (an orphan is reaped by init, whenever it does)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Poll until none of ``procs`` is alive, at most ``timeout`` s; returns those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)  # polling interval of a bounded wait


def wait_for(what, timeout: float, message: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.05)  # polling interval of a bounded wait
    raise TimeoutError(message)


def read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def kill_left(procs: list[psutil.Process]) -> None:
    for p in procs:
        if alive(p):
            p.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sharded(state: str, shards: list) -> tuple[subprocess.Popen, psutil.Process]:
    """``serve --shards 2`` (supervised, the default) with both local shards in their loops (joined:
    their prctl is behind them); ``shards`` gets them as they are found. Returns the supervisor's
    Popen and the daemon."""
    server = spawn("serve", "--bind", "tcp://127.0.0.1:0", "--state", state, "--problem", "quadratic",
                   "--algorithm", "asgd", "--max-steps", "100000", "--eval-every", "0", "--shards", "2",
                   "--log-level", "info")
    wait_line(server, r"listening on (\S+)", 60)
    daemon = psutil.Process(daemon_pid(server))
    assert daemon.pid != server.pid  # supervised

    def local_shards():
        found = [c for c in daemon.children() if "shard" in c.cmdline() and any(state in a for a in c.cmdline())]
        return found if len(found) == 2 else None
    shards += wait_for(local_shards, 60, "the daemon did not start 2 local shards")
    wait_for(lambda: all(re.search(r"shard \d of 2", read(shard_log(state, i))) for i in range(2)), 60,
             "the local shards did not join")
    return server, daemon


def shard_log(state: str, i: int) -> str:
    return os.path.join(state, f"shard-{i}", "shard.log")


def test_kill9_of_supervisor_and_daemon_together_leaves_no_local_shard(tmp_path):
    state, shards, server = str(tmp_path / "state"), [], None
    try:
        server, daemon = start_sharded(state, shards)
        os.kill(server.pid, signal.SIGKILL)  # the two pids only: the shards lead groups of their own anyway
        os.kill(daemon.pid, signal.SIGKILL)
        left = wait_gone(shards, GONE_S)
        assert not left, f"shards {[p.pid for p in left]} outlived their coordinator by {GONE_S} s"
    finally:
        kill_left(shards)
        if server is not None:
            reap([server], grace_s=5)


def test_sigterm_of_the_daemon_stops_its_local_shards(tmp_path):
    """What ``latecomer stop`` does (SIGTERM to the daemon): the shards are told to stop and exit 0,
    each having written its checkpoint, then serve exits 0."""
    state, shards, server = str(tmp_path / "state"), [], None
    try:
        server, daemon = start_sharded(state, shards)
        daemon.send_signal(signal.SIGTERM)
        assert wait_exit(server, 60) == 0
        assert not wait_gone(shards, GONE_S)
        for i in range(2):
            assert "latecomer shard: stopped (the coordinator stopped: the run is over: signal SIGTERM)" in \
                read(shard_log(state, i))
    finally:
        kill_left(shards)
        if server is not None:
            reap([server], grace_s=5)


PATCHED_SHARD = """
import sys
import ps.net.supervise
ps.net.supervise.set_pdeathsig = lambda sig: "prctl(PR_SET_PDEATHSIG) failed: switched off by this test"
from ps.cli.main import main
main()
"""

PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], stdin=subprocess.DEVNULL)
print(f"shard pid {child.pid}", flush=True)
sys.stdin.read()  # until the test kills this process
"""


def test_a_local_shard_without_its_prctl_stops_by_itself_when_its_parent_dies(tmp_path):
    """The lifeline alone: the shard's parent (a small Python process here) killed with -9, the
    shard's PR_SET_PDEATHSIG never set; it stops within the bound, through its clean stop."""
    log = str(tmp_path / "shard.log")
    args = ["shard", "--coordinator", f"tcp://127.0.0.1:{free_port()}", "--state", str(tmp_path / "s"),
            "--exit-with-parent", "--coordinator-timeout", "0", "--log-level", "info"]
    with open(log, "ab") as out:
        parent = subprocess.Popen([sys.executable, "-c", PARENT, PATCHED_SHARD, *args], stdin=subprocess.PIPE,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    shard: list[psutil.Process] = []
    try:
        pid = int(wait_for(lambda: re.search(r"shard pid (\d+)", read(log)), 30, "no shard started").group(1))
        shard = [psutil.Process(pid)]
        wait_for(lambda: "latecomer shard: coordinator" in read(log), 60, f"the shard did not start: {read(log)}")
        assert "switched off by this test: this shard stops within 0.5 s of its parent instead" in read(log)
        parent.kill()
        parent.wait(timeout=10)
        t0 = time.monotonic()
        assert not wait_gone(shard, GONE_S), f"the shard outlived its parent: {read(log)[-2000:]}"
        took = time.monotonic() - t0
        text = read(log)
        assert f"the process that started this shard (pid {parent.pid}) is gone: stopping" in text, text
        assert f"latecomer shard: stopped (the process that started this shard (pid {parent.pid}) is gone)" in text
        assert took < 5.0, took  # the lifeline looks every pass (<= 100 ms), the close takes a moment
    finally:
        kill_left(shard)
        reap([parent], grace_s=5)


SPAWNER = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-m", "ps", *sys.argv[1:], f"--parent-pid={os.getpid()}"],
                         stdin=subprocess.DEVNULL)
print(f"shard pid {child.pid}", flush=True)
os._exit(0)  # gone before the shard's prctl: it is init's child by then
"""


def test_a_local_shard_whose_parent_died_while_it_started_exits(tmp_path):
    """The race of issue 28: the process that started a local shard dies while the shard is still
    importing; the shard, told its parent's pid (as LocalShards does), sees a parent that is not
    that one and exits instead of serving no one for ever (a parent read after the fact would
    be init, and the prctl armed on init)."""
    log = str(tmp_path / "shard.log")
    with open(log, "ab") as out:
        spawner = subprocess.Popen([sys.executable, "-c", SPAWNER, "shard", "--coordinator",
                                    f"tcp://127.0.0.1:{free_port()}", "--state", str(tmp_path / "s"),
                                    "--exit-with-parent", "--coordinator-timeout", "0"],
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    shard: list[psutil.Process] = []
    try:
        assert wait_exit(spawner, 30) == 0
        pid = int(re.search(r"shard pid (\d+)", read(log)).group(1))
        try:
            shard = [psutil.Process(pid)]
        except psutil.NoSuchProcess:
            pass  # already gone
        assert not wait_gone(shard, 60), f"the shard outlived its parent: {read(log)[-2000:]}"
        assert f"the process that started it (pid {spawner.pid}) is gone" in read(log)
    finally:
        kill_left(shard)


def test_a_remote_shard_gives_up_without_a_coordinator(tmp_path):
    shard = spawn("shard", "--coordinator", f"tcp://127.0.0.1:{free_port()}", "--state", str(tmp_path / "s"),
                  "--coordinator-timeout", "2")
    try:
        wait_line(shard, r"latecomer shard: coordinator", 60)
        t0 = time.monotonic()
        rc = wait_exit(shard, 20)
        took = time.monotonic() - t0
        out = shard.stdout.read().decode(errors="replace")
        assert rc == 1, out
        assert out.count("no coordinator for 2 s: stopping") == 1, out
        assert "latecomer shard: stopped (no coordinator for 2 s)" in out
        assert 1.0 < took < 10.0, took  # 2 s from its start (its first line came a moment after)
    finally:
        reap([shard], grace_s=5)
