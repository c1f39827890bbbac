"""``latecomer check-problem``: a problem against the contract workers rely on, before it meets them."""

from __future__ import annotations

import click

from ps.cli.options import parse_pairs


@click.command("check-problem")
@click.argument("spec", metavar="SPEC")
@click.option("--problem-opt", multiple=True, metavar="KEY=VALUE",
              help="Problem option, e.g. --problem-opt d=256 (repeatable).")
@click.option("--seed", type=int, default=0, show_default=True, help="Job seed of the first call.")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
def check_problem(spec, problem_opt, seed, batch_size) -> None:
    """Load SPEC (a built-in name or module:callable, found as `latecomer serve` finds it) and check
    it against the problem contract (latecomer.testing.check_problem): float32 vectors of the
    layout's size, the same bits for the same (x, seed, batch size), fresh_gradients only where it
    holds, a finite loss. One line and exit status 1 when something breaks."""
    from latecomer.testing import check_problem as check

    options = parse_pairs(problem_opt, "--problem-opt")
    try:
        check(spec, options, seed=seed, batch_size=batch_size)
    except (AssertionError, ValueError) as e:  # a broken contract; a spec or option that does not load
        raise click.ClickException(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from None
    click.echo(f"{spec}: meets the problem contract (init_params, grad, grad_pair, evaluate at seed {seed})")
