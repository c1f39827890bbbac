"""A problem with negligible compute, for transport benchmarks: ``grad`` returns a fixed,
precomputed vector, so what is measured is the system moving parameters and gradients.

f(x) = ½‖x‖²  is what ``evaluate`` reports; the returned gradient is *not* ∇f (it is a constant
small vector): never train anything real with this.
"""

from __future__ import annotations

import numpy as np

from problems.base import GradResult, Problem


class SyntheticProblem(Problem):
    """The constant gradient 1e-3 everywhere, at no cost: what the benchmarks time is the transport."""

    fresh_gradients = True  # one read-only array, never written

    def __init__(self, d: int, blocks: int = 1) -> None:
        if d < 1:
            raise ValueError(f"d must be >= 1, got {d}")
        if not 1 <= blocks <= min(d, 64):
            raise ValueError(f"blocks must be in [1, {min(d, 64)}], got {blocks}")
        # ``blocks`` 1-D layout blocks of (nearly) equal size: what a sharded server splits over shards
        sizes = [d // blocks + (i < d % blocks) for i in range(blocks)]
        self.layout = (("x", (d,)),) if blocks == 1 else tuple((f"x{i}", (n,)) for i, n in enumerate(sizes))
        self._g = np.full(d, 1e-3, np.float32)
        self._g.setflags(write=False)

    def init_params(self, seed: int) -> np.ndarray:
        return np.zeros(self.dim, np.float32)

    def grad(self, x: np.ndarray, seed: int, batch_size: int) -> GradResult:
        return GradResult(self._g, 0.0)

    def evaluate(self, x: np.ndarray) -> dict[str, float]:
        return {"loss": 0.5 * float(np.dot(x, x))}


def make_synthetic(d: int = 1000, blocks: int = 1, device: str = "cpu") -> SyntheticProblem:
    """Negligible-compute problem of ``d`` float32 parameters in ``blocks`` layout blocks (benchmarks only)."""
    return SyntheticProblem(d, blocks)
