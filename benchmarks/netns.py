"""Several "hosts" on one box for benchmarks: network namespaces on a private, rate-limited bridge.

Each host is a network namespace with loopback up and one veth link (``eth0``, its address in
10.232.0.0/24) to a bridge that lives in a namespace of its own (the switch; its ports are
``p0``, ``p1``, ...). Every link is shaped with ``tc`` tbf in both directions: the egress of the
host's end (host -> switch) and the egress of the switch's end (switch -> host), so a transfer
from one host to another passes two shapers at the same rate, and each host's link carries at
most ``rate`` in each direction, like a NIC on a switch. No address is given to the root
namespace and no namespace has a default route: nothing can leave the box. The addresses are a
different /24 from tests/integration/test_netns.py's (10.231.0.0/24), so both can run at once.

Usage (root and iproute2 needed; ``why_unusable()`` says why not, without side effects beyond a
probe namespace)::

    from benchmarks.netns import Hosts

    with Hosts(["server", "w1", "w2"], rate="400mbit") as hosts:
        srv = hosts.popen("server", [sys.executable, "-m", "ps", "serve",
                                      "--bind", f"tcp://{hosts.ip('server')}:5555", ...])
        w1 = hosts.popen("w1", [sys.executable, "-m", "ps", "work",
                                 "--server", f"tcp://{hosts.ip('server')}:5555", "--shm", "off", ...])
        rx0, tx0 = hosts.link_bytes("server")
        ...
        rx1, tx1 = hosts.link_bytes("server")        # bytes in/out of the server's link
    # here every process group started by popen has been SIGKILLed and reaped, and the
    # namespaces (with their veths and the bridge) are gone, whatever happened inside.

``rate`` is a tc rate (``"400mbit"``, ``"1gbit"``, ``"50mbps"`` = 50 MB/s; tc's units: ``bit`` is
bits, ``bps`` is *bytes* per second) or None for an unshaped link, the same for every host; or a
mapping that gives each host its own (every host named, None for an unshaped one), e.g.
``{"server": "100mbit", "workers": None}`` makes the server's link the bottleneck.
``hosts.rate_of(name)`` is a host's rate in bits per second (None: unshaped);
``hosts.rate_bits_per_s`` is the common one (an error where the hosts' rates differ). Workers of
this project must get ``--shm off``: the namespaces share the box's machine id and /dev/shm, so
they would otherwise take the same-host path around the links.

How the shaper is set (measured on this box: kernel 6.18, 2 cores, veth with TSO/GSO on, BBR;
``python -m benchmarks.netns [--rate R ...] [--burst B]`` reruns it: 40 MB as 20 ZeroMQ PUSH/PULL
messages between two hosts, timed by the receiver):

* ``burst`` (the bucket) defaults to max(64 KiB + one frame, 2 ms at the rate). Smaller buckets
  lose the rate as it grows: at 1gbit a 10 KB bucket gave 0.51-0.55 of it, 32 KB 0.76 (a bucket
  below a 64 KiB GSO super-packet makes tbf split each one in software, and a bucket that holds
  under ~100 us of tokens overflows whenever the qdisc is not run in time); at 200mbit 10 KB
  still gave 0.956. With the default:
  100mbit, 200mbit, 400mbit and 1gbit all gave 0.954-0.957 of the rate (unshaped: 9.5-15.7
  Gbit/s). Over tens of MB the bucket changes the average by well under 1%.
* ``latency`` (how long a packet may queue before tbf drops it) is 20 ms. At 2 ms and 5 ms tbf
  dropped packets (about 5,000 and 500 per 40 MB at the sender's own link; at 5 ms also on the switch port
  when two hosts send to one) though the rate held; at 20 ms none. The queue a bulk transfer
  builds stays far below the limit (a UDP ping beside it: 4-7 ms round trip at 200mbit, 0.2 ms
  idle), as BBR and TCP small queues keep it short; a loss-based sender (cubic) would fill it to 20 ms
  (untested: see the next point).
* tbf counts layer-2 bytes (Ethernet header included, per segment of a GSO packet): TCP payload
  moves at 1448/1514 = 0.956 of ``rate``, which is what a real link of that rate does too.
* ``link_bytes`` reads the host end's veth counters (``ip -s link``): layer-2 bytes without the
  FCS, a GSO super-packet counted once with one set of headers, so 40 MB of payload shows as
  about 40.04-40.8 MB, a little below what a wire would carry.
* The namespaces inherit the box's congestion control (BBR here); setting
  net.ipv4.tcp_congestion_control inside one is refused (EPERM) on this box.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

SUBNET = "10.232.0"  # /24; host i gets SUBNET.(FIRST_HOST + i)
FIRST_HOST = 11
MAX_HOSTS = 200
HOST_DEV = "eth0"  # the host's end of its link, inside the host's namespace
LATENCY = "20ms"  # tbf: longest a packet may queue before it is dropped
MIN_BURST = 65536 + 1514  # a whole GSO super-packet (64 KiB) plus a frame's headers
BURST_S = 0.002  # ... or 2 ms at the rate, whichever is larger
KILL_WAIT_S = 10.0

_RATE_UNITS = {  # tc(8): "bit" units are bits per second, "bps" units are BYTES per second
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30, "tibps": 8 * 2**40,
}
_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")


def parse_rate(rate: str) -> float:
    """A tc rate string in bits per second (``"400mbit"`` -> 4e8, ``"50mbps"`` -> 4e8). A unit is
    required: tc reads a bare number as bits per second, which is too easy to get wrong."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]+)\s*", rate)
    if not m or m.group(2).lower() not in _RATE_UNITS:
        raise ValueError(f"not a tc rate with a unit (e.g. '400mbit', '1gbit', '50mbps'): {rate!r}")
    bits = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is below 8 kbit/s")
    return bits


def _sh(argv: Sequence[str], timeout: float = 15) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _ok(*argv: str) -> str:
    r = _sh(argv)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed (rc={r.returncode}): {r.stderr.strip()}")
    return r.stdout


def why_unusable() -> str | None:
    """Why this box cannot build Hosts (None: it can): root, iproute2 and tc, namespaces, veth, bridge, tbf."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root (creates network namespaces, veth pairs, a bridge and tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2's `{tool}`"
    name = f"lcbprobe{secrets.token_hex(4)}"
    r = _sh(["ip", "netns", "add", name])
    if r.returncode != 0:
        return f"`ip netns add` does not work here: {r.stderr.strip()}"
    try:
        for argv, what in ((["link", "add", "pb", "type", "bridge"], "a bridge"),
                           (["link", "add", "pa", "type", "veth", "peer", "name", "pz"], "a veth pair")):
            r = _sh(["ip", "-n", name, *argv])
            if r.returncode != 0:
                return f"cannot create {what} in a namespace: {r.stderr.strip()}"
        r = _sh(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "pa", "root", "tbf",
                 "rate", "1mbit", "burst", "10kb", "latency", "10ms"])
        if r.returncode != 0:
            return f"tc qdisc tbf unavailable (CONFIG_NET_SCH_TBF): {r.stderr.strip()}"
    finally:
        r = _sh(["ip", "netns", "del", name])
    if r.returncode != 0:
        return f"`ip netns del` does not work here: {r.stderr.strip()}"
    return None


class Hosts:
    """Several "hosts" on one box: each a network namespace with one veth link to a bridge (the
    switch, in a namespace of its own). Every host's link is rate-limited with tc tbf in BOTH
    directions (egress of the host's end and egress of the bridge's end) at ``rate`` (e.g.
    ``"400mbit"``); ``rate=None``: unlimited; a mapping {host name: rate or None} (every host
    named): each host's own. ``burst`` overrides the bucket of every shaped link (a tc size,
    e.g. ``"128kb"``; default: per link, from its rate). Namespaces are named
    ``<prefix><6 random hex><name>`` (switch: ``...sw`` is reserved), so instances never collide.

    Use as a context manager: ``__enter__`` builds everything (and tears down what it built if a
    step fails); ``__exit__`` always SIGKILLs every process group started with ``popen``/``run``
    (and any process still inside the namespaces), reaps them, then deletes the namespaces."""

    def __init__(self, names: list[str], rate: str | None | Mapping[str, str | None], *, burst: str | None = None,
                 prefix: str = "lcb") -> None:
        names = list(names)
        if not names or len(names) > MAX_HOSTS:
            raise ValueError(f"between 1 and {MAX_HOSTS} hosts, not {len(names)}")
        bad = [n for n in names if not _NAME.fullmatch(n) or n == "sw"]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"host names must be unique, [A-Za-z0-9_-]{{1,32}} and not 'sw': {names}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,11}", prefix):
            raise ValueError(f"prefix must be [a-z][a-z0-9]{{0,11}}: {prefix!r}")
        if isinstance(rate, Mapping):
            if set(rate) != set(names):
                raise ValueError(f"a rate per host must name every host, and only them: {sorted(rate)} vs {names}")
            rates = {n: rate[n] for n in names}
        else:
            rates = {n: rate for n in names}
        self._rates = {n: None if r is None else parse_rate(r) for n, r in rates.items()}
        if burst is not None and all(r is None for r in self._rates.values()):
            raise ValueError("burst without a rate")
        self.names = names
        self.tag = f"{prefix}{secrets.token_hex(3)}"
        self.switch = f"{self.tag}sw"
        self._bursts = {n: None if r is None else (burst if burst is not None else f"{self.default_burst_bytes(n)}b")
                        for n, r in self._rates.items()}
        uniform = set(self._bursts.values())
        self.burst = uniform.pop() if len(uniform) == 1 else None  # the common bucket (None: unshaped or several)
        self._ns = {n: f"{self.tag}{n}" for n in names}
        self._port = {n: f"p{i}" for i, n in enumerate(names)}
        self._ip = {n: f"{SUBNET}.{FIRST_HOST + i}" for i, n in enumerate(names)}
        self._created: list[str] = []  # namespaces, deleted in reverse
        self._children: list[subprocess.Popen] = []
        self._entered = False

    # ------------------------------------------------------------------ properties
    @property
    def rate_bits_per_s(self) -> float | None:
        """The configured rate of every link, each direction, in bits per second (None: unshaped).
        Hosts given different rates have no such figure (ValueError): see ``rate_of``."""
        rates = set(self._rates.values())
        if len(rates) != 1:
            raise ValueError("the hosts' links have different rates: use rate_of(name)")
        return rates.pop()

    def rate_of(self, name: str) -> float | None:
        """The configured rate of the host's link, each direction, in bits per second (None: unshaped)."""
        return self._rates[name]

    def burst_of(self, name: str) -> str | None:
        """The tc bucket of the host's link (None: unshaped)."""
        return self._bursts[name]

    def default_burst_bytes(self, name: str | None = None) -> int:
        """The default bucket of a link at the host's rate (``name`` None: the common rate)."""
        bits = self.rate_bits_per_s if name is None else self._rates[name]
        assert bits is not None
        return max(MIN_BURST, int(bits / 8 * BURST_S))

    def ip(self, name: str) -> str:
        """The host's address (inside its namespace only), e.g. ``"10.232.0.11"``."""
        return self._ip[name]

    def namespace(self, name: str) -> str:
        """The host's network namespace (``ip netns exec <it> ...``)."""
        return self._ns[name]

    def namespaces(self) -> list[str]:
        """Every namespace this instance uses: the switch's and the hosts'."""
        return [self.switch, *self._ns.values()]

    # ------------------------------------------------------------------ build / teardown
    def __enter__(self) -> Hosts:
        if self._entered:
            raise RuntimeError("a Hosts instance is entered once")
        self._entered = True
        try:
            self._build()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        problems = self._teardown()
        if problems and exc[0] is None:
            raise RuntimeError(f"netns teardown: {problems}")

    def _add_ns(self, ns: str) -> None:
        _ok("ip", "netns", "add", ns)
        self._created.append(ns)
        _ok("ip", "-n", ns, "link", "set", "lo", "up")

    def _sysctl(self, ns: str, key: str, value: str) -> None:
        # best effort (a kernel without IPv6 has no such keys): only keeps stray IPv6 chatter off the links
        _sh(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}"])

    def _build(self) -> None:
        self._add_ns(self.switch)
        self._sysctl(self.switch, "net.ipv6.conf.all.disable_ipv6", "1")
        self._sysctl(self.switch, "net.ipv6.conf.default.disable_ipv6", "1")
        _ok("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ok("ip", "-n", self.switch, "link", "set", "br0", "up")
        for name in self.names:
            ns, port = self._ns[name], self._port[name]
            self._add_ns(ns)
            _ok("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", HOST_DEV, "netns", ns)
            self._sysctl(ns, f"net.ipv6.conf.{HOST_DEV}.disable_ipv6", "1")
            _ok("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ok("ip", "-n", ns, "addr", "add", f"{self._ip[name]}/24", "dev", HOST_DEV)
            _ok("ip", "-n", ns, "link", "set", HOST_DEV, "up")
            bits, bucket = self._rates[name], self._bursts[name]
            if bits is not None and bucket is not None:
                for where, dev in ((ns, HOST_DEV), (self.switch, port)):
                    _ok("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                        "rate", f"{int(bits)}bit", "burst", bucket, "latency", LATENCY)

    def _teardown(self) -> list[str]:
        problems: list[str] = []
        for p in self._children:
            _killpg(p)
        deadline = time.monotonic() + KILL_WAIT_S
        for p in self._children:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                problems.append(f"pid {p.pid} did not die within {KILL_WAIT_S} s of SIGKILL")
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
        for ns in reversed(self._created):
            problems += _kill_strays(ns)
            r = _sh(["ip", "netns", "del", ns])
            if r.returncode != 0:
                problems.append(f"ip netns del {ns}: {r.stderr.strip()}")
        self._created.clear()
        left = [n for n in _netns_list() if n in self.namespaces()]
        if left:
            problems.append(f"namespaces left behind: {left}")
        return problems

    # ------------------------------------------------------------------ processes
    def popen(self, name: str, argv: list[str], *, env: Mapping[str, str] | None = None, stdout=None, stderr=None,
              cwd: str | os.PathLike | None = None) -> subprocess.Popen:
        """``argv`` inside the host's namespace (``ip netns exec <ns> argv``: the same pid, the
        namespace's /sys), stdin from /dev/null, in a session of its own so that teardown can kill
        its whole process group."""
        if not self._created:
            raise RuntimeError("Hosts is not entered (use `with Hosts(...) as hosts:`)")
        p = subprocess.Popen(["ip", "netns", "exec", self._ns[name], *argv], env=None if env is None else dict(env),
                             stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, cwd=cwd, start_new_session=True)
        self._children.append(p)
        return p

    def run(self, name: str, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Run ``argv`` in the host's namespace to completion, output captured as text. Past
        ``timeout`` seconds its process group is killed and subprocess.TimeoutExpired raised."""
        p = self.popen(name, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(p)
            p.communicate(timeout=KILL_WAIT_S)
            raise
        return subprocess.CompletedProcess(argv, p.returncode, out.decode(errors="replace"),
                                           err.decode(errors="replace"))

    # ------------------------------------------------------------------ counters
    def link_bytes(self, name: str) -> tuple[int, int]:
        """(rx, tx) bytes of the host's end of its link (``eth0`` in its namespace), from ``ip -s link``."""
        out = _ok("ip", "-n", self._ns[name], "-j", "-s", "link", "show", "dev", HOST_DEV)
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def qdisc_stats(self, name: str) -> str:
        """``tc -s qdisc`` of both ends of the host's link (host end first), for diagnostics."""
        return "\n".join(_sh(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev]).stdout
                         for ns, dev in ((self._ns[name], HOST_DEV), (self.switch, self._port[name])))


def _netns_list() -> list[str]:
    return [line.split()[0] for line in _sh(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def _killpg(p: subprocess.Popen) -> None:
    """SIGKILL the child's process group (start_new_session: its id is the child's pid). The group
    id stays reserved while the child is unreaped or any member lives, so it cannot name another's group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)


def _kill_strays(ns: str) -> list[str]:
    """SIGKILL every process still inside namespace ``ns`` (one that left its group with setsid):
    only processes we started can be in a namespace we created under a random name. Each pid is
    pinned with a pidfd and its network namespace checked again before the signal, so a reused
    pid is never hit. Returns problems."""
    r = _sh(["ip", "netns", "pids", ns])
    if r.returncode != 0:
        return []
    try:
        want = os.stat(f"/run/netns/{ns}").st_ino
    except OSError:
        return []
    fds = []
    for pid in (int(x) for x in r.stdout.split() if x.isdigit()):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            same = os.stat(f"/proc/{pid}/ns/net").st_ino == want
        except OSError:
            same = False
        if same:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            fds.append((pid, fd))
        else:
            os.close(fd)
    problems = []
    deadline = time.monotonic() + KILL_WAIT_S
    for pid, fd in fds:  # not our children (reparented): wait until /proc says they are gone
        while os.path.exists(f"/proc/{pid}/ns/net") and _same_process(fd) and time.monotonic() < deadline:
            time.sleep(0.01)  # polling interval of a bounded wait
        if _same_process(fd) and os.path.exists(f"/proc/{pid}/ns/net"):
            problems.append(f"pid {pid} in {ns} survived SIGKILL")
        os.close(fd)
    return problems


def _same_process(fd: int) -> bool:
    """True while the process behind pidfd ``fd`` has not exited (signal 0 through the pidfd)."""
    try:
        signal.pidfd_send_signal(fd, 0)
        return True
    except ProcessLookupError:
        return False
    except OSError:
        return True


# ---------------------------------------------------------------------- measurement (python -m benchmarks.netns)

_ZMQ_SINK = r"""
import sys, time, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.PULL); s.bind(sys.argv[1]); print("ready", flush=True)
n, total = int(sys.argv[2]), 0
first = s.recv(copy=False); t0 = time.perf_counter(); total += len(first)
for _ in range(n - 1):
    total += len(s.recv(copy=False))
print(total - len(first), time.perf_counter() - t0, flush=True)
"""
_ZMQ_SOURCE = r"""
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.PUSH); s.connect(sys.argv[1])
n, size = int(sys.argv[2]), int(sys.argv[3]); buf = bytes(size)
for _ in range(n):
    s.send(buf, copy=False)
s.close(linger=-1); ctx.term()
"""


def zmq_throughput(hosts: Hosts, src: str, dst: str, nbytes: int, messages: int = 20,
                   timeout: float = 120) -> tuple[float, int, int]:
    """Move ``nbytes`` from ``src`` to ``dst`` as ``messages`` ZeroMQ PUSH/PULL messages over TCP.
    Returns (payload bits per second measured by the receiver from the end of its first message to
    the end of its last, bytes on src's link tx, bytes on dst's link rx)."""
    endpoint = f"tcp://{hosts.ip(dst)}:5601"
    size = nbytes // messages
    rx0, tx0 = hosts.link_bytes(dst)[0], hosts.link_bytes(src)[1]
    sink = hosts.popen(dst, [sys.executable, "-c", _ZMQ_SINK, endpoint, str(messages)], stdout=subprocess.PIPE)
    assert sink.stdout is not None
    if sink.stdout.readline().strip() != b"ready":
        raise RuntimeError("zmq sink did not start")
    hosts.run(src, [sys.executable, "-c", _ZMQ_SOURCE, endpoint, str(messages), str(size)], timeout=timeout)
    out, _ = sink.communicate(timeout=timeout)
    moved, seconds = out.split()
    return (int(moved) * 8 / float(seconds), hosts.link_bytes(src)[1] - tx0, hosts.link_bytes(dst)[0] - rx0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.netns",
                                 description="Measure ZeroMQ-over-TCP throughput between two shaped netns hosts.")
    ap.add_argument("--rate", action="append", default=None, help="tc rate (repeatable); 'none': unshaped")
    ap.add_argument("--burst", default=None, help="tc burst (default: max(64 KiB + headers, 2 ms at the rate))")
    ap.add_argument("--mb", type=float, default=40.0, help="megabytes moved per measurement")
    ap.add_argument("--messages", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    why = why_unusable()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    for rate in a.rate or ["100mbit", "400mbit", "1gbit", "none"]:
        r = None if rate == "none" else rate
        with Hosts(["a", "b"], r, burst=a.burst) as hosts:
            for _ in range(a.repeat):
                bps, tx, rx = zmq_throughput(hosts, "a", "b", int(a.mb * 1e6), a.messages)
                ratio = "" if hosts.rate_bits_per_s is None else f"  {bps / hosts.rate_bits_per_s:.3f} of the rate"
                print(f"rate {rate:>9} burst {hosts.burst}: {bps / 1e6:8.1f} Mbit/s payload{ratio}"
                      f"  (link bytes tx {tx} rx {rx})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
