"""``latecomer launch`` (workers on remote hosts over ssh) and ``latecomer chaos`` (kill, freeze and
restart workers and the server, then judge the run)."""

from __future__ import annotations

import os

import click

from ps.cli.options import allow_patterns, positive
from ps.cli.paths import check_output_file, output_dir, usage_check
from ps.net.endpoints import remote_server_endpoint


@click.command()
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
@click.option("--allow-problem", "allow_problem", multiple=True, metavar="PATTERN", callback=allow_patterns,
              help="Passed to every worker: the problem of your own it may load (module:callable or a pattern; "
                   "repeatable). Built-in problems need none.")
@click.option("--log-dir", default="/tmp", show_default=True, help="Directory on the hosts for the worker logs.")
@click.option("--grace", type=float, default=10.0, show_default=True, callback=positive,
              help="With --stop: seconds between SIGTERM and SIGKILL.")
@click.option("--ssh-timeout", type=float, default=30.0, show_default=True, callback=positive,
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


@click.command()
@click.option("--duration", type=float, default=60.0, show_default=True, callback=positive, help="Seconds.")
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
