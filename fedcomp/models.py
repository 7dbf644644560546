"""Models, built from settings and initialized from an explicit seed."""

from __future__ import annotations

import math

import torch
from torch import nn

from fedcomp.rng import torch_generator
from fedcomp.settings import ModelSettings

#: Input and output sizes of each dataset, so models can be built without the data.
DATASET_SHAPES = {"digits": (64, 10)}


class MLP(nn.Sequential):
    """A ReLU multilayer perceptron on flattened inputs."""

    def __init__(self, in_features: int, hidden: list[int], num_classes: int) -> None:
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)


def _init_(model: nn.Module, generator: torch.Generator) -> None:
    """PyTorch's default Linear init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), seeded."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            bound = 1.0 / math.sqrt(module.in_features)
            with torch.no_grad():
                module.weight.uniform_(-bound, bound, generator=generator)
                module.bias.uniform_(-bound, bound, generator=generator)


def build_model(model: ModelSettings, dataset_name: str, seed: int) -> nn.Module:
    """Build and seed-initialize the configured model for a dataset."""
    if dataset_name not in DATASET_SHAPES:
        raise ValueError(f"no model input shape known for dataset.name={dataset_name!r}")
    in_features, num_classes = DATASET_SHAPES[dataset_name]
    if model.name == "mlp":
        net = MLP(in_features, list(model.hidden), num_classes)
    else:
        raise ValueError(f"invalid setting model.name={model.name!r}: allowed: mlp")
    _init_(net, torch_generator(seed, "model-init"))
    return net


def num_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
