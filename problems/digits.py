"""scikit-learn's 8x8 digits (1,797 images, 10 classes) with a small MLP: the offline MNIST stand-in.

Needs no download (the data ships with scikit-learn), so it is the classifier that tests and
the data-dependent-delay experiments (docs/ALGORITHMS.md §4.4) use by default.
"""

from __future__ import annotations

import importlib.metadata
import os
import tempfile
import zipfile

import numpy as np


def make_digits(hidden: int = 32, test_fraction: float = 0.25, split_seed: int = 0, cubic: bool = False,
                homogeneous: bool = False, slow_class: int = 9, kappa: float = 10.0, device: str = "cpu"):
    """Factory for ``--problem digits``: a 64–hidden–10 ReLU MLP on a fixed stratified split.

    Args:
        hidden: hidden-layer width.
        test_fraction: share of the images held out for ``evaluate`` (stratified).
        split_seed: seed of the train/test split.
        cubic: logits z ↦ z³ before softmax cross-entropy (non-Lipschitz variant).
        homogeneous: each minibatch from a single class, drawn with its train frequency.
        slow_class: the class whose batches ``sample_cost`` marks as slow.
        kappa: relative cost of a slow-class batch.
        device: torch device (``"cpu"``, ``"cuda:0"``).

    Returns:
        An :class:`problems.mlp.MLPClassifier`.

    Raises:
        ValueError: an option is out of range.
    """
    from problems.mlp import MLPClassifier

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"digits: test_fraction must be in (0, 1), got {test_fraction}")
    x_train, x_test, y_train, y_test = digits_split(test_fraction, split_seed)
    return MLPClassifier(x_train, y_train, x_test, y_test, hidden=hidden, num_classes=10, cubic=cubic,
                         homogeneous=homogeneous, slow_class=slow_class, kappa=kappa, device=device)


def cache_dir() -> str:
    """Where derived data is cached: ``$LATECOMER_CACHE``, else ``$XDG_CACHE_HOME/latecomer``,
    else ``~/.cache/latecomer``."""
    if os.environ.get("LATECOMER_CACHE"):
        return os.environ["LATECOMER_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "latecomer")


_SPLIT_KEYS = ("x_train", "x_test", "y_train", "y_test")


def digits_split(test_fraction: float, split_seed: int) -> tuple[np.ndarray, ...]:
    """``(x_train, x_test, y_train, y_test)``: scikit-learn's digits (pixels / 16, float32;
    labels int64) split by ``train_test_split(stratify=y, random_state=split_seed)``.

    Importing scikit-learn costs about a second of CPU, paid by the server and by every worker
    at its start; so the split is cached (:func:`cache_dir`, one ``.npz`` per scikit-learn
    version and split, written atomically) and later loads read it in milliseconds. A cache
    file that does not read back as the four arrays of the right shapes is ignored and written
    again; one that cannot be written leaves the split computed."""
    try:
        version = importlib.metadata.version("scikit-learn")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    path = os.path.join(cache_dir(), f"digits-{version}-{float(test_fraction)!r}-{int(split_seed)}.npz")
    cached = _read_split(path)
    if cached is not None:
        return cached
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)  # pixel values are 0..16
    y = data.target.astype(np.int64)
    split = tuple(train_test_split(x, y, test_size=test_fraction, stratify=y, random_state=split_seed))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **dict(zip(_SPLIT_KEYS, split, strict=True)))
        os.replace(tmp, path)
    except OSError:
        pass
    return split


def _read_split(path: str) -> tuple[np.ndarray, ...] | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            split = tuple(z[k] for k in _SPLIT_KEYS)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    x_train, x_test, y_train, y_test = split
    if (x_train.dtype != np.float32 or x_test.dtype != np.float32 or y_train.dtype != np.int64
            or y_test.dtype != np.int64 or x_train.ndim != 2 or x_train.shape[1:] != (64,)
            or x_test.shape[1:] != (64,) or len(x_train) != len(y_train) or len(x_test) != len(y_test)
            or len(x_train) + len(x_test) != 1797):
        return None
    return split
