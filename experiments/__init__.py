"""Reference experiments in the simulator (``latecomer experiment NAME``).

Each experiment is ``run(out_dir, quick, seed, progress) -> dict`` and writes a CSV of every
curve, PNG plots and a markdown table of the headline numbers into ``out_dir``. The returned
dict names the files (``csv``, ``png``: lists; ``markdown``) and holds the ``headline`` numbers.
"""

from __future__ import annotations

from typing import Callable

from experiments import (
    adamw_charlm,
    async_vs_sync,
    delayed_vr,
    ordered_momentum,
    rennala_mvr,
    ringmaster_lmo,
    wire_dtype,
)

EXPERIMENTS: dict[str, Callable[..., dict]] = {
    "rennala-mvr": rennala_mvr.run,
    "delayed-vr": delayed_vr.run,
    "async-vs-sync": async_vs_sync.run,
    "ordered-momentum": ordered_momentum.run,
    "ringmaster-lmo": ringmaster_lmo.run,
    "wire-dtype": wire_dtype.run,
    "adamw-charlm": adamw_charlm.run,
}


def get(name: str) -> Callable[..., dict]:
    """The ``run`` function of experiment ``name``.

    Raises:
        KeyError: unknown name (the message lists the known ones).
    """
    if name not in EXPERIMENTS:
        raise KeyError(f"unknown experiment {name!r} (choose one of {', '.join(sorted(EXPERIMENTS))})")
    return EXPERIMENTS[name]


__all__ = ["EXPERIMENTS", "get"]
