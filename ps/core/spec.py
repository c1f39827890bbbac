"""What a run trains, as its run.json recorded it: the problem, the algorithm and their settings.

:class:`TrainingSpec` names what to train and builds it (the problem loaded, the algorithm built
and bound to the problem's layout, or split over shards); ps/journal/runfile.py reads a recorded
run back (``recorded_settings``, ``core_config``). Pure code: the server's assembly
(ps/drivers/server.py) and a shard (ps/sharded/state.py) both build from it, so a shard needs
nothing of the layers above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainingSpec:
    """What to train: problem, algorithm and their settings (from flags and an optional TOML file)."""

    problem: str
    problem_options: dict[str, Any] = field(default_factory=dict)
    algorithm: str = "ordered-momentum"
    settings: dict[str, Any] = field(default_factory=dict)
    max_steps: int | None = None  # the run's step limit: the default decay_steps of an lr schedule

    def build(self, device: str = "cpu"):
        """Load the problem and build (and bind) the algorithm; user errors become ClickExceptions.

        ``settings`` is completed with what the run's context provides (``decay_steps`` from
        ``max_steps``), so that recording it lets resume and replay rebuild the same algorithm.
        """
        import algorithms
        from algorithms.registry import complete_settings
        from problems import load_problem

        try:
            problem = load_problem(self.problem, self.problem_options, device=device)
        except ValueError as e:
            import click

            raise click.BadParameter(str(e), param_hint="--problem/--problem-opt") from None
        try:
            self.settings = complete_settings(algorithms.ALGORITHMS, self.algorithm, self.settings,
                                              max_steps=self.max_steps)
            alg = algorithms.build(self.algorithm, self.settings)
        except ValueError as e:
            import click

            raise click.BadParameter(str(e), param_hint="--algorithm/--set") from None
        bind = getattr(alg, "bind", None)
        if bind is not None:  # the problem's lmo_mask, if any, says which blocks get LMO steps
            alg = algorithms.base.bind_layout(alg, problem.layout, getattr(problem, "lmo_mask", None))
        return problem, alg

    def build_sharded(self, shards: int, device: str = "cpu"):
        """The problem and the algorithm as :class:`algorithms.sharding.Sharded` over ``shards``
        shards (algorithms/sharding.py), bound to the problem's layout: its ``coordinator`` runs on
        the coordinator, ``parts[i]`` on shard i (docs/ALGORITHMS.md §14)."""
        import algorithms
        from algorithms.base import bind_layout
        from algorithms.sharding import Sharded

        problem, _ = self.build(device)  # loads the problem and completes the settings
        try:
            alg = bind_layout(Sharded(algorithms.build(self.algorithm, self.settings), n_shards=shards),
                              problem.layout, getattr(problem, "lmo_mask", None))
        except ValueError as e:
            import click

            raise click.BadParameter(str(e), param_hint="--shards") from None
        return problem, alg
