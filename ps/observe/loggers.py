"""Loggers: a run's figures to TensorBoard, Weights & Biases or MLflow (``serve --log-to SPEC``).

Each logger is an :class:`~ps.observe.observer.Observer`. It turns what the daemon hands it into scalars
keyed by the server's version (the step) and records the run's settings as hyper-parameters:

- ``eval/<name>``: each evaluation's figures (loss, accuracy, ...), at the version evaluated;
- at each tick (ps/observe/observer.py, about every 0.5 s): ``server/step_rate``, ``server/workers``,
  ``server/outstanding``; ``age/mean``, ``age/p90``, ``age/max`` of the replies applied since
  the previous tick; ``jobs/lost`` and ``jobs/failed`` (the run's totals so far);
  ``worker/<id>/jobs_per_s`` (jobs done per second since the previous tick, from the worker
  table); ``alg/<name>`` (the algorithm's own figures) and ``lr`` where the algorithm reports one.

The daemon's loop must not wait on a disk or a network: the loop only appends a record to a
bounded queue (:class:`Writer`) whose own thread hands it to the backend. A full queue drops its
oldest record (counted, logged once); ``close`` writes what is queued and closes the backend
within :data:`CLOSE_TIMEOUT_S`. A backend that fails is logged once; the run goes on.

:func:`make_logger` builds one from a ``--log-to`` spec: ``tensorboard:DIR``, ``wandb``,
``wandb:PROJECT``, ``mlflow:URI`` (``file:`` URI, a directory path or ``http(s)://``).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import re
import threading
from typing import Any

from ps.observe.observer import Observer

log = logging.getLogger("latecomer.loggers")

SPEC_FORMS = "tensorboard:DIR, wandb, wandb:PROJECT or mlflow:URI (a file: URI, a directory or http(s)://HOST)"
QUEUE_SIZE = 4096  # records waiting for the writer thread; a full queue drops its oldest
CLOSE_TIMEOUT_S = 30.0  # close waits this long for the queue to be written and the backend closed
NAME_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")


def _missing(extra: str) -> ValueError:
    return ValueError(f"--log-to {extra} needs its package: pip install latecomer[{extra}]")


# --------------------------------------------------------------------------- the writer thread

class Writer:
    """A bounded queue and the thread that empties it into ``backend`` (``open(settings)``,
    ``write(step, scalars)``, ``close()``). :meth:`put` never blocks: when ``size`` records
    wait, the oldest is dropped and counted (``dropped``), with one warning for the run."""

    def __init__(self, backend: Any, name: str, size: int = QUEUE_SIZE) -> None:
        self.backend, self.name, self.size = backend, name, size
        self.queue: collections.deque[tuple] = collections.deque()
        self.cond = threading.Condition()
        self.dropped = 0
        self.failures = 0
        self.written = 0
        self.broken: str | None = None  # why the backend could not be opened: nothing more is written
        self.closing = False
        self.thread = threading.Thread(target=self._loop, name=f"latecomer-{name}", daemon=True)
        self.thread.start()

    def put(self, item: tuple) -> None:
        with self.cond:
            if self.closing:
                return
            if len(self.queue) >= self.size:
                opening = self.queue[0][0] == "open" and len(self.queue) > 1
                del self.queue[1 if opening else 0]  # the oldest write; the backend's opening is kept
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("%s logger: its queue is full (%d records), dropping the oldest (counted; "
                                "logged once)", self.name, self.size)
            self.queue.append(item)
            self.cond.notify()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closing:
                    self.cond.wait()
                if not self.queue:
                    break
                item = self.queue.popleft()
            self._handle(item)
        self._close_backend()

    def _handle(self, item: tuple) -> None:
        if self.broken:
            return
        kind = item[0]
        try:
            if kind == "open":
                self.backend.open(item[1])
            else:
                self.backend.write(item[1], item[2])
                self.written += 1
        except Exception as e:  # noqa: BLE001 - a logger's failure must not stop the run
            if kind == "open":
                self.broken = f"{type(e).__name__}: {e}"
                log.warning("%s logger could not start, nothing is logged there: %s", self.name, self.broken)
                return
            self.failures += 1
            if self.failures == 1:
                log.warning("%s logger: a write failed (later failures are counted, not logged): %s: %s",
                            self.name, type(e).__name__, e)

    def _close_backend(self) -> None:
        if self.broken:
            return
        try:
            self.backend.close()
        except Exception as e:  # noqa: BLE001
            log.warning("%s logger: closing failed: %s: %s", self.name, type(e).__name__, e)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Write what is queued, close the backend. Returns whether that ended within ``timeout``."""
        with self.cond:
            self.closing = True
            self.cond.notify()
        self.thread.join(timeout)
        done = not self.thread.is_alive()
        if not done:
            log.warning("%s logger: still writing after %.0f s, %d records not written", self.name, timeout,
                        len(self.queue))
        if self.dropped or self.failures:
            log.warning("%s logger: %d records dropped (queue full), %d writes failed", self.name, self.dropped,
                        self.failures)
        return done


# --------------------------------------------------------------------------- the observer

def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def tick_scalars(snapshot: dict[str, Any], ages: list[int], prev_jobs: dict[str, tuple[float, int]],
                 now: float) -> dict[str, float]:
    """The scalars of one tick: server figures, the ages applied since the previous tick, the
    totals of lost and failed jobs, each worker's jobs per second since its previous row in
    ``prev_jobs`` (updated: worker -> (time, jobs done)), the algorithm's figures (the
    snapshot's ``alg``, else the ``alg.*`` entries of ``info``)."""
    info = snapshot.get("info", {})
    out: dict[str, float] = {}
    for key, name in (("step_rate", "server/step_rate"), ("workers", "server/workers"),
                      ("outstanding", "server/outstanding"), ("counter.lost", "jobs/lost"),
                      ("counter.failed", "jobs/failed")):
        if _number(info.get(key)) is not None:
            out[name] = float(info[key])
    if ages:
        ordered = sorted(ages)
        out["age/mean"] = sum(ordered) / len(ordered)
        out["age/p90"] = _percentile(ordered, 90)
        out["age/max"] = float(ordered[-1])
    columns = list(snapshot.get("columns", ()))
    if "worker" in columns and "jobs_done" in columns:
        iw, ij = columns.index("worker"), columns.index("jobs_done")
        for row in snapshot.get("rows", ()):
            wid, jobs = str(row[iw]), int(row[ij])
            before = prev_jobs.get(wid)
            prev_jobs[wid] = (now, jobs)
            if before is not None and now > before[0]:
                out[f"worker/{NAME_CHARS.sub('_', wid)}/jobs_per_s"] = (jobs - before[1]) / (now - before[0])
    alg = snapshot.get("alg")  # all of them; info's alg.* entries may be cut by its cap
    if alg is None:
        alg = {k[4:]: v for k, v in info.items() if k.startswith("alg.")}
    for key, v in alg.items():
        if _number(v) is not None:
            out[f"alg/{NAME_CHARS.sub('_', key)}"] = float(v)
    if "alg/lr" in out:
        out["lr"] = out["alg/lr"]
    return out


def _percentile(ordered: list[int], q: float) -> float:
    """numpy's default (linear) percentile of a sorted list."""
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


class ScalarLogger(Observer):
    """The observer every logger is: scalars keyed by the version, handed to a :class:`Writer`."""

    def __init__(self, backend: Any, name: str, queue_size: int = QUEUE_SIZE) -> None:
        self.name = name
        self.backend = backend
        self.writer = Writer(backend, name, queue_size)
        self.ages: list[int] = []
        self.prev_jobs: dict[str, tuple[float, int]] = {}

    def on_start(self, settings: dict[str, Any]) -> None:
        self.writer.put(("open", dict(settings)))

    def on_events(self, events: list[dict[str, Any]], now: float) -> None:
        self.ages.extend(ev["age"] for ev in events if ev.get("ev") == "applied" and "age" in ev)

    def on_evaluation(self, ev: dict[str, float]) -> None:
        scalars = {f"eval/{NAME_CHARS.sub('_', k)}": float(v) for k, v in ev.items()
                   if k not in ("version", "t") and _number(v) is not None}
        if "t" in ev and _number(ev["t"]) is not None:
            scalars["eval/time_s"] = float(ev["t"])
        self.writer.put(("write", int(ev["version"]), scalars))

    def on_tick(self, snapshot: dict[str, Any], now: float) -> None:
        ages, self.ages = self.ages, []
        scalars = tick_scalars(snapshot, ages, self.prev_jobs, now)
        self.writer.put(("write", int(snapshot.get("info", {}).get("version", 0)), scalars))

    def close(self) -> None:
        self.writer.close()


# --------------------------------------------------------------------------- backends

def _hparam(v: Any) -> Any:
    """A setting as a hyper-parameter: numbers, strings and booleans as they are, else its text."""
    return v if isinstance(v, (bool, int, float, str)) else json.dumps(v, default=str)


class TensorBoardBackend:
    """``torch.utils.tensorboard.SummaryWriter`` in ``log_dir``: scalars, the settings as
    hyper-parameters (the HParams tab) and as a text summary."""

    def __init__(self, log_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
        except ImportError:
            raise _missing("tensorboard") from None
        self.SummaryWriter = SummaryWriter
        self.log_dir = log_dir
        self.sw = None

    def open(self, settings: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        self.sw = self.SummaryWriter(log_dir=self.log_dir)
        for summary in hparams({k: _hparam(v) for k, v in settings.items()}, {}):
            self.sw.file_writer.add_summary(summary)
        self.sw.add_text("settings", "\n".join(f"    {k} = {v!r}" for k, v in settings.items()), 0)
        log.info("tensorboard: logging to %s (tensorboard --logdir %s)", self.log_dir, self.log_dir)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for name, v in scalars.items():
            self.sw.add_scalar(name, v, step)

    def close(self) -> None:
        if self.sw is not None:
            self.sw.close()


def _wandb_key_configured() -> bool:
    """Whether W&B has an API key here: WANDB_API_KEY, or a netrc entry for its host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbBackend:
    """A W&B run in ``project``. Its mode: WANDB_MODE where set, else online with an API key and
    offline without one (the run's directory is logged; ``wandb sync DIR`` uploads it later).
    Every scalar's x-axis is ``version`` (the server's step): evaluations arrive after ticks of
    later versions, which W&B's own step would refuse."""

    def __init__(self, project: str) -> None:
        try:
            import wandb
        except ImportError:
            raise _missing("wandb") from None
        self.wandb = wandb
        self.project = project
        self.mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_key_configured() else "offline")
        self.run = None

    def open(self, settings: dict[str, Any]) -> None:
        wandb = self.wandb
        self.run = wandb.init(project=self.project, config={k: _hparam(v) for k, v in settings.items()},
                              mode=self.mode, name=str(settings.get("run_id") or "") or None, reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True))
        self.run.define_metric("version")
        self.run.define_metric("*", step_metric="version")
        where = getattr(getattr(self.run, "settings", None), "sync_dir", None) or self.run.dir
        if self.mode in ("offline", "dryrun"):
            log.info("wandb: offline run in %s (upload it with: wandb sync %s)", where, where)
        else:
            log.info("wandb: run %s (%s mode), local files in %s", getattr(self.run, "url", None) or self.run.id,
                     self.mode, where)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({"version": step, **scalars})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def mlflow_uri(target: str) -> str:
    """A ``mlflow:`` spec's tracking URI: ``file:``, ``http(s)://`` as they are, a path as a ``file:`` URI."""
    from pathlib import Path

    scheme = target.partition(":")[0].lower() if re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*:", target) else ""
    if scheme in ("http", "https"):
        if not re.match(r"^https?://[^/\s]+", target):
            raise ValueError(f"--log-to mlflow:{target}: expected http(s)://HOST[:PORT]")
        return target
    if scheme == "file":
        return target
    if scheme and len(scheme) > 1:  # a one-letter scheme is a Windows drive
        raise ValueError(f"--log-to mlflow:{target}: unknown scheme {scheme!r}; expected {SPEC_FORMS}")
    return Path(target).expanduser().resolve().as_uri()


class MlflowBackend:
    """An MLflow run in the experiment MLFLOW_EXPERIMENT_NAME (default ``latecomer``) of the
    tracking URI: the settings as params, the scalars as metrics with the version as step."""

    def __init__(self, uri: str) -> None:
        try:
            from mlflow.tracking import MlflowClient  # mlflow or mlflow-skinny
        except ImportError:
            raise _missing("mlflow") from None
        self.MlflowClient = MlflowClient
        self.uri = uri
        self.client = None
        self.run_id: str | None = None

    def open(self, settings: dict[str, Any]) -> None:
        import time

        from mlflow.entities import Param

        if self.uri.startswith("file:"):  # MLflow 3 keeps its file store only on request
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = client = self.MlflowClient(self.uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "latecomer"
        exp = client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(name)
        run = client.create_run(exp_id, run_name=str(settings.get("run_id") or "") or None,
                                tags={"latecomer.started": str(time.time())})
        self.run_id = run.info.run_id
        params = [Param(re.sub(r"[^A-Za-z0-9_.\-/ ]", "_", k), str(_hparam(v))[:6000]) for k, v in settings.items()]
        for i in range(0, len(params), 100):  # MLflow's cap per batch
            client.log_batch(self.run_id, params=params[i:i + 100])
        log.info("mlflow: run %s in experiment %r at %s", self.run_id, name, self.uri)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        metrics = [Metric(k, v, ms, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)


# --------------------------------------------------------------------------- specs

def parse_spec(spec: str) -> tuple[str, str]:
    """``(kind, target)`` of a ``--log-to`` spec; ValueError (one line) for a bad one."""
    kind, sep, target = (spec or "").strip().partition(":")
    kind, target = kind.strip().lower(), target.strip()
    if kind == "tensorboard" and target:
        return kind, target
    if kind == "wandb" and (not sep or target):
        if target and not re.fullmatch(r"[A-Za-z0-9_.\-]{1,128}", target):
            raise ValueError(f"--log-to wandb:{target}: a project name is letters, digits, '_', '-' and '.'")
        return kind, target or os.environ.get("WANDB_PROJECT") or "latecomer"
    if kind == "mlflow" and target:
        return kind, mlflow_uri(target)
    raise ValueError(f"--log-to {spec!r}: expected {SPEC_FORMS}")


PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


def check_spec(spec: str) -> str:
    """Check a ``--log-to`` spec without building its logger (no thread, no heavy import):
    ValueError (one line) for a bad spec or a package not installed. Returns the spec."""
    import importlib.util

    kind, _ = parse_spec(spec)
    module, extra = PACKAGES[kind]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken package
        found = False
    if not found:
        raise _missing(extra)
    return spec


def make_logger(spec: str) -> Observer:
    """The logger of one ``--log-to`` spec. ValueError with a one-line message for a bad spec or a
    package that is not installed (``pip install latecomer[tensorboard|wandb|mlflow]``)."""
    kind, target = parse_spec(spec)
    if kind == "tensorboard":
        return ScalarLogger(TensorBoardBackend(os.path.expanduser(target)), "tensorboard")
    if kind == "wandb":
        return ScalarLogger(WandbBackend(target), "wandb")
    return ScalarLogger(MlflowBackend(target), "mlflow")
