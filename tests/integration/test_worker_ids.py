"""Real processes: workers sharing a CurveZMQ key get distinct default ids and both train (no
knock-out), and a server on an IPv6 loopback endpoint serves workers and `status`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ps.cli.main import main
from tests.conftest import REPO
from tests.integration.util import read_events, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow


def test_workers_sharing_a_key_get_distinct_default_ids(procs, tmp_path, monkeypatch):
    from worker.identity import base_id

    d = str(tmp_path / "keys")
    r = CliRunner()
    assert r.invoke(main, ["keys", "init", d]).exit_code == 0
    assert r.invoke(main, ["keys", "add-worker", "shared", "--keys", d]).exit_code == 0
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the children's id claims live here
    events = str(tmp_path / "events.jsonl")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--keys", d, "--problem", "quadratic",
                         "--algorithm", "asgd", "--set", "lr=0.1", "--events", events, "--max-time", "120")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    key = f"{d}/workers/shared.key_secret"
    for _ in range(2):
        procs.start("work", "--server", endpoint, "--delay", "0.01", "--key", key, "--server-key", f"{d}/server.key")
    base = base_id(key)
    assert base.startswith("shared@")  # this host is not called "shared": the host is in the id
    ids = {base, f"{base}-2"}
    wait_events(events, lambda ev: all(sum(e["ev"] == "applied" and e["worker_id"] == w for e in ev) >= 10
                                       for w in ids), timeout=60)
    ev = read_events(events)
    assert {e["worker_id"] for e in ev if e["ev"] == "joined"} == ids
    assert not [e for e in ev if e["ev"] == "left"], "neither worker was written off by the other"


def test_two_processes_claiming_one_default_id_settle_on_two_ids(procs, tmp_path):
    """Two workers sharing a key whose id claims cannot see each other (separate temporary
    directories: two containers of one host name, or two hosts of one name) both default to
    ``shared@HOST``. The second hello replaces the first; the first speaks again with its old boot,
    which proves a second live process: it is refused (``worker id in use``), takes ``ID-BOOT`` and
    joins. One write-off at the takeover, then no more joins or leaves: no knock-out loop."""
    from worker.identity import base_id

    d = str(tmp_path / "keys")
    r = CliRunner()
    assert r.invoke(main, ["keys", "init", d]).exit_code == 0
    assert r.invoke(main, ["keys", "add-worker", "shared", "--keys", d]).exit_code == 0
    events = str(tmp_path / "events.jsonl")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--keys", d, "--problem", "quadratic",
                         "--algorithm", "asgd", "--set", "lr=0.1", "--events", events, "--max-time", "120")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    key = f"{d}/workers/shared.key_secret"
    base = base_id(key)
    for i in range(2):
        tmp = tmp_path / f"tmp{i}"
        tmp.mkdir()
        procs.start("work", "--server", endpoint, "--delay", "0.01", "--key", key, "--server-key",
                    f"{d}/server.key", env={"TMPDIR": str(tmp)})
        if i == 0:  # the first has joined before the second says hello
            wait_events(events, lambda ev: any(e["ev"] == "joined" for e in ev), timeout=60)

    def settled(ev):
        ids = {e["worker_id"] for e in ev if e["ev"] == "joined"}
        other = [w for w in ids if w != base]
        return len(other) == 1 and all(sum(e["ev"] == "applied" and e["worker_id"] == w for e in ev) >= 20
                                       for w in (base, other[0])) and other[0]
    other = wait_events(events, settled, timeout=60)
    assert other.startswith(f"{base}-") and len(other) == len(base) + 7, other
    n = len(read_events(events))
    wait_events(events, lambda ev: len(ev) > n + 200, timeout=60)  # it goes on training, two ids
    ev = read_events(events)
    assert [e["worker_id"] for e in ev if e["ev"] == "joined"].count(base) == 2  # first joined, then replaced
    assert [(e["worker_id"], e.get("reason")) for e in ev if e["ev"] == "left"] == [(base, "restarted")]


def test_two_workers_given_one_id_the_replaced_one_stops_with_one_line(procs, tmp_path):
    """With ``--worker-id`` given by the user, the replaced process does not rename itself: it
    stops with one line naming the flag (status 2), and the other trains on. The id is then
    contested: a new boot of it is refused while its holder is live."""
    events = str(tmp_path / "events.jsonl")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--algorithm", "asgd",
                         "--set", "lr=0.1", "--events", events, "--max-time", "120")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    first = procs.start("work", "--server", endpoint, "--delay", "0.01", "--worker-id", "twin")
    wait_events(events, lambda ev: any(e["ev"] == "joined" for e in ev), timeout=60)
    procs.start("work", "--server", endpoint, "--delay", "0.01", "--worker-id", "twin")
    assert wait_exit(first, timeout=60) == 2
    err = first.stderr.read().decode()
    assert "worker id in use" in err and "--worker-id" in err, err
    # Restarted (as Restart=always would), the twin cannot take the id back while its holder lives.
    again = procs.start("work", "--server", endpoint, "--delay", "0.01", "--worker-id", "twin")
    assert wait_exit(again, timeout=60) == 2
    n = len(read_events(events))
    wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev[n:]) >= 50, timeout=60)
    ev = read_events(events)
    assert [e["ev"] for e in ev].count("joined") == 2 and [e["ev"] for e in ev].count("left") == 1


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_endpoint_serves_workers_and_status(procs, tmp_path):
    server = procs.start("serve", "--bind", "tcp://[::1]:0", "--problem", "quadratic", "--algorithm", "asgd",
                         "--set", "lr=0.1", "--max-time", "120")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    assert endpoint.startswith("tcp://[::1]:")
    w = procs.start("work", "--server", endpoint, "--max-jobs", "5", "--worker-id", "v6")
    assert wait_exit(w, timeout=60) == 0
    st = subprocess.run([sys.executable, "-m", "ps", "status", "--server", endpoint, "--json"], cwd=REPO,
                        capture_output=True, text=True, timeout=60)
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["info"]["counter.applied"] >= 5
