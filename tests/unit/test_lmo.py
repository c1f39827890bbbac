"""Pure LMO / Newton–Schulz math (docs/ALGORITHMS.md §1, §6.1): test vectors of §11.4, atol 1e-6."""

from __future__ import annotations

import math

import numpy as np
import pytest

from algorithms.lmo import (
    CLASSIC_NS5,
    NS_TABLES,
    POLAR_EXPRESS_NS5,
    check_layout,
    check_lmo_mask,
    coupled_threshold,
    layout_numel,
    lmo_l2,
    lmo_sign,
    lmo_spectral,
    muon_direction,
    newton_schulz,
    ns_coefficients,
    pa_schedule,
)

ATOL = 1e-6

# (matrix, exact U Vᵀ, classic NS5, Polar-Express NS5) from docs/ALGORITHMS.md §11.4.
NS5_VECTORS = [
    (np.diag([3.0, 1.0]), np.eye(2), np.diag([0.753033, 1.133706]), np.diag([1.017546, 1.130347])),
    (np.array([[1.0, 2.0], [3.0, 4.0]]),
     np.array([[-0.514496, 0.857493], [0.857493, 0.514496]]),
     np.array([[-0.680661, 0.825540], [0.741295, 0.259440]]),
     np.array([[-0.575520, 0.968983], [0.971651, 0.588860]])),
]


@pytest.mark.parametrize("m, exact, classic, polar", NS5_VECTORS)
def test_newton_schulz_vectors(m, exact, classic, polar):
    np.testing.assert_allclose(newton_schulz(m, CLASSIC_NS5, 5), classic, atol=ATOL)
    np.testing.assert_allclose(newton_schulz(m, POLAR_EXPRESS_NS5, 5), polar, atol=ATOL)
    np.testing.assert_allclose(lmo_spectral(m), -exact, atol=ATOL)


def test_newton_schulz_row_vector_and_its_transpose():
    row = np.array([[3.0, 4.0]])
    np.testing.assert_allclose(newton_schulz(row, CLASSIC_NS5, 5), [[0.417862, 0.557149]], atol=ATOL)
    np.testing.assert_allclose(lmo_spectral(row), [[-0.6, -0.8]], atol=1e-12)
    # rows > cols: the iteration runs on the transpose and transposes back.
    np.testing.assert_allclose(newton_schulz(row.T, CLASSIC_NS5, 5), [[0.417862], [0.557149]], atol=ATOL)


def test_newton_schulz_tables_and_steps():
    assert len(CLASSIC_NS5) == 5 and set(CLASSIC_NS5) == {(3.4445, -4.7750, 2.0315)}
    assert POLAR_EXPRESS_NS5[0] == (8.156554524902461, -22.48329292557795, 15.878769915207462)
    assert NS_TABLES == {"polar-express": POLAR_EXPRESS_NS5, "classic": CLASSIC_NS5}
    m = np.array([[1.0, 2.0], [3.0, 4.0]])
    # A one-triple table repeated is the same as the five-fold classic table.
    np.testing.assert_array_equal(newton_schulz(m, CLASSIC_NS5[:1], 5), newton_schulz(m, CLASSIC_NS5, 5))
    # steps = 0 is just the normalization G / (‖G‖_F + 1e-7).
    np.testing.assert_allclose(newton_schulz(m, CLASSIC_NS5, 0), m / (math.sqrt(30.0) + 1e-7), rtol=1e-12)
    # Input is not modified.
    m0 = m.copy()
    newton_schulz(m, POLAR_EXPRESS_NS5, 5)
    np.testing.assert_array_equal(m, m0)


@pytest.mark.parametrize("bad", [np.zeros(3), np.zeros((2, 2, 2))])
def test_newton_schulz_rejects_non_matrices(bad):
    with pytest.raises(ValueError):
        newton_schulz(bad)
    with pytest.raises(ValueError):
        lmo_spectral(bad)


def test_newton_schulz_rejects_bad_steps_and_tables():
    with pytest.raises(ValueError):
        newton_schulz(np.eye(2), CLASSIC_NS5, -1)
    with pytest.raises(ValueError):
        newton_schulz(np.eye(2), (), 5)


def test_lmo_sign_and_l2():
    m = np.array([2.0, -0.5, 0.0])
    np.testing.assert_array_equal(lmo_sign(m), [-1.0, 1.0, 0.0])
    np.testing.assert_allclose(lmo_l2(np.array([3.0, -4.0])), [-0.6, 0.8], rtol=1e-12)
    np.testing.assert_array_equal(lmo_l2(np.zeros(3)), np.zeros(3))
    assert lmo_l2(np.array([3.0, 4.0], np.float32)).dtype == np.float32


def test_lmo_spectral_rank_deficient_and_zero():
    m = np.outer([1.0, 2.0], [3.0, 4.0])  # rank 1: U Vᵀ on the range only
    u = np.array([1.0, 2.0]) / math.sqrt(5.0)
    v = np.array([3.0, 4.0]) / 5.0
    np.testing.assert_allclose(lmo_spectral(m), -np.outer(u, v), atol=1e-12)
    np.testing.assert_array_equal(lmo_spectral(np.zeros((2, 3))), np.zeros((2, 3)))


def test_lmo_is_a_descent_direction_of_unit_norm():
    rng = np.random.default_rng(0)
    m = rng.standard_normal((4, 3))
    s = lmo_spectral(m)
    assert np.sum(m * s) < 0
    np.testing.assert_allclose(np.linalg.svd(s, compute_uv=False), np.ones(3), atol=1e-12)
    # ⟨m, lmo(m)⟩ = −(dual norm): nuclear norm for the spectral ball, ℓ1 for ℓ∞, ℓ2 for ℓ2.
    np.testing.assert_allclose(np.sum(m * s), -np.linalg.svd(m, compute_uv=False).sum(), rtol=1e-12)
    v = m.ravel()
    np.testing.assert_allclose(v @ lmo_sign(v), -np.abs(v).sum(), rtol=1e-12)
    np.testing.assert_allclose(v @ lmo_l2(v), -np.linalg.norm(v), rtol=1e-12)


def test_muon_direction_per_block():
    rng = np.random.default_rng(1)
    layout = (("w", (3, 2)), ("b", (2,)), ("conv", (2, 2, 2)), ("s", ()))
    assert layout_numel(layout) == 6 + 2 + 8 + 1
    u = rng.standard_normal(17)
    o = muon_direction(u, layout, coefficients=CLASSIC_NS5, steps=5)
    assert o.shape == (17,) and o.dtype == np.float64
    # (3, 2) matrix: NS5 times √max(1, 3/2).
    np.testing.assert_allclose(o[:6], (newton_schulz(u[:6].reshape(3, 2), CLASSIC_NS5, 5) * math.sqrt(1.5)).ravel(),
                               rtol=1e-12)
    np.testing.assert_array_equal(o[6:8], u[6:8])  # vector block: plain direction
    np.testing.assert_allclose(o[8:16], newton_schulz(u[8:16].reshape(2, 4), CLASSIC_NS5, 5).ravel(), rtol=1e-12)
    assert o[16] == u[16]  # scalar


def test_muon_direction_without_layout_is_normalized():
    u = np.array([3.0, 4.0])
    np.testing.assert_allclose(muon_direction(u), [0.6, 0.8], rtol=1e-12)
    np.testing.assert_array_equal(muon_direction(np.zeros(3)), np.zeros(3))


def test_muon_direction_rejects_mismatch():
    with pytest.raises(ValueError):
        muon_direction(np.zeros(5), (("w", (2, 2)),))
    with pytest.raises(ValueError):
        muon_direction(np.zeros((2, 2)))


@pytest.mark.parametrize("bad", [[("w", (2, 2))], (("w", [2, 2]),), ((1, (2,)),), (("w", (2, -1)),), (("w",),)])
def test_check_layout_rejects(bad):
    with pytest.raises(ValueError):
        check_layout(bad)


def test_check_layout_accepts():
    check_layout(())
    check_layout((("w", (2, 3)), ("b", (3,)), ("s", ())))


# k: (α_k, R_k, η_k/η) from docs/ALGORITHMS.md §11.4 (7 significant digits).
PA_TABLE = {
    0: (1.0, 1, 1.0), 1: (1.0, 1, 0.594604), 2: (0.707107, 1, 0.438691), 3: (0.577350, 1, 0.353553),
    4: (0.5, 2, 0.299070), 5: (0.447214, 2, 0.260847), 8: (0.353553, 2, 0.192450), 9: (0.333333, 3, 0.177828),
    10: (0.316228, 3, 0.165560),
}


@pytest.mark.parametrize("k", sorted(PA_TABLE))
def test_pa_schedule_table(k):
    alpha, r, eta = pa_schedule(k)
    a_exp, r_exp, eta_exp = PA_TABLE[k]
    assert alpha == pytest.approx(a_exp, abs=ATOL)
    assert r == r_exp and isinstance(r, int)
    assert eta == pytest.approx(eta_exp, abs=ATOL)


def test_pa_schedule_threshold_is_exact_for_squares():
    for k in range(1, 2000):
        assert pa_schedule(k)[1] == math.isqrt(k)
    assert pa_schedule(10**12)[1] == 10**6
    with pytest.raises(ValueError):
        pa_schedule(-1)


# ---- issue 15: per-block LMO mask, the quadratic's 1×d vector, the NS step count, R = ⌊1/α⌋


def test_muon_direction_follows_the_lmo_mask():
    rng = np.random.default_rng(2)
    layout = (("wte", (4, 3)), ("h0", (3, 3)), ("b", (3,)), ("head", (4, 3)))
    u = rng.standard_normal(layout_numel(layout))
    default = muon_direction(u, layout)  # no mask: every matrix gets NS, the vector the fallback
    masked = muon_direction(u, layout, lmo_mask=(False, True, False, False))
    np.testing.assert_array_equal(masked[:12], u[:12])  # embedding: the fallback, u itself
    np.testing.assert_array_equal(masked[12:21], default[12:21])  # hidden matrix: NS, as without a mask
    np.testing.assert_array_equal(masked[21:24], u[21:24])
    np.testing.assert_array_equal(masked[24:], u[24:])  # head: the fallback
    assert not np.allclose(default[:12], u[:12]) and not np.allclose(default[24:], u[24:])
    assert muon_direction(u, layout, lmo_mask=(True, True, False, True)).tobytes() == default.tobytes()
    for bad in [(True,), (1, 0, 0, 0), "tttt", 3]:
        with pytest.raises(ValueError, match="lmo_mask"):
            muon_direction(u, layout, lmo_mask=bad)
    assert check_lmo_mask(layout, None) is None
    assert check_lmo_mask(layout, [np.True_, False, False, True]) == (True, False, False, True)


def test_flagged_vector_block_is_a_1xd_matrix_as_the_groups_quadratic_script():
    """The group's quadratic script passes no layout: NS on the 1×d matrix, 0.859·u/‖u‖ under
    Polar Express (0.696 classic). A flagged vector block gets exactly that."""
    rng = np.random.default_rng(3)
    u = rng.standard_normal(1729)
    o = muon_direction(u, (("x", (1729,)),), lmo_mask=(True,))
    np.testing.assert_array_equal(o, newton_schulz(u.reshape(1, -1), POLAR_EXPRESS_NS5, 5).ravel())
    np.testing.assert_allclose(o, 0.859129 * u / np.linalg.norm(u), rtol=1e-5)
    oc = muon_direction(u, (("x", (1729,)),), lmo_mask=(True,), coefficients=CLASSIC_NS5)
    np.testing.assert_allclose(oc, 0.696436 * u / np.linalg.norm(u), rtol=1e-5)
    # unflagged (or no mask): the momentum fallback, u itself; unbound: the exact u/‖u‖
    np.testing.assert_array_equal(muon_direction(u, (("x", (1729,)),)), u)
    np.testing.assert_allclose(muon_direction(u), u / np.linalg.norm(u), rtol=1e-12)
    from problems import load_problem

    q = load_problem("quadratic", {"d": 8})
    assert q.layout == (("x", (8,)),) and q.lmo_mask == (True,)


def test_newton_schulz_step_count_matches_the_official_code():
    """Issue 15 item 4: Polar Express runs at most its 5 triples (POLAR_EXPRESS_COEFFS[:steps] in
    the Ringmaster-LMO code); classic repeats Keller Jordan's one triple as often as asked."""
    assert ns_coefficients("polar-express", 5) == POLAR_EXPRESS_NS5
    assert ns_coefficients("polar-express", 8) == POLAR_EXPRESS_NS5  # 8 asked, 5 run
    assert ns_coefficients("polar-express", 3) == POLAR_EXPRESS_NS5[:3]
    assert ns_coefficients("classic", 8) == ((3.4445, -4.7750, 2.0315),) * 8
    assert ns_coefficients("classic", 5) == CLASSIC_NS5
    with pytest.raises(ValueError):
        ns_coefficients("polar", 5)
    from algorithms import build

    rng = np.random.default_rng(4)
    layout = (("w", (3, 5)),)
    x0 = rng.standard_normal(15)
    g = rng.standard_normal(15)

    def first_step(**hyper):
        from algorithms.base import Result
        from protocol.messages import JobKind

        # α_0 = 1 (momentum_start="first"): the first step is on u = g itself, so O(g) is compared
        alg = build("ringmaster-lmo", {"lr": 1.0, "momentum_start": "first", **hyper}).bind(layout)
        state, _ = alg.init(x0, seed=0)
        r = Result(job_id=0, worker_id="w", created_at=0, kind=JobKind.GRAD, iterate_ids=(0,), grads=(g,))
        state, _ = alg.apply(state, [r])
        return x0 - state.x

    five, eight = first_step(ns_steps=5), first_step(ns_steps=8)
    assert five.tobytes() == eight.tobytes()
    np.testing.assert_allclose(five, newton_schulz(g.reshape(3, 5), POLAR_EXPRESS_NS5, 5).ravel(), rtol=1e-12)
    c8 = first_step(ns="classic", ns_steps=8)
    np.testing.assert_allclose(c8, newton_schulz(g.reshape(3, 5), CLASSIC_NS5[:1] * 8, 8).ravel(), rtol=1e-12)
    assert not np.allclose(c8, first_step(ns="classic", ns_steps=5))
    np.testing.assert_allclose(first_step(ns_steps=3),
                               newton_schulz(g.reshape(3, 5), POLAR_EXPRESS_NS5[:3], 3).ravel(), rtol=1e-12)


def test_coupled_threshold_is_floor_of_one_over_alpha():
    assert [coupled_threshold(a) for a in (1.0, 0.5, 0.3, 0.25, 0.1, 0.05, 1 / 3, 0.7)] == [1, 2, 3, 4, 10, 20, 3, 1]
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError):
            coupled_threshold(bad)


# ---- issue 24: Newton–Schulz in float32 (the server's default) and bfloat16, and the in-place step

# Newton–Schulz in float32 and bfloat16 against float64 (entries of O are at most about 1.2). Polar Express's
# steep first polynomial amplifies rounding most on tiny matrices: worst seen over 30 random draws per shape,
# float32 1.8e-5 absolute on 2×2, 1.6e-6 from 48×64 up; bfloat16 (8 significant bits) 0.17 relative
# (Frobenius) on 2×2, 0.018 from 48×64 up.
F32_ATOL = 1e-4
F32_ATOL_WORKED = 1e-5  # §11.4's vectors in float32 (worst 2.9e-6; float64 meets 1e-6)
BF16_RTOL_TINY, BF16_RTOL = 0.3, 0.05  # min(rows, cols) < 40, and from 40 up

NS_SHAPES = [(2, 2), (7, 5), (5, 7), (64, 48), (48, 200), (300, 40), (1, 500), (128, 128), (96, 384)]


def _ns_inputs():
    rng = np.random.default_rng(24)
    return [m for m, *_ in NS5_VECTORS] + [np.array([[3.0, 4.0]])] + [rng.standard_normal(s) for s in NS_SHAPES]


@pytest.mark.parametrize("table", [CLASSIC_NS5, POLAR_EXPRESS_NS5], ids=["classic", "polar-express"])
def test_newton_schulz_float32_and_bfloat16_agree_with_float64(table):
    for m in _ns_inputs():
        ref = newton_schulz(m, table, 5)
        o32 = newton_schulz(m.astype(np.float32), table, 5, dtype="float32")
        assert o32.dtype == np.float32 and o32.shape == m.shape and o32.flags.c_contiguous
        np.testing.assert_allclose(o32, ref, rtol=0, atol=F32_ATOL)
        # a float64 input in float32 arithmetic: rounded to float32 first, the same bits
        assert newton_schulz(m, table, 5, dtype="float32").tobytes() == o32.tobytes()
        obf = newton_schulz(m.astype(np.float32), table, 5, dtype="bfloat16")
        assert obf.dtype == np.float32 and obf.shape == m.shape
        rtol = BF16_RTOL if min(m.shape) >= 40 else BF16_RTOL_TINY
        assert np.linalg.norm(obf - ref) <= rtol * np.linalg.norm(ref)
        assert not np.array_equal(obf, o32)  # it is the other arithmetic


def test_newton_schulz_float32_reproduces_the_worked_vectors():
    for m, _, classic, polar in NS5_VECTORS:
        np.testing.assert_allclose(newton_schulz(m, CLASSIC_NS5, 5, dtype="float32"), classic, atol=F32_ATOL_WORKED)
        np.testing.assert_allclose(newton_schulz(m, POLAR_EXPRESS_NS5, 5, dtype="float32"), polar,
                                   atol=F32_ATOL_WORKED)
    np.testing.assert_allclose(newton_schulz(np.array([[3.0, 4.0]]), CLASSIC_NS5, 5, dtype="float32"),
                               [[0.417862, 0.557149]], atol=F32_ATOL_WORKED)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_newton_schulz_is_deterministic_and_transposes_exactly(dtype):
    """Two calls give the same bits; a tall matrix runs on its transpose, so NS(gᵀ) is NS(g)ᵀ bit
    for bit (a missed transpose would still converge, to other bits); the input is not written."""
    rng = np.random.default_rng(7)
    for shape in [(40, 90), (3, 50), (1, 64)]:  # wide; square matrices are not transposed
        g = rng.standard_normal(shape).astype(np.float32)
        g0 = g.copy()
        o = newton_schulz(g, POLAR_EXPRESS_NS5, 5, dtype=dtype)
        assert o.tobytes() == newton_schulz(g, POLAR_EXPRESS_NS5, 5, dtype=dtype).tobytes()
        tall = newton_schulz(np.ascontiguousarray(g.T), POLAR_EXPRESS_NS5, 5, dtype=dtype)
        assert tall.flags.c_contiguous and tall.tobytes() == np.ascontiguousarray(o.T).tobytes()
        assert newton_schulz(g.T, POLAR_EXPRESS_NS5, 5, dtype=dtype).tobytes() == tall.tobytes()  # a strided view
        np.testing.assert_array_equal(g, g0)
    with pytest.raises(ValueError, match="dtype"):
        newton_schulz(np.eye(2), dtype="float16")


GPT_LAYOUT = (("wte", (50, 8)), ("attn", (24, 8)), ("attn.b", (24,)), ("proj", (8, 8)), ("fc", (32, 8)),
              ("fc2", (8, 32)), ("ln", (8,)), ("conv", (6, 2, 3, 3)), ("s", ()))
GPT_MASK = (False, True, False, True, True, True, False, True, False)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_muon_direction_in_place_is_the_same_as_a_new_array(dtype):
    """``out=u``: the fallback blocks stay as they are, the NS blocks get NS(u_blk)·√max(1, rows/cols)
    in NS's dtype, rounded once to out's; the same bits as writing to a fresh array."""
    rng = np.random.default_rng(11)
    u = rng.standard_normal(layout_numel(GPT_LAYOUT)).astype(np.float32)
    fresh = muon_direction(u, GPT_LAYOUT, lmo_mask=GPT_MASK, dtype=dtype)
    assert fresh.dtype == (np.float64 if dtype == "float64" else np.float32)
    into = np.empty_like(u)
    assert muon_direction(u, GPT_LAYOUT, lmo_mask=GPT_MASK, dtype=dtype, out=into) is into
    np.testing.assert_array_equal(into, fresh.astype(np.float32))
    v = u.copy()
    assert muon_direction(v, GPT_LAYOUT, lmo_mask=GPT_MASK, dtype=dtype, out=v) is v
    assert v.tobytes() == into.tobytes()
    off = 0
    for (_, shape), flagged in zip(GPT_LAYOUT, GPT_MASK, strict=True):
        size = math.prod(shape)
        blk = slice(off, off + size)
        if flagged:
            mat = u[blk].reshape(shape[0], -1)
            want = newton_schulz(mat, POLAR_EXPRESS_NS5, 5, dtype=dtype)
            scale = math.sqrt(max(1.0, mat.shape[0] / mat.shape[1]))
            want = want * want.dtype.type(scale)
            assert v[blk].tobytes() == want.astype(np.float32).ravel().tobytes()
        else:
            assert v[blk].tobytes() == u[blk].tobytes()
        off += size
    for bad in (np.empty(3, np.float32), np.empty((u.size, 2), np.float32)[:, 0]):
        with pytest.raises(ValueError, match="out"):
            muon_direction(u, GPT_LAYOUT, lmo_mask=GPT_MASK, out=bad)


def test_muon_direction_unbound_in_place_is_the_float64_normalization():
    u = np.array([3.0, 4.0, 1e-3], np.float32)
    want = (u.astype(np.float64) / float(np.linalg.norm(u))).astype(np.float32)
    v = u.copy()
    assert muon_direction(v, out=v).tobytes() == want.tobytes()
    z = np.zeros(3, np.float32)
    assert not muon_direction(z, out=z).any()


def _muon_run(x0, grads, layout=GPT_LAYOUT, mask=GPT_MASK, **hyper):
    from algorithms import build
    from algorithms.base import Result, bind_layout
    from protocol.messages import JobKind

    alg = bind_layout(build("ringmaster-lmo", {"lr": 0.1, "alpha": 0.3, **hyper}), layout, mask)
    state, _ = alg.init(x0, seed=0)
    xs = []
    for i, g in enumerate(grads):
        r = Result(job_id=i, worker_id="w", created_at=state.version, kind=JobKind.GRAD,
                   iterate_ids=(state.version,), grads=(g,))
        state, out = alg.apply(state, [r])
        assert out.applied == (i,)
        xs.append(state.x.copy())
    return xs, state


@pytest.mark.parametrize("run_dtype", [np.float32, np.float64])
def test_ringmaster_muon_runs_newton_schulz_in_the_runs_dtype_by_default(run_dtype):
    """ns_dtype="auto": float32 arithmetic for a float32 run's small blocks (GPT_LAYOUT has only small
    ones), float64 for a float64 run. The first step with α_0 = 1 (momentum_start="first": u = g) is
    x0 − lr·O(g) with O of that dtype, bit for bit."""
    rng = np.random.default_rng(5)
    d = layout_numel(GPT_LAYOUT)
    x0, g = rng.standard_normal(d).astype(run_dtype), rng.standard_normal(d).astype(run_dtype)
    want_ns = "float64" if run_dtype == np.float64 else "float32"
    first = {"momentum_start": "first"}
    (x1,), state = _muon_run(x0, [g], **first)
    assert x1.dtype == run_dtype and state.m.dtype == run_dtype
    o = muon_direction(g, GPT_LAYOUT, lmo_mask=GPT_MASK, dtype=want_ns).astype(run_dtype)
    assert x1.tobytes() == (x0 - np.asarray(0.1, run_dtype) * o).tobytes()
    (x1_named,), _ = _muon_run(x0, [g], ns_dtype=want_ns, **first)
    assert x1_named.tobytes() == x1.tobytes()
    for other in {"float32", "float64", "bfloat16"} - {want_ns}:
        (x1_other,), _ = _muon_run(x0, [g], ns_dtype=other, **first)
        o = muon_direction(g, GPT_LAYOUT, lmo_mask=GPT_MASK, dtype=other, out=np.empty_like(g))  # fallback exact
        assert x1_other.tobytes() == (x0 - np.asarray(0.1, run_dtype) * o).tobytes()
        assert x1_other.tobytes() != x1.tobytes()


@pytest.mark.parametrize("start", ["zero", "first"])
@pytest.mark.parametrize("ns_dtype", ["auto", "float64", "bfloat16"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_ringmaster_muon_steps_are_deterministic_and_match_the_plain_formulas(ns_dtype, nesterov, start):
    """Two runs from the same start and replies give the same bits (what replay relies on); each step is
    m ← (1−α) m + α g, u = (1−α) m + α g or m, x ← x − lr·O(u), written with whole-array numpy, from
    m_0 = 0 with α = 0.3 from the first step ("zero") or α_0 = 1 ("first")."""
    rng = np.random.default_rng(9)
    d = layout_numel(GPT_LAYOUT)
    x0 = rng.standard_normal(d).astype(np.float32)
    grads = [rng.standard_normal(d).astype(np.float32) for _ in range(4)]
    xs, state = _muon_run(x0, grads, ns_dtype=ns_dtype, nesterov=nesterov, momentum_start=start)
    again, _ = _muon_run(x0, grads, ns_dtype=ns_dtype, nesterov=nesterov, momentum_start=start)
    assert [x.tobytes() for x in xs] == [x.tobytes() for x in again]
    f32 = np.float32
    x, m = x0.copy(), np.zeros(d, f32)
    ns = "float32" if ns_dtype == "auto" else ns_dtype
    for k, g in enumerate(grads):
        alpha = 1.0 if k == 0 and start == "first" else 0.3
        m = m * np.asarray(1.0 - alpha, f32)
        m = m + np.asarray(alpha, f32) * g
        u = np.asarray(1.0 - alpha, f32) * m + np.asarray(alpha, f32) * g if nesterov else m
        o = muon_direction(u, GPT_LAYOUT, lmo_mask=GPT_MASK, dtype=ns).astype(f32)
        x = x - np.asarray(0.1, f32) * o
        assert xs[k].tobytes() == x.tobytes()
    assert state.m.tobytes() == m.tobytes()


def test_delay_adaptive_and_rennala_muon_take_ns_dtype():
    from algorithms import build

    for name in ("delay-adaptive-muon", "rennala-muon"):
        assert build(name, {}).ns_dtype == "auto"
        assert build(name, {"ns_dtype": "bfloat16"}).ns_dtype == "bfloat16"
    from algorithms.lmo import ns_dtype_for

    assert ns_dtype_for("auto", np.float32) == "float32" and ns_dtype_for("auto", np.float64) == "float64"
    assert ns_dtype_for("auto", np.float16) == "float32" and ns_dtype_for("bfloat16", np.float64) == "bfloat16"
    with pytest.raises(ValueError, match="ns_dtype"):
        ns_dtype_for("fp32", np.float32)


def test_auto_runs_layer_sized_blocks_in_bfloat16_and_small_ones_in_float32():
    """The "auto" rule: in a float32 run a block of at least 2**15 elements and 32 on its short side
    iterates in bfloat16 (torch.optim.Muon's arithmetic, where the step's cost is), smaller ones
    and thin ones (the quadratic's 1×d row) in float32; a float64 run stays float64. The rule reads
    the shape only, so every machine and every shard chooses the same. Bit for bit per block."""
    from algorithms.lmo import ns_dtype_for

    assert ns_dtype_for("auto", np.float32, (128, 256)) == "bfloat16"
    assert ns_dtype_for("auto", np.float32, (256, 128)) == "bfloat16"
    assert ns_dtype_for("auto", np.float32, (127, 256)) == "float32"  # 32,512 elements
    assert ns_dtype_for("auto", np.float32, (31, 4096)) == "float32"  # thin
    assert ns_dtype_for("auto", np.float32, (1, 1 << 20)) == "float32"
    assert ns_dtype_for("auto", np.float64, (512, 512)) == "float64"
    assert ns_dtype_for("float32", np.float32, (512, 512)) == "float32"
    layout = (("big", (256, 128)), ("small", (16, 8)), ("b", (16,)), ("conv", (64, 32, 4, 4)))
    rng = np.random.default_rng(3)
    u = rng.standard_normal(layout_numel(layout)).astype(np.float32)
    auto = muon_direction(u, layout, dtype="auto")
    bf, f32 = muon_direction(u, layout, dtype="bfloat16"), muon_direction(u, layout, dtype="float32")
    assert auto.dtype == np.float32
    big, small, conv = slice(0, 32768), slice(32768, 32768 + 128), slice(32768 + 144, None)
    assert auto[big].tobytes() == bf[big].tobytes() != f32[big].tobytes()
    assert auto[small].tobytes() == f32[small].tobytes() != bf[small].tobytes()
    assert auto[conv].tobytes() == bf[conv].tobytes()  # viewed as 64 x 512
    assert muon_direction(u.astype(np.float64), layout, dtype="auto").tobytes() == \
        muon_direction(u.astype(np.float64), layout, dtype="float64").tobytes()
