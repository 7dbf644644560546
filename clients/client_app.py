"""The project's example ClientApp: local training on one partition, compressed replies.

``make_client_app()`` builds it (simulation uses the factory directly); the
module-level ``app`` is what ``flwr run`` and the Deployment Engine load. Every
setting it needs arrives in the message config (``KEY_TASK``), never in globals,
except the paths it reads and writes: those are the client's own (clients.paths:
the node config, or the ``paths`` given to the factory), whatever the task says.
"""

from __future__ import annotations

import json
import logging
from contextvars import ContextVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable, Mod

from clients.faults import FaultMod, NaNFaultMod
from clients.paths import ClientPaths, resolve, task_paths, with_paths
from fedcomp.codecs import TensorPolicy
from fedcomp.data import ArrayDataset, client_datasets
from fedcomp.diagnostics import write_update
from fedcomp.flower.identity import partition_id_of, stable_id_of
from fedcomp.flower.mod import CompressionMod
from fedcomp.flower.packed import PackError, open_instruction
from fedcomp.keys import (
    KEY_NUM_EXAMPLES,
    KEY_ROUND,
    KEY_TASK,
    METRIC_PRE_TRAIN_ACCURACY,
    METRIC_PRE_TRAIN_EXAMPLES,
    METRIC_PRE_TRAIN_LOSS,
    RECORD_METRICS,
)
from fedcomp.models import build_model
from fedcomp.perturb import perturb_update
from fedcomp.rng import torch_generator
from fedcomp.settings import Settings, settings_from_dict, validate
from fedcomp.training import evaluate, select_device, train_local

#: Metric names of the client-side evaluation (aggregated by the strategy).
METRIC_EVAL_LOSS = "eval_loss"
METRIC_EVAL_ACC = "eval_acc"
METRIC_TRAIN_LOSS = "train_loss"

log = logging.getLogger(__name__)

#: The paths of the message being handled, set by LocalPathsMod around the call
#: (CompressionMod's state_dir hook sees the message only, not the node config).
_NO_PATHS = ClientPaths()  # frozen: a shared default is safe
_PATHS: ContextVar[ClientPaths] = ContextVar("fedcomp_client_paths", default=_NO_PATHS)


class LocalPathsMod:
    """Outermost mod: the client's own paths (its node config over the factory's
    ``paths``) for the duration of one message; the task's paths are ignored, with a
    warning the first time a task names one that differs."""

    def __init__(self, paths: ClientPaths | None = None) -> None:
        self.paths = paths or ClientPaths()
        self._warned = False

    def __call__(self, msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
        paths = resolve(ctxt.node_config, self.paths)
        self._warn_once(msg, paths)
        token = _PATHS.set(paths)
        try:
            return call_next(msg, ctxt)
        finally:
            _PATHS.reset(token)

    def _warn_once(self, msg: Message, paths: ClientPaths) -> None:
        try:  # outside the compression mod: its fields may still be packed
            open_instruction(msg)
        except PackError:
            return  # the compression mod answers it with an error
        config = _task_config(msg)
        if self._warned or config is None:
            return
        try:
            tree = json.loads(str(config[KEY_TASK]))
        except ValueError:
            return  # a malformed task fails in _task, naming it
        own = task_paths(with_paths(tree, paths)) if isinstance(tree, dict) else {}
        named = task_paths(tree) if isinstance(tree, dict) else {}
        ignored = {k: v for k, v in named.items() if own.get(k) != v}
        if ignored:
            self._warned = True
            log.warning(
                "the server's task names client paths (%s); ignored: this client reads and "
                "writes only the paths of its own node config (data-path, client-state-dir, "
                "diagnostics-dir) or local settings",
                ", ".join(f"{k}={v!r}" for k, v in sorted(ignored.items())),
            )


def _task_config(msg: Message) -> ConfigRecord | None:
    return next((c for c in msg.content.config_records.values() if KEY_TASK in c), None)


def _task(msg: Message) -> Settings:
    """The task's settings with the paths replaced by this client's own."""
    config = _task_config(msg)
    if config is None:
        raise ValueError(
            f"instruction has no '{KEY_TASK}' config: this ClientApp is driven by "
            "fedcomp.flower.strategy.CompressedStrategy"
        )
    tree = json.loads(str(config[KEY_TASK]))
    if not isinstance(tree, dict):
        raise ValueError(f"the '{KEY_TASK}' config is not a settings object: {tree!r:.80}")
    return validate(settings_from_dict(with_paths(tree, _PATHS.get())))


def _round(msg: Message) -> int:
    config = next((c for c in msg.content.config_records.values() if KEY_ROUND in c), None)
    return int(config[KEY_ROUND]) if config is not None else 0


def _model_from(msg: Message, task: Settings) -> torch.nn.Module:
    arrays = next(iter(msg.content.array_records.values()))
    model = build_model(task.model, task.dataset.name, task.seed)
    model.load_state_dict(arrays.to_torch_state_dict())
    return model


def _client_state_dir(msg: Message) -> str | None:
    """Where this client keeps its codec memories on disk: its own client-state-dir,
    never the task's (``msg`` is unused: CompressionMod's hook signature)."""
    del msg
    return _PATHS.get().state_dir or None


def _client_state_in_context(msg: Message) -> bool:
    """Whether the codec memory and replica stay in Context.state (settings.client_state
    is "memory") or only in client_state_dir ("disk")."""
    config = _task_config(msg)
    if config is None:
        return True
    return json.loads(str(config[KEY_TASK])).get("client_state", "memory") != "disk"


def _initial_model(msg: Message) -> ArrayRecord:
    """The run's initial model, built from the task's seed exactly as the ServerApp
    builds it (downlink.initial=seeded: version 0 of the replica is never sent)."""
    task = _task(msg)
    model = build_model(task.model, task.dataset.name, task.seed)
    with torch.no_grad():
        return ArrayRecord(model.state_dict())


def evaluation_split(train_set: ArrayDataset, val_set: ArrayDataset) -> ArrayDataset:
    """The client's local evaluation data: its validation split, or its training data
    when the partition has none (partition.val_fraction=0)."""
    return val_set if len(val_set) > 0 else train_set


def pre_train_metrics(
    model: torch.nn.Module, data: ArrayDataset, device: torch.device | str = "cpu"
) -> dict[str, float | int]:
    """The received model's accuracy, mean loss and example count on ``data``, under
    the names the server's wrapper reads (settings.evaluate_in_train)."""
    loss, acc = evaluate(model, data, device=device)
    return {
        METRIC_PRE_TRAIN_ACCURACY: acc,
        METRIC_PRE_TRAIN_LOSS: loss,
        METRIC_PRE_TRAIN_EXAMPLES: len(data),
    }


def _write_diagnostics(
    directory: str, msg: Message, stable_id: int, num_examples: int, model: torch.nn.Module
) -> None:
    """The exact update (trained model minus the model received), outside the message."""
    start = next(iter(msg.content.array_records.values()))
    write_update(
        directory,
        _round(msg),
        stable_id,
        num_examples,
        {
            k: v.detach().cpu().double().numpy() - np.asarray(start[k].numpy())
            for k, v in model.state_dict().items()
        },
    )


def make_client_app(
    policy: TensorPolicy | None = None,
    inner_mods: list[Mod] | None = None,
    paths: ClientPaths | None = None,
) -> ClientApp:
    """Build the example ClientApp with the compression mod outermost.

    ``inner_mods`` wrap the train handler only, inside the compression mod, so they
    see the dense reply (e.g. Flower's ``fixedclipping_mod`` for client-side DP
    clipping, which expects a model in every message it sees). ``paths``: where the
    clients read data and write state when their node config names no path
    (simulation: ``clients.paths.paths_of(settings)``); never the server's task.
    """
    # Fault injection (inactive unless faults.* rates are set): outside the compression
    # mod for crashes, drops and corrupt payloads, inside it for NaN models.
    mod = CompressionMod(
        policy,
        state_dir=_client_state_dir,
        state_in_context=_client_state_in_context,
        initial_model=_initial_model,
    )
    app = ClientApp(mods=[LocalPathsMod(paths), FaultMod(), mod])

    @app.train(mods=[NaNFaultMod(), *(inner_mods or [])])
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)  # Ray runs one client per core; more threads oversubscribe
        task = _task(msg)
        stable_id = stable_id_of(context)
        model = _model_from(msg, task)
        train_set, val_set = client_datasets(task, partition_id_of(context))
        gen = torch_generator(task.seed, "local-train", _round(msg), stable_id)
        config = next(iter(msg.content.config_records.values()), ConfigRecord())
        mu = float(config.get("proximal-mu", 0.0))  # set by Flower's FedProx
        device = select_device(task.train.device)
        # Before training: the model as received (training changes it in place).
        received = (
            pre_train_metrics(model, evaluation_split(train_set, val_set), device)
            if task.evaluate_in_train
            else {}
        )
        loss = train_local(model, train_set, task.train, gen, proximal_mu=mu, device=device)
        perturb_update(
            model,
            df=task.train.noise_df,
            scale=task.train.noise_scale,
            run_seed=task.seed,
            server_round=_round(msg),
            stable_id=stable_id,
        )
        if task.diagnostics_dir:  # exact update, outside the message (fedcomp.diagnostics)
            _write_diagnostics(task.diagnostics_dir, msg, stable_id, len(train_set), model)
        metrics = MetricRecord(
            {KEY_NUM_EXAMPLES: len(train_set), METRIC_TRAIN_LOSS: loss, **received}
        )
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()), RECORD_METRICS: metrics})
        return Message(content, reply_to=msg)

    @app.evaluate()
    def evaluate_local(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        task = _task(msg)
        model = _model_from(msg, task)
        train_set, val_set = client_datasets(task, partition_id_of(context))
        data = evaluation_split(train_set, val_set)
        loss, acc = evaluate(model, data, device=select_device(task.train.device))
        metrics = MetricRecord(
            {KEY_NUM_EXAMPLES: len(data), METRIC_EVAL_LOSS: loss, METRIC_EVAL_ACC: acc}
        )
        return Message(RecordDict({RECORD_METRICS: metrics}), reply_to=msg)

    return app


app = make_client_app()
