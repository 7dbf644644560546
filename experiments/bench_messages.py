"""Compact messages: Flower objects and wire bytes of one train reply, protocol 1
(one Array per tensor) against protocol 2 (every payload in one bundle of the header).

    python -m experiments.bench_messages [--out FILE.md]

Per model (the digits MLP, NIID-Bench's Fashion-MNIST CNN) and codec, the same
payloads (a Gaussian update of the model, encoded by the codec under the default
tensor policy) are laid out both ways and measured as Flower measures them: the
objects of the message (on a Deployment Engine each is one PushObject call with about
1 KB of HTTP framing) and their deflated bytes (what results.json calls wire bytes).
The plain Flower fp32 reply (the trained model as an ArrayRecord) is the reference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from experiments.inprocess import set_task_identity
from experiments.runtime import emit
from fedcomp.codecs import TensorPolicy, make_codec_from_spec
from fedcomp.codecs.policy import encode_all
from fedcomp.flower.accounting import wire_bytes
from fedcomp.flower.reply_format import reply_content
from fedcomp.keys import (
    KEY_CODEC,
    KEY_NUM_EXAMPLES,
    KEY_PROTOCOL,
    KEY_ROUND,
    KEY_STABLE_ID,
    RECORD_HEADER,
)
from fedcomp.models import build_model
from fedcomp.settings import settings_from_dict

#: Label -> (dataset, model settings as the Hydra presets set them).
MODELS = {
    "digits MLP": ("digits", {"name": "mlp"}),
    "Fashion-MNIST CNN": ("fashion_mnist", {"name": "niid_cnn", "hidden": [120, 84]}),
}
CODECS: dict[str, dict] = {
    "fp32": {"name": "fp32"},
    "uniform 8-bit": {"name": "uniform", "bits": 8, "block": 256},
    "sparseq 2% (ef_sparseq2)": {"name": "sparseq", "fraction": 0.02, "bits": 4, "block": 256},
}


def _model(dataset: str, model: dict) -> dict[str, np.ndarray]:
    settings = settings_from_dict({"dataset": {"name": dataset}, "model": model})
    net = build_model(settings.model, settings.dataset.name, settings.seed)
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def _message(content: RecordDict) -> Message:
    instruction = Message(RecordDict(), dst_node_id=1, message_type="train")
    return Message(content, reply_to=instruction)


def _version_1(header: dict, payloads: dict[str, bytes], metrics: MetricRecord) -> RecordDict:
    """Protocol 1's layout, rebuilt here for the comparison: the codec spec echoed in
    the header, one raw uint8 Array per tensor in its own ArrayRecord."""
    arrays = {
        n: Array(dtype="uint8", shape=(len(p),), stype="raw", data=p) for n, p in payloads.items()
    }
    return RecordDict(
        {
            "fedcomp.payload": ArrayRecord(arrays),
            RECORD_HEADER: ConfigRecord(header),
            "metrics": metrics,
        }
    )


def measure(model: dict[str, np.ndarray], spec: dict) -> dict[str, tuple[int, int]]:
    """(objects, wire bytes) of the plain fp32 reply and of both layouts."""
    rng = np.random.default_rng(0)
    update = {k: torch.from_numpy(rng.standard_normal(v.shape).astype(v.dtype)) for k, v in
              model.items()}  # fmt: skip
    payloads = encode_all(
        make_codec_from_spec(spec), TensorPolicy(), update, dict.fromkeys(model, 1)
    )
    metrics = MetricRecord({KEY_NUM_EXAMPLES: 180, "train_loss": 0.5})
    header = {KEY_STABLE_ID: 3, KEY_PROTOCOL: 2, KEY_ROUND: 7}
    v1 = _version_1({**header, KEY_CODEC: json.dumps(spec, sort_keys=True)}, payloads, metrics)
    plain = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in model.items()}),
                        "metrics": metrics})  # fmt: skip
    out = {}
    for name, content in (
        ("plain fp32", plain),
        ("v1", v1),
        ("v2", reply_content(header, payloads, metrics)),
    ):
        msg = _message(content)
        out[name] = (len(get_all_nested_objects(msg)), wire_bytes(msg))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    set_task_identity()  # Messages built outside a run need Flower's task identity
    lines = [
        "# Compact messages: one train reply, protocol 1 against protocol 2",
        "",
        "`python -m experiments.bench_messages --out experiments/results/bench_messages.md`",
        "(deterministic: object counts and deflated bytes do not depend on the machine).",
        "",
        "| model (tensors) | codec | plain fp32 objects / bytes | v1 objects / bytes | "
        "v2 objects / bytes | objects saved |",
        "|---|---|---|---|---|---|",
    ]
    for label, (dataset, model_name) in MODELS.items():
        model = _model(dataset, model_name)
        for codec, spec in CODECS.items():
            m = measure(model, spec)
            (po, pb), (o1, b1), (o2, b2) = m["plain fp32"], m["v1"], m["v2"]
            lines.append(
                f"| {label} ({len(model)}) | {codec} | {po} / {pb:,} | {o1} / {b1:,} | "
                f"{o2} / {b2:,} | {o1 - o2} |"
            )
    lines += [
        "",
        "Each object is its own HTTP call on a Deployment Engine (about 1 KB of framing per",
        "call, docs/experiments.md): the objects saved are calls saved per reply and node.",
    ]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
