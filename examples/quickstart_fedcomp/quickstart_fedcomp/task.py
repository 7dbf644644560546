"""Model, data and training: a small MLP on scikit-learn's digits (bundled, offline)."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def load_data(partition_id: int, num_partitions: int) -> tuple[tuple, tuple]:
    """This partition's (train, test) tensors: every num_partitions-th sample."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    rng = np.random.default_rng(0)
    order = torch.from_numpy(rng.permutation(len(y)))
    mine = order[partition_id::num_partitions]
    cut = int(0.8 * len(mine))
    return (x[mine[:cut]], y[mine[:cut]]), (x[mine[cut:]], y[mine[cut:]])


def train(net: Net, data: tuple, epochs: int, lr: float) -> float:
    x, y = data
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    loss = torch.tensor(0.0)
    for _ in range(epochs):
        for i in range(0, len(y), 32):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(x[i : i + 32]), y[i : i + 32])
            loss.backward()
            optimizer.step()
    return float(loss)


def test(net: Net, data: tuple) -> tuple[float, float]:
    x, y = data
    net.eval()
    with torch.no_grad():
        logits = net(x)
    loss = float(nn.functional.cross_entropy(logits, y))
    return loss, float((logits.argmax(1) == y).float().mean())
