"""``latecomer dashboard`` (a finished run's page), and the live dashboard options that ``serve``
and ``run`` take (ps/ops/dashboard.py, issue 25)."""

from __future__ import annotations

from typing import Any

import click

from ps.observe.log_setup import setup_logging


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
    ctx.meta[param.name] = value  # read by start_dashboard: the commands' signatures stay as they are
    return value


def dashboard_options(f):
    """``--dashboard-port`` and ``--dashboard-addr`` of serve and run (ps/ops/dashboard.py)."""
    f = click.option("--dashboard-addr", default="127.0.0.1", show_default=True, callback=_dashboard_meta,
                     expose_value=False,
                     help="Address of the dashboard (another than loopback shows the run, read-only, to anyone "
                          "who can reach it).")(f)
    return click.option("--dashboard-port", type=click.IntRange(0, 65535), default=None, callback=_dashboard_meta,
                        expose_value=False,
                        help="Serve a live dashboard (a web page) on this port (0: any free port; the address "
                             "is logged).")(f)


def start_dashboard(daemon: Any) -> Any:
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


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--port", type=click.IntRange(0, 65535), default=8265, show_default=True,
              help="The page's port (0: any free port).")
@click.option("--addr", default="127.0.0.1", show_default=True, callback=_dashboard_addr,
              help="The page's address.")
def dashboard(run_dir, port, addr) -> None:
    """Serve the dashboard of a finished run (a serve --state or an --out directory) until Ctrl-C."""
    from ps.ops.dashboard import serve_recorded

    setup_logging("warning")
    try:
        serve_recorded(run_dir, port, addr, lambda line: click.echo(line))
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"cannot serve the dashboard on {addr}:{port}: {e}") from None
