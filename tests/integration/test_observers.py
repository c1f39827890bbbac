"""The observer seam (ps/observe/observer.py): a real daemon, a real worker process, an observer that
records what it is handed. Loggers, the dashboard and the Python API are built on it."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from ps.cli.options import training_spec
from ps.drivers.server import ServeOptions, make_daemon
from ps.observe.observer import Observer

pytestmark = pytest.mark.slow

STEPS = 300


class Recorder(Observer):
    wants_issued = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.thread_ids: set[int] = set()

    def _note(self, name, value):
        self.thread_ids.add(threading.get_ident())
        self.calls.append((name, value))

    def on_start(self, settings):
        self._note("start", settings)

    def on_events(self, events, now):
        self._note("events", list(events))

    def on_evaluation(self, ev):
        self._note("evaluation", dict(ev))

    def on_tick(self, snapshot, now):
        self._note("tick", snapshot)

    def close(self):
        self._note("close", None)


class Broken(Observer):
    def on_events(self, events, now):
        raise RuntimeError("a logger's bug")


def test_an_observer_sees_settings_events_evaluations_and_ticks_and_a_broken_one_is_dropped(procs, caplog):
    spec = training_spec("quadratic", ("d=20",), "asgd", ("lr=0.05",), None, default_problem="quadratic",
                         default_algorithm="asgd")
    opts = ServeOptions(max_steps=STEPS, eval_every=100, liveness_timeout=10.0, heartbeat_interval=1.0, seed=3)
    daemon = make_daemon(spec, "tcp://127.0.0.1:0", opts)
    rec, broken = Recorder(), Broken()
    daemon.add_observer(rec)
    daemon.add_observer(broken)
    worker = subprocess.Popen([sys.executable, "-m", "ps", "work", "--server", daemon.endpoint, "--worker-id", "w0"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    procs.children.append(worker)
    try:
        reason = daemon.run()
    finally:
        daemon.close()
    assert reason and daemon.core.version == STEPS
    names = [n for n, _ in rec.calls]
    assert names[0] == "start" and names[-1] == "close" and names.count("close") == 1
    settings = rec.calls[0][1]
    assert settings["algorithm"] == "asgd" and settings["alg.lr"] == 0.05 and settings["problem"] == "quadratic"
    assert settings["problem.d"] == 20 and settings["seed"] == 3
    events = [e for n, v in rec.calls if n == "events" for e in v]
    applied = [e for e in events if e["ev"] == "applied"]
    assert len(applied) == STEPS  # every applied reply, once
    assert any(e["ev"] == "issued" for e in events) and any(e["ev"] == "joined" for e in events)
    evals = [v for n, v in rec.calls if n == "evaluation"]
    assert [e["version"] for e in evals] == [e["version"] for e in daemon.evaluations]
    assert evals[-1]["version"] == STEPS
    ticks = [v for n, v in rec.calls if n == "tick"]
    assert ticks and ticks[-1]["info"]["version"] == STEPS and "w0" in [r[0] for r in ticks[-1]["rows"]]
    assert sum(ticks[-1]["age_counts"].values()) == STEPS
    assert rec.thread_ids == {threading.get_ident()}  # in the loop's thread
    assert broken not in list(daemon.observers) or not daemon.observers
    assert sum("observer Broken failed in on_events and is dropped" in r.getMessage() for r in caplog.records) == 1
