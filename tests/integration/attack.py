"""A harness for hostile-input tests: a real server with two real workers training, an attack
run against it, and the figures every such test checks.

    victim = Victim(procs, tmp_path)                 # serve --state + 2 workers, training
    report = victim.measure(my_attack, seconds=4)    # baseline window, then the attack
    report.check(rss_bound_mb=60)                    # alive, RSS bounded, rate >= half, ...
    victim.finish()                                  # clean stop; nothing accepted lost

``my_attack(endpoint, running)`` is a plain function that attacks ``endpoint`` until
``running()`` turns False (or until it is done) and returns a dict of its own figures. It runs
in a thread of the test process while the harness samples the server's RSS and counts the
updates the real workers get applied.

"Nothing accepted lost" is checked at the end: the server stops cleanly, its summary's
accounting identity holds, and the journal replays bit for bit to the final iterate that the
server wrote (every reply it accepted is in the state it left).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import psutil

from tests.integration.util import daemon_pid, wait_exit, wait_line

Attack = Callable[[str, Callable[[], bool]], dict]


class EventCounter:
    """Counts ``applied`` events in an event log incrementally (reads only what was appended),
    and the real workers (ids ``real*``) written off (``left`` for another reason than bye)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.applied = 0
        self.partial = b""
        self.real_lost: list[str] = []

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.applied
        self.offset += len(chunk)
        data = self.partial + chunk
        lines = data.split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            if b'"applied"' in line and json.loads(line).get("ev") == "applied":
                self.applied += 1
            elif b'"left"' in line and b'"real' in line:
                ev = json.loads(line)
                if ev.get("ev") == "left" and ev.get("reason") != "bye" and str(ev.get("worker_id")).startswith("real"):
                    self.real_lost.append(f"{ev['worker_id']}: {ev.get('reason')}")
        return self.applied


@dataclass
class AttackReport:
    """What happened to the server and the real workers during one attack."""

    rate_before: float  # applied updates/s of the real workers before the attack
    rate_during: float  # ... while it ran
    rss0: int  # server RSS (bytes) just before the attack
    rss_peak: int  # highest RSS sampled during the attack
    rss_after: int  # RSS once the attack's connections are closed (after a short settle)
    alive: bool  # the server process is still running
    seconds: float  # how long the attack ran
    attack: dict = field(default_factory=dict)  # the attack's own figures
    rate_after: float | None = None  # ... once the attack was over and its effects gone (see reference())
    rate_control: float | None = None  # ... after it, with burners using the attacker's CPU (see reference())
    attacker_cores: float = 0.0  # CPU the attacking process used during the attack (cores)

    def reference(self) -> float:
        """The rate the one during the attack is held against: the control's (``rate_control``,
        a window after the attack in which burners used the CPU the attacker used: on a 2-core
        machine an attacker that spins takes a core from the real workers whatever the server
        does, and the control pays the same), else the rate before it, or, when one was
        measured after it too (``rate_after``), the mean of the two. This VM's speed wanders
        by up to 2x over seconds (real workers without a delay, no attack, 1 s windows: 660 to
        1,450 updates/s within 20 s); the mean of a window on each side cancels a drift that is
        linear over the test, where one window before it would stand for whatever moment it hit."""
        if self.rate_control is not None:
            return self.rate_control
        return self.rate_before if self.rate_after is None else 0.5 * (self.rate_before + self.rate_after)

    def summary(self) -> str:
        mb = 2**20
        after = "" if self.rate_after is None else f", {self.rate_after:.0f}/s after"
        if self.rate_control is not None:
            after += f", control {self.rate_control:.0f}/s (burners {self.attacker_cores:.2f} cores)"
        return (f"rate {self.rate_before:.0f}/s -> {self.rate_during:.0f}/s during{after}; "
                f"RSS {self.rss0 / mb:.0f} MiB -> "
                f"peak {self.rss_peak / mb:.0f} MiB, after {self.rss_after / mb:.0f} MiB; {self.seconds:.1f} s; "
                f"attack {self.attack}")

    def check(self, *, rss_bound_mb: float, min_rate_ratio: float = 0.5) -> None:
        """The acceptance figures: alive, RSS within ``rss_bound_mb`` of the baseline during and
        after, and the real workers' rate at least ``min_rate_ratio`` of what it was before
        (:meth:`reference`)."""
        assert self.alive, f"the server died: {self.summary()}"
        bound = rss_bound_mb * 2**20
        assert self.rss_peak - self.rss0 <= bound, f"RSS grew past the bound during the attack: {self.summary()}"
        assert self.rss_after - self.rss0 <= bound, f"RSS stayed past the bound after the attack: {self.summary()}"
        assert self.rate_during >= min_rate_ratio * self.reference(), f"the real workers slowed: {self.summary()}"


# A CPU burner for the control windows: busy for ``share`` of every 10 ms, asleep for the rest.
BURNER = ("import sys, time\nshare = float(sys.argv[1])\nwhile True:\n    t = time.monotonic()\n"
          "    while time.monotonic() - t < share * 0.01:\n        pass\n"
          "    time.sleep(max(0.0, (1.0 - share) * 0.01))\n")


@dataclass
class ControlReport:
    """The real workers' rate in windows with the attack (A) and in control windows (B) in which
    a CPU burner used what the attacker used (its CPU time in the A window before), alternating
    A B A B: what the machine's speed does to both cancels out, what the attack does to the
    server alone remains."""

    attack_rates: list[float] = field(default_factory=list)
    control_rates: list[float] = field(default_factory=list)
    attacker_cores: list[float] = field(default_factory=list)  # CPU the attacker used (cores), per A window
    rss0: int = 0
    rss_peak: int = 0
    rss_after: int = 0
    alive: bool = True
    attacks: list[dict] = field(default_factory=list)
    real_lost: list[str] = field(default_factory=list)  # real workers written off during the windows

    def ratio(self) -> float:
        """The attack windows' mean rate over the control windows' mean."""
        return float(np.mean(self.attack_rates)) / max(float(np.mean(self.control_rates)), 1e-9)

    def summary(self) -> str:
        mb = 2**20
        rates = f"{[round(r) for r in self.attack_rates]}/s vs control {[round(r) for r in self.control_rates]}/s"
        return (f"attack {rates} (ratio {self.ratio():.2f}; attacker {[round(c, 2) for c in self.attacker_cores]} "
                f"cores); RSS {self.rss0 / mb:.0f} MiB -> peak {self.rss_peak / mb:.0f} MiB, "
                f"after {self.rss_after / mb:.0f} MiB; "
                f"real lost {self.real_lost}; attack {self.attacks}")

    def check(self, *, rss_bound_bytes: float, min_ratio: float = 0.5) -> None:
        """Alive, no real worker written off, RSS within ``rss_bound_bytes`` (from the design:
        a per-connection bound x connections) of the baseline, and the rate under attack at
        least ``min_ratio`` of the control's."""
        assert self.alive, f"the server died: {self.summary()}"
        assert not self.real_lost, f"real workers written off: {self.summary()}"
        assert self.rss_peak - self.rss0 <= rss_bound_bytes, f"RSS grew past the bound: {self.summary()}"
        assert self.rss_after - self.rss0 <= rss_bound_bytes, f"RSS stayed past the bound: {self.summary()}"
        assert self.ratio() >= min_ratio, f"the real workers slowed more than the control: {self.summary()}"


class Victim:
    """``latecomer serve --state`` with two real workers (injected delays), training the quadratic."""

    def __init__(self, procs: Any, tmp_path: Any, *, extra_serve: tuple[str, ...] = (), d: int = 32,
                 delays: tuple[str, ...] = ("0.004", "0.01"), algorithm: tuple[str, ...] = (
                     "--algorithm", "asgd", "--set", "lr=0.05"), env: dict | None = None,
                 worker_args: Callable[[int], tuple[str, ...]] | None = None) -> None:
        """``worker_args(i)``: more command-line arguments for real worker ``i`` (1, 2), e.g. its key."""
        self.procs = procs
        self.state = str(tmp_path / "state")
        self.server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--state", self.state, "--problem",
                                  "quadratic", "--problem-opt", f"d={d}", *algorithm, "--max-time", "600",
                                  "--liveness-timeout", "3", "--eval-every", "0", "--log-level", "warning",
                                  *extra_serve, env=env)
        self.endpoint = wait_line(self.server, r"listening on (tcp://\S+)", timeout=60).group(1)
        self.events = EventCounter(os.path.join(self.state, "events.jsonl"))
        self.workers = [procs.start("work", "--server", self.endpoint, "--worker-id", f"real{i}", "--delay", dl,
                                    *(worker_args(i) if worker_args else ()))
                        for i, dl in enumerate(delays, 1)]
        self.wait_applied(50, timeout=60)

    # ---- figures
    def rss(self) -> int:
        """The server's RSS: the serve process and its children (a supervised daemon runs in one)."""
        top = psutil.Process(self.server.pid)
        total = top.memory_info().rss
        for child in top.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.NoSuchProcess:  # a daemon being restarted
                pass
        return total

    def daemon_pid(self) -> int:
        """The pid of the process that owns the server's socket (``serve``'s child when supervised)."""
        return daemon_pid(self.server)

    def alive(self) -> bool:
        return self.server.poll() is None

    def wait_applied(self, n: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.events.poll() < n:
            assert self.alive(), "the server died"
            assert time.monotonic() < deadline, f"only {self.events.applied} updates applied within {timeout} s"
            time.sleep(0.05)  # polling interval of a bounded wait
        return self.events.applied

    def rate(self, seconds: float) -> float:
        """Applied updates per second over a window of ``seconds``, the RSS sampled every 50 ms
        as :meth:`measure` does during an attack (the sampling costs CPU that the workers share:
        the baseline pays it too)."""
        a0, t0 = self.events.poll(), time.monotonic()
        while time.monotonic() - t0 < seconds:
            self.rss()
            time.sleep(0.05)  # sampling interval of the measurement window
        return (self.events.poll() - a0) / (time.monotonic() - t0)

    # ---- one attack
    def measure(self, attack: Attack, *, seconds: float, baseline_s: float = 2.0,
                settle_s: float = 1.5, control_s: float = 5.0) -> AttackReport:
        """Measure the rate for ``baseline_s``, then run ``attack`` for at most ``seconds`` while
        sampling RSS every 50 ms; ``rss_after`` is sampled ``settle_s`` after the attack returned.
        Then, unless ``control_s`` is 0, a control window (as long as the attack, at most
        ``control_s`` and at least 2 s) in which burners use the CPU the attack's process used:
        the rate the one during the attack is held against (AttackReport.reference)."""
        rate_before = self.rate(baseline_s)
        rss0 = self.rss()
        stop = threading.Event()
        out: dict = {}
        errors: list[BaseException] = []

        def run() -> None:
            try:
                out.update(attack(self.endpoint, lambda: not stop.is_set()) or {})
            except BaseException as e:  # reported in the test's thread
                errors.append(e)

        th = threading.Thread(target=run, daemon=True)
        a0, t0, cpu0 = self.events.poll(), time.monotonic(), time.process_time()
        th.start()
        peak = rss0
        while th.is_alive() and time.monotonic() - t0 < seconds and self.alive():
            peak = max(peak, self.rss())
            th.join(0.05)
        stop.set()
        th.join(30)
        elapsed = time.monotonic() - t0
        applied = self.events.poll() - a0
        cores = (time.process_time() - cpu0) / max(elapsed, 1e-9)
        alive = self.alive()
        if alive:
            peak = max(peak, self.rss())
        assert not th.is_alive(), "the attack did not stop within 30 s of being told"
        if errors:
            raise errors[0]
        settle_end = time.monotonic() + settle_s
        while alive and time.monotonic() < settle_end:
            peak = max(peak, self.rss())
            time.sleep(0.05)  # sampling interval
        rss_after = self.rss() if self.alive() else 0
        rate_control = None
        if control_s > 0 and self.alive():
            burners = self.burn(cores)
            try:
                rate_control = self.rate(max(2.0, min(elapsed, control_s)))
            finally:
                for b in burners:
                    b.kill()
                    b.wait(10)
        return AttackReport(rate_before=rate_before, rate_during=applied / max(elapsed, 1e-9), rss0=rss0,
                            rss_peak=peak, rss_after=rss_after, alive=self.alive(), seconds=elapsed, attack=out,
                            rate_control=rate_control, attacker_cores=cores)

    # ---- an attack against a control (A B A B)
    def burn(self, cores: float) -> list[subprocess.Popen]:
        """Burners using ``cores`` of CPU together (at most one core each), reaped by ``procs``."""
        n = max(1, int(np.ceil(cores)))
        ps = [subprocess.Popen([sys.executable, "-c", BURNER, f"{min(1.0, cores / n):.3f}"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
              for _ in range(n if cores > 0.01 else 0)]
        self.procs.children.extend(ps)
        return ps

    def _window(self, seconds: float, report: ControlReport,
                run: Callable[[Callable[[], bool]], Any]) -> tuple[float, float]:
        """The real workers' rate over one window of at most ``seconds`` in which ``run(running)``
        runs in a thread (RSS sampled every 50 ms; the window ends when it returns); returns that
        rate and the window's length, the attacker's CPU in ``report``."""
        stop = threading.Event()
        errors: list[BaseException] = []

        def body() -> None:
            try:
                run(lambda: not stop.is_set())
            except BaseException as e:  # reported in the test's thread
                errors.append(e)

        th = threading.Thread(target=body, daemon=True)
        a0, t0, cpu0 = self.events.poll(), time.monotonic(), time.process_time()
        th.start()
        while time.monotonic() - t0 < seconds and self.alive() and th.is_alive():
            report.rss_peak = max(report.rss_peak, self.rss())
            th.join(0.05)
        stop.set()
        th.join(30)
        elapsed = time.monotonic() - t0
        report.attacker_cores.append((time.process_time() - cpu0) / elapsed)
        assert not th.is_alive(), "the window's work did not stop within 30 s of being told"
        if errors:
            raise errors[0]
        return (self.events.poll() - a0) / elapsed, elapsed

    def compare(self, attack: Attack, *, windows: int = 2, seconds: float = 3.0,
                settle_s: float = 1.5) -> ControlReport:
        """``windows`` pairs of an attack window (``attack`` runs for at most ``seconds``, or until it
        returns: a fresh attack each time) and a control window (burners using the CPU the
        attack's process used in the window before, for as long as that window lasted): the real
        workers' rates in each (ControlReport)."""
        report = ControlReport(rss0=self.rss())
        report.rss_peak = report.rss0
        lost0 = len(self.events.real_lost)
        for _ in range(windows):
            out: dict = {}
            rate, elapsed = self._window(seconds, report, lambda running, out=out: out.update(
                attack(self.endpoint, running) or {}))
            report.attack_rates.append(rate)
            report.attacks.append(out)
            burners = self.burn(report.attacker_cores[-1])
            try:
                report.control_rates.append(self.rate(elapsed))
            finally:
                for b in burners:
                    b.kill()
                    b.wait(10)
        settle_end = time.monotonic() + settle_s
        while self.alive() and time.monotonic() < settle_end:
            report.rss_peak = max(report.rss_peak, self.rss())
            time.sleep(0.05)  # sampling interval
        report.alive = self.alive()
        report.rss_after = self.rss() if report.alive else 0
        self.events.poll()
        report.real_lost = self.events.real_lost[lost0:]
        return report

    # ---- the end
    def finish(self, *, more_updates: int = 100) -> dict:
        """Training still goes on, then a clean stop; returns summary.json after checking that
        nothing accepted was lost (accounting identity, exact replay of the journal)."""
        from ps.drivers.replay import replay_run

        self.wait_applied(self.events.applied + more_updates, timeout=60)
        self.server.send_signal(signal.SIGTERM)
        rc = wait_exit(self.server, timeout=60)
        assert rc == 0, self.server.stderr.read()[-3000:].decode(errors="replace")
        for w in self.workers:
            wait_exit(w, timeout=30)
        with open(os.path.join(self.state, "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
        assert summary["accounted"], summary["counters"]
        replayed = replay_run(self.state)
        assert np.array_equal(replayed.final_x, np.load(os.path.join(self.state, "final_x.npy"))), \
            "the journal replays exactly to the final iterate"
        return summary
