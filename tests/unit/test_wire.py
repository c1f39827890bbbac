"""protocol/wire.py: reduced-precision frames (PROTOCOL.md §6.12) against torch's bfloat16 and numpy's float16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol.messages import ALLOWED_DTYPES, WIRE_DTYPES
from protocol.wire import WIRE_NUMPY, check_wire, frame_nbytes, from_wire, roundtrip, to_wire

F32_MAX = np.finfo(np.float32).max
F32_TINY = np.finfo(np.float32).tiny  # smallest normal
SUB_MIN = np.float32(1e-45)  # smallest subnormal


def torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    """torch's float32 -> bfloat16 conversion, as uint16 bits."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def edge_values() -> np.ndarray:
    bits = np.array([
        0x00000000, 0x80000000,  # +0, -0
        0x00000001, 0x80000001, 0x007FFFFF, 0x00008000, 0x00018000, 0x00028000,  # subnormals (ties too)
        0x00800000, 0x3F800000, 0xBF800000,  # smallest normal, ±1
        0x3F808000,  # 1 + 2^-8: a tie, rounds down to even (1.0)
        0x3F818000,  # 1 + 3·2^-8: a tie, rounds up to even
        0x3F808001, 0x3F807FFF,  # just above / below the tie
        0x3F80FFFF, 0x3FFFFFFF,  # carry into the exponent
        0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF,  # near and at max float32 (the latter two round to inf)
        0x7F800000, 0xFF800000,  # ±inf
    ], dtype=np.uint32)
    return bits.view(np.float32)


# --------------------------------------------------------------------------- bf16

def test_bf16_bits_match_torch_on_edge_values():
    x = edge_values()
    assert np.array_equal(to_wire(x, "bf16"), torch_bf16_bits(x))
    assert to_wire(np.array([F32_MAX], np.float32), "bf16")[0] == 0x7F80, "max float32 rounds up to +inf"


def test_bf16_bits_match_torch_on_random_values():
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.standard_normal(100_000).astype(np.float32),
        (rng.standard_normal(10_000) * 1e30).astype(np.float32),
        (rng.standard_normal(10_000) * 1e-40).astype(np.float32),  # subnormals
        rng.integers(0, 2**32, size=100_000, dtype=np.uint64).astype(np.uint32).view(np.float32),  # any bits
    ])
    nan = np.isnan(x)
    assert nan.any(), "random bit patterns include NaNs"
    got, want = to_wire(x, "bf16"), torch_bf16_bits(x)
    assert got.dtype == np.dtype("<u2")
    assert np.array_equal(got[~nan], want[~nan])
    assert np.isnan(from_wire(got, "bf16")[nan]).all()


def test_bf16_nan_stays_a_quiet_nan_and_inf_stays_inf():
    # a signalling NaN (quiet bit clear, payload only in the low 16 bits) must not become inf
    x = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0xFFFFFFFF, 0x7FBFFFFF], np.uint32).view(np.float32)
    w = to_wire(x, "bf16")
    assert np.all(w & 0x7F80 == 0x7F80) and np.all(w & 0x0040), "exponent all ones, quiet bit set"
    back = from_wire(w, "bf16")
    assert np.isnan(back).all()
    assert list(np.signbit(back)) == [False, True, False, True, False], "sign kept"
    inf = np.array([np.inf, -np.inf], np.float32)
    assert np.array_equal(roundtrip(inf, "bf16"), inf)


def test_bf16_round_trip_is_exact_on_representable_values_and_on_zero_signs():
    x = np.array([0x3F80, 0xBF80, 0x0001, 0x8000, 0x7F7F, 0x4049], np.uint16)
    assert np.array_equal(to_wire(from_wire(x, "bf16"), "bf16"), x)
    z = roundtrip(np.array([0.0, -0.0], np.float32), "bf16")
    assert list(np.signbit(z)) == [False, True]


# --------------------------------------------------------------------------- f16

def test_f16_matches_numpy_and_overflows_to_inf():
    rng = np.random.default_rng(1)
    x = np.concatenate([(rng.standard_normal(10_000) * 100).astype(np.float32), edge_values()])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    got = to_wire(x, "f16")
    assert got.dtype == np.dtype("<f2")
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    big = roundtrip(np.array([70000.0, -1e30, 65504.0], np.float32), "f16")
    assert list(big) == [np.inf, -np.inf, 65504.0], "beyond the f16 range: ±inf (refused as NON_FINITE)"
    assert np.isnan(roundtrip(np.array([np.nan], np.float32), "f16")).all()


# --------------------------------------------------------------------------- error bounds

@pytest.mark.parametrize("wire, unit, lo, hi", [("bf16", 2.0**-8, F32_TINY, 3e38),
                                                ("f16", 2.0**-11, 2.0**-14, 65504.0)])
def test_relative_error_bound_in_the_normal_range(wire, unit, lo, hi):
    rng = np.random.default_rng(2)
    mag = np.exp(rng.uniform(np.log(lo), np.log(hi), 200_000))
    x = (mag * rng.choice([-1.0, 1.0], mag.size)).astype(np.float32)
    x = x[(np.abs(x) >= lo) & (np.abs(x) <= hi)]
    rel = np.abs(roundtrip(x, wire).astype(np.float64) - x) / np.abs(x.astype(np.float64))
    assert rel.max() <= unit
    assert rel.max() > unit / 2, "the bound is tight: quantization really happens"


def test_f32_is_the_identity_without_a_copy():
    x = np.arange(5, dtype=np.float32)
    assert to_wire(x, "f32") is x
    assert from_wire(x, "f32") is x
    assert roundtrip(x, "f32") is x


# --------------------------------------------------------------------------- API

def test_wire_dtypes_are_allowed_by_the_codec():
    assert set(WIRE_NUMPY) == set(WIRE_DTYPES)
    for dt in WIRE_NUMPY.values():
        assert ALLOWED_DTYPES[dt.str] == dt
    assert [frame_nbytes(10, w) for w in WIRE_DTYPES] == [40, 20, 20]


def test_check_wire_rejects_unknown_names():
    for w in WIRE_DTYPES:
        assert check_wire(w) == w
    for bad in ("f64", "F16", "bfloat16", "", None, 16):
        with pytest.raises(ValueError, match="unknown wire dtype"):
            check_wire(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown wire dtype"):
        to_wire(np.zeros(2, np.float32), "fp8")
    with pytest.raises(ValueError, match="unknown wire dtype"):
        from_wire(np.zeros(2, np.float32), "fp8")


@pytest.mark.parametrize("wire", WIRE_DTYPES)
def test_from_wire_rejects_a_frame_of_another_dtype(wire):
    for other in ({"f32": np.float32, "f16": np.float16, "bf16": np.uint16}.values()):
        a = np.zeros(3, other)
        if a.dtype == WIRE_NUMPY[wire]:
            continue
        with pytest.raises(ValueError, match=f"wire dtype {wire} expects"):
            from_wire(a, wire)
    with pytest.raises(ValueError, match="expects"):
        from_wire(np.zeros(3, np.float64), wire)
    with pytest.raises(ValueError, match="expects"):
        from_wire(np.zeros(3, ">f4" if wire == "f32" else ">f2" if wire == "f16" else ">u2"), wire)  # big-endian


@pytest.mark.parametrize("wire", WIRE_DTYPES)
def test_to_wire_takes_float32_only(wire):
    with pytest.raises(ValueError, match="float32"):
        to_wire(np.zeros(3, np.float64), wire)
    with pytest.raises(ValueError, match="float32"):
        to_wire([1.0, 2.0], wire)  # type: ignore[arg-type]


@pytest.mark.parametrize("wire", WIRE_DTYPES)
def test_out_arguments_write_in_place(wire):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 7)).astype(np.float32)
    buf = np.empty(x.shape, WIRE_NUMPY[wire])
    w = to_wire(x, wire, out=buf)
    assert w is buf
    assert np.array_equal(w.view(np.uint8), np.ascontiguousarray(to_wire(x, wire)).view(np.uint8))
    back = np.full(x.shape, np.nan, np.float32)
    assert from_wire(w, wire, out=back) is back
    assert np.array_equal(back, roundtrip(x, wire))
    with pytest.raises(ValueError, match="out must be"):
        to_wire(x, wire, out=np.empty((3, 6), WIRE_NUMPY[wire]))
    with pytest.raises(ValueError, match="out must be"):
        from_wire(w, wire, out=np.empty(x.shape, np.float64))
    ro = np.empty(x.shape, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        from_wire(w, wire, out=ro)


def test_non_contiguous_input():
    x = np.random.default_rng(5).standard_normal((8, 8)).astype(np.float32)[:, ::2]
    assert np.array_equal(to_wire(x, "bf16"), torch_bf16_bits(x).reshape(x.shape))
    assert np.array_equal(roundtrip(x, "f16"), x.astype(np.float16).astype(np.float32))


# --------------------------------------------------------------------------- properties

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=True)


@given(hnp.arrays(np.float32, st.integers(0, 64), elements=st.floats(width=32)))
def test_property_bf16_agrees_with_torch_and_is_idempotent(x):
    nan = np.isnan(x)
    w = to_wire(x, "bf16")
    assert np.array_equal(w[~nan], torch_bf16_bits(x)[~nan])
    r = from_wire(w, "bf16")
    assert np.array_equal(np.isnan(r), nan)
    assert np.array_equal(roundtrip(r, "bf16"), r, equal_nan=True), "a bf16 value is a fixed point"


@given(finite32, finite32)
def test_property_rounding_is_monotone(a, b):
    lo, hi = sorted((a, b))
    x = np.array([lo, hi], np.float32)
    for wire in ("bf16", "f16"):
        r = roundtrip(x, wire)
        assert r[0] <= r[1]


@given(st.floats(width=32, min_value=-65504.0, max_value=65504.0))
def test_property_nearest(v):
    """No representable value lies strictly closer to x than the rounded one."""
    x = np.array([v], np.float32)
    for wire, step in (("bf16", 2.0**-8), ("f16", 2.0**-11)):
        r = float(roundtrip(x, wire)[0])
        err = abs(r - float(v))
        # one ulp of the target format around |v| (floor at the subnormal spacing)
        floor = 2.0**-133 if wire == "bf16" else 2.0**-24
        ulp = max(2.0 ** np.floor(np.log2(abs(float(v)))) * 2 * step if v != 0 else 0.0, floor)
        assert err <= ulp / 2 * (1 + 1e-12)


def test_protocol_md_example_bytes():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "protocol" / "PROTOCOL.md").read_text(encoding="utf-8")
    assert "### 6.12 Wire dtype" in doc
    grad = np.array([0.25, 0.0, -1.5], np.float32)  # the reply of section 11.3
    assert f"`{to_wire(grad, 'bf16').tobytes().hex(' ')}`" in doc
    assert to_wire(np.array([0.1], np.float32), "bf16")[0] == 0x3DCD
    assert float(roundtrip(np.array([0.1], np.float32), "bf16")[0]) == 0.10009765625
