"""The wrapper's parts, built once from its arguments, in the order they depend on each other.

codec -> the policy sent -> downlink replicas -> instructions -> client holdings ->
uplink (validate, decode, bound, hand off) -> outbox (sample, send, count) -> round
book -> checkpoint. :class:`~fedcomp.flower.strategy.CompressedStrategy` only calls
them; nothing here decides anything per round.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flwr.serverapp.strategy import Strategy

from fedcomp.codecs import TensorPolicy, make_codec_from_spec
from fedcomp.downlink import DownlinkSpec, parse_downlink
from fedcomp.flower.families import family_of
from fedcomp.flower.holdings import ClientHoldings
from fedcomp.flower.instructions import Instructions, Sampling
from fedcomp.flower.options import ServerOptions
from fedcomp.flower.outbox import Outbox
from fedcomp.flower.replica import ReplicaSender
from fedcomp.flower.resume import ServerCheckpoint
from fedcomp.flower.round_book import RoundBook
from fedcomp.flower.uplink import Uplink
from fedcomp.observers import Reporting


@dataclass
class ServerParts:
    """Everything the wrapper delegates to (see the module docstring)."""

    codec: Any
    #: The policy the server applies (the clients get it only when ``sent``).
    policy: TensorPolicy
    downlink: DownlinkSpec
    instructions: Instructions
    #: Downlink replicas (None: the full fp32 model in every instruction, as Flower).
    replicas: ReplicaSender | None
    clients: ClientHoldings
    uplink: Uplink
    outbox: Outbox
    book: RoundBook
    checkpoint: ServerCheckpoint


def build_parts(
    inner: Strategy,
    codec_spec: Mapping[str, Any],
    downlink: DownlinkSpec | Mapping[str, Any] | None,
    run_seed: int,
    options: ServerOptions,
    reporting: Reporting,
) -> ServerParts:
    """The parts for these arguments; a bad codec or downlink spec fails here."""
    sampling = Sampling.of(inner)
    options.check(str(codec_spec.get("name")), type(inner).__name__, sampling)
    codec = make_codec_from_spec(codec_spec)
    family = family_of(codec)
    # Joint codes: the server sends its policy, so both halves pick the same tensors.
    sent = options.policy or (TensorPolicy() if family.sends_policy else None)
    policy = sent or TensorPolicy()
    if not isinstance(downlink, DownlinkSpec):
        downlink = parse_downlink(downlink or {"name": "fp32"})
    replicas = ReplicaSender.of(downlink, policy, run_seed)
    instructions = Instructions(
        codec.spec(),
        run_seed=run_seed,
        policy=sent,
        task=options.task,
        downlink_codec=replicas.codec_json if replicas else None,
    )
    ident = options.identity
    clients = ClientHoldings(
        instructions.shared, replicas, reply_timeout=ident.reply_timeout, bind_keys=ident.bind_keys
    )
    uplink = Uplink(family, options, run_seed, clients.ids.stable_of, policy=sent)
    seeded = downlink.initial == "seeded"
    outbox = Outbox(
        instructions, clients, replicas, sampling, run_seed=run_seed, seeded_initial=seeded
    )
    book = RoundBook(reporting, instructions.codec_json, uplink.cv)
    checkpoint = ServerCheckpoint(inner, clients, uplink, book)
    return ServerParts(
        codec, policy, downlink, instructions, replicas, clients, uplink, outbox, book, checkpoint
    )


def summary_line(parts: ServerParts, options: ServerOptions, run_seed: int) -> str:
    """What the wrapper runs, in one line (its ``summary``)."""
    s, d = parts.outbox.sampling, parts.downlink
    return (
        f"CompressedStrategy: codec {parts.instructions.codec_json}, downlink "
        f"{json.dumps({**d.codec, 'memory': d.memory})}, handoff "
        f"{options.aggregation.handoff}, run seed {run_seed}, sampling (from the inner "
        f"strategy) train {s.fraction_train:.2f} (min {s.min_train_nodes}) evaluate "
        f"{s.fraction_evaluate:.2f} (min {s.min_evaluate_nodes}), waiting for "
        f"{s.min_available_nodes} nodes"
    )
