"""Small shared pieces of the per-reply algorithms."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from algorithms.base import JobSpec
from protocol.messages import JobKind


def grad_job(version: int, x: np.ndarray) -> JobSpec:
    """A GRAD job at the current iterate x_k (x must already be read-only)."""
    return JobSpec(kind=JobKind.GRAD, created_at=version, iterate_ids=(version,), points=(x,))


def frozen(x: np.ndarray) -> np.ndarray:
    """Mark a freshly computed iterate read-only: it may now be sent zero-copy and cached."""
    x.setflags(write=False)
    return x


@dataclass(slots=True)
class IterateState:
    """State of a momentum-free per-reply method: the version and the (immutable) iterate."""

    version: int
    x: np.ndarray
