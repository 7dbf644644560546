"""One home per protocol (fedcomp.flower.families): every codec the configs offer names a
family; each family's two halves agree on every codec; and the Flower layer decides
nothing by a codec's class."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

import fedcomp.codecs
from experiments.runtime import PROJECT_ROOT
from fedcomp.codecs import WHOLE_CODES, TensorPolicy, make_codec_from_spec
from fedcomp.flower.families import FAMILIES, family_of
from fedcomp.flower.families.base import Instruction
from fedcomp.flower.memory_state import MemoryState
from fedcomp.flower.reply_format import payloads_of, reply_content, reply_header
from fedcomp.flower.round_state import RoundState
from fedcomp.flower.validation import uplink_headers
from fedcomp.onebit import OneBitCode

SPECS = {
    path.stem: yaml.safe_load(path.read_text())
    for path in sorted((PROJECT_ROOT / "conf" / "codec").glob("*.yaml"))
}


def _codec_classes() -> set[str]:
    """Names of every class the codecs define (the kinds a codec can be)."""
    names = {"OneBitCode"}
    for module in Path(fedcomp.codecs.__file__).parent.glob("*.py"):
        tree = ast.parse(module.read_text())
        names |= {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    return names - {"TensorPolicy", "PayloadError", "PayloadHeader", "Payload", "BitWriter"}


def test_the_flower_layer_never_asks_a_codec_its_class() -> None:
    """No isinstance on a codec's kind anywhere in fedcomp/flower/: a codec names its
    family, and family_of is the one place that reads it."""
    kinds = _codec_classes()
    offenders = []
    for path in sorted((PROJECT_ROOT / "fedcomp" / "flower").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if named & kinds:
                    offenders.append(f"{path.name}:{node.lineno} {sorted(named & kinds)}")
    assert "ResidualMemory" in kinds and "UniformCodec" in kinds  # the scan sees the classes
    assert offenders == []


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_configured_codec_names_a_known_family(name: str) -> None:
    spec = {k: v for k, v in SPECS[name].items() if not k.startswith("_")}
    family = family_of(make_codec_from_spec(spec))
    assert type(family) is FAMILIES[make_codec_from_spec(spec).family]


def test_an_unknown_family_is_refused_by_name() -> None:
    class Odd:
        name, family = "odd", "telepathy"

    with pytest.raises(ValueError, match=r"codec 'odd' names no known family: 'telepathy'"):
        family_of(Odd())


def _instruction(codec, round_: int = 3, stable_id: int = 7) -> Instruction:
    return Instruction(
        config=ConfigRecord({}),
        codec=codec,
        policy=TensorPolicy(min_numel=16),
        stable_id=stable_id,
        round=round_,
        run_seed=11,
        global_record=ArrayRecord({}),
    )


# the joint and summed codes decode only all replies together: tests/test_onebit*.py,
# tests/test_sketch.py
@pytest.mark.parametrize("name", [n for n in sorted(SPECS) if SPECS[n]["name"] not in WHOLE_CODES])
def test_each_familys_server_half_decodes_what_its_client_half_encoded(name: str) -> None:
    """Per-reply families, first round (fresh memories): the server half's update is
    the client half's payloads decoded, tensor by tensor: decode(payload) for raw and
    stateless tensors, and for residual compression h + decode(q) with h = 0."""
    from fedcomp.codecs import decode_bytes

    spec = {k: v for k, v in SPECS[name].items() if not k.startswith("_")}
    codec = make_codec_from_spec(spec)
    family = family_of(codec)
    rng = np.random.default_rng(0)
    deltas = {
        "w": torch.from_numpy(rng.standard_normal((32, 24)).astype(np.float32)),
        "b": torch.from_numpy(rng.standard_normal(8).astype(np.float32)),  # travels raw
    }
    instruction = _instruction(codec)
    memory = MemoryState()
    encoded = family.encode(
        instruction, deltas, lambda: memory, make_codec_from_spec({"name": "fp32"})
    )
    content = reply_content(encoded.header, encoded.payloads, MetricRecord())
    header = reply_header(content)
    state = RoundState(number=instruction.round, t_start=0.0)
    state.global_arrays = {n: np.zeros(tuple(d.shape), np.float32) for n, d in deltas.items()}
    rule = uplink_headers(
        state.global_arrays, instruction.run_seed, instruction.round, instruction.stable_id
    )
    payloads = payloads_of(header, list(deltas), rule)
    half = family.server(instruction.policy, instruction.run_seed, None)
    update = half.decode(payloads, header, instruction.stable_id, state)
    assert set(update.deltas) == set(deltas)
    for n in deltas:
        expected = decode_bytes(encoded.payloads[n]).numpy()
        assert np.array_equal(update.deltas[n], expected), n
    assert update.codecs["b"] == "raw"
    assert float(np.abs(update.deltas["w"]).sum()) > 0  # something was sent


def test_the_joint_family_has_a_plan_and_a_mean_of_its_own() -> None:
    code = make_codec_from_spec({**SPECS["onebit"], "center": "zero"})
    assert isinstance(code, OneBitCode)
    family = family_of(code)
    half = family.server(TensorPolicy(), 0, None)
    assert family.sends_policy and half.joint and half.reducer() is not None
    stateless = family_of(make_codec_from_spec({"name": "uniform", "bits": 2}))
    assert not stateless.sends_policy
    assert stateless.server(None, 0, None).reducer() is None


@pytest.mark.parametrize("value", [True, 1.0, "1", [1]])
def test_a_residual_header_field_that_is_not_an_int_is_malformed(value) -> None:
    """Version, checksum mode and sync fields are integers; a bool (an int subclass in
    Python), a float, a string or a list is the sender's malformed reply, not a crash."""
    from fedcomp.failures import Failure
    from fedcomp.flower.families.residual import int_field
    from fedcomp.flower.validation import ReplyError

    assert int_field(ConfigRecord({"k": 3}), "k", -1) == 3
    assert int_field(ConfigRecord({}), "k", -1) == -1
    with pytest.raises(ReplyError, match=r"header field k=.* is not an integer") as info:
        int_field(ConfigRecord({"k": value}), "k", -1)
    assert info.value.kind is Failure.MALFORMED
