"""benchmarks/netns.py's ``Hosts``: the shaping is applied, the counters count, teardown leaves nothing.

Two hosts at RATE: a plain-socket server in host ``a`` receives NBYTES that a client in host ``b``
sends over TCP. The receiver times the transfer itself, from its first recv to EOF: the bytes it
reads in that window are the ones that arrived in it plus what was queued before its first recv
(at most the initial receive buffer, ~128 KB, as autotuning only grows it as the reader reads),
so the figure cannot exceed the shaped rate by more than (bucket + that backlog) / window, about
1% here, however loaded the box is. That cap is the robust claim: the upper bound below holds on
any box. The lower bounds are loose on purpose (a loaded 2-core VM may be slow, never fast): the
limited run must reach a quarter of the rate (not shaped far too hard, e.g. a unit slip), and an
unshaped run in the same test must beat the cap by 2x (so the cap is the shaper's, not the CPU's).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from benchmarks.netns import Hosts, why_unusable
from tests.integration.test_netns import netns_unusable

pytestmark = [pytest.mark.slow, pytest.mark.netns]

RATE = "200mbit"
NBYTES = 20_000_000  # 0.84 s at 200 Mbit/s: large against the bucket (67 KB) and the initial rcvbuf
PORT = 5602

SERVER = r"""
import socket, sys, time
srv = socket.socket(); srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1); print("ready", flush=True)
conn, _ = srv.accept(); buf = bytearray(1 << 20)
first = conn.recv_into(buf); t0 = time.perf_counter(); total = 0
while n := conn.recv_into(buf):
    total += n
print(first + total, total, time.perf_counter() - t0, flush=True)
"""
CLIENT = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60); s.sendall(bytes(int(sys.argv[3]))); s.close()
"""
LOOPBACK = r"""
import socket
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
c = socket.create_connection(srv.getsockname(), timeout=10); s, _ = srv.accept()
c.sendall(b"ping"); print(s.recv(4).decode())
"""


@pytest.fixture(autouse=True)
def _needs_netns():
    why = netns_unusable() or why_unusable()  # the latter adds tc's tbf
    if why:
        pytest.skip(why)


def transfer(hosts: Hosts) -> tuple[float, int, int]:
    """NBYTES from b to a. Returns (payload bits/s seen by the receiver, b's link tx bytes, a's link rx bytes)."""
    tx0, rx0 = hosts.link_bytes("b")[1], hosts.link_bytes("a")[0]
    server = hosts.popen("a", [sys.executable, "-c", SERVER, hosts.ip("a"), str(PORT)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert server.stdout is not None
    assert server.stdout.readline().strip() == b"ready", server.communicate(timeout=10)
    client = hosts.run("b", [sys.executable, "-c", CLIENT, hosts.ip("a"), str(PORT), str(NBYTES)], timeout=120)
    assert client.returncode == 0, client.stderr
    out, err = server.communicate(timeout=60)
    assert server.returncode == 0, err
    received, timed, seconds = out.split()
    assert int(received) == NBYTES
    return int(timed) * 8 / float(seconds), hosts.link_bytes("b")[1] - tx0, hosts.link_bytes("a")[0] - rx0


def test_hosts_shape_count_and_clean_up():
    with Hosts(["a", "b"], RATE) as hosts:
        assert hosts.rate_bits_per_s == 200e6
        assert hosts.ip("a").startswith("10.232.0.") and hosts.ip("a") != hosts.ip("b")
        assert hosts.run("a", [sys.executable, "-c", LOOPBACK], timeout=30).stdout.strip() == "ping"
        limited, tx, rx = transfer(hosts)
        stats = hosts.qdisc_stats("b") + hosts.qdisc_stats("a")
        # a process that leaves its group (setsid) and one that stays in it: both must die at exit
        escaper = hosts.popen("a", ["sh", "-c", "setsid sleep 600 & echo $!; exec sleep 600"], stdout=subprocess.PIPE)
        assert escaper.stdout is not None
        stray = int(escaper.stdout.readline())
        deadline = time.monotonic() + 10
        while _session(stray) != stray:  # bounded: wait until it has left the group
            assert time.monotonic() < deadline, "setsid did not take"
            time.sleep(0.01)
        names = hosts.namespaces()
    assert escaper.returncode == -9
    assert not _alive(stray), f"the setsid'd sleep {stray} survived teardown"
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert not [n for n in names if re.search(rf"^{n}\b", left, re.M)], left

    with Hosts(["a", "b"], None) as hosts:
        assert hosts.rate_bits_per_s is None
        unlimited, _, _ = transfer(hosts)

    rate = 200e6
    print(f"\n{RATE}: {limited / 1e6:.1f} Mbit/s payload ({limited / rate:.3f} of the rate); unshaped "
          f"{unlimited / 1e6:.0f} Mbit/s; link bytes tx {tx} rx {rx} for {NBYTES} bytes of payload")
    assert limited <= 1.1 * rate, (limited, stats)
    assert re.search(r"overlimits [1-9]", stats), stats  # tbf held packets back
    assert limited >= 0.25 * rate, (limited, stats)
    assert unlimited >= 2 * 1.1 * rate, (unlimited, limited)
    # both ends of the path count the payload plus headers (GSO super-packets carry one set each)
    assert NBYTES <= tx <= 1.1 * NBYTES and NBYTES <= rx <= 1.1 * NBYTES, (tx, rx)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not yet reaped
    except OSError:
        return False


def _session(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[3])  # after comm: state ppid pgrp session
    except (OSError, ValueError, IndexError):
        return None
