"""A worker that does not know about shards (PROTOCOL.md §9, §12.1; issue 28): written before
§12, it says ``hello`` without ``shards`` and would compute on the coordinator's empty points. A
real ``serve --shards 2`` refuses it at its hello, with one line, within one liveness timeout;
the server logs one line; the same hello with ``shards: true`` is welcomed (the control)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import zmq

from protocol.codec import decode, encode
from protocol.messages import Error, ErrorCode, Hello, Welcome
from ps.ops.children import reap
from tests.integration.util import wait_line

pytestmark = pytest.mark.slow

LIVENESS_S = 3.0


def ask(endpoint: str, hello: Hello, timeout: float) -> tuple[object, float]:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.routing_id = f"{hello.worker_id}/{hello.boot:x}".encode()
    s.connect(endpoint)
    try:
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:  # the coordinator answers no hello before its shards joined
            s.send_multipart(encode(hello))
            if s.poll(500):
                return decode(s.recv_multipart()), time.monotonic() - t0
        return None, timeout
    finally:
        s.close()


def test_a_worker_that_ignores_shards_is_refused_at_its_hello_with_one_line(tmp_path):
    server = subprocess.Popen(
        [sys.executable, "-m", "ps", "serve", "--bind", "tcp://127.0.0.1:0", "--state", str(tmp_path / "s"),
         "--problem", "synthetic", "--problem-opt", "d=1000", "--algorithm", "asgd", "--shards", "2",
         "--max-steps", "10", "--eval-every", "0", "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        endpoint = wait_line(server, r"listening on (\S+)", 60).group(1)
        old, took = ask(endpoint, Hello(worker_id="old", boot=1, credit=1), 30)
        assert isinstance(old, Error) and old.code == ErrorCode.REFUSED, old
        assert "sharded" in old.message and "12" in old.message and "\n" not in old.message, old.message
        assert took < LIVENESS_S, took
        new, _ = ask(endpoint, Hello(worker_id="new", boot=2, credit=1, shards=True), 60)
        assert isinstance(new, Welcome) and len(new.shards) == 2, new
    finally:
        reap([server], grace_s=5)
    out = server.stdout.read().decode()
    lines = [ln for ln in out.splitlines() if "refused hello from worker old" in ln]
    assert len(lines) == 1, out[-3000:]
