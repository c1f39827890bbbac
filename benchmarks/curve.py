"""Throughput of latecomer in plaintext, under ``--keys`` (the sealed data connection, PROTOCOL.md
§6.15) and under ``--keys --seal off`` (everything inside libzmq's CurveZMQ) (issues 5 and 32).

Runs the real daemon and real worker processes on loopback, plain async SGD on the
``synthetic`` problem (negligible compute: what is measured is moving parameters and
gradients), and reports applied updates per second (median of windows) for each parameter size,
the three side by side, plus the ratios. Figures, never assertions: this machine is shared.

    python -m benchmarks.curve [--quick] [--out benchmarks/RESULTS-curve.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ps", *args], cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)


def _applied(events: str) -> list[float]:
    out = []
    with open(events, encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n") and '"applied"' in line:
                ev = json.loads(line)
                if ev.get("ev") == "applied":
                    out.append(ev["t"])
    return out


def measure(d: int, workers: int, curve: bool | str, seconds: float, tmp: str) -> float:
    """Median applied updates/s over 0.5 s windows after a warm-up."""
    """``curve``: False (plaintext), True (``--keys``: sealed) or "curvezmq" (``--keys --seal off``)."""
    events = os.path.join(tmp, f"ev-{d}-{workers}-{curve}.jsonl")
    args = ["serve", "--bind", "tcp://127.0.0.1:0", "--problem", "synthetic", "--problem-opt", f"d={d}",
            "--algorithm", "asgd", "--set", "lr=1e-9", "--max-time", str(seconds + 8),
            "--min-workers", str(workers), "--eval-every", "0", "--events", events, "--log-level", "error",
            "--shm", "off"]  # the TCP path: on one host the arrays would go through shared memory, not CurveZMQ
    if curve:
        keys = os.path.join(tmp, f"keys-{d}-{workers}-{curve}")
        subprocess.run([sys.executable, "-m", "ps", "keys", "init", keys], cwd=REPO, check=True,
                       capture_output=True)
        for i in range(workers):
            subprocess.run([sys.executable, "-m", "ps", "keys", "add-worker", f"b{i}", "--keys", keys], cwd=REPO,
                           check=True, capture_output=True)
        args += ["--keys", keys] + (["--seal", "off"] if curve == "curvezmq" else [])
    server = _start(*args)
    line = server.stdout.readline().decode()
    endpoint = line.split()[-1]
    procs = []
    for i in range(workers):
        w = ["work", "--server", endpoint, "--worker-id", f"b{i}", "--shm", "off"]
        if curve:
            w += ["--key", os.path.join(keys, "workers", f"b{i}.key_secret"),
                  "--server-key", os.path.join(keys, "server.key")]
        procs.append(_start(*w))
    try:
        server.wait(timeout=seconds + 60)
    finally:
        for p in [server, *procs]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
    ts = _applied(events)
    if len(ts) < 10:
        return float("nan")
    t0 = ts[0] + 1.0  # warm-up
    rates, start, n = [], t0, 0
    for t in ts:
        if t < t0:
            continue
        if t >= start + 0.5:
            rates.append(n / 0.5)
            start, n = start + 0.5, 0
        n += 1
    return statistics.median(rates) if rates else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS-curve.md"))
    a = ap.parse_args()
    sizes = [1000, 100_000] if a.quick else [1000, 100_000, 1_000_000]
    seconds = 3.0 if a.quick else 6.0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for d in sizes:
            for workers in (1, 2):
                plain = measure(d, workers, False, seconds, tmp)
                sealed = measure(d, workers, True, seconds, tmp)
                czmq = measure(d, workers, "curvezmq", seconds, tmp)
                rows.append((d, workers, plain, sealed, czmq))
                print(f"d={d:>9,} workers={workers}: plain {plain:8.0f}/s  sealed {sealed:8.0f}/s "
                      f"({sealed / plain:4.2f})  curvezmq {czmq:8.0f}/s ({czmq / plain:4.2f})", flush=True)
    lines = [f"# Plaintext, sealed (`--keys`) and CurveZMQ (`--keys --seal off`) ({platform.machine()}, "
             f"{os.cpu_count()} cores, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')})", "",
             "Real daemon and worker processes on loopback, the arrays over TCP (`--shm off`; the "
             "same-host path would carry them through shared memory, outside CurveZMQ); plain async SGD on "
             "the `synthetic` problem (negligible compute); applied "
             "updates/s (median of 0.5 s windows). Shared, noisy machine: read the ratios.", "",
             "| d (float32) | workers | plain TCP | sealed | sealed / plain | CurveZMQ | CurveZMQ / plain |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {d:,} | {w} | {p:,.0f} | {c:,.0f} | {c / p:.2f} | {z:,.0f} | {z / p:.2f} |" for d, w, p, c, z in rows]
    with open(a.out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
