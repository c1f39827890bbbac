"""MNIST from local idx files with the 784–32–10 ReLU MLP of docs/ALGORITHMS.md §8.4.

Nothing is downloaded: give the four idx files (plain or ``.gz``) as options. Server and workers
each read them, so the paths must be valid on every machine.
"""

from __future__ import annotations

import gzip
import math
import zlib

import numpy as np

from problems.loader import worker_local

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081

# idx type code -> big-endian numpy dtype (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT")
IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_GZIP_MAGIC = b"\x1f\x8b"


def parse_idx(raw: bytes, name: str = "idx data") -> np.ndarray:
    """Decode an idx byte string.

    Layout: two zero bytes, a type code, the number of dimensions, one big-endian uint32 per
    dimension, then the values in big-endian row-major order.

    Args:
        raw: the whole (decompressed) file.
        name: how to call it in error messages.

    Returns:
        The array in native byte order.

    Raises:
        ValueError: bad magic, unknown type code, no dimensions, or a size that does not match.
    """
    # Until the header reads as idx (magic and type code), no message quotes the file's bytes: it
    # may go to the server (err PROBLEM_UNAVAILABLE), whose path may name any file (SECURITY.md).
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{name}: not an idx file (bad magic: {'empty' if not raw else 'not 00 00 TYPE NDIM'})")
    code, ndim = raw[2], raw[3]
    if code not in IDX_DTYPES:
        raise ValueError(f"{name}: unknown idx type code (known: "
                         f"{', '.join(f'0x{c:02x}' for c in IDX_DTYPES)})")
    if ndim == 0:
        raise ValueError(f"{name}: idx file declares 0 dimensions")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{name}: truncated idx header ({len(raw)} bytes, need {header})")
    dims = tuple(int(v) for v in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(IDX_DTYPES[code])
    expected = header + math.prod(dims) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(f"{name}: {len(raw)} bytes, but shape {dims} of {dtype.name} needs {expected}")
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return data.astype(dtype.newbyteorder("="))


def read_idx(path: str) -> np.ndarray:
    """Read an idx file (gzip-compressed or not; detected from its first bytes).

    Args:
        path: file path.

    Returns:
        The array in native byte order.

    Raises:
        ValueError: unreadable file, broken gzip stream or malformed idx content.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == _GZIP_MAGIC:
            raw = gzip.decompress(raw)
    except OSError as e:  # missing file, permissions, BadGzipFile
        raise ValueError(f"cannot read idx file {path!r}: {e}") from None
    except (EOFError, zlib.error) as e:  # truncated or corrupt gzip stream
        raise ValueError(f"idx file {path!r}: corrupt gzip data ({e})") from None
    return parse_idx(raw, name=repr(path))


def load_mnist_arrays(images: str, labels: str, subset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Read an images/labels idx pair as flattened, normalized float32 inputs and int64 labels.

    Inputs have shape (n, h·w) and are ``(pixel/255 − MNIST_MEAN) / MNIST_STD``; ``subset`` > 0
    keeps the first ``subset`` examples.

    Raises:
        ValueError: malformed files, non-uint8 or non-3-d images, or a label count that does not match.
    """
    x, y = read_idx(images), read_idx(labels)
    if x.ndim != 3 or x.dtype != np.uint8:
        raise ValueError(f"{images!r}: expected uint8 images of shape (n, h, w), got {x.dtype} {x.shape}")
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise ValueError(f"{labels!r}: expected {x.shape[0]} labels, got shape {y.shape}")
    if subset:
        x, y = x[:subset], y[:subset]
    x = ((x.reshape(len(x), -1) / 255.0 - MNIST_MEAN) / MNIST_STD).astype(np.float32)
    return x, y.astype(np.int64)


@worker_local("images", "labels", "test_images", "test_labels")  # the files may live elsewhere on each host
def make_mnist(images: str = "", labels: str = "", test_images: str = "", test_labels: str = "", subset: int = 0,
               hidden: int = 32, cubic: bool = False, homogeneous: bool = False, slow_class: int = 9,
               kappa: float = 10.0, device: str = "cpu"):
    """Factory for ``--problem mnist``: a 784–hidden–10 ReLU MLP on MNIST idx files.

    Args:
        images: training images idx file (``train-images-idx3-ubyte[.gz]``); required.
        labels: training labels idx file; required.
        test_images: test images idx file; required.
        test_labels: test labels idx file; required.
        subset: keep only the first ``subset`` training images (0 = all).
        hidden: hidden-layer width.
        cubic: logits z ↦ z³ before softmax cross-entropy.
        homogeneous: each minibatch from a single class, drawn with its train frequency.
        slow_class: the class whose batches ``sample_cost`` marks as slow.
        kappa: relative cost of a slow-class batch.
        device: torch device.

    Returns:
        An :class:`problems.mlp.MLPClassifier`.

    Raises:
        ValueError: a path is missing or a file is malformed, or an option is out of range.
    """
    from problems.mlp import MLPClassifier  # torch is imported only when a classifier is built

    paths = {"images": images, "labels": labels, "test_images": test_images, "test_labels": test_labels}
    missing = [k for k, v in paths.items() if not v]
    if missing:
        raise ValueError(f"mnist: missing option(s) {', '.join(missing)} (paths to idx files)")
    if subset < 0:
        raise ValueError(f"mnist: subset must be >= 0, got {subset}")
    x_train, y_train = load_mnist_arrays(images, labels, subset)
    x_test, y_test = load_mnist_arrays(test_images, test_labels)
    return MLPClassifier(x_train, y_train, x_test, y_test, hidden=hidden, num_classes=10, cubic=cubic,
                         homogeneous=homogeneous, slow_class=slow_class, kappa=kappa, device=device)
