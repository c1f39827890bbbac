"""Hostile input against the state directory and the metrics endpoint (issue 13, points 8 and 11),
through the attack harness (tests/integration/attack.py): a real ``serve --state`` with two real
workers training.

- Heartbeats padded with unknown header keys to 60 KB: the journal records what the core
  consumed (the decoded message), not the padding, so a heartbeat record stays small; with
  ``--max-journal-bytes`` the journal on disk stays within its bound while the attack runs, and
  the run still replays bit for bit (from the oldest kept checkpoint once the journal's head is
  removed).
- Many idle connections to the metrics port (``--metrics-port 0``): they cost the server no
  thread each (its thread count and RSS stay bounded), it stays alive and keeps scraping, and the
  log names the port it bound.
"""

from __future__ import annotations

import os
import re
import select
import socket
import time
import urllib.request

import msgpack
import pytest
import zmq

from protocol.codec import encode
from protocol.messages import MAX_PARTS, Heartbeat, Hello
from ps.drivers.schedule import MAX_READS
from ps.journal.segments import first_journal_lsn, read_journal
from tests.integration.attack import Victim

pytestmark = [pytest.mark.slow, pytest.mark.attack]

PAD_KEYS = 15  # msgpack caps a header string at 4 KiB and a map at 64 keys: 15 keys of 4000 chars
HEARTBEAT_BYTES = 60_000


def padded_heartbeat(boot: int) -> bytes:
    """A valid heartbeat whose header carries ~60 KB of unknown keys (forward compatibility says
    a receiver ignores them)."""
    header = msgpack.unpackb(encode(Heartbeat(boot=boot, credit=1, busy=(), seen=-1))[0])
    for i in range(PAD_KEYS):
        header[f"pad{i}"] = "x" * (HEARTBEAT_BYTES // PAD_KEYS)
    frame = msgpack.packb(header, use_bin_type=True)
    assert len(frame) >= HEARTBEAT_BYTES
    return frame


def journal_bytes(state: str) -> int:
    total = 0
    for name in os.listdir(state):
        if name.startswith("wal-") and name.endswith(".log"):
            try:
                total += os.path.getsize(os.path.join(state, name))
            except FileNotFoundError:  # removed meanwhile (covered by the checkpoints kept)
                pass
    return total


def padded_heartbeat_flood(state: str, samples: list[int], rate: float = 1500.0):
    """Say hello as a fake worker (never ready: it gets no job), then send padded heartbeats at
    ``rate`` per second (90 MB/s; the issue's attack wrote 290 MB of journal in 5 s), sampling the
    journal's size on disk."""
    def attack(endpoint, running):
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.sndhwm = 1000
        s.connect(endpoint)
        sent = 0
        try:
            s.send_multipart(encode(Hello(worker_id="padder", boot=7, credit=1)))
            frame = padded_heartbeat(7)
            t_sample = 0.0
            t_next = time.monotonic()
            while running():
                ahead = t_next - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)  # the attacker's own pace
                t_next += 1.0 / rate
                try:
                    s.send(frame, zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass  # the server's queue is full: this one is not sent
                while s.poll(0):
                    s.recv_multipart()  # welcome, heartbeats
                if time.monotonic() >= t_sample:
                    samples.append(journal_bytes(state))
                    t_sample = time.monotonic() + 0.05
        finally:
            s.close(0)
            ctx.term()
        samples.append(journal_bytes(state))
        return {"heartbeats_sent": sent, "bytes_sent_mb": round(sent * len(frame) / 2**20, 1)}
    return attack


def test_padded_heartbeats_are_journaled_small_and_the_journal_stays_bounded(procs, tmp_path):
    """Before the fix: 290 MB of journal in 5 s (every padded heartbeat journaled whole, nothing
    ever removed). The attack holds no server memory past what the design queues (each heartbeat
    is decoded and dropped), so the RSS bound is that queue: the daemon's receive pipe for one
    connection (its high-water mark, 8 x MAX_PARTS messages) and one pass of reads (MAX_READS),
    each a 60 KB frame and its decoded copy: about 88 MiB, where the 360 MB the attack sends would
    show if it were kept. Measured +2 MiB; +74 MiB once, with three suites running at once (the
    daemon behind, its pipe full). A fixed 40 MiB had no such derivation."""
    bound = 512 << 10  # small, so that the attack runs the journal past it: segments must go
    victim = Victim(procs, tmp_path, extra_serve=("--max-journal-bytes", str(bound), "--checkpoint-every", "200"))
    samples: list[int] = []
    report = victim.measure(padded_heartbeat_flood(victim.state, samples), seconds=4)
    print(report.summary(), f"journal peak {max(samples) / 2**10:.0f} KiB (bound {bound / 2**10:.0f} KiB)")
    queued = (8 * MAX_PARTS + MAX_READS) * 2 * HEARTBEAT_BYTES  # frames and their decoded copies
    report.check(rss_bound_mb=queued / 2**20)
    assert report.attack["heartbeats_sent"] > 2000, "the attack ran"
    # the journal on disk: within the bound, give or take one loop pass of records (MAX_BATCH messages)
    assert max(samples) <= bound + 64 * 1024, f"journal reached {max(samples)} bytes (bound {bound})"
    summary = victim.finish()  # replays bit for bit from the oldest kept checkpoint
    assert first_journal_lsn(victim.state) > 0, "segments the kept checkpoints cover were removed"
    assert summary["counters"]["applied"] >= 150
    records = [r for r in read_journal(victim.state) if r.op == "msg" and r.body.get("wid") == "padder"]
    assert len(records) > 100, "the padded heartbeats that reached the core are journaled"
    sizes = [len(msgpack.packb(r.body, use_bin_type=True)) + 8 for r in records]
    print(f"{len(records)} heartbeat records kept, {max(sizes)} bytes at most (the message was "
          f"{HEARTBEAT_BYTES / 1000:.0f} KB)")
    assert max(sizes) <= 200, "a heartbeat record holds the decoded fields, not the padding"


# --------------------------------------------------------------------------- metrics connections

def read_stderr_line(p, pattern: str, timeout: float) -> re.Match:
    """Read ``p.stderr`` until a line matches (the metrics port is logged there)."""
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout
    buf = b""
    fd = p.stderr.fileno()
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
        m = rx.search(buf.decode(errors="replace"))
        if m:
            return m
    raise TimeoutError(f"no line matching {pattern!r} on stderr: {buf[-500:]!r}")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def idle_metrics_connections(victim, port: int, figures: dict, n: int = 1000):
    """Open ``n`` TCP connections to the metrics port and send nothing on them; while they are
    open, sample the server's thread count and scrape it once."""
    import psutil

    def attack(endpoint, running):
        server = psutil.Process(victim.daemon_pid())  # the metrics threads live in the daemon
        socks = []
        threads = [server.num_threads()]
        try:
            while running() and len(socks) < n:
                s = socket.socket()
                s.setblocking(True)
                s.settimeout(5)
                try:
                    s.connect(("127.0.0.1", port))
                except OSError:
                    s.close()
                    figures["connect_failures"] = figures.get("connect_failures", 0) + 1
                    continue
                socks.append(s)
                if len(socks) % 50 == 0:
                    threads.append(server.num_threads())
            t_end = time.monotonic() + 1.0
            while running() and time.monotonic() < t_end:  # hold them open a while
                threads.append(server.num_threads())
                time.sleep(0.05)  # sampling interval
            figures["scrape_during"] = "latecomer_version" in scrape(port)
            threads.append(server.num_threads())
        finally:
            for s in socks:
                s.close()
        return {"connections": len(socks), "threads_max": max(threads), "threads_before": threads[0]}
    return attack


def test_idle_metrics_connections_hold_no_thread_and_the_bound_port_is_logged(procs, tmp_path):
    """Before the fix: one server thread per idle connection (prometheus_client's
    ThreadingHTTPServer), and `--metrics-port 0` logged as port 0. RSS bound 30 MiB: an idle
    connection costs a file descriptor and a small buffer (at most 64 are kept; the oldest idle
    one is closed for a new one)."""
    victim = Victim(procs, tmp_path, extra_serve=("--metrics-port", "0", "--log-level", "info"))
    port = int(read_stderr_line(victim.server, r"metrics on http://127\.0\.0\.1:(\d+)/metrics", timeout=10).group(1))
    assert port != 0, "the log names the port the OS chose"
    assert "latecomer_version" in scrape(port)
    figures: dict = {}
    report = victim.measure(idle_metrics_connections(victim, port, figures), seconds=8)
    print(report.summary(), figures)
    report.check(rss_bound_mb=30)
    a = report.attack
    assert a["threads_max"] <= a["threads_before"] + 2, "idle metrics connections hold no thread"
    assert a["connections"] >= 500, "the attack opened its connections"
    assert figures["scrape_during"], "a scrape is served while the idle connections are open"
    assert "latecomer_jobs_total" in scrape(port)
    victim.finish()
