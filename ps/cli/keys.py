"""``latecomer keys``: the CurveZMQ key pair of the server and the allow-list of worker keys
(ps/net/security.py)."""

from __future__ import annotations

import os

import click

from ps.cli.paths import output_dir


@click.group()
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
