"""Downlink compression, both halves: the server's broadcast replica and each client's.

Definitions (docs/downlink.md). The server keeps ``x_hat``, the model every
up-to-date client holds bit for bit, at a version. After round t's aggregation gives
x_t, the server encodes one step ``p_t = C(x_t - x_hat)`` and moves ``x_hat`` by
``decode(p_t)``; what ``C`` lost stays in ``x_t - x_hat`` and enters the next step
(error feedback applied to the broadcast). With ``memory="none"`` the step encodes the
global update ``x_t - x_{t-1}`` instead and the replicas drift from x_t.

Tensors the policy sends raw (integer buffers, small tensors) travel as their exact
new value (a ``raw`` payload); every other payload carries a difference. One function,
:func:`apply_step`, moves a replica on both sides, so the two stay bit-identical; a
checksum of the result travels with every step and a client never trains on a
replica whose checksum differs.

No flwr here: ``fedcomp.flower`` carries steps in messages.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedcomp.codecs import (
    Codec,
    Payload,
    TensorPolicy,
    codec_class_by_id,
    make_codec_from_spec,
    parse_payload,
)
from fedcomp.codecs.dense import RawCodec
from fedcomp.codecs.entropy import max_inner_size, work_size
from fedcomp.codecs.wire import PayloadHeader
from fedcomp.compact import HeaderRule
from fedcomp.rng import derive_seed
from fedcomp.rules import fail

#: ``downlink.memory``: error feedback on the server (x_hat), or none (x_t - x_{t-1}).
MEMORIES = ("error_feedback", "none")
#: Downlink codec names that mean "no replica": the full model in every instruction.
OFF = "fp32"
#: ``downlink.initial``: how a client with no replica gets version 0, the initial model:
#: sent in full, or built by the client itself from the run's seed (its mod was given
#: an ``initial_model`` function); a client that cannot is sent x_hat in full.
INITIALS = ("sent", "seeded")
#: The seed purpose of downlink payloads in the public randomness.
SEED_PURPOSE = "downlink"
#: The most steps one instruction carries. Each step costs the client one decode of the
#: model whatever its bytes (a tiny payload can decode to a dense tensor), so this
#: bounds a catch-up at 16 model decodes; a client further behind is sent x_hat in
#: full (the bytes of at most 16 steps of a 2-bit codec).
MAX_STEPS = 16

_RAW = RawCodec()


class ReplicaError(ValueError):
    """A client replica that cannot take the steps it was sent (it is resynced)."""


@dataclass(frozen=True)
class DownlinkSpec:
    """What the server broadcasts with: a stateless codec and the server memory."""

    codec: dict[str, Any] = field(default_factory=lambda: {"name": OFF})
    memory: str = "error_feedback"
    initial: str = "sent"

    @property
    def active(self) -> bool:
        """False for the default: the full fp32 model in every instruction."""
        return self.codec.get("name") != OFF

    def build(self) -> Codec:
        codec = make_codec_from_spec(self.codec)
        if not isinstance(codec, Codec):
            raise TypeError(f"{self.codec} is not a stateless codec")
        return codec


def parse_downlink(spec: Mapping[str, Any]) -> DownlinkSpec:
    """Check a ``downlink`` settings group (name, the codec's parameters, memory).

    Raises
    ------
    ValueError
        ``invalid setting downlink.<key>=<value>: <what is allowed>``.
    """
    from fedcomp.codecs import codec_class, codec_names

    spec = dict(spec)
    memory = spec.pop("memory", "error_feedback")
    if memory not in MEMORIES:
        fail("downlink.memory", memory, f"allowed: {', '.join(MEMORIES)}")
    initial = spec.pop("initial", "sent")
    if initial not in INITIALS:
        fail("downlink.initial", initial, f"allowed: {', '.join(INITIALS)}")
    name = spec.get("name")
    # a stateless codec encodes one tensor alone (adaptive's widths are a reply's choice)
    allowed = [n for n in codec_names() if n != "raw" and codec_class(n).family == "stateless"]
    if name not in allowed:
        fail(
            "downlink.name",
            name,
            f"a stateless codec: {', '.join(allowed)} (fp32: no compression, no replica); "
            "memories and joint codes cannot encode a broadcast",
        )
    try:
        codec = make_codec_from_spec(spec)
    except (ValueError, TypeError) as exc:
        fail("downlink", spec, str(exc))
    if not isinstance(codec, Codec):
        fail("downlink.name", name, "a stateless codec")
    return DownlinkSpec(codec=dict(codec.spec()), memory=str(memory), initial=str(initial))


# --- the step, and the one way to apply it ----------------------------------------------


@dataclass(frozen=True)
class Step:
    """One broadcast step: from version ``source`` to ``target``, one payload per
    tensor (a ``raw`` payload is the new value, any other the difference, applied
    times its scale: x_hat + scale * decode(payload))."""

    source: int
    target: int
    payloads: dict[str, bytes]
    #: Checksum of the replica after this step.
    checksum: str
    #: Per-tensor scale of the decoded difference (absent: 1).
    scales: dict[str, float] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """What decoding the step reads: each payload's bytes, a lossless stage's
        decompressed size (fedcomp.codecs.entropy.work_size). The server sends the
        model instead of steps that weigh more, and the client refuses them: one
        instruction costs a client at most a model's bytes and MAX_STEPS decodes."""
        return sum(work_size(p) for p in self.payloads.values())


def checksum(arrays: Mapping[str, np.ndarray]) -> str:
    """A digest of the replica: names, dtypes, shapes and bytes, in model order."""
    h = hashlib.blake2b(digest_size=8)
    for name, array in arrays.items():
        a = np.ascontiguousarray(array)
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def decode_payload_for(name: str, payload: bytes, current: np.ndarray) -> tuple[np.ndarray, bool]:
    """One step payload decoded against the replica's tensor: (values, whether it is a
    raw payload carrying the new value rather than a difference).

    Raises
    ------
    ReplicaError
        When the payload is malformed or does not fit the tensor.
    """
    try:
        parsed = parse_payload(payload, current.size)
    except ValueError as exc:
        raise ReplicaError(f"{name}: {exc}") from exc
    return decode_parsed(name, parsed, current)


def decode_parsed(name: str, parsed: Payload, current: np.ndarray) -> tuple[np.ndarray, bool]:
    """:func:`decode_payload_for` on a payload already parsed (and checked)."""
    try:
        cls = codec_class_by_id(parsed.header.codec_id)
        if cls is None:
            raise ValueError(f"unknown codec id {parsed.header.codec_id}")
        decoded = cls.decode_payload(parsed)
    except ValueError as exc:
        raise ReplicaError(f"{name}: {exc}") from exc
    if tuple(decoded.shape) != current.shape:
        raise ReplicaError(f"{name}: payload shape {tuple(decoded.shape)} != {current.shape}")
    return decoded.numpy(), parsed.header.codec_id == _RAW.codec_id


def move(current: np.ndarray, value: np.ndarray, raw: bool, scale: float) -> np.ndarray:
    """A replica tensor after one decoded payload: the new value (raw), or current +
    scale * difference in float32 (float64 for float64 models), the same on both sides."""
    if raw:
        return value.astype(current.dtype, copy=True)
    work = np.result_type(current.dtype, np.float32)
    moved = current.astype(work, copy=False) + work.type(scale) * value.astype(work, copy=False)
    return moved.astype(current.dtype, copy=False)


def apply_step(
    arrays: Mapping[str, np.ndarray],
    step: Step,
    parsed: Mapping[str, Payload] | None = None,
) -> dict[str, np.ndarray]:
    """The replica after ``step`` (the client's half; the server moves x_hat with the
    same :func:`move`, so both are bit-identical). ``parsed``: the step's payloads
    already parsed and checked (:func:`check_step_payloads`).

    Raises
    ------
    ReplicaError
        When the step names other tensors than the replica's, or a payload does not fit.
    """
    if set(step.payloads) != set(arrays):
        raise ReplicaError("the step's tensors are not the replica's")
    out = {}
    for name, current in arrays.items():
        if parsed is None:
            value, raw = decode_payload_for(name, step.payloads[name], current)
        else:
            value, raw = decode_parsed(name, parsed[name], current)
        out[name] = move(current, value, raw, step.scales.get(name, 1.0))
    return out


# --- what a client checks before decoding a step (the server may be hostile) ----------


def check_chain(steps: Sequence[Step], target: int) -> None:
    """The steps' versions: at most :data:`MAX_STEPS`, each from a version to a later
    one, each starting where the previous one ended, the last at ``target``.

    Raises
    ------
    ReplicaError
        Naming the first step that breaks a rule.
    """
    if len(steps) > MAX_STEPS:
        raise ReplicaError(f"{len(steps)} steps in one instruction, at most {MAX_STEPS} allowed")
    for step in steps:
        if not 0 <= step.source < step.target:
            raise ReplicaError(
                f"a step from version {step.source} to {step.target}: versions must increase"
            )
    for previous, step in itertools.pairwise(steps):
        if step.source != previous.target:
            raise ReplicaError(
                f"the step to version {step.target} starts at {step.source}, "
                f"the step before it ends at {previous.target}"
            )
    if steps and steps[-1].target != target:
        last = steps[-1].target
        raise ReplicaError(f"the steps end at version {last}, the server is at {target}")


def check_step_bytes(steps: Sequence[Step], arrays: Mapping[str, np.ndarray]) -> None:
    """The steps together weigh at most the dense model, decompressed (the server's
    own rule: it sends x_hat in full instead), so reading them costs less than the
    model.

    Raises
    ------
    ReplicaError
        Naming both sizes.
    """
    total, dense = sum(s.nbytes for s in steps), sum(a.nbytes for a in arrays.values())
    if total > dense:
        raise ReplicaError(f"the steps weigh {total} bytes, more than the {dense}-byte model")


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def check_step_payload(
    name: str, payload: bytes, current: np.ndarray, codec: Codec, raw: bool
) -> Payload:
    """Parse one step payload and check it against what the server builds for this
    tensor, before anything is decoded: the tensor's exact value (``raw``: the policy
    sends it raw), else a float32 difference encoded by ``codec``, its parameters and
    inner codecs included (``codec.check_payload``: a nested payload the spec does not
    build is refused here). At most :func:`max_inner_size` bytes.

    Raises
    ------
    ReplicaError
        Naming the tensor and what differs.
    """
    bound = max_inner_size(current.size, current.ndim)
    if len(payload) > bound:
        raise ReplicaError(f"{name}: a {len(payload)}-byte payload, at most {bound} for the tensor")
    try:
        parsed = parse_payload(payload, current.size)
        header = parsed.header
        if header.shape != current.shape:
            raise ValueError(f"payload shape {header.shape} != {current.shape}")
        want = _torch_dtype(current.dtype) if raw else torch.float32
        if header.dtype != want:
            raise ValueError(f"payload dtype {header.dtype}, the server sends {want}")
        (_RAW if raw else codec).check_payload(parsed)
    except (ValueError, TypeError) as exc:
        raise ReplicaError(f"{name}: {exc}") from exc
    return parsed


def check_step_payloads(
    step: Step, arrays: Mapping[str, np.ndarray], codec: Codec, policy: TensorPolicy
) -> dict[str, Payload]:
    """Every payload and scale of one step checked (:func:`check_step_payload`); the
    payloads parsed, by tensor.

    Raises
    ------
    ReplicaError
        When the step's tensors or scales are not the replica's, or a payload fails.
    """
    if set(step.payloads) != set(arrays):
        raise ReplicaError(f"the step to version {step.target} has other tensors than the model")
    for name, scale in step.scales.items():
        if name not in arrays or not math.isfinite(scale):
            raise ReplicaError(f"step to version {step.target}: scale {name!r}={scale!r}")
    return {
        name: check_step_payload(
            name,
            step.payloads[name],
            current,
            codec,
            policy.travels_raw(current.dtype.kind == "f", current.shape, codec, current.itemsize),
        )
        for name, current in arrays.items()
    }


def contraction_scale(difference: np.ndarray, decoded: np.ndarray) -> float:
    """The scale a of the decoded difference q that leaves the least error,
    a = <d, q> / ||q||^2 (clipped at 0): ||d - a q||^2 = ||d||^2 - <d, q>^2 / ||q||^2
    never exceeds ||d||^2, so error feedback contracts with any codec, including
    unbiased ones whose noise exceeds the signal (stochastic 1-bit: omega >> 1)."""
    d, q = difference.astype(np.float64).ravel(), decoded.astype(np.float64).ravel()
    qq = float(q @ q)
    return max(float(d @ q) / qq, 0.0) if qq > 0 else 1.0


def wire_scale(value: float) -> float:
    """A step's scale as both sides apply it: rounded to float32, so the instruction can
    carry its shortest float32 form (:func:`scale_text`) and the client, rounding what
    it reads the same way, moves its replica bit for bit as the server did."""
    return float(np.float32(value))


def scale_text(value: float) -> float:
    """The shortest number that rounds to the float32 ``value`` (about 9 digits in JSON,
    not 17)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="0"))


def encode_step(
    values: Mapping[str, np.ndarray],
    differences: Mapping[str, np.ndarray],
    codec: Codec,
    policy: TensorPolicy,
    *,
    seed_parts: tuple[int, int],
) -> dict[str, bytes]:
    """One step's payloads: tensors the policy sends raw as their exact new
    ``values``, the rest as ``codec`` of their ``differences``, seeded from (run seed,
    purpose, target version, tensor)."""
    run_seed, version = seed_parts
    payloads = {}
    for name, value in values.items():
        value = np.asarray(value)
        if policy.travels_raw(value.dtype.kind == "f", value.shape, codec, value.itemsize):
            payloads[name] = bytes(_RAW.encode(torch.from_numpy(np.array(value)), seed=0))
            continue
        diff = torch.from_numpy(np.asarray(differences[name], dtype=np.float32))
        seed = derive_seed(run_seed, SEED_PURPOSE, version, name)
        payloads[name] = bytes(codec.encode(diff, seed=seed))
    return payloads


def step_headers(held: Mapping[str, np.ndarray], run_seed: int) -> HeaderRule:
    """The client's rule for the compact entries of a step bundle (fedcomp.compact):
    entry "<target>/<tensor>" was :func:`encode_step`'s payload for that tensor, raw in
    the tensor's dtype or the codec's float32 difference, seeded from the target."""

    def rule(name: str, codec_id: int, seeded: bool) -> PayloadHeader:
        target, _, tensor = name.partition("/")
        current = held.get(tensor)
        if current is None or not target.isdigit():
            raise ValueError(f"entry {name!r:.80} is not '<target>/<tensor>' of the model")
        raw = codec_id == _RAW.codec_id
        dtype = _torch_dtype(current.dtype) if raw else torch.float32
        seed = derive_seed(run_seed, SEED_PURPOSE, int(target), tensor) if seeded else 0
        return PayloadHeader(codec_id, dtype, tuple(current.shape), seed)

    return rule


# --- server half ----------------------------------------------------------------------


class BroadcastServer:
    """The server's replica ``x_hat``, its step history, and what each client holds.

    The history is bounded by bytes: at most one full model's worth (older steps would
    never be cheaper than sending x_hat itself).
    """

    def __init__(self, spec: DownlinkSpec, policy: TensorPolicy, run_seed: int) -> None:
        self.spec = spec
        self.codec = spec.build()
        self.policy = policy
        self.run_seed = run_seed
        self.x_hat: dict[str, np.ndarray] | None = None
        #: memory="none" only: the global model the last step was computed from.
        self.previous: dict[str, np.ndarray] | None = None
        self.version = 0
        self.checksum = ""
        self.history: deque[Step] = deque()
        #: The version each client (stable id) confirmed holding; absent: unknown.
        self.confirmed: dict[int, int] = {}
        #: Clients to send x_hat in full next (an error reply since their last
        #: confirmation): never the seeded version 0 again.
        self.full_next: set[int] = set()
        #: Checksum of version 0, the initial model (what a seeded client checks).
        self.initial_checksum = ""

    def start(self, initial: Mapping[str, np.ndarray]) -> None:
        """Version 0 is the initial model, exactly (a no-op once started)."""
        if self.x_hat is None:
            self.x_hat = {k: np.array(v) for k, v in initial.items()}
            if self.spec.memory == "none":
                self.previous = {k: np.array(v) for k, v in initial.items()}
            self.checksum = checksum(self.x_hat)
            self.initial_checksum = self.checksum

    @property
    def full_nbytes(self) -> int:
        return sum(a.nbytes for a in (self.x_hat or {}).values())

    def advance(self, x_t: Mapping[str, np.ndarray]) -> Step:
        """Encode one step toward the new global model and move x_hat by it."""
        if self.x_hat is None:
            raise RuntimeError("BroadcastServer.advance before start")
        # Error feedback: what x_hat lacks of x_t. None: the global update alone.
        base = self.x_hat if self.spec.memory == "error_feedback" else self.previous
        differences = {
            k: np.asarray(x_t[k], dtype=np.float32) - np.asarray(base[k], dtype=np.float32)
            for k in x_t
        }
        payloads = encode_step(
            x_t, differences, self.codec, self.policy, seed_parts=(self.run_seed, self.version + 1)
        )
        scales, x_hat = {}, {}
        for name, current in self.x_hat.items():  # each payload decoded once
            value, raw = decode_payload_for(name, payloads[name], current)
            if not raw and self.spec.memory == "error_feedback":
                scales[name] = wire_scale(contraction_scale(differences[name], value))
            x_hat[name] = move(current, value, raw, scales.get(name, 1.0))
        step = Step(self.version, self.version + 1, payloads, checksum(x_hat), scales)
        self.x_hat, self.version, self.checksum = x_hat, step.target, step.checksum
        if self.spec.memory == "none":  # only the direct scheme needs x_{t-1}
            self.previous = {k: np.array(v) for k, v in x_t.items()}
        self.history.append(step)
        while sum(s.nbytes for s in self.history) > self.full_nbytes and self.history:
            self.history.popleft()
        return step

    def steps_for(self, client: int) -> list[Step] | None:
        """The steps that bring ``client`` to the current version ([] if current), or
        None when it must receive x_hat in full (no known replica, history too short,
        more than :data:`MAX_STEPS` steps, or steps that would weigh more than the
        model)."""
        have = self.confirmed.get(client)
        if have is None and self.spec.initial == "seeded" and client not in self.full_next:
            have = 0  # it builds version 0 itself: the steps from there, if cheaper
        if have is None or have > self.version:
            return None
        if have == self.version:
            return []
        steps = [s for s in self.history if s.source >= have]
        if not steps or steps[0].source != have:
            return None
        if sum(s.nbytes for s in steps) >= self.full_nbytes or len(steps) > MAX_STEPS:
            return None
        return steps

    def confirm(self, client: int, version: int, digest: str) -> bool:
        """Record the version a reply says its client holds (true when it is one the
        server can vouch for: the current one, or one in the history)."""
        known = {self.version: self.checksum, **{s.target: s.checksum for s in self.history}}
        if known.get(version) == digest:
            self.confirmed[client] = version
            self.full_next.discard(client)
            return True
        self.confirmed.pop(client, None)
        return False

    def forget(self, client: int) -> None:
        """The client's replica is unknown (an error reply): send x_hat in full next."""
        self.confirmed.pop(client, None)
        self.full_next.add(client)

    def drift(self, x_t: Mapping[str, np.ndarray]) -> float:
        """||x_hat - x_t|| / ||x_t|| over the floating-point tensors."""
        num = den = 0.0
        for name, value in x_t.items():
            value = np.asarray(value)
            if value.dtype.kind != "f" or self.x_hat is None:
                continue
            num += float(np.sum((self.x_hat[name].astype(np.float64) - value) ** 2))
            den += float(np.sum(value.astype(np.float64) ** 2))
        return float(np.sqrt(num / den)) if den > 0 else 0.0

    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint: x_hat, the previous model, versions, history."""
        return {
            "x_hat": None if self.x_hat is None else {k: v.copy() for k, v in self.x_hat.items()},
            "previous": None
            if self.previous is None
            else {k: v.copy() for k, v in self.previous.items()},
            "version": self.version,
            "checksum": self.checksum,
            "history": [
                (s.source, s.target, dict(s.payloads), s.checksum, dict(s.scales))
                for s in self.history
            ],
            "confirmed": dict(self.confirmed),
            "initial_checksum": self.initial_checksum,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.x_hat = state["x_hat"]
        self.previous = state["previous"]
        self.version = int(state["version"])
        self.checksum = str(state["checksum"])
        self.history = deque(Step(a, b, dict(p), c, dict(f)) for a, b, p, c, f in state["history"])
        self.confirmed = {int(k): int(v) for k, v in state["confirmed"].items()}
        self.initial_checksum = str(state["initial_checksum"])


# --- client half ----------------------------------------------------------------------


@dataclass
class Replica:
    """A client's copy of x_hat at a version (absent arrays: no replica yet)."""

    arrays: dict[str, np.ndarray] | None = None
    version: int = -1
    checksum: str = ""

    def take_full(self, arrays: Mapping[str, np.ndarray], version: int, digest: str) -> Replica:
        """The replica sent in full (checked against its checksum)."""
        copy = {k: np.array(v) for k, v in arrays.items()}
        if checksum(copy) != digest:
            raise ReplicaError(f"the full model of version {version} fails its checksum")
        return Replica(copy, version, digest)

    def take_steps(
        self,
        steps: Sequence[Step],
        target: int,
        digest: str,
        *,
        codec: Codec | None = None,
        policy: TensorPolicy | None = None,
    ) -> Replica:
        """The replica after the steps it has not applied yet; checked against the
        checksum of the target version. Never modifies ``self``.

        Before anything is decoded: the versions chain (:func:`check_chain`), the steps
        weigh at most the model (:func:`check_step_bytes`) and, with the downlink
        ``codec`` the server was configured with, every payload is what it builds
        (:func:`check_step_payloads`, tensors sent raw by ``policy``). Each step is then
        decoded once: the cost is at most :data:`MAX_STEPS` decodes of the model.

        Raises
        ------
        ReplicaError
            No replica, steps that break a check above, a version the steps do not
            start from, or a checksum mismatch.
        """
        if self.arrays is None:
            raise ReplicaError("no replica here (new, wiped or restarted): send the model")
        check_chain(steps, target)
        check_step_bytes(steps, self.arrays)
        rules = policy or TensorPolicy()
        parsed = [
            None if codec is None else check_step_payloads(s, self.arrays, codec, rules)
            for s in steps
        ]
        arrays, version = self.arrays, self.version
        for step, payloads in zip(steps, parsed, strict=True):
            if step.target <= version:
                continue  # applied already (its reply was lost)
            if step.source != version:
                raise ReplicaError(f"replica at version {version}, steps start at {step.source}")
            arrays, version = apply_step(arrays, step, payloads), step.target
        if version != target:
            raise ReplicaError(f"replica at version {version}, the server is at {target}")
        got = checksum(arrays)
        if got != digest:
            raise ReplicaError(
                f"replica checksum {got} != server's {digest} at version {target}: not trained on"
            )
        return Replica(dict(arrays), version, got)
