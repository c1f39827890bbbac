"""Evaluations off the server's loop: one at a time, in a thread, on a copy of the iterate.

The daemon's loop must go on answering heartbeats, replies and readys while a problem
evaluates (a ResNet-18 with its BatchNorm statistics re-estimated takes seconds on a CPU; a
loop that waits that long makes every worker say ``server silent ... reconnecting``). So the
loop hands :class:`Evaluator` the version and a copy of its iterate and goes on; the thread
calls ``problem.evaluate`` on that copy, and the loop takes the figures on a later pass
(:meth:`Evaluator.take`), in the loop's own thread, where they are recorded as before. The
figures are those of exactly the version the evaluation names, whatever the core did
meanwhile; nothing that is journaled depends on them, so replay is unchanged.

One evaluation runs at a time. When the next one is due while one is still running, it
starts when that one ends, at the version the core has then: the loop never queues copies of
the iterate, and a run whose evaluation is slower than ``eval_every`` steps of training is
evaluated as often as the evaluation allows (logged once).

The problem is used by this thread only while it evaluates (the server computes no gradient;
``latecomer replay`` and the simulator evaluate in their own thread, synchronously). An
exception in ``evaluate`` is raised again by :meth:`Evaluator.take`, in the loop, as a
synchronous evaluation raised it.

:class:`RunEvaluations` is the daemon's side: the earlier sessions' evaluations (``EvalLog``),
when the next one starts, and each recorded (the log, observers, progress) when it ends.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from typing import Any

import numpy as np

__all__ = ["EvalLog", "Evaluator", "RunEvaluations"]

log = logging.getLogger("latecomer.server")


class Evaluator:
    """Run ``problem.evaluate`` in a background thread, one evaluation at a time.

    Args:
        problem: anything with ``evaluate(x) -> {name: number}``.
        clock: the monotonic clock (how long an evaluation took, :attr:`last_s`).
    """

    def __init__(self, problem: Any, clock: Any = time.monotonic) -> None:
        self.problem = problem
        self.clock = clock
        self._thread: threading.Thread | None = None
        self._result: dict[str, float] | BaseException | None = None
        self.version: int | None = None  # the version being evaluated (None: idle)
        self.started = 0  # evaluations started
        self.last_s: float | None = None  # seconds the last finished evaluation took
        self.late = 0  # evaluations that were due while the one before still ran (the daemon counts them)
        self.late_for = -1  # the version of the running evaluation that made one late

    @property
    def busy(self) -> bool:
        """An evaluation is running, or finished and not yet taken."""
        return self._thread is not None

    def submit(self, version: int, t: float, x: np.ndarray) -> None:
        """Evaluate ``x`` (copied now) as the iterate of ``version`` at run time ``t``.

        Raises:
            RuntimeError: an evaluation is still busy.
        """
        if self._thread is not None:
            raise RuntimeError(f"an evaluation (of step {self.version}) is still running")
        copy = np.array(x, copy=True)  # the iterate it names, whatever the core does next
        self.version, self._result = int(version), None
        self._thread = threading.Thread(target=self._run, args=(int(version), float(t), copy),
                                        name=f"latecomer-evaluate-{version}", daemon=True)
        self.started += 1
        self._thread.start()

    def _run(self, version: int, t: float, x: np.ndarray) -> None:
        t0 = self.clock()
        try:
            figures = self.problem.evaluate(x)
            self._result = {"t": t, "version": float(version), **{k: float(v) for k, v in figures.items()}}
        except BaseException as e:  # noqa: BLE001 - raised again in the loop by take()
            self._result = e
        self.last_s = self.clock() - t0

    def take(self) -> dict[str, float] | None:
        """The figures of the evaluation that finished (``t``, ``version`` and the problem's),
        once; None while it runs or when none was started.

        Raises:
            Exception: whatever the problem's ``evaluate`` raised.
        """
        th = self._thread
        if th is None or th.is_alive():
            return None
        th.join()
        result, self._thread, self._result, self.version = self._result, None, None, None
        if isinstance(result, BaseException):
            raise result
        return result

    def wait(self, timeout: float | None = None) -> dict[str, float] | None:
        """:meth:`take`, after waiting at most ``timeout`` seconds (None: as long as it takes)
        for the running evaluation to end."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.take()


class EvalLog:
    """``evaluations.jsonl`` in a state directory: every evaluation of every session of the run,
    one JSON line each, appended and flushed as it is recorded (not fsynced: nothing replays from
    it). A resumed run starts from the lines of the versions before its own (a crash's torn last
    line is skipped), so its summary.json and ``latecomer report`` hold the whole run, and its
    ``t`` goes on from the last one recorded (training time, not counting the time the server
    was down)."""

    NAME = "evaluations.jsonl"

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, self.NAME)
        self.f: Any = None
        self.skipped = 0

    def load(self, before_version: int) -> list[dict[str, float]]:
        """The recorded evaluations of versions before ``before_version``, in order."""
        out: list[dict[str, float]] = []
        try:
            with open(self.path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return out
        for line in lines:
            try:
                ev = json.loads(line)
                ok = isinstance(ev, dict) and "version" in ev and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in ev.values())
            except ValueError:
                ok = False
            if not ok or not float(ev["version"]).is_integer() or not math.isfinite(float(ev.get("t", 0.0))):
                self.skipped += 1
                continue
            if ev["version"] < before_version:
                out.append(ev)
        return out

    def append(self, ev: dict[str, float]) -> None:
        try:
            if self.f is None:
                self.f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open for the run
            self.f.write(json.dumps(ev) + "\n")
            self.f.flush()
        except (OSError, ValueError):  # a full disk: the summary still has it; the journal holds the run
            pass

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


class RunEvaluations:
    """The evaluations of the daemon's run (ps/drivers/daemon.py), from its loop's thread.

    ``evaluations`` are a resumed run's recorded ones, then this session's, in order. It reads
    the daemon's core, clock, observers, ``on_progress``, ``eval_every``, ``training_started_at``
    and (sharded) ``sharded`` at the time of each use.
    """

    def __init__(self, daemon: Any, problem: Any, clock: Any) -> None:
        self.daemon = daemon
        self.evaluations: list[dict[str, float]] = self._prior()  # a resumed run's, then ours
        self.evaluator = Evaluator(problem, clock)  # evaluations run off the loop
        self.last_version = -1  # the version of the evaluation started last

    def _prior(self) -> list[dict[str, float]]:
        """With a state directory, its evaluations.jsonl (:class:`EvalLog`): the evaluations of the
        sessions before this one, of versions before the recovered one."""
        persist = self.daemon.persist
        self.eval_log, self.t_offset = None, 0.0
        if persist is None:
            return []
        self.eval_log = EvalLog(persist.state_dir)
        prior = self.eval_log.load(self.daemon.core.version)
        if self.eval_log.skipped:
            log.warning("%s: %d damaged lines skipped", self.eval_log.path, self.eval_log.skipped)
        self.t_offset = float(prior[-1]["t"]) if prior else 0.0
        return prior

    def run_time(self) -> float:
        """Seconds since the first job was issued (0 before): an evaluation's ``t``; a resumed run
        goes on from its last recorded evaluation's."""
        d = self.daemon
        if d.training_started_at is None and d.core.started:
            d.training_started_at = d.clock()
        own = 0.0 if d.training_started_at is None else d.clock() - d.training_started_at
        return self.t_offset + own

    def evaluate(self) -> None:
        """Start an evaluation of the current iterate, off the loop: the figures are recorded
        (:meth:`collect`) when it ends, named by the version it started at, with ``t`` of its
        start (counted from the first job issued, 0 before). A sharded server evaluates the
        iterate last gathered from its shards: if it has none of the current version it asks for
        it, and starts the evaluation when it has come (ps/drivers/coordinator.py)."""
        d = self.daemon
        version = d.core.version
        self.last_version = version
        if d.sharded is not None and d.sharded.gather_for(version):
            return
        self.start(version, d.params())

    def start(self, version: int, x: np.ndarray) -> None:
        if self.evaluator.busy:  # a gathered iterate came while one ran (rare): this one waits
            self.record(self.evaluator.wait())
        self.evaluator.submit(version, self.run_time(), x)

    def record(self, ev: dict[str, float] | None, *, progress: bool = True) -> None:
        d = self.daemon
        if ev is not None:
            self.evaluations.append(ev)
            if self.eval_log is not None:
                self.eval_log.append(ev)
            if d.observers:
                d.observers.call("on_evaluation", ev)
            if progress and d.on_progress:
                d.on_progress(d, ev)

    def collect(self) -> bool:
        """Record the evaluation that ended, if one did. Returns whether one did."""
        ev = self.evaluator.take()
        self.record(ev)
        return ev is not None

    def start_due(self) -> None:
        """Every ``eval_every`` versions: the next evaluation, unless one still runs (or waits for
        the shards' iterate); a slow one is counted, and logged once."""
        d, evaluator = self.daemon, self.evaluator
        if d.eval_every and d.core.version >= self.last_version + d.eval_every:
            if not evaluator.busy and (d.sharded is None or d.sharded.gathering is None):
                self.evaluate()
            elif evaluator.busy and evaluator.late_for != self.last_version:
                evaluator.late_for = self.last_version  # counted once per evaluation
                evaluator.late += 1
                if evaluator.late == 1:
                    log.info("an evaluation is slower than %d steps of training: the next one starts when the "
                             "last ends", d.eval_every)

    def finish(self) -> None:
        """At shutdown: the evaluation still running, if any, then one of the final iterate (unless
        the last one was of it, and there are two or more)."""
        d = self.daemon
        self.record(self.evaluator.wait())  # the one running, if any
        if d.sharded is not None and self.evaluations and self.evaluations[-1]["version"] != d.sharded.x_version:
            self.last_version = -1  # the iterate gathered last is evaluated
        if self.last_version != d.core.version or len(self.evaluations) < 2:
            self.evaluate()
        self.record(self.evaluator.wait(), progress=False)

    def close(self) -> None:
        if self.eval_log is not None:
            self.eval_log.close()
