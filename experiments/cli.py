"""``latecomer experiment NAME``: run one reference experiment in the simulator.

Register it in ``ps/cli/main.py`` with ``main.add_command(experiment)`` (imported from here).
"""

from __future__ import annotations

import os
import time

import click

from experiments import EXPERIMENTS
from ps.cli.paths import output_dir


@click.command("experiment")
@click.argument("name", metavar="NAME")
@click.option("--quick", is_flag=True, help="Small grids and short horizons (well under a minute).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds every simulation (same seed, same CSV).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None, callback=output_dir,
              help="Output folder [default: runs/experiments/NAME].")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--real", is_flag=True,
              help="async-vs-sync and ordered-momentum only: best simulator setting per method re-run on the real "
                   "daemon with local worker processes (injected delays); simulator and real curves side by side.")
@click.option("--part", type=click.Choice(["all", "grids", "recipes"]), default=None,
              help="ringmaster-lmo only: the tuned grids, the authors' recipes (their own settings, one run per "
                   "method), or both [default: all].")
def experiment(name: str, quick: bool, seed: int, out_dir: str | None, no_progress: bool, real: bool,
               part: str | None) -> None:
    """Run reference experiment NAME (rennala-mvr, delayed-vr, async-vs-sync,
    ordered-momentum, ringmaster-lmo, wire-dtype, adamw-charlm): a CSV of every
    curve, PNG plots and a markdown table of the headline numbers go into the output folder."""
    table = EXPERIMENTS
    if real:
        from experiments.real import REAL_EXPERIMENTS

        table = REAL_EXPERIMENTS
    if name not in table:
        raise click.BadParameter(f"unknown {'real ' if real else ''}experiment {name!r} "
                                 f"(choose one of {', '.join(sorted(table))})", param_hint="NAME")
    if part is not None and (real or name != "ringmaster-lmo"):
        raise click.BadParameter("--part is for ringmaster-lmo only", param_hint="--part")
    out_dir = out_dir or os.path.join("runs", "experiments", f"real-{name}" if real else name)
    t0 = time.monotonic()
    extra = {} if part is None else {"part": part}
    result = table[name](out_dir, quick=quick, seed=seed, progress=not no_progress, **extra)
    elapsed = time.monotonic() - t0
    tags = (" (real)" if real else "") + (" (quick)" if quick else "")
    click.echo(f"experiment {name}{tags}, seed {seed}: {elapsed:.1f} s")
    for path in [*result["csv"], *result["png"], result["markdown"]]:
        click.echo(f"  {path}")
    with open(result["markdown"], encoding="utf-8") as f:
        click.echo(f.read())


if __name__ == "__main__":  # python -m experiments.cli NAME
    experiment()
