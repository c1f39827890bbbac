"""A one-hidden-layer ReLU MLP classifier over in-memory arrays (shared by ``digits`` and ``mnist``).

The parameters are one flat float32 vector; each call to ``grad`` copies it to the device once
and takes the weight matrices as views of that single tensor, so there is no per-call model
construction. Data-dependent delays (docs/ALGORITHMS.md §4.4): with
``homogeneous=True`` every minibatch comes from one class, picked with its train frequency so
the gradient stays unbiased, and ``sample_cost`` reports ``kappa`` for batches of ``slow_class``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from problems.base import GradResult, Layout, Problem


def macro_f1_and_recall(y_true: np.ndarray, y_pred: np.ndarray, num_classes: int) -> tuple[float, np.ndarray]:
    """Macro-averaged F1 and per-class recall (a class with no support or predictions scores 0).

    Args:
        y_true: integer labels, shape (n,).
        y_pred: integer predictions, shape (n,).
        num_classes: number of classes C; the macro average is over all C.

    Returns:
        (macro-F1, recall per class of shape (C,)).
    """
    tp = np.bincount(y_true[y_true == y_pred], minlength=num_classes).astype(np.float64)
    support = np.bincount(y_true, minlength=num_classes)
    predicted = np.bincount(y_pred, minlength=num_classes)
    denom = support + predicted  # 2tp + fp + fn
    f1 = np.divide(2 * tp, denom, out=np.zeros(num_classes), where=denom > 0)
    recall = np.divide(tp, support, out=np.zeros(num_classes), where=support > 0)
    return float(f1.mean()), recall


class MLPClassifier(Problem):
    """Softmax cross-entropy on ``in -> hidden (ReLU) -> classes`` logits.

    Args:
        x_train: float32 inputs, shape (n, features), already normalized.
        y_train: integer labels in [0, num_classes), shape (n,).
        x_test: held-out inputs for ``evaluate``.
        y_test: held-out labels.
        hidden: width of the hidden layer.
        num_classes: number of classes.
        cubic: replace logits z by z³ before the softmax (a non-Lipschitz objective).
        homogeneous: draw each minibatch from a single class (see module docstring).
        slow_class: the class whose batches cost ``kappa``.
        kappa: relative cost of a slow-class batch.
        device: torch device of the data and the computation (``"cpu"``, ``"cuda:0"``).

    Raises:
        ValueError: inconsistent arrays or an out-of-range option.
    """

    fresh_gradients = True  # every call returns new arrays

    def __init__(self, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray, *,
                 hidden: int = 32, num_classes: int = 10, cubic: bool = False, homogeneous: bool = False,
                 slow_class: int = 9, kappa: float = 10.0, device: str = "cpu"):
        if hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {hidden}")
        if not 0 <= slow_class < num_classes:
            raise ValueError(f"slow_class must be in [0, {num_classes}), got {slow_class}")
        if not kappa > 0:
            raise ValueError(f"kappa must be > 0, got {kappa}")
        for name, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
            if x.ndim != 2 or y.shape != (x.shape[0],) or x.shape[0] == 0:
                raise ValueError(f"{name} data: inputs {x.shape} and labels {y.shape} do not match")
            if y.min() < 0 or y.max() >= num_classes:
                raise ValueError(f"{name} labels must be in [0, {num_classes})")
        if x_test.shape[1] != x_train.shape[1]:
            raise ValueError(f"test inputs have {x_test.shape[1]} features, train inputs {x_train.shape[1]}")
        try:
            self.device = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"invalid device {device!r}: {e}") from None
        features = x_train.shape[1]
        self.num_classes, self.cubic, self.homogeneous = num_classes, cubic, homogeneous
        self.slow_class, self.kappa = slow_class, float(kappa)
        self.layout: Layout = (("fc1.weight", (hidden, features)), ("fc1.bias", (hidden,)),
                               ("fc2.weight", (num_classes, hidden)), ("fc2.bias", (num_classes,)))
        self.y_train_np = np.asarray(y_train, dtype=np.int64)
        self.num_samples = int(self.y_train_np.shape[0])  # a finite sum over the train set (full_grad)
        self.y_test_np = np.asarray(y_test, dtype=np.int64)
        self._x_train = torch.as_tensor(np.asarray(x_train, dtype=np.float32), device=self.device)
        self._y_train = torch.as_tensor(self.y_train_np, device=self.device)
        self._x_test = torch.as_tensor(np.asarray(x_test, dtype=np.float32), device=self.device)
        self._y_test = torch.as_tensor(self.y_test_np, device=self.device)
        counts = np.bincount(self.y_train_np, minlength=num_classes)
        self.class_freq = counts / counts.sum()
        self._class_index = [np.flatnonzero(self.y_train_np == c) for c in range(num_classes)]
        self._all_index = np.arange(len(self.y_train_np))

    # -- sampling -------------------------------------------------------------------------------
    def batch_indices(self, seed: int, batch_size: int) -> tuple[int | None, np.ndarray]:
        """The minibatch picked by ``seed``: its class (None unless homogeneous) and train indices.

        Indices are drawn without replacement; a batch larger than its pool is clipped to it.
        ``grad`` and ``sample_cost`` both call this, so they always agree on the class.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        rng = np.random.default_rng(seed)
        cls, pool = None, self._all_index
        if self.homogeneous:
            cls = int(rng.choice(self.num_classes, p=self.class_freq))
            pool = self._class_index[cls]
        take = min(batch_size, len(pool))
        return cls, pool[rng.choice(len(pool), size=take, replace=False)]

    def sample_cost(self, seed: int, batch_size: int) -> float:
        """``kappa`` when ``seed`` draws a ``slow_class`` batch (homogeneous mode), else 1.0."""
        if not self.homogeneous:
            return 1.0
        cls, _ = self.batch_indices(seed, batch_size)
        return self.kappa if cls == self.slow_class else 1.0

    # -- model ----------------------------------------------------------------------------------
    def _blocks(self, w: torch.Tensor) -> list[torch.Tensor]:
        out, off = [], 0
        for _, shape in self.layout:
            n = math.prod(shape)
            out.append(w[off:off + n].view(shape))
            off += n
        return out

    def _loss(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean cross-entropy and the (possibly cubed) logits."""
        w1, b1, w2, b2 = self._blocks(w)
        z = F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)
        if self.cubic:
            z = z ** 3
        return F.cross_entropy(z, y), z

    def _to_tensor(self, x: np.ndarray) -> torch.Tensor:
        if x.shape != (self.dim,):
            raise ValueError(f"parameter vector of shape {x.shape}, expected ({self.dim},)")
        # torch.tensor copies, so read-only buffers (zero-copy network frames) are fine.
        return torch.tensor(np.asarray(x, dtype=np.float32), device=self.device)

    def init_params(self, seed: int) -> np.ndarray:
        """PyTorch-default ``nn.Linear`` init: weights and biases ~ U(±1/√fan_in), from ``seed``."""
        rng = np.random.default_rng(seed)
        hidden, features = self.layout[0][1]
        fan_in = {"fc1": features, "fc2": hidden}
        parts = []
        for name, shape in self.layout:
            bound = 1.0 / math.sqrt(fan_in[name.split(".")[0]])
            parts.append(rng.uniform(-bound, bound, size=math.prod(shape)))
        return np.concatenate(parts).astype(np.float32)

    def grad(self, x: np.ndarray, seed: int, batch_size: int) -> GradResult:
        """Mean cross-entropy gradient on the minibatch picked by ``seed``.

        Args:
            x: flat float32 parameters.
            seed: picks the batch (and its class in homogeneous mode).
            batch_size: batch size, clipped to the size of the pool it is drawn from.

        Returns:
            float32 flat gradient (same layout) and the batch loss.
        """
        _, idx = self.batch_indices(seed, batch_size)
        idx_t = torch.as_tensor(idx, device=self.device)
        w = self._to_tensor(x).requires_grad_(True)
        loss, _ = self._loss(w, self._x_train[idx_t], self._y_train[idx_t])
        (g,) = torch.autograd.grad(loss, w)
        return GradResult(grad=g.detach().cpu().numpy().astype(np.float32, copy=False), loss=float(loss.detach()))

    def full_grad(self, x: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, int, float]:
        """Sum over the train examples [lo, hi) of their cross-entropy gradients, the count and
        the summed loss (the finite-sum view that ``snapshot-vr`` uses; ``num_samples`` = N)."""
        if not 0 <= lo <= hi <= self.num_samples:
            raise ValueError(f"shard [{lo}, {hi}) is not inside [0, {self.num_samples})")
        if hi == lo:
            return np.zeros(self.dim, np.float32), 0, 0.0
        w = self._to_tensor(x).requires_grad_(True)
        loss, _ = self._loss(w, self._x_train[lo:hi], self._y_train[lo:hi])
        total = loss * (hi - lo)  # the mean times the count: the sum of the per-example losses
        (g,) = torch.autograd.grad(total, w)
        return g.detach().cpu().numpy().astype(np.float32, copy=False), hi - lo, float(total.detach())

    @torch.no_grad()
    def evaluate(self, x: np.ndarray) -> dict[str, float]:
        """Test ``loss``, ``accuracy``, macro-``f1``, ``recall_slow`` (of ``slow_class``) and ``train_loss``."""
        w = self._to_tensor(x)
        loss, z = self._loss(w, self._x_test, self._y_test)
        train_loss, _ = self._loss(w, self._x_train, self._y_train)
        pred = z.argmax(dim=1).cpu().numpy()
        f1, recall = macro_f1_and_recall(self.y_test_np, pred, self.num_classes)
        return {"loss": float(loss), "accuracy": float(np.mean(pred == self.y_test_np)), "f1": f1,
                "recall_slow": float(recall[self.slow_class]), "train_loss": float(train_loss)}
