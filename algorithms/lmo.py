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

Its arithmetic is a parameter too (:data:`NS_DTYPES`, docs/ALGORITHMS.md §6.1): ``"float64"``
and ``"float32"`` run in numpy (OpenBLAS: ``X Xᵀ`` and ``A A`` as symmetric rank-k updates, half
the multiplications of a general product), ``"bfloat16"`` in torch on the CPU (the arithmetic of
``torch.optim.Muon``: bf16 products, as Keller Jordan's code). The Muon methods' ``ns_dtype="auto"``
is chosen per block (:func:`ns_dtype_for`): float64 for a float64 run (the worked examples); in a
float32 run (the server) bfloat16 for layer-sized matrices, where the cost is, and float32 for
small ones.

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
    "CLASSIC_NS5", "POLAR_EXPRESS_NS5", "NS_TABLES", "NS_EPS", "NS_DTYPES", "newton_schulz", "ns_coefficients",
    "ns_dtype_for", "lmo_sign",
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

#: Newton–Schulz arithmetic by the name the ``ns_dtype`` hyper-parameters use; "auto" is the run's
#: dtype (:func:`ns_dtype_for`).
NS_DTYPES = ("auto", "float32", "float64", "bfloat16")


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


#: ``ns_dtype="auto"`` in a float32 run iterates in bfloat16 (torch.optim.Muon's arithmetic) for a
#: block whose matrix has at least this many elements and at least :data:`NS_BF16_MIN_SIDE` on its
#: short side: layer-sized matrices, where Newton–Schulz is the step's cost; smaller ones in float32.
NS_BF16_MIN_ELEMENTS = 1 << 15
NS_BF16_MIN_SIDE = 32


def ns_dtype_for(name: str, run_dtype: np.dtype | type, shape: tuple[int, int] | None = None) -> str:
    """The arithmetic ``ns_dtype=name`` runs for a block of matrix ``shape`` in a run of ``run_dtype``.

    ``"auto"``: float64 for a float64 run; for any other run, bfloat16 when ``shape`` is given and
    is layer-sized (at least :data:`NS_BF16_MIN_ELEMENTS` elements and :data:`NS_BF16_MIN_SIDE` on
    the short side), else float32. The rule depends on the shape only, never on the machine, so a
    run, its replay and its shards choose the same arithmetic. The other names are themselves.

    Raises:
        ValueError: an unknown name.
    """
    if name not in NS_DTYPES:
        raise ValueError(f"Invalid ns_dtype: {name!r} (choose one of {', '.join(NS_DTYPES)})")
    if name != "auto":
        return name
    if np.dtype(run_dtype) == np.float64:
        return "float64"
    if shape is not None and min(shape) >= NS_BF16_MIN_SIDE and shape[0] * shape[1] >= NS_BF16_MIN_ELEMENTS:
        return "bfloat16"
    return "float32"


def _check_ns_args(coefficients: Coefficients, steps: int, dtype: str,
                   allowed: tuple[str, ...] = NS_DTYPES[1:]) -> None:
    if steps < 0 or int(steps) != steps:
        raise ValueError(f"Invalid steps: {steps!r}")
    if len(coefficients) == 0:
        raise ValueError("newton_schulz needs at least one (a, b, c) triple")
    if dtype not in allowed:
        raise ValueError(f"Invalid dtype: {dtype!r} (choose one of {', '.join(allowed)})")


def _ns_wide(g: np.ndarray, coefficients: Coefficients, steps: int, dtype: str) -> tuple[np.ndarray, bool]:
    """Newton–Schulz of a checked 2-D ``g``: ``(X, transposed)`` with the result ``X.T`` when
    ``transposed`` (rows > cols: the iteration ran on ``gᵀ``), else ``X``; X is C-contiguous,
    float64 for ``dtype="float64"``, float32 otherwise (bfloat16 values widened exactly). g is
    read, never written, and copied once (the working copy).
    """
    transposed = g.shape[0] > g.shape[1]
    wide = np.float64 if dtype == "float64" else np.float32
    # The working copy first (C order, the wide orientation), then its norm: the same bits whatever
    # g's dtype, orientation or strides (a norm taken in another element order rounds otherwise).
    x = np.array(g.T if transposed else g, dtype=wide, order="C")
    x /= float(np.linalg.norm(x)) + NS_EPS
    if dtype == "bfloat16":
        return _ns_bfloat16(x, coefficients, steps), transposed
    rows = x.shape[0]
    a_buf, b_buf, y = np.empty((rows, rows), wide), np.empty((rows, rows), wide), np.empty_like(x)
    for i in range(int(steps)):
        a, b, c = coefficients[min(i, len(coefficients) - 1)]
        np.matmul(x, x.T, out=a_buf)  # X Xᵀ: a symmetric rank-k update (numpy calls syrk), exactly symmetric
        np.matmul(a_buf, a_buf.T, out=b_buf)  # A A = A Aᵀ (A is exactly symmetric): syrk again
        np.multiply(a_buf, b, out=a_buf)
        np.multiply(b_buf, c, out=b_buf)
        np.add(b_buf, a_buf, out=b_buf)  # B = b A + c A², rounded as the reference's expression
        np.matmul(b_buf, x, out=y)
        np.multiply(x, a, out=x)
        np.add(x, y, out=y)  # X ← a X + B X
        x, y = y, x
    return x, transposed


def _ns_bfloat16(x: np.ndarray, coefficients: Coefficients, steps: int) -> np.ndarray:
    """The iteration in torch bfloat16 on the CPU, from the normalized float32 ``x`` (wide),
    in torch.optim.Muon's form: ``A = X Xᵀ``, ``B = addmm(A, A, A, β=b, α=c)``,
    ``X = addmm(X, B, X, β=a)``. Returns float32 (the bf16 values, exactly)."""
    import torch  # a dependency of the project; imported on first use only

    with torch.no_grad():
        t = torch.from_numpy(x).to(torch.bfloat16)
        for i in range(int(steps)):
            a, b, c = coefficients[min(i, len(coefficients) - 1)]
            gram = t @ t.T
            t = torch.addmm(t, torch.addmm(gram, gram, gram, beta=b, alpha=c), t, beta=a)
        return t.to(torch.float32).numpy()


def newton_schulz(g: np.ndarray, coefficients: Coefficients = POLAR_EXPRESS_NS5, steps: int = 5, *,
                  dtype: str = "float64") -> np.ndarray:
    """Approximate the orthogonal polar factor U Vᵀ of ``g = U Σ Vᵀ`` (no minus sign).

    Args:
        g: a 2-D array (any real dtype; not modified).
        coefficients: (a, b, c) per step; steps beyond the table reuse its last triple.
        steps: number of iterations (>= 0).
        dtype: the arithmetic, ``"float64"`` (default), ``"float32"`` or ``"bfloat16"`` (torch).

    Returns:
        A C-contiguous array of ``g``'s shape, float64 for ``dtype="float64"``, float32 otherwise.
        Singular values land near 1, not exactly on it (classic NS5 maps diag(3, 1) to about
        diag(0.753, 1.134)). Deterministic: the same input, dtype and BLAS thread count give the
        same bits.

    Raises:
        ValueError: ``g`` is not 2-D, ``steps`` < 0, the table is empty or the dtype unknown.
    """
    g = np.asarray(g)
    if g.ndim != 2:
        raise ValueError(f"newton_schulz expects a 2-D array, got shape {g.shape}")
    _check_ns_args(coefficients, steps, dtype)
    x, transposed = _ns_wide(g, coefficients, steps, dtype)
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
                   coefficients: Coefficients = POLAR_EXPRESS_NS5, steps: int = 5, dtype: str = "float64",
                   out: np.ndarray | None = None) -> np.ndarray:
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
        coefficients, steps, dtype: passed to :func:`newton_schulz` (see :func:`ns_coefficients`);
            ``dtype="auto"`` chooses per block by :func:`ns_dtype_for` (``u``'s dtype, the
            block's matrix shape); the scale √max(1, rows/cols) is applied in NS's result dtype, then the block is
            rounded to ``out``'s dtype.
        out: where to write O (1-D, ``u``'s length); it may be ``u`` itself, whose fallback blocks
            are then left as they are (no copy) and whose Newton–Schulz blocks are overwritten
            after they are read. None: a new array, float64 for ``dtype="float64"`` (or "auto"
            with a float64 ``u``), else float32.

    Returns:
        ``out`` (or the new array).

    Raises:
        ValueError: ``u`` is not 1-D, the layout does not cover it, the mask or ``out`` does not fit.
    """
    u = np.asarray(u)
    if u.ndim != 1:
        raise ValueError(f"muon_direction expects a flat vector, got shape {u.shape}")
    _check_ns_args(coefficients, steps, dtype, NS_DTYPES)
    if out is None:
        wide = dtype == "float64" or (dtype == "auto" and u.dtype == np.float64)
        out = np.empty(u.shape, np.float64 if wide else np.float32)
    elif out.shape != u.shape or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writable contiguous array of u's shape {u.shape}")
    if not layout:
        norm = float(np.linalg.norm(u))
        if norm == 0.0:
            out[...] = 0
        else:  # in float64, rounded once to out's dtype
            np.divide(u, norm, out=out, dtype=np.float64, casting="same_kind")
        return out
    if layout_numel(layout) != u.shape[0]:
        raise ValueError(f"layout of size {layout_numel(layout)} does not match vector of size {u.shape[0]}")
    mask = check_lmo_mask(layout, lmo_mask)
    if mask is None:
        mask = default_lmo_mask(layout)
    in_place = out is u
    off = 0
    for (_, shape), lmo in zip(layout, mask, strict=True):
        size = math.prod(shape)
        blk = u[off:off + size]
        if lmo and size > 0:
            rows = shape[0] if len(shape) >= 2 else 1
            mat = blk.reshape(rows, size // rows)
            x, transposed = _ns_wide(mat, coefficients, steps, ns_dtype_for(dtype, u.dtype, mat.shape))
            o = x.T if transposed else x
            target = out[off:off + size].reshape(mat.shape)
            scale = math.sqrt(max(1.0, mat.shape[0] / mat.shape[1]))
            if scale == 1.0:
                np.copyto(target, o, casting="same_kind")
            else:
                np.multiply(o, scale, out=target, dtype=o.dtype, casting="same_kind")
        elif not in_place:
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
