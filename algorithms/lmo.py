"""Linear minimization oracles and Newton–Schulz orthogonalization (docs/ALGORITHMS.md §1, §6.1).

Pure math on numpy arrays, no state. Sign convention (§1): ``lmo(m) = argmin_{‖u‖≤1} ⟨m, u⟩``,
so ``x + η·lmo(m)`` is a descent step. :func:`muon_direction` instead returns the Muon update
``O`` with the descent step ``x − η·O`` (the public code's convention); ``O ≈ −lmo_spectral``
block by block.

Newton–Schulz follows Keller Jordan's ``zeropower_via_newtonschulz5`` and the Ringmaster-LMO
code exactly: transpose when rows > cols, ``X ← G / (‖G‖_F + 1e-7)``, then per step with
coefficients (a, b, c): ``A = X Xᵀ``, ``X ← a X + (b A + c A²) X``; transpose back.
The coefficient table is a parameter (:data:`CLASSIC_NS5`, :data:`POLAR_EXPRESS_NS5`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = [
    "CLASSIC_NS5", "POLAR_EXPRESS_NS5", "NS_TABLES", "NS_EPS", "newton_schulz", "lmo_sign", "lmo_l2",
    "lmo_spectral", "muon_direction", "check_layout", "layout_numel", "pa_schedule",
]

Coefficients = Sequence[tuple[float, float, float]]
Layout = tuple[tuple[str, tuple[int, ...]], ...]

#: Keller Jordan's Muon quintic, the same triple at each of the 5 steps.
CLASSIC_NS5: tuple[tuple[float, float, float], ...] = ((3.4445, -4.7750, 2.0315),) * 5

#: The five per-step "Polar Express" triples used by the Ringmaster-LMO code.
POLAR_EXPRESS_NS5: tuple[tuple[float, float, float], ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

#: Coefficient tables by the name the ``ns`` hyper-parameters use.
NS_TABLES: dict[str, tuple[tuple[float, float, float], ...]] = {
    "polar-express": POLAR_EXPRESS_NS5, "classic": CLASSIC_NS5,
}

#: Added to the Frobenius norm before the first Newton–Schulz step (as in the reference code).
NS_EPS = 1e-7


def newton_schulz(g: np.ndarray, coefficients: Coefficients = POLAR_EXPRESS_NS5, steps: int = 5) -> np.ndarray:
    """Approximate the orthogonal polar factor U Vᵀ of ``g = U Σ Vᵀ`` (no minus sign).

    Args:
        g: a 2-D array.
        coefficients: (a, b, c) per step; steps beyond the table reuse its last triple.
        steps: number of iterations (>= 0).

    Returns:
        A float64 array of ``g``'s shape. Singular values land near 1, not exactly on it
        (classic NS5 maps diag(3, 1) to about diag(0.753, 1.134)).

    Raises:
        ValueError: ``g`` is not 2-D, ``steps`` < 0 or the table is empty.
    """
    x = np.array(g, dtype=np.float64, copy=True)
    if x.ndim != 2:
        raise ValueError(f"newton_schulz expects a 2-D array, got shape {x.shape}")
    if steps < 0 or int(steps) != steps:
        raise ValueError(f"Invalid steps: {steps!r}")
    if len(coefficients) == 0:
        raise ValueError("newton_schulz needs at least one (a, b, c) triple")
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x /= np.linalg.norm(x) + NS_EPS
    for i in range(int(steps)):
        a, b, c = coefficients[min(i, len(coefficients) - 1)]
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return np.ascontiguousarray(x.T) if transposed else x


def lmo_sign(m: np.ndarray) -> np.ndarray:
    """ℓ∞-ball LMO: ``−sign(m)`` with sign(0) = 0 (momentum signSGD)."""
    return -np.sign(m)


def lmo_l2(m: np.ndarray) -> np.ndarray:
    """ℓ2-ball LMO: ``−m / ‖m‖`` (normalized momentum SGD); zeros for m = 0."""
    norm = float(np.linalg.norm(m))
    if norm == 0.0:
        return np.zeros_like(m)
    return -m / norm


def lmo_spectral(m: np.ndarray, *, rtol: float = 1e-12) -> np.ndarray:
    """Spectral-norm-ball LMO, exact via SVD: ``−U Vᵀ`` for ``m = U Σ Vᵀ``.

    Singular directions with σ ≤ rtol·σ_max are left out (the polar factor on the range
    of m, which is also what Newton–Schulz converges to); m = 0 gives zeros.

    Raises:
        ValueError: ``m`` is not 2-D.
    """
    m = np.asarray(m, dtype=np.float64)
    if m.ndim != 2:
        raise ValueError(f"lmo_spectral expects a 2-D array, got shape {m.shape}")
    u, s, vt = np.linalg.svd(m, full_matrices=False)
    if s.size == 0 or s[0] == 0.0:
        return np.zeros_like(m)
    keep = s > rtol * s[0]
    return -(u[:, keep] @ vt[keep, :])


def layout_numel(layout: Layout) -> int:
    """Total number of scalars in a layout."""
    return sum(math.prod(shape) for _, shape in layout)


def check_layout(layout: object) -> None:
    """Raise ValueError unless ``layout`` is a tuple of ``(name: str, shape: tuple[int, ...])``."""
    if not isinstance(layout, tuple):
        raise ValueError(f"Invalid layout: {layout!r} (expected a tuple of (name, shape); set by bind())")
    for entry in layout:
        ok = (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
              and isinstance(entry[1], tuple)
              and all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in entry[1]))
        if not ok:
            raise ValueError(f"Invalid layout entry: {entry!r} (expected (name, shape))")


def muon_direction(u: np.ndarray, layout: Layout = (), *, coefficients: Coefficients = POLAR_EXPRESS_NS5,
                   steps: int = 5) -> np.ndarray:
    """Muon's update O for the flat vector ``u``, block by block; the step is ``x − η O``.

    - Block with ≥ 2 dims, viewed as (shape[0], rest): ``NS(u_blk) · √max(1, rows/cols)``.
    - Block with ≤ 1 dim (bias, gain, scalar): ``u_blk`` itself (the reference code's
      momentum-SGD fallback for non-matrix parameters).
    - Empty layout: the whole vector is one 1×d matrix, whose polar factor is exactly
      ``u / ‖u‖`` (normalized SGD); that exact value is used, not the NS approximation.

    Args:
        u: flat 1-D direction (momentum or its Nesterov variant).
        layout: ``((name, shape), ...)`` covering ``u`` in order, or ``()``.
        coefficients, steps: passed to :func:`newton_schulz`.

    Returns:
        A float64 array of ``u``'s shape.

    Raises:
        ValueError: ``u`` is not 1-D or the layout does not cover it.
    """
    u = np.asarray(u)
    if u.ndim != 1:
        raise ValueError(f"muon_direction expects a flat vector, got shape {u.shape}")
    if not layout:
        norm = float(np.linalg.norm(u))
        return np.zeros(u.shape) if norm == 0.0 else np.asarray(u, dtype=np.float64) / norm
    if layout_numel(layout) != u.shape[0]:
        raise ValueError(f"layout of size {layout_numel(layout)} does not match vector of size {u.shape[0]}")
    out = np.empty(u.shape, dtype=np.float64)
    off = 0
    for _, shape in layout:
        size = math.prod(shape)
        blk = u[off:off + size]
        if len(shape) >= 2 and size > 0:
            mat = blk.reshape(shape[0], size // shape[0])
            o = newton_schulz(mat, coefficients, steps)
            o *= math.sqrt(max(1.0, mat.shape[0] / mat.shape[1]))
            out[off:off + size] = o.reshape(-1)
        else:
            out[off:off + size] = blk
        off += size
    return out


def pa_schedule(k: int) -> tuple[float, int, float]:
    """Parameter-agnostic Ringmaster-LMO schedule at version k (§6).

    Returns:
        ``(α_k, R_k, η_k/η)``: α_0 = 1, α_k = 1/√k; R_k = ⌊1/α_k⌋ = ⌊√k⌋ (via ``math.isqrt``,
        at least 1); η_k/η = (k+1)^(−3/4).

    Raises:
        ValueError: k < 0.
    """
    if k < 0 or int(k) != k:
        raise ValueError(f"Invalid k: {k!r}")
    k = int(k)
    alpha = 1.0 if k == 0 else 1.0 / math.sqrt(k)
    return alpha, max(1, math.isqrt(k)), (k + 1) ** -0.75
