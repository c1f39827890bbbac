"""Your own PyTorch model on latecomer: an MLP with BatchNorm and Dropout on scikit-learn's digits.

From this folder (see the README's "Your own model")::

    latecomer serve --problem mymodel:make --algorithm asgd --set lr=0.05 --max-steps 2000 --state state
    latecomer work --server tcp://127.0.0.1:5555 --allow-problem mymodel:make   # two or three, in other terminals
    latecomer export state -o model.pt --allow-problem mymodel:make

and then, in plain PyTorch: ``net = Net(); net.load_state_dict(torch.load("model.pt")); net.eval()``.
"""

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import TensorDataset

import latecomer


class Net(nn.Module):
    """64 pixels -> hidden (BatchNorm, ReLU, Dropout) -> 10 logits."""

    def __init__(self, hidden: int = 64, dropout: float = 0.2):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(dropout))
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def digits(split_seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The 8x8 digits as (train, test) TensorDatasets: pixels scaled to [0, 1], a stratified 75/25 split."""
    data = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split((data.data / 16.0).astype(np.float32), data.target, test_size=0.25,
                                              stratify=data.target, random_state=split_seed)
    return (TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr)),
            TensorDataset(torch.from_numpy(x_te), torch.from_numpy(y_te)))


def make(hidden: int = 64, device: str = "cpu") -> latecomer.TorchProblem:
    """The problem factory: ``latecomer serve --problem mymodel:make [--problem-opt hidden=128]``."""
    train, test = digits()
    return latecomer.TorchProblem(lambda: Net(hidden), nn.functional.cross_entropy, train, test, device=device)
