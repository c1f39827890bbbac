"""Shared measurement for ``latecomer bench``: rows, windows, server CPU/RSS, reaping, and the
description of the machine every report opens with.

Every backend runs the same workload (server holds x of d float32; each worker loops: send a
constant g, the server applies x <- x - lr*g and sends x back) and reports, for one
(backend, d, workers) cell, the completion times of the updates (monotonic clock, shared by all
processes on Linux), the round trips, and the server's CPU times sampled at the start and end
of the timed interval [t0, t1].
"""

from __future__ import annotations

import math
import os
import platform
import socket
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import psutil

LR = 1e-9  # tiny: x stays finite however long the run
N_WINDOWS = 5  # timed interval split into this many windows; updates/s = median of the windows


@dataclass
class Row:
    backend: str
    d: int
    workers: int
    updates_per_s: float = math.nan
    bytes_per_update: float = math.nan
    cpu_s_per_update: float = math.nan
    rtt_p50_s: float = math.nan
    rtt_p99_s: float = math.nan
    peak_rss_bytes: float = math.nan
    updates: int = 0
    windows: list = field(default_factory=list)
    skipped: str = ""  # non-empty: not measured, and why
    note: str = ""
    wall_s: float = math.nan  # the whole cell (start, warm-up, timed interval, shutdown), for the time plan
    rep: int = 0  # `bench --repeat N`: which repetition (1..N) of the interleaved cells; 0: not repeated

    def as_dict(self) -> dict:
        return asdict(self)


def measured(r: Row | None) -> bool:
    """Whether ``r`` is a row that ran and gave a rate (not skipped, not empty)."""
    return r is not None and not r.skipped and math.isfinite(r.updates_per_s) and r.updates_per_s > 0


def skipped(backend: str, d: int, workers: int, why: str) -> Row:
    return Row(backend, d, workers, skipped=why)


def _tree(pid: int) -> list[psutil.Process]:
    """The process and its descendants (``latecomer serve`` is a supervisor and the daemon)."""
    p = psutil.Process(pid)
    try:
        return [p, *p.children(recursive=True)]
    except psutil.Error:
        return [p]


def server_cpu(pid: int) -> float:
    """CPU seconds (user + system) of the process and its descendants so far."""
    total = 0.0
    for p in _tree(pid):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _peak_rss_one(p: psutil.Process) -> float:
    try:
        with open(f"/proc/{p.pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(p.memory_info().rss)
    except psutil.Error:
        return 0.0


def peak_rss(pid: int) -> float:
    """Peak resident set so far (VmHWM; current RSS where /proc lacks it) of the process and its
    descendants, summed."""
    return sum(_peak_rss_one(p) for p in _tree(pid))


def sleep_until(t: float) -> None:
    while True:
        left = t - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.05))


def summarize(backend: str, d: int, workers: int, ts: np.ndarray, rtts: np.ndarray, t0: float, t1: float,
              cpu0: float, cpu1: float, rss: float, bytes_per_update: float, note: str = "") -> Row:
    """Figures for one cell: ``ts`` = update completion times, ``rtts[i]`` = round trip of update i
    (only the updates completed in [t0, t1) count)."""
    ts = np.asarray(ts, dtype=np.float64)
    mask = (ts >= t0) & (ts < t1)
    inside = ts[mask]
    w = (t1 - t0) / N_WINDOWS
    rates = [float(np.count_nonzero((inside >= t0 + i * w) & (inside < t0 + (i + 1) * w)) / w)
             for i in range(N_WINDOWS)]
    row = Row(backend, d, workers, windows=rates, updates=int(inside.size), note=note,
              bytes_per_update=float(bytes_per_update), peak_rss_bytes=float(rss))
    if inside.size == 0:
        row.skipped = "no update completed in the timed interval"
        return row
    row.updates_per_s = statistics.median(rates)
    row.cpu_s_per_update = (cpu1 - cpu0) / inside.size
    r = np.asarray(rtts, dtype=np.float64)[mask]
    if r.size:
        row.rtt_p50_s = float(np.percentile(r, 50))
        row.rtt_p99_s = float(np.percentile(r, 99))
    return row


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reap_popen(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM each process group still running, wait ``grace`` s, then SIGKILL; always wait."""
    from ps.ops.children import reap

    reap(procs, grace)


def reap_mp(procs: list, grace: float = 5.0) -> None:
    """multiprocessing children: join ``grace`` s, terminate, then kill; always joined."""
    procs = [p for p in procs if p.pid is not None]  # started ones only
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(3)
        if p.is_alive():
            p.kill()
            p.join(5)


def worker_loop(step, ctrl, warm: int = 3):
    """Run ``step()`` (one update; returns nothing) until ``ctrl[0]`` (a monotonic deadline) has
    passed; returns (completion times, round trips) as float64 arrays."""
    for _ in range(warm):
        step()
    ts, rt = [], []
    now = time.monotonic()
    while now < ctrl[0]:
        step()
        t = time.monotonic()
        ts.append(t)
        rt.append(t - now)
        now = t
    return np.asarray(ts), np.asarray(rt)


def run_mp_cell(backend: str, server_target, server_args: tuple, worker_target, worker_args: tuple, d: int,
                workers: int, seconds: float, warmup: float, note: str = "", start_timeout: float = 90.0,
                server_grace: float = 10.0) -> Row:
    """One cell with ``spawn``ed processes. ``server_target(*server_args, q_srv)`` puts ("up", pid, info)
    once listening; ``worker_target(i, info, *worker_args, ctrl, q)`` puts ("ready", i) after its warm-up
    updates and ("done", i, ts, rtts, bytes_per_update) once ``ctrl[0]`` has passed."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q_srv, q = ctx.Queue(), ctx.Queue()
    ctrl = ctx.RawArray("d", [math.inf])
    procs = [ctx.Process(target=server_target, args=(*server_args, q_srv), daemon=True)]
    try:
        procs[0].start()
        tag, pid, info = q_srv.get(timeout=start_timeout)
        for i in range(workers):
            p = ctx.Process(target=worker_target, args=(i, info, *worker_args, ctrl, q), daemon=True)
            p.start()
            procs.append(p)
        deadline = time.monotonic() + start_timeout
        ready = 0
        while ready < workers:
            msg = q.get(timeout=max(0.1, deadline - time.monotonic()))
            if msg[0] == "error":
                return skipped(backend, d, workers, f"worker failed: {msg[1]}")
            ready += msg[0] == "ready"
        t0 = time.monotonic() + warmup
        t1 = t0 + seconds
        ctrl[0] = t1
        sleep_until(t0)
        cpu0 = server_cpu(pid)
        sleep_until(t1)
        cpu1 = server_cpu(pid)
        rss = peak_rss(pid)
        ts, rts, nbytes = [], [], []
        done = 0
        deadline = time.monotonic() + 60 + seconds
        while done < workers:
            msg = q.get(timeout=max(0.1, deadline - time.monotonic()))
            if msg[0] == "error":
                return skipped(backend, d, workers, f"worker failed: {msg[1]}")
            if msg[0] == "done":
                done += 1
                ts.append(msg[2])
                rts.append(msg[3])
                nbytes.append(msg[4])
        return summarize(backend, d, workers, np.concatenate(ts), np.concatenate(rts), t0, t1, cpu0, cpu1, rss,
                         float(np.mean(nbytes)), note)
    except Exception as e:  # noqa: BLE001 - a failed cell is a row saying why, never a crash of the sweep
        return skipped(backend, d, workers, f"{type(e).__name__}: {e}"[:200])
    finally:
        reap_mp(procs[1:], grace=10)
        reap_mp(procs[:1], grace=server_grace)


CPUIDLE = "/sys/devices/system/cpu/cpuidle"
HALTPOLL_NS = "/sys/module/haltpoll/parameters/guest_halt_poll_ns"


def idle_policy(cpuidle: str = CPUIDLE, haltpoll_ns: str = HALTPOLL_NS) -> str:
    """How this machine's idle CPUs wait, which sets the cost of every wake-up in a lockstep round
    trip: the cpuidle driver and governor, and on a KVM guest with the ``haltpoll`` driver how long
    the guest polls before it halts (``guest_halt_poll_ns``; 0: it halts at once, and the next
    wake-up goes through the host). On this project's VMs that setting alone moved raw pyzmq's
    small-message rate 2.8x (benchmarks/PROFILE.md, "The VM's idle policy"). "" where none is readable."""
    def read(path: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            return ""

    driver, governor = read(f"{cpuidle}/current_driver"), read(f"{cpuidle}/current_governor")
    if not driver and not governor:
        return ""
    text = f"cpuidle {driver or '?'}/{governor or '?'}"
    ns = read(haltpoll_ns)
    if ns:
        text += f", guest halt polling {ns} ns" + (" (off)" if ns == "0" else "")
    return text


def machine() -> str:
    """The machine in one line: CPU, cores, memory, OS, its idle policy, the versions that matter,
    the load at start."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for ln in f:
                if ln.startswith("model name"):
                    cpu = ln.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import numpy
    import torch
    import zmq
    try:
        import ray
        rv = ray.__version__
    except Exception:  # noqa: BLE001
        rv = "not installed"
    idle = idle_policy()
    idle = f" ({idle})" if idle else ""
    return (f"{cpu}, {os.cpu_count()} logical cores, {psutil.virtual_memory().total / 2**30:.1f} GiB RAM, "
            f"{platform.system()} {platform.release()}{idle}; Python {platform.python_version()}, "
            f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), numpy {numpy.__version__}, "
            f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads by default), ray {rv}; "
            f"load average at start {os.getloadavg()[0]:.2f}")
