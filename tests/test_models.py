"""The image models (LEAF CNN, small CNN, CIFAR ResNet-18), seeded initialization, device
selection and the GPU checks that run before Ray."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from experiments.simulate import backend_config, check_devices
from fedcomp.models import build_model, num_parameters
from fedcomp.settings import ModelSettings, settings_from_dict, validate
from fedcomp.training import select_device

LEAF = ModelSettings("cnn", [32, 64, 2048])
SMALL_CNN = ModelSettings("cnn", [32, 64, 512])
RESNET = ModelSettings("resnet18", [])


def _leaf_cnn_parameters() -> int:
    """The LEAF FEMNIST CNN counted layer by layer (5x5 convs, 'same' padding)."""
    conv1 = 1 * 32 * 25 + 32
    conv2 = 32 * 64 * 25 + 64
    dense = 64 * 7 * 7 * 2048 + 2048
    out = 2048 * 62 + 62
    return conv1 + conv2 + dense + out


@pytest.mark.parametrize(
    ("model", "dataset", "expected", "shape", "classes"),
    [
        (LEAF, "femnist", _leaf_cnn_parameters(), (1, 28, 28), 62),
        (
            SMALL_CNN,
            "cifar10",
            3 * 32 * 25 + 32 + 32 * 64 * 25 + 64 + 4096 * 512 + 512 + 512 * 10 + 10,
            (3, 32, 32),
            10,
        ),
        (RESNET, "cifar10", 11_173_962, (3, 32, 32), 10),
    ],
    ids=["leaf_cnn", "cnn", "resnet18"],
)
def test_model_sizes_and_output_shapes(model, dataset, expected, shape, classes) -> None:
    net = build_model(model, dataset, seed=0)
    assert num_parameters(net) == expected
    with torch.no_grad():
        assert tuple(net.eval()(torch.zeros(2, *shape)).shape) == (2, classes)


def test_resnet18_has_the_cifar_stem_and_integer_buffers() -> None:
    net = build_model(RESNET, "cifar10", seed=0)
    assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1)
    assert isinstance(net.maxpool, nn.Identity)
    ints = [k for k, v in net.state_dict().items() if not v.is_floating_point()]
    assert len(ints) == 20 and all(k.endswith("num_batches_tracked") for k in ints)


@pytest.mark.parametrize("model", [LEAF, RESNET], ids=["cnn", "resnet18"])
def test_every_parameter_comes_from_the_seed(model) -> None:
    dataset = "femnist" if model.name == "cnn" else "cifar10"
    torch.manual_seed(123)  # global state must not matter ...
    a = build_model(model, dataset, seed=5).state_dict()
    torch.manual_seed(456)
    b = build_model(model, dataset, seed=5).state_dict()
    c = build_model(model, dataset, seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    weights = [k for k in a if k.endswith("weight") and a[k].dim() > 1]
    assert all(not torch.equal(a[k], c[k]) for k in weights)  # ... the seed does
    state = torch.random.get_rng_state()
    build_model(model, dataset, seed=5)
    assert torch.equal(state, torch.random.get_rng_state())  # and is left alone


def test_model_widths_are_validated() -> None:
    with pytest.raises(ValueError, match=r"cnn takes \[conv1 channels, conv2 channels"):
        validate(settings_from_dict({"model": {"name": "cnn", "hidden": [32, 64]}}))
    with pytest.raises(ValueError, match="resnet18 has a fixed width: use model=resnet18"):
        validate(settings_from_dict({"model": {"name": "resnet18"}}))


def test_device_selection_and_gpu_checks() -> None:
    cuda = torch.cuda.is_available()
    assert select_device("auto").type == ("cuda" if cuda else "cpu")
    assert select_device("cpu").type == "cpu"
    if cuda:
        pytest.skip("this machine has CUDA; the refusals below are for CPU-only hosts")
    with pytest.raises(ValueError, match=r"train.device='cuda': torch sees no CUDA device"):
        select_device("cuda")
    gpu = settings_from_dict({"simulation": {"gpus_per_client": 0.5}})
    with pytest.raises(ValueError, match=r"simulation.gpus_per_client=0.5: torch sees no CUDA"):
        check_devices(gpu)
    # Ray is asked for the GPU share per client (multi-GPU simulation).
    assert backend_config(gpu)["client_resources"] == {"num_cpus": 1.0, "num_gpus": 0.5}
    check_devices(settings_from_dict({}))
