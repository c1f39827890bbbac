"""Asynchronous server algorithms: pure state machines (see ``algorithms/base.py``).

``ALGORITHMS`` is the explicit registry: adding a class here enrols it in the CLI and in the
contract tests.
"""

from algorithms.adam import Adam, AdamW
from algorithms.base import Algorithm, JobSpec, Outcome, Result
from algorithms.baselines import DelayAdaptiveASGD, DelayFilteredASGD, NaiveMomentumASGD, VanillaASGD
from algorithms.ordered import OrderedMomentum, OrderedMu2SGD
from algorithms.registry import build as _build
from algorithms.registry import hyper_parameters
from algorithms.rennala import RennalaMuon, RennalaMVR, RennalaMVRInexact, RennalaSGD
from algorithms.ringmaster import DelayAdaptiveMuon, RingmasterASGD, RingmasterLMO
from algorithms.storm import DelayedStormVR, SnapshotVR

ALGORITHMS: dict[str, type[Algorithm]] = {
    VanillaASGD.name: VanillaASGD,
    NaiveMomentumASGD.name: NaiveMomentumASGD,
    DelayAdaptiveASGD.name: DelayAdaptiveASGD,
    DelayFilteredASGD.name: DelayFilteredASGD,
    RingmasterASGD.name: RingmasterASGD,
    OrderedMomentum.name: OrderedMomentum,
    OrderedMu2SGD.name: OrderedMu2SGD,
    RingmasterLMO.name: RingmasterLMO,
    DelayAdaptiveMuon.name: DelayAdaptiveMuon,
    RennalaSGD.name: RennalaSGD,
    RennalaMVR.name: RennalaMVR,
    RennalaMVRInexact.name: RennalaMVRInexact,
    RennalaMuon.name: RennalaMuon,
    DelayedStormVR.name: DelayedStormVR,
    SnapshotVR.name: SnapshotVR,
    AdamW.name: AdamW,
    Adam.name: Adam,
}


def build(name: str, settings=None, *, max_steps: int | None = None) -> Algorithm:
    """Build a registered algorithm (or a user's ``"module:Class"``) from its name and settings
    (its hyper-parameters plus the wrapper keys of ``algorithms/wrappers.py``; ``max_steps`` is
    the default ``decay_steps`` of a schedule)."""
    return _build(ALGORITHMS, name, settings, max_steps=max_steps)


__all__ = ["ALGORITHMS", "Algorithm", "JobSpec", "Outcome", "Result", "build", "hyper_parameters"]
