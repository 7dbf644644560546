"""The one-bit code (fedcomp.onebit): a joint code, decoded only from all replies together.

Server half, before the round: the public plan (``plan_round``: the jointly coded
tensors, each selected client's index, the tau blocks from the server's state). Client
half: reads the plan from its instruction (``read_joint_plan``) and answers each
planned tensor's public queries with one bit each (``encode_joint``; the public seed
has no client id), the other tensors raw. Server half, per reply: each one-bit payload
checked against the plan, the raw tensors decoded (``split_reply``); a bad reply is
dropped like a lost one (the decoder's Horvitz-Thompson weights use the planned
inclusion probabilities). At hand-over: the mean of every jointly coded tensor decoded
from all accepted replies at once (``joint_mean``, :class:`JointMean`), which moves the
server's state (side center, tau) to the next round.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedcomp.aggregate import weighted_mean
from fedcomp.codecs import Codec, Payload, PayloadError, TensorPolicy, parse_payload
from fedcomp.codecs.policy import encode_all
from fedcomp.failures import Failure
from fedcomp.flower.families.base import (
    DecodedUpdate,
    Encoded,
    Family,
    Instruction,
    LoadMemory,
    Payloads,
    ServerHalf,
)
from fedcomp.flower.validation import ReplyError, _check_header, decode_payloads
from fedcomp.keys import KEY_JOINT_CLIENTS, KEY_JOINT_INDEX, KEY_JOINT_TAU, METRIC_OUT_OF_RANGE
from fedcomp.onebit import OneBitCode
from fedcomp.onebit.federated import (
    JointServerState,
    joint_seed,
    out_of_range_fraction,
    pack_taus,
    unpack_taus,
)

log = logging.getLogger("fedcomp.flower.strategy")  # one logger for the wrapper's lines


@dataclass
class JointRound:
    """The public plan of one joint round, fixed in configure_train."""

    names: list[str]
    index: dict[int, int]  # stable id -> position among the selected clients
    taus: dict[str, np.ndarray]
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def clients(self) -> int:
        return len(self.index)

    def fields(self, stable_id: int) -> dict[str, int | bytes]:
        """The plan's fields in this client's train instruction."""
        return {
            KEY_JOINT_INDEX: self.index[stable_id],
            KEY_JOINT_CLIENTS: self.clients,
            KEY_JOINT_TAU: pack_taus([self.taus[n] for n in self.names]),
        }


def joint_names(
    code: OneBitCode, policy: TensorPolicy, global_arrays: Mapping[str, np.ndarray]
) -> list[str]:
    """Tensors the policy compresses, in model order (the client derives the same list
    with the same function)."""
    return policy.compressed(global_arrays)


def plan_round(
    code: OneBitCode,
    policy: TensorPolicy,
    state: JointServerState,
    global_arrays: Mapping[str, np.ndarray],
    selected: Sequence[int],
) -> JointRound:
    names = joint_names(code, policy, global_arrays)
    taus = state.taus_for(code, {n: int(np.asarray(global_arrays[n]).size) for n in names})
    return JointRound(names=names, index={sid: i for i, sid in enumerate(selected)}, taus=taus)


def split_reply(
    code: OneBitCode,
    plan: JointRound,
    payloads: Payloads,
    global_arrays: Mapping[str, np.ndarray],
    *,
    run_seed: int,
    server_round: int,
    stable_id: int,
) -> tuple[dict[str, np.ndarray], dict[str, bytes], dict[str, str]]:
    """Validate one reply: one-bit payloads against the plan, the rest decoded.

    Returns the decoded raw tensors, the checked one-bit payloads, and per tensor
    the codec name. Raises ReplyError naming the first problem.
    """
    if list(payloads.keys()) != list(global_arrays):
        raise ReplyError("payload tensor names differ from the global model's")
    if stable_id not in plan.index:
        raise ReplyError(
            f"client {stable_id} was not selected for this joint round", Failure.NOT_ASKED
        )
    joint = {}
    for name in plan.names:
        buf = payloads[name]
        reference = np.asarray(global_arrays[name])
        try:
            _check_header(name, parse_payload(buf, max_numel=reference.size).header, reference)
            code.check(
                buf,
                client_index=plan.index[stable_id],
                num_clients=plan.clients,
                seed=joint_seed(run_seed, server_round, name),
                tau=plan.taus[name],
                shape=reference.shape,
            )
        except PayloadError as exc:
            raise ReplyError(f"{name}: {exc}", exc.kind) from None
        joint[name] = bytes(buf)
    rest = [n for n in global_arrays if n not in joint]
    deltas, codecs = decode_payloads(
        {n: payloads[n] for n in rest},
        {n: global_arrays[n] for n in rest},
        codec=None,  # the policy sends every tensor outside the joint plan raw
        policy=None,
        run_seed=run_seed,
        server_round=server_round,
        stable_id=stable_id,
    )
    codecs.update(dict.fromkeys(joint, code.name))
    return deltas, joint, codecs


def joint_mean(
    code: OneBitCode,
    plan: JointRound,
    state: JointServerState,
    replies: Sequence[tuple[int, float, dict[str, bytes]]],
    global_arrays: Mapping[str, np.ndarray],
    *,
    run_seed: int,
    server_round: int,
) -> dict[str, np.ndarray]:
    """Decode every jointly coded tensor's weighted mean from the accepted replies
    ``(stable id, weight, one-bit payloads)``, and move the state to the next round."""
    indices = [plan.index[sid] for sid, _, _ in replies]
    weights = [w for _, w, _ in replies]
    means: dict[str, np.ndarray] = {}
    stopped = total = 0
    for name in plan.names:
        reference = np.asarray(global_arrays[name])
        payloads = [p[name] for _, _, p in replies]
        tau = plan.taus[name]
        mean, result = code.decode(
            payloads,
            client_indices=indices,
            num_clients=plan.clients,
            seed=joint_seed(run_seed, server_round, name),
            tau=tau,
            shape=reference.shape,
            weights=weights,
            side_center=state.center_for(name, reference.size),
        )
        means[name] = mean.numpy().astype(reference.dtype, copy=False)
        state.update(
            name, code.next_tau(payloads, shape=reference.shape, previous=tau), means[name]
        )
        stopped += result.stopped_early
        total += reference.size
    plan.stats = {
        "joint_replied": len(replies),
        "joint_selected": plan.clients,
        "center_stopped_fraction": stopped / total if total else 0.0,
    }
    return means


# ---------------------------------------------------------------------------------
# client half
# ---------------------------------------------------------------------------------


@dataclass
class JointPlan:
    """A joint (one-bit) round as this client sees it: its position among the n
    selected clients and the public tau blocks of each jointly coded tensor."""

    index: int
    clients: int
    taus: dict[str, np.ndarray]


def read_joint_plan(
    code: OneBitCode, policy: TensorPolicy, config: ConfigRecord, global_record: ArrayRecord
) -> JointPlan:
    """Read the round's joint parameters; the jointly coded tensors are those the
    policy compresses, in model order (the server derives the same list)."""
    for key in (KEY_JOINT_INDEX, KEY_JOINT_CLIENTS, KEY_JOINT_TAU):
        if key not in config:
            raise ValueError(f"joint codec {code.name!r} needs '{key}' in the train config")
    index, clients = int(config[KEY_JOINT_INDEX]), int(config[KEY_JOINT_CLIENTS])
    if not 0 <= index < clients:
        raise ValueError(f"joint index {index} is not in [0, {clients})")
    names = policy.compressed({k: np.asarray(v.numpy()) for k, v in global_record.items()})
    blocks = [code.num_blocks(int(np.prod(global_record[n].shape))) for n in names]
    taus = unpack_taus(config[KEY_JOINT_TAU], blocks)
    return JointPlan(index=index, clients=clients, taus=dict(zip(names, taus, strict=True)))


def encode_joint(
    code: OneBitCode,
    policy: TensorPolicy,
    deltas: dict[str, torch.Tensor],
    seeds: dict[str, int],
    plan: JointPlan,
    run_seed: int,
    server_round: int,
) -> Encoded:
    """One-bit payloads for the tensors the policy compresses, which the server
    planned (public seed, no client id); raw payloads for the rest."""
    counts = {"beyond": 0.0, "total": 0}

    def compress(name: str, delta: torch.Tensor) -> Payload:
        tau = plan.taus.get(name)
        if tau is None:  # the server plans every tensor the policy compresses
            raise ValueError(f"joint: tensor {name!r} is compressed but has no planned scale")
        z = np.abs(delta.detach().reshape(-1).double().numpy())
        z /= np.repeat(tau, code.block)[: z.size]
        counts["beyond"] += out_of_range_fraction(z, code) * z.size
        counts["total"] += z.size
        return code.encode(
            delta,
            client_index=plan.index,
            num_clients=plan.clients,
            seed=joint_seed(run_seed, server_round, name),
            tau=tau,
        )

    payloads = encode_all(code, policy, deltas, seeds, compress, names=plan.taus)
    total = counts["total"]
    stats = {METRIC_OUT_OF_RANGE: counts["beyond"] / total if total else 0.0}
    return Encoded(payloads, inputs={}, stats=stats)


# ---------------------------------------------------------------------------------
# server half: the plan, each reply, the joint mean
# ---------------------------------------------------------------------------------


class JointServer(ServerHalf):
    """The server's joint state across rounds, the round's plan and the joint mean."""

    joint = True

    def __init__(self, code: OneBitCode, run_seed: int) -> None:
        self.code, self.run_seed = code, run_seed
        #: Side center and tau across rounds.
        self.joint_state = JointServerState(prior=code.tau_prior)

    def plan(self, state: Any, selected: list[int], policy: TensorPolicy) -> None:
        state.plan = plan_round(self.code, policy, self.joint_state, state.global_arrays, selected)

    def decode(
        self, payloads: Payloads, header: ConfigRecord, stable_id: int, state: Any
    ) -> DecodedUpdate:
        deltas, bits, codecs = split_reply(
            self.code,
            state.plan,
            payloads,
            state.global_arrays,
            run_seed=self.run_seed,
            server_round=state.number,
            stable_id=stable_id,
        )
        return DecodedUpdate(deltas, codecs, joint=bits)

    def reducer(self) -> JointMean:
        return JointMean(self.code, self.joint_state, self.run_seed)

    def state_dict(self) -> dict[str, Any]:
        return {"joint": self.joint_state.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("joint") is not None:
            self.joint_state.load_state_dict(state["joint"])


class JointMean:
    """The one-bit code's joint decode of its tensors; the raw ones as a plain mean."""

    def __init__(self, code: OneBitCode, joint_state: JointServerState, run_seed: int) -> None:
        self.code, self.joint_state, self.run_seed = code, joint_state, run_seed

    def mean(self, decoded: list[Any], state: Any) -> dict[str, np.ndarray] | None:
        updates, weights = [d.deltas for d in decoded], [d.weight for d in decoded]
        mean = weighted_mean(updates, weights) if updates[0] else {}
        assert state.plan is not None
        try:
            joint = joint_mean(
                self.code,
                state.plan,
                self.joint_state,
                [(d.stable_id, d.weight, d.joint) for d in decoded],
                state.global_arrays,
                run_seed=self.run_seed,
                server_round=state.number,
            )
        except ValueError as exc:  # e.g. a non-finite mean: keep the model
            log.warning("round %d: joint decoding failed: %s", state.number, exc)
            state.record.joint = {"error": str(exc)}
            return None
        mean.update(joint)
        state.record.joint = dict(state.plan.stats)
        return mean


class JointFamily(Family):
    """Both halves of the one-bit code."""

    #: The jointly coded tensors are the policy's compressed ones: both halves must
    #: use the same policy, so the server always sends its own.
    sends_policy = True

    def read_plan(
        self, policy: TensorPolicy, config: ConfigRecord, global_record: ArrayRecord
    ) -> JointPlan:
        return read_joint_plan(self.codec, policy, config, global_record)

    def encode(
        self,
        instruction: Instruction,
        deltas: dict[str, torch.Tensor],
        load_memory: LoadMemory,
        fp32: Codec,
    ) -> Encoded:
        if instruction.plan is None:
            raise ValueError(f"joint codec {self.codec.name!r}: the instruction carries no plan")
        seeds = instruction.seeds(deltas)
        return encode_joint(
            self.codec,
            instruction.policy,
            deltas,
            seeds,
            instruction.plan,
            instruction.run_seed,
            instruction.round,
        )

    def server(
        self, policy: TensorPolicy | None, run_seed: int, mirror_dir: str | None
    ) -> ServerHalf:
        return JointServer(self.codec, run_seed)
