"""The project's ServerApp: the wrapped strategy, centralized evaluation, results.json.

``make_server_app(settings)`` builds it for simulation (run_simulation passes no run
config); the module-level ``app`` reads Flower's flat run config (``flwr run``, the
Deployment Engine) through ``fedcomp.settings.settings_from_run_config``.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedcomp.checkpoint import (
    STATE_FILE,
    Checkpoint,
    check_compatible,
    check_layout,
    checkpoint_dir,
    load_checkpoint,
    save_checkpoint,
)
from fedcomp.codecs import TensorPolicy
from fedcomp.data import server_test_set
from fedcomp.diagnostics import aggregate_error
from fedcomp.failures import RunFailed
from fedcomp.flower.options import IdentityOptions, ServerOptions
from fedcomp.flower.round_records import fmt
from fedcomp.flower.strategy import CompressedStrategy
from fedcomp.machine import machine_record
from fedcomp.models import build_model
from fedcomp.observers import Reporting
from fedcomp.progress import ProgressReporter
from fedcomp.results_file import build_results, write_results
from fedcomp.rules import check_client_evaluation, check_codec_regime, check_learnable
from fedcomp.settings import (
    Settings,
    aggregation_of,
    influence_of,
    settings_from_run_config,
    settings_to_dict,
    validate,
)
from fedcomp.training import evaluate, select_device
from strategies.inner import make_inner_strategy

log = logging.getLogger(__name__)

#: Where a run directory keeps its clients' codec memories (experiments.run sets
#: client_state_dir to it); a resumed run copies them from there, and only there.
CLIENT_STATE_SUBDIR = "client_state"

#: Settings the ClientApp needs; sent to every client in its message config. Not the
#: paths a client reads or writes (dataset.path, client_state_dir, diagnostics_dir):
#: clients take those from their own node config or settings (clients.paths).
CLIENT_TASK_KEYS = (
    "seed",
    "num_clients",
    "dataset",
    "partition",
    "model",
    "train",
    "faults",
    "client_state",
)


def client_task(settings: Settings) -> dict[str, Any]:
    """The part of the settings a client needs, as a plain dict (no paths)."""
    tree = settings_to_dict(settings)
    task = {k: tree[k] for k in CLIENT_TASK_KEYS}
    task["dataset"] = {k: v for k, v in task["dataset"].items() if k != "path"}
    if settings.evaluate_in_train:
        # Named only when on: with it off the task (and so every instruction's bytes)
        # stays what it was, and a client takes the default (off) when it is absent.
        # fraction_evaluate comes along because the client validates its task as a
        # whole Settings, and the setting is valid only with it at 0.
        task["evaluate_in_train"] = True
        task["fraction_evaluate"] = settings.fraction_evaluate
    return task


def make_evaluate_fn(settings: Settings) -> Callable[[int, ArrayRecord], MetricRecord]:
    """Centralized evaluation of the global model on the server's held-out test split."""
    test_set = server_test_set(settings)
    model = build_model(settings.model, settings.dataset.name, settings.seed)
    device = select_device(settings.train.device)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(model, test_set, device=device)
        return MetricRecord({"accuracy": acc, "loss": loss})

    return evaluate_fn


def _update_probe(directory: str):
    """The wrapper's diagnostics hook: the applied update against the exact mean."""
    if not directory:
        return None

    def probe(server_round, global_arrays, new_arrays, stable_ids):
        return aggregate_error(directory, server_round, stable_ids, global_arrays, new_arrays)

    return probe


def _checkpoint(run_dir: Path, strategy: CompressedStrategy, settings: Settings) -> None:
    """After every round: the model, the wrapper's and inner strategy's state, records."""
    arrays = strategy.last_arrays
    if arrays is None or not strategy.rounds:
        return
    save_checkpoint(
        run_dir,
        Checkpoint(
            round=strategy.rounds[-1]["round"],
            arrays={k: np.asarray(v.numpy()) for k, v in arrays.items()},
            strategy=strategy.state_dict(),
            settings=settings_to_dict(settings),
        ),
    )


def check_resume(settings: Settings) -> None:
    """The checks a resumed run makes, before anything starts (experiments.simulate's
    preflight): the checkpoint loads into a strategy and a model of these settings."""
    if not settings.resume:
        return
    model = build_model(settings.model, settings.dataset.name, settings.seed)
    with torch.no_grad():
        initial = ArrayRecord(model.state_dict())
    _resume(settings, build_strategy(settings), initial, copy_states=False)


def _resume(
    settings: Settings,
    strategy: CompressedStrategy,
    model: ArrayRecord,
    *,
    copy_states: bool = True,
) -> ArrayRecord:
    """Restore a stopped run's state into ``strategy`` (which then starts after the
    checkpoint's round); return the model. A malformed or mismatched checkpoint is a
    ValueError naming the file and the problem, before anything runs."""
    ckpt = load_checkpoint(settings.resume)
    folder = checkpoint_dir(settings.resume)
    check_compatible(ckpt.settings, settings_to_dict(settings))
    check_layout(
        ckpt.arrays,
        {k: np.asarray(v.numpy()) for k, v in model.items()},
        str(folder / f"model-{ckpt.round:05d}.npz"),
    )
    if ckpt.round >= settings.num_rounds:
        raise ValueError(
            f"resume={settings.resume}: the run already finished round {ckpt.round} of "
            f"num_rounds={settings.num_rounds}; raise num_rounds to continue it"
        )
    # The clients' codec memories and replicas as of the stopped run: in its own
    # directory's client_state (copied below into this run's, never from a path its
    # files name), or already where this run keeps them (resumed in place).
    old_states = Path(settings.resume) / CLIENT_STATE_SUBDIR
    kept = (
        copy_states
        and bool(settings.client_state_dir)
        and old_states.is_dir()
        and not old_states.is_symlink()
    )
    try:
        # the inner strategy's state included
        strategy.load_state_dict(ckpt.strategy, clients_kept_state=kept)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError) as exc:
        raise ValueError(
            f"resume={settings.resume}: {folder / STATE_FILE} does not hold this run's "
            f"strategy state ({type(exc).__name__}: {exc!s:.200})"
        ) from None
    if not copy_states:
        return ArrayRecord({k: Array(v) for k, v in ckpt.arrays.items()})
    # (a client whose reply the checkpoint did not acknowledge drops its pending state
    # by itself)
    if kept and old_states.resolve() != Path(settings.client_state_dir).resolve():
        shutil.copytree(old_states, settings.client_state_dir, dirs_exist_ok=True)
    log.info("resuming %s after round %d of %d", settings.resume, ckpt.round, settings.num_rounds)
    return ArrayRecord({k: Array(v) for k, v in ckpt.arrays.items()})


def build_strategy(
    settings: Settings, on_round: Callable[[dict[str, Any]], None] | None = None
) -> CompressedStrategy:
    """The ServerApp's strategy for these settings (the inner Flower strategy wrapped)."""
    # The same regime rule as the settings check before Ray (it needs the run's counts,
    # which the wrapper alone does not know).
    check_codec_regime(
        str(settings.codec["name"]),
        max(1, int(settings.fraction_train * settings.num_clients)),
        regime_check=settings.regime_check,
    )
    check_learnable(
        settings.codec, str(settings.strategy["name"]), regime_check=settings.regime_check
    )
    check_client_evaluation(settings.evaluate_in_train, settings.fraction_evaluate)
    return CompressedStrategy(
        make_inner_strategy(
            settings.strategy,
            settings.num_clients,
            fraction_train=settings.fraction_train,
            fraction_evaluate=settings.fraction_evaluate,
        ),
        codec=settings.codec,
        run_seed=settings.seed,
        downlink=settings.downlink,
        reporting=Reporting(
            on_round=on_round,
            update_probe=_update_probe(settings.diagnostics_dir),
            learning_check=settings.learning_check,
            learning_margin=settings.learning_margin,
        ),
        options=ServerOptions(
            aggregation=aggregation_of(settings),
            influence=influence_of(settings),
            task=client_task(settings),
            policy=TensorPolicy(min_numel=settings.policy.min_numel),
            identity=IdentityOptions(
                timeout=settings.simulation.round_timeout,
                reply_timeout=min(
                    settings.identity_reply_timeout, settings.simulation.round_timeout
                ),
                bind_keys=settings.bind_keys,
            ),
        ),
    )


def run_server(
    grid: Grid,
    settings: Settings,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the whole federated job on ``grid``; return (and maybe write) the results."""
    validate(settings)
    t0 = time.perf_counter()
    model = build_model(settings.model, settings.dataset.name, settings.seed)
    progress = ProgressReporter(settings.num_rounds, settings.progress)

    run_dir = Path(settings.results_path).parent if settings.results_path else None

    def round_done(record: dict[str, Any]) -> None:
        progress.update(record)
        if run_dir is not None:
            _checkpoint(run_dir, strategy, settings)
        if on_round is not None:
            on_round(record)

    strategy = build_strategy(settings, on_round=round_done)
    with torch.no_grad():
        initial = ArrayRecord(model.state_dict())
    if settings.resume:
        initial = _resume(settings, strategy, initial)
    failed: Exception | None = None
    try:
        strategy.start(
            grid=grid,
            initial_arrays=initial,
            num_rounds=settings.num_rounds,
            timeout=settings.simulation.round_timeout,
            evaluate_fn=make_evaluate_fn(settings),
        )
    except Exception as exc:  # the rounds so far are written first, then it is raised
        failed = exc
        log.error("the run failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
    finally:
        progress.close()
    results = _results(settings, strategy, time.perf_counter() - t0, failed)
    if "failure" not in results or isinstance(failed, RunFailed):
        _log_summary(results, settings)  # the rounds are complete
    if settings.results_path:
        write_results(settings.results_path, results, salvage=failed is not None)
    if failed is not None:
        raise failed
    return results


def _results(
    settings: Settings, strategy: CompressedStrategy, wall_s: float, failed: Exception | None
) -> dict[str, Any]:
    """results.json's content: the rounds so far, the machine, and why the run failed."""
    rounds = strategy.rounds
    try:
        results = build_results(settings_to_dict(settings), rounds, wall_s=wall_s)
    except Exception as exc:  # a record the schema refuses: keep what there is, say why
        failed = failed or exc
        results = {"schema_version": 1, "config": settings_to_dict(settings), "rounds": rounds}
        results["summary"] = {"wall_s": wall_s}
    results["machine"] = machine_record()  # what the trajectory may depend on besides the code
    initial_eval = strategy.book.initial_evaluation or {}
    results["summary"]["initial_accuracy"] = initial_eval.get("accuracy")
    if failed is not None:
        results["failure"] = {"kind": type(failed).__name__, "message": str(failed)[:2000]}
    return results


def _log_summary(results: dict[str, Any], settings: Settings) -> None:
    """The run's closing lines: its bytes against fp32, and how to run fp32 FedAvg."""
    s, rounds = results["summary"], results["rounds"]
    log.info(
        "done: final accuracy %s (initial %s) | total wire %s B in %d rounds, fp32/total "
        "%s (train traffic %s) | uplink wire %d B, ratio vs fp32: codec %s wire %s | %.1f s",
        fmt(s["final_accuracy"]),
        fmt(s["initial_accuracy"]),
        s["total_wire_bytes"],
        len(rounds),
        fmt(s["total_ratio_vs_fp32"]),
        fmt(s["train_ratio_vs_fp32"]),
        s["uplink_wire_bytes_total"],
        fmt(s["ratio_vs_fp32_codec"]),
        fmt(s["ratio_vs_fp32_wire"]),
        s["wall_s"],
    )
    if settings.codec.get("name") != "fp32":
        log.info(
            "fp32 FedAvg on the same job: add recipe=fedavg num_rounds=%d to your other "
            "settings (make run RUN_ARGS='recipe=fedavg num_rounds=%d')",
            settings.num_rounds,
            settings.num_rounds,
        )
    if s["rounds_without_accepted_reply"]:
        log.warning(
            "%d of %d rounds accepted no reply: the model did not change in them",
            s["rounds_without_accepted_reply"],
            len(rounds),
        )


def make_server_app(
    settings: Settings | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    on_results: Callable[[dict[str, Any]], None] | None = None,
) -> ServerApp:
    """Build the ServerApp; with ``settings=None`` it reads Flower's run config."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_settings = settings or settings_from_run_config(context.run_config)
        results = run_server(grid, run_settings, on_round=on_round)
        if on_results is not None:
            on_results(results)

    return app


app = make_server_app()
