"""FetchSGD (Rothchild et al. 2020): count sketches summed on the server, which keeps
momentum and error in sketch space and unsketches the heavy coordinates.

Client half: each tensor the policy compresses, count-sketched with the run's public
draws of that tensor (fedcomp.codecs.sketch: no round, no client id, so sketches
add); the other tensors raw. The client keeps nothing: a client that missed rounds
answers like any other.

Server half, per reply: each sketch checked against the spec (rows, columns, value
dtype, public seed, finite values); the raw tensors decoded. At hand-over, from the
accepted replies' weighted mean sketch S (summed in stable-id order, in float64), one
step of FetchSGD's Algorithm 1 over all sketched tensors together
(:func:`fetchsgd_step`):

    S_u <- rho S_u + S              momentum (rho: the codec's ``momentum``)
    S_e <- S_e + S_u                error accumulation (the server's step size is the
                                    inner strategy's: the update is handed to it)
    Delta <- top-k of U(S_e)        U: the median of the rows' estimates; k: ``keep`` of
                                    all sketched coordinates, chosen across tensors
    S_u, S_e <- 0 at the buckets of Delta's coordinates

The zeroing, rather than S_e <- S_e - S(Delta), is what the paper reports using
("doing so stabilizes the optimization"); zeroing S_u there too is its momentum
stopping. Delta is the mean update for the sketched tensors; the raw ones are the plain
weighted mean. The state (S_u, S_e) is checkpointed with the run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord

from fedcomp.aggregate import weighted_mean
from fedcomp.codecs import Codec, PayloadError, TensorPolicy, parse_payload
from fedcomp.codecs.policy import encode_all
from fedcomp.codecs.sketch import CountSketchCodec, sketch_seed, slots, top_k, unsketch
from fedcomp.codecs.wire import check_field
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
from fedcomp.flower.validation import (
    ReplyError,
    _check_header,
    _pick_codec,
    allowed_codecs,
    decode_payloads,
)


def sketched_names(
    codec: CountSketchCodec, policy: TensorPolicy | None, arrays: Mapping[str, np.ndarray]
) -> list[str]:
    """The tensors the policy sketches, in model order (the client's policy is the
    server's: the family sends it)."""
    return [
        n for n, a in arrays.items() if allowed_codecs(np.asarray(a), codec, policy) == (codec,)
    ]


# ---------------------------------------------------------------------------------
# client half
# ---------------------------------------------------------------------------------


def encode_sketches(
    codec: CountSketchCodec,
    policy: TensorPolicy,
    deltas: dict[str, torch.Tensor],
    run_seed: int,
) -> Encoded:
    """Each compressed tensor's count sketch with the run's public draws of that tensor
    (no round, no client id); the others raw."""
    seeds = {n: sketch_seed(run_seed, n) for n in deltas}
    return Encoded(encode_all(codec, policy, deltas, seeds), inputs={})


# ---------------------------------------------------------------------------------
# server half: each reply, then the step
# ---------------------------------------------------------------------------------


def check_sketches(
    codec: CountSketchCodec,
    policy: TensorPolicy | None,
    payloads: Payloads,
    global_arrays: Mapping[str, np.ndarray],
    *,
    run_seed: int,
    server_round: int,
    stable_id: int,
) -> DecodedUpdate:
    """Validate one reply: each sketch against the spec and the tensor's public seed,
    its values finite; the raw tensors decoded. Raises ReplyError naming the problem."""
    if list(payloads.keys()) != list(global_arrays):
        raise ReplyError("payload tensor names differ from the global model's")
    names = sketched_names(codec, policy, global_arrays)
    tables = {}
    for name in names:
        reference = np.asarray(global_arrays[name])
        try:
            payload = parse_payload(payloads[name], max_numel=reference.size)
            _check_header(name, payload.header, reference)
            _pick_codec(name, payload, (codec,))
            check_field(
                f"{name} ({codec.name})", "seed", payload.header.seed, sketch_seed(run_seed, name)
            )
            table = codec.read_table(payload)
        except PayloadError as exc:
            raise ReplyError(f"{name}: {exc}", exc.kind) from None
        if not np.isfinite(table).all():
            raise ReplyError(f"{name}: non-finite values in the sketch", Failure.NONFINITE)
        tables[name] = table  # checked once, summed at hand-over
    rest = [n for n in global_arrays if n not in tables]
    deltas, codecs = decode_payloads(
        {n: payloads[n] for n in rest},
        {n: global_arrays[n] for n in rest},
        codec=None,  # the policy sends every other tensor raw
        policy=None,
        run_seed=run_seed,
        server_round=server_round,
        stable_id=stable_id,
    )
    codecs.update(dict.fromkeys(tables, codec.name))
    return DecodedUpdate(deltas, codecs, joint=tables)


@dataclass
class SketchState:
    """The server's FetchSGD state: per sketched tensor, the momentum sketch S_u and the
    error sketch S_e (rows x cols, float64), both zero until a tensor's first round."""

    momentum: dict[str, np.ndarray] = field(default_factory=dict)
    error: dict[str, np.ndarray] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "momentum": {k: v.tolist() for k, v in self.momentum.items()},
            "error": {k: v.tolist() for k, v in self.error.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.momentum = {k: np.asarray(v, dtype=np.float64) for k, v in state["momentum"].items()}
        self.error = {k: np.asarray(v, dtype=np.float64) for k, v in state["error"].items()}


def mean_sketch(
    replies: Sequence[tuple[int, float, np.ndarray]],
) -> np.ndarray:
    """sum_i (w_i / W) S_i over replies ``(stable id, weight, table)``, added in stable-id
    order in float64: the same bits whatever order the replies came in."""
    total = sum(w for _, w, _ in replies)
    ordered = sorted(replies, key=lambda r: r[0])
    acc = np.zeros_like(ordered[0][2], dtype=np.float64)
    for _, w, table in ordered:
        acc += (w / total) * table
    return acc


def fetchsgd_step(
    tables: Mapping[str, np.ndarray],
    sizes: Mapping[str, int],
    state: SketchState,
    *,
    rho: float,
    keep: float,
    run_seed: int,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """One server step of FetchSGD on the round's mean sketches (see the module):
    returns each sketched tensor's flat update Delta and the step's statistics."""
    estimates = {}
    for name, table in tables.items():
        u = rho * state.momentum.get(name, 0.0) + table
        state.momentum[name] = u
        state.error[name] = state.error.get(name, 0.0) + u
        estimates[name] = unsketch(state.error[name], sketch_seed(run_seed, name), sizes[name])
    names = list(tables)
    flat = np.concatenate([estimates[n] for n in names]) if names else np.zeros(0)
    k = min(flat.size, max(1, math.ceil(keep * flat.size)))
    chosen = top_k(flat, k)
    updates, start = {}, 0
    for name in names:
        n = sizes[name]
        mine = chosen[(chosen >= start) & (chosen < start + n)] - start
        delta = np.zeros(n)
        delta[mine] = estimates[name][mine]
        updates[name] = delta
        _zero_buckets(state, name, mine, run_seed)
        start += n
    error = math.sqrt(sum(float(np.sum(e * e)) for e in state.error.values()))
    stats = {
        "sketch_kept": float(k),
        "sketch_error_norm": error,
        "sketch_update_norm": float(np.linalg.norm(flat[chosen])),
    }
    return updates, stats


def _zero_buckets(state: SketchState, name: str, coords: np.ndarray, run_seed: int) -> None:
    """Zero S_u and S_e at every bucket a chosen coordinate of ``name`` hashes to."""
    rows, cols = state.error[name].shape
    at, _ = slots(sketch_seed(run_seed, name), rows, cols, coords)
    state.error[name].reshape(-1)[at.reshape(-1)] = 0.0
    state.momentum[name].reshape(-1)[at.reshape(-1)] = 0.0


class SketchServer(ServerHalf):
    """The server's FetchSGD state across rounds, each reply's check, and the step."""

    joint = True

    def __init__(self, codec: CountSketchCodec, policy: TensorPolicy | None, run_seed: int):
        self.codec, self.policy, self.run_seed = codec, policy, run_seed
        self.sketch_state = SketchState()

    def decode(
        self, payloads: Payloads, header: ConfigRecord, stable_id: int, state: Any
    ) -> DecodedUpdate:
        return check_sketches(
            self.codec,
            self.policy,
            payloads,
            state.global_arrays,
            run_seed=self.run_seed,
            server_round=state.number,
            stable_id=stable_id,
        )

    def reducer(self) -> SketchMean:
        return SketchMean(self.codec, self.sketch_state, self.run_seed)

    def state_dict(self) -> dict[str, Any]:
        return {"sketch": self.sketch_state.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("sketch") is not None:
            self.sketch_state.load_state_dict(state["sketch"])


class SketchMean:
    """FetchSGD's step on the sketched tensors; the raw ones as a plain mean."""

    def __init__(self, codec: CountSketchCodec, sketch_state: SketchState, run_seed: int):
        self.codec, self.sketch_state, self.run_seed = codec, sketch_state, run_seed

    def mean(self, decoded: list[Any], state: Any) -> dict[str, np.ndarray] | None:
        updates, weights = [d.deltas for d in decoded], [d.weight for d in decoded]
        mean = weighted_mean(updates, weights) if updates[0] else {}
        names = list(decoded[0].joint)
        tables, sizes = {}, {}
        for name in names:
            replies = [(d.stable_id, d.weight, d.joint[name]) for d in decoded]
            tables[name] = mean_sketch(replies)
            sizes[name] = int(np.asarray(state.global_arrays[name]).size)
        deltas, stats = fetchsgd_step(
            tables,
            sizes,
            self.sketch_state,
            rho=self.codec.momentum,
            keep=self.codec.keep,
            run_seed=self.run_seed,
        )
        for name, delta in deltas.items():
            reference = np.asarray(state.global_arrays[name])
            mean[name] = delta.reshape(reference.shape).astype(reference.dtype, copy=False)
        state.record.joint = {"sketch_replied": len(decoded), **stats}
        return mean


class SketchFamily(Family):
    """Both halves of FetchSGD."""

    #: The sketched tensors are the policy's: both halves must use the same policy.
    sends_policy = True

    def encode(
        self,
        instruction: Instruction,
        deltas: dict[str, torch.Tensor],
        load_memory: LoadMemory,
        fp32: Codec,
    ) -> Encoded:
        return encode_sketches(self.codec, instruction.policy, deltas, instruction.run_seed)

    def server(
        self, policy: TensorPolicy | None, run_seed: int, mirror_dir: str | None
    ) -> ServerHalf:
        return SketchServer(self.codec, policy, run_seed)
