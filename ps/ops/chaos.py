"""Chaos run: a real server and real workers, killed, frozen, thawed and restarted at random.

``latecomer chaos`` starts a server with a state directory and N worker processes on loopback,
then for a set time kills (-9), freezes (SIGSTOP), resumes (SIGCONT) and restarts random
workers, and once kills the server with -9 and starts it again on the same state directory.
At the end it drains the server and prints a verdict:

1. every issued job is accounted for:
   issued = applied + dropped + lost + failed + cancelled + rejected + outstanding
   (late replies answer jobs already settled as lost or cancelled: counted apart);
2. no applied update was lost across the server restart (the restarted server resumed at the
   step its journal held, and no step was applied twice);
3. the final iterate equals the exact replay of the journal, bit for bit.
"""

from __future__ import annotations

import os
import random
import select
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from ps.journal.statefiles import SUMMARY_BYTES, read_json, read_npy
from ps.ops.children import reap, spawn
from ps.ops.report import read_events


@dataclass
class ChaosReport:
    duration_s: float
    worker_kills: int = 0
    freezes: int = 0
    thaws: int = 0
    worker_restarts: int = 0
    server_kills: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    outstanding: int = 0
    version: int = 0
    detect_s: list[float] = field(default_factory=list)  # worker kill -> its job written off
    resume_s: float | None = None  # server kill -> first update applied by the new server
    resumed_at: int | None = None
    logged_at_crash: int | None = None
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())

    def render(self) -> str:
        c = self.counters
        lines = [
            f"chaos run of {self.duration_s:.0f} s: {self.worker_kills} worker kills (-9), {self.freezes} freezes, "
            f"{self.thaws} thaws, {self.worker_restarts} worker restarts, {self.server_kills} server kill(s)",
            f"  jobs: issued {c.get('issued')}, applied {c.get('applied')}, dropped {c.get('dropped')}, "
            f"lost {c.get('lost')}, failed {c.get('failed', 0)}, cancelled {c.get('cancelled')}, "
            f"rejected {c.get('rejected')}, "
            f"outstanding {self.outstanding}; late replies {c.get('late')}",
            f"  final step {self.version}; server resumed at step {self.resumed_at} "
            f"(journal held {self.logged_at_crash} at the crash)",
        ]
        if self.detect_s:
            d = np.array(self.detect_s)
            lines.append(f"  dead worker detected after: median {np.median(d):.3f} s, max {d.max():.3f} s "
                         f"({len(d)} kills)")
        if self.resume_s is not None:
            lines.append(f"  training resumed {self.resume_s:.2f} s after the server was killed")
        for name, ok in self.checks.items():
            lines.append(f"  [{'PASS' if ok else 'FAIL'}] {name}")
        lines.append(f"verdict: {'PASS' if self.passed else 'FAIL'}")
        return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Chaos:
    """Drive one chaos run. Every child runs in its own session and is reaped at the end."""

    def __init__(self, *, duration_s: float, workers: int, kills: int, seed: int, state_dir: str | None,
                 problem: tuple[str, dict[str, str]] = ("quadratic", {"d": "64"}),
                 algorithm: tuple[str, dict[str, str]] = ("ordered-momentum", {"lr": "0.1", "beta": "0.3"}),
                 liveness_s: float = 1.5, log=print) -> None:
        if workers < 2:
            raise ValueError("a chaos run needs at least 2 workers")
        self.duration_s = duration_s
        self.n = workers
        self.kills = kills
        self.rng = random.Random(seed)
        self.state = state_dir or tempfile.mkdtemp(prefix="latecomer-chaos-")
        self.events_path = os.path.join(self.state, "events.jsonl")
        self.endpoint = f"tcp://127.0.0.1:{_free_port()}"
        self.problem, self.algorithm = problem, algorithm
        self.liveness_s = liveness_s
        self.log = log
        self.children: list[subprocess.Popen] = []
        self.workers: dict[str, subprocess.Popen] = {}
        self.frozen: set[str] = set()
        self.report = ChaosReport(duration_s=duration_s)

    # ------------------------------------------------------------------ processes
    def _spawn(self, *args: str) -> subprocess.Popen:
        p = spawn(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.children.append(p)
        return p

    def _server(self) -> subprocess.Popen:
        args = ["serve", "--bind", self.endpoint, "--state", self.state, "--problem", self.problem[0],
                "--algorithm", self.algorithm[0], "--batch-size", "1", "--liveness-timeout", str(self.liveness_s),
                "--heartbeat-interval", str(self.liveness_s / 5), "--checkpoint-every", "200",
                "--checkpoint-interval", "5", "--fsync", "batch", "--eval-every", "0", "--log-level", "info"]
        for k, v in self.problem[1].items():
            args += ["--problem-opt", f"{k}={v}"]
        for k, v in self.algorithm[1].items():
            args += ["--set", f"{k}={v}"]
        p = self._spawn(*args)
        self._wait_line(p, b"listening on", 60)
        return p

    def _wait_line(self, p: subprocess.Popen, needle: bytes, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        buf = b""
        while needle not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or p.poll() is not None:
                raise RuntimeError(f"server did not start: {buf[-300:]!r} {p.stderr.read()[-1000:]!r}")
            if select.select([p.stdout], [], [], left)[0]:
                buf += os.read(p.stdout.fileno(), 4096)

    def _worker(self, wid: str) -> subprocess.Popen:
        delay = self.rng.choice(["0.005", "0.01", "0.02", "0.04"])
        p = self._spawn("work", "--server", self.endpoint, "--worker-id", wid, "--delay", delay, "--give-up", "30")
        self.workers[wid] = p
        return p

    def _reap(self) -> None:
        reap(self.children, 10.0)
        for p in self.children:
            for s in (p.stdout, p.stderr):
                s.close()

    # ------------------------------------------------------------------ the run
    def run(self) -> ChaosReport:
        from ps.drivers.replay import replay_run

        rep = self.report
        try:
            server = self._server()
            for i in range(self.n):
                self._worker(f"w{i + 1}")
            t0 = time.monotonic()
            end = t0 + self.duration_s
            server_kill_at = t0 + self.duration_s * self.rng.uniform(0.35, 0.55)
            # spread the worker kills over the run, with freezes and thaws in between
            gap = self.duration_s / (self.kills + 1) / 2
            next_action = t0 + gap
            kill_times: dict[str, float] = {}
            while time.monotonic() < end:
                now = time.monotonic()
                if server_kill_at and now >= server_kill_at:
                    server = self._kill_server(server, replay_run)
                    server_kill_at = 0.0
                if now >= next_action:
                    self._random_action(kill_times)
                    next_action = now + self.rng.uniform(0.5, 1.5) * gap
                time.sleep(0.02)  # the driver's own pacing; no test waits on it
            for wid in list(self.frozen):
                os.killpg(self.workers[wid].pid, signal.SIGCONT)
                rep.thaws += 1
            self.frozen.clear()
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
            for p in self.workers.values():
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            self._verdict(kill_times, replay_run)
        finally:
            self._reap()
        return rep

    def _random_action(self, kill_times: dict[str, float]) -> None:
        rep = self.report
        alive = [w for w, p in self.workers.items() if p.poll() is None and w not in self.frozen]
        if self.frozen and self.rng.random() < 0.5:
            wid = self.rng.choice(sorted(self.frozen))
            os.killpg(self.workers[wid].pid, signal.SIGCONT)
            self.frozen.discard(wid)
            rep.thaws += 1
            self.log(f"  thawed {wid}")
        elif rep.worker_kills < self.kills and len(alive) > 1:
            wid = self.rng.choice(alive)
            p = self.workers[wid]
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
            kill_times[f"{wid}#{rep.worker_kills}"] = time.monotonic()
            rep.worker_kills += 1
            self.log(f"  killed {wid} (-9)")
            self._worker(wid)  # restart it: a new incarnation joins
            rep.worker_restarts += 1
        elif len(alive) > 2:
            wid = self.rng.choice(alive)
            os.killpg(self.workers[wid].pid, signal.SIGSTOP)
            self.frozen.add(wid)
            rep.freezes += 1
            self.log(f"  froze {wid}")

    def _kill_server(self, server: subprocess.Popen, replay_run) -> subprocess.Popen:
        rep = self.report
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
        t_kill = time.monotonic()
        rep.server_kills += 1
        rep.logged_at_crash = replay_run(self.state).version
        self.applied_before = max((e["version"] for e in read_events(self.events_path) if e["ev"] == "applied"),
                                  default=0)
        self.log(f"  killed the server (-9) at step {rep.logged_at_crash}; restarting it")
        server = self._server()
        self.t_server_kill = t_kill
        return server

    def _verdict(self, kill_times: dict[str, float], replay_run) -> None:
        rep = self.report
        summary = read_json(os.path.join(self.state, "summary.json"), "a run summary", max_bytes=SUMMARY_BYTES)
        c = rep.counters = summary["counters"]
        rep.outstanding = summary["outstanding"]
        rep.version = summary["version"]
        ev = read_events(self.events_path)
        rep.checks["every issued job accounted for"] = (
            c["issued"] == c["applied"] + c["dropped"] + c["lost"] + c["failed"] + c["cancelled"] + c["rejected"]
            + rep.outstanding)
        versions = [e["version"] for e in ev if e["ev"] == "applied"]
        if rep.server_kills:
            after = [e for e in ev if e["ev"] == "applied" and e["t"] > self.t_server_kill]
            rep.resumed_at = after[0]["version"] - 1 if after else None
            rep.resume_s = after[0]["t"] - self.t_server_kill if after else None
            rep.checks["no applied update lost across the server restart"] = (
                rep.resumed_at is not None and rep.resumed_at == rep.logged_at_crash
                and rep.logged_at_crash >= self.applied_before)
        rep.checks["no step applied twice"] = len(versions) == len(set(versions)) and max(versions) == rep.version
        replayed = replay_run(self.state)
        recorded = read_npy(os.path.join(self.state, "final_x.npy"))
        rep.checks["final iterate equals the replay of the journal"] = (
            replayed.version == rep.version and np.array_equal(replayed.final_x, recorded))
        # detection: each kill -> the first 'lost' or 'left' event of that worker after it
        for key, t_kill in kill_times.items():
            wid = key.split("#")[0]
            later = [e["t"] for e in ev if e.get("worker_id") == wid and e["ev"] in ("left", "lost")
                     and "t" in e and e["t"] >= t_kill]
            if later:
                rep.detect_s.append(min(later) - t_kill)
