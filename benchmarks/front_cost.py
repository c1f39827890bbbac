"""What the front costs (ps/net/front.py): ``latecomer serve`` supervised (the default: the front
relays every connection to the daemon) against ``serve --no-supervise`` (the daemon alone on the
port), on the bench workload (asgd on ``synthetic``, one ``latecomer work --shm off``, lockstep).

    python -m benchmarks.front_cost [--sizes 1000,100000] [--seconds 4] [--repeats 3]

Per row: updates/s, the daemon's CPU per update, the front's (the supervisor process's) CPU per
update and per relayed message (an update is two messages: a job and its reply). The runs of
the two modes alternate and the medians are shown (the machine's other load moves them all).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

import psutil

from benchmarks.common import reap_popen


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def one(d: int, supervised: bool, seconds: float) -> tuple[float, float, float]:
    """(updates/s, daemon CPU s per update, front CPU s per update) of one run."""
    from ps.ops.status import fetch_status

    args = [sys.executable, "-m", "ps", "serve", "--bind", "tcp://127.0.0.1:0", "--problem", "synthetic",
            "--problem-opt", f"d={d}", "--algorithm", "asgd", "--set", "lr=1e-9", "--eval-every", "0",
            "--log-level", "error", "--max-time", str(seconds + 60), "--shm", "off"]
    server = subprocess.Popen(args + ([] if supervised else ["--no-supervise"]), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    procs = [server]
    try:
        endpoint = re.search(r"(tcp://\S+)", server.stdout.readline().decode()).group(1)
        procs.append(subprocess.Popen([sys.executable, "-m", "ps", "work", "--server", endpoint, "--shm", "off",
                                       "--log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))
        deadline = time.monotonic() + 60
        while fetch_status(endpoint, timeout_s=5).info.get("counter.applied", 0) < 50:
            if time.monotonic() > deadline:
                raise RuntimeError("no updates within 60 s")
            time.sleep(0.1)  # polling interval of a bounded wait
        top = psutil.Process(server.pid)
        daemon = (top.children() or [top])[0]
        a0, f0, d0, t0 = fetch_status(endpoint, timeout_s=5).info["counter.applied"], _cpu(top), _cpu(daemon), \
            time.monotonic()
        time.sleep(seconds)  # the timed interval
        a1, f1, d1, t1 = fetch_status(endpoint, timeout_s=5).info["counter.applied"], _cpu(top), _cpu(daemon), \
            time.monotonic()
        n = max(a1 - a0, 1)
        return n / (t1 - t0), (d1 - d0) / n, (f1 - f0) / n if supervised else 0.0
    finally:
        reap_popen(procs[1:], grace=5)
        reap_popen(procs[:1], grace=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,100000")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    print("| d | mode | updates/s | daemon CPU/update | front CPU/update | front CPU/message |")
    print("|---|---|---|---|---|---|")
    for d in (int(x) for x in a.sizes.split(",")):
        runs: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
        for _ in range(a.repeats):
            for supervised in (False, True):
                runs[supervised].append(one(d, supervised, a.seconds))
        for supervised in (False, True):
            rate, dcpu, fcpu = (statistics.median(x) for x in zip(*runs[supervised], strict=True))
            front = f"{fcpu * 1e6:.0f} us | {fcpu / 2 * 1e6:.0f} us" if supervised else "- | -"
            print(f"| {d} | {'front (default)' if supervised else '--no-supervise'} | {rate:.0f} | "
                  f"{dcpu * 1e6:.0f} us | {front} |")


if __name__ == "__main__":
    main()
