"""latecomer as a library: start, watch and finish a run from a script or a notebook.

::

    import latecomer

    def make(device="cpu"):                       # your own model, in your script or notebook
        return latecomer.TorchProblem(Net, nn.functional.cross_entropy, train, test, device=device)

    with latecomer.start(make, algorithm="asgd", settings={"lr": 0.05}, workers=2, steps=2000) as run:
        for ev in run.evaluations():              # live, one dict per evaluation, ends with the run
            print(ev["version"], ev["loss"], ev["accuracy"])
        summary = run.wait()                      # what summary.json holds
    net = run.model()                             # the trained nn.Module (eval mode)

- :func:`start` starts a server and ``workers`` local worker processes and returns a :class:`Run`
  at once; :func:`train` is ``start`` then :meth:`Run.wait`, the workers reaped, the run returned.
- The server runs in this process, in a thread (``server="thread"``, the default: live figures
  through the observer seam, ps/observe/observer.py), or as a child process (``server="process"``:
  ``latecomer serve``; figures through the status protocol, the summary from summary.json).
- ``problem`` is a spec string (``"digits"``, ``"mymodule:make"``, found from the current
  directory as the CLI finds it) or a callable that returns a :class:`latecomer.TorchProblem` (or
  any Problem). A callable is registered under a local name (``<local>:make#1``) that only this
  process and the processes it forks can load, and the workers are started by forking this
  process (multiprocessing's ``"fork"``) so that they inherit it. No peer on the network can make
  a worker load a local name (problems/trust.py). Forking needs Linux (or another POSIX system
  with ``fork``): on macOS and Windows, put the factory in a module and pass ``"mymodule:make"``.
- Notebooks work the same way (a factory defined in a cell is a callable like any other); the
  workers' and the server's logs go to files in the run's directory (``out``, or a temporary one:
  :attr:`Run.log_dir`).

Every mistake in the arguments is a ``ValueError`` with a one-line message, raised before any
process starts.
"""

from __future__ import annotations

import atexit
import copy
import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from ps.journal.statefiles import SUMMARY_BYTES, read_json, read_npy, read_problem_json
from ps.observe.observer import Observer

log = logging.getLogger("latecomer.api")

SERVERS = ("thread", "process")
STOP_GRACE_S = 30.0  # how long a stopped server may take to finish (drain, final evaluation, outputs)
WORKER_GRACE_S = 5.0  # how long a worker told bye may take to exit before SIGTERM, then as long before SIGKILL
START_TIMEOUT_S = 120.0  # a server process must say where it listens within this
POLL_S = 0.25  # process mode: the status poll period


# --------------------------------------------------------------------------- arguments

@dataclass(frozen=True)
class _Option:
    field: str  # ps.drivers.server.ServeOptions field ("" for the ones handled here)
    flag: str  # `latecomer serve` flag
    check: Callable[[str, Any], Any]


def _positive(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name}: expected a finite number > 0, got {v!r}")
    return float(v)


def _finite(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name}: expected a finite number, got {v!r}")
    return float(v)


def _int(name: str, v: Any, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}: expected an integer >= {lo}, got {v!r}")
    return v


def _choice(*choices: str) -> Callable[[str, Any], str]:
    def check(name: str, v: Any) -> str:
        if v not in choices:
            raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {v!r}")
        return v
    return check


def _dir(name: str, v: Any) -> str:
    if not isinstance(v, (str, os.PathLike)) or not os.path.isdir(v):
        raise ValueError(f"{name}: expected an existing directory, got {v!r}")
    return os.fspath(v)


def _path(name: str, v: Any) -> str:
    if not isinstance(v, (str, os.PathLike)) or not os.fspath(v):
        raise ValueError(f"{name}: expected a path, got {v!r}")
    return os.fspath(v)


#: ``start(**serve_options)``: the other options of ``latecomer serve`` a run may set.
SERVE_OPTIONS: dict[str, _Option] = {
    "liveness_timeout": _Option("liveness_timeout", "--liveness-timeout", _positive),
    "heartbeat_interval": _Option("heartbeat_interval", "--heartbeat-interval", _positive),
    "min_workers": _Option("min_workers", "--min-workers", lambda n, v: _int(n, v, 1)),
    "round_period": _Option("round_period", "--round-period", _positive),
    "events": _Option("events", "--events", _path),
    "keys": _Option("keys_dir", "--keys", _dir),
    "shm": _Option("shm", "--shm", _choice("auto", "any", "off")),
    "wire_dtype": _Option("wire_dtype", "--wire-dtype", _choice("f32", "f16", "bf16")),
    "max_workers": _Option("", "--max-workers", lambda n, v: _int(n, v, 1)),
    "max_workers_per_key": _Option("", "--max-workers-per-key", lambda n, v: _int(n, v, 1)),
    "insecure": _Option("", "--insecure", lambda n, v: bool(v)),
}


@dataclass(frozen=True)
class _Plan:
    """The arguments of :func:`start`, checked."""

    problem: str  # a spec or a local name (<local>:NAME#N)
    problem_options: dict[str, Any]
    algorithm: str
    settings: dict[str, Any]
    workers: int
    delays: tuple[float, ...]
    steps: int | None
    max_time: float | None
    target_loss: float | None
    batch_size: int
    eval_every: int
    seed: int
    out: str | None
    state: str | None
    log_to: tuple[str, ...]
    server: str
    bind: str
    serve: dict[str, Any] = field(default_factory=dict)

    @property
    def local(self) -> bool:
        from problems.loader import is_local

        return is_local(self.problem)


def _problem_spec(problem: Any) -> str:
    from problems.loader import is_local, register_local

    if isinstance(problem, str):
        if not problem or is_local(problem):
            raise ValueError(f"problem: expected a built-in name, 'module:callable' or a callable, got {problem!r}")
        return problem
    if isinstance(problem, type) or not callable(problem):
        raise ValueError(f"problem: expected a spec string or a function returning a problem, got {problem!r}")
    return register_local(problem)


def _scalars(name: str, d: Any) -> dict[str, Any]:
    if d is None:
        return {}
    if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
        raise ValueError(f"{name}: expected a dict of str keys, got {d!r}")
    bad = [k for k, v in d.items() if not isinstance(v, (int, float, str, bool))]
    if bad:
        raise ValueError(f"{name}: {bad[0]!r}: values must be str, int, float or bool")
    return dict(d)


def _delays(delays: Any, workers: int) -> tuple[float, ...]:
    if delays is None:
        return (0.0,)
    values = (delays,) if isinstance(delays, (int, float)) else delays
    try:
        out = tuple(_finite("delays", v) for v in values)
    except TypeError:
        raise ValueError(f"delays: expected seconds per job, one per worker (cycled), got {delays!r}") from None
    if not out or any(d < 0 for d in out):
        raise ValueError(f"delays: expected seconds >= 0, one per worker (cycled), got {delays!r}")
    return out


def _log_specs(log_to: Any) -> tuple[str, ...]:
    specs = (log_to,) if isinstance(log_to, str) else tuple(log_to or ())
    if not all(isinstance(s, str) and s and s.isprintable() for s in specs):
        raise ValueError(f"log_to: expected logger specs such as 'tensorboard:DIR', 'wandb', got {log_to!r}")
    if specs:
        try:
            import ps.observe.loggers
        except ImportError:
            raise ValueError("log_to: this latecomer has no loggers (ps.observe.loggers is missing)") from None
        check = getattr(ps.observe.loggers, "check_spec", None)  # a bad spec, a missing package: before anything starts
        for spec in specs if check is not None else ():
            check(spec)
    return specs


def _plan(problem: Any, *, algorithm: str, settings: Any, workers: Any, steps: Any, max_time: Any, target_loss: Any,
          batch_size: Any, eval_every: Any, seed: Any, out: Any, state: Any, delays: Any, log_to: Any, server: Any,
          bind: Any, problem_options: Any, serve_options: dict[str, Any]) -> _Plan:
    from ps.net.endpoints import check_endpoint

    if not isinstance(algorithm, str) or not algorithm:
        raise ValueError(f"algorithm: expected a name or 'module:Class', got {algorithm!r}")
    unknown = sorted(set(serve_options) - set(SERVE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r} (known: {', '.join(SERVE_OPTIONS)})")
    serve = {k: SERVE_OPTIONS[k].check(k, v) for k, v in serve_options.items()}
    if not isinstance(bind, str):
        raise ValueError(f"bind: expected an endpoint such as tcp://127.0.0.1:0, got {bind!r}")
    bind = check_endpoint(bind, bind=True)  # EndpointError is a ValueError with one line
    workers = _int("workers", workers)
    plan = _Plan(problem=_problem_spec(problem), problem_options=_scalars("problem_options", problem_options),
                 algorithm=algorithm, settings=_scalars("settings", settings), workers=workers,
                 delays=_delays(delays, workers), steps=None if steps is None else _int("steps", steps, 1),
                 max_time=None if max_time is None else _positive("max_time", max_time),
                 target_loss=None if target_loss is None else _finite("target_loss", target_loss),
                 batch_size=32 if batch_size is None else _int("batch_size", batch_size, 1),
                 eval_every=_int("eval_every", eval_every), seed=_int("seed", seed, -(1 << 63)),
                 out=None if out is None else _path("out", out), state=None if state is None else _path("state", state),
                 log_to=_log_specs(log_to), server=_choice(*SERVERS)("server", server), bind=bind, serve=serve)
    if plan.local and plan.workers and not _can_fork():
        raise ValueError("problem: a function of your own needs fork() to reach the workers (Linux); on this system "
                         "put it in a module and pass 'module:function'")
    hb, lt = serve.get("heartbeat_interval", 0.5), serve.get("liveness_timeout", 3.0)
    if serve.get("keys") and plan.workers:
        raise ValueError("keys: local workers have no worker keys: give workers=0 and start workers of your own "
                         "(latecomer work --key ... --server-key ...)")
    if hb >= lt:
        raise ValueError(f"heartbeat_interval: must be smaller than liveness_timeout ({hb:g} >= {lt:g})")
    from ps.net.security import is_loopback_endpoint

    if not serve.get("keys") and not serve.get("insecure") and not is_loopback_endpoint(bind):
        raise ValueError(f"bind: {bind} without keys= would let anyone on the network connect: give keys=DIR "
                         "(`latecomer keys init`) or insecure=True")
    return plan


def _can_fork() -> bool:
    import multiprocessing

    return "fork" in multiprocessing.get_all_start_methods()


# --------------------------------------------------------------------------- child processes

class _Child:
    """A child process (a ``subprocess.Popen`` or a forked ``multiprocessing.Process``) in a
    process group of its own: polled, signalled and reaped one way."""

    def __init__(self, name: str, popen: subprocess.Popen | None = None, process: Any = None) -> None:
        self.name, self.popen, self.process = name, popen, process
        self.pid = popen.pid if popen is not None else process.pid

    def poll(self) -> int | None:
        return self.popen.poll() if self.popen is not None else self.process.exitcode

    def signal(self, sig: int) -> None:
        if self.poll() is None:
            from ps.ops.children import signal_group

            signal_group(self.pid, sig)

    def wait(self, timeout: float | None) -> bool:
        """Whether it exited (and was reaped) within ``timeout`` seconds (None: no bound)."""
        timeout = None if timeout is None else max(0.0, timeout)
        if self.popen is not None:
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        self.process.join(timeout)
        return self.process.exitcode is not None


def _reap(children: list[_Child], grace_s: float = WORKER_GRACE_S) -> None:
    """Each child gets ``grace_s`` to exit by itself (a worker told bye does), then SIGCONT and
    SIGTERM and ``grace_s`` more, then SIGKILL; every one is waited for."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            for c in children:
                if sig == signal.SIGTERM:
                    c.signal(signal.SIGCONT)
                c.signal(sig)
        deadline = time.monotonic() + (grace_s if sig != signal.SIGKILL else 10.0)
        left = [c for c in children if not c.wait(max(0.05, deadline - time.monotonic()))]
        if not left:
            return
        children = left
    log.error("processes %s did not exit after SIGKILL", ", ".join(str(c.pid) for c in children))


def _child_setup(log_path: str, close: tuple[int, ...]) -> None:
    """The first thing a forked child does: a session of its own, the parent's pipes to other
    children closed, stdin/stdout to /dev/null, stderr to its log file, one torch thread (the
    parent's thread pool did not survive the fork)."""
    os.setsid()
    for fd in close:
        _close_fd(fd)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    # plain files on those descriptors: a notebook kernel's streams would hand output to a thread
    # of the parent, which the fork did not copy
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def _forked_worker(config_kw: dict, endpoint_fd: int, log_path: str, close: tuple[int, ...]) -> None:
    """A forked worker's main: wait for the server's endpoint on a pipe (none: exit), then run as
    ``latecomer work`` does, trusting the parent's local factory by its exact name."""
    _child_setup(log_path, close)
    with os.fdopen(endpoint_fd, "r") as f:
        endpoint = f.readline().strip()
    if not endpoint:
        raise SystemExit(0)  # the server did not start
    from ps.observe.log_setup import setup_logging
    from worker.link import WorkerConfig, run_worker

    setup_logging("warning")
    reason = run_worker(WorkerConfig(server=endpoint, **config_kw))
    sys.stderr.write(f"latecomer worker: stopped ({reason})\n")


def _forked_serve(plan: _Plan, out: str, stdout_fd: int, log_path: str, close: tuple[int, ...]) -> None:
    """A local factory's server, forked (the table of local names is inherited): what ``latecomer
    serve --no-supervise`` does with :func:`_serve_argv`'s options, through the functions that
    command calls (ps/drivers/server.py); its "listening on" line goes to ``stdout_fd``."""
    _child_setup(log_path, close)
    os.dup2(stdout_fd, 1)
    os.close(stdout_fd)
    import click

    from ps.core.spec import TrainingSpec
    from ps.drivers.server import log_progress, serve_until_stopped
    from ps.net.supervise import announce
    from ps.observe.log_setup import setup_logging
    from ps.observe.loggers import make_logger

    setup_logging("info")
    # the options as serve reads them back from its flags (str values), as before this process
    # was forked instead of started as a command: the same problem.json and run.json
    spec = TrainingSpec(problem=plan.problem, problem_options=_as_flag_pairs(plan.problem_options),
                        algorithm=plan.algorithm, settings=_as_flag_pairs(plan.settings), max_steps=plan.steps)
    try:
        daemon = _make_daemon(plan, spec)
    except click.ClickException as e:  # one line in the log, as the command prints it
        e.show()
        raise SystemExit(e.exit_code) from None
    for log_spec in plan.log_to:
        daemon.add_observer(make_logger(log_spec))
    daemon.install_signal_handlers()
    announce(daemon)
    daemon.on_progress = log_progress
    reason = serve_until_stopped(daemon, [d for d in (out, plan.state) if d])
    click.echo(f"latecomer: stopped ({reason}) at step {daemon.core.version}")


def _fork(target: Callable, args: tuple) -> Any:
    """``target(*args)`` in a forked child. Daemonic: should this process exit without closing
    its run, multiprocessing terminates the child rather than wait for it."""
    import multiprocessing

    p = multiprocessing.get_context("fork").Process(target=target, args=args, daemon=True)
    p.start()
    return p


def _worker_ids(n: int) -> list[str]:
    return [f"w{i + 1}" for i in range(n)]


def spawn_worker(endpoint: str, wid: str, delay: float, extra: list[str] | tuple[str, ...] = (), *,
                 stderr: Any = subprocess.DEVNULL, give_up_s: float = 10.0) -> subprocess.Popen:
    """A local ``latecomer work`` process (``python -m ps work``, in a process group of its own)
    for the server at ``endpoint``; ``extra``: more ``work`` options (``--allow-problem ...``)."""
    from ps.ops.children import spawn

    return spawn("work", "--server", endpoint, "--worker-id", wid, "--delay", f"{delay:g}", "--give-up",
                 f"{give_up_s:g}", *extra, stderr=stderr)


# --------------------------------------------------------------------------- figures

class _Feed:
    """The evaluations of a run as they come, and whether the run is over."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.done = False
        self.cond = threading.Condition()

    def add(self, ev: dict[str, Any]) -> None:
        with self.cond:
            self.items.append(ev)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()

    def follow(self) -> Iterator[dict[str, Any]]:
        i = 0
        while True:
            with self.cond:
                while len(self.items) <= i and not self.done:
                    self.cond.wait()
                if len(self.items) <= i:
                    return
                ev = self.items[i]
            i += 1
            yield dict(ev)


def _status_dict(info: dict, columns: tuple | list, rows: tuple | list, running: bool) -> dict[str, Any]:
    return {"info": dict(info), "workers": [dict(zip(columns, r, strict=True)) for r in rows], "running": running}


class _Watch(Observer):
    """Thread mode: what the daemon's loop hands its observers, kept for the caller's thread."""

    def __init__(self, daemon: Any, feed: _Feed) -> None:
        from ps.observe.observer import snapshot

        self.daemon, self.feed = daemon, feed
        self.snap = snapshot(daemon)  # before the loop's thread starts
        self.summary: dict[str, Any] | None = None
        self.x: np.ndarray | None = None

    def on_evaluation(self, ev: dict[str, float]) -> None:
        self.feed.add(dict(ev))

    def on_tick(self, snapshot: dict[str, Any], now: float) -> None:
        self.snap = snapshot

    def close(self) -> None:  # in the loop's thread, the daemon whole: the final figures and iterate
        self.summary = self.daemon.summary()
        self.x = np.array(self.daemon.params(), copy=True)
        self.feed.close()


# --------------------------------------------------------------------------- the servers

def _make_daemon(plan: _Plan, spec: Any) -> Any:
    """The daemon of ``plan`` training ``spec`` (ps/drivers/server.py ``make_daemon``, as ``serve``
    makes it); a mistake it finds in them is a ``click.ClickException``."""
    from problems.trust import Allowed
    from ps.drivers.server import ServeOptions, StateOptions, make_daemon

    caps = {k: plan.serve[k] for k in ("max_workers", "max_workers_per_key") if k in plan.serve}
    fields = {SERVE_OPTIONS[k].field: v for k, v in plan.serve.items() if SERVE_OPTIONS[k].field}
    opts = ServeOptions(batch_size=plan.batch_size, max_steps=plan.steps, max_time=plan.max_time,
                        target_loss=plan.target_loss, eval_every=plan.eval_every, seed=plan.seed,
                        caps=caps, **{"min_workers": max(1, plan.workers), **fields})
    return make_daemon(spec, plan.bind, opts, state=StateOptions(plan.state) if plan.state else None,
                       allowed=Allowed().naming(problem=spec.problem, algorithm=spec.algorithm))


class _ThreadServer:
    """The daemon (ps/drivers/server.py ``make_daemon``) run in a thread of this process."""

    mode = "thread"

    def __init__(self, plan: _Plan, feed: _Feed) -> None:
        import click

        from ps.core.spec import TrainingSpec

        spec = TrainingSpec(problem=plan.problem, problem_options=dict(plan.problem_options),
                            algorithm=plan.algorithm, settings=dict(plan.settings), max_steps=plan.steps)
        try:
            self.daemon = _make_daemon(plan, spec)
        except click.ClickException as e:
            raise ValueError(e.format_message().replace("Invalid value for ", "")) from None
        self.dirs = [d for d in (plan.out, plan.state) if d]
        self.watch = _Watch(self.daemon, feed)
        self.daemon.add_observer(self.watch)
        try:
            for spec_ in plan.log_to:
                from ps.observe.loggers import make_logger

                self.daemon.add_observer(make_logger(spec_))
        except ValueError:
            self.daemon.close()
            raise
        self.endpoint = self.daemon.endpoint
        self.error: BaseException | None = None
        self.reason: str | None = None
        self.thread = threading.Thread(target=self._serve, name="latecomer-server", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _serve(self) -> None:
        from ps.drivers.server import serve_until_stopped

        try:
            self.reason = serve_until_stopped(self.daemon, self.dirs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's wait()
            self.error = e
            self.watch.feed.close()

    def running(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        if self.daemon.stopping is None:
            self.daemon.stopping = "stopped from Python"  # read by the loop within 100 ms

    def join(self, timeout: float | None) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def kill(self) -> None:  # a thread cannot be killed: it is a daemon thread, it ends with the process
        log.error("the server thread did not finish within %.0f s", STOP_GRACE_S)

    def status(self) -> dict[str, Any]:
        s = self.watch.snap
        return _status_dict(s["info"], s["columns"], s["rows"], self.running())

    def summary(self) -> dict[str, Any]:
        """summary.json as written (with ``out``/``state``), else the same dict taken at the close."""
        if self.error is not None:
            raise RuntimeError(f"the server failed: {type(self.error).__name__}: {self.error}") from self.error
        for d in self.dirs:
            try:  # the checked reader: bounded size and depth (StateError is a ValueError)
                return read_json(os.path.join(d, "summary.json"), "a run summary", max_bytes=SUMMARY_BYTES)
            except ValueError:
                continue
        return self.watch.summary

    def final(self) -> tuple[np.ndarray, Any]:
        """The final iterate and the problem (already built here)."""
        self.summary()
        return self.watch.x, self.daemon.problem


def _flag_value(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else repr(v) if isinstance(v, float) else str(v)


def _as_flag_pairs(values: dict[str, Any]) -> dict[str, str]:
    """``values`` as ``serve`` reads them from ``KEY=VALUE`` flags (ps/cli/options.py ``parse_pairs``)."""
    out = {}
    for k, v in values.items():
        key, _, val = f"{k}={_flag_value(v)}".partition("=")
        out[key.strip()] = val.strip()
    return out


def _serve_argv(plan: _Plan, out: str) -> list[str]:
    """``latecomer serve`` options for ``plan``."""
    argv = ["serve", "--bind", plan.bind, "--problem", plan.problem, "--algorithm", plan.algorithm,
            "--batch-size", str(plan.batch_size), "--eval-every", str(plan.eval_every), "--seed", str(plan.seed),
            "--min-workers", str(max(1, plan.workers)), "--out", out]
    for k, v in plan.problem_options.items():
        argv += ["--problem-opt", f"{k}={_flag_value(v)}"]
    for k, v in plan.settings.items():
        argv += ["--set", f"{k}={_flag_value(v)}"]
    for flag, v in (("--max-steps", plan.steps), ("--max-time", plan.max_time), ("--target-loss", plan.target_loss),
                    ("--state", plan.state)):
        if v is not None:
            argv += [flag, _flag_value(v)]
    for spec in plan.log_to:
        argv += ["--log-to", spec]
    for k, v in plan.serve.items():
        opt = SERVE_OPTIONS[k]
        if k == "insecure":
            argv += [opt.flag] if v else []
        elif k != "min_workers":
            argv += [opt.flag, _flag_value(v)]
        else:
            argv[argv.index("--min-workers") + 1] = str(v)
    return argv


class _ProcessServer:
    """The server as a child process: ``latecomer serve`` spawned for a spec string, this process
    forked for a local factory (:func:`_forked_serve`). Figures through the status protocol; the
    summary and iterate from ``out``."""

    mode = "process"

    def __init__(self, plan: _Plan, feed: _Feed, out: str, log_dir: str, close: tuple[int, ...] = ()) -> None:
        self.plan, self.feed, self.out = plan, feed, out
        self.log_path = os.path.join(log_dir, "server.log")
        # A local factory's server is this process forked: unsupervised, since the supervisor's
        # daemon is a new program that could not inherit the local factory (ps/net/supervise.py).
        rfd, wfd = os.pipe()
        if plan.local:
            self.child = _Child("server", process=_fork(_forked_serve, (plan, out, wfd, self.log_path, (rfd, *close))))
            os.close(wfd)
            stdout = os.fdopen(rfd, "r")
        else:
            os.close(rfd)
            os.close(wfd)
            argv = _serve_argv(plan, out)
            with open(self.log_path, "ab") as err:
                popen = subprocess.Popen([sys.executable, "-m", "ps", *argv], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
            self.child, stdout = _Child("server", popen=popen), popen.stdout
        self.endpoint = self._endpoint(stdout)
        self.snap: dict[str, Any] = _status_dict({}, (), (), True)
        self.reason: str | None = None
        self.thread = threading.Thread(target=self._poll, name="latecomer-status", daemon=True)

    def _endpoint(self, stdout: Any) -> str:
        """The "listening on" line, read in a thread (a server that never says it is bounded)."""
        found: list[str] = []
        lines: list[str] = []

        def read() -> None:
            for line in stdout:
                lines.append(line)
                m = re.search(r"listening on (\S+)", line)
                if m and not found:
                    found.append(m.group(1))
            stdout.close()

        reader = threading.Thread(target=read, name="latecomer-serve-stdout", daemon=True)
        reader.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not found and self.child.poll() is None and time.monotonic() < deadline:
            reader.join(0.05)
        if found:
            self.stdout_lines = lines
            return found[0]
        self.child.signal(signal.SIGKILL)
        self.child.wait(10.0)
        raise ValueError(f"the server did not start: {self._log_tail() or 'no output'}")

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                lines = [s.strip() for s in f.read().splitlines() if s.strip()]
        except OSError:
            return ""
        return lines[-1] if lines else ""

    def start(self) -> None:
        self.thread.start()

    def _poll(self) -> None:
        """Every POLL_S: the status (its last evaluation fed on when new) until the server exits;
        then the evaluations of summary.json that came after the last one seen."""
        from ps.ops.status import fetch_status

        seen = -1
        while self.child.poll() is None:
            try:
                st = fetch_status(self.endpoint, timeout_s=1.0, **self._keys())
            except (TimeoutError, ValueError, OSError):
                self.child.wait(POLL_S)
                continue
            self.snap = _status_dict(st.info, st.columns, st.rows, True)
            ev = {k[5:]: v for k, v in st.info.items() if k.startswith("eval.")}
            if "version" in ev and int(ev["version"]) > seen:
                seen = int(ev["version"])
                self.feed.add(ev)
            self.child.wait(POLL_S)
        try:
            for ev in self.summary().get("evaluations", ()):
                if ev["version"] > seen:
                    self.feed.add(ev)
                    seen = ev["version"]
        except RuntimeError:  # no summary.json: wait() says why
            pass
        self.snap = {**self.snap, "running": False}
        self.feed.close()

    def _keys(self) -> dict[str, str]:
        return {}

    def running(self) -> bool:
        return self.child.poll() is None

    def stop(self) -> None:
        self.child.signal(signal.SIGTERM)  # serve drains, evaluates, writes its outputs

    def join(self, timeout: float | None) -> bool:
        done = self.child.wait(timeout)
        if done:
            self.thread.join(10.0)
        return done

    def kill(self) -> None:
        self.child.signal(signal.SIGKILL)
        self.child.wait(10.0)
        self.thread.join(10.0)

    def status(self) -> dict[str, Any]:
        return self.snap

    def summary(self) -> dict[str, Any]:
        path = os.path.join(self.out, "summary.json")
        rc = self.child.poll()
        try:
            return read_json(path, "a run summary", max_bytes=SUMMARY_BYTES)
        except ValueError:
            raise RuntimeError(f"the server exited with status {rc} without {path}: "
                               f"{self._log_tail() or 'see ' + self.log_path}") from None

    def final(self) -> tuple[np.ndarray, Any]:
        from problems import load_problem

        self.summary()
        x = read_npy(os.path.join(self.out, "final_x.npy"))  # checked: a damaged file is one line
        desc = read_problem_json(os.path.join(self.out, "problem.json"))
        if desc["problem"] != self.plan.problem:
            raise RuntimeError(f"{self.out} holds a run of {desc['problem']}, not {self.plan.problem}")
        return x, load_problem(desc["problem"], desc["problem_options"], device="cpu")


# --------------------------------------------------------------------------- the run

_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_runs() -> None:  # a script that forgot its `with`: no process is left behind
    for run in list(_OPEN):
        run.close()


class Run:
    """A run started by :func:`start`: a context manager (its exit stops the server if it still
    runs and reaps every worker), with live figures while it runs and the trained model after.

    Attributes:
        endpoint: the server's endpoint (``tcp://127.0.0.1:PORT``): more workers may join it
            (``latecomer work --server ENDPOINT``), :func:`connect` reads its status.
        problem: the problem's spec (a local name for a function of your own).
        server: ``"thread"`` or ``"process"``.
        out: the directory of summary.json and final_x.npy (``out=``; process mode: a temporary
            one when not given); None for a thread-mode run without ``out``.
        log_dir: where the workers' (and a server process's) logs are: ``w1.log``, ...
        reason: why the run stopped (after :meth:`wait`).
    """

    def __init__(self, plan: _Plan, server: Any, workers: list[_Child], out: str | None, log_dir: str,
                 tmp: Any, feed: _Feed) -> None:
        self.plan, self._server, self._workers, self._feed, self._tmp = plan, server, workers, feed, tmp
        self.endpoint: str = server.endpoint
        self.problem, self.server, self.out, self.log_dir = plan.problem, server.mode, out, log_dir
        self.reason: str | None = None
        self._closed = False
        self._problem: Any = None
        self._x: np.ndarray | None = None
        _OPEN.add(self)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else f"stopped ({self.reason})" if self.reason else "finished"
        return f"<latecomer.Run {self.plan.algorithm} on {self.problem} at {self.endpoint}, {state}>"

    @property
    def running(self) -> bool:
        """Whether the server still runs."""
        return self._server.running()

    @property
    def workers(self) -> list[int]:
        """The process ids of the local workers."""
        return [c.pid for c in self._workers]

    def status(self) -> dict[str, Any]:
        """What ``latecomer status`` shows, as dicts: ``info`` (step, step rate, counters
        ``counter.*``, ages ``age.*``, the last evaluation ``eval.*``, the algorithm's figures
        ``alg.*``), ``workers`` (one dict per worker: ``worker``, ``device``, ``jobs_done``,
        ``state``, ...) and ``running``. Thread mode: the figures of the loop's last tick (every
        0.5 s); process mode: of the last status request (every 0.25 s). After the end: the last
        figures seen."""
        return self._server.status()

    def evaluations(self) -> Iterator[dict[str, Any]]:
        """Every evaluation of the run from the first (``version``, ``t``, ``loss``, ``accuracy``,
        ...), each as soon as it is recorded; the iterator ends when the run ends. Thread mode
        hands on every evaluation; process mode polls the server's status, so an evaluation that
        another replaces within 0.25 s may come only from summary.json at the end (in order: those
        newer than the last seen)."""
        return self._feed.follow()

    def stop(self) -> None:
        """Ask the server to stop now: it tells the workers bye, evaluates the final iterate and
        writes its outputs (:meth:`wait` returns when it has)."""
        self._server.stop()

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the end of the run (at most ``timeout`` seconds) and return its summary, the
        dict summary.json holds (``version``, ``stopped``, ``counters``, ``evaluations``, ...).

        Raises:
            TimeoutError: the run still runs after ``timeout`` seconds.
            RuntimeError: the server failed (with its error, or its log's last line).
        """
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):
            raise ValueError(f"timeout: expected seconds >= 0 or None, got {timeout!r}")
        if not self._server.join(timeout):
            raise TimeoutError(f"the run is still going after {timeout:g} s")
        summary = self._server.summary()
        self.reason = summary.get("stopped")
        return summary

    def close(self) -> None:
        """Stop the server if it still runs (bounded: it is killed after 30 s), then reap every
        worker (5 s to exit by itself, then SIGTERM, then SIGKILL). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._server.running():
                self._server.stop()
            if not self._server.join(STOP_GRACE_S):
                self._server.kill()
        finally:
            _reap(self._workers)
            self._feed.close()
            _OPEN.discard(self)
        try:
            self.reason = self._server.summary().get("stopped")
        except RuntimeError:
            pass

    def _final(self) -> tuple[np.ndarray, Any]:
        if self._server.running():
            raise RuntimeError("the run is still going: wait() for it (or stop() it) first")
        if self._x is None:
            self._x, self._problem = self._server.final()
        return self._x, self._problem

    def params(self) -> np.ndarray:
        """The final iterate (a flat float32 array); after the end of the run."""
        return np.array(self._final()[0], copy=True)

    def state_dict(self) -> dict[str, Any]:
        """The final iterate as a state dict (``latecomer export``'s): a TorchProblem's model's
        parameter and buffer names (torch tensors, BatchNorm statistics re-estimated as its
        evaluation does), any other problem's layout blocks by name (numpy arrays)."""
        x, problem = self._final()
        to_dict = getattr(problem, "state_dict", None)
        if callable(to_dict) and hasattr(problem, "buffer_names"):
            return to_dict(x)
        from problems.torch_problem import flat_state

        return flat_state(problem, x)

    def model(self) -> Any:
        """The trained ``nn.Module``: a copy of the problem's model with the final iterate's
        weights (and buffers), in eval mode; it scores what the server's last evaluation scored.

        Raises:
            ValueError: the problem is not a TorchProblem (use :meth:`params`, :meth:`state_dict`).
        """
        x, problem = self._final()
        template = getattr(problem, "model", None)
        if template is None or not hasattr(problem, "buffer_names"):
            raise ValueError(f"problem {self.problem!r} has no PyTorch model: use run.params() or run.state_dict()")
        net = copy.deepcopy(template)
        net.load_state_dict(problem.state_dict(x))
        return net.eval()


def start(problem: str | Callable[..., Any], *, algorithm: str = "ordered-momentum",
          settings: dict[str, Any] | None = None, workers: int = 2, steps: int | None = None,
          max_time: float | None = None, target_loss: float | None = None, batch_size: int | None = None,
          eval_every: int = 100, seed: int = 0, out: str | None = None, state: str | None = None,
          delays: float | list[float] | None = None, log_to: str | list[str] | tuple[str, ...] = (),
          server: str = "thread", bind: str = "tcp://127.0.0.1:0", problem_options: dict[str, Any] | None = None,
          **serve_options: Any) -> Run:
    """Start a run: a server and ``workers`` local worker processes; returns the :class:`Run` at
    once (use it as a context manager).

    Args:
        problem: a spec (``"digits"``, ``"mymodule:make"``) or a function returning a problem
            (a :class:`latecomer.TorchProblem`); a function is loaded by forked workers (Linux).
        algorithm, settings: the algorithm's name (``latecomer algorithms``) and hyper-parameters
            (``{"lr": 0.05}``: ``serve --set``).
        workers: local worker processes (0: none, workers of your own join ``run.endpoint``);
            the server waits for this many before the first job (``min_workers=`` to change it).
        steps, max_time, target_loss: when to stop (``--max-steps``, ``--max-time`` seconds,
            ``--target-loss``); none: when :meth:`Run.stop` is called.
        batch_size: the batch of each gradient (default 32); eval_every: evaluate every this many
            steps (0: at the start and the end only); seed: the run's seed.
        out: write summary.json, final_x.npy and problem.json here (``serve --out``).
        state: a state directory (journal and checkpoints; a run there is resumed).
        delays: injected seconds per job, one per worker (cycled), as ``latecomer run --delays``.
        log_to: logger specs (``"tensorboard:DIR"``, ``"wandb"``, ``"mlflow:URI"``: ``--log-to``).
        server: ``"thread"`` (in this process) or ``"process"`` (a ``latecomer serve`` child).
        bind: the server's endpoint (port 0: any free port, see ``run.endpoint``).
        problem_options: the problem's options (``--problem-opt``).
        serve_options: more options of ``latecomer serve``: ``liveness_timeout``,
            ``heartbeat_interval``, ``min_workers``, ``round_period``, ``events``, ``keys``,
            ``shm``, ``wire_dtype``, ``max_workers``, ``max_workers_per_key``, ``insecure``.

    Raises:
        ValueError: a bad argument, a problem or algorithm that does not load, a server that
            does not start (one line).
    """
    plan = _plan(problem, algorithm=algorithm, settings=settings, workers=workers, steps=steps, max_time=max_time,
                 target_loss=target_loss, batch_size=batch_size, eval_every=eval_every, seed=seed, out=out,
                 state=state, delays=delays, log_to=log_to, server=server, bind=bind,
                 problem_options=problem_options, serve_options=serve_options)
    tmp = tempfile.TemporaryDirectory(prefix="latecomer-run-") if plan.out is None else None
    run_dir = plan.out or tmp.name
    os.makedirs(run_dir, exist_ok=True)
    out = plan.out if plan.server == "thread" else run_dir
    return _launch(plan, out, run_dir, tmp)


def _launch(plan: _Plan, out: str | None, log_dir: str, tmp: Any) -> Run:
    """Fork the local factory's workers first (before this process has a server's threads and
    sockets), then the server, then tell the workers where it is (spec workers are spawned then)."""
    feed, pipes, workers = _Feed(), [], []
    from problems.trust import is_user_problem

    wids = _worker_ids(plan.workers)
    try:
        if plan.local:
            for wid in wids:
                rfd, wfd = os.pipe()
                kw = {"worker_id": wid, "give_up_s": 30.0, "threads": 1, "local_problems": (plan.problem,),
                      "delay": _delay_spec(plan.delays[len(workers) % len(plan.delays)])}
                log_path = os.path.join(log_dir, f"{wid}.log")
                workers.append(_Child(wid, process=_fork(_forked_worker, (kw, rfd, log_path, (wfd, *pipes)))))
                os.close(rfd)
                pipes.append(wfd)
        server = _ThreadServer(plan, feed) if plan.server == "thread" else \
            _ProcessServer(plan, feed, out, log_dir, tuple(pipes))
        while pipes:
            wfd = pipes.pop()
            os.write(wfd, (server.endpoint + "\n").encode())
            os.close(wfd)
        if not plan.local:
            allow = ["--allow-problem", plan.problem] if is_user_problem(plan.problem) else []
            for i, wid in enumerate(wids):
                with open(os.path.join(log_dir, f"{wid}.log"), "ab") as err:
                    popen = spawn_worker(server.endpoint, wid, plan.delays[i % len(plan.delays)], allow, stderr=err,
                                         give_up_s=30.0)
                workers.append(_Child(wid, popen=popen))
    except BaseException:
        while pipes:  # a worker reads no endpoint: it exits
            _close_fd(pipes.pop())
        _reap(workers, 1.0)
        raise
    server.start()
    return Run(plan, server, workers, out, log_dir, tmp, feed)


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _delay_spec(delay: float) -> Any:
    from worker.runner import DelaySpec

    return DelaySpec(delay_s=delay)


def train(problem: str | Callable[..., Any], **kwargs: Any) -> Run:
    """:func:`start` (same arguments), wait for the end of the run, reap the workers; returns the
    finished :class:`Run` (``run.model()``, ``run.wait()`` for the summary). Needs a stop
    condition: ``steps``, ``max_time`` or ``target_loss``. An interrupt (Ctrl-C) stops the run
    and reaps its processes before it propagates."""
    if all(kwargs.get(k) is None for k in ("steps", "max_time", "target_loss")):
        raise ValueError("train: give steps=, max_time= or target_loss= (or use start() and stop())")
    run = start(problem, **kwargs)
    try:
        run.wait()
    finally:
        run.close()
    return run


# --------------------------------------------------------------------------- connect

class Client:
    """A running server's read-only status (:func:`connect`)."""

    def __init__(self, endpoint: str, key_secret: str | None = None, server_key: str | None = None) -> None:
        self.endpoint, self._key_secret, self._server_key = endpoint, key_secret, server_key

    def __repr__(self) -> str:
        return f"<latecomer.Client {self.endpoint}>"

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        """What ``latecomer status`` shows, as dicts (see :meth:`Run.status`).

        Raises:
            TimeoutError: no answer within ``timeout`` seconds.
        """
        from ps.ops.status import fetch_status

        timeout = _positive("timeout", timeout)
        st = fetch_status(self.endpoint, timeout_s=timeout, key_secret=self._key_secret, server_key=self._server_key)
        return _status_dict(st.info, st.columns, st.rows, True)


def connect(endpoint: str, keys: tuple[str, str] | None = None) -> Client:
    """A client of the server at ``endpoint`` (``tcp://HOST:PORT``, ``ipc://PATH``); ``keys``:
    ``(worker.key_secret, server.key)`` paths for a server with CurveZMQ keys (``--keys``), as
    ``latecomer status --key --server-key``.

    Raises:
        ValueError: a malformed endpoint, keys that are not two existing files.
    """
    from ps.net.endpoints import check_endpoint

    if not isinstance(endpoint, str):
        raise ValueError(f"endpoint: expected tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
    endpoint = check_endpoint(endpoint)
    if keys is None:
        return Client(endpoint)
    if not (isinstance(keys, (tuple, list)) and len(keys) == 2 and all(isinstance(k, (str, os.PathLike))
                                                                      and os.path.isfile(k) for k in keys)):
        raise ValueError(f"keys: expected (key_secret file, server.key file), got {keys!r}")
    return Client(endpoint, os.fspath(keys[0]), os.fspath(keys[1]))


__all__ = ["Client", "Run", "connect", "spawn_worker", "start", "train"]
