"""Building a server from its options: a new run, or the run a state directory holds.

The commands (ps/cli/serve.py, ps/cli/work.py) and the API (latecomer/api.py) parse their options
and call :func:`make_daemon`; what it takes is
:class:`ServeOptions` (the run's settings) and :class:`StateOptions` (``--state`` and its
persistence). A new state directory gets its run.json and a ``start`` record; one that holds
a run is recovered (checkpoint plus journal tail, ps/journal/recovery.py) and journals a ``restart``.
Errors a person can fix are one-line ``click`` exceptions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import click

from ps.core.spec import TrainingSpec
from ps.journal.runfile import core_config, recorded_settings

log = logging.getLogger("latecomer.server")


@dataclass(frozen=True)
class ServeOptions:
    """What a run is served with, besides its problem and algorithm (``serve``'s options)."""

    batch_size: int | None = 1  # None: the problem's own batch_size, else 32 (resolve_batch_size)
    max_steps: int | None = None
    max_time: float | None = None
    target_loss: float | None = None
    eval_every: int = 0
    liveness_timeout: float = 3.0
    heartbeat_interval: float = 0.5
    min_workers: int = 1
    round_period: float | None = None
    seed: int = 0
    events: str | None = None
    keys_dir: str | None = None
    shm: str = "auto"
    wire_dtype: str = "f32"
    caps: dict = field(default_factory=dict)  # max_workers, max_workers_per_key
    shards: int = 0  # >= 1: a sharded server of this many shards (ps/sharded/hub.py); 0: one process
    shard_bind: str = "tcp://127.0.0.1:0"  # the coordinator's endpoint for its shards

    def core_kw(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "liveness_timeout": self.liveness_timeout,
                "heartbeat_interval": self.heartbeat_interval, "min_workers": self.min_workers,
                "round_period": self.round_period, "seed": self.seed}


@dataclass(frozen=True)
class StateOptions:
    """``serve --state DIR`` and its persistence settings."""

    state_dir: str
    checkpoint_every: int = 1000
    checkpoint_interval_s: float = 30.0
    fsync: str = "batch"
    log_payloads: bool = False
    max_journal_bytes: int = 1 << 30  # ps.journal.persistence.DEFAULT_MAX_JOURNAL_BYTES
    # --repair: keep the journal's valid prefix, move the rest aside (ps.journal.repair.repair_journal)
    repair: bool = False


def muon_blocks_text(alg: Any, problem: Any) -> str | None:
    """One line saying which blocks a Muon run orthogonalizes (and in what arithmetic) and how
    many take the momentum step; None for an algorithm that runs no Newton–Schulz or an unbound
    problem."""
    if getattr(alg, "ns_dtype", None) is None or getattr(alg, "lmo", "muon") != "muon":
        return None
    import math

    import numpy as np

    from algorithms.lmo import check_lmo_mask, default_lmo_mask, ns_dtype_for

    layout = tuple(getattr(problem, "layout", ()) or ())
    if not layout:
        return None
    mask = check_lmo_mask(layout, getattr(problem, "lmo_mask", None)) or default_lmo_mask(layout)
    named = []
    for (name, shape), on in zip(layout, mask, strict=True):
        if on and math.prod(shape):
            rows = shape[0] if len(shape) >= 2 else 1
            mat = (rows, math.prod(shape) // rows)
            named.append(f"{name} {mat[0]}x{mat[1]} {ns_dtype_for(alg.ns_dtype, np.float32, mat)}")
    shown = ", ".join(named[:8]) + (f", ... {len(named) - 8} more" if len(named) > 8 else "")
    return (f"Muon: Newton-Schulz on {len(named)} of {len(layout)} blocks ({shown or 'none'}); the other "
            f"{len(layout) - len(named)} take the momentum step (the problem's lmo_mask)")


def log_muon_blocks(alg: Any, problem: Any) -> None:
    text = muon_blocks_text(alg, problem)
    if text:
        log.info("%s", text)


def resolve_batch_size(given: int | None, problem: Any) -> int:
    """The jobs' batch size: ``--batch-size`` when given, else the problem's own ``batch_size``
    (a TorchProblem's), else 32. Logs which, and warns when both are given and differ."""
    own = getattr(problem, "batch_size", None)
    own = own if isinstance(own, int) and not isinstance(own, bool) and own >= 1 else None
    if given is None:
        size = own or 32
        log.info("jobs of %d samples (%s)", size, "the problem's batch_size" if own else "the default; --batch-size")
        return size
    if own is not None and own != given:
        log.warning("--batch-size %d differs from the problem's batch_size %d: jobs use %d; the problem's is for "
                    "its BatchNorm re-estimation and full-gradient chunks", given, own, given)
    return given


def make_daemon(spec: TrainingSpec, bind: str, opts: ServeOptions, *, state: StateOptions | None = None,
                allowed: Any = None, on_progress: Callable | None = None):
    """The daemon for ``spec`` on ``bind``: a fresh run, or with
    ``state`` the run its directory holds (new or resumed)."""
    import zmq

    from ps.core.config import CoreConfig
    from ps.drivers.daemon import Daemon, StopCondition

    persistence, boot = None, secrets.randbits(63)
    wire_dtype, events, shards = opts.wire_dtype, opts.events, None
    before = _entries(state.state_dir) if state is not None else None
    if opts.shards and state is None:
        raise click.UsageError("a sharded server needs --state DIR: its journal feeds the shards")
    if state is not None:
        core, problem, persistence, spec = open_state(state, spec, boot=boot, wire_dtype=wire_dtype, allowed=allowed,
                                                      shards=opts.shards, **opts.core_kw())
        wire_dtype = persistence.wire_dtype
        events = events or os.path.join(state.state_dir, "events.jsonl")
        run = read_run_checked(state.state_dir)
        if run.get("shards"):
            if state.fsync == "never":
                persistence.close()
                raise click.BadParameter("a sharded server ships its journal to the shards once durable: use "
                                         "--fsync batch or always", param_hint="--fsync")
            shards = {"n": int(run["shards"]), "bind": opts.shard_bind, "ranges": tuple(map(tuple, run["ranges"])),
                      "x0": problem.init_params(run["core"]["seed"])}
    else:
        problem, alg = spec.build()
        cfg = CoreConfig(problem=spec.problem, problem_options=dict(problem.options or spec.problem_options),
                         batch_size=resolve_batch_size(opts.batch_size, problem),
                         heartbeat_interval_s=opts.heartbeat_interval,
                         liveness_timeout_s=opts.liveness_timeout, min_workers=opts.min_workers,
                         round_period_s=opts.round_period, seed=opts.seed, run_id=secrets.randbits(63) + 1,
                         refuse_overflow=True)
        core = new_core(alg, problem.init_params(opts.seed), cfg, boot, time.monotonic())
    try:
        log_muon_blocks(core.alg, problem)
        return Daemon(core, problem, bind, stop=StopCondition(opts.max_steps, opts.max_time, opts.target_loss),
                      eval_every=opts.eval_every, events_path=events, on_progress=on_progress,
                      persistence=persistence, keys_dir=opts.keys_dir, shm="off" if shards else opts.shm,
                      wire_dtype=wire_dtype, shards=shards, **opts.caps)
    except ValueError as e:  # unusable keys
        if persistence is not None:
            persistence.close()
        raise click.BadParameter(str(e), param_hint="--keys") from None
    except zmq.ZMQError as e:
        if persistence is not None:
            persistence.close()
            _undo_new_run(state.state_dir, before)
        raise click.ClickException(f"cannot bind {bind}: {e}") from None


def _entries(d: str) -> set[str] | None:
    """What a state directory holds before this server starts (None: it does not exist)."""
    try:
        return set(os.listdir(d))
    except FileNotFoundError:
        return None


def _undo_new_run(d: str, before: set[str] | None) -> None:
    """A new run whose server cannot bind leaves nothing behind: the files it created go (the
    directory too, if it made it), so the next start is a new run again, not a run with no
    checkpoint. A resumed run's directory had run.json before: nothing of it is removed."""
    import shutil

    if before is not None and "run.json" in before:
        return
    if before is None:
        shutil.rmtree(d, ignore_errors=True)
        return
    for name in set(os.listdir(d)) - before:
        path = os.path.join(d, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)


def read_run_checked(state_dir: str) -> dict[str, Any]:
    from ps.journal.runfile import read_run

    return read_run(state_dir, complete=True) or {}


def open_state(state: StateOptions, spec: TrainingSpec, *, boot: int, wire_dtype: str = "f32", allowed=None,
               shards: int = 0, **core_kw):
    """Start a new run in an empty state directory, or resume the one it holds. Returns the
    core, the problem, the Persistence and the spec (a resumed run's, from its run.json).

    A resumed run's problem and algorithm come from its run.json: a user callable there is
    loaded only if ``allowed`` (the command line: problems/trust.py) trusts it; else one line
    saying what to add."""
    from ps.journal.lock import StateLock
    from ps.journal.persistence import Persistence
    from ps.journal.runfile import read_run

    d = state.state_dir
    os.makedirs(d, exist_ok=True)
    lock = StateLock(d)  # one server per state directory; `latecomer stop` verifies it (ps/journal/lock.py)
    try:  # a directory refused (damaged, crafted, another run) is left as it was: no server.pid behind
        run = read_run(d, complete=True)
        if run is None:
            run, core, problem, journal = _new_run(state, spec, boot, wire_dtype, core_kw, shards)
        else:
            if shards and int(run.get("shards", 0)) != shards:
                raise click.BadParameter(f"{d} holds a run with {run.get('shards', 0) or 'no'} shards",
                                         param_hint="--shards")
            core, problem, journal, spec = _resume_run(state, spec, run, boot, wire_dtype, allowed)
    except BaseException:
        lock.release()
        raise
    log_payloads = state.log_payloads
    if run.get("shards"):
        # A sharded run's payloads are its shards' blocks journals (kept whole when the run was created
        # with --log-payloads): the coordinator's own gradients are empty, so it journals headers.
        if bool(run.get("log_payloads")) != log_payloads:
            log.warning("%s holds a sharded run %s --log-payloads: resuming it so (a sharded run's payloads are "
                        "chosen when it starts)", d, "with" if run.get("log_payloads") else "without")
        log_payloads = False
    persistence = Persistence(d, journal, checkpoint_every=state.checkpoint_every,
                              checkpoint_interval_s=state.checkpoint_interval_s, log_payloads=log_payloads,
                              max_journal_bytes=state.max_journal_bytes, lock=lock)
    persistence.wire_dtype = run["wire_dtype"]  # the run's, which a resumed run keeps
    return core, problem, persistence, spec


def new_core(alg: Any, x0: Any, cfg: Any, boot: int, now: float) -> Any:
    """A new run's core; settings its algorithm refuses on this iterate (e.g. snapshot-vr
    without num_samples) are one line of error, before anything is written."""
    from ps.core.server_core import ServerCore

    try:
        return ServerCore(alg, x0, cfg, server_boot=boot, now=now)
    except ValueError as e:
        raise click.BadParameter(str(e).splitlines()[0] if str(e) else type(e).__name__,
                                 param_hint="--algorithm/--set") from None


def _build(spec: TrainingSpec, shards: int):
    """The problem and the algorithm the core runs: the algorithm itself, or (sharded) its
    coordinator (bound to no blocks), with the shards' ranges."""
    if not shards:
        problem, alg = spec.build()
        return problem, alg, None
    problem, sharded = spec.build_sharded(shards)
    return problem, sharded.coordinator, sharded.plan.ranges


def _new_run(state: StateOptions, spec: TrainingSpec, boot: int, wire_dtype: str, core_kw: dict, shards: int = 0):
    """run.json, then the core and the journal's start record (with the core's creation time)."""
    from ps.core.config import restart_grace_s
    from ps.journal.runfile import write_run
    from ps.journal.wal import Journal

    d = state.state_dir
    problem, alg, ranges = _build(spec, shards)
    options = dict(problem.options or spec.problem_options)
    run = {"problem": spec.problem, "problem_options": options, "algorithm": spec.algorithm,
           "settings": dict(spec.settings), "format": 1, "wire_dtype": wire_dtype,
           "core": {"problem": spec.problem, "problem_options": options,
                    "batch_size": resolve_batch_size(core_kw["batch_size"], problem),
                    "heartbeat_interval_s": core_kw["heartbeat_interval"],
                    "liveness_timeout_s": core_kw["liveness_timeout"], "min_workers": core_kw["min_workers"],
                    "round_period_s": core_kw["round_period"], "seed": core_kw["seed"],
                    "run_id": secrets.randbits(63) + 1,
                    # pinned: a later version's backoff constants must not change how this run replays
                    "restart_grace_s": restart_grace_s(core_kw["liveness_timeout"]),
                    # a restored worker gets nothing before its hello (PROTOCOL.md 8.11); runs before: False
                    "await_hello": True,
                    # a gradient value whose square overflows is refused (issue 29); runs before: False
                    "refuse_overflow": True}}
    if shards:
        run["shards"], run["ranges"] = shards, [list(r) for r in ranges]
        if state.log_payloads:  # the shards keep every block they journal, and replay takes them (not the oracle)
            run["log_payloads"] = True
    now = time.monotonic()  # the core's creation time, journaled: replay creates its core at the same time
    core = new_core(alg, _x0(problem, run), core_config(run), boot, now)  # first: it checks the settings
    write_run(d, run)
    journal = Journal(d, next_lsn=0, fsync=state.fsync)
    journal.append("start", run=run, now=now)
    log.info("new run in %s", d)
    return run, core, problem, journal


def _resume_run(state: StateOptions, spec: TrainingSpec, run: dict, boot: int, wire_dtype: str, allowed: Any):
    """The run the directory holds, if the command line trusts what it names: recovered, with a
    ``restart`` record journaled and fed to the core."""
    from problems.trust import Allowed, UntrustedError, check_run
    from ps.core.server_core import ServerCore
    from ps.journal.inputs import CoreInputs
    from ps.journal.recovery import recover
    from ps.journal.wal import Journal

    d = state.state_dir
    try:
        check_run(run, allowed or Allowed().naming(problem=spec.problem, algorithm=spec.algorithm),
                  os.path.join(d, "run.json"), problem_hint="--allow-problem {spec} (or --problem {spec})",
                  algorithm_hint="--allow-algorithm {spec} (or --algorithm {spec})")
    except UntrustedError as e:
        raise click.ClickException(str(e)) from None
    resumed = TrainingSpec(problem=run["problem"], problem_options=run["problem_options"],
                           algorithm=run["algorithm"], settings=recorded_settings(run))
    if (spec.problem, spec.algorithm) != (resumed.problem, resumed.algorithm):
        log.warning("%s holds a run of %s on %s: resuming it (the command-line problem and algorithm are "
                    "ignored)", d, resumed.algorithm, resumed.problem)
    if run["wire_dtype"] != wire_dtype:
        log.warning("%s holds a run with --wire-dtype %s: resuming it with that", d, run["wire_dtype"])
    problem, alg, _ = _build(resumed, int(run.get("shards", 0)))
    cfg = core_config(run)
    deterministic_oracle()
    core, last, n = recover(lambda now=0.0: ServerCore(alg, _x0(problem, run), cfg, server_boot=boot, now=now),
                            lambda snap: ServerCore.restore(alg, snap, cfg, server_boot=boot), d, problem,
                            repair=state.repair)
    core.server_boot = boot
    journal = Journal(d, next_lsn=last + 1, fsync=state.fsync)
    now = time.monotonic()
    journal.append("restart", now=now)
    CoreInputs(core).restarted(now)  # what replaying the "restart" record does
    log.info("resumed %s at step %d (%d journal records replayed)", d, core.version, n)
    return core, problem, journal, resumed


def _x0(problem: Any, run: dict) -> Any:
    """The core's initial iterate: the problem's, or none at all for a sharded run's coordinator."""
    x0 = problem.init_params(run["core"]["seed"])
    return x0[:0] if run.get("shards") else x0


def deterministic_oracle() -> None:
    """Recomputing gradients must give the workers' bits: torch problems run single-threaded,
    as workers do by default (``latecomer work --threads 1``)."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def start_metrics(daemon: Any, port: int, addr: str) -> None:
    """``--metrics-port``: the Prometheus endpoint, its bound port logged (port 0: the OS's choice)."""
    try:
        daemon.enable_metrics(port, addr)
    except OSError as e:
        daemon.close()
        raise click.ClickException(f"cannot serve metrics on {addr}:{port}: {e}") from None
    log.info("metrics on http://%s:%d/metrics", addr, daemon.metrics.port)


def log_progress(daemon: Any, ev: dict[str, float] | None) -> None:
    """``serve``'s progress: a log line per evaluation."""
    if ev is not None:
        core = daemon.core
        log.info("step %d  %s  workers %d  applied %d lost %d", int(ev["version"]),
                 "  ".join(f"{k} {v:.4g}" for k, v in ev.items() if k not in ("t", "version")),
                 len(core.workers), core.counters.applied, core.counters.lost)


def waiting_for(d: Any) -> str:
    """What a run that has not made its first step waits for, in a few words."""
    workers = d.core.workers.values()
    joined, ready = len(workers), sum(1 for w in workers if w.ready)
    wanted = d.core.cfg.min_workers
    if joined == 0:
        return "workers starting"
    if ready < joined:
        return f"{joined - ready} loading the problem"
    if ready < wanted:
        return f"{wanted - ready} more worker{'s' if wanted - ready > 1 else ''}"
    return "first replies"


def want_progress(flag: bool | None, stream: Any, log_format: str) -> bool:
    """``serve --progress/--no-progress``: None (neither given) shows the bar when ``stream`` is a
    terminal and the log is text (a JSON log is read by programs)."""
    if flag is not None:
        return flag
    isatty = getattr(stream, "isatty", None)
    return log_format == "text" and bool(isatty and isatty())


class ServeBar:
    """``serve``'s progress bar on a terminal: steps (of ``--max-steps`` when given), update rate,
    workers, lost jobs and the last evaluation; before the first step, what it waits for. The
    evaluation lines are still logged (above the bar)."""

    def __init__(self, total: int | None, stream: Any = None) -> None:
        from tqdm import tqdm

        self.total = total
        self.bar = tqdm(total=total, desc="serve", unit="step", file=stream or sys.stderr, dynamic_ncols=True,
                        mininterval=0.2)

    def __call__(self, daemon: Any, ev: dict[str, float] | None) -> None:
        log_progress(daemon, ev)
        core = daemon.core
        self.bar.n = min(core.version, self.total) if self.total else core.version
        post: dict[str, Any] = {"rate": f"{daemon.step_rate(daemon.clock()):.1f}/s", "workers": len(core.workers)}
        if core.counters.lost:
            post["lost"] = core.counters.lost
        if core.version == 0:
            post["waiting"] = waiting_for(daemon)
        if daemon.evaluations:
            last = daemon.evaluations[-1]
            post.update({k: f"{v:.4g}" for k, v in last.items() if k in ("loss", "accuracy")})
        self.bar.set_postfix(post, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def serve_until_stopped(daemon: Any, out_dirs: list[str]) -> str:
    """Run the daemon to its end, then write summary.json and final_x.npy into each of
    ``out_dirs`` (a full disk is logged: the journal and checkpoints still hold the run) and
    close it (server.pid goes with the state lock: a clean exit). Returns why it stopped."""
    from ps.drivers.outputs import write_outputs

    try:
        return daemon.run()
    finally:
        for d in out_dirs:
            try:
                write_outputs(d, daemon)
            except OSError as e:
                log.error("cannot write summary.json and final_x.npy in %s: %s", d, e.strerror or e)
        if daemon.persist is not None:
            daemon.persist.close()
        daemon.close()
