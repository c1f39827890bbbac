"""scikit-learn's 8x8 digits (1,797 images, 10 classes) with a small MLP: the offline MNIST stand-in.

Needs no download (the data ships with scikit-learn), so it is the classifier that tests and
the data-dependent-delay experiments (docs/ALGORITHMS.md §4.4) use by default.
"""

from __future__ import annotations

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
    # Imported here so that loading the numpy-only problems never pays for torch and sklearn.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from problems.mlp import MLPClassifier

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"digits: test_fraction must be in (0, 1), got {test_fraction}")
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)  # pixel values are 0..16
    y = data.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=test_fraction, stratify=y,
                                                        random_state=split_seed)
    return MLPClassifier(x_train, y_train, x_test, y_test, hidden=hidden, num_classes=10, cubic=cubic,
                         homogeneous=homogeneous, slow_class=slow_class, kappa=kappa, device=device)
