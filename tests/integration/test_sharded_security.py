"""CurveZMQ on a sharded server (issue 17): ``serve --keys --shards 2`` and ``latecomer shard
--keys``. Every process of the server holds the server's key pair: the coordinator's shard
socket admits only a shard holding it (a shard with another key pair is refused at the
handshake and never joins), each shard's data socket admits only workers on the allow-list (a
stranger's key and a plaintext peer get no answer, while an allowed worker's fetch is answered
at once), and an allowed worker trains through both shards until the run is stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
import zmq
from click.testing import CliRunner

from protocol.codec import decode, encode
from protocol.messages import Error, ErrorCode, Fetch
from ps.cli.main import main
from tests.integration.test_security import keys
from tests.integration.util import wait_events, wait_exit

pytestmark = pytest.mark.slow



def logged(path, pattern: str, timeout: float = 60) -> re.Match:
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(pattern, path.read_text(errors="replace")) if path.exists() else None
        if m:
            return m
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {pattern!r} in {path.name}: {path.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)  # polling interval of a bounded wait


def answered(endpoint: str, curve: tuple | None, wait_ms: int) -> object | None:
    """A fetch of job 0 (settled, or not this peer's: an admitted peer gets UNKNOWN_JOB at once) from
    a DEALER with these CURVE keys (None: plaintext); the answer, or None after ``wait_ms``."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    try:
        if curve is not None:
            s.curve_publickey, s.curve_secretkey, s.curve_serverkey = curve
        s.connect(endpoint)
        s.send_multipart(encode(Fetch(job_id=0, created_at=0)))
        return decode(s.recv_multipart()) if s.poll(wait_ms) else None
    finally:
        s.close()


def test_a_sharded_server_under_curve_admits_its_own_shards_and_allowed_workers_only(procs, tmp_path):
    d = keys(tmp_path, "good")
    stranger = str(tmp_path / "stranger")
    assert CliRunner().invoke(main, ["keys", "init", stranger]).exit_code == 0  # another key pair entirely
    state, log = str(tmp_path / "run"), tmp_path / "serve.log"

    def start(name: str, *args: str) -> subprocess.Popen:
        out = open(tmp_path / f"{name}.log", "ab")  # noqa: SIM115 - the child's output for its life
        return procs.start(*args, stdout=out, stderr=subprocess.STDOUT)

    server = start("serve", "serve", "--bind", "tcp://127.0.0.1:0", "--keys", d, "--state", state, "--shards", "2",
                   "--local-shards", "1", "--problem", "digits", "--algorithm", "asgd", "--set", "lr=0.1",
                   "--max-steps", "1000000", "--eval-every", "0", "--log-level", "info")
    endpoint = logged(log, r"listening on (\S+)").group(1)
    coordinator = logged(log, r"shards connect to (\S+)").group(1)

    from worker.keys import client_keys

    mine = client_keys(f"{d}/workers/good.key_secret", f"{d}/server.key")
    theirs = client_keys(f"{stranger}/server.key_secret", f"{d}/server.key")
    # Peers that know the server's public key but not its secret one knock on the shard socket: a
    # stranger's key and an allowed worker's key (a worker is not a shard) are both refused by its
    # ZAP domain, and logged.
    for curve in (theirs, mine):
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.linger = 0
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = curve
        s.connect(coordinator)
        s.send(b"\x81\xa1t\xa6shello")  # never read: the handshake fails first
        assert not s.poll(1000)
        s.close()
    deadline = time.monotonic() + 30
    while log.read_text().count("refused a connection with an unknown key") < 2:
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)  # polling interval of a bounded wait
    # A shard started with another key pair (so it does not even pin this server's key) never joins.
    fake = start("fake", "shard", "--coordinator", coordinator, "--slot", "1", "--keys", stranger)
    time.sleep(3)  # no event to wait for: the absence of a join over a few liveness-free seconds
    assert "shard 1 joined" not in log.read_text() and fake.poll() is None
    fake.terminate()
    assert wait_exit(fake, 15) is not None

    shard = start("shard1", "shard", "--coordinator", coordinator, "--slot", "1", "--keys", d,
                  "--state", str(tmp_path / "shard1"), "--log-level", "info")
    logged(log, r"shard 1 joined")
    shard_ep = logged(tmp_path / "shard1.log", r"shard data on (\S+)").group(1)
    good = start("good", "work", "--server", endpoint, "--worker-id", "good", "--key",
                 f"{d}/workers/good.key_secret", "--server-key", f"{d}/server.key", "--give-up", "60")
    wait_events(os.path.join(state, "events.jsonl"), lambda ev: sum(e["ev"] == "applied" for e in ev) >= 5, 120)

    assert answered(shard_ep, theirs, 2000) is None, "a key not on the allow-list is answered by a shard"
    assert answered(shard_ep, None, 2000) is None, "a plaintext peer is answered by a shard"
    reply = answered(shard_ep, mine, 20000)  # the silence above is the handshake's: an allowed key is answered
    assert type(reply) is Error and reply.code == ErrorCode.UNKNOWN_JOB, reply

    wait_events(os.path.join(state, "events.jsonl"), lambda ev: sum(e["ev"] == "applied" for e in ev) >= 100, 120)
    server.send_signal(signal.SIGTERM)  # the run goes on until stopped: the checks above ran during training
    assert wait_exit(server, 60) == 0, log.read_text()[-3000:]
    assert wait_exit(shard, 30) == 0
    assert wait_exit(good, 30) == 0
    with open(os.path.join(state, "summary.json"), encoding="utf-8") as f:
        s = json.load(f)
    assert s["version"] >= 100 and s["counters"]["applied"] == s["version"]
    assert [sh["joins"] for sh in s["shards"]] == [1, 1]
    assert "refused a connection with an unknown key" in (tmp_path / "shard1.log").read_text()
