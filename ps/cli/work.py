"""``latecomer work`` (one worker) and ``latecomer run`` (the embedded default: a server and local
workers of different speeds on loopback)."""

from __future__ import annotations

import functools
import math
import os
import subprocess
from typing import Any

import click

from problems.trust import ENV_ALLOW_PROBLEM
from protocol.messages import ID_IN_USE
from ps.cli.dashboard import dashboard_options, start_dashboard
from ps.cli.options import (
    add_loggers,
    allow_patterns,
    cipher_threads_env,
    finite,
    log_to_option,
    parse_pairs,
    positive,
    training_options,
    training_spec,
)
from ps.cli.paths import output_dir
from ps.core.spec import TrainingSpec
from ps.drivers.server import ServeOptions, make_daemon, waiting_for
from ps.net.endpoints import server_endpoint
from ps.observe.log_setup import setup_logging


@click.command()
@click.option("--server", "-s", required=True, envvar="LATECOMER_SERVER", callback=server_endpoint,
              help="Server endpoint, tcp://HOST:PORT or ipc://PATH.")
@click.option("--worker-id", default="", envvar="LATECOMER_WORKER_ID",
              help="Stable worker name (default: with --key the key's NAME, NAME@HOST if the key is not named "
                   "after this host, -2, -3... for more workers of one key here; else HOST-PID).")
@click.option("--credit", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Jobs held at once (2 = one prefetched).")
@click.option("--device", default="cpu", show_default=True, help="Torch device: cpu, cuda or cuda:N.")
@click.option("--delay", type=click.FloatRange(min=0), default=0.0, show_default=True, callback=finite,
              help="Injected extra seconds per job (heterogeneity for experiments).")
@click.option("--jitter", type=click.FloatRange(min=0), default=0.0, show_default=True, callback=finite,
              help="Half-normal noise scale added to each job's delay (seconds).")
@click.option("--slowdown", type=click.FloatRange(min=1), default=1.0, show_default=True, callback=finite,
              help="Stretch the measured compute time by this factor.")
@click.option("--data-delay/--no-data-delay", default=False,
              help="Multiply the delay by the problem's per-sample cost (data-dependent delays).")
@click.option("--cache-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--give-up", type=float, default=None, callback=positive,
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
@click.option("--busy-poll", type=click.Choice(["auto", "off"]), default="auto", show_default=True,
              help="Busy-poll the wait for the next job for as long as the server advises (auto: where this "
                   "host has a CPU for each of the run's processes on it; serve --busy-poll-us), or never (off).")
@click.option("--problem-opt", multiple=True, metavar="KEY=VALUE",
              help="Override a worker-local option of the server's problem here, e.g. a data path on this host "
                   "(repeatable; options the problem does not declare worker-local are refused).")
@click.option("--allow-problem", "allow_problem", multiple=True, metavar="PATTERN", envvar=ENV_ALLOW_PROBLEM,
              callback=allow_patterns,
              help="Load this problem of your own when the server names it: module:callable or an fnmatch "
                   "pattern ('mymodel:*', 'mypkg.*'); repeatable. Built-in problems need none; a worker never "
                   "imports anything else a server names (SECURITY.md, trust model).")
@click.option("--log-level", default="warning", type=click.Choice(["debug", "info", "warning", "error"]))
def work(server, worker_id, credit, device, delay, jitter, slowdown, data_delay, cache_size, give_up, max_jobs,
         threads, seed, key_secret, server_key, shm, busy_poll, problem_opt, allow_problem, log_level) -> None:
    """Run one worker: connect to a server and compute the jobs it hands out."""
    setup_logging(log_level)
    cipher_threads_env()
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
                       server_key=server_key, shm=shm, busy_poll=busy_poll,
                       problem_overrides=tuple(parse_pairs(problem_opt, "--problem-opt").items()),
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


def _spawn_worker(endpoint: str, wid: str, delay: float, extra: list[str]) -> subprocess.Popen:
    from latecomer.api import spawn_worker  # the Python API's local workers are started the same way

    return spawn_worker(endpoint, wid, delay, extra, stderr=subprocess.PIPE, give_up_s=10.0)


@click.command()
@training_options("digits", "ordered-momentum")
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
@dashboard_options
def run(problem, problem_opt, algorithm, settings, config, workers, delays, steps, batch_size, eval_every, seed, out,
        progress, log_to) -> None:
    """The embedded default: a server plus local workers of different speeds on loopback."""
    setup_logging("warning")
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
    dash = start_dashboard(daemon)
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
