"""The problem interface: the objective both the server and the workers load.

The server uses ``layout``, ``init_params`` and ``evaluate``; workers use ``grad`` (and
``full_grad`` for finite sums) on seeded samples. Parameters travel as one flat float32
vector; ``layout`` names the blocks (e.g. per weight matrix, so Muon can step each matrix).

A user's own problem is given as ``module:callable``: the callable takes keyword options
(strings, numbers, booleans, as passed with ``--problem-opt key=value``) plus ``device`` and
returns an object with this interface (for a PyTorch model, a ``latecomer.TorchProblem``:
``problems/torch_problem.py``). Both sides call it with the same options; the server
announces spec and options to the workers in ``Welcome``.

Determinism contract: ``grad(x, seed, batch_size)`` must be a pure function of its arguments
on CPU (same bits every call, in every process). That is what makes the simulator/daemon
parity test and exact replay possible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

Layout = tuple[tuple[str, tuple[int, ...]], ...]


def layout_size(layout: Layout) -> int:
    """Total number of scalars in a layout."""
    return sum(math.prod(shape) for _, shape in layout)


def split_params(x: np.ndarray, layout: Layout) -> dict[str, np.ndarray]:
    """Views of the flat vector ``x`` as the named blocks of ``layout`` (no copies)."""
    if x.ndim != 1 or x.shape[0] != layout_size(layout):
        raise ValueError(f"parameter vector of shape {x.shape} does not match layout of size {layout_size(layout)}")
    out, off = {}, 0
    for name, shape in layout:
        n = math.prod(shape)
        out[name] = x[off:off + n].reshape(shape)
        off += n
    return out


@dataclass(frozen=True, slots=True)
class GradResult:
    """A worker's answer for one point: the gradient (float32, shape (d,)) and the sample loss."""

    grad: np.ndarray
    loss: float


class Problem:
    """Base class (and documentation) of the problem interface.

    Attributes:
        spec: the string that loads this problem (``"quadratic"``, ``"pkg.mod:make"``).
        options: the keyword options it was built with (msgpack-able scalars).
        layout: named block shapes of the flat parameter vector.
        num_samples: N for finite-sum problems (FULL_GRAD shards index [0, N)); None otherwise.
        lmo_mask: optional, one bool per layout block: True where an LMO/Muon step applies
            (TorchProblem sets it: matrices, not embeddings, not the output layer).
        fresh_gradients: True when ``grad``, ``grad_pair`` and ``full_grad`` never write into an
            array they returned before (each call returns new arrays, or buffers reused only
            once nobody references them, as TorchProblem's pool does). False (the default, and
            what a problem without the attribute counts as): the worker copies each gradient as
            it comes back, since it still holds the last one (a large frame is sent without a
            copy and read by ZeroMQ later; replies are kept for a resend to a restarted server).
            Set it only if it holds: a gradient written over in flight goes out silently wrong.
    """

    spec: str = ""
    options: dict[str, Any] = {}
    layout: Layout = ()
    num_samples: int | None = None
    fresh_gradients: bool = False

    @property
    def dim(self) -> int:
        return layout_size(self.layout)

    def init_params(self, seed: int) -> np.ndarray:
        """x0 as a float32 vector of shape (dim,)."""
        raise NotImplementedError

    def grad(self, x: np.ndarray, seed: int, batch_size: int) -> GradResult:
        """Stochastic gradient at x on the minibatch (or noise) picked by ``seed``."""
        raise NotImplementedError

    def grad_pair(self, x_new: np.ndarray, x_old: np.ndarray, seed: int,
                  batch_size: int) -> tuple[GradResult, GradResult]:
        """Gradients at two points on the *same* sample (STORM/MVR corrections). Without
        ``fresh_gradients`` the first is copied before the second call can write over it."""
        new = self.grad(x_new, seed, batch_size)
        if not self.fresh_gradients:
            new = GradResult(np.array(new.grad, copy=True), new.loss)
        return new, self.grad(x_old, seed, batch_size)

    def full_grad(self, x: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, int, float]:
        """Sum of component gradients over [lo, hi), the count, and the summed loss."""
        raise NotImplementedError(f"{self.spec} is not a finite-sum problem")

    def evaluate(self, x: np.ndarray) -> dict[str, float]:
        """Figures a person reads: always ``loss``; also e.g. ``grad_norm_sq``, ``accuracy``, ``f1``."""
        raise NotImplementedError

    def sample_cost(self, seed: int, batch_size: int) -> float:
        """Relative compute cost of the sample picked by ``seed`` (1.0 = normal).

        Used to inject data-dependent delays (a slow class takes κ times longer); the
        default is uniform cost.
        """
        return 1.0
