"""The front's connection limits against a real ``serve`` (issue 29, point 1; SECURITY.md, "Limits
and rates"): under CurveZMQ an unauthenticated connection never displaces an authenticated one,
and ``--max-connections-per-source`` caps what one address holds.

What is observed is the connections themselves: each real worker's TCP connection (its local
port, from the worker process's own socket table) is the same one before and after the flood, so
it was never cut and reconnected; the flood's sockets see the server close them (EOF or reset).
"""

from __future__ import annotations

import errno
import os
import select
import socket
import time

import psutil
import pytest
from click.testing import CliRunner

from ps.cli.main import main
from tests.integration.attack import Victim
from tests.integration.util import read_events
from tests.integration.zmtp_raw import MORE, frame_header, greeting, ready, tcp_address

pytestmark = [pytest.mark.slow, pytest.mark.attack]


def worker_connections(pid: int, port: int) -> list[tuple[int, str]]:
    """The worker process's TCP connections to the server's ``port``, (local port, state) each: under
    --keys two, its CurveZMQ connection and its sealed data connection (PROTOCOL.md §6.15)."""
    return sorted((c.laddr.port, c.status) for c in psutil.Process(pid).net_connections(kind="tcp")
                  if c.raddr and c.raddr.port == port)


def open_raw(endpoint: str, source: str, first: bytes) -> socket.socket:
    """A TCP connection from ``source`` that sends ``first`` (a greeting, a handshake) and nothing more."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.settimeout(10)
    s.connect(tcp_address(endpoint))
    s.sendall(first)
    s.setblocking(False)
    return s


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (an EOF or a reset is waiting); what it sent is read and dropped."""
    while True:
        if not select.select([s], [], [], 0)[0]:
            return False
        try:
            if not s.recv(65536):
                return True
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno in (errno.ECONNRESET, errno.EPIPE):
                return True
            raise


def wait_closed(socks: list[socket.socket], n: int, timeout: float) -> int:
    """Wait until at least ``n`` of ``socks`` were closed by the server; the number closed."""
    deadline = time.monotonic() + timeout
    while True:
        closed = sum(closed_by_server(s) for s in socks)
        if closed >= n:
            return closed
        assert time.monotonic() < deadline, f"only {closed} of {len(socks)} connections closed within {timeout} s"
        time.sleep(0.05)  # polling interval of a bounded wait


def joined(state: str, worker_id: str) -> bool:
    return any(e.get("ev") == "joined" and e.get("worker_id") == worker_id
               for e in read_events(os.path.join(state, "events.jsonl")))


def test_under_curve_a_flood_of_unauthenticated_connections_never_displaces_an_authenticated_one(procs, tmp_path):
    """``serve --keys --max-connections 6``: two allowed workers train (4 connections: each its
    CurveZMQ one and its sealed data one); 300 connections that send a CURVE greeting and never
    finish the handshake arrive from two addresses. The front makes room for each by shedding a
    connection still in its handshake, never one whose CURVE handshake the daemon accepted (its
    READY seen) nor a data connection whose token checked out (at most one per authenticated
    one): the two workers keep the very connections they had (same local ports, ESTABLISHED),
    keep training, and a third allowed worker started during the flood joins (the front sheds
    flood connections for its two). Broken on purpose (authenticated connections made
    sheddable), the workers' ports change."""
    d = str(tmp_path / "keys")
    runner = CliRunner()
    assert runner.invoke(main, ["keys", "init", d]).exit_code == 0
    for name in ("real1", "real2", "late"):
        assert runner.invoke(main, ["keys", "add-worker", name, "--keys", d]).exit_code == 0

    def key_args(name: str) -> tuple[str, ...]:
        return ("--key", f"{d}/workers/{name}.key_secret", "--server-key", f"{d}/server.key")

    victim = Victim(procs, tmp_path, extra_serve=("--keys", d, "--max-connections", "6"),
                    worker_args=lambda i: key_args(f"real{i}"))
    port = tcp_address(victim.endpoint)[1]
    deadline = time.monotonic() + 30
    while not all(len(worker_connections(w.pid, port)) == 2 for w in victim.workers):
        assert time.monotonic() < deadline, [worker_connections(w.pid, port) for w in victim.workers]
        time.sleep(0.05)  # polling interval of a bounded wait (the data connection follows the welcome)
    before = [worker_connections(w.pid, port) for w in victim.workers]
    assert all(st == psutil.CONN_ESTABLISHED for c in before for _, st in c), before

    flood = []
    try:
        for i in range(300):
            flood.append(open_raw(victim.endpoint, ("127.0.0.1", "127.0.0.2")[i % 2], greeting(b"CURVE")))
        # 300 in, 2 sheddable slots: all but at most 2 were shed (or cut at the handshake deadline)
        shed = wait_closed(flood, len(flood) - 2, timeout=60)
        late = procs.start("work", "--server", victim.endpoint, "--worker-id", "late", "--delay", "0.01",
                           *key_args("late"))
        deadline = time.monotonic() + 60
        while not joined(victim.state, "late"):
            assert late.poll() is None, f"the late worker exited ({late.returncode})"
            assert time.monotonic() < deadline, "the late allowed worker did not join during the flood"
            time.sleep(0.05)  # polling interval of a bounded wait
        victim.workers.append(late)
        after = [worker_connections(w.pid, port) for w in victim.workers[:2]]
        assert after == before, f"an authenticated connection was cut and remade: {before} -> {after}"
        print(f"flood: {shed} of {len(flood)} closed by the server; workers' connections {before} kept")
    finally:
        for s in flood:
            s.close()
    victim.wait_applied(victim.events.applied + 100, timeout=60)
    assert not victim.events.real_lost, victim.events.real_lost
    victim.finish()


def test_one_source_holds_at_most_its_cap_and_the_others_are_served(procs, tmp_path):
    """``serve --max-connections-per-source 5`` (NULL): 40 clients from 127.0.0.2 finish the ZMTP
    handshake and hold; the server closes all but 5 at once, keeps those 5 (they broke no bound),
    closes a new one from that address too, and a worker from 127.0.0.1 still joins and trains.
    Broken on purpose (no cap), nothing is closed and the wait fails."""
    victim = Victim(procs, tmp_path, extra_serve=("--max-connections-per-source", "5"))
    held = [open_raw(victim.endpoint, "127.0.0.2", greeting() + ready()) for _ in range(40)]
    try:
        assert wait_closed(held, 35, timeout=60) == 35
        kept = [s for s in held if not closed_by_server(s)]
        assert len(kept) == 5, "the first 5 of the address are kept"
        extra = open_raw(victim.endpoint, "127.0.0.2", greeting() + ready())
        held.append(extra)
        assert wait_closed([extra], 1, timeout=30) == 1, "a sixth connection from the address is closed at once"
        w = procs.start("work", "--server", victim.endpoint, "--worker-id", "real3", "--delay", "0.01")
        victim.workers.append(w)
        deadline = time.monotonic() + 60
        while not joined(victim.state, "real3"):
            assert w.poll() is None, f"the worker exited ({w.returncode})"
            assert time.monotonic() < deadline, "a worker from another address did not join"
            time.sleep(0.05)  # polling interval of a bounded wait
        assert not any(closed_by_server(s) for s in kept), "the 5 within the cap are still open"
    finally:
        for s in held:
            s.close()
    victim.finish()


def test_a_worker_that_never_reads_is_cut_once_the_bytes_for_it_wait(procs, tmp_path):
    """A raw client joins as a worker with credit 4 (4 jobs of a 4 MiB iterate: more than its
    receive buffer of 4 KiB and the front's socket buffer hold), heartbeats every 0.4 s and never
    reads. Once the daemon's bytes wait in the front for it, it must take 64 KiB in every 5 s
    window: it takes nothing, so the front resets it (its next send fails) and the daemon drops
    what it queued for it, well before the heartbeats would ever let the liveness timeout end
    it; the real workers train on and nothing accepted is lost. Broken on purpose (no outbound
    window), the client is never cut and the wait fails."""
    from protocol.codec import encode
    from protocol.messages import Heartbeat, Hello, Ready

    victim = Victim(procs, tmp_path, d=1 << 20)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: no autotuning
    s.settimeout(10)
    s.connect(tcp_address(victim.endpoint))

    def message(msg) -> bytes:
        frames = [bytes(f) for f in encode(msg)]
        return b"".join(frame_header(len(f), MORE if i < len(frames) - 1 else 0) + f for i, f in enumerate(frames))

    s.sendall(greeting() + ready())
    got = b""
    while len(got) < 64 + 2 or len(got) < 64 + 2 + got[65]:  # the server's greeting and READY (a short command)
        chunk = s.recv(4096)
        assert chunk, "the server closed the connection in the handshake"
        got += chunk
    s.sendall(message(Hello(worker_id="sink", boot=3, credit=4)) + message(Ready(credit=4)))
    t0 = time.monotonic()
    deadline = t0 + 60  # the design: about a window (5 s) once its buffers are full
    cut = False
    try:
        while not cut:
            assert time.monotonic() < deadline, "a client that never reads was not cut within 60 s"
            try:
                s.sendall(message(Heartbeat(boot=3, credit=4, busy=(), seen=-1)))
            except OSError as e:
                assert e.errno in (errno.ECONNRESET, errno.EPIPE), e
                cut = True
            time.sleep(0.4)  # its heartbeat interval
    finally:
        s.close()
    took = time.monotonic() - t0
    victim.wait_applied(victim.events.applied + 50, timeout=60)
    assert not victim.events.real_lost, victim.events.real_lost
    victim.finish()
    log = (victim.server.stdout.read() + victim.server.stderr.read()).decode(errors="replace")
    assert "of what the server sent it in 5 s" in log, log[-2000:]
    print(f"the non-reading worker was cut {took:.1f} s after it joined")
