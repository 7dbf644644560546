"""The wrapper's joint-decoding path for the one-bit code.

A joint code cannot be decoded per reply: the wrapper validates each reply's one-bit
payloads against the round's public plan (a bad reply is dropped like a lost one: the
decoder's Horvitz-Thompson weights use the planned inclusion probabilities), decodes the
raw tensors as usual, then decodes the mean of every jointly coded tensor from all
accepted replies at once and hands the inner strategy one pre-aggregated reply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord

from fedcomp.codecs import PayloadError, TensorPolicy, parse_payload
from fedcomp.failures import Failure
from fedcomp.flower.validation import ReplyError, _check_header, decode_payloads
from fedcomp.onebit import OneBitCode
from fedcomp.onebit.federated import JointServerState, joint_seed


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
    payloads: ArrayRecord,
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
        buf = payloads[name].data
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
        ArrayRecord({n: payloads[n] for n in rest}),
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
