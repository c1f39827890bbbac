"""``latecomer serve`` (the server daemon in the foreground) and ``latecomer stop`` (ask one to
drain). A sharded server's shard processes: ps/cli/shard.py."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

import click

from ps.cli.dashboard import dashboard_options, start_dashboard
from ps.cli.options import (
    add_loggers,
    allow_options,
    allowed_from,
    busy_poll_setting,
    cipher_threads_env,
    finite,
    log_to_option,
    positive,
    training_options,
    training_spec,
)
from ps.cli.paths import output_dir, output_file
from ps.drivers.server import (
    ServeBar,
    ServeOptions,
    StateOptions,
    log_progress,
    make_daemon,
    serve_until_stopped,
    start_metrics,
    want_progress,
)
from ps.net.endpoints import bind_endpoint
from ps.net.supervise import ServeCommand
from ps.observe.log_setup import setup_logging

DEFAULT_PORT = 5555


@click.command(cls=ServeCommand)  # --supervise, --max-unfinished-bytes (ps/net/supervise.py)
@click.option("--bind", default=f"tcp://127.0.0.1:{DEFAULT_PORT}", show_default=True, callback=bind_endpoint,
              help="ZeroMQ endpoint to bind: tcp://HOST:PORT (HOST * for every interface, [::1] for IPv6; "
                   "port 0: any free port) or ipc://PATH.")
@training_options("digits", "ordered-momentum")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Samples per job (default: the problem's own batch_size, e.g. TorchProblem(batch_size=), else 32).")
@click.option("--max-steps", type=click.IntRange(min=1), default=None, help="Stop after this many updates.")
@click.option("--max-time", type=float, default=None, callback=positive, help="Stop after this many seconds.")
@click.option("--target-loss", type=float, default=None, callback=finite,
              help="Stop once the evaluated loss is at most this.")
@click.option("--eval-every", type=click.IntRange(min=0), default=100, show_default=True,
              help="Evaluate the model every N updates.")
@click.option("--liveness-timeout", type=float, default=3.0, show_default=True, callback=positive,
              help="Seconds of silence after which a worker is declared dead.")
@click.option("--heartbeat-interval", type=float, default=0.5, show_default=True, callback=positive)
@click.option("--min-workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Issue no job until this many workers have joined.")
@click.option("--round-period", type=float, default=None, callback=positive,
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
@click.option("--checkpoint-interval", type=click.FloatRange(min=0), default=30.0, show_default=True, callback=finite,
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
@allow_options
@click.option("--shards", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Shard the parameter vector over this many shard processes (contiguous ranges; a block is cut "
                   "only where the algorithm's work is elementwise; 0: one server process). Needs --state (a "
                   "temporary directory if not given).")
@click.option("--local-shards", type=click.IntRange(min=0), default=None,
              help="How many of the shards serve starts on this host, slots 0.. (default: all); the others are "
                   "`latecomer shard --coordinator ...` started elsewhere.")
@click.option("--shard-bind", default="tcp://127.0.0.1:0", show_default=True, callback=bind_endpoint,
              help="The coordinator's endpoint for its shards (give a fixed port for remote shards).")
@click.option("--busy-poll-us", default="auto", show_default=True, metavar="auto|N", callback=busy_poll_setting,
              help="Before it sleeps waiting for messages, the server polls without blocking for up to N "
                   "microseconds (0 to 100000), the window adapted to how soon messages have come (it shrinks to "
                   "nothing when they come later than N): a worker whose replies come back within it is served "
                   "without the wake-up of a sleeping CPU, at the cost of that CPU time. 0: never; auto: 400 while "
                   "this host has a CPU for the server and for each worker and shard of the run on it, else 0 "
                   "(benchmarks/PROFILE.md).")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="json: one JSON object per line, lifecycle events with their fields.")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--progress/--no-progress", default=None,
              help="A progress bar (steps, rate, workers, last evaluation) on stderr; default: when stderr is a "
                   "terminal and the log is text.")
@log_to_option
@dashboard_options
def serve(bind, problem, problem_opt, algorithm, settings, config, batch_size, max_steps, max_time, target_loss,
          eval_every, liveness_timeout, heartbeat_interval, min_workers, round_period, seed, events, out, state_dir,
          checkpoint_every, checkpoint_interval, fsync, log_payloads, max_journal_bytes, repair, keys_dir, insecure,
          metrics_port, metrics_addr, max_workers, max_workers_per_key, shm, wire_dtype, allow_problem,
          allow_algorithm, shards, local_shards, shard_bind, busy_poll_us, log_format, log_level, progress, log_to):
    """Run the server daemon in the foreground.

    Resuming a --state directory whose run.json names a problem or algorithm of your own
    (module:callable) needs the command line to name it too: --problem/--algorithm equal to it, or
    --allow-problem/--allow-algorithm patterns that match it.
    """
    from ps.net.security import is_loopback_endpoint

    setup_logging(log_level, log_format)
    cipher_threads_env()
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
    public, bind = bind, supervise.daemon_bind(bind)
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
    daemon = make_daemon(spec, bind, opts, state=state, allowed=allowed_from(allow_problem, allow_algorithm).naming(
        problem=spec.problem, algorithm=spec.algorithm))
    daemon.transport.behind_front, daemon.busy_poll = bind != public, busy_poll_us  # front: X-Source
    add_loggers(daemon, log_to)
    daemon.install_signal_handlers()
    supervise.watch_supervisor(daemon)  # supervised: stop (and stop the local shards) once the supervisor is gone
    if metrics_port is not None:
        start_metrics(daemon, metrics_port, metrics_addr)
    start_dashboard(daemon)
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


@click.command()
@click.option("--state", "state_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="The server's state directory.")
@click.option("--timeout", type=float, default=60.0, show_default=True, callback=positive,
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

