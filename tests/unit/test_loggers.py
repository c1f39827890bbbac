"""ps/observe/loggers.py without a server: --log-to specs, the bounded queue and its thread, the scalars
of a tick, the CLI's one-line errors."""

from __future__ import annotations

import logging
import sys
import threading
import time

import numpy as np
import pytest
from click.testing import CliRunner

from ps.observe import loggers
from ps.observe.loggers import (
    SPEC_FORMS,
    ScalarLogger,
    Writer,
    check_spec,
    make_logger,
    mlflow_uri,
    parse_spec,
    tick_scalars,
)


def test_specs_accepted_forms(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    assert parse_spec("tensorboard:runs/tb") == ("tensorboard", "runs/tb")
    assert parse_spec("wandb") == ("wandb", "latecomer")
    assert parse_spec("wandb:my-proj.1") == ("wandb", "my-proj.1")
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    assert parse_spec("wandb") == ("wandb", "from-env")
    assert parse_spec(f"mlflow:{tmp_path}/mlruns") == ("mlflow", (tmp_path / "mlruns").as_uri())
    assert parse_spec("mlflow:file:///tmp/x") == ("mlflow", "file:///tmp/x")
    assert parse_spec("mlflow:http://127.0.0.1:5000") == ("mlflow", "http://127.0.0.1:5000")
    assert parse_spec("MLflow:https://mlflow.example:443/") == ("mlflow", "https://mlflow.example:443/")


def test_a_relative_mlflow_path_is_an_absolute_file_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert mlflow_uri("mlruns") == (tmp_path / "mlruns").resolve().as_uri()


@pytest.mark.parametrize("spec", ["", "tensorboard", "tensorboard:", "tb:dir", "wandb:", "wandb:a b", "wandb:x/y",
                                  "mlflow", "mlflow:", "mlflow:ftp://host/x", "mlflow:http://", "csv:out"])
def test_a_bad_spec_is_one_line_naming_the_forms(spec):
    with pytest.raises(ValueError) as e:
        parse_spec(spec)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--log-to")
    if not spec.startswith(("wandb:", "mlflow:http")):
        assert SPEC_FORMS in msg or "expected" in msg


@pytest.mark.parametrize("kind", ["tensorboard", "wandb", "mlflow"])
def test_a_missing_package_says_which_extra_to_install(kind, monkeypatch):
    spec = {"tensorboard": "tensorboard:tb", "wandb": "wandb", "mlflow": "mlflow:/tmp/mlruns"}[kind]
    module = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow"}[kind]
    for name in [m for m in sys.modules if m == kind or m.startswith(f"{kind}.") or m.startswith(f"{module}.")]:
        monkeypatch.delitem(sys.modules, name)  # an earlier test may have imported it
    monkeypatch.setitem(sys.modules, kind, None)  # import raises ImportError, as when not installed
    monkeypatch.setitem(sys.modules, module, None)
    for call in (check_spec, make_logger):
        with pytest.raises(ValueError, match=rf"^--log-to {kind} needs its package: pip install latecomer\[{kind}\]$"):
            call(spec)


def test_the_cli_turns_a_bad_spec_into_a_one_line_usage_error():
    from ps.cli.main import main

    for cmd in (["serve", "--log-to", "tensorbored:x"], ["run", "--log-to", "mlflow:"]):
        r = CliRunner().invoke(main, cmd)
        assert r.exit_code == 2, r.output
        lines = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
        assert len(lines) == 1 and "--log-to" in lines[0] and "tensorboard:DIR" in lines[0], r.output


def test_the_cli_says_which_extra_a_missing_package_is_in(monkeypatch):
    from ps.cli.main import main

    monkeypatch.setitem(sys.modules, "wandb", None)
    r = CliRunner().invoke(main, ["serve", "--log-to", "wandb:proj"])
    assert r.exit_code == 2 and "pip install latecomer[wandb]" in r.output, r.output


class Recording:
    """A backend that records, optionally blocked until ``gate`` is set, or failing."""

    def __init__(self, fail_open=False, fail_write=False):
        self.opened, self.writes, self.closed = None, [], False
        self.gate = threading.Event()
        self.gate.set()
        self.fail_open, self.fail_write = fail_open, fail_write
        self.thread_ids = set()

    def open(self, settings):
        self.thread_ids.add(threading.get_ident())
        if self.fail_open:
            raise PermissionError("read-only")
        self.opened = settings

    def write(self, step, scalars):
        self.gate.wait(10)
        self.thread_ids.add(threading.get_ident())
        if self.fail_write:
            raise OSError("disk full")
        self.writes.append((step, scalars))

    def close(self):
        self.closed = True


def test_a_full_queue_drops_the_oldest_counts_and_warns_once_then_close_writes_the_rest(caplog):
    b = Recording()
    b.gate.clear()  # the backend stalls: the queue fills
    w = Writer(b, "test", size=5)
    w.put(("write", 0, {"x": 0.0}))
    deadline = time.monotonic() + 5
    while w.queue and time.monotonic() < deadline:  # the thread took the first one and waits in write
        time.sleep(0.005)
    assert not w.queue
    t0 = time.monotonic()
    for i in range(1, 21):
        w.put(("write", i, {"x": float(i)}))
    assert time.monotonic() - t0 < 1.0  # put never waits for the backend
    assert w.dropped == 15 and len(w.queue) == 5
    b.gate.set()
    assert w.close(timeout=10)
    assert [s for s, _ in b.writes] == [0, 16, 17, 18, 19, 20] and b.closed
    warnings = [r.getMessage() for r in caplog.records if "queue is full" in r.getMessage()]
    assert len(warnings) == 1
    assert any("15 records dropped" in r.getMessage() for r in caplog.records)
    assert threading.get_ident() not in b.thread_ids  # written in the writer's thread
    w.put(("write", 99, {"x": 1.0}))  # after close: ignored
    assert [s for s, _ in b.writes][-1] == 20


def test_a_full_queue_keeps_the_backends_opening():
    b = Recording()
    b.gate.clear()
    w = Writer(b, "test", size=3)
    w.put(("write", 0, {"x": 0.0}))  # taken by the thread, which waits in write
    deadline = time.monotonic() + 5
    while w.queue and time.monotonic() < deadline:
        time.sleep(0.005)
    w.put(("open", {"a": 1}))  # (the observer sends it first; here it waits behind a stalled write)
    for i in range(1, 6):
        w.put(("write", i, {"x": 1.0}))
    assert [item[0] for item in w.queue] == ["open", "write", "write"] and w.dropped == 3
    b.gate.set()
    assert w.close(timeout=10)
    assert b.opened == {"a": 1} and [s for s, _ in b.writes] == [0, 4, 5]


def test_a_backend_that_cannot_open_is_logged_once_and_writes_nothing(caplog):
    b = Recording(fail_open=True)
    w = Writer(b, "test")
    w.put(("open", {"a": 1}))
    for i in range(10):
        w.put(("write", i, {"x": 1.0}))
    assert w.close(timeout=10)
    assert w.broken and "PermissionError" in w.broken and b.writes == [] and not b.closed
    assert sum("could not start" in r.getMessage() for r in caplog.records) == 1


def test_failing_writes_are_counted_and_logged_once(caplog):
    b = Recording(fail_write=True)
    w = Writer(b, "test")
    w.put(("open", {}))
    for i in range(7):
        w.put(("write", i, {"x": 1.0}))
    assert w.close(timeout=10)
    assert w.failures == 7 and b.closed
    assert sum("a write failed" in r.getMessage() for r in caplog.records) == 1


def test_close_gives_up_after_its_timeout_on_a_stuck_backend(caplog):
    b = Recording()
    b.gate.clear()
    w = Writer(b, "test")
    w.put(("write", 1, {"x": 1.0}))
    w.put(("write", 2, {"x": 1.0}))
    t0 = time.monotonic()
    assert not w.close(timeout=0.3)
    assert time.monotonic() - t0 < 5
    assert any("still writing" in r.getMessage() for r in caplog.records)
    b.gate.set()


def test_tick_scalars_ages_workers_counts_and_algorithm_figures():
    ages = [0, 1, 1, 2, 3, 5, 8, 13, 0, 2]
    snap = {"info": {"version": 120, "step_rate": 42.5, "workers": 2, "outstanding": 3, "counter.lost": 4,
                     "counter.failed": 1, "alg.lr": 0.025, "alg.m_k": 7.0, "algorithm": "asgd",
                     "alg.bad": float("nan")},
            "columns": ("worker", "device", "jobs_done"), "rows": (("w1", "cpu", 10), ("w/2", "cpu", 4))}
    prev: dict = {}
    first = tick_scalars(snap, ages, prev, now=100.0)
    assert not any(k.startswith("worker/") for k in first)  # no earlier row: no rate yet
    assert first["age/mean"] == pytest.approx(np.mean(ages))
    assert first["age/p90"] == pytest.approx(np.percentile(ages, 90))
    assert first["age/max"] == 13.0
    assert first["server/step_rate"] == 42.5 and first["server/workers"] == 2 and first["server/outstanding"] == 3
    assert first["jobs/lost"] == 4 and first["jobs/failed"] == 1
    assert first["alg/lr"] == first["lr"] == 0.025 and first["alg/m_k"] == 7.0 and "alg/bad" not in first
    snap["rows"] = (("w1", "cpu", 30), ("w/2", "cpu", 5))
    second = tick_scalars(snap, [], prev, now=102.0)
    assert second["worker/w1/jobs_per_s"] == pytest.approx(10.0)
    assert second["worker/w_2/jobs_per_s"] == pytest.approx(0.5)
    assert not any(k.startswith("age/") for k in second)  # nothing applied since the last tick
    snap["alg"] = {"lr": 0.5, "m_k": 3}  # the snapshot's own (uncapped) figures win over info's alg.*
    third = tick_scalars(snap, [], prev, now=103.0)
    assert third["alg/lr"] == third["lr"] == 0.5 and third["alg/m_k"] == 3.0 and "alg/bad" not in third


def test_the_observer_keys_evaluations_by_their_version_and_ticks_by_the_current_one():
    b = Recording()
    obs = ScalarLogger(b, "test")
    obs.on_start({"algorithm": "asgd", "alg.lr": 0.1})
    obs.on_events([{"ev": "applied", "age": 2}, {"ev": "issued"}, {"ev": "applied", "age": 4}], 1.0)
    obs.on_tick({"info": {"version": 57, "step_rate": 3.0}, "columns": (), "rows": ()}, 1.0)
    obs.on_evaluation({"version": 50, "t": 1.5, "loss": 0.25, "accuracy": 0.75})
    obs.close()
    assert b.opened == {"algorithm": "asgd", "alg.lr": 0.1}
    assert b.writes[0] == (57, {"server/step_rate": 3.0, "age/mean": 3.0, "age/p90": pytest.approx(3.8),
                                "age/max": 4.0})
    assert b.writes[1] == (50, {"eval/loss": 0.25, "eval/accuracy": 0.75, "eval/time_s": 1.5})
    assert b.closed


@pytest.mark.parametrize("kind,backend", [("tensorboard", "TensorBoardBackend"), ("wandb", "WandbBackend"),
                                          ("mlflow", "MlflowBackend")])
def test_make_logger_builds_each_kind_without_touching_its_target(kind, backend, tmp_path):
    pytest.importorskip({"tensorboard": "torch.utils.tensorboard"}.get(kind, kind),
                        reason=f"pip install latecomer[{kind}]")
    spec = {"tensorboard": f"tensorboard:{tmp_path}/tb", "wandb": "wandb:p", "mlflow": f"mlflow:{tmp_path}/ml"}[kind]
    obs = make_logger(spec)
    assert isinstance(obs, ScalarLogger) and isinstance(obs.backend, getattr(loggers, backend))
    assert obs.writer.close(timeout=10)  # never opened: nothing written, nothing made
    assert list(tmp_path.iterdir()) == []


def test_loggers_say_where_they_write_under_run_s_warning_level(tmp_path, monkeypatch):
    pytest.importorskip("torch.utils.tensorboard", reason="pip install latecomer[tensorboard]")
    from ps.cli.options import add_loggers

    monkeypatch.setattr(loggers.log, "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger(), "level", logging.WARNING)
    added = []

    class D:
        def add_observer(self, obs):
            added.append(obs)

    add_loggers(D(), ())
    assert not loggers.log.isEnabledFor(logging.INFO)  # no logger: nothing changed
    add_loggers(D(), (f"tensorboard:{tmp_path}/tb",))
    assert loggers.log.isEnabledFor(logging.INFO) and len(added) == 1
    added[0].close()
