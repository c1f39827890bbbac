"""Nesterov's worst-case tridiagonal quadratic with a noisy gradient oracle (docs/ALGORITHMS.md §8.1).

f(x) = ½ xᵀAx − bᵀx with A = (L/4)·tridiag(−1, 2, −1) and b = −(L/4)·e₁ (the sign the group's
code uses). A is never formed: ``A @ x`` is three vector operations.
"""

from __future__ import annotations

import math

import numpy as np

from problems.base import GradResult, Layout, Problem

NOISE_KINDS = ("scalar", "isotropic")
X0_KINDS = ("nesterov", "zeros")


def tridiag_matvec(x: np.ndarray, scale: float) -> np.ndarray:
    """``scale * tridiag(-1, 2, -1) @ x`` without forming the matrix.

    Args:
        x: float64 vector.
        scale: the factor in front of the matrix (L/4 for the Nesterov quadratic).

    Returns:
        A new float64 vector of the same shape.
    """
    y = 2.0 * x
    y[1:] -= x[:-1]
    y[:-1] -= x[1:]
    return scale * y


class NesterovQuadratic(Problem):
    """The §8.1 quadratic with scalar or isotropic Gaussian gradient noise.

    ``grad(x, seed, b)`` is ``A x − b + σ·ξ`` where ξ is the mean of ``b`` independent draws:
    one N(0, 1) scalar added to every coordinate (``noise="scalar"``, as the group's code) or a
    N(0, I_d) vector (``"isotropic"``). The mean is drawn directly as N(0, 1/b), which has the
    same law and costs O(d) whatever ``b`` is. The reported loss is the noiseless f(x) − f*.

    ``lmo_mask = (True,)``: the Muon methods orthogonalise the one vector block as a 1×d matrix
    (≈ 0.859·u/‖u‖ under Polar Express), as the Ringmaster-LMO group's quadratic script does
    (it passes no layout); without the flag a vector block would take the momentum fallback.
    """

    fresh_gradients = True  # every call returns new arrays

    def __init__(self, d: int = 64, L: float = 1.0, sigma: float = 0.01, noise: str = "scalar",
                 x0: str = "nesterov"):
        if d < 1:
            raise ValueError(f"quadratic: d must be >= 1, got {d}")
        if not L > 0:
            raise ValueError(f"quadratic: L must be > 0, got {L}")
        if not sigma >= 0:
            raise ValueError(f"quadratic: sigma must be >= 0, got {sigma}")
        if noise not in NOISE_KINDS:
            raise ValueError(f"quadratic: noise must be one of {', '.join(NOISE_KINDS)}, got {noise!r}")
        if x0 not in X0_KINDS:
            raise ValueError(f"quadratic: x0 must be one of {', '.join(X0_KINDS)}, got {x0!r}")
        self.d, self.L, self.sigma, self.noise, self.x0_kind = d, float(L), float(sigma), noise, x0
        self.layout: Layout = (("x", (d,)),)
        self.lmo_mask: tuple[bool, ...] = (True,)  # Muon: the vector as one 1×d matrix (the group's script)
        self._scale = self.L / 4.0
        # A x* = b  <=>  tridiag(-1,2,-1) x* = -e1, whose solution is the first column of the
        # inverse, negated: (T^-1)_{i1} = (d + 1 - i) / (d + 1) for i = 1..d.
        self.x_star = -np.arange(d, 0, -1, dtype=np.float64) / (d + 1)
        self.f_star = self._scale / 2.0 * self.x_star[0]  # f* = -½ bᵀx*

    def _residual(self, x: np.ndarray) -> np.ndarray:
        """∇f(x) = A x − b in float64."""
        g = tridiag_matvec(x, self._scale)
        g[0] += self._scale
        return g

    def _gap(self, x: np.ndarray) -> float:
        """f(x) − f* = ½ (x − x*)ᵀ A (x − x*), which stays accurate (and >= 0) near x*."""
        e = x - self.x_star
        return 0.5 * float(e @ tridiag_matvec(e, self._scale))

    def init_params(self, seed: int) -> np.ndarray:
        """x0 = (√d, 0, …, 0) (``x0="nesterov"``) or zeros; the seed is ignored."""
        x = np.zeros(self.d, dtype=np.float32)
        if self.x0_kind == "nesterov":
            x[0] = math.sqrt(self.d)
        return x

    def grad(self, x: np.ndarray, seed: int, batch_size: int) -> GradResult:
        """Noisy gradient; the noise comes from ``np.random.default_rng(seed)``.

        Args:
            x: point, shape (d,).
            seed: picks the noise; the same seed gives the same bits.
            batch_size: number of noise draws averaged (variance σ²/batch_size).

        Returns:
            float32 gradient and the noiseless gap f(x) − f*.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        x64 = np.asarray(x, dtype=np.float64)
        g = self._residual(x64)
        if self.sigma > 0:
            rng = np.random.default_rng(seed)
            std = self.sigma / math.sqrt(batch_size)
            g += std * (rng.standard_normal() if self.noise == "scalar" else rng.standard_normal(self.d))
        return GradResult(grad=g.astype(np.float32), loss=self._gap(x64))

    def evaluate(self, x: np.ndarray) -> dict[str, float]:
        """``loss`` = f(x) − f(x*) and ``grad_norm_sq`` = ‖Ax − b‖²."""
        x64 = np.asarray(x, dtype=np.float64)
        g = self._residual(x64)
        return {"loss": self._gap(x64), "grad_norm_sq": float(g @ g)}


def make_quadratic(d: int = 64, L: float = 1.0, sigma: float = 0.01, noise: str = "scalar",
                   x0: str = "nesterov", device: str = "cpu") -> NesterovQuadratic:
    """Factory for ``--problem quadratic`` (numpy only; ``device`` is ignored).

    Args:
        d: dimension.
        L: smoothness constant (λ_max(A) < L).
        sigma: noise standard deviation per draw.
        noise: ``"scalar"`` (one ξ on every coordinate) or ``"isotropic"``.
        x0: ``"nesterov"`` for (√d, 0, …, 0) or ``"zeros"``.
        device: unused.

    Raises:
        ValueError: an option is out of range.
    """
    return NesterovQuadratic(d=d, L=L, sigma=sigma, noise=noise, x0=x0)
