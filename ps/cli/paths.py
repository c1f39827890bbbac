"""Output paths given on the command line (``--state``, ``--out``, ``--events``, ...), checked
before anything runs.

Without this, a path whose parent is a file, or one that cannot be created (``/proc/nope/x``,
a read-only mount, no permission), surfaces as a ``NotADirectoryError``/``FileNotFoundError``
traceback, sometimes only at the end of a run (``serve --out`` writes there when it stops). The
checks here probe the file system the way the command will use it, then undo the probe:

- :func:`check_output_dir`: the directory exists and takes new files, or it can be created
  (every missing level is created and removed again).
- :func:`check_output_file`: the file can be opened for appending (an existing one is left as it
  is; a new one is created and removed again); its directory must exist, or be creatable when
  ``make_parents`` is set (for commands that create it).

Each raises :class:`OutputPathError` with one line naming the fix; :func:`output_dir` and
:func:`output_file` are the click callbacks that turn it into ``click.BadParameter`` (exit 2).
"""

from __future__ import annotations

import os
import tempfile

import click


class OutputPathError(ValueError):
    """An output path that cannot be written; the message says what to give instead."""


def _first_existing(path: str) -> tuple[str, list[str]]:
    """The nearest existing ancestor of ``path`` (itself included) and the missing levels below
    it, deepest first."""
    missing = []
    cur = path.rstrip(os.sep) or os.sep
    while not os.path.lexists(cur):
        missing.append(cur)
        parent = os.path.dirname(cur) or os.curdir
        if parent == cur:
            break
        cur = parent
    return cur, missing


def _fix() -> str:
    return "give a path in a directory you can write to"


def check_output_dir(path: str) -> str:
    """Check that ``path`` is, or can become, a directory this process can write files into.

    Returns ``path`` unchanged; raises :class:`OutputPathError`. Leaves the file system as it
    found it.
    """
    if os.path.isdir(path):
        try:
            fd, probe = tempfile.mkstemp(dir=path, prefix=".latecomer-probe-")
        except OSError as e:
            raise OutputPathError(f"cannot write into {path}: {e.strerror}: {_fix()}") from None
        os.close(fd)
        os.remove(probe)
        return path
    if os.path.lexists(path):
        what = "a broken link" if os.path.islink(path) else "a file"
        raise OutputPathError(f"{path} is {what}, not a directory: give a directory (or a new name)")
    anchor, missing = _first_existing(path)
    if not os.path.isdir(anchor):
        raise OutputPathError(f"cannot create {path}: {anchor} is a file, not a directory: {_fix()}")
    created = []
    try:
        for d in reversed(missing):
            os.mkdir(d)
            created.append(d)
    except OSError as e:
        raise OutputPathError(f"cannot create {path}: {e.strerror} ({e.filename}): {_fix()}") from None
    finally:
        for d in reversed(created):
            try:
                os.rmdir(d)
            except OSError:
                pass
    return path


def check_output_file(path: str, *, make_parents: bool = False) -> str:
    """Check that ``path`` can be opened for appending (the way event logs and records are
    written). With ``make_parents``, missing parent directories count as fine if they can be
    created (the command creates them). Returns ``path``; raises :class:`OutputPathError`.
    """
    if os.path.isdir(path):
        raise OutputPathError(f"{path} is a directory: give a file name (e.g. {os.path.join(path, 'events.jsonl')})")
    parent = os.path.dirname(path.rstrip(os.sep)) or os.curdir
    if not os.path.isdir(parent):
        anchor, _ = _first_existing(parent)
        if not os.path.isdir(anchor):
            raise OutputPathError(f"cannot create {path}: {anchor} is a file, not a directory: {_fix()}")
        if not make_parents:
            raise OutputPathError(f"cannot create {path}: directory {parent} does not exist: create it first "
                                  f"or {_fix()}")
        check_output_dir(parent)
        return path
    existed = os.path.lexists(path)
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise OutputPathError(f"cannot write {path}: {e.strerror}: {_fix()}") from None
    if not existed:
        try:
            os.remove(path)
        except OSError:
            pass
    return path


def output_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """click callback: ``value`` must be a directory this process can write into or create."""
    if value is None:
        return None
    try:
        return check_output_dir(value)
    except OutputPathError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None


def output_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """click callback: ``value`` must be a file this process can append to (its folder existing)."""
    if value is None:
        return None
    try:
        return check_output_file(value)
    except OutputPathError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None


def output_file_in_new_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """click callback: like :func:`output_file`, for commands that create the file's folder."""
    if value is None:
        return None
    try:
        return check_output_file(value, make_parents=True)
    except OutputPathError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None


def usage_check(check, value: str, hint: str, **kw) -> str:
    """Run ``check(value, **kw)`` inside a command body: :class:`OutputPathError` becomes
    ``click.BadParameter`` for ``hint`` (options whose check depends on another option)."""
    try:
        return check(value, **kw)
    except OutputPathError as e:
        raise click.BadParameter(str(e), param_hint=hint) from None
