"""A finite-sum L2-regularized logistic regression on synthetic data (numpy only).

F(w) = (1/N) Σᵢ fᵢ(w) with fᵢ(w) = log(1 + exp(−yᵢ aᵢᵀw)) + (reg/2)‖w‖², labels yᵢ ∈ {−1, +1}.
The regularizer sits inside every component so that a shard sum divided by its count is an
unbiased estimate of ∇F; this is the finite-sum problem for FULL_GRAD jobs (A12).
"""

from __future__ import annotations

import numpy as np

from problems.base import GradResult, Layout, Problem


def _sigmoid_neg(m: np.ndarray) -> np.ndarray:
    """σ(−m) = 1 / (1 + eᵐ), without overflow."""
    return np.exp(-np.logaddexp(0.0, m))


class LogisticRegression(Problem):
    """Binary logistic regression, no intercept, on N Gaussian feature vectors.

    The data come from ``np.random.default_rng(data_seed)``: features aᵢ ~ N(0, I_p), a true
    weight w° = 4·N(0, I_p)/√p and labels yᵢ = +1 with probability σ(aᵢᵀw°), so the classes are
    noisy but separable enough for accuracy to mean something.
    """

    fresh_gradients = True  # every call returns new arrays

    def __init__(self, n: int = 10000, p: int = 20, reg: float = 1e-3, data_seed: int = 0):
        if n < 1:
            raise ValueError(f"logreg: n must be >= 1, got {n}")
        if p < 1:
            raise ValueError(f"logreg: p must be >= 1, got {p}")
        if not reg >= 0:
            raise ValueError(f"logreg: reg must be >= 0, got {reg}")
        rng = np.random.default_rng(data_seed)
        self.features = rng.standard_normal((n, p))
        w_true = 4.0 * rng.standard_normal(p) / np.sqrt(p)
        prob = 1.0 / (1.0 + np.exp(-self.features @ w_true))
        self.labels = np.where(rng.random(n) < prob, 1.0, -1.0)
        self.reg = float(reg)
        self.num_samples = n
        self.layout: Layout = (("w", (p,)),)

    def _sums(self, w: np.ndarray, a: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
        """Summed component gradients and losses over the rows (a, y), regularizer included per row."""
        margin = y * (a @ w)
        grad = a.T @ (-y * _sigmoid_neg(margin)) + len(y) * self.reg * w
        loss = float(np.logaddexp(0.0, -margin).sum()) + len(y) * 0.5 * self.reg * float(w @ w)
        return grad, loss

    def init_params(self, seed: int) -> np.ndarray:
        """Zeros (the problem is convex; the seed is ignored)."""
        return np.zeros(self.dim, dtype=np.float32)

    def grad(self, x: np.ndarray, seed: int, batch_size: int) -> GradResult:
        """Mean gradient over ``batch_size`` samples drawn with replacement via ``default_rng(seed)``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        idx = np.random.default_rng(seed).integers(0, self.num_samples, size=batch_size)
        g, loss = self._sums(np.asarray(x, dtype=np.float64), self.features[idx], self.labels[idx])
        return GradResult(grad=(g / batch_size).astype(np.float32), loss=loss / batch_size)

    def full_grad(self, x: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, int, float]:
        """Sum of the component gradients over samples [lo, hi), the count hi − lo, and the summed loss.

        Raises:
            ValueError: the shard is not inside [0, N).
        """
        if not 0 <= lo <= hi <= self.num_samples:
            raise ValueError(f"shard [{lo}, {hi}) is not inside [0, {self.num_samples})")
        g, loss = self._sums(np.asarray(x, dtype=np.float64), self.features[lo:hi], self.labels[lo:hi])
        return g.astype(np.float32), hi - lo, loss

    def evaluate(self, x: np.ndarray) -> dict[str, float]:
        """Full-data ``loss`` F(w), ``grad_norm_sq`` ‖∇F(w)‖² and training ``accuracy``."""
        w = np.asarray(x, dtype=np.float64)
        g, loss = self._sums(w, self.features, self.labels)
        g /= self.num_samples
        accuracy = float(np.mean(np.where(self.features @ w >= 0, 1.0, -1.0) == self.labels))
        return {"loss": loss / self.num_samples, "grad_norm_sq": float(g @ g), "accuracy": accuracy}


def make_logreg(n: int = 10000, p: int = 20, reg: float = 1e-3, data_seed: int = 0,
                device: str = "cpu") -> LogisticRegression:
    """Factory for ``--problem logreg`` (numpy only; ``device`` is ignored).

    Args:
        n: number of samples N (``num_samples``).
        p: number of features.
        reg: L2 regularization strength.
        data_seed: seed of the synthetic data set.
        device: unused.

    Raises:
        ValueError: an option is out of range.
    """
    return LogisticRegression(n=n, p=p, reg=reg, data_seed=data_seed)
