"""``latecomer status`` (a running server's figures) and ``latecomer report`` (plots and a summary
of a finished run). ``export`` lives in ps/ops/export.py, ``dashboard`` in ps/cli/dashboard.py."""

from __future__ import annotations

import json
import os
import time

import click

from ps.cli.options import positive
from ps.cli.paths import output_dir
from ps.net.endpoints import server_endpoint


@click.command()
@click.option("--server", "-s", required=True, envvar="LATECOMER_SERVER", callback=server_endpoint,
              help="Server endpoint, tcp://HOST:PORT or ipc://PATH.")
@click.option("--key", "key_secret", type=click.Path(exists=True, dir_okay=False), default=None,
              envvar="LATECOMER_KEY", help="CurveZMQ: an allow-listed key pair (.key_secret).")
@click.option("--server-key", type=click.Path(exists=True, dir_okay=False), default=None,
              envvar="LATECOMER_SERVER_KEY", help="CurveZMQ: the server's public server.key.")
@click.option("--watch", is_flag=True, help="Refresh until interrupted.")
@click.option("--interval", type=float, default=2.0, show_default=True, callback=positive)
@click.option("--timeout", type=float, default=5.0, show_default=True, callback=positive,
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


@click.command()
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
