"""`latecomer launch` across "hosts" that are network namespaces (issue 8).

A server namespace and two host namespaces (``hostA``, ``hostB``) on a private bridge, built with
test_netns.py's ``Lab`` (10.231.0.0/24, nothing reaches the root namespace). The server binds
10.231.0.1 inside its namespace; ``latecomer launch`` runs in the root namespace with a fake
``ssh`` that turns ``ssh [opts] HOST CMD`` into ``ip netns exec <HOST's namespace> bash -c CMD``,
so each worker really runs on its host's network and reaches the server over the bridge. The
workers train (applied replies from all three), ``latecomer launch --stop`` stops them (they say
bye), the server drains on SIGTERM. Teardown kills and reaps whatever is left and deletes the
namespaces, whatever happens.
"""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import signal
import sys

import pytest

from tests.integration.test_launch_report import PR_SET_CHILD_SUBREAPER, latecomer, reap
from tests.integration.test_netns import PORT, SERVER_IP, Lab, netns_unusable
from tests.integration.util import read_events, wait_events, wait_line

pytestmark = [pytest.mark.slow, pytest.mark.netns]

ENDPOINT = f"tcp://{SERVER_IP}:{PORT}"
HOSTS = {"hostA": 2, "hostB": 1}
IDS = {"hostA-0", "hostA-1", "hostB-0"}


class LaunchLab(Lab):
    """A Lab that also adopts the workers `latecomer launch` detaches (``setsid nohup ... &``):
    they are orphaned when the fake ssh exits, so this process is made their subreaper and can
    wait for them (no zombies, no strays)."""

    def __init__(self, tmp_path) -> None:
        super().__init__(tmp_path)
        self.launched: list[int] = []  # PIDs of launched workers, reaped (or killed) at teardown
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.subreaper = self._libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0

    def reap_launched(self) -> list[str]:
        """SIGKILL every launched worker still running, reap it. Returns what could not be reaped."""
        problems = []
        for pid in self.launched:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue  # already reaped (or never ours): its PID may be reused, leave it alone
            if not done:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                if not reap(pid, timeout=5):
                    problems.append(f"launched worker pid {pid} not reaped")
        return problems

    def close(self) -> None:
        if self.subreaper:
            self._libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)

    def fake_ssh(self) -> str:
        """`ssh [-n] [-o OPT]... HOST COMMAND` -> `ip netns exec NS bash -c COMMAND`; logs the host."""
        cases = "".join(f"  {h}) ns={shlex.quote(self.hosts[h][0])};;\n" for h in HOSTS)
        path = self.tmp / "fake-ssh"
        path.write_text(
            "#!/bin/bash\n"
            'while [[ $# -gt 0 ]]; do case "$1" in -n) shift;; -o) shift 2;; *) break;; esac; done\n'
            'host=$1; shift\n'
            f'case "$host" in\n{cases}'
            '  *) echo "ssh: Could not resolve hostname $host" >&2; exit 255;;\n'
            "esac\n"
            f'echo "$host" >> {shlex.quote(str(self.tmp / "ssh.log"))}\n'
            'exec ip netns exec "$ns" bash -c "$*"\n')
        path.chmod(0o755)
        return str(path)


@pytest.fixture
def lab(tmp_path):
    why = netns_unusable()
    if why:
        pytest.skip(why)
    lab = LaunchLab(tmp_path)
    if not lab.subreaper:
        lab.close()
        pytest.skip("prctl(PR_SET_CHILD_SUBREAPER) not available: launched workers could not be reaped")
    problems: list[str] = []
    try:
        yield lab
    finally:
        try:
            problems += lab.reap_launched()
            lab.reap()
        finally:
            problems += lab.teardown()
            lab.close()
        assert not problems, problems


def netns_inode(lab: Lab, host: str) -> int:
    return os.stat(f"/run/netns/{lab.hosts[host][0]}").st_ino


def test_launch_over_ssh_into_namespaces_trains_and_stops(lab, tmp_path):
    events = str(tmp_path / "events.jsonl")
    lab.build(["server", *HOSTS])
    server = lab.start("server", "serve", "--bind", ENDPOINT, "--problem", "quadratic", "--problem-opt", "d=64",
                       "--algorithm", "asgd", "--set", "lr=0.05", "--max-time", "120", "--liveness-timeout", "2",
                       "--heartbeat-interval", "0.25", "--events", events, "--log-level", "warning",
                       "--insecure")  # a private namespace network; CurveZMQ has its own test
    wait_line(server, r"listening on", timeout=60)

    hosts = tmp_path / "hosts"
    hosts.write_text("# two namespaces as hosts\n" + "".join(f"{h} {n}\n" for h, n in HOSTS.items()))
    launch_file = str(tmp_path / "launch.json")
    ssh = lab.fake_ssh()
    r = latecomer("launch", "--hosts", str(hosts), "--server", ENDPOINT, "--ssh", ssh,
                  "--remote-cmd", f"{shlex.quote(sys.executable)} -m ps", "--launch-file", launch_file,
                  "--log-dir", str(tmp_path), "--ssh-timeout", "20")
    record = json.loads(open_text(launch_file)) if os.path.exists(launch_file) else {"workers": []}
    lab.launched.extend(int(w["pid"]) for w in record["workers"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 workers started" in r.stdout, r.stdout
    assert sorted((w["host"], w["worker_id"]) for w in record["workers"]) == \
        [("hostA", "hostA-0"), ("hostA", "hostA-1"), ("hostB", "hostB-0")]
    assert (tmp_path / "ssh.log").read_text().split() == ["hostA", "hostA", "hostB"]
    for w in record["workers"]:
        # the worker really lives on its host's network (not the root namespace, not the server's)
        assert os.stat(f"/proc/{w['pid']}/ns/net").st_ino == netns_inode(lab, w["host"]), w
        assert w["worker_id"] in open_text(f"/proc/{w['pid']}/cmdline").split("\0")

    def trained(ev):
        return IDS <= {e["worker_id"] for e in ev if e["ev"] == "applied"}
    try:
        wait_events(events, trained, timeout=60)
    except TimeoutError as e:
        logs = {w["worker_id"]: _tail(w["log"]) for w in record["workers"]}
        raise AssertionError(f"{e}; worker logs: {logs}; server: {lab.stderr_tail('server')}") from e

    r = latecomer("launch", "--stop", "--launch-file", launch_file, "--grace", "5", "--ssh-timeout", "20")
    assert r.returncode == 0, r.stdout + r.stderr
    stopped = {ln.split()[1]: ln.split()[0] for ln in r.stdout.splitlines() if ln.startswith(("stopped", "killed"))}
    assert stopped == dict.fromkeys(IDS, "stopped"), r.stdout  # SIGTERM was enough for every one
    assert not os.path.exists(launch_file)
    assert (tmp_path / "ssh.log").read_text().split()[3:] == ["hostA", "hostB"], "one stop ssh per host"
    for w in record["workers"]:
        assert reap(w["pid"], timeout=10), f"{w['worker_id']} (pid {w['pid']}) still running"
    left = wait_events(events, lambda ev: ({e["worker_id"] for e in ev if e["ev"] == "left"} >= IDS) and ev,
                       timeout=10)
    reasons = {e["worker_id"]: e["reason"] for e in left if e["ev"] == "left"}
    assert set(reasons.values()) <= {"bye", "unreachable"}, reasons  # not a liveness timeout

    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=30) == 0, lab.stderr_tail("server")
    applied = {wid: sum(1 for e in read_events(events) if e["ev"] == "applied" and e["worker_id"] == wid)
               for wid in sorted(IDS)}
    for w in record["workers"]:
        assert os.path.exists(w["log"])
    print(f"\nnetns launch: workers on {sorted(HOSTS)} applied {applied}; stop: {stopped}; left: {reasons}")


def open_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _tail(path: str, n: int = 400) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")
    except OSError:
        return ""
