"""The compression mod: encodes a ClientApp's train reply as packed payloads.

Add it to any ClientApp whose train handler replies with one ArrayRecord (the
trained model) and one MetricRecord holding ``num-examples``::

    from fedcomp.flower.mod import CompressionMod
    app = ClientApp(mods=[CompressionMod()])

On the server, wrap the strategy with ``fedcomp.flower.strategy.CompressedStrategy``:
it sends the codec spec this mod needs (``KEY_CODEC``); without it the mod answers
with an Error naming the wrapper, as Flower's central-DP mods do.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    RecordDict,
)
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode

from fedcomp.codecs import (
    TensorPolicy,
    make_codec,
    make_codec_from_spec,
)
from fedcomp.downlink import Replica, ReplicaError, parse_downlink
from fedcomp.flower.encoding import (
    Instruction,
    encode_update,
    only_record,
    reply_metrics,
    trained_update,
)
from fedcomp.flower.families import family_of
from fedcomp.flower.identity import identity_reply, is_identity_message, stable_id_of
from fedcomp.flower.memory_state import (
    MemoryState,
    load_memory,
    load_memory_file,
    memory_path,
    save_memory_file,
    store_memory,
)
from fedcomp.flower.packed import PackError, open_instruction, pack_into
from fedcomp.flower.replica import (
    downlink_config,
    load_replica,
    rebuild_model,
    replica_header,
    store_replica,
)
from fedcomp.flower.reply_format import reply_content
from fedcomp.flower.shared_settings import SHARED_KEYS
from fedcomp.flower.shared_settings import restore as restore_settings
from fedcomp.keys import (
    KEY_CODEC,
    KEY_DOWNLINK,
    KEY_EXPECTED_ID,
    KEY_HANDLES,
    KEY_POLICY,
    KEY_PROTOCOL,
    KEY_ROUND,
    KEY_RUN_SEED,
    KEY_SETTINGS,
    KEY_STABLE_ID,
    PROTOCOL_VERSION,
    RECORD_HEADER,
)

_WRAPPER = "fedcomp.flower.strategy.CompressedStrategy"
#: Longest error reason a failed instruction's reply carries (the exception's text may
#: quote fields of a hostile instruction).
MAX_REASON = 500
_log = logging.getLogger(__name__)
#: The message kinds this mod handles (it rebuilds train and evaluate instructions).
HANDLES = f"{MessageType.TRAIN},{MessageType.EVALUATE}"


def _as_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: np.asarray(v.numpy()) for k, v in record.items()}


def _names_any(msg: Message, keys: Iterable[str]) -> bool:
    """Whether any config record of the message holds one of ``keys``."""
    keys = tuple(keys)
    return any(k in c for c in msg.content.config_records.values() for k in keys)


def _from_wrapper(msg: Message) -> bool:
    """True when the instruction carries fields of fedcomp's strategy wrapper."""
    return _names_any(msg, (KEY_SETTINGS, KEY_DOWNLINK))


def _holdings_header(digest: str | None, replica: Replica | None, declare: bool) -> dict[str, Any]:
    """Reply header fields saying what this client holds: the downlink replica (when
    the server uses one), and, in the reply to an instruction that carried the run
    settings in full (``declare``), their digest and the message kinds this mod
    handles: the server needs them once, and again only after a client lost them,
    which it answers with an error (the server then sends the settings in full)."""
    if digest is None:
        return {}
    out = replica_header(replica) if replica is not None else {}
    if declare:
        out.update({KEY_HANDLES: HANDLES, KEY_SETTINGS: digest})
    return out


def _carries_settings(msg: Message) -> bool:
    """Whether the instruction carries the run settings in full (not only their digest)."""
    return _names_any(msg, SHARED_KEYS)


def _precondition_error(msg: Message, reason: str) -> Message:
    return Message(
        Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason[:MAX_REASON]), reply_to=msg
    )


class _AppCall:
    """``call_next`` noting what the app (and the mods inside this one) did: its
    exceptions and error replies are its own, passed on unchanged."""

    def __init__(self, call_next: ClientAppCallable) -> None:
        self.call_next = call_next
        self.called = self.raised = False

    def __call__(self, msg: Message, ctxt: Context) -> Message:
        self.called = True
        try:
            return self.call_next(msg, ctxt)
        except BaseException:
            self.raised = True
            raise


def _restore_state(state: RecordDict, saved: dict[str, Any]) -> None:
    """Put Context.state back as it was (the mod replaces its records, never changes
    one in place, so the records themselves are the snapshot)."""
    for key in [k for k in state if k not in saved]:
        del state[key]
    for key, record in saved.items():
        if state.get(key) is not record:
            state[key] = record


class CompressionMod:
    """Flower mod that replaces a train reply's model with encoded updates.

    Parameters
    ----------
    policy : TensorPolicy, optional
        Which tensors travel raw (integer buffers, tensors below a size threshold).
    measure_error : bool (default: True)
        Report the codec's relative error sum ||decode(q) - x||^2 / sum ||x||^2 over
        the encoded tensors (costs one decode).
    state_dir : str or callable, optional
        Also keep the codec memory (error-feedback error, residual control variate) in
        ``<state_dir>/client-<stable id>.npz``, written atomically after every reply and
        read when ``Context.state`` has none: the memory survives a device restart (or
        a resumed simulation) instead of being resynced. A callable gets the instruction
        and returns the directory (or None).
    state_in_context : bool or callable (default: True)
        False keeps the codec memory and the downlink replica ONLY in ``state_dir``:
        ``Context.state`` holds none of it, which bounds the simulation driver's memory
        (it keeps every node's Context.state) at the cost of a file read and write per
        instruction. A callable gets the instruction.
    initial_model : callable, optional
        Builds the run's initial model (the ArrayRecord the server started from) from
        the instruction, e.g. from the seed in the app's run config: with the server's
        ``downlink.initial="seeded"`` a client with no replica then receives only the
        downlink steps since round 1, not the model (a checksum verifies the result).
    downlink : Mapping, optional
        The one downlink codec spec this client decodes, e.g. ``{"name": "uniform",
        "bits": 4}`` (the server's ``downlink`` without ``memory``); an instruction
        naming another is refused. Without it the client decodes the stateless codec
        the server names, each instruction bounded to at most the model's bytes
        (decompressed) and 16 steps (docs/downlink.md).
    """

    def __init__(
        self,
        policy: TensorPolicy | None = None,
        *,
        measure_error: bool = True,
        state_dir: str | Callable[[Message], str | None] | None = None,
        state_in_context: bool | Callable[[Message], bool] = True,
        initial_model: Callable[[Message], ArrayRecord] | None = None,
        downlink: Mapping[str, Any] | None = None,
    ) -> None:
        if state_in_context is False and state_dir is None:
            raise ValueError("CompressionMod: state_in_context=False needs a state_dir")
        self.policy = policy or TensorPolicy()
        self.state_dir = state_dir
        self.state_in_context = state_in_context
        self.initial_model = initial_model
        #: The one downlink codec this client decodes (None: whatever the server
        #: names, each instruction bounded in cost: docs/downlink.md).
        self.downlink = None if downlink is None else parse_downlink(downlink).codec
        self.measure_error = measure_error
        self._fp32 = make_codec("fp32")
        #: The last codec spec read and the codec built from it: a run sends the same
        #: spec every round, so it is parsed and checked once.
        self._codec: tuple[str, Any] | None = None

    def __call__(self, msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
        kind = msg.metadata.message_type
        if kind not in (MessageType.TRAIN, MessageType.EVALUATE):
            return call_next(msg, ctxt)
        try:  # fedcomp's fields travel packed (fedcomp.flower.packed): entries again, here
            open_instruction(msg)
        except PackError as exc:
            return _precondition_error(msg, f"CompressionMod: packed fields: {exc}")
        if kind == MessageType.EVALUATE and not _from_wrapper(msg):
            return call_next(msg, ctxt)  # not fedcomp's: untouched
        app = _AppCall(call_next)
        saved = dict(ctxt.state.items())
        try:
            reply = self._handle(msg, ctxt, app)
        except Exception as exc:  # any failure of the mod itself is an error reply
            if app.raised:
                raise  # the app's own exception: Flower's error reply, as without the mod
            reason = f"CompressionMod: {type(exc).__name__}: {exc}"[:MAX_REASON]
            # a traceback for what no check raised on purpose (a bug, or memory)
            _log.warning("%s", reason, exc_info=not isinstance(exc, ValueError))
            if app.called:  # encoding the reply failed: the app ran, on the right model
                code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            else:  # the instruction could not be taken: nothing of it is kept
                _restore_state(ctxt.state, saved)
                code = ErrorCode.MOD_FAILED_PRECONDITION
            return Message(Error(code=code, reason=reason), reply_to=msg)
        if reply.has_error() and not app.called:  # a precondition failed: nothing kept
            _restore_state(ctxt.state, saved)
        return reply

    def _handle(self, msg: Message, ctxt: Context, call_next: _AppCall) -> Message:
        """One train or evaluate instruction of fedcomp's wrapper. :meth:`__call__`
        turns any exception of the mod here into an error reply (RecursionError and
        MemoryError included); a failure before the app runs leaves Context.state as
        it was."""
        if is_identity_message(msg):  # first contact: answered here, no training
            return identity_reply(msg, ctxt, HANDLES)
        holdings = self._settings_and_replica(msg, ctxt)
        if isinstance(holdings, Message):  # a precondition failed: an error reply
            return holdings
        if msg.metadata.message_type == MessageType.EVALUATE:
            return self._evaluate(msg, ctxt, call_next, holdings)
        return self._train(msg, ctxt, call_next, holdings)

    def _settings_and_replica(self, msg: Message, ctxt: Context) -> dict[str, Any] | Message:
        """What every instruction needs before the app runs: the run settings (restored
        when it carries only their digest), a place for the client's state, and the
        downlink replica brought up to date. Returns the reply header fields saying
        what this client holds, or an error reply."""
        declare = _carries_settings(msg)  # before restoring fills the config in
        try:
            digest = restore_settings(msg.content, ctxt.state)
        except ValueError as exc:
            return _precondition_error(msg, f"CompressionMod: {exc}")
        if not self._in_context(msg) and not self._state_dir(msg):  # on the restored config
            return _precondition_error(
                msg, "CompressionMod: state kept out of Context.state needs a state_dir"
            )
        replica = self._take_downlink(msg, ctxt)
        if isinstance(replica, Message):  # the replica cannot be brought up to date
            return replica
        return _holdings_header(digest, replica, declare)

    def _train(
        self, msg: Message, ctxt: Context, call_next: _AppCall, holdings: dict[str, Any]
    ) -> Message:
        """A train instruction: the app trains, its update is encoded (staging the
        codec's memory), and the reply carries the payloads; the memory is kept last."""
        instruction = self._read_instruction(msg, ctxt)
        if isinstance(instruction, Message):  # a precondition failed: an error reply
            return instruction
        reply = call_next(msg, ctxt)
        if reply.has_error():
            return reply
        deltas, metrics = trained_update(reply, instruction.global_record)
        t0 = time.perf_counter()
        encoded = encode_update(
            instruction, deltas, lambda: self._load_memory(msg, ctxt), fp32=self._fp32
        )
        encode_s = time.perf_counter() - t0
        if encoded.memory is not None:
            encoded.memory.stage(instruction.round, encoded.pending, encoded.pending_version)
        out_metrics = reply_metrics(
            metrics,
            encoded,
            instruction,
            deltas,
            encode_s,
            measure_error=self.measure_error,
        )
        header = {
            KEY_STABLE_ID: instruction.stable_id,
            KEY_PROTOCOL: PROTOCOL_VERSION,
            KEY_ROUND: instruction.round,
            **encoded.header,
            **holdings,
        }
        content = reply_content(header, encoded.payloads, out_metrics)
        reply = Message(content, reply_to=msg)
        if encoded.memory is not None:  # last: nothing after this can fail
            self._keep_memory(msg, ctxt, instruction.stable_id, encoded.memory)
        return reply

    def _keep_memory(
        self, msg: Message, ctxt: Context, stable_id: int, memory: MemoryState
    ) -> None:
        """The staged memory into Context.state and/or its file, as the run config says."""
        directory = self._state_dir(msg)
        if self._in_context(msg):
            store_memory(ctxt.state, memory)
        if directory:
            save_memory_file(memory_path(directory, stable_id), memory)

    def _take_downlink(self, msg: Message, ctxt: Context) -> Replica | Message | None:
        """Bring this client's replica up to the server's x_hat and put the model into
        ``msg`` (fedcomp.flower.replica); None when the instruction has no downlink
        replica, an error reply (never trained on) when it cannot be done."""
        if downlink_config(msg.content) is None:
            return None
        try:
            path = self._replica_path(msg, ctxt)
            build = self.initial_model
            initial = (lambda: _as_numpy(build(msg))) if build is not None else None
            config = downlink_config(msg.content)
            policy = self._policy(config) if config is not None else self.policy
            replica = rebuild_model(
                msg, load_replica(ctxt.state, path), initial, policy, accept=self.downlink
            )
            store_replica(ctxt.state if self._in_context(msg) else None, replica, path)
        except (ReplicaError, ValueError, KeyError, TypeError) as exc:
            return _precondition_error(msg, f"CompressionMod: downlink replica: {exc}")
        return replica

    def _replica_path(self, msg: Message, ctxt: Context) -> Path | None:
        directory = self._state_dir(msg)
        if not directory:
            return None
        return Path(directory) / f"replica-{stable_id_of(ctxt):06d}.npz"

    @staticmethod
    def _evaluate(
        msg: Message, ctxt: Context, call_next: ClientAppCallable, holdings: dict[str, Any]
    ) -> Message:
        """Evaluate instructions: the app's handler on the restored config and the
        rebuilt model; the reply header says what this client holds."""
        reply = call_next(msg, ctxt)
        if _names_any(msg, (KEY_SETTINGS,)) and not reply.has_error():
            header = {KEY_STABLE_ID: stable_id_of(ctxt), **holdings}
            record = ConfigRecord(header)
            pack_into(record)  # fedcomp.flower.packed, as in train replies
            reply.content[RECORD_HEADER] = record
        return reply

    def _read_instruction(self, msg: Message, ctxt: Context) -> Instruction | Message:
        """Everything the reply needs from the instruction, checked BEFORE training (a
        bad instruction must not cost a round of local work); an error reply if not."""
        config = next((c for c in msg.content.config_records.values() if KEY_CODEC in c), None)
        if config is None:
            return _precondition_error(
                msg,
                f"CompressionMod: the train instruction has no '{KEY_CODEC}' config; "
                f"wrap the server strategy with {_WRAPPER}.",
            )
        if int(config.get(KEY_PROTOCOL, -1)) != PROTOCOL_VERSION:
            return _precondition_error(
                msg,
                f"CompressionMod: server protocol {config.get(KEY_PROTOCOL)!r}, "
                f"this client speaks {PROTOCOL_VERSION}",
            )
        try:
            codec = self._codec_of(str(config[KEY_CODEC]))
            stable_id = stable_id_of(ctxt)
            policy = self._policy(config)
        except (ValueError, TypeError) as exc:
            return _precondition_error(msg, f"CompressionMod: {exc}")
        expected = config.get(KEY_EXPECTED_ID)
        if expected is not None and int(expected) != stable_id:
            return _precondition_error(
                msg,
                f"CompressionMod: server expected stable id {expected}, this node is {stable_id}",
            )
        _, global_record = only_record(
            msg.content.array_records, "ArrayRecord", "train instruction"
        )
        try:  # the round's public plan, for families that have one (the joint code)
            plan = family_of(codec).read_plan(policy, config, global_record)
        except (ValueError, TypeError) as exc:
            return _precondition_error(msg, f"CompressionMod: {exc}")
        return Instruction(
            config=config,
            codec=codec,
            policy=policy,
            stable_id=stable_id,
            round=int(config[KEY_ROUND]),
            run_seed=int(config[KEY_RUN_SEED]),
            global_record=global_record,
            plan=plan,
        )

    def _codec_of(self, spec: str) -> Any:
        """The codec a JSON spec names (the last one is kept: specs do not change
        within a run, and codecs hold no state of their own)."""
        if self._codec is None or self._codec[0] != spec:
            self._codec = (spec, make_codec_from_spec(json.loads(spec)))
        return self._codec[1]

    def _state_dir(self, msg: Message) -> str | None:
        return self.state_dir(msg) if callable(self.state_dir) else self.state_dir

    def _in_context(self, msg: Message) -> bool:
        """Whether Context.state keeps the memory and replica (else only the files)."""
        keep = self.state_in_context
        return bool(keep(msg)) if callable(keep) else keep

    def _load_memory(self, msg: Message, ctxt: Context) -> MemoryState:
        """The memory in Context.state, else the one on disk (a restarted client)."""
        memory = load_memory(ctxt.state)
        directory = self._state_dir(msg)
        if directory and not memory.spec:
            saved = load_memory_file(memory_path(directory, stable_id_of(ctxt)))
            if saved is not None:
                return saved
        return memory

    def _policy(self, config: ConfigRecord) -> TensorPolicy:
        if KEY_POLICY not in config:
            return self.policy
        return TensorPolicy(**json.loads(str(config[KEY_POLICY])))
