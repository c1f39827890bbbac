"""Linear minimization oracles and Newton–Schulz orthogonalization (docs/ALGORITHMS.md §1, §6.1).

Pure math on numpy arrays, no state. Sign convention (§1): ``lmo(m) = argmin_{‖u‖≤1} ⟨m, u⟩``,
so ``x + η·lmo(m)`` is a descent step. :func:`muon_direction` instead returns the Muon update
``O`` with the descent step ``x − η·O`` (the public code's convention); ``O ≈ −lmo_spectral``
block by block.

Newton–Schulz follows Keller Jordan's ``zeropower_via_newtonschulz5`` and the Ringmaster-LMO
code exactly: transpose when rows > cols, ``X ← G / (‖G‖_F + 1e-7)``, then per step with
coefficients (a, b, c): ``A = X Xᵀ``, ``X ← a X + (b A + c A²) X``; transpose back.
The coefficient table is a parameter (:data:`CLASSIC_NS5`, :data:`POLAR_EXPRESS_NS5`);
:func:`ns_coefficients` gives the triples the Muon methods run for ``ns`` and ``ns_steps``.

Which blocks get Newton–Schulz is a per-block flag (``lmo_mask``, from the problem through
``bind``); without one, every block with ≥ 2 dimensions does. The official NanoChat code flags
only the hidden matrices (embeddings, output head, biases and norm weights take the momentum
fallback); its quadratic script passes no layout, so the whole vector is one 1×d matrix.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = [
    "CLASSIC_NS5", "POLAR_EXPRESS_NS5", "NS_TABLES", "NS_EPS", "newton_schulz", "ns_coefficients", "lmo_sign",
    "lmo_l2", "lmo_spectral", "muon_direction", "check_layout", "check_lmo_mask", "default_lmo_mask",
    "momentum_blocks",
    "layout_numel", "pa_schedule", "coupled_threshold",
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


def ns_coefficients(name: str, steps: int) -> tuple[tuple[float, float, float], ...]:
    """The (a, b, c) triples, one per Newton–Schulz step, that ``ns=name, ns_steps=steps`` runs.

    ``"polar-express"``: the first ``min(steps, 5)`` of the five per-step triples: like the
    Ringmaster-LMO code (``POLAR_EXPRESS_COEFFS[:steps]``), more than 5 steps run only 5.
    ``"classic"``: Keller Jordan's single quintic triple ``steps`` times (his
    ``zeropower_via_newtonschulz5`` uses the same triple at every step, however many).

    Raises:
        ValueError: unknown name or ``steps`` < 0.
    """
    if name not in NS_TABLES:
        raise ValueError(f"Invalid ns: {name!r} (choose one of {', '.join(NS_TABLES)})")
    if steps < 0 or int(steps) != steps:
        raise ValueError(f"Invalid steps: {steps!r}")
    if name == "classic":
        return CLASSIC_NS5[:1] * int(steps)
    return NS_TABLES[name][: int(steps)]


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


def default_lmo_mask(layout: Layout) -> tuple[bool, ...]:
    """The rule without a problem's ``lmo_mask``: Newton–Schulz on every block with ≥ 2 dims."""
    return tuple(len(shape) >= 2 for _, shape in layout)


def momentum_blocks(layout: Layout, lmo_mask: object = None) -> tuple[bool, ...]:
    """True for the blocks :func:`muon_direction` steps with ``u_blk`` itself (elementwise: a
    sharded server may split them), False for those that get Newton–Schulz."""
    mask = check_lmo_mask(tuple(layout), lmo_mask)
    return tuple(not m for m in (default_lmo_mask(tuple(layout)) if mask is None else mask))


def check_lmo_mask(layout: Layout, lmo_mask: object) -> tuple[bool, ...] | None:
    """``lmo_mask`` as a tuple of bools aligned with ``layout`` (None stays None).

    Raises:
        ValueError: not a sequence of bools, one per layout block.
    """
    if lmo_mask is None:
        return None
    try:
        mask = tuple(lmo_mask)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"Invalid lmo_mask: {lmo_mask!r} (expected one bool per layout block)") from None
    if len(mask) != len(layout) or not all(isinstance(b, (bool, np.bool_)) for b in mask):
        raise ValueError(f"Invalid lmo_mask: {lmo_mask!r} (expected {len(layout)} bools, one per layout block)")
    return tuple(bool(b) for b in mask)


def muon_direction(u: np.ndarray, layout: Layout = (), *, lmo_mask: Sequence[bool] | None = None,
                   coefficients: Coefficients = POLAR_EXPRESS_NS5, steps: int = 5) -> np.ndarray:
    """Muon's update O for the flat vector ``u``, block by block; the step is ``x − η O``.

    - Block with an LMO step (``lmo_mask`` True; without a mask, every block with ≥ 2 dims):
      viewed as (shape[0], rest), or as a 1×n matrix when it has ≤ 1 dim,
      ``NS(u_blk) · √max(1, rows/cols)``.
    - Any other block (``lmo_mask`` False; without a mask, biases, gains, scalars):
      ``u_blk`` itself (the reference code's momentum-SGD fallback).
    - Empty layout (unbound): the whole vector is one 1×d matrix, whose polar factor is exactly
      ``u / ‖u‖`` (normalized SGD); that exact value is used, not the NS approximation. To run
      what the group's quadratic script runs (it passes no layout: NS on the 1×d matrix, about
      0.859·u/‖u‖ with Polar Express, 0.696·u/‖u‖ classic), flag the vector block instead, as
      the ``quadratic`` problem does (``lmo_mask = (True,)``).

    Args:
        u: flat 1-D direction (momentum or its Nesterov variant).
        layout: ``((name, shape), ...)`` covering ``u`` in order, or ``()``.
        lmo_mask: one bool per layout block (see :func:`check_lmo_mask`), or None.
        coefficients, steps: passed to :func:`newton_schulz` (see :func:`ns_coefficients`).

    Returns:
        A float64 array of ``u``'s shape.

    Raises:
        ValueError: ``u`` is not 1-D, the layout does not cover it or the mask does not fit.
    """
    u = np.asarray(u)
    if u.ndim != 1:
        raise ValueError(f"muon_direction expects a flat vector, got shape {u.shape}")
    if not layout:
        norm = float(np.linalg.norm(u))
        return np.zeros(u.shape) if norm == 0.0 else np.asarray(u, dtype=np.float64) / norm
    if layout_numel(layout) != u.shape[0]:
        raise ValueError(f"layout of size {layout_numel(layout)} does not match vector of size {u.shape[0]}")
    mask = check_lmo_mask(layout, lmo_mask)
    if mask is None:
        mask = default_lmo_mask(layout)
    out = np.empty(u.shape, dtype=np.float64)
    off = 0
    for (_, shape), lmo in zip(layout, mask, strict=True):
        size = math.prod(shape)
        blk = u[off:off + size]
        if lmo and size > 0:
            mat = blk.reshape(shape[0], size // shape[0]) if len(shape) >= 2 else blk.reshape(1, size)
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


def coupled_threshold(alpha: float) -> int:
    """The theorem's coupling of the delay threshold to the momentum weight: R = ⌊1/α⌋ (>= 1).

    A relative 1e-9 guards the floor against 1/α landing just below an integer (α = 1/3)."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"Invalid alpha: {alpha!r}")
    return max(1, math.floor(1.0 / alpha * (1.0 + 1e-9)))
