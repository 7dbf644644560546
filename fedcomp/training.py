"""Local training and evaluation loops (plain torch, seeded, CPU or CUDA)."""

from __future__ import annotations

import torch
from torch import nn

from fedcomp.data import ArrayDataset
from fedcomp.settings import TrainSettings


def select_device(preference: str = "auto") -> torch.device:
    """``train.device`` as a torch device: "auto" is CUDA when available, else the CPU.

    Under Ray with ``simulation.gpus_per_client > 0`` each client sees only the GPU
    share Ray gave it (``CUDA_VISIBLE_DEVICES``), so "cuda" is that GPU.

    Raises
    ------
    ValueError
        For "cuda" on a machine where torch sees no CUDA device, or an unknown value.
    """
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if preference == "cpu":
        return torch.device("cpu")
    if preference == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "invalid setting train.device='cuda': torch sees no CUDA device here "
                "(use train.device=auto or cpu)"
            )
        return torch.device("cuda")
    raise ValueError(f"invalid setting train.device={preference!r}: allowed: auto, cpu, cuda")


def train_local(
    model: nn.Module,
    data: ArrayDataset,
    train: TrainSettings,
    generator: torch.Generator,
    proximal_mu: float = 0.0,
    device: torch.device | str = "cpu",
) -> float:
    """Train in place with SGD; return the mean training loss over all batches.

    The batch order comes from ``generator``, so a client's training is reproducible
    from (run seed, round, stable id). ``proximal_mu > 0`` adds FedProx's term
    ``mu / 2 * ||w - w_start||^2`` (the loss reported excludes it). Training runs on
    ``device``; the model is back on the CPU when this returns.
    """
    if len(data) == 0:
        raise ValueError("cannot train on an empty partition")
    device = torch.device(device)
    model.to(device)
    data = ArrayDataset(data.x.to(device), data.y.to(device))
    opt = torch.optim.SGD(
        model.parameters(), lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay
    )
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else []
    total, batches = 0.0, 0
    for _ in range(train.local_epochs):
        order = torch.randperm(len(data), generator=generator)
        for start in range(0, len(data), train.batch_size):
            idx = order[start : start + train.batch_size]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(data.x[idx]), data.y[idx])
            objective = loss
            if anchor:
                params = zip(model.parameters(), anchor, strict=True)
                prox = sum(((p - a) ** 2).sum() for p, a in params)
                objective = loss + 0.5 * proximal_mu * prox
            objective.backward()
            opt.step()
            total += float(loss.detach())
            batches += 1
    model.to("cpu")
    return total / batches


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: ArrayDataset,
    batch_size: int = 1024,
    device: torch.device | str = "cpu",
) -> tuple[float, float]:
    """Return (mean cross-entropy loss, accuracy) on ``data`` (computed on ``device``;
    the model is back on the CPU when this returns)."""
    if len(data) == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    device = torch.device(device)
    model.to(device)
    model.eval()
    loss_sum, correct = 0.0, 0
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    for start in range(0, len(data), batch_size):
        x = data.x[start : start + batch_size].to(device)
        y = data.y[start : start + batch_size].to(device)
        logits = model(x)
        loss_sum += float(loss_fn(logits, y))
        correct += int((logits.argmax(1) == y).sum())
    model.to("cpu")
    return loss_sum / len(data), correct / len(data)
