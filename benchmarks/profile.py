"""Where an update's time goes: py-spy on a real daemon and a real worker (the bench workload).

    python -m benchmarks.profile [--d 1000] [--shm off|auto] [--credit 1] [--seconds 5] [--top 15]

Starts ``latecomer serve`` (asgd on ``synthetic``) and one ``latecomer work``, samples both with
py-spy (the ``bench`` extra; ``pip install py-spy``) and prints, per process, the functions with
the most samples (own time) and the share of samples spent waiting in ``poll`` (idle: waiting
for the other side). Also prints each process's CPU per update. Results for this machine are in
benchmarks/PROFILE.md.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import click

from benchmarks.common import reap_popen, server_cpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stacks(raw_path: str) -> Iterator[tuple[list[str], int]]:
    """(frames, samples) of each line of a py-spy ``--format raw`` file."""
    with open(raw_path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip()
            if line and " " in line:
                stack, n = line.rsplit(" ", 1)
                yield stack.split(";"), int(n)


def top_frames(raw_path: str, top: int) -> tuple[list[tuple[float, str]], float]:
    """(share of samples, frame) for the ``top`` frames by own samples; share of samples in poll."""
    own: collections.Counter = collections.Counter()
    total = 0
    for frames, n in _stacks(raw_path):
        total += n
        own[frames[-1]] += n
    total = max(total, 1)
    poll = sum(n for fr, n in own.items() if "poll" in fr.lower() and "zmq" in fr)
    return [(n / total, fr) for fr, n in own.most_common(top)], poll / total


def inclusive(raw_path: str, root: str, top: int) -> tuple[list[tuple[float, str]], float]:
    """(share of the busy samples under ``root``, function) for the ``top`` functions by
    inclusive samples, and the share of the thread's samples idle in poll: only the stacks of
    the thread that runs ``root`` (the daemon's or the worker's loop), so sleeping helper threads
    (pyzmq's garbage collector, the malloc-trim timer) do not count as work."""
    inc: collections.Counter = collections.Counter()
    busy = idle = 0
    for frames, n in _stacks(raw_path):
        if not any(root in fr for fr in frames):
            continue
        if any("poll" in fr.lower() and "zmq" in fr for fr in frames[-2:]):
            idle += n
            continue
        busy += n
        for name in {fr.split(" (")[0] for fr in frames}:
            inc[name] += n
    busy = max(busy, 1)
    return [(c / busy, name) for name, c in inc.most_common(top)], idle / max(busy + idle, 1)


def _applied(status_endpoint: str) -> int:
    from ps.ops.status import fetch_status

    return int(fetch_status(status_endpoint, timeout_s=5.0).info.get("counter.applied", 0))


@click.command("profile")
@click.option("--d", "dim", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--shm", type=click.Choice(["off", "auto"]), default="off", show_default=True)
@click.option("--credit", type=click.IntRange(1, 64), default=1, show_default=True)
@click.option("--seconds", type=click.FloatRange(min=1), default=5.0, show_default=True)
@click.option("--top", type=click.IntRange(min=1), default=15, show_default=True)
def profile(dim, shm, credit, seconds, top) -> None:
    """Sample a running daemon and worker with py-spy and print where their time goes."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        raise click.ClickException("py-spy is not installed (pip install py-spy, or the bench extra)")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory(prefix="latecomer-profile-") as tmp:
        server = subprocess.Popen(
            [sys.executable, "-m", "ps", "serve", "--bind", "tcp://127.0.0.1:0", "--problem", "synthetic",
             "--problem-opt", f"d={dim}", "--algorithm", "asgd", "--set", "lr=0.001", "--eval-every", "0",
             "--max-time", str(seconds + 120), "--shm", shm, "--log-level", "error"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        procs = [server]
        try:
            line = server.stdout.readline().decode()
            if "listening on" not in line:
                raise click.ClickException(f"the daemon did not start: {line!r}")
            endpoint = line.split()[-1]
            worker = subprocess.Popen(
                [sys.executable, "-m", "ps", "work", "--server", endpoint, "--worker-id", "prof", "--shm", shm,
                 "--credit", str(credit), "--log-level", "error"],
                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            procs.append(worker)
            deadline = time.monotonic() + 60
            while _applied(endpoint) < 50:
                if time.monotonic() > deadline:
                    raise click.ClickException("no updates within 60 s")
                time.sleep(0.2)
            time.sleep(1.0)  # past the inline switch-over and the first allocations
            files = {name: os.path.join(tmp, f"{name}.txt") for name in ("server", "worker")}
            # --subprocesses: `serve` is the front and the daemon (ps/net/supervise.py)
            spies = [subprocess.Popen([spy, "record", "-p", str(p.pid), "-d", str(int(seconds)), "-r", "250",
                                       "--subprocesses", "-f", "raw", "-o", files[name]], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
                     for name, p in (("server", server), ("worker", worker))]
            n0, c0, w0, t0 = _applied(endpoint), server_cpu(server.pid), server_cpu(worker.pid), time.monotonic()
            for s in spies:
                s.wait(timeout=seconds + 60)
            n1, c1, w1, t1 = _applied(endpoint), server_cpu(server.pid), server_cpu(worker.pid), time.monotonic()
            n = max(n1 - n0, 1)
            click.echo(f"d={dim:,} shm={shm} credit={credit}: {n / (t1 - t0):,.0f} updates/s while sampled; "
                       f"CPU per update: server {1e3 * (c1 - c0) / n:.3f} ms, worker {1e3 * (w1 - w0) / n:.3f} ms")
            for name, path in files.items():
                if not os.path.exists(path):
                    click.echo(f"{name}: py-spy wrote nothing (permissions?)")
                    continue
                frames, poll = top_frames(path, top)
                click.echo(f"\n{name}: {100 * poll:.0f} % of samples waiting in poll; own samples:")
                for share, fr in frames:
                    click.echo(f"  {100 * share:5.1f} %  {fr}")
                root = "Daemon.run" if name == "server" else "Worker.run"
                funcs, idle = inclusive(path, root, 3 * top)
                click.echo(f"{name}, the thread of {root}: {100 * idle:.0f} % idle in poll; of its busy samples, "
                           "inclusive (a function and what it calls):")
                for share, fr in funcs:
                    if share < 0.995:  # the frames every busy sample holds (main, click, the loop) say nothing
                        click.echo(f"  {100 * share:5.1f} %  {fr}")
        finally:
            server.send_signal(signal.SIGTERM)
            reap_popen(procs[1:], grace=5)
            reap_popen(procs[:1], grace=5)


if __name__ == "__main__":
    profile()
