"""The models and data of ``latecomer bench --models`` (benchmarks/models.py), written here: nothing is downloaded.

Three models, each at a ``full`` size (realistic, for the gradient-time ratio) and a ``small``
one (the time-to-target runs, which must train to a target in tens of seconds on 2 CPU cores),
and a ``tiny`` one for the test suite:

* ``resnet18``: a ResNet-18 for 32x32 3-channel inputs (the CIFAR form: a 3x3 stem, no max
  pool; BasicBlocks [2, 2, 2, 2], BatchNorm, widths w, 2w, 4w, 8w; w = 64 at full size: 11.2 M
  parameters in 62 blocks), on scikit-learn's 8x8 digits upsampled to 32x32 (bilinear) and
  repeated over 3 channels. Target: test accuracy.
* ``gpt2``: a GPT-2-like character language model (token and position embeddings, pre-LN
  transformer blocks with causal self-attention and a 4x GELU MLP, a final LayerNorm, the output
  head tied to the token embedding: ``lm_head.weight = wte.weight``) on the Python sources of a
  standard-library package (``problems.charlm.read_package_text``). Target: validation loss
  (nats per character).
* ``mlp``: a wide MLP of 30 Linear layers (60 parameter blocks: weights and biases), pre-norm
  residual (a parameter-free LayerNorm, ReLU, Linear, added to the stream) so that 30 layers
  train with plain SGD, on a synthetic 10-class problem (``sklearn.datasets.make_classification``:
  learnable, not trivial). Target: test accuracy.

:func:`make_problem` wraps one into a :class:`latecomer.TorchProblem`, as a user's module would;
:func:`train_arrays` gives the same data as tensors for the plain and DDP loops. With
``snapshots=DIR``, the problem's ``evaluate(x)`` only saves ``x`` there (``DIR/NNNNN.npy``) and
returns ``{"snapshot": N, "snapshot_s": seconds it took, "in_loop": 1 if the server's loop waited for
it}``: the benchmark scores every system's snapshots afterwards with the one real ``evaluate``, so
no system's training clock pays for the evaluation.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import latecomer

MODELS = ("resnet18", "gpt2", "mlp")
SIZES = ("full", "small", "tiny")


@dataclass(frozen=True)
class Spec:
    """One model at one size, with its data, batch, learning rate and target."""

    model: str
    size: str
    batch: int  # the global batch: one plain step, one DDP step (over all ranks), one latecomer job
    lr: float
    metric: str  # "accuracy" (higher is better) or "loss" (lower is better)
    target: float
    snap_every: int  # steps between the snapshots scored for the time to target
    width: int = 0  # resnet18: base width; gpt2: n_embd; mlp: hidden width
    depth: int = 0  # gpt2: transformer blocks; mlp: Linear layers
    heads: int = 0
    context: int = 0
    package: str = "email"  # gpt2's text

    @property
    def higher_is_better(self) -> bool:
        return self.metric != "loss"

    def reached(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return value >= self.target if self.higher_is_better else value <= self.target


SPECS: dict[tuple[str, str], Spec] = {
    ("resnet18", "full"): Spec("resnet18", "full", 32, 0.05, "accuracy", 0.97, 20, width=64),
    ("resnet18", "small"): Spec("resnet18", "small", 32, 0.05, "accuracy", 0.97, 10, width=8),
    ("resnet18", "tiny"): Spec("resnet18", "tiny", 8, 0.05, "accuracy", 0.3, 5, width=2),
    ("gpt2", "full"): Spec("gpt2", "full", 16, 0.3, "loss", 2.4, 20, width=256, depth=4, heads=4, context=64),
    ("gpt2", "small"): Spec("gpt2", "small", 16, 0.3, "loss", 2.4, 20, width=64, depth=2, heads=2, context=32),
    ("gpt2", "tiny"): Spec("gpt2", "tiny", 4, 0.3, "loss", 3.5, 5, width=8, depth=1, heads=1, context=8,
                           package="json"),
    ("mlp", "full"): Spec("mlp", "full", 64, 0.05, "accuracy", 0.75, 25, width=512, depth=30),
    ("mlp", "small"): Spec("mlp", "small", 64, 0.05, "accuracy", 0.75, 25, width=256, depth=30),
    ("mlp", "tiny"): Spec("mlp", "tiny", 8, 0.05, "accuracy", 0.2, 5, width=8, depth=30),
}


def spec_of(model: str, size: str) -> Spec:
    try:
        return SPECS[(model, size)]
    except KeyError:
        raise ValueError(f"unknown model/size {model}/{size}: models {', '.join(MODELS)}, "
                         f"sizes {', '.join(SIZES)}") from None


# --------------------------------------------------------------------------- ResNet-18


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 inputs: 3x3 stem, BasicBlocks [2, 2, 2, 2], global average pool, a linear head."""

    def __init__(self, width: int = 64, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers, cin = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2 ** i
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# --------------------------------------------------------------------------- GPT-2


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2's layout at a small size: ``wte``, ``wpe``, blocks ``h``, ``ln_f``, ``lm_head`` tied to ``wte``."""

    def __init__(self, vocab: int, context: int, n_embd: int, n_layer: int, n_head: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(context, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if name.endswith("weight") and p.ndim == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias") and "ln_" not in name:
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy over every position of every window."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# --------------------------------------------------------------------------- wide MLP


class WideMLP(nn.Module):
    """``depth`` Linear layers (``2 * depth`` parameter blocks): an input layer, ``depth - 2`` pre-norm
    residual layers (parameter-free LayerNorm, ReLU, Linear), an output layer."""

    def __init__(self, width: int, depth: int = 30, inputs: int = 64, classes: int = 10):
        super().__init__()
        if depth < 2:
            raise ValueError("WideMLP: depth >= 2")
        self.inp = nn.Linear(inputs, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(depth - 2))
        for layer in self.hidden:  # each residual branch starts small: the stream stays O(1) over 28 layers
            layer.weight.data.mul_(1.0 / math.sqrt(depth))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.hidden:
            h = h + layer(F.relu(F.layer_norm(h, h.shape[-1:])))
        return self.out(F.relu(F.layer_norm(h, h.shape[-1:])))


# --------------------------------------------------------------------------- data


@functools.lru_cache(maxsize=4)
def _digits32() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split((d.data / 16.0).astype(np.float32), d.target, test_size=0.25,
                                              stratify=d.target, random_state=0)

    def up(x: np.ndarray) -> torch.Tensor:
        img = torch.from_numpy(x).reshape(-1, 1, 8, 8)
        img = F.interpolate(img, size=(32, 32), mode="bilinear", align_corners=False)
        return ((img - 0.3) / 0.4).repeat(1, 3, 1, 1).contiguous()

    return up(x_tr), torch.from_numpy(y_tr), up(x_te), torch.from_numpy(y_te)


@functools.lru_cache(maxsize=4)
def _text_windows(package: str, context: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train windows, validation windows, vocabulary size): windows of ``context + 1`` characters,
    the train ones at stride ``context // 2`` from the first 90 % of the text, the validation ones
    (at most 256, stride ``context``) from the rest."""
    from problems.charlm import read_package_text

    text = read_package_text(package)
    vocab = sorted(set(text))
    lut = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([lut[c] for c in text], dtype=torch.int64)
    cut = int(0.9 * len(ids))
    tr, va = ids[:cut], ids[cut:]
    train = tr.unfold(0, context + 1, max(1, context // 2))
    val = va.unfold(0, context + 1, context)[:256]
    return train.contiguous(), val.contiguous(), len(vocab)


@functools.lru_cache(maxsize=4)
def _synthetic() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=5000, n_features=64, n_informative=32, n_redundant=8, n_classes=10,
                               n_clusters_per_class=2, class_sep=1.5, flip_y=0.0, random_state=0)
    x = ((x - x.mean(0)) / x.std(0)).astype(np.float32)
    n_tr = 4000
    return (torch.from_numpy(x[:n_tr]), torch.from_numpy(y[:n_tr]), torch.from_numpy(x[n_tr:]),
            torch.from_numpy(y[n_tr:]))


def train_arrays(spec: Spec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train inputs, train targets, test inputs, test targets) as tensors."""
    if spec.model == "resnet18":
        return _digits32()
    if spec.model == "gpt2":
        train, val, _ = _text_windows(spec.package, spec.context)
        return train[:, :-1], train[:, 1:], val[:, :-1], val[:, 1:]
    if spec.model == "mlp":
        return _synthetic()
    raise ValueError(spec.model)


def build_model(spec: Spec) -> nn.Module:
    if spec.model == "resnet18":
        return ResNet18(spec.width)
    if spec.model == "gpt2":
        vocab = _text_windows(spec.package, spec.context)[2]
        return GPT2(vocab, spec.context, spec.width, spec.depth, spec.heads)
    if spec.model == "mlp":
        return WideMLP(spec.width, spec.depth)
    raise ValueError(spec.model)


def loss_fn(spec: Spec):
    return lm_loss if spec.model == "gpt2" else F.cross_entropy


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def make_problem(model: str = "mlp", size: str = "small", snapshots: str = "", device: str = "cpu"):
    """The TorchProblem of ``model`` at ``size`` (what the served module's ``make`` returns)."""
    spec = spec_of(model, size)
    x_tr, y_tr, x_te, y_te = train_arrays(spec)
    cls = SnapshotProblem if snapshots else latecomer.TorchProblem
    kw = {"snapshots": snapshots} if snapshots else {}
    return cls(lambda: build_model(spec), loss_fn(spec), TensorDataset(x_tr, y_tr), TensorDataset(x_te, y_te),
               batch_size=spec.batch, device=device, eval_batch_size=512, **kw)


class SnapshotProblem(latecomer.TorchProblem):
    """A TorchProblem whose ``evaluate(x)`` saves ``x`` for scoring later (see the module docstring)."""

    def __init__(self, *args, snapshots: str, **kw):
        super().__init__(*args, **kw)
        self.snapshots, self.count = snapshots, 0
        os.makedirs(snapshots, exist_ok=True)

    def evaluate(self, x: np.ndarray) -> dict[str, float]:
        t = time.perf_counter()
        k = self.count
        self.count += 1
        np.save(os.path.join(self.snapshots, f"{k:05d}.npy"), np.asarray(x, dtype=np.float32))
        # in the main thread: the server's loop waited for it (its clock leaves the seconds out); in
        # another thread (the server's evaluations off its loop): it trained meanwhile
        in_loop = threading.current_thread() is threading.main_thread()
        return {"snapshot": float(k), "snapshot_s": time.perf_counter() - t, "in_loop": float(in_loop)}
