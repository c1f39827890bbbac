"""Asynchronous server algorithms: pure state machines (see ``algorithms/base.py``).

``ALGORITHMS`` is the explicit registry: adding a class here enrols it in the CLI and in the
contract tests.
"""

from algorithms.base import Algorithm, JobSpec, Outcome, Result
from algorithms.baselines import VanillaASGD
from algorithms.ordered import OrderedMomentum
from algorithms.registry import build as _build
from algorithms.registry import hyper_parameters

ALGORITHMS: dict[str, type[Algorithm]] = {
    VanillaASGD.name: VanillaASGD,
    OrderedMomentum.name: OrderedMomentum,
}


def build(name: str, settings=None) -> Algorithm:
    """Build a registered algorithm from its name and hyper-parameter settings."""
    return _build(ALGORITHMS, name, settings)


__all__ = ["ALGORITHMS", "Algorithm", "JobSpec", "Outcome", "Result", "build", "hyper_parameters"]
