"""Models, built from settings and initialized from an explicit seed.

- ``mlp``: a ReLU perceptron on flattened inputs (any dataset).
- ``cnn``: two 5x5 convolutions (same padding, ReLU, 2x2 max-pool) and two dense
  layers; ``model.hidden = [c1, c2, fc]``. With [32, 64, 2048] on FEMNIST it is the
  LEAF CNN (6,603,710 parameters, ``model=leaf_cnn``); with [32, 64, 512] on CIFAR-10
  the small CNN of FedAvg-style experiments (``model=cnn``).
- ``niid_cnn``: NIID-Bench's CNN (Li et al., 2102.02079): two unpadded 5x5
  convolutions with 6 and 16 channels (ReLU, 2x2 max-pool each) and dense layers
  ``model.hidden = [120, 84]`` then the classes: 44,426 parameters on 28x28x1
  (Fashion-MNIST, ``model=niid_cnn``), 62,006 on 32x32x3 (their CIFAR-10 CNN).
- ``resnet18``: torchvision's ResNet-18 with the CIFAR stem (a 3x3 stride-1 first
  convolution and no max-pool), 11.2M parameters; its BatchNorm layers carry
  running statistics and an int64 ``num_batches_tracked`` buffer, which the tensor
  policy sends raw.

Every parameter is drawn from a generator derived from (seed, "model-init"), so a
model is a function of its settings and seed, not of global RNG state.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fedcomp.data.sources import spec_of
from fedcomp.rng import torch_generator
from fedcomp.settings import ModelSettings


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


class CNN(nn.Sequential):
    """conv5x5(c1)-ReLU-pool2, conv5x5(c2)-ReLU-pool2, dense(fc)-ReLU, dense(classes)."""

    def __init__(self, shape: tuple[int, int, int], widths: list[int], num_classes: int) -> None:
        channels, height, width = shape
        c1, c2, fc = widths
        super().__init__(
            nn.Conv2d(channels, c1, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(c2 * (height // 4) * (width // 4), fc),
            nn.ReLU(),
            nn.Linear(fc, num_classes),
        )


class NiidCNN(nn.Sequential):
    """conv5x5(6)-ReLU-pool2, conv5x5(16)-ReLU-pool2 (no padding), dense(h1)-ReLU,
    dense(h2)-ReLU, dense(classes): NIID-Bench's SimpleCNN / SimpleCNNMNIST."""

    def __init__(self, shape: tuple[int, int, int], widths: list[int], num_classes: int) -> None:
        channels, height, width = shape
        h1, h2 = widths
        super().__init__(
            nn.Conv2d(channels, 6, kernel_size=5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * niid_cnn_side(height) * niid_cnn_side(width), h1),
            nn.ReLU(),
            nn.Linear(h1, h2),
            nn.ReLU(),
            nn.Linear(h2, num_classes),
        )


def niid_cnn_side(side: int) -> int:
    """A side of the NIID CNN's last feature map: two unpadded 5x5 convolutions, each
    followed by a 2x2 max-pool (28 -> 24 -> 12 -> 8 -> 4; 32 -> 5)."""
    return ((side - 4) // 2 - 4) // 2


def cifar_resnet18(in_channels: int, num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 with the usual CIFAR stem: 3x3 stride-1 conv, no max-pool
    (the ImageNet stem would shrink a 32x32 image to 8x8 before the first block)."""
    from torchvision.models import resnet18

    net = resnet18(weights=None, num_classes=num_classes)
    net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


def _init_(model: nn.Module, generator: torch.Generator, conv_fan_out: bool) -> None:
    """Seeded versions of the usual initializations.

    Linear (and, for the CNN, Conv2d): PyTorch's default U(-1/sqrt(fan_in),
    1/sqrt(fan_in)) for weights and biases. ResNet convolutions: Kaiming normal
    (fan_out, ReLU) as torchvision does; BatchNorm: weight 1, bias 0.
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d) and conv_fan_out:
                nn.init.kaiming_normal_(
                    module.weight, mode="fan_out", nonlinearity="relu", generator=generator
                )
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Linear | nn.Conv2d):
                fan_in = module.weight[0].numel()
                bound = 1.0 / math.sqrt(fan_in)
                module.weight.uniform_(-bound, bound, generator=generator)
                if module.bias is not None:
                    module.bias.uniform_(-bound, bound, generator=generator)
            elif isinstance(module, nn.BatchNorm2d):
                module.weight.fill_(1.0)
                module.bias.zero_()


def check_model(model: ModelSettings, dataset_name: str) -> None:
    """Raise ValueError when the model cannot take the dataset's inputs.

    The message names the model, the input shape and a model that fits.
    """
    spec = spec_of(dataset_name)
    if model.name == "mlp":
        _check_size(model, dataset_name)
        return
    if model.name not in ("cnn", "resnet18", "niid_cnn"):
        raise ValueError(
            f"invalid setting model.name={model.name!r}: allowed: mlp, cnn, resnet18, niid_cnn"
        )
    if not spec.is_image:
        raise ValueError(
            f"model.name={model.name!r} takes images (channels x height x width), but "
            f"dataset '{dataset_name}' gives vectors of {spec.shape[0]} features: use "
            f"model=mlp"
        )
    _, height, width = spec.shape
    if model.name == "cnn" and min(height, width) < 4:
        raise ValueError(
            f"model.name='cnn' pools twice by 2 and needs images of at least 4x4; "
            f"dataset '{dataset_name}' has {height}x{width}"
        )
    if model.name == "niid_cnn" and min(niid_cnn_side(height), niid_cnn_side(width)) < 1:
        raise ValueError(
            f"model.name='niid_cnn' (two unpadded 5x5 convolutions, each pooled by 2) needs "
            f"images of at least 16x16; dataset '{dataset_name}' has {height}x{width}"
        )
    _check_size(model, dataset_name)


def _check_size(model: ModelSettings, dataset_name: str) -> None:
    if any(not isinstance(h, int) or isinstance(h, bool) or h <= 0 for h in model.hidden):
        raise ValueError(
            f"invalid setting model.hidden={list(model.hidden)!r:.200}: positive integer widths"
        )
    elements = model_elements(model, dataset_name)
    if elements > MAX_MODEL_ELEMENTS:
        raise ValueError(
            f"invalid setting model.hidden={list(model.hidden)!r:.200}: {model.name} on "
            f"{dataset_name} would have {elements:,} elements, more than the "
            f"{MAX_MODEL_ELEMENTS:,} fedcomp builds"
        )


#: The largest model fedcomp builds, in parameters and buffers (2^28, 1 GiB of
#: float32; ResNet-18 has 11M): a width in a settings file or a server's task cannot
#: make a client allocate more. Counted before anything is allocated.
MAX_MODEL_ELEMENTS = 1 << 28


def model_elements(model: ModelSettings, dataset_name: str) -> int:
    """How many parameter and buffer elements the model has, counted on PyTorch's meta
    device (no memory is allocated)."""
    with torch.device("meta"):
        net = _construct(model, spec_of(dataset_name))
    return sum(t.numel() for t in (*net.parameters(), *net.buffers()))


def _construct(model: ModelSettings, spec: Any) -> nn.Module:
    if model.name == "mlp":
        return MLP(math.prod(spec.shape), list(model.hidden), spec.num_classes)
    if model.name == "cnn":
        return CNN(spec.shape, list(model.hidden), spec.num_classes)
    if model.name == "niid_cnn":
        return NiidCNN(spec.shape, list(model.hidden), spec.num_classes)
    return cifar_resnet18(spec.shape[0], spec.num_classes)


def build_model(model: ModelSettings, dataset_name: str, seed: int) -> nn.Module:
    """Build and seed-initialize the configured model for a dataset."""
    check_model(model, dataset_name)
    spec = spec_of(dataset_name)
    # Module constructors draw from the global generator; fork it so building a model
    # leaves global state alone (every parameter is re-drawn from the seed below).
    with torch.random.fork_rng(devices=[]):
        net = _construct(model, spec)
    _init_(net, torch_generator(seed, "model-init"), conv_fan_out=model.name == "resnet18")
    return net


def num_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
