"""CurveZMQ: an allowed worker trains; an unknown key and a revoked key are refused."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ps.cli.main import main
from tests.integration.util import read_events, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow


def keys(tmp_path, *names):
    d = str(tmp_path / "keys")
    r = CliRunner()
    assert r.invoke(main, ["keys", "init", d]).exit_code == 0
    for n in names:
        res = r.invoke(main, ["keys", "add-worker", n, "--keys", d])
        assert res.exit_code == 0, res.output
    return d


def worker(procs, endpoint, d, name, *extra, key_of=None):
    return procs.start("work", "--server", endpoint, "--worker-id", name, "--delay", "0.01",
                       "--key", f"{d}/workers/{key_of or name}.key_secret", "--server-key", f"{d}/server.key", *extra)


def test_curve_allowed_worker_trains_and_strangers_and_revoked_keys_are_refused(procs, tmp_path):
    d = keys(tmp_path, "good", "later-revoked")
    stranger = str(tmp_path / "stranger")
    assert CliRunner().invoke(main, ["keys", "init", stranger]).exit_code == 0  # a key pair not on the list
    events = str(tmp_path / "events.jsonl")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--keys", d, "--problem", "quadratic",
                         "--algorithm", "asgd", "--set", "lr=0.1", "--events", events, "--max-time", "120",
                         "--liveness-timeout", "2", "--log-level", "info")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    good = worker(procs, endpoint, d, "good")
    revoked = worker(procs, endpoint, d, "later-revoked")
    wait_events(events, lambda ev: all(sum(e["ev"] == "applied" and e["worker_id"] == w for e in ev) >= 5
                                       for w in ("good", "later-revoked")), timeout=60)
    ev = read_events(events)
    keys_seen = {e["worker_id"]: e["key"] for e in ev if e["ev"] == "applied"}
    assert len(keys_seen["good"]) == 16 and keys_seen["good"] != keys_seen["later-revoked"], \
        "each applied reply records the key that contributed it"

    # a worker with a key that is not on the allow-list never gets in
    intruder = procs.start("work", "--server", endpoint, "--worker-id", "intruder", "--give-up", "3",
                           "--key", f"{stranger}/server.key_secret", "--server-key", f"{d}/server.key")
    # a worker without CURVE at all cannot even complete the handshake
    plain = procs.start("work", "--server", endpoint, "--worker-id", "plain", "--give-up", "3")
    assert wait_exit(intruder, timeout=30) == 0 and wait_exit(plain, timeout=30) == 0
    assert b"no server for 3 s" in intruder.stderr.read()

    # revocation without restart: delete from the allow-list, SIGHUP
    r = CliRunner().invoke(main, ["keys", "revoke", "later-revoked", "--keys", d])
    assert r.exit_code == 0, r.output
    server.send_signal(signal.SIGHUP)
    left = wait_events(events, lambda ev: [e for e in ev if e["ev"] == "left" and e["worker_id"] == "later-revoked"],
                       timeout=20)
    assert left[0]["reason"] == "revoked"
    assert wait_exit(revoked, timeout=15) == 0, "told bye, the revoked worker exits"
    again = worker(procs, endpoint, d, "later-revoked-2", "--give-up", "3", key_of="later-revoked")
    assert wait_exit(again, timeout=30) == 0  # its key no longer passes the handshake
    n = len(read_events(events))
    wait_events(events, lambda ev: sum(e["ev"] == "applied" and e["worker_id"] == "good" for e in ev[n:]) >= 5,
                timeout=30)  # the allowed worker trains on
    server.send_signal(signal.SIGTERM)
    assert wait_exit(server, timeout=30) == 0
    assert wait_exit(good, timeout=15) == 0
    err = server.stderr.read().decode()
    assert "refused a connection with an unknown key" in err
    ev = read_events(events)
    assert not any(e["ev"] == "joined" and e["worker_id"] in ("intruder", "plain", "later-revoked-2") for e in ev)


def test_non_loopback_bind_needs_keys_or_insecure():
    r = subprocess.run([sys.executable, "-m", "ps", "serve", "--bind", "tcp://0.0.0.0:0", "--problem", "quadratic"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--insecure" in r.stderr and "Traceback" not in r.stderr
