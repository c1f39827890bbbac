"""The ``latecomer`` command line: the click group and its commands, one module per group of them.

A new command goes into the module of its group (ps/cli/serve.py: serve, stop; work.py: work, run;
simulate.py: simulate, replay; status.py: status, report; dashboard.py; keys.py; launch.py: launch,
chaos; algorithm_list.py; shard.py; conformance.py; problem_check.py) or a module of its own, and
is added to :data:`main` below. What
several commands share (option groups, callbacks, ``--config``) is in ps/cli/options.py; output
paths are checked by ps/cli/paths.py.

User mistakes raise ``click.BadParameter``/``click.UsageError``/``click.ClickException``: a
one-line message and exit code 2 (usage) or 1, never a traceback. Real bugs keep theirs.

Every command ignores SIGTERM and SIGINT once the interpreter exits (:func:`_exit_deaf_to_stop_signals`).
"""

from __future__ import annotations

import atexit
import signal
from typing import Any

import click

from ps.cli.advise import advise
from ps.cli.algorithm_list import list_algorithms
from ps.cli.conformance import conformance
from ps.cli.dashboard import dashboard
from ps.cli.keys import keys
from ps.cli.launch import chaos, launch
from ps.cli.problem_check import check_problem
from ps.cli.serve import serve, stop
from ps.cli.shard import shard
from ps.cli.simulate import replay, simulate
from ps.cli.status import report, status
from ps.cli.work import run, work


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
    atexit.unregister(_exit_deaf_to_stop_signals)  # once, however often a test invokes the group
    atexit.register(_exit_deaf_to_stop_signals)


def _exit_deaf_to_stop_signals() -> None:
    """From the interpreter's exit on, SIGTERM and SIGINT are ignored. The server, its shards and
    its workers stop on the first one they get and exit with their own status; but Python puts the
    default action back for every signal it handled while it tears itself down, so a second
    SIGTERM in that moment killed a process that had already stopped cleanly, and its status 0
    became 143. SLURM sends exactly that: scancel's SIGTERM, then the job's end sends another to
    every process of the job (tests/integration/test_exit_signals.py). SIG_IGN is a disposition
    Python leaves as it is; SIGKILL still ends the process."""
    try:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
    except ValueError:  # not the main thread (a command invoked from a test's thread): nothing to protect
        pass


# `latecomer --help` lists them sorted by name (_LazyGroup.list_commands), whatever the order here
for _command in (serve, stop, shard, work, run, simulate, replay, status, report, dashboard, list_algorithms, keys,
                 launch, chaos, conformance, advise, check_problem):
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    main()
