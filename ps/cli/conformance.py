"""``latecomer conformance``: the conformance kit for workers written from PROTOCOL.md
(ps/ops/conformance.py, docs/CONFORMANCE.md)."""

from __future__ import annotations

import shlex
import shutil

import click


@click.command("conformance")
@click.option("--worker", "command", default=None, metavar="'CMD {endpoint}'",
              help="The worker under test: a command line with {endpoint} where the kit's tcp endpoint goes.")
@click.option("--case", "names", multiple=True, metavar="NAME", help="Run only this case (repeatable).")
@click.option("--sharded/--unsharded", default=None,
              help="Only the sharded cases (PROTOCOL.md §12), or only the others (default: both).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1, max=600), default=10.0, show_default=True,
              help="The longest the kit waits for one expected message (seconds).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the results here as JSON.")
@click.option("--list", "list_only", is_flag=True, help="List the cases and exit.")
def conformance(command, names, sharded, timeout_s, json_path, list_only) -> None:
    """Play the protocol's cases against a worker; one PASS or FAIL line per case; exit 1 if any fails."""
    from ps.ops.conformance import run_cases, select, write_json
    from ps.ops.conformance_cases import CASES
    from ps.ops.conformance_shards import CASES as SHARD_CASES

    all_cases = CASES[:-1] + SHARD_CASES + CASES[-1:]  # bye ends a worker: last
    if list_only:
        for c in all_cases:
            click.echo(f"{c.name:18s} §{c.section:18s} {c.what}")
        return
    if command is None:
        raise click.UsageError("Missing option '--worker'.")
    _check_command(command)
    try:
        cases = select(all_cases, tuple(names), sharded)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--case") from None
    if not cases:
        raise click.UsageError("no case left to play: the --case names and --sharded/--unsharded exclude each other")
    results = run_cases(command, cases, timeout_s, echo=click.echo)
    failed = [r for r in results if not r.ok]
    click.echo(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    if json_path:
        write_json(json_path, results)
    if failed:
        raise SystemExit(1)


def _check_command(command: str) -> None:
    """A worker command the kit can start: {endpoint} in it, a shell-like line, a program that exists."""
    if "{endpoint}" not in command:
        raise click.BadParameter("the command needs {endpoint} where the kit's endpoint goes", param_hint="--worker")
    try:
        argv = shlex.split(command)
    except ValueError as e:
        raise click.BadParameter(f"not a command line: {e}", param_hint="--worker") from None
    if not argv or shutil.which(argv[0]) is None:
        raise click.BadParameter(f"no program {argv[0] if argv else command!r} to run", param_hint="--worker")
