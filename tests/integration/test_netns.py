"""Several "hosts" on one box: a server and workers each in its own network namespace, joined by
veth pairs to a bridge that lives in a namespace of its own (the switch). PROTOCOL_NOTES §1.5, §6.

* ``test_link_cut_...``: a worker's link is cut (its veth set down, both ends). No FIN, no RST: only
  the liveness timeout can tell; the server writes it off, training goes on with the others, and
  when the link comes back the worker reconnects and joins again by itself.
* ``test_impaired_link[...]``: training over a rate-limited (tbf), lossy (htb + a classic-BPF
  random classifier feeding a drop-everything pfifo) or delayed (netem) link; each part is skipped
  with the kernel capability it lacks (this box has no sch_netem, no iptables/nft).

Everything lives in 10.231.0.0/24 inside namespaces created here (random suffix per test, so runs
in parallel don't collide); no address is given to the root namespace and no namespace has a
default route, so no packet can leave. Teardown kills every process group, then deletes the
namespaces (which destroys their veths and the bridge); it runs whatever happens.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time

import pytest

from tests.integration.util import read_events, wait_events, wait_line

pytestmark = [pytest.mark.slow, pytest.mark.netns]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER_IP = "10.231.0.1"
PORT = 5555  # the server's namespace is ours alone: a fixed port cannot collide
LIVENESS_S = 2.0
HEARTBEAT_S = 0.25
D = 20000  # 80 KB float32 vectors: every job carries one iterate, every reply one gradient
SETTLED = ("applied", "dropped", "lost", "failed", "cancelled", "rejected")

RATE = "8mbit"  # 80 KB at 8 Mbit/s: 80 ms per message and direction
LOSS = 0.03  # fraction of packets (skbs) dropped in each direction
DELAY_MS = 50  # one-way
SURVIVORS_S = 30  # bound: the two survivors each get 5 replies applied after the cut


def sh(*cmd: str, timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def run_ok(*cmd: str) -> str:
    r = sh(*cmd)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: rc={r.returncode} {r.stderr.strip()}")
    return r.stdout


@functools.lru_cache(maxsize=None)
def netns_unusable() -> str | None:
    """Why this box cannot run these tests (None: it can). Probes by creating and deleting a namespace."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root (creates network namespaces, veth pairs and a bridge)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    name = f"lcprobe{secrets.token_hex(4)}"
    r = sh("ip", "netns", "add", name)
    if r.returncode != 0:
        return f"`ip netns add` does not work here: {r.stderr.strip()}"
    try:
        r = sh("ip", "-n", name, "link", "add", "pb", "type", "bridge")
        if r.returncode != 0:
            return f"cannot create a bridge in a namespace: {r.stderr.strip()}"
        r = sh("ip", "-n", name, "link", "add", "pa", "type", "veth", "peer", "name", "pz")
        if r.returncode != 0:
            return f"cannot create a veth pair in a namespace: {r.stderr.strip()}"
    finally:
        r = sh("ip", "netns", "del", name)
    if r.returncode != 0:
        return f"`ip netns del` does not work here: {r.stderr.strip()}"
    return None


class Lab:
    """A switch namespace with a bridge; hosts (server, workers) in namespaces of their own, each
    joined to the bridge by a veth pair: ``eth0`` in the host, ``p<i>`` on the switch."""

    def __init__(self, tmp_path) -> None:
        self.tag = secrets.token_hex(3)
        self.tmp = tmp_path
        self.switch = f"lc{self.tag}sw"
        self.namespaces: list[str] = []  # created, deleted in reverse at teardown
        self.hosts: dict[str, tuple[str, str, str]] = {}  # host -> (namespace, switch port, address)
        self.children: list[subprocess.Popen] = []
        self.impairments: dict[str, str] = {}  # host -> what was applied

    # ------------------------------------------------------------------ topology
    def _add_ns(self, name: str) -> None:
        run_ok("ip", "netns", "add", name)
        self.namespaces.append(name)
        run_ok("ip", "-n", name, "link", "set", "lo", "up")

    def build(self, hosts: list[str]) -> None:
        self._add_ns(self.switch)
        run_ok("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run_ok("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(hosts):
            ns, port, addr = f"lc{self.tag}{host}", f"p{i}", f"10.231.0.{i + 1}"
            self._add_ns(ns)
            run_ok("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            run_ok("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            run_ok("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            run_ok("ip", "-n", ns, "link", "set", "eth0", "up")
            self.hosts[host] = (ns, port, addr)
        assert self.hosts[hosts[0]][2] == SERVER_IP

    def set_link(self, host: str, up: bool) -> None:
        """Both ends of the host's veth down (or up again)."""
        ns, port, _ = self.hosts[host]
        state = "up" if up else "down"
        run_ok("ip", "-n", self.switch, "link", "set", port, state)
        run_ok("ip", "-n", ns, "link", "set", "eth0", state)

    def _both_ends(self, host: str) -> list[tuple[str, str]]:
        ns, port, _ = self.hosts[host]
        return [(self.switch, port), (ns, "eth0")]  # egress towards the host, egress from the host

    # ------------------------------------------------------------------ impairments
    def impair(self, host: str, kind: str) -> str | None:
        """Impair the host's link in both directions. Returns None, or why this box cannot."""
        for ns, dev in self._both_ends(host):
            why = self._impair_one(ns, dev, kind)
            if why is not None:
                for n, d in self._both_ends(host):
                    sh("ip", "netns", "exec", n, "tc", "qdisc", "del", "dev", d, "root")
                return why
        self.impairments[host] = {"rate": f"tbf rate {RATE}", "loss": f"{LOSS:.0%} random loss (cls_bpf)",
                                  "delay": f"netem delay {DELAY_MS} ms"}[kind]
        return None

    @staticmethod
    def _impair_one(ns: str, dev: str, kind: str) -> str | None:
        tc = ("ip", "netns", "exec", ns, "tc")
        if kind == "rate":
            cmds = [(*tc, "qdisc", "add", "dev", dev, "root", "tbf", "rate", RATE, "burst", "10kb", "latency", "400ms")]
            need = "tc qdisc tbf (CONFIG_NET_SCH_TBF)"
        elif kind == "delay":
            cmds = [(*tc, "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{DELAY_MS}ms")]
            need = "tc qdisc netem (CONFIG_NET_SCH_NETEM)"
        elif kind == "loss":
            # No iptables/nft (`statistic` match) and no netem `loss` here: an htb root whose default
            # class passes everything, and a classic-BPF classifier (ld rand: SKF_AD_RANDOM) sending a
            # random LOSS fraction of the packets to a class whose leaf is a pfifo of length 0.
            threshold = int((1 - LOSS) * 2**32)
            bytecode = f"4,32 0 0 {2**32 - 0x1000 + 56},53 0 1 {threshold},6 0 0 {0x10002},6 0 0 0"
            cmds = [(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"),
                    (*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", "10gbit"),
                    (*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:2", "htb", "rate", "10gbit"),
                    (*tc, "qdisc", "add", "dev", dev, "parent", "1:2", "handle", "20:", "pfifo", "limit", "0"),
                    (*tc, "filter", "add", "dev", dev, "parent", "1:", "bpf", "bytecode", bytecode)]
            need = "tc htb + pfifo + cls_bpf with classic BPF (CONFIG_NET_SCH_HTB, CONFIG_NET_CLS_BPF)"
        else:
            raise ValueError(kind)
        if shutil.which("tc") is None:
            return "iproute2's `tc` is not installed"
        for cmd in cmds:
            r = sh(*cmd)
            if r.returncode != 0:
                return f"{need} unavailable: `{' '.join(cmd[4:])}` says {r.stderr.strip()!r}"
        return None

    def qdisc_stats(self, host: str) -> str:
        return "\n".join(sh("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev).stdout
                         for ns, dev in self._both_ends(host))

    def dropped(self, host: str, handle: str) -> int:
        """Packets dropped by the qdisc ``handle`` on both ends of the host's link."""
        total = 0
        for block in self.qdisc_stats(host).split("qdisc ")[1:]:
            if block.split()[1] == handle:
                total += int(re.search(r"dropped (\d+)", block).group(1))
        return total

    # ------------------------------------------------------------------ processes
    def start(self, host: str, *args: str) -> subprocess.Popen:
        """``python -m ps ARGS`` inside the host's namespace, in a session of its own."""
        ns = self.hosts[host][0]
        err = open(self.tmp / f"{host}.stderr", "wb")
        try:
            p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "ps", *args], cwd=REPO,
                                 env=dict(os.environ, PYTHONUNBUFFERED="1"), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        finally:
            err.close()
        self.children.append(p)
        return p

    def stderr_tail(self, host: str, n: int = 1500) -> str:
        try:
            return (self.tmp / f"{host}.stderr").read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def reap(self) -> None:
        """SIGTERM every child's process group, then SIGKILL what is left; wait for all."""
        for p in self.children:
            if p.poll() is None:
                _killpg(p, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.children:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _killpg(p, signal.SIGKILL)
                p.wait(timeout=5)
            _killpg(p, signal.SIGKILL)  # anything the child left behind in its group
            if p.stdout:
                p.stdout.close()

    def teardown(self) -> list[str]:
        """Delete every namespace created (their veths and the bridge go with them). Returns failures."""
        problems = []
        for ns in reversed(self.namespaces):
            r = sh("ip", "netns", "del", ns)
            if r.returncode != 0:
                problems.append(f"ip netns del {ns}: {r.stderr.strip()}")
        left = [n for n in sh("ip", "netns", "list").stdout.split() if n.startswith(f"lc{self.tag}")]
        if left:
            problems.append(f"namespaces left behind: {left}")
        return problems


def _killpg(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # start_new_session: the group id is the child's pid
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture
def lab(tmp_path):
    why = netns_unusable()
    if why:
        pytest.skip(why)
    lab = Lab(tmp_path)
    try:
        yield lab
    finally:
        try:
            lab.reap()
        finally:
            problems = lab.teardown()
        assert not problems, problems


# --------------------------------------------------------------------------- helpers

def serve_args(events: str, out: str) -> list[str]:
    return ["serve", "--bind", f"tcp://{SERVER_IP}:{PORT}", "--problem", "quadratic", "--problem-opt", f"d={D}",
            "--algorithm", "asgd", "--set", "lr=0.1", "--batch-size", "1", "--max-time", "180",
            "--liveness-timeout", str(LIVENESS_S), "--heartbeat-interval", str(HEARTBEAT_S), "--min-workers", "3",
            "--eval-every", "100", "--events", events, "--out", out, "--log-level", "warning",
            "--insecure"]  # a private namespace network; CurveZMQ has its own test (test_security.py)


def start_workers(lab: Lab, delays: dict[str, float]) -> dict[str, subprocess.Popen]:
    # --shm off: the namespaces stand for other hosts, but they share this host's machine id and
    # /dev/shm, so the workers would otherwise take the same-host path around the shaped links.
    return {w: lab.start(w, "work", "--server", f"tcp://{SERVER_IP}:{PORT}", "--worker-id", w, "--delay", str(d),
                         "--shm", "off", "--log-level", "info") for w, d in delays.items()}


def wait_file(path, pattern: str, timeout: float, poll_s: float = 0.05) -> re.Match:
    """Poll a (log) file until ``pattern`` matches its content; fail after ``timeout`` seconds."""
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_bytes().decode(errors="replace") if path.exists() else ""
        m = rx.search(text)
        if m:
            return m
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {pattern!r} in {path.name} within {timeout} s: {text[-500:]!r}")
        time.sleep(poll_s)  # polling interval of a bounded wait, not synchronisation


def applied_by(events, wid):
    return sum(1 for e in events if e["ev"] == "applied" and e["worker_id"] == wid)


def story(events, wid, since=0):
    keep = ("joined", "ready", "lost", "left", "late", "worker_error", "rejected")
    return [(e["ev"], e.get("job_id"), e.get("reason", e.get("was"))) for e in events[since:]
            if e.get("worker_id") == wid and e["ev"] in keep][:20]


def survivors_report(lab: Lab, events, since: int, err: Exception) -> str:
    """Why the survivors did not get 5 replies each applied after the cut: per worker, what was
    applied since, its story since, its link's qdisc counters and its stderr's tail."""
    later = events[since:]
    lines = [f"{err}; {len(later)} events since w1 was declared dead; applied since, per worker: "
             f"{ {w: applied_by(later, w) for w in ('w1', 'w2', 'w3')} }"]
    for w in ("w2", "w3"):
        if applied_by(later, w) < 5:
            lines.append(f"{w} ({lab.impairments.get(w, 'no impairment')}): story {story(events, w, since)}; "
                         f"last events {[(e['ev'], e.get('job_id')) for e in later if e.get('worker_id') == w][-8:]}; "
                         f"qdisc {lab.qdisc_stats(w)!r}; stderr tail {lab.stderr_tail(w, 800)!r}")
    return "\n".join(lines)


def round_trips(events, wid):
    """Seconds from issue to apply of each of ``wid``'s applied jobs (server clock)."""
    issued = {e["job_id"]: e["t"] for e in events if e["ev"] == "issued"}
    return [e["t"] - issued[e["job_id"]] for e in events
            if e["ev"] == "applied" and e["worker_id"] == wid and e["job_id"] in issued]


def stop_and_check_accounting(server: subprocess.Popen, events: str, out: str) -> dict:
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=30) == 0
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    c = summary["counters"]
    assert c["issued"] == c["applied"] + c["dropped"] + c["lost"] + c["failed"] + c["cancelled"] + c["rejected"] \
        + summary["outstanding"]
    ev = read_events(events)
    issued = {e["job_id"] for e in ev if e["ev"] == "issued"}
    settled = [e["job_id"] for e in ev if e["ev"] in SETTLED]
    assert len(settled) == len(set(settled)), "a job was settled twice"
    assert len(issued) == c["issued"] and len(issued - set(settled)) == summary["outstanding"]
    assert summary["evaluations"][-1]["loss"] < summary["evaluations"][0]["loss"]
    return summary


# --------------------------------------------------------------------------- tests

def test_link_cut_worker_is_declared_dead_and_rejoins_when_the_link_is_back(lab, tmp_path):
    events, out = str(tmp_path / "events.jsonl"), str(tmp_path / "out")
    lab.build(["server", "w1", "w2", "w3"])
    # The survivors get the impairments this box can do (the cut worker's link stays clean, so
    # the figures measured on it are the protocol's, not the impairment's).
    skipped = {kind: lab.impair(w, kind) for w, kind in (("w2", "rate"), ("w3", "loss"))}
    server = lab.start("server", *serve_args(events, out))
    wait_line(server, r"listening on", timeout=60)
    workers = start_workers(lab, {"w1": 0.02, "w2": 0.02, "w3": 0.02})
    try:
        wait_events(events, lambda ev: all(applied_by(ev, w) >= 5 for w in workers), timeout=60)
    except TimeoutError as e:
        raise AssertionError(f"{e}; stderr: {[lab.stderr_tail(h, 400) for h in lab.hosts]}") from e

    lab.set_link("w1", up=False)
    cut_at = time.monotonic()
    try:
        left = wait_events(events, lambda ev: [e for e in ev if e["ev"] == "left" and e["worker_id"] == "w1"],
                           timeout=LIVENESS_S + 5, poll_s=0.01)
        detected_s = time.monotonic() - cut_at
        ev = read_events(events)
        assert left[0]["reason"] == "timeout", story(ev, "w1")
        assert detected_s <= LIVENESS_S + 1.0, f"cut-off worker declared dead {detected_s:.2f} s after the cut"
        old_jobs = {e["job_id"] for e in ev if e["ev"] == "lost" and e["worker_id"] == "w1"}
        assert all(e["reason"] == "timeout" for e in ev if e["ev"] == "lost" and e["worker_id"] == "w1")
        assert len(old_jobs) == left[0]["lost"] == 1, story(ev, "w1")  # credit 1: the job it held
        n_dead = ev.index(left[0])
        # training goes on with the other two, over their impaired links
        try:
            wait_events(events, lambda ev: applied_by(ev[n_dead:], "w2") >= 5 and applied_by(ev[n_dead:], "w3") >= 5,
                        timeout=SURVIVORS_S)
        except TimeoutError as e:
            raise AssertionError(survivors_report(lab, read_events(events), n_dead, e)) from e
        survivors_s = time.monotonic() - cut_at
        # the cut-off worker notices the silence by itself and keeps trying to reconnect
        wait_file(tmp_path / "w1.stderr", r"server silent for .* reconnecting", timeout=LIVENESS_S + 5)
        worker_noticed_s = time.monotonic() - cut_at
        assert workers["w1"].poll() is None, lab.stderr_tail("w1")
    finally:
        lab.set_link("w1", up=True)
    up_at = time.monotonic()

    def back(ev):
        later = ev[n_dead + 1:]
        joined = [i for i, e in enumerate(later) if e["ev"] == "joined" and e["worker_id"] == "w1"]
        if not joined:
            return False
        new = [e for e in later[joined[0]:] if e["ev"] == "applied" and e["worker_id"] == "w1"
               and e["job_id"] not in old_jobs]
        return bool(new)

    try:
        wait_events(events, back, timeout=30, poll_s=0.01)
    except TimeoutError as e:
        raise AssertionError(f"w1 did not rejoin after the link came back: {story(read_events(events), 'w1')}; "
                             f"its stderr: {lab.stderr_tail('w1')}") from e
    rejoined_s = time.monotonic() - up_at
    ev = read_events(events)
    assert not [e for e in ev if e["ev"] == "left" and e["worker_id"] in ("w2", "w3")], \
        "a worker on an impaired but working link was declared dead"
    assert not [e for e in ev if e["ev"] in ("applied", "dropped") and e["job_id"] in old_jobs]
    summary = stop_and_check_accounting(server, events, out)
    c = summary["counters"]
    assert c["workers_lost"] == 1 and c["workers_joined"] == 4
    applied_impaired = {w: len(round_trips(ev, w)) for w in ("w2", "w3")}
    print(f"\nnetns link cut: declared dead {detected_s:.2f} s after link down (liveness timeout {LIVENESS_S} s); "
          f"the survivors had 5 replies each applied since {survivors_s:.2f} s after the cut; "
          f"the worker noticed the silence after {worker_noticed_s:.2f} s; "
          f"rejoined and contributing {rejoined_s:.2f} s after link up; impairments "
          f"{ {w: lab.impairments.get(w) or f'none ({skipped[k]})' for w, k in (('w2', 'rate'), ('w3', 'loss'))} }; "
          f"applied over them {applied_impaired}; late {c['late']}, lost {c['lost']}")


@pytest.mark.parametrize("kind", ["rate", "loss", "delay"])
def test_impaired_link(lab, tmp_path, kind):
    """Training proceeds over an impaired link and the impairment measurably acts on it."""
    events, out = str(tmp_path / "events.jsonl"), str(tmp_path / "out")
    lab.build(["server", "w1", "w2", "w3"])
    why = lab.impair("w2", kind)
    if why:
        pytest.skip(f"{kind} impairment: {why}")
    server = lab.start("server", *serve_args(events, out))
    wait_line(server, r"listening on", timeout=60)
    start_workers(lab, {"w1": 0.02, "w2": 0.02, "w3": 0.02})
    try:
        wait_events(events, lambda ev: applied_by(ev, "w2") >= 30 and applied_by(ev, "w1") >= 30, timeout=60)
    except TimeoutError as e:
        raise AssertionError(f"{e}; {lab.qdisc_stats('w2')}") from e
    ev = read_events(events)
    assert not [e for e in ev if e["ev"] == "left"], story(ev, "w2")
    clean, impaired = statistics.median(round_trips(ev, "w1")), statistics.median(round_trips(ev, "w2"))
    stats = lab.qdisc_stats("w2")
    if kind == "rate":
        # a job (80 KB down) and its reply (80 KB up), each through an 8 Mbit/s shaper with a 10 KB
        # bucket: (80 - 10) KB / (1 MB/s) = 70 ms per direction at least, on top of the 20 ms job
        assert impaired >= 0.14 and clean < 0.1, (impaired, clean, stats)
        assert re.search(r"overlimits [1-9]", stats), stats
    elif kind == "delay":
        # one DELAY_MS each way on top of the job
        assert impaired >= 2 * DELAY_MS / 1000 and clean < 2 * DELAY_MS / 1000, (impaired, clean, stats)
    else:
        assert lab.dropped("w2", "20:") > 0, stats
    summary = stop_and_check_accounting(server, events, out)
    print(f"\n{kind}: {lab.impairments['w2']}: median issue-to-apply {impaired * 1000:.0f} ms vs {clean * 1000:.0f} ms "
          f"on a clean link; packets dropped {lab.dropped('w2', '20:') if kind == 'loss' else 0}; "
          f"applied {summary['counters']['applied']}, lost {summary['counters']['lost']}")
