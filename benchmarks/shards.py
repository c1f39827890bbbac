"""Sharding where the link is the bottleneck (issue 17): updates/s of the unsharded server and of
``serve --shards S`` for each S, every server-side process in a network namespace of its own
whose link is rate-limited (benchmarks/netns.py ``Hosts``, tc tbf both directions).

    python -m benchmarks.shards [--d 10000000] [--rate 100mbit] [--shards 1,2,4] [--workers 2]
                                [--credit 2] [--seconds 60] [--warmup 15] [--out benchmarks/RESULTS-shards.md]

Each configuration gets fresh hosts (root, iproute2 and tc needed; the namespaces, the bridge and
every process are gone after it, whatever happened):

* unsharded: host ``server`` (``serve``, no ``--shards``) at ``--rate``, host ``workers`` unshaped;
* S shards: host ``coord`` (``serve --shards S --local-shards 0``; its socket carries headers only)
  at ``--rate``, hosts ``shard0`` .. ``shard{S-1}`` (``latecomer shard``, slot i, each owning a
  contiguous range of the vector) each at ``--rate``, host ``workers`` unshaped.

All ``--workers`` workers (``--credit``, ``--shm off``) run in the one unshaped ``workers`` host, so
the server side's links are the only bottleneck, as the issue asks. The problem is ``synthetic``
(a constant gradient: no compute) with ``blocks=4`` (4 equal layout blocks, so S = 1, 2, 4 split
them evenly), the algorithm ``asgd`` (lr 1e-9). Every server gets ``--state`` (the sharded mode
needs it; the unsharded one is given one too, so both journal).

What is measured (all times CLOCK_MONOTONIC, which every namespace shares):

* updates/s: from the server's own event log (``applied`` events, each with its time). The first
  applied update starts the warm-up; the window is [first + warmup, + seconds); updates/s =
  (n - 1) / (t_n - t_1) over the n updates applied in the window (between the first and last of
  them, so the count is not off by a fraction of an update at the window's ends: at 0.3 updates/s
  a fixed window would be off by up to one update in 18). ``updates_per_s_window`` = n / window
  is kept too.
* link bytes: each host's link counters (rx + tx of its veth end, layer-2 bytes) read at the
  window's ends, per update = (bytes / window) / updates/s; and each link's use of its rate in
  each direction (``tx_util``/``rx_util``: bits/s over the configured rate; tbf passes
  TCP payload at 1448/1514 = 0.956 of it, the veth counters count headers too, so a saturated
  link reads about 0.95-1.0).
* memory: VmHWM (peak resident) of each process tree we started, read from /proc at the window's
  end (the server: ``serve``'s supervisor, front and daemon together; a shard: its process), and
  the shards' own ``rss_bytes`` from the coordinator's summary.json (resident at their last report).
* CPU: user + system seconds of each process tree over the window, and the box's busy share from
  /proc/stat (all cores; includes the kernel's forwarding through veth, bridge and tbf, and
  anything else that runs on the box meanwhile).

The link-bound expectation: a shard's link carries, per update, the iterate slice down and the
gradient slice up, 4 d / S bytes each way (float32) plus headers, so at most
0.956 * rate / 8 / (4 d / S) updates/s, linear in S. A worker that caches an iterate fetches
nothing for it, so a link may carry less than that per update; the measured bytes say.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.netns import Hosts, parse_rate, why_unusable

REPO = Path(__file__).resolve().parent.parent
PAYLOAD_SHARE = 1448 / 1514  # TCP payload per layer-2 byte of a full segment (what tbf counts)
BLOCKS = 4
LR = 1e-9
SERVE_PORT, SHARD_PORT, DATA_PORT = 5555, 5556, 7000
LISTEN_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 180.0  # a sharded stop gathers x from the shards over the coordinator's link (it allows 120 s)
EXIT_TIMEOUT_S = 20.0
NOISY_CORES = 0.25  # other processes' CPU in a window above which it is measured again
POLL_S = 0.1  # polling interval of the bounded waits below


def _insecure_shard(tree: str) -> list[str]:
    """``--insecure`` for a shard bound to a namespace's address, where the tree's shard has it
    (since CurveZMQ on shards a non-loopback bind without --keys needs it; older trees refuse it)."""
    cli = next(p for p in (Path(tree) / "ps" / "cli" / "shard.py", Path(tree) / "ps" / "shardcli.py") if p.exists())
    return ["--insecure"] if "--insecure" in cli.read_text() else []


def _token_shard(tree: str, state: Path) -> list[str]:
    """``--token-file`` (the run's shard token, without --keys) where the tree's shard has it."""
    cli = next(p for p in (Path(tree) / "ps" / "cli" / "shard.py", Path(tree) / "ps" / "shardcli.py") if p.exists())
    return ["--token-file", str(state / "shard.token")] if "--token-file" in cli.read_text() else []


def _py(*args: str) -> list[str]:
    return [sys.executable, "-m", "ps", *args]


# ``latecomer work`` with worker/shards.py's silence before a fetch is asked again (REFETCH_MIN_S
# and REFETCH_FIRST_S) set first (``--refetch-s``): a diagnostic, not the shipped worker. The
# module is imported before the command runs, so the value holds.
_WORK_PATCHED = ("import runpy, sys\n"
                 "import worker.shards as m\n"
                 "assert hasattr(m, 'REFETCH_MIN_S'), 'worker/shards.py has no REFETCH_MIN_S any more'\n"
                 "m.REFETCH_MIN_S = m.REFETCH_FIRST_S = float(sys.argv.pop(1))\n"
                 "sys.argv[0] = 'ps'\n"
                 "runpy.run_module('ps', run_name='__main__', alter_sys=True)\n")


def _work(refetch_s: float | None, *args: str) -> list[str]:
    if refetch_s is None:
        return _py("work", *args)
    return [sys.executable, "-c", _WORK_PATCHED, str(refetch_s), "work", *args]


def code_version(tree: Path) -> str:
    """The commit the processes run: a git checkout's HEAD (``+dirty`` where ps/, worker/,
    protocol/ or algorithms/ differ from it), or an exported tree's COMMIT file."""
    if (tree / "COMMIT").exists():
        return (tree / "COMMIT").read_text().strip()[:40] + " (exported tree)"
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--", "ps", "worker", "protocol",
                                "algorithms"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
    except psutil.Error:
        return []
    try:
        return [p, *p.children(recursive=True)]
    except psutil.Error:
        return [p]


def _cpu(pid: int) -> tuple[float, float]:
    """(user, user + system) CPU seconds of the process tree so far."""
    user = total = 0.0
    for p in _tree(pid):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        user += t.user
        total += t.user + t.system
    return user, total


def _status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _mem(pid: int) -> dict[str, int]:
    """VmHWM and VmRSS of the process tree, summed, and the processes counted."""
    tree = _tree(pid)
    return {"hwm_bytes": sum(_status_kb(p.pid, "VmHWM") for p in tree),
            "rss_bytes": sum(_status_kb(p.pid, "VmRSS") for p in tree), "processes": len(tree)}


_STAT = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _proc_stat() -> list[float]:
    """/proc/stat's first line: jiffies of all cores in each of _STAT."""
    with open("/proc/stat", encoding="ascii") as f:
        return [float(x) for x in f.readline().split()[1:9]]


def _all_cpu() -> dict[tuple[int, float], float]:
    """CPU seconds of every user-space process on the box, by (pid, start time) (kernel threads,
    which do the forwarding for every namespace, are left out: /proc/stat's softirq share shows them)."""
    out = {}
    for p in psutil.process_iter(["ppid", "create_time", "cpu_times"]):
        info = p.info
        if p.pid == 2 or info["ppid"] == 2 or info["cpu_times"] is None:
            continue
        out[(p.pid, info["create_time"])] = info["cpu_times"].user + info["cpu_times"].system
    return out


def _others_cpu(before: dict, after: dict, mine: set[int]) -> float:
    """CPU seconds spent between the two snapshots by processes not in ``mine`` (at least: one
    that started and ended between them is missed)."""
    return sum(c - before.get(k, 0.0) for k, c in after.items() if k[0] not in mine)


def _mine(procs: dict[str, subprocess.Popen]) -> set[int]:
    return {os.getpid(), *(q.pid for p in procs.values() for q in _tree(p.pid))}


def wait_quiet(limit_s: float, below: float = 0.25, sample_s: float = 3.0) -> tuple[float, float]:
    """Wait (at most ``limit_s``) until the box's other processes use under ``below`` cores over
    ``sample_s``. Returns (seconds waited, cores the others used in the last sample)."""
    t_start = time.monotonic()
    while True:
        c0, st0, t0 = _all_cpu(), _proc_stat(), time.monotonic()
        time.sleep(sample_s)
        st1, dt = _proc_stat(), time.monotonic() - t0
        user = (st1[0] + st1[1] - st0[0] - st0[1]) / os.sysconf("SC_CLK_TCK") / dt  # every process's user time
        others = max(_others_cpu(c0, _all_cpu(), {os.getpid()}) / dt, user)
        if others < below or time.monotonic() - t_start >= limit_s:
            return time.monotonic() - t_start, others


def _applied(events: Path) -> list[tuple[float, int]]:
    """(time, version) of every ``applied`` event written so far (whole lines only)."""
    out = []
    try:
        with open(events, encoding="utf-8") as f:
            for line in f:
                if '"applied"' not in line or not line.endswith("\n"):
                    continue
                ev = json.loads(line)
                if ev.get("ev") != "applied":
                    continue
                out.append((float(ev["t"]), int(ev.get("version", 0))))
    except OSError:
        return []
    return out


def _wait_for(pred, timeout: float, procs: dict[str, subprocess.Popen]) -> str | None:
    """Poll ``pred`` until true (None) or ``timeout`` s pass or a process exits (why, as text)."""
    deadline = time.monotonic() + timeout
    while not pred():
        for name, p in procs.items():
            if p.poll() is not None:
                return f"{name} exited (rc={p.returncode}) before it was ready"
        if time.monotonic() > deadline:
            return f"not ready within {timeout:.0f} s"
        time.sleep(POLL_S)
    return None


def _sleep_until(t: float) -> None:
    while (left := t - time.monotonic()) > 0:
        time.sleep(min(left, 0.2))


def expected_link_bound(d: int, shards: int, rate_bits: float) -> float:
    """Updates/s a link-bound run can reach: each shard link (or the unsharded server's, S = 1)
    carries 4 d / S bytes of payload each way per update, at PAYLOAD_SHARE of the rate."""
    return PAYLOAD_SHARE * rate_bits / 8 / (4 * d / shards)


def run_config(shards: int, a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One configuration: ``shards`` 0 = the unsharded server. Returns its row (``error`` set when
    it could not be measured)."""
    label = "unsharded" if shards == 0 else f"S={shards}"
    server_host = "server" if shards == 0 else "coord"
    shard_hosts = [f"shard{i}" for i in range(shards)]
    names = [server_host, *shard_hosts, "workers"]
    rates = {n: (None if n == "workers" else a.rate) for n in names}
    work = tmp / label.replace("=", "")
    work.mkdir(parents=True)
    row: dict[str, Any] = {"config": label, "shards": shards, "d": a.d, "workers": a.workers, "credit": a.credit,
                           "rate": a.rate, "rate_bits_per_s": parse_rate(a.rate), "algorithm": "asgd",
                           "blocks": BLOCKS, "warmup_s": a.warmup, "seconds": a.seconds, "refetch_s": a.refetch_s,
                           "liveness_timeout": a.liveness_timeout, "error": ""}
    row["code"] = code_version(Path(a.tree))
    t_start = time.monotonic()
    max_time = a.start_timeout + a.warmup + a.seconds + 120  # a backstop: the run is stopped with SIGTERM
    with Hosts(names, rates, prefix="lcs") as hosts:
        row["tbf"] = {n: "tbf" in hosts.qdisc_stats(n) for n in names}
        row["link_rate_bits_per_s"] = {n: hosts.rate_of(n) for n in names}
        sip = hosts.ip(server_host)
        events = work / "events.jsonl"
        state = work / "state"
        serve = ["serve", "--problem", "synthetic", "--problem-opt", f"d={a.d}", "--problem-opt", f"blocks={BLOCKS}",
                 "--algorithm", "asgd", "--set", f"lr={LR}", "--state", str(state), "--events", str(events),
                 "--bind", f"tcp://{sip}:{SERVE_PORT}", "--insecure", "--max-time", str(max_time),
                 "--eval-every", "0", "--min-workers", str(a.workers), "--shm", "off", "--log-level", "info"]
        if a.liveness_timeout is not None:
            serve += ["--liveness-timeout", str(a.liveness_timeout)]
        if shards:
            serve += ["--shards", str(shards), "--local-shards", "0", "--shard-bind", f"tcp://{sip}:{SHARD_PORT}"]
        procs: dict[str, subprocess.Popen] = {}
        logs: dict[str, Path] = {}

        def start(role: str, host: str, argv: list[str]) -> subprocess.Popen:
            logs[role] = work / f"{role}.log"
            with open(logs[role], "wb") as log:
                p = hosts.popen(host, argv, stdout=log, stderr=subprocess.STDOUT, cwd=a.tree)
            procs[role] = p
            return p

        def fail(why: str) -> dict[str, Any]:
            row["error"] = why
            row["log_tails"] = {r: _tail(path) for r, path in logs.items()}
            return row

        server = start("server", server_host, _py(*serve))
        why = _wait_for(lambda: "listening on" in logs["server"].read_text(errors="replace"), LISTEN_TIMEOUT_S,
                        procs)
        if why:
            return fail(f"server: {why}")
        for i, h in enumerate(shard_hosts):
            start(f"shard{i}", h, _py("shard", "--coordinator", f"tcp://{sip}:{SHARD_PORT}",
                                      "--bind", f"tcp://{hosts.ip(h)}:{DATA_PORT}", "--slot", str(i),
                                      "--state", str(work / f"shard{i}-state"), "--log-level", "info",
                                      *_insecure_shard(a.tree), *_token_shard(a.tree, state)))
        for i in range(a.workers):
            start(f"worker{i}", "workers", _work(a.refetch_s, "--server", f"tcp://{sip}:{SERVE_PORT}", "--credit",
                                                 str(a.credit), "--shm", "off", "--worker-id", f"w{i}",
                                                 "--log-level", "info"))
        why = _wait_for(lambda: bool(_applied(events)), a.start_timeout, procs)
        if why:
            return fail(f"first update: {why}")
        t_first = _applied(events)[0][0]
        row["start_to_first_update_s"] = t_first - t_start
        t0 = max(time.monotonic(), t_first + a.warmup)
        t1 = t0 + a.seconds
        _sleep_until(t0)
        link0 = {n: hosts.link_bytes(n) for n in names}
        cpu0 = {r: _cpu(p.pid) for r, p in procs.items()}
        all0 = _all_cpu()
        stat0 = _proc_stat()
        t0 = time.monotonic()  # the window starts when its counters were read
        _sleep_until(t1)
        link1 = {n: hosts.link_bytes(n) for n in names}
        cpu1 = {r: _cpu(p.pid) for r, p in procs.items()}
        all1 = _all_cpu()
        stat1 = _proc_stat()
        t1 = time.monotonic()
        mem = {r: _mem(p.pid) for r, p in procs.items()}
        mine = _mine(procs)
        row["loadavg_1m_at_end"] = os.getloadavg()[0]
        row["qdisc"] = {n: hosts.qdisc_stats(n) for n in names if rates[n] is not None}
        exited = {r: p.returncode for r, p in procs.items() if p.poll() is not None}

        server.send_signal(signal.SIGTERM)  # graceful: summary.json, events flushed, bye to workers and shards
        try:
            server.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            row["error"] = f"the server did not stop within {STOP_TIMEOUT_S:.0f} s of SIGTERM"
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        for r, p in procs.items():
            if r != "server":
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    exited.setdefault(r, None)
        row["still_running_after_stop"] = sorted(r for r, p in procs.items() if p.poll() is None)
        row["exited_during_window"] = {r: rc for r, rc in exited.items() if rc is not None}
        row["log_tails"] = {r: _tail(path, 5) for r, path in logs.items()}
    # the hosts are gone here: every process killed and reaped, the namespaces deleted

    window = t1 - t0
    applied = _applied(events)
    inside = [t for t, _ in applied if t0 <= t < t1]
    row["window_s"] = window
    row["updates_in_window"] = len(inside)
    row["updates_per_s_window"] = len(inside) / window
    row["updates_per_s"] = ((len(inside) - 1) / (inside[-1] - inside[0]) if len(inside) >= 2 and inside[-1] > inside[0]
                            else math.nan)
    ups = row["updates_per_s"]
    row["expected_updates_per_s"] = expected_link_bound(a.d, max(1, shards), parse_rate(a.rate))
    links = {}
    for n in names:
        rx, tx = link1[n][0] - link0[n][0], link1[n][1] - link0[n][1]
        bits = rates[n] and parse_rate(rates[n])
        links[n] = {"rx_bytes": rx, "tx_bytes": tx,
                    "bytes_per_update": (rx + tx) / window / ups if ups and not math.isnan(ups) else math.nan,
                    "rx_util": rx * 8 / window / bits if bits else None,
                    "tx_util": tx * 8 / window / bits if bits else None}
    row["links"] = links
    row["expected_bytes_per_update_per_data_link"] = 2 * 4 * a.d / max(1, shards)
    dstat = {k: b - a for k, a, b in zip(_STAT, stat0, stat1, strict=True)}
    jiffies = sum(dstat.values())
    row["box_share"] = {k: v / jiffies for k, v in dstat.items()} if jiffies else {}
    row["box_busy"] = 1 - (dstat["idle"] + dstat["iowait"]) / jiffies if jiffies else math.nan
    row["box_softirq"] = dstat["softirq"] / jiffies if jiffies else math.nan
    row["cpu_cores"] = os.cpu_count()
    row["cpu_per_s"] = {r: (cpu1[r][1] - cpu0[r][1]) / window for r in procs}
    # Two views of what the rest of the box took: the processes seen at both ends (misses short-lived
    # ones, e.g. a test suite's), and the box's user time less ours (our processes' time is mostly
    # system time, moving bytes; the kernel's forwarding is softirq or system). The larger counts.
    hz = os.sysconf("SC_CLK_TCK")
    ours_user = sum(cpu1[r][0] - cpu0[r][0] for r in procs)
    others_user = max(0.0, (dstat["user"] + dstat["nice"]) / hz - ours_user) / window
    row["others_cpu_per_s"] = max(_others_cpu(all0, all1, mine) / window, others_user)
    row["others_user_per_s"] = others_user
    row["mem"] = mem
    summary_path = state / "summary.json"
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, ValueError) as e:
        summary = {}
        row["error"] = row["error"] or f"no summary.json: {e}"
    row["summary"] = {k: summary.get(k) for k in ("version", "elapsed_s", "stopped", "counters", "shards")}
    if not inside and not row["error"]:
        row["error"] = "no update applied in the window"
    row["wall_s"] = time.monotonic() - t_start
    return row


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def ratios(rows: list[dict[str, Any]]) -> None:
    """Speedups against the S=1 sharded run and the unsharded one of the same invocation."""
    by = {r["shards"]: r for r in rows if not r["error"]}
    s1 = by.get(1, {}).get("updates_per_s", math.nan)
    un = by.get(0, {}).get("updates_per_s", math.nan)
    for r in rows:
        u = r.get("updates_per_s", math.nan)
        r["speedup_vs_s1"] = u / s1 if s1 and not math.isnan(s1) and not r["error"] else math.nan
        r["speedup_vs_unsharded"] = u / un if un and not math.isnan(un) and not r["error"] else math.nan


TARGETS = {2: 1.7, 4: 3.0}  # the issue's: speedup over S=1


def targets(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for s, want in TARGETS.items():
        r = next((r for r in rows if r["shards"] == s), None)
        if r is None:
            continue
        got = r.get("speedup_vs_s1", math.nan)
        if math.isnan(got):
            out.append(f"S={s}: target >= {want}x over S=1 not measured ({r['error'] or 'no S=1 run'})")
        else:
            out.append(f"S={s}: {got:.2f}x over S=1, target >= {want}x: {'MET' if got >= want else 'NOT MET'}")
    return out


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    d, rate = meta["d"], meta["rate"]
    tweaks = []
    if meta.get("refetch_s") is not None:
        tweaks.append(f"workers run with worker/shards.py's REFETCH_MIN_S = REFETCH_FIRST_S = {meta['refetch_s']:g} s "
                      f"(patched in the worker process; shipped: 2 s and 10 s)")
    if meta.get("liveness_timeout") is not None:
        tweaks.append(f"`serve --liveness-timeout {meta['liveness_timeout']:g}`")
    lines = [
        f"`python -m benchmarks.shards {meta['argv']}` — {meta['date']}, {meta['host']}; code {meta.get('code')}. "
        f"d = {d:,} float32 ({4 * d / 1e6:.0f} MB), problem `synthetic` (constant gradient, no compute; "
        f"`blocks={BLOCKS}`), algorithm `asgd` (lr {LR}), {meta['workers']} workers at credit {meta['credit']} "
        f"(`--shm off`), every server-side link (the server's, the coordinator's and each shard's) tc-tbf "
        f"limited to **{rate}** ({parse_rate(rate) / 1e6:g} Mbit/s) each way, the workers' host unshaped. "
        f"Warm-up {meta['warmup']:g} s after the first update, then a {meta['seconds']:g} s window. "
        + (("Changed from the defaults: " + "; ".join(tweaks) + ".") if tweaks else "Everything as shipped."),
        "",
        "| config | updates/s (median of rounds: range) | vs S=1 | vs unsharded | link-bound expectation | "
        "updates in window | data link bytes/update (expected) | data link use tx / rx | server/coord peak RSS | "
        "shard peak RSS (each) | CPU: server, shards, workers, others (cores) | box busy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if meta.get("repeat", 1) > 1:
        lines.insert(1, f"\n{meta['repeat']} rounds, interleaved; the columns after updates/s are of the round "
                        f"nearest the median.\n")
    for r in rows:
        if r["error"] and "updates_per_s" not in r:
            lines.append(f"| {r['config']} | failed: {r['error']} |" + " |" * 10)
            continue
        data = ["server"] if r["shards"] == 0 else [f"shard{i}" for i in range(r["shards"])]
        per = [r["links"][h]["bytes_per_update"] for h in data]
        bpu = "/".join(_fmt(x / 1e6, ".1f") for x in per)
        bpu += f" MB ({r['expected_bytes_per_update_per_data_link'] / 1e6:.1f})"
        use = " ".join(f"{_fmt(r['links'][h]['tx_util'])}/{_fmt(r['links'][h]['rx_util'])}" for h in data)
        shard_mem = " ".join(_fmt(r["mem"][f"shard{i}"]["hwm_bytes"] / 2**20, ".0f") for i in range(r["shards"]))
        cpu = r["cpu_per_s"]
        shards_cpu = sum(v for k, v in cpu.items() if k.startswith("shard"))
        workers_cpu = sum(v for k, v in cpu.items() if k.startswith("worker"))
        ups = _fmt(r["updates_per_s"], ".3f")
        rounds = [u for u in r.get("updates_per_s_rounds", []) if not math.isnan(u)]
        if len(rounds) > 1:
            ups += f" ({min(rounds):.3f}–{max(rounds):.3f})"
        lines.append(
            f"| {r['config']} | {ups} | {_fmt(r['speedup_vs_s1'])} | "
            f"{_fmt(r['speedup_vs_unsharded'])} | {_fmt(r['expected_updates_per_s'], '.3f')} | "
            f"{r['updates_in_window']} | {bpu} | {use} | {_fmt(r['mem']['server']['hwm_bytes'] / 2**20, '.0f')} MiB | "
            f"{shard_mem + ' MiB' if shard_mem else '—'} | {_fmt(cpu['server'])}, {_fmt(shards_cpu)}, "
            f"{_fmt(workers_cpu)}, {_fmt(r.get('others_cpu_per_s'))} | {_fmt(r['box_busy'] * 100, '.0f')}% |")
        if r["error"]:
            lines.append(f"| ↳ {r['config']}: {r['error']} |" + " |" * 11)
    lines += ["", "**Targets (issue 17):** " + "; ".join(targets(rows) or ["no sharded run"]) + ".", ""]
    return "\n".join(lines)


SERIES = [("tab:blue", "o"), ("tab:green", "s"), ("tab:purple", "^"), ("tab:red", "v")]


def plot(runs: dict[str, dict[str, Any]], out: str) -> None:
    """Updates/s against S for every run (tag) in ``runs``, with each run's ideal line (S x its
    S=1) and unsharded figure, and the link-bound expectation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    xs_all: set[int] = set()
    expect = None
    for (tag, run), (colour, marker) in zip(runs.items(), SERIES, strict=False):
        rows = run["rows"]
        sh = sorted((r["shards"], r["updates_per_s"]) for r in rows
                    if r["shards"] and not r["error"] and not math.isnan(r.get("updates_per_s", math.nan)))
        if not sh:
            continue
        xs = [s for s, _ in sh]
        xs_all.update(xs)
        m = run["meta"]
        name = f"{tag} (credit {m['credit']})"
        ax.plot(xs, [u for _, u in sh], color=colour, marker=marker, linestyle="-", label=f"{name}: sharded")
        for r in rows:  # the rounds' range
            rounds = [u for u in r.get("updates_per_s_rounds", []) if not math.isnan(u)]
            if r["shards"] and len(rounds) > 1 and not r["error"]:
                ax.vlines(r["shards"], min(rounds), max(rounds), color=colour, linewidth=2, alpha=0.6)
        base = dict(sh).get(1)
        if base:
            ax.plot(xs, [base * s for s in xs], color=colour, linestyle="--", linewidth=0.9,
                    label=f"{name}: ideal, S x (S=1)")
        un = next((r["updates_per_s"] for r in rows if r["shards"] == 0 and not r["error"]), None)
        if un:
            ax.axhline(un, color=colour, linestyle="-.", linewidth=0.9, label=f"{name}: unsharded server")
        expect = expect or (m["d"], m["rate_bits_per_s"], m["rate"], m["workers"])
    if expect and xs_all:
        xs = sorted(xs_all)
        d, bits = expect[0], expect[1]
        ax.plot(xs, [expected_link_bound(d, s, bits) for s in xs], color="black", linestyle=":",
                label="link-bound expectation")
        ax.set_xticks(xs)
        ax.set_title(f"latecomer sharded: every server-side link {expect[2]}, d={d:.0e} float32, "
                     f"{expect[3]} workers", fontsize=9)
    ax.set_xlabel("shards S")
    ax.set_ylabel("applied updates / s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def write_report(out: Path, tag: str, meta: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON beside ``out`` keeps every tag's run ({"runs": {tag: {"meta", "rows"}}}); in the
    markdown, this tag's table replaces the one between its markers (or is appended)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    jpath = out.with_suffix(".json")
    runs: dict[str, Any] = {}
    if jpath.exists():
        try:
            runs = json.loads(jpath.read_text()).get("runs", {})
        except (OSError, ValueError, AttributeError):
            runs = {}
    runs[tag] = {"meta": meta, "rows": rows}
    jpath.write_text(json.dumps({"runs": runs}, indent=1, default=str) + "\n")
    table = markdown(rows, meta)
    start, end = f"<!-- table:{tag} -->", f"<!-- /table:{tag} -->"
    old = out.read_text() if out.exists() else ""
    block = f"{start}\n{table.rstrip()}\n{end}"
    if start in old and end in old:
        new = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block, old, flags=re.S)
    else:
        new = (old.rstrip() + "\n\n" if old.strip() else "") + f"## Run `{tag}`\n\n{block}\n"
    out.write_text(new if new.endswith("\n") else new + "\n")
    return runs


def _tagged(runs: dict[str, Any], tags: str | None) -> dict[str, Any]:
    if tags is None:
        return runs
    want = [t.strip() for t in tags.split(",") if t.strip()]
    missing = [t for t in want if t not in runs]
    if missing:
        raise SystemExit(f"no run tagged {missing} in the JSON (it has {sorted(runs)})")
    return {t: runs[t] for t in want}


def measure(s: int, a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One configuration once; again (at most --noisy-retries times) while the box's other
    processes took over NOISY_CORES in its window. The quietest try is kept."""
    tries: list[dict[str, Any]] = []
    label = "unsharded" if s == 0 else f"S={s}"
    while True:
        waited, others = wait_quiet(a.quiet_wait) if a.quiet_wait > 0 else (0.0, math.nan)
        print(f"{label}: (waited {waited:.0f} s for a quiet box: others use {others:.2f} cores) ...", flush=True)
        try:
            row = run_config(s, a, tmp / f"try{len(tries)}")
        except Exception as e:  # noqa: BLE001 - one configuration failing must not lose the others
            row = {"config": label, "shards": s, "error": f"{type(e).__name__}: {e}"}
        row["quiet_wait_s"], row["others_cpu_before"] = waited, others
        tries.append(row)
        if row.get("others_cpu_per_s", 0.0) <= NOISY_CORES or len(tries) > a.noisy_retries:
            break
        print(f"  others used {row['others_cpu_per_s']:.2f} cores in the window: again", flush=True)
    row = min(tries, key=lambda r: r.get("others_cpu_per_s", 0.0))
    row["tries"] = len(tries)
    row["others_cpu_per_s_of_tries"] = [r.get("others_cpu_per_s") for r in tries]
    print(f"  {label}: {_fmt(row.get('updates_per_s'), '.3f')} updates/s ({row.get('updates_in_window', 0)} in "
          f"the window; expected <= {_fmt(row.get('expected_updates_per_s'), '.3f')}); box busy "
          f"{_fmt(row.get('box_busy'))}" + (f"; ERROR {row['error']}" if row["error"] else ""), flush=True)
    return row


def aggregate(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """A configuration's rounds: the round with the median updates/s stands for it (its links,
    memory, CPU), with updates/s the median of the rounds that worked and every round's figure
    kept. Any round that failed makes the configuration's ``error``."""
    ok = [r for r in reps if not r["error"] and not math.isnan(r.get("updates_per_s", math.nan))]
    errors = [f"round {r.get('round')}: {r['error']}" for r in reps if r["error"]]
    if not ok:
        row = dict(reps[0])
    else:
        ups = sorted(r["updates_per_s"] for r in ok)
        median = statistics.median(ups)
        row = dict(min(ok, key=lambda r: abs(r["updates_per_s"] - median)))
        row["updates_per_s_of_round"] = row["updates_per_s"]
        row["updates_per_s"] = median
    row["updates_per_s_rounds"] = [r.get("updates_per_s", math.nan) for r in reps]
    row["rounds"] = len(reps)
    row["error"] = "; ".join(errors)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.shards", description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=10_000_000)
    ap.add_argument("--rate", default="100mbit", help="tc rate of every server-side link")
    ap.add_argument("--shards", default="1,2,4", help="comma-separated shard counts (each divides 4)")
    ap.add_argument("--no-unsharded", action="store_true", help="skip the unsharded baseline")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--credit", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0, help="measured window")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds after the first update before the window")
    ap.add_argument("--start-timeout", type=float, default=240.0, help="seconds allowed until the first update")
    ap.add_argument("--out", default="benchmarks/RESULTS-shards.md", help="markdown; the JSON goes beside it")
    ap.add_argument("--tag", default="shipped", help="this run's name in the report (its table, its JSON entry)")
    ap.add_argument("--plot", default=None, help="PNG of updates/s against S, every run in the JSON (default: none)")
    ap.add_argument("--plot-tags", default=None,
                    help="comma-separated tags the plot shows (default: every run in the JSON)")
    ap.add_argument("--plot-only", action="store_true",
                    help="measure nothing: draw --plot from the JSON beside --out")
    ap.add_argument("--refetch-s", type=float, default=None,
                    help="diagnostic: the workers' worker/shards.py REFETCH_MIN_S and REFETCH_FIRST_S set to this "
                         "(default: as shipped)")
    ap.add_argument("--liveness-timeout", type=float, default=None,
                    help="serve --liveness-timeout (workers and shards; default: serve's)")
    ap.add_argument("--quiet-wait", type=float, default=600.0,
                    help="before each configuration, wait up to this many seconds for the box's other processes "
                         "to use under 0.25 cores (0: don't)")
    ap.add_argument("--tree", default=str(REPO),
                    help="the source tree the server, shards and workers run from (their cwd, so its ps/ and "
                         "worker/ are imported): e.g. one commit exported with git archive, a COMMIT file in it "
                         "naming the commit (default: this checkout)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds: every configuration this many times, interleaved; updates/s is their median")
    ap.add_argument("--noisy-retries", type=int, default=2,
                    help=f"measure a configuration again (at most this many times) when the box's other processes "
                         f"used over {NOISY_CORES} cores in its window; the quietest try is kept")
    ap.add_argument("--keep", action="store_true", help="keep the state directories and logs (printed)")
    a = ap.parse_args(argv)
    if a.plot_only:
        if not a.plot:
            ap.error("--plot-only needs --plot")
        runs = json.loads(Path(a.out).with_suffix(".json").read_text())["runs"]
        plot(_tagged(runs, a.plot_tags), a.plot)
        return 0
    counts = [int(x) for x in a.shards.split(",") if x.strip()]
    if any(s < 1 or BLOCKS % s for s in counts):
        ap.error(f"each shard count must divide the {BLOCKS} layout blocks: {counts}")
    parse_rate(a.rate)
    why = why_unusable()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    a.tree = str(Path(a.tree).resolve())
    if not (Path(a.tree) / "ps" / "__main__.py").exists():
        ap.error(f"--tree {a.tree}: no ps/__main__.py there")
    configs = ([] if a.no_unsharded else [0]) + counts
    tmp = Path(tempfile.mkdtemp(prefix="latecomer-shards-"))
    measured: dict[int, list[dict[str, Any]]] = {s: [] for s in configs}
    try:
        for rep in range(a.repeat):  # interleaved: every configuration once per round, so a drift hits all
            for s in configs:
                row = measure(s, a, tmp / f"round{rep}")
                row["round"] = rep
                measured[s].append(row)
    finally:
        if a.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = [aggregate(measured[s]) for s in configs]
    ratios(rows)
    codes = sorted({r.get("code", "?") for r in rows})
    meta = {"tag": a.tag, "argv": " ".join(sys.argv[1:] if argv is None else argv), "d": a.d, "rate": a.rate,
            "rate_bits_per_s": parse_rate(a.rate), "workers": a.workers, "credit": a.credit, "seconds": a.seconds,
            "warmup": a.warmup, "repeat": a.repeat, "refetch_s": a.refetch_s,
            "liveness_timeout": a.liveness_timeout, "algorithm": "asgd", "problem": "synthetic", "blocks": BLOCKS,
            "date": time.strftime("%Y-%m-%d %H:%M"), "host": f"{platform.node()}, {os.cpu_count()} cores, "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB, Linux {platform.release()}",
            "targets": targets(rows), "code": codes[0] if len(codes) == 1 else f"CHANGED DURING THE RUN: {codes}"}
    runs = write_report(Path(a.out), a.tag, meta, rows)
    if a.plot:
        plot(_tagged(runs, a.plot_tags), a.plot)
    print("\n".join(meta["targets"]))
    return 0 if all(not r["error"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
