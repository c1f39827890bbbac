"""The ``latecomer`` command line: serve, work, run, simulate.

User mistakes raise ``click.BadParameter``/``click.UsageError``/``click.ClickException``: a
one-line message and exit code 2 (usage) or 1, never a traceback. Real bugs keep theirs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import subprocess
import sys
import time
from typing import Any

import click
import numpy as np

from problems.loader import BUILTIN_PROBLEMS
from problems.trust import ENV_ALLOW_PROBLEM
from protocol.messages import ID_IN_USE
from ps.cli.paths import check_output_file, output_dir, output_file, usage_check
from ps.core.spec import TrainingSpec
from ps.drivers.server import (
    ServeBar,
    ServeOptions,
    StateOptions,
    log_progress,
    make_daemon,
    serve_until_stopped,
    start_metrics,
    waiting_for,
    want_progress,
)
from ps.net.endpoints import bind_endpoint, remote_server_endpoint, server_endpoint
from ps.net.supervise import ServeCommand

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as the tomli package (a dependency there)
    import tomli as tomllib

DEFAULT_PORT = 5555


# --------------------------------------------------------------------------- shared parsing

def _parse_pairs(values: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for v in values:
        key, sep, val = v.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got {v!r}", param_hint=what)
        out[key.strip()] = val.strip()
    return out


def training_spec(problem: str | None, problem_opt: tuple[str, ...], algorithm: str | None,
                  settings: tuple[str, ...], config: str | None, *, default_problem: str,
                  default_algorithm: str, default_settings: dict[str, Any] | None = None) -> TrainingSpec:
    """Merge a TOML config file (``[problem] name=..., key=...``, ``[algorithm] name=..., key=...``)
    with command-line flags (flags win)."""
    file_problem: dict[str, Any] = {}
    file_alg: dict[str, Any] = {}
    if config:
        try:
            with open(config, "rb") as f:
                doc = tomllib.load(f)
        except OSError as e:
            raise click.BadParameter(f"cannot read {config}: {e.strerror}", param_hint="--config") from None
        except tomllib.TOMLDecodeError as e:
            raise click.BadParameter(f"{config} is not valid TOML: {e}", param_hint="--config") from None
        unknown = set(doc) - {"problem", "algorithm"}
        if unknown:
            raise click.BadParameter(f"unknown section(s) {sorted(unknown)} in {config}", param_hint="--config")
        file_problem = dict(doc.get("problem", {}))
        file_alg = dict(doc.get("algorithm", {}))
    p_name = problem or file_problem.pop("name", None) or default_problem
    file_problem.pop("name", None)
    a_name = algorithm or file_alg.pop("name", None) or default_algorithm
    file_alg.pop("name", None)
    base_settings = dict(default_settings or {}) if a_name == default_algorithm and not file_alg else {}
    return TrainingSpec(problem=p_name, problem_options={**file_problem, **_parse_pairs(problem_opt, "--problem-opt")},
                        algorithm=a_name, settings={**base_settings, **file_alg, **_parse_pairs(settings, "--set")})


def _training_options(default_problem: str, default_algorithm: str):
    def deco(f):
        f = click.option("--config", type=click.Path(dir_okay=False),
                         help="TOML file with [problem] and [algorithm] tables (flags override it).")(f)
        f = click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
                         help="Algorithm hyper-parameter, e.g. --set lr=0.05 (repeatable).")(f)
        f = click.option("--algorithm", "-a", default=None,
                         help=f"Algorithm name (default {default_algorithm}; see `latecomer algorithms`).")(f)
        f = click.option("--problem-opt", multiple=True, metavar="KEY=VALUE",
                         help="Problem option, e.g. --problem-opt d=256 (repeatable).")(f)
        f = click.option("--problem", "-p", default=None,
                         help=f"Built-in problem ({', '.join(BUILTIN_PROBLEMS)}) or module:callable "
                              f"(default {default_problem}).")(f)
        return f
    return deco


def _allow_patterns(ctx, param, value):
    """``--allow-problem``/``--allow-algorithm`` values as validated patterns (problems/trust.py);
    one value may hold several separated by white space (as ``LATECOMER_ALLOW_PROBLEM`` does)."""
    from problems.trust import check_pattern

    try:
        return tuple(check_pattern(p, param.opts[0]) for v in value or () for p in v.split())
    except ValueError as e:
        raise click.BadParameter(str(e).removeprefix(f"{param.opts[0]} "), param_hint=param.opts[0]) from None


def _allowed(allow_problem=(), allow_algorithm=()):
    """The trust of a command that reads a state directory (problems/trust.py)."""
    from problems.trust import Allowed

    return Allowed(tuple(allow_problem), tuple(allow_algorithm))


def _allow_options(f):
    """``--allow-problem`` and ``--allow-algorithm`` for commands that load what a state directory names."""
    f = click.option("--allow-algorithm", "allow_algorithm", multiple=True, metavar="PATTERN",
                     callback=_allow_patterns,
                     help="Trust this algorithm of your own (module:Class or an fnmatch pattern) where a state "
                          "directory names it (repeatable).")(f)
    f = click.option("--allow-problem", "allow_problem", multiple=True, metavar="PATTERN", callback=_allow_patterns,
                     help="Trust this problem of your own (module:callable or an fnmatch pattern such as "
                          "'mymodel:*') where a state directory names it (repeatable).")(f)
    return f


def _setup_logging(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from ps.observe.metrics import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)


def _positive(ctx, param, value):
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise click.BadParameter(f"must be > 0, got {value}")
    return value


def _finite(ctx, param, value):
    """click callback: NaN and infinity are refused (FloatRange lets them through)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"must be a finite number, got {value}")
    return value


def _log_to_specs(ctx, param, value):
    """click callback: each ``--log-to`` spec checked (ps/observe/loggers.py), one line for a bad one."""
    from ps.observe.loggers import check_spec

    try:
        return tuple(check_spec(v) for v in value or ())
    except ValueError as e:
        raise click.BadParameter(str(e).removeprefix("--log-to "), param_hint="--log-to") from None


log_to_option = click.option(
    "--log-to", "log_to", multiple=True, metavar="SPEC", callback=_log_to_specs,
    help="Log the run's figures and settings (repeatable): tensorboard:DIR, wandb, wandb:PROJECT, mlflow:URI.")


def add_loggers(daemon: Any, specs: tuple[str, ...]) -> None:
    """One logger (ps/observe/loggers.py) per ``--log-to`` spec, observing ``daemon``."""
    from ps.observe.loggers import log, make_logger

    if specs and not log.isEnabledFor(logging.INFO):
        log.setLevel(logging.INFO)  # where each logger writes is said even under `run`'s warning level
    for spec in specs:
        try:
            daemon.add_observer(make_logger(spec))
        except ValueError as e:
            raise click.BadParameter(str(e).removeprefix("--log-to "), param_hint="--log-to") from None


# --------------------------------------------------------------------------- the group

class _LazyGroup(click.Group):
    """Commands from other packages are imported only when invoked: `latecomer work` stays light."""

    LAZY = {"experiment": "experiments.cli:experiment", "bench": "benchmarks.cli:bench",
            "export": "ps.ops.export:export"}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.LAZY))

    def invoke(self, ctx: click.Context) -> Any:
        """A damaged, unexpected or busy state directory (``ps.journal.statedir.StateError``, raised by any
        command that reads one) is one line, never a traceback."""
        try:
            return super().invoke(ctx)
        except ValueError as e:
            from ps.journal.statedir import StateError

            if isinstance(e, StateError):
                raise click.ClickException(str(e)) from None
            raise

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.LAZY:
            import importlib

            module, attr = self.LAZY[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="latecomer")
def main() -> None:
    """latecomer: an asynchronous parameter server for heterogeneous machines."""


# --------------------------------------------------------------------------- dashboard (issue 25)

def _dashboard_addr(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from ps.ops.dashboard import check_addr

    try:
        check_addr(value)
    except ValueError:
        raise click.BadParameter(f"expected an IP address or localhost, got {value!r}") from None
    return value


def _dashboard_meta(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if param.name == "dashboard_addr":
        value = _dashboard_addr(ctx, param, value)
    ctx.meta[param.name] = value  # read by _start_dashboard: the commands' signatures stay as they are
    return value


def _dashboard_options(f):
    """``--dashboard-port`` and ``--dashboard-addr`` of serve and run (ps/ops/dashboard.py)."""
    f = click.option("--dashboard-addr", default="127.0.0.1", show_default=True, callback=_dashboard_meta,
                     expose_value=False,
                     help="Address of the dashboard (another than loopback shows the run, read-only, to anyone "
                          "who can reach it).")(f)
    return click.option("--dashboard-port", type=click.IntRange(0, 65535), default=None, callback=_dashboard_meta,
                        expose_value=False,
                        help="Serve a live dashboard (a web page) on this port (0: any free port; the address "
                             "is logged).")(f)


def _start_dashboard(daemon: Any) -> Any:
    """The dashboard of ``daemon`` when --dashboard-port was given (else None)."""
    meta = click.get_current_context().meta
    port, addr = meta.get("dashboard_port"), meta.get("dashboard_addr", "127.0.0.1")
    if port is None:
        return None
    from ps.ops.dashboard import attach

    try:
        return attach(daemon, port, addr)
    except OSError as e:
        daemon.close()
        raise click.ClickException(f"cannot serve the dashboard on {addr}:{port}: {e}") from None


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--port", type=click.IntRange(0, 65535), default=8265, show_default=True,
              help="The page's port (0: any free port).")
@click.option("--addr", default="127.0.0.1", show_default=True, callback=_dashboard_addr,
              help="The page's address.")
def dashboard(run_dir, port, addr) -> None:
    """Serve the dashboard of a finished run (a serve --state or an --out directory) until Ctrl-C."""
    from ps.ops.dashboard import serve_recorded

    _setup_logging("warning")
    try:
        serve_recorded(run_dir, port, addr, lambda line: click.echo(line))
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"cannot serve the dashboard on {addr}:{port}: {e}") from None


@main.command("algorithms")
@click.argument("names", nargs=-1, metavar="[NAME|module:Class]...")
def list_algorithms(names) -> None:
    """List the algorithms (or just NAMES), what each hyper-parameter means, and the wrapper keys."""
    import algorithms
    from algorithms.registry import describe, resolve, summary
    from algorithms.wrappers import WrapperSettings

    try:
        classes = [(n, resolve(algorithms.ALGORITHMS, n)) for n in names] or sorted(algorithms.ALGORITHMS.items())
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="NAME") from None
    for name, cls in (*classes, ("wrappers", WrapperSettings)):
        hp, text = algorithms.hyper_parameters(cls), describe(cls)
        head = "wrappers: --set keys that compose with any algorithm (see algorithms/wrappers.py)" \
            if cls is WrapperSettings else f"{name}: {summary(cls)}"
        click.echo(head)
        for k, (_, default) in hp.items():
            click.echo(f"  {k + '=' + repr(default):28s} {text[k] or '(undocumented)'}")


# --------------------------------------------------------------------------- serve

@main.command(cls=ServeCommand)  # --supervise, --max-unfinished-bytes (ps/net/supervise.py)
@click.option("--bind", default=f"tcp://127.0.0.1:{DEFAULT_PORT}", show_default=True, callback=bind_endpoint,
              help="ZeroMQ endpoint to bind: tcp://HOST:PORT (HOST * for every interface, [::1] for IPv6; "
                   "port 0: any free port) or ipc://PATH.")
@_training_options("digits", "ordered-momentum")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Samples per job (default: the problem's own batch_size, e.g. TorchProblem(batch_size=), else 32).")
@click.option("--max-steps", type=click.IntRange(min=1), default=None, help="Stop after this many updates.")
@click.option("--max-time", type=float, default=None, callback=_positive, help="Stop after this many seconds.")
@click.option("--target-loss", type=float, default=None, callback=_finite,
              help="Stop once the evaluated loss is at most this.")
@click.option("--eval-every", type=click.IntRange(min=0), default=100, show_default=True,
              help="Evaluate the model every N updates.")
@click.option("--liveness-timeout", type=float, default=3.0, show_default=True, callback=_positive,
              help="Seconds of silence after which a worker is declared dead.")
@click.option("--heartbeat-interval", type=float, default=0.5, show_default=True, callback=_positive)
@click.option("--min-workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Issue no job until this many workers have joined.")
@click.option("--round-period", type=float, default=None, callback=_positive,
              help="Round-based algorithms: a round every this many seconds (default: demand-driven).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--events", type=click.Path(dir_okay=False), default=None, callback=output_file,
              help="Append every event as JSON lines.")
@click.option("--out", type=click.Path(file_okay=False), default=None, callback=output_dir,
              help="Write summary.json and final_x.npy here at the end.")
@click.option("--state", "state_dir", type=click.Path(file_okay=False), default=None, callback=output_dir,
              help="State directory: journal and checkpoints; start again with the same DIR to resume.")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=1000, show_default=True,
              help="With --state: checkpoint every N updates (0: only by time and at exit).")
@click.option("--checkpoint-interval", type=click.FloatRange(min=0), default=30.0, show_default=True, callback=_finite,
              help="With --state: checkpoint at least every this many seconds (0: never by time).")
@click.option("--fsync", type=click.Choice(["always", "batch", "never"]), default="batch", show_default=True,
              help="With --state: journal durability (batch = group commit every 10 ms).")
@click.option("--log-payloads/--no-log-payloads", default=False, show_default=True,
              help="With --state: journal every gradient (replay without recomputing; costs 4 bytes per "
                   "parameter per reply on disk).")
@click.option("--max-journal-bytes", type=click.IntRange(min=0), default=1 << 30, show_default=True,
              help="With --state: bound on the journal on disk (0: none). A checkpoint is forced when the "
                   "current segment reaches a quarter of it; past it, segments the kept checkpoints cover are "
                   "removed (replay then starts from the oldest kept checkpoint).")
@click.option("--repair", is_flag=True, default=False,
              help="With --state: if the journal is damaged (a bad record before its end, records missing), keep "
                   "the records before the damage and move the rest aside into DIR/damaged-<time>/ (nothing is "
                   "deleted), say what was dropped, and resume.")
@click.option("--keys", "keys_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="CurveZMQ keys directory (`latecomer keys init`): encrypt, and accept only allow-listed workers.")
@click.option("--insecure", is_flag=True, default=False,
              help="Allow binding a non-loopback address without --keys (no authentication, no encryption).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on this port (0: any free port; the port is logged).")
@click.option("--metrics-addr", default="127.0.0.1", show_default=True, help="Address of the metrics endpoint.")
@click.option("--max-workers", type=click.IntRange(1, 65536), default=10_000, show_default=True,
              help="Refuse a new worker (err REFUSED) while this many are joined.")
@click.option("--max-workers-per-key", type=click.IntRange(min=1), default=8, show_default=True,
              help="With --keys: refuse a new worker while its CurveZMQ key already has this many joined.")
@click.option("--shm", type=click.Choice(["auto", "any", "off"]), default="auto", show_default=True,
              help="Same-host path: workers on this host exchange iterates and gradients through shared memory "
                   "(auto: offered to workers that ask and report this host's id; any: to every worker that asks, "
                   "e.g. containers sharing /dev/shm under another machine id, the worker's probe decides; "
                   "off: TCP for everyone).")
@click.option("--wire-dtype", type=click.Choice(["f32", "f16", "bf16"]), default="f32", show_default=True,
              help="Precision of iterates and gradients on the wire (TCP); the server keeps float32.")
@_allow_options
@click.option("--shards", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Shard the parameter vector over this many shard processes (contiguous ranges; a block is cut "
                   "only where the algorithm's work is elementwise; 0: one server process). Needs --state (a "
                   "temporary directory if not given).")
@click.option("--local-shards", type=click.IntRange(min=0), default=None,
              help="How many of the shards serve starts on this host, slots 0.. (default: all); the others are "
                   "`latecomer shard --coordinator ...` started elsewhere.")
@click.option("--shard-bind", default="tcp://127.0.0.1:0", show_default=True, callback=bind_endpoint,
              help="The coordinator's endpoint for its shards (give a fixed port for remote shards).")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="json: one JSON object per line, lifecycle events with their fields.")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--progress/--no-progress", default=None,
              help="A progress bar (steps, rate, workers, last evaluation) on stderr; default: when stderr is a "
                   "terminal and the log is text.")
@log_to_option
@_dashboard_options
def serve(bind, problem, problem_opt, algorithm, settings, config, batch_size, max_steps, max_time, target_loss,
          eval_every, liveness_timeout, heartbeat_interval, min_workers, round_period, seed, events, out,
          state_dir, checkpoint_every, checkpoint_interval, fsync, log_payloads, max_journal_bytes, repair, keys_dir,
          insecure, metrics_port, metrics_addr, max_workers, max_workers_per_key, shm, wire_dtype, allow_problem,
          allow_algorithm, shards, local_shards, shard_bind, log_format, log_level, progress, log_to) -> None:
    """Run the server daemon in the foreground.

    Resuming a --state directory whose run.json names a problem or algorithm of your own
    (module:callable) needs the command line to name it too: --problem/--algorithm equal to it, or
    --allow-problem/--allow-algorithm patterns that match it.
    """
    from ps.net.security import is_loopback_endpoint

    _setup_logging(log_level, log_format)
    if not keys_dir and not insecure and not is_loopback_endpoint(bind):
        raise click.UsageError(f"binding {bind} without --keys would let anyone on the network connect and "
                               "read the traffic: give --keys DIR (see `latecomer keys`) or --insecure")
    spec = training_spec(problem, problem_opt, algorithm, settings, config, default_problem="digits",
                         default_algorithm="ordered-momentum")
    spec.max_steps = max_steps
    if heartbeat_interval >= liveness_timeout:
        raise click.BadParameter("must be smaller than --liveness-timeout", param_hint="--heartbeat-interval")
    from ps.net import supervise
    if supervise.is_supervisor():  # the front and restarts here; the daemon is a child (ps/net/supervise.py)
        raise SystemExit(supervise.supervise(bind, state_dir))
    bind = supervise.daemon_bind(bind)
    if local_shards is not None and local_shards > shards:
        raise click.BadParameter(f"more than the {shards} shards", param_hint="--local-shards")
    if shards and not state_dir:
        import tempfile

        state_dir = tempfile.mkdtemp(prefix="latecomer-sharded-")
        logging.getLogger("latecomer.server").info("a sharded server needs a state directory: %s", state_dir)
    opts = ServeOptions(batch_size=batch_size, max_steps=max_steps, max_time=max_time, target_loss=target_loss,
                        eval_every=eval_every, liveness_timeout=liveness_timeout,
                        heartbeat_interval=heartbeat_interval, min_workers=min_workers, round_period=round_period,
                        seed=seed, events=events, keys_dir=keys_dir, shm=shm, wire_dtype=wire_dtype,
                        caps={"max_workers": max_workers, "max_workers_per_key": max_workers_per_key},
                        shards=shards, shard_bind=shard_bind)
    state = StateOptions(state_dir, checkpoint_every, checkpoint_interval, fsync, log_payloads, max_journal_bytes,
                         repair) if state_dir else None
    daemon = make_daemon(spec, bind, opts, state=state, allowed=_allowed(allow_problem, allow_algorithm).naming(
        problem=spec.problem, algorithm=spec.algorithm))
    add_loggers(daemon, log_to)
    daemon.install_signal_handlers()
    if metrics_port is not None:
        start_metrics(daemon, metrics_port, metrics_addr)
    _start_dashboard(daemon)
    supervise.announce(daemon)  # "listening on ..." (or, supervised, ready to the supervisor)
    bar = ServeBar(max_steps) if want_progress(progress, sys.stderr, log_format) else None
    daemon.on_progress = bar or log_progress
    local = None
    if daemon.hub is not None:
        from ps.cli.shard import start_local_shards

        local = start_local_shards(daemon, state_dir, local_shards, spec, allow_problem, allow_algorithm, shm)
    _serve_to_the_end(daemon, bar, [d for d in (out, state_dir) if d], local)


def _serve_to_the_end(daemon: Any, bar: Any, out_dirs: list[str], local: Any) -> None:
    try:
        with _bar_logging(bar):
            reason = serve_until_stopped(daemon, out_dirs)
    finally:
        if bar is not None:
            bar.close()
        if local is not None:
            local.close()
    click.echo(f"latecomer: stopped ({reason}) at step {daemon.core.version}")


def _bar_logging(bar: Any):
    """Log lines above the progress bar, not through it (tqdm's redirect), while there is one."""
    if bar is None:
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm()


# --------------------------------------------------------------------------- work

@main.command()
@click.option("--server", "-s", required=True, envvar="LATECOMER_SERVER", callback=server_endpoint,
              help="Server endpoint, tcp://HOST:PORT or ipc://PATH.")
@click.option("--worker-id", default="", envvar="LATECOMER_WORKER_ID",
              help="Stable worker name (default: with --key the key's NAME, NAME@HOST if the key is not named "
                   "after this host, -2, -3... for more workers of one key here; else HOST-PID).")
@click.option("--credit", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Jobs held at once (2 = one prefetched).")
@click.option("--device", default="cpu", show_default=True, help="Torch device: cpu, cuda or cuda:N.")
@click.option("--delay", type=click.FloatRange(min=0), default=0.0, show_default=True, callback=_finite,
              help="Injected extra seconds per job (heterogeneity for experiments).")
@click.option("--jitter", type=click.FloatRange(min=0), default=0.0, show_default=True, callback=_finite,
              help="Half-normal noise scale added to each job's delay (seconds).")
@click.option("--slowdown", type=click.FloatRange(min=1), default=1.0, show_default=True, callback=_finite,
              help="Stretch the measured compute time by this factor.")
@click.option("--data-delay/--no-data-delay", default=False,
              help="Multiply the delay by the problem's per-sample cost (data-dependent delays).")
@click.option("--cache-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--give-up", type=float, default=None, callback=_positive,
              help="Exit after this many seconds without a server (default: retry forever).")
@click.option("--max-jobs", type=click.IntRange(min=1), default=None, help="Exit after this many jobs.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="Torch CPU threads.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the delay jitter.")
@click.option("--key", "key_secret", type=click.Path(exists=True, dir_okay=False), default=None,
              envvar="LATECOMER_KEY", help="CurveZMQ: this worker's NAME.key_secret (from `keys add-worker`).")
@click.option("--server-key", type=click.Path(exists=True, dir_okay=False), default=None,
              envvar="LATECOMER_SERVER_KEY", help="CurveZMQ: the server's public server.key.")
@click.option("--shm", type=click.Choice(["auto", "off"]), default="auto", show_default=True,
              help="Same-host path: use the server's shared memory when it offers it (auto) or never (off).")
@click.option("--problem-opt", multiple=True, metavar="KEY=VALUE",
              help="Override a worker-local option of the server's problem here, e.g. a data path on this host "
                   "(repeatable; options the problem does not declare worker-local are refused).")
@click.option("--allow-problem", "allow_problem", multiple=True, metavar="PATTERN", envvar=ENV_ALLOW_PROBLEM,
              callback=_allow_patterns,
              help="Load this problem of your own when the server names it: module:callable or an fnmatch "
                   "pattern ('mymodel:*', 'mypkg.*'); repeatable. Built-in problems need none; a worker never "
                   "imports anything else a server names (SECURITY.md, trust model).")
@click.option("--log-level", default="warning", type=click.Choice(["debug", "info", "warning", "error"]))
def work(server, worker_id, credit, device, delay, jitter, slowdown, data_delay, cache_size, give_up, max_jobs,
         threads, seed, key_secret, server_key, shm, problem_opt, allow_problem, log_level) -> None:
    """Run one worker: connect to a server and compute the jobs it hands out."""
    _setup_logging(log_level)
    if worker_id and not (worker_id.isascii() and worker_id.isprintable() and len(worker_id) <= 64):
        raise click.BadParameter("1-64 printable ASCII characters", param_hint="--worker-id")
    if not (device in ("cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())):
        raise click.BadParameter(f"expected cpu, cuda or cuda:N, got {device!r}", param_hint="--device")
    if device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise click.ClickException(f"--device {device}: CUDA is not available on this machine")
        n_gpus = torch.cuda.device_count()
        if device.startswith("cuda:") and int(device[5:]) >= n_gpus:
            raise click.ClickException(f"--device {device}: this machine has {n_gpus} CUDA device(s): "
                                       f"give cuda:0 to cuda:{n_gpus - 1}")
    from worker.link import WorkerConfig, run_worker
    from worker.runner import DelaySpec

    if bool(key_secret) != bool(server_key):
        raise click.UsageError("CurveZMQ needs both --key and --server-key")
    cfg = WorkerConfig(server=server, worker_id=worker_id, credit=credit, device=device, cache_size=cache_size,
                       give_up_s=give_up, max_jobs=max_jobs, threads=threads, key_secret=key_secret,
                       server_key=server_key, shm=shm,
                       problem_overrides=tuple(_parse_pairs(problem_opt, "--problem-opt").items()),
                       allow_problems=allow_problem,
                       delay=DelaySpec(delay_s=delay, jitter_s=jitter, slowdown=slowdown, data_dependent=data_delay,
                                       seed=seed))
    try:
        reason = run_worker(cfg)
    except ValueError as e:  # unusable keys
        raise click.BadParameter(str(e), param_hint="--key/--server-key") from None
    click.echo(f"latecomer worker: stopped ({reason})", err=True)
    if reason.startswith(f"server refused: {ID_IN_USE}"):  # a --worker-id another live worker has
        raise SystemExit(2)


# --------------------------------------------------------------------------- run (embedded default)

def _spawn_worker(endpoint: str, wid: str, delay: float, extra: list[str]) -> subprocess.Popen:
    from latecomer.api import spawn_worker  # the Python API's local workers are started the same way

    return spawn_worker(endpoint, wid, delay, extra, stderr=subprocess.PIPE, give_up_s=10.0)


@main.command()
@_training_options("digits", "ordered-momentum")
@click.option("--workers", "-n", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Local worker processes.")
@click.option("--delays", default="0,0.002,0.006,0.02", show_default=True,
              help="Comma-separated injected seconds per job, one per worker (cycled).")
@click.option("--steps", type=click.IntRange(min=1), default=3000, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Samples per job (default: the problem's own batch_size, e.g. TorchProblem(batch_size=), else 32).")
@click.option("--eval-every", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default="runs/latest", show_default=True, callback=output_dir,
              help="Where the summary, the events and the plots go.")
@click.option("--progress/--no-progress", default=True)
@log_to_option
@_dashboard_options
def run(problem, problem_opt, algorithm, settings, config, workers, delays, steps, batch_size, eval_every, seed, out,
        progress, log_to) -> None:
    """The embedded default: a server plus local workers of different speeds on loopback."""
    _setup_logging("warning")
    try:
        delay_list = [float(x) for x in delays.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected numbers separated by commas, got {delays!r}", param_hint="--delays") \
            from None
    if not delay_list or any(d < 0 or not math.isfinite(d) for d in delay_list):
        raise click.BadParameter("delays must be finite numbers >= 0", param_hint="--delays")
    spec = training_spec(problem, problem_opt, algorithm, settings, config, default_problem="digits",
                         default_algorithm="ordered-momentum", default_settings={"lr": 0.3, "beta": 0.3})
    spec.max_steps = steps
    os.makedirs(out, exist_ok=True)
    events_path = os.path.join(out, "events.jsonl")
    if os.path.exists(events_path):
        os.remove(events_path)
    daemon = make_daemon(spec, "tcp://127.0.0.1:0", ServeOptions(
        batch_size=batch_size, max_steps=steps, eval_every=eval_every, min_workers=workers, seed=seed,
        events=events_path))
    add_loggers(daemon, log_to)
    daemon.install_signal_handlers()
    dash = _start_dashboard(daemon)
    if dash is not None:
        click.echo(f"dashboard on {dash.http.url}", err=True)
    from tqdm import tqdm

    from problems.trust import is_user_problem

    # the workers are ours: they trust the problem this command line names (SECURITY.md, trust model)
    allow = ["--allow-problem", spec.problem] if is_user_problem(spec.problem) else []
    procs = [_spawn_worker(daemon.endpoint, f"w{i + 1}", delay_list[i % len(delay_list)], allow)
             for i in range(workers)]
    bar = tqdm(total=steps, desc=f"{spec.algorithm} on {spec.problem}", unit="step", disable=not progress,
               dynamic_ncols=True)

    daemon.on_progress = functools.partial(_bar_progress, bar, steps)
    try:
        reason = daemon.run()
    finally:
        bar.n = min(daemon.core.version, steps)
        bar.close()
        from ps.drivers.outputs import write_outputs
        write_outputs(out, daemon)
        daemon.close()
        from ps.ops.children import reap
        reap(procs, 5.0, terminate=False)  # they got the bye: they exit by themselves
    from ps.ops.report import age_stats, plot_run, read_events

    ev = read_events(events_path)
    plot_path = plot_run(daemon.evaluations, ev, os.path.join(out, "convergence.png"),
                         title=f"{spec.algorithm} on {spec.problem}, {workers} workers")
    click.echo(_run_summary(daemon, spec, workers, delay_list, reason, age_stats(ev), plot_path))


def _bar_progress(bar: Any, steps: int, d: Any, ev: dict | None) -> None:
    """``run``'s progress bar: steps, workers, the latest loss (and accuracy); before the first
    step, what it waits for (workers starting, then loading the problem)."""
    bar.n = min(d.core.version, steps)
    post = {"workers": len(d.core.workers)}
    if d.core.version == 0:
        post["waiting"] = waiting_for(d)
    if d.evaluations:
        last = d.evaluations[-1]
        post["loss"] = f"{last['loss']:.4f}"
        if "accuracy" in last:
            post["acc"] = f"{last['accuracy']:.3f}"
    bar.set_postfix(post, refresh=False)
    bar.refresh()


def _run_summary(daemon, spec: TrainingSpec, workers: int, delays: list[float], reason: str, ages: dict,
                 plot_path: str) -> str:
    c = daemon.core.counters
    first, last = daemon.evaluations[0], daemon.evaluations[-1]
    lines = [
        "",
        f"latecomer run: {spec.algorithm} on {spec.problem}, {workers} workers "
        f"(injected delays {', '.join(f'{d * 1000:g} ms' for d in delays[:workers])})",
        f"  stopped:   {reason} after {daemon.summary()['elapsed_s']:.1f} s",
        f"  steps:     {daemon.core.version}",
        f"  jobs:      issued {c.issued}, applied {c.applied}, dropped {c.dropped}, lost {c.lost}, "
        f"{f'failed {c.failed}, ' if c.failed else ''}cancelled {c.cancelled}, outstanding {daemon.core.outstanding}",
        f"  ages:      mean {ages['mean']:.2f}, median {ages['p50']:.0f}, p90 {ages['p90']:.0f}, max {ages['max']:.0f}",
    ]
    for key in ("loss", "accuracy", "f1", "grad_norm_sq"):
        if key in first:
            lines.append(f"  {key + ':':10s} {first[key]:.4g} -> {last[key]:.4g}")
    lines.append(f"  plot:      {plot_path}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- simulate

@main.command()
@_training_options("quadratic", "ordered-momentum")
@click.option("--workers", "-n", type=click.IntRange(1, 100000), default=10, show_default=True)
@click.option("--delays", "delay_model", default="sqrt", show_default=True,
              type=click.Choice(["sqrt", "sqrt1", "linear", "uniform", "mixture"]))
@click.option("--noise", default="sqrt", show_default=True, type=click.Choice(["sqrt", "frac", "none"]))
@click.option("--time", "max_time", type=float, default=200.0, show_default=True, callback=_positive,
              help="Simulated seconds.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None)
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--crash", "crashes", multiple=True, metavar="WORKER@TIME[+REJOIN]",
              help="Crash worker index (0-based) at a simulated time, optionally rejoining after a delay.")
@click.option("--loss-prob", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Probability that a reply is lost in transit.")
@click.option("--liveness-timeout", type=float, default=10.0, show_default=True, callback=_positive)
@click.option("--eval-every", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--wire-dtype", type=click.Choice(["f32", "f16", "bf16"]), default="f32", show_default=True,
              help="How iterates and gradients travel (PROTOCOL.md §6.12): simulated workers compute on the "
                   "quantized iterate and their gradients reach the server quantized.")
@click.option("--shards", type=click.IntRange(min=1), default=1, show_default=True,
              help="Shard the parameter vector over this many server shards (contiguous ranges; blocks cut only "
                   "where the algorithm's work is elementwise; one decision for all, checked; the same bits as 1).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default="runs/sim", show_default=True, callback=output_dir,
              help="Write trace.csv, convergence.png, summary.json and final_x.npy here.")
def simulate(problem, problem_opt, algorithm, settings, config, workers, delay_model, noise, max_time, max_steps,
             batch_size, crashes, loss_prob, liveness_timeout, eval_every, wire_dtype, shards, seed, out) -> None:
    """Run the same server core against simulated workers (deterministic, seeded)."""
    from ps.core.config import CoreConfig
    from ps.drivers.sim import Crash, DelayModel, Simulator

    spec = training_spec(problem, problem_opt, algorithm, settings, config, default_problem="quadratic",
                         default_algorithm="ordered-momentum")
    spec.max_steps = max_steps
    problem_obj, alg = spec.build()
    crash_list = []
    for c in crashes:
        try:
            w, _, rest = c.partition("@")
            at, _, rejoin = rest.partition("+")
            crash_list.append(Crash(int(w), float(at), float(rejoin) if rejoin else None))
        except ValueError:
            raise click.BadParameter(f"expected WORKER@TIME[+REJOIN], got {c!r}", param_hint="--crash") from None
        times = (crash_list[-1].at, crash_list[-1].rejoin_after)
        if not all(t is None or (math.isfinite(t) and t >= 0) for t in times):
            raise click.BadParameter(f"TIME and REJOIN must be finite seconds >= 0, got {c!r}", param_hint="--crash")
        if not 0 <= crash_list[-1].worker < workers:
            raise click.BadParameter(f"worker index {crash_list[-1].worker} out of range", param_hint="--crash")
    cfg = CoreConfig(problem=spec.problem, problem_options=dict(problem_obj.options or {}), batch_size=batch_size,
                     liveness_timeout_s=liveness_timeout, min_workers=workers, seed=seed)
    try:
        sim = Simulator(alg, problem_obj, DelayModel.named(delay_model, workers, noise=noise), cfg, seed=seed,
                        crashes=crash_list, loss_prob=loss_prob, wire_dtype=wire_dtype, shards=shards)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--shards") from None
    from tqdm import tqdm

    bar = tqdm(total=max_time, desc=f"simulating {spec.algorithm}", unit="sim-s", dynamic_ncols=True)

    def progress(core, t):
        bar.n = min(t, max_time)
        bar.refresh() if core.version % 200 == 0 else None

    trace = sim.run(max_time=max_time, max_updates=max_steps, eval_every=eval_every, progress=progress)
    bar.n = min(trace.final_t, max_time)
    bar.close()
    title = (f"{spec.algorithm} on {spec.problem} (simulated, {workers} workers, {delay_model}"
             f"{'' if wire_dtype == 'f32' else ', wire ' + wire_dtype}{'' if shards == 1 else f', {shards} shards'})")
    plot = _write_sim_outputs(trace, out, title, {"wire_dtype": wire_dtype, "shards": shards})
    first, last = trace.points[0], trace.points[-1]
    c = trace.counters
    click.echo(f"simulated {trace.final_t:.1f} s: {c['updates']} updates, applied {c['applied']}, "
               f"dropped {c['dropped']}, lost {c['lost']}, wire dtype {wire_dtype}")
    for key in ("loss", "grad_norm_sq", "accuracy"):
        if key in first:
            click.echo(f"  {key}: {first[key]:.6g} -> {last[key]:.6g}")
    click.echo(f"  trace: {os.path.join(out, 'trace.csv')}  plot: {plot}")


def _write_sim_outputs(trace, out: str, title: str, extra: dict) -> str:
    """trace.csv, convergence.png, summary.json and final_x.npy (as ``serve --out`` writes it) in
    ``out``; returns the plot's path."""
    from ps.ops.report import plot_run, write_trace_csv

    os.makedirs(out, exist_ok=True)
    write_trace_csv(trace, os.path.join(out, "trace.csv"))
    evs = [{"ev": "applied", "age": a[3], "worker_id": a[2], "t": a[4]} for a in trace.applied]
    plot = plot_run(trace.points, evs, os.path.join(out, "convergence.png"), title=title)
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump({"counters": trace.counters, "points": trace.points[-1:], "final_t": trace.final_t, **extra}, f,
                  indent=1)
    np.save(os.path.join(out, "final_x.npy"), np.asarray(trace.final_x))
    return plot


# --------------------------------------------------------------------------- status

@main.command()
@click.option("--server", "-s", required=True, envvar="LATECOMER_SERVER", callback=server_endpoint,
              help="Server endpoint, tcp://HOST:PORT or ipc://PATH.")
@click.option("--key", "key_secret", type=click.Path(exists=True, dir_okay=False), default=None,
              envvar="LATECOMER_KEY", help="CurveZMQ: an allow-listed key pair (.key_secret).")
@click.option("--server-key", type=click.Path(exists=True, dir_okay=False), default=None,
              envvar="LATECOMER_SERVER_KEY", help="CurveZMQ: the server's public server.key.")
@click.option("--watch", is_flag=True, help="Refresh until interrupted.")
@click.option("--interval", type=float, default=2.0, show_default=True, callback=_positive)
@click.option("--timeout", type=float, default=5.0, show_default=True, callback=_positive,
              help="Seconds to wait for the server's answer.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw figures as JSON.")
def status(server, key_secret, server_key, watch, interval, timeout, as_json) -> None:
    """Show a running server's workers, jobs, ages, step rate and loss (a read-only request)."""
    from ps.ops.status import fetch_status, render_status

    if bool(key_secret) != bool(server_key):
        raise click.UsageError("CurveZMQ needs both --key and --server-key")
    while True:
        try:
            st = fetch_status(server, timeout_s=timeout, key_secret=key_secret, server_key=server_key)
        except TimeoutError as e:
            raise click.ClickException(str(e)) from None
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--key/--server-key") from None
        if as_json:
            click.echo(json.dumps({"info": st.info, "columns": list(st.columns), "rows": [list(r) for r in st.rows]}))
        else:
            if watch:
                click.clear()
            click.echo(render_status(st))
        if not watch:
            return
        time.sleep(interval)


# --------------------------------------------------------------------------- keys

@main.group()
def keys() -> None:
    """CurveZMQ keys: the server's key pair and the allow-list of worker keys."""


@keys.command("init")
@click.argument("keys_dir", type=click.Path(file_okay=False), callback=output_dir)
def keys_init(keys_dir) -> None:
    """Make the server key pair and an empty allow-list in KEYS_DIR."""
    from ps.net.security import fingerprint, init_keys, load_public

    try:
        pub = init_keys(keys_dir)
    except FileExistsError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"server key {fingerprint(load_public(pub))}: give {pub} to every worker; "
               f"the secret stays in {keys_dir}")


@keys.command("add-worker")
@click.argument("name")
@click.option("--keys", "keys_dir", required=True, type=click.Path(exists=True, file_okay=False))
def keys_add_worker(name, keys_dir) -> None:
    """Make a key pair for worker NAME and allow it (takes effect at the next SIGHUP or start)."""
    from ps.net.security import add_worker, fingerprint, load_public

    try:
        pub, sec = add_worker(keys_dir, name)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"worker key {name} ({fingerprint(load_public(pub))}): give {sec} and "
               f"{os.path.join(keys_dir, 'server.key')} to the worker (--key, --server-key)")


@keys.command("revoke")
@click.argument("name")
@click.option("--keys", "keys_dir", required=True, type=click.Path(exists=True, file_okay=False))
def keys_revoke(name, keys_dir) -> None:
    """Remove worker NAME from the allow-list (send the server SIGHUP to apply it now)."""
    from ps.net.security import revoke_worker

    try:
        revoke_worker(keys_dir, name)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"revoked {name}: `kill -HUP <server pid>` applies it without a restart")


# --------------------------------------------------------------------------- replay, stop

@main.command()
@click.argument("state_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--algorithm", "-a", default=None,
              help="Re-run the recorded delay trace under this algorithm instead (in the simulator).")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE", help="Its hyper-parameters.")
@click.option("--out", type=click.Path(file_okay=False), default=None, callback=output_dir,
              help="With --algorithm: trace and plot here.")
@_allow_options
def replay(state_dir, algorithm, settings, out, allow_problem, allow_algorithm) -> None:
    """Re-run a recorded run exactly from its journal and check the final iterate bit for bit.

    Gradients journaled without payload are recomputed from their seeds with the problem's
    oracle (deterministic on CPU). With --algorithm, the recorded per-worker job durations are
    played back in the simulator under another algorithm, for a like-for-like comparison.
    A problem or algorithm of your own that run.json names is loaded only with --allow-problem/
    --allow-algorithm patterns that match it.
    """
    from ps.drivers.replay import recorded_final_x, replay_run

    allowed = _allowed(allow_problem, allow_algorithm)
    try:
        result = replay_run(state_dir, allowed)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    recorded = recorded_final_x(state_dir)
    if result.from_checkpoint:
        click.echo(f"the journal before LSN {result.start_lsn} was removed (serve --max-journal-bytes): replaying "
                   f"from {result.from_checkpoint}")
    click.echo(f"replayed {result.records} journal records: step {result.version}, "
               f"applied {result.counters['applied']}, lost {result.counters['lost']}, "
               f"final iterate sha256 {result.sha256[:16]}")
    if algorithm is None:
        if recorded is None:
            click.echo("no final_x.npy (the server did not stop cleanly): nothing to compare with")
            return
        same = recorded.dtype == result.final_x.dtype and np.array_equal(recorded, result.final_x)
        click.echo(f"bit-identical to the recorded final iterate: {'yes' if same else 'NO'}")
        if not same:
            diff = float(np.max(np.abs(recorded.astype(np.float64) - result.final_x)))
            raise click.ClickException(f"replay differs from the recorded iterate (max abs diff {diff:.3g})")
        return
    _replay_other_algorithm(state_dir, result, algorithm, _parse_pairs(settings, "--set"), out, allowed)


def _replay_other_algorithm(state_dir, result, algorithm, settings, out, allowed) -> None:
    from ps.drivers.replay import TraceDelays, build_from_run
    from ps.drivers.sim import Simulator
    from ps.journal.runfile import read_run

    run = read_run(state_dir)
    try:
        where = os.path.join(state_dir, "run.json")
        problem, alg, cfg = build_from_run(run, algorithm=algorithm, settings=settings, allowed=allowed, where=where)
        _, base_alg, _ = build_from_run(run, allowed=allowed, where=where)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--algorithm/--set") from None
    workers = sorted(result.durations, key=lambda w: (len(w), w))
    seqs = [result.durations[w] for w in workers]
    horizon = sum(sum(s) for s in seqs) / max(1, len(seqs))
    rows = []
    import dataclasses

    cfg = dataclasses.replace(cfg, min_workers=len(workers))
    for name, a in ((run["algorithm"], base_alg), (algorithm, alg)):
        tr = Simulator(a, problem, TraceDelays(seqs), cfg).run(max_time=horizon, eval_every=50)
        rows.append((name, tr))
    click.echo(f"the recorded delay trace of {len(workers)} workers ({', '.join(workers)}), "
               f"{horizon:.1f} s per worker, played back in the simulator:")
    for name, tr in rows:
        last = tr.points[-1]
        figs = ", ".join(f"{k} {last[k]:.4g}" for k in ("loss", "accuracy", "grad_norm_sq") if k in last)
        click.echo(f"  {name:24s} steps {tr.counters['updates']:6d}  {figs}")
    if out:
        from ps.ops.report import write_trace_csv

        os.makedirs(out, exist_ok=True)
        for name, tr in rows:
            write_trace_csv(tr, os.path.join(out, f"trace-{name}.csv"))


@main.command()
@click.option("--state", "state_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="The server's state directory.")
@click.option("--timeout", type=float, default=60.0, show_default=True, callback=_positive,
              help="Seconds to wait for the server to exit.")
def stop(state_dir, timeout) -> None:
    """Ask a running server to drain: checkpoint, say bye to the workers, exit.

    Only a verified server is signalled: a live process must hold the lock on DIR/server.pid,
    and the pid and start time the file holds must be that process's (ps/journal/lock.py
    ``locked_server``). A server.pid left by a crash, or one naming another process, is refused
    with one line and nothing is signalled.
    """
    import signal

    import psutil

    from ps.journal.lock import locked_server, wait_unlocked
    from ps.journal.statedir import StateError

    try:
        proc, fd = locked_server(state_dir)
    except StateError as e:
        raise click.ClickException(str(e)) from None
    try:
        try:
            proc.send_signal(signal.SIGTERM)  # psutil checks the pid was not reused meanwhile
        except psutil.NoSuchProcess:
            click.echo(f"server {proc.pid} stopped")
            return
        except psutil.AccessDenied:
            raise click.ClickException(f"not permitted to signal the server (pid {proc.pid})") from None
        if not wait_unlocked(fd, proc, timeout):
            raise click.ClickException(f"server {proc.pid} still running after {timeout:g} s")
        click.echo(f"server {proc.pid} stopped")
    finally:
        os.close(fd)


@main.command()
@click.option("--duration", type=float, default=60.0, show_default=True, callback=_positive, help="Seconds.")
@click.option("--workers", "-n", type=click.IntRange(2, 32), default=5, show_default=True)
@click.option("--kills", type=click.IntRange(min=0), default=10, show_default=True, help="Worker kills (-9).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--state", "state_dir", type=click.Path(file_okay=False), default=None, callback=output_dir,
              help="State directory of the server (default: a new temporary one).")
def chaos(duration, workers, kills, seed, state_dir) -> None:
    """Kill, freeze and restart random workers and once the server; then judge the run."""
    from ps.ops.chaos import Chaos

    if state_dir and os.path.exists(os.path.join(state_dir, "run.json")):
        raise click.BadParameter(f"{state_dir} already holds a run", param_hint="--state")
    report = Chaos(duration_s=duration, workers=workers, kills=kills, seed=seed, state_dir=state_dir,
                   log=lambda line: click.echo(line, err=True)).run()
    click.echo(report.render())
    if not report.passed:
        raise SystemExit(1)


# --------------------------------------------------------------------------- launch, report (issue 8)

@main.command()
@click.option("--hosts", "hosts_file", type=click.Path(dir_okay=False), default=None,
              help="Hosts file: one line per host, HOST COUNT [DEVICE] (DEVICE cpu, cuda or cuda:N).")
@click.option("--server", default=None, callback=remote_server_endpoint,
              help="Server endpoint the workers connect to, tcp://HOST:PORT.")
@click.option("--launch-file", default="latecomer-launch.json", show_default=True, type=click.Path(dir_okay=False),
              help="JSON record of the started workers (hosts and remote PIDs), read by --stop.")
@click.option("--stop", "stop_", is_flag=True, help="Stop the workers recorded in --launch-file.")
@click.option("--ssh", default="ssh", show_default=True, help="The ssh program (and options), e.g. 'ssh -p 2222'.")
@click.option("--remote-cmd", default="latecomer", show_default=True,
              help="The latecomer command on the hosts, e.g. ~/venv/bin/latecomer.")
@click.option("--worker-args", default="", help="Extra `latecomer work` options for every worker, e.g. '--credit 2'.")
@click.option("--allow-problem", "allow_problem", multiple=True, metavar="PATTERN", callback=_allow_patterns,
              help="Passed to every worker: the problem of your own it may load (module:callable or a pattern; "
                   "repeatable). Built-in problems need none.")
@click.option("--log-dir", default="/tmp", show_default=True, help="Directory on the hosts for the worker logs.")
@click.option("--grace", type=float, default=10.0, show_default=True, callback=_positive,
              help="With --stop: seconds between SIGTERM and SIGKILL.")
@click.option("--ssh-timeout", type=float, default=30.0, show_default=True, callback=_positive,
              help="Seconds to wait for each ssh command.")
@click.option("--dry-run", is_flag=True, help="Print the ssh commands instead of running them.")
def launch(hosts_file, server, launch_file, stop_, ssh, remote_cmd, worker_args, allow_problem, log_dir, grace,
           ssh_timeout, dry_run) -> None:
    """Start workers on the hosts of a hosts file over ssh (or stop them again with --stop)."""
    import shlex

    from ps.ops import launch as lm

    try:
        if stop_:
            if dry_run:
                record = lm.read_launch_file(launch_file)
                pids: dict[str, list[int]] = {}
                for w in record["workers"]:
                    pids.setdefault(w["host"], []).append(int(w["pid"]))
                for host, ps_ in pids.items():
                    click.echo(shlex.join(lm.ssh_argv(ssh if ssh != "ssh" else record.get("ssh", ssh), host,
                                                      lm.remote_stop_command(ps_, grace))))
                return
            lm.stop(launch_file, ssh=None if ssh == "ssh" else ssh, grace_s=grace, timeout=ssh_timeout,
                    echo=click.echo)
            return
        if not hosts_file:
            raise click.UsageError("missing option '--hosts' (or --stop)")
        if not server:
            raise click.UsageError("missing option '--server'")
        try:
            extra = tuple(shlex.split(worker_args))
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--worker-args") from None
        extra += tuple(a for p in allow_problem for a in ("--allow-problem", p))
        hosts = lm.read_hosts(hosts_file)
        if dry_run:
            for w in lm.plan(hosts, log_dir):
                click.echo(shlex.join(lm.ssh_argv(ssh, w.host, lm.remote_start_command(w, server, remote_cmd,
                                                                                         extra))))
            return
        if os.path.exists(launch_file):
            raise click.ClickException(f"{launch_file} exists (workers already launched?): stop them with "
                                       f"`latecomer launch --stop --launch-file {launch_file}` or pick another "
                                       f"--launch-file")
        usage_check(check_output_file, launch_file, "--launch-file")  # before any worker starts
        record = lm.launch(hosts, server, launch_file, ssh=ssh, remote_cmd=remote_cmd, worker_args=extra,
                           log_dir=log_dir, timeout=ssh_timeout, echo=click.echo)
        click.echo(f"{len(record['workers'])} workers started; launch file {launch_file}")
    except lm.LaunchError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.argument("state_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", type=click.Path(file_okay=False), default=None, callback=output_dir,
              help="Where the plots and report.md go (default STATE_DIR/report).")
@click.option("--events", "events_path", type=click.Path(dir_okay=False), default=None,
              help="The event log (default STATE_DIR/events.jsonl).")
def report(state_dir, out, events_path) -> None:
    """Plots and a markdown summary of a run from its state (or --out) directory's events.jsonl."""
    from ps.ops.report import make_report

    out = out or os.path.join(state_dir, "report")
    try:
        result = make_report(state_dir, out, events_path=events_path)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    for path in result["files"]:
        click.echo(path)


def _add_shard_command() -> None:
    from ps.cli.shard import shard

    main.add_command(shard)  # `latecomer shard`: a sharded server's shard process (ps/sharded/shard.py)


_add_shard_command()


if __name__ == "__main__":  # pragma: no cover
    main()
