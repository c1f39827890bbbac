"""``latecomer algorithms``: what each algorithm is and what its hyper-parameters mean."""

from __future__ import annotations

import click


@click.command("algorithms")
@click.argument("names", nargs=-1, metavar="[NAME|module:Class]...")
def list_algorithms(names) -> None:
    """List the algorithms (or just NAMES), what each hyper-parameter means, and the wrapper keys."""
    import algorithms
    from algorithms.registry import describe, resolve, summary
    from algorithms.wrappers import WrapperSettings

    try:
        classes = [(n, resolve(algorithms.ALGORITHMS, n)) for n in names] or sorted(algorithms.ALGORITHMS.items())
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="NAME") from None
    for name, cls in (*classes, ("wrappers", WrapperSettings)):
        hp, text = algorithms.hyper_parameters(cls), describe(cls)
        head = "wrappers: --set keys that compose with any algorithm (see algorithms/wrappers.py)" \
            if cls is WrapperSettings else f"{name}: {summary(cls)}"
        click.echo(head)
        for k, (_, default) in hp.items():
            click.echo(f"  {k + '=' + repr(default):28s} {text[k] or '(undocumented)'}")
