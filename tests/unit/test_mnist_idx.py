"""The idx reader and the ``mnist`` problem, on tiny idx files written by the tests."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from problems import load_problem
from problems.mnist import IDX_DTYPES, MNIST_MEAN, MNIST_STD, load_mnist_arrays, parse_idx, read_idx

CODES = {np.dtype(v).newbyteorder("=").str: k for k, v in IDX_DTYPES.items()}


def idx_bytes(arr: np.ndarray) -> bytes:
    """Encode an array in the idx format (big-endian header and data)."""
    code = CODES[arr.dtype.newbyteorder("=").str]
    header = bytes([0, 0, code, arr.ndim]) + np.array(arr.shape, dtype=">u4").tobytes()
    return header + arr.astype(arr.dtype.newbyteorder(">")).tobytes()


def write_idx(path, arr: np.ndarray, gz: bool = False) -> str:
    raw = idx_bytes(arr)
    with open(path, "wb") as f:
        f.write(gzip.compress(raw) if gz else raw)
    return str(path)


@pytest.fixture
def mnist_files(tmp_path):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, (20, 28, 28), dtype=np.uint8)
    test = rng.integers(0, 256, (10, 28, 28), dtype=np.uint8)
    train_labels, test_labels = (np.arange(20) % 10).astype(np.uint8), (np.arange(10) % 10).astype(np.uint8)
    return {
        "images": write_idx(tmp_path / "train-images-idx3-ubyte.gz", train, gz=True),
        "labels": write_idx(tmp_path / "train-labels-idx1-ubyte", train_labels),
        "test_images": write_idx(tmp_path / "t10k-images-idx3-ubyte", test),
        "test_labels": write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", test_labels, gz=True),
        "_train": train,
    }


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("arr", [
    np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
    np.array([-5, 0, 70000, -(2 ** 31)], dtype=np.int32),
    np.array([[1.5, -2.25], [np.pi, 1e300]], dtype=np.float64),
    np.array([[-3, 3]], dtype=np.int16),
])
def test_read_idx_round_trips(tmp_path, arr, gz):
    out = read_idx(write_idx(tmp_path / "a.idx", arr, gz=gz))
    assert out.dtype == arr.dtype and out.dtype.isnative
    np.testing.assert_array_equal(out, arr)


def test_read_idx_parses_the_big_endian_header_by_hand():
    raw = bytes([0, 0, 0x0C, 2, 0, 0, 0, 1, 0, 0, 0, 2]) + bytes([0, 0, 1, 0, 0xFF, 0xFF, 0xFF, 0xFE])
    np.testing.assert_array_equal(parse_idx(raw), np.array([[256, -2]], dtype=np.int32))


@pytest.mark.parametrize("mutate, message", [
    (lambda raw: raw[:-1], "bytes, but shape"),  # truncated data
    (lambda raw: raw + b"\0", "bytes, but shape"),  # trailing garbage
    (lambda raw: raw[:10], "truncated idx header"),
    (lambda raw: b"\x01" + raw[1:], "bad magic"),
    (lambda raw: b"PK\x03\x04" + raw[4:], "bad magic"),
    (lambda raw: raw[:2] + b"\x07" + raw[3:], "unknown idx type code \\(known"),
    (lambda raw: raw[:3] + b"\x00", "0 dimensions"),
    (lambda raw: b"", "bad magic"),
    (lambda raw: gzip.compress(raw)[:-12], "corrupt gzip"),  # truncated .gz stream
])
def test_read_idx_rejects_malformed_files(tmp_path, mutate, message):
    raw = idx_bytes(np.zeros((4, 3, 3), dtype=np.uint8))
    path = tmp_path / "bad.idx"
    path.write_bytes(mutate(raw))
    with pytest.raises(ValueError, match=message):
        read_idx(str(path))


def test_read_idx_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read idx file"):
        read_idx(str(tmp_path / "absent"))


# Plausible headers (known type code, a few small dims) followed by arbitrary bytes, or just bytes.
_HEADERS = st.builds(lambda code, dims: bytes([0, 0, code, len(dims)]) + np.array(dims, dtype=">u4").tobytes(),
                     st.sampled_from(sorted(IDX_DTYPES)), st.lists(st.integers(0, 3), max_size=3))


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=64), st.builds(bytes.__add__, _HEADERS, st.binary(max_size=40))))
def test_parse_idx_on_arbitrary_bytes_returns_or_raises_value_error(raw):
    try:
        out = parse_idx(raw)
    except ValueError:
        return
    assert idx_bytes(out) == raw  # whatever it accepts, it decodes exactly


def test_load_mnist_arrays_normalizes_and_takes_a_prefix(mnist_files):
    x, y = load_mnist_arrays(mnist_files["images"], mnist_files["labels"], subset=12)
    assert x.shape == (12, 784) and x.dtype == np.float32 and y.dtype == np.int64
    expected = (mnist_files["_train"][:12].reshape(12, -1) / 255.0 - MNIST_MEAN) / MNIST_STD
    np.testing.assert_allclose(x, expected, rtol=1e-6)
    np.testing.assert_array_equal(y, np.arange(12) % 10)
    with pytest.raises(ValueError, match="expected 20 labels"):
        load_mnist_arrays(mnist_files["images"], mnist_files["test_labels"])
    with pytest.raises(ValueError, match="expected uint8 images"):
        load_mnist_arrays(mnist_files["labels"], mnist_files["labels"])


def test_mnist_problem_trains_on_tiny_files(mnist_files):
    options = {k: v for k, v in mnist_files.items() if not k.startswith("_")}
    p = load_problem("mnist", {**options, "subset": "12", "hidden": "8", "homogeneous": "true", "kappa": "4"})
    assert p.layout == (("fc1.weight", (8, 784)), ("fc1.bias", (8,)), ("fc2.weight", (10, 8)), ("fc2.bias", (10,)))
    assert len(p.y_train_np) == 12 and p.options["subset"] == 12
    x = p.init_params(0)
    costs = {p.batch_indices(s, 4)[0]: p.sample_cost(s, 4) for s in range(200)}
    assert costs[9] == 4.0 and all(c == 1.0 for k, c in costs.items() if k != 9)
    before = p.evaluate(x)
    assert set(before) == {"loss", "accuracy", "f1", "recall_slow", "train_loss"}
    for seed in range(60):
        x = x - 0.1 * p.grad(x, seed, 4).grad
    assert p.evaluate(x)["train_loss"] < before["train_loss"]


def test_mnist_problem_rejects_bad_labels(mnist_files, tmp_path):
    options = {k: v for k, v in mnist_files.items() if not k.startswith("_")}
    options["labels"] = write_idx(tmp_path / "bad-labels", np.full(20, 10, dtype=np.uint8))
    with pytest.raises(ValueError, match=r"train labels must be in \[0, 10\)"):
        load_problem("mnist", options)
