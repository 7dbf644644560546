"""Run settings: one typed tree shared by Hydra, ``flwr run`` and the apps.

Hydra composes ``conf/`` against these dataclasses (registered as a structured
config in ``experiments``), so a wrong type or a missing value fails at
composition. The apps receive the same tree either directly (simulation) or as
Flower's flat run config (``flwr run``, the Deployment Engine) through the one
documented mapping, :func:`flatten` / :func:`unflatten`:

- nested keys are joined with dots: ``{"partition": {"alpha": 0.3}}`` becomes
  ``{"partition.alpha": 0.3}``;
- bool, int, float and str values stay as they are;
- anything else (lists, dicts, ``None``) and any string that starts with
  ``json:`` becomes the string ``"json:" + json.dumps(value)``.

:func:`validate` checks values (names, ranges) and raises ``ValueError`` naming
the key, the value and what is allowed. It runs before any Flower or Ray start.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from fedcomp.rules import (
    check_client_evaluation,
    check_codec_regime,
    check_learnable,
    check_server_options,
    fail,
)

if TYPE_CHECKING:  # a runtime import would load torch for every settings user
    from fedcomp.handoff_options import Aggregation
    from fedcomp.influence import Influence
    from fedcomp.trees.aggregate import TreeConfig

JSON_PREFIX = "json:"

DATASETS = ("digits", "femnist", "cifar10", "synthetic", "fashion_mnist")
PARTITIONS = ("dirichlet", "iid", "natural", "pathological", "niid_labeldir", "niid_labels")
MODELS = ("mlp", "cnn", "resnet18", "niid_cnn")
DEVICES = ("auto", "cpu", "cuda")
PROGRESS = ("auto", "bar", "log", "off")
CLIENT_STATES = ("memory", "disk")
TREES = ("sum", "sequential", "balanced", "blocked", "huffman", "greedy", "adaptive")
STATS = ("current", "ema")
TREE_DTYPES = ("fp32", "bf16", "fp16")
#: The inner strategies a run can name: Flower's classes of these names, lowercased
#: (strategies/inner.py takes them from fedcomp.flower.inner_state, which checkpoints
#: them); the core names them without importing flwr.
STRATEGIES = (
    "fedavg",
    "fedavgm",
    "fedprox",
    "fedadam",
    "fedyogi",
    "fedadagrad",
    "fedmedian",
    "fedtrimmedavg",
)


@dataclass
class DatasetSettings:
    """Which dataset, and how the server's held-out test split is cut."""

    name: str = "digits"
    test_fraction: float = 0.2
    #: femnist, cifar10: a local copy (a datasets ``save_to_disk`` directory, parquet
    #: file(s), or for cifar10 torchvision's ``cifar-10-batches-py``); "" = the hub
    #: through flwr-datasets. fashion_mnist: a directory of the four IDX files ("" =
    #: /usr/share/datasets/fashion-mnist, the Debian package's).
    path: str = ""
    #: synthetic only: number of samples, and the Student-t degrees of freedom of the
    #: features (heavy tails below 4: infinite kurtosis; below 2: infinite variance).
    num_samples: int = 6000
    tail_df: float = 3.0

    def check(self) -> None:
        """Raise naming ``dataset.<key>`` when a value is out of range."""
        _check_choice("dataset.name", self.name, DATASETS)
        if not 0.0 < self.test_fraction < 1.0:
            _fail("dataset.test_fraction", self.test_fraction, "must be in (0, 1)")
        if self.num_samples < 2:
            _fail("dataset.num_samples", self.num_samples, "must be >= 2")
        if not self.tail_df > 0.0:
            _fail("dataset.tail_df", self.tail_df, "Student-t degrees of freedom must be > 0")


@dataclass
class PartitionSettings:
    """How the training split is divided among clients (flwr-datasets partitioners)."""

    name: str = "dirichlet"
    alpha: float = 0.3
    min_partition_size: int = 10
    #: Pathological and niid_labels partitions: the distinct labels each client holds.
    classes_per_client: int = 2
    #: Fraction of each client's partition held out for client-side evaluation.
    val_fraction: float = 0.2

    def check(self) -> None:
        """Raise naming ``partition.<key>`` when a value is out of range."""
        _check_choice("partition.name", self.name, PARTITIONS)
        if self.classes_per_client < 1:
            _fail("partition.classes_per_client", self.classes_per_client, "must be >= 1")
        if self.alpha <= 0.0:
            _fail("partition.alpha", self.alpha, "the Dirichlet alpha must be > 0")
        if self.min_partition_size < 1:
            _fail("partition.min_partition_size", self.min_partition_size, "must be >= 1")
        if not 0.0 <= self.val_fraction < 1.0:
            _fail("partition.val_fraction", self.val_fraction, "must be in [0, 1)")


@dataclass
class ModelSettings:
    """The model family and its size.

    ``hidden`` is the layer widths: mlp, the hidden layers; cnn, [conv1 channels,
    conv2 channels, fully connected width]; niid_cnn, its two dense widths (its
    convolutions are fixed at 6 and 16 channels); resnet18 has a fixed width (empty list).
    """

    name: str = "mlp"
    hidden: list[int] = field(default_factory=lambda: [512, 128])

    def check(self) -> None:
        """Raise naming ``model.<key>`` when a value is out of range."""
        _check_choice("model.name", self.name, MODELS)
        _check_model_widths(self)


@dataclass
class TrainSettings:
    """Local training on each client."""

    local_epochs: int = 5
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    #: SGD's L2 weight decay (0 = none; NIID-Bench's baseline uses 1e-5).
    weight_decay: float = 0.0
    #: "auto" = CUDA when available, else the CPU.
    device: str = "auto"
    #: Heavy-tailed stress test: add ``noise_scale * Student-t(noise_df)`` to every
    #: client's update after training (0 = off), the one-bit experiments' setting.
    noise_df: float = 0.0
    noise_scale: float = 0.0

    def check(self) -> None:
        """Raise naming ``train.<key>`` when a value is out of range."""
        if self.local_epochs <= 0:
            _fail("train.local_epochs", self.local_epochs, "must be a positive integer")
        if self.batch_size <= 0:
            _fail("train.batch_size", self.batch_size, "must be a positive integer")
        if self.lr <= 0.0:
            _fail("train.lr", self.lr, "must be > 0")
        if not 0.0 <= self.momentum < 1.0:
            _fail("train.momentum", self.momentum, "must be in [0, 1)")
        if not 0.0 <= self.weight_decay < math.inf:
            _fail("train.weight_decay", self.weight_decay, "must be a finite number >= 0")
        _check_choice("train.device", self.device, DEVICES)
        if self.noise_df < 0 or not math.isfinite(self.noise_df):
            _fail("train.noise_df", self.noise_df, "must be 0 (off) or a positive number")
        if self.noise_scale < 0 or not math.isfinite(self.noise_scale):
            _fail("train.noise_scale", self.noise_scale, "must be a finite number >= 0")


@dataclass
class PolicySettings:
    """Integer buffers, tensors with fewer elements than ``min_numel``, and tensors the
    codec would not carry in fewer bits than raw travel raw
    (fedcomp.codecs.policy.TensorPolicy)."""

    min_numel: int = 0

    def check(self) -> None:
        """Raise naming ``policy.min_numel`` when it is negative."""
        if self.min_numel < 0:
            _fail("policy.min_numel", self.min_numel, "must be >= 0")


@dataclass
class TreeOptions:
    """The reduction tree's options (``aggregation.*``), declared once: the run
    settings (:class:`AggregationSettings`) and the server's
    ``fedcomp.trees.aggregate.TreeConfig`` both extend it. Pre-aggregated mode: the
    reduction tree, its dtype, and its statistics."""

    tree: str = "sum"
    dtype: str = "fp32"
    root_fp32: bool = False
    chunk_size: int = 65536
    refresh_rounds: int = 1
    stats: str = "current"

    def check_tree_options(self) -> None:
        """Raise ``ValueError`` naming the ``aggregation.*`` key, its value and what is
        allowed."""
        if self.tree not in TREES:
            raise ValueError(f"aggregation.tree={self.tree!r}; allowed: {', '.join(TREES)}")
        if self.dtype not in TREE_DTYPES:
            raise ValueError(f"aggregation.dtype={self.dtype!r}; allowed: {', '.join(TREE_DTYPES)}")
        if self.chunk_size < 1:
            raise ValueError(f"aggregation.chunk_size={self.chunk_size!r}: must be >= 1")
        if self.refresh_rounds < 1:
            raise ValueError(f"aggregation.refresh_rounds={self.refresh_rounds!r}: must be >= 1")
        if self.stats not in STATS:
            raise ValueError(f"aggregation.stats={self.stats!r}; allowed: {', '.join(STATS)}")


@dataclass
class AggregationSettings(TreeOptions):
    """How decoded client updates reach the inner Flower strategy (the reduction tree's
    options: :class:`TreeOptions`)."""

    handoff: str = "per_client"
    #: Residual memory: a directory for the control-variate mirrors ("" = in memory).
    mirror_dir: str = ""
    #: Bounded influence (fedcomp.influence, docs/reliability.md): a client's reported
    #: num-examples is capped at this multiple of the round's lower median report
    #: (0 = no cap), so no client dominates the mean by what it claims.
    weight_cap: float = 5.0
    #: Bounded influence, on by default: a decoded update whose L2 norm exceeds this
    #: multiple of the round's reference norm (the lower median of the update norms,
    #: fedcomp.influence.reference_norm) is scaled down to it (0 = off; joint codes are
    #: bounded by construction and skip it). Honest runs do not reach it
    #: (docs/reliability.md).
    norm_cap: float = 10.0
    #: Hostile or broken updates: a reply whose decoded update has an L2 norm beyond
    #: this multiple of the round's reference norm is rejected outright (0 = off).
    #: Far above any honest spread, it stops a client from sending huge finite values;
    #: ``norm_cap`` handles the milder cases by clipping.
    reject_factor: float = 1000.0
    #: The largest num-examples one reply may claim; a reply claiming more is rejected
    #: (bad_weight). Keeps the round's total weight finite.
    max_num_examples: float = 1e9
    #: The reference norm falls back to the last clean round's when the lower median
    #: norm is this many times below the upper median (half the updates near zero).
    collapse_ratio: float = 10.0
    #: The consensus trust region (multiples of the consensus step's norm): how far one
    #: client's contribution may push against the round's consensus, along it and
    #: across it (push_along=0: off, with the other two 0).
    push_against: float = 0.5
    push_along: float = 2.0
    push_side: float = 3.0
    #: ... in multiples of max(C, consensus_floor x the reference norm): near
    #: convergence the common step shrinks, the clients' differences do not.
    consensus_floor: float = 0.25
    #: A client bound round after round (weight capped, norm clipped, contribution
    #: held) gets half the room for each strike beyond the first; rounds it is not
    #: bound take strikes away (fedcomp.influence.room_of).
    escalation: bool = True


@dataclass
class FaultSettings:
    """Fault injection (simulation and tests): each train reply, with these
    probabilities (at most one fault per reply), drawn from (run seed, round, stable id).

    drop_reply: the reply is lost after training (an error reply marked as a drop);
    crash_client: the ClientApp raises before training; corrupt_payload: one payload is
    truncated after encoding; nan_update: the trained model turns NaN before encoding.
    """

    drop_reply: float = 0.0
    crash_client: float = 0.0
    corrupt_payload: float = 0.0
    nan_update: float = 0.0

    def check(self) -> None:
        """Raise naming ``faults.<key>`` for a rate outside [0, 1] or rates summing past 1."""
        rates = dataclasses.asdict(self)
        for key, rate in rates.items():
            if not (isinstance(rate, int | float) and 0.0 <= rate <= 1.0):
                _fail(f"faults.{key}", rate, "must be a probability in [0, 1]")
        if sum(rates.values()) > 1.0:
            _fail("faults", rates, "the fault probabilities must sum to at most 1")


@dataclass
class SimulationSettings:
    """Ray resources for flwr.simulation, sized for this 2-core machine by default."""

    num_cpus: int = 2
    cpus_per_client: float = 1.0
    gpus_per_client: float = 0.0
    #: Seconds the server waits for replies in one round.
    round_timeout: float = 600.0
    #: An existing Ray cluster's head (``host:port`` of its GCS, what ``ray start
    #: --head`` prints); empty: start a private local Ray. With an address the CPUs and
    #: GPUs are the cluster's (``num_cpus`` is not used).
    ray_address: str = ""

    def check(self) -> None:
        """Raise naming ``simulation.<key>`` when a value is out of range."""
        if self.ray_address and ray_host_port(self.ray_address) is None:
            _fail(
                "simulation.ray_address",
                self.ray_address,
                "must be host:port of a Ray cluster's head (e.g. 10.0.0.5:6379), or empty",
            )
        if self.num_cpus <= 0:
            _fail("simulation.num_cpus", self.num_cpus, "must be a positive integer")
        if self.cpus_per_client <= 0:
            _fail("simulation.cpus_per_client", self.cpus_per_client, "must be > 0")
        if self.gpus_per_client < 0:
            _fail("simulation.gpus_per_client", self.gpus_per_client, "must be >= 0")
        if self.round_timeout <= 0:
            _fail("simulation.round_timeout", self.round_timeout, "must be > 0")


def ray_host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port`` address (None when it is not one)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


@dataclass
class Settings:
    """The whole run. Field names are the Hydra keys and the flat run-config keys."""

    seed: int = 0
    num_rounds: int = 10
    num_clients: int = 10
    dataset: DatasetSettings = field(default_factory=DatasetSettings)
    partition: PartitionSettings = field(default_factory=PartitionSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    #: Codec spec: ``name`` plus the codec's own parameters (checked by make_codec).
    codec: dict[str, Any] = field(default_factory=lambda: {"name": "fp32"})
    #: Downlink spec (fedcomp.downlink): a stateless codec's spec plus ``memory``
    #: (error_feedback or none); ``fp32``: the full model in every instruction.
    downlink: dict[str, Any] = field(default_factory=lambda: {"name": "fp32"})
    policy: PolicySettings = field(default_factory=PolicySettings)
    #: Strategy spec: ``name`` plus the Flower strategy's keyword arguments.
    strategy: dict[str, Any] = field(default_factory=lambda: {"name": "fedavg"})
    #: Fractions of the known clients sampled per round (by the wrapper, seeded).
    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0
    #: The train-sampled clients evaluate the model they received, before training, on
    #: their local evaluation split and report it in their train reply; no evaluate
    #: instructions are sent (fraction_evaluate must be 0). The round's client_accuracy
    #: is then that of the previous round's aggregate (docs/experiments.md).
    evaluate_in_train: bool = False
    aggregation: AggregationSettings = field(default_factory=AggregationSettings)
    faults: FaultSettings = field(default_factory=FaultSettings)
    simulation: SimulationSettings = field(default_factory=SimulationSettings)
    #: Where the ServerApp writes results.json ("" = do not write).
    results_path: str = ""
    #: Simulation diagnostics: clients also write their exact updates here (outside
    #: the messages) and each round records the aggregate's error against their exact
    #: mean (fedcomp.diagnostics). "" = off.
    diagnostics_dir: str = ""
    #: Continue the stopped run in this directory from its last checkpoint (runs with a
    #: results_path write one after every round). "" = a new run.
    resume: str = ""
    #: Clients also keep their codec memory (error-feedback error, residual control
    #: variate) in files here, so a resumed run continues with it ("" = only in
    #: Context.state). experiments.run sets it to <run dir>/client_state.
    client_state_dir: str = ""
    #: Where clients keep that memory and their downlink replica: "memory" (in
    #: Context.state, plus a file copy when client_state_dir is set) or "disk" (only
    #: in client_state_dir; Context.state keeps none of it). In run_simulation every
    #: client's Context.state lives in the driver process: "disk" bounds it for many
    #: clients (docs/experiments.md, "Cross-device").
    client_state: str = "memory"
    #: Progress display: "bar" (one line updated in place on stderr), "log" (a progress
    #: log line at most once a minute), "auto" (bar when stderr is a terminal, else log).
    progress: str = "auto"
    #: Refuse codecs outside the regime they work in (the one-bit code with fewer than
    #: fedcomp.rules.JOINT_MIN_CLIENTS clients a round; sparse codecs under a
    #: coordinate-wise median or trimmed mean); false runs them anyway.
    regime_check: bool = True
    #: Fail a run whose model ends no better than it started (fedcomp.observers): its
    #: central loss not below the initial, or its accuracy not ``learning_margin``
    #: above the initial.
    learning_check: bool = True
    learning_margin: float = 0.05
    #: Bind each stable id to the public key of the SuperNode that first claims it
    #: (CompressedStrategy's bind_keys; docs/deployment.md): only with SuperNode
    #: authentication, where a node keeps its key across restarts. The deployment
    #: launcher sets it when deployment.auth.enabled.
    bind_keys: bool = False
    #: Seconds the server waits for the identity replies of newly connected nodes (a
    #: node that does not answer is asked again later, with backoff).
    identity_reply_timeout: float = 30.0


# ---------------------------------------------------------------------------------
# dict <-> dataclass with type checks
# ---------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` to type ``tp`` or raise ``ValueError`` naming ``key``."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ValueError(f"{key}: expected a mapping, got {value!r}")
        return _from_mapping(tp, value, key + ".")
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], key)
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ValueError(f"{key}: expected a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected a bool, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: expected an int, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key}: expected a float, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a str, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported settings type {_type_name(tp)}")


def _from_mapping(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(
            f"unknown setting(s) {', '.join(prefix + u for u in unknown)}; "
            f"allowed under '{prefix or '<root>'}': {', '.join(sorted(names))}"
        )
    kwargs = {name: _convert(data[name], hints[name], prefix + name) for name in data}
    return cls(**kwargs)


def settings_from_dict(data: Mapping[str, Any]) -> Settings:
    """Build :class:`Settings` from a nested mapping (missing keys take defaults).

    Raises
    ------
    ValueError
        On an unknown key or a value of the wrong type, naming the key.
    """
    return _from_mapping(Settings, data)


def settings_to_dict(settings: Settings) -> dict[str, Any]:
    """Return the settings as a nested plain dict (JSON-serializable)."""
    return dataclasses.asdict(settings)


# ---------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------


_fail = fail


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(key, value, f"allowed: {', '.join(choices)}")


def validate(settings: Settings) -> Settings:
    """Check every value that can be checked without loading data: each settings group
    checks itself, then the rules across groups (written once: the server's in
    fedcomp.rules, which CompressedStrategy's constructor applies too).

    Returns the settings unchanged so calls can be chained; raises ``ValueError``
    naming the key, the value and what is allowed.
    """
    s = settings
    _check_finite(s)
    _check_run_values(s)
    _check_groups(s)
    _check_specs(s)
    if not 0 <= s.learning_margin < 1:
        _fail("learning_margin", s.learning_margin, "must be in [0, 1)")
    if not (math.isfinite(s.identity_reply_timeout) and s.identity_reply_timeout > 0):
        _fail("identity_reply_timeout", s.identity_reply_timeout, "must be > 0 seconds")
    a = s.aggregation
    check_server_options(
        codec_name=str(s.codec["name"]),
        handoff=a.handoff,
        strategy_name=str(s.strategy["name"]),
        trees=tree_config(s),  # TreeConfig's own checks name the aggregation.* key
        fraction_train=s.fraction_train,
        fraction_evaluate=s.fraction_evaluate,
        influence=influence_of(s),
    )
    check_client_evaluation(s.evaluate_in_train, s.fraction_evaluate)
    return s


def _check_finite(value: Any, key: str = "") -> None:
    """Every number in the settings, nested groups and specs included, is finite: a
    NaN passes every one-sided check (``x <= 0`` is False for NaN) and ran a whole run
    before failing elsewhere."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            _check_finite(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _check_finite(v, f"{key}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_finite(v, f"{key}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        _fail(key, value, "must be a finite number")


def _check_run_values(s: Settings) -> None:
    """The run's own scalars: sizes, seed, display, and where client state lives."""
    if s.num_rounds <= 0:
        _fail("num_rounds", s.num_rounds, "must be a positive integer")
    if s.num_clients <= 0:
        _fail("num_clients", s.num_clients, "must be a positive integer")
    if s.seed < 0:
        _fail("seed", s.seed, "must be a non-negative integer")
    _check_choice("progress", s.progress, PROGRESS)
    _check_choice("client_state", s.client_state, CLIENT_STATES)
    if s.client_state == "disk" and not s.client_state_dir:
        _fail(
            "client_state",
            s.client_state,
            "keeps client state only in files: set client_state_dir=<dir> too "
            "(experiments.run sets it to <run dir>/client_state)",
        )


def _check_groups(s: Settings) -> None:
    """Each settings group checks itself; then the partition against the dataset."""
    for group in (s.dataset, s.partition, s.model, s.train, s.policy, s.faults, s.simulation):
        group.check()
    from fedcomp.models import check_model  # torch only when checking

    check_model(s.model, s.dataset.name)  # the input shape, and the size bound
    if s.partition.name == "natural" and s.dataset.name != "femnist":
        _fail(
            "partition.name",
            s.partition.name,
            f"a natural (per-writer) partition needs writer ids, which only femnist has "
            f"(dataset.name={s.dataset.name!r}): use dirichlet, pathological or iid",
        )


def _check_specs(s: Settings) -> None:
    """The codec, downlink and strategy specs, then the codec in its regime (fedcomp.rules)."""
    if "name" not in s.codec:
        _fail("codec", s.codec, "a codec spec needs a 'name'")
    from fedcomp.codecs import make_codec_from_spec  # the codecs (torch) only when checking
    from fedcomp.downlink import parse_downlink

    try:  # the codec's own parameters, before any run (a sweep's run fails alone)
        make_codec_from_spec(s.codec)
    except (ValueError, TypeError) as exc:
        _fail("codec", s.codec, str(exc))
    parse_downlink(s.downlink)  # names downlink.<key>, the value and what is allowed
    if "name" not in s.strategy:
        _fail("strategy", s.strategy, "a strategy spec needs a 'name'")
    _check_choice("strategy.name", s.strategy["name"], STRATEGIES)
    check_codec_regime(
        str(s.codec["name"]),
        max(1, int(s.fraction_train * s.num_clients)),  # the wrapper's count (Flower's)
        regime_check=s.regime_check,
    )
    check_learnable(s.codec, str(s.strategy["name"]), regime_check=s.regime_check)


def _check_model_widths(model: ModelSettings) -> None:
    hidden = model.hidden
    if model.name == "mlp" and (not hidden or any(h <= 0 for h in hidden)):
        _fail("model.hidden", hidden, "a non-empty list of positive layer widths")
    if model.name == "cnn" and (len(hidden) != 3 or any(h <= 0 for h in hidden)):
        _fail(
            "model.hidden",
            hidden,
            "cnn takes [conv1 channels, conv2 channels, fully connected width], "
            "e.g. [32, 64, 2048] (model=leaf_cnn) or [32, 64, 512] (model=cnn)",
        )
    if model.name == "niid_cnn" and (len(hidden) != 2 or any(h <= 0 for h in hidden)):
        _fail("model.hidden", hidden, "niid_cnn takes two dense widths ([120, 84] in NIID-Bench)")
    if model.name == "resnet18" and hidden:
        _fail("model.hidden", hidden, "resnet18 has a fixed width: use model=resnet18 (hidden: [])")


def tree_config(settings: Settings) -> TreeConfig:
    """The reduction-tree configuration of the pre-aggregated mode (validated)."""
    from fedcomp.trees.aggregate import TreeConfig

    a = settings.aggregation
    return TreeConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(TreeOptions)})


def aggregation_of(settings: Settings) -> Aggregation:
    """The wrapper's aggregation settings object (hand-off, tree, mirrors)."""
    from fedcomp.handoff_options import Aggregation

    a = settings.aggregation
    return Aggregation(
        handoff=a.handoff, trees=tree_config(settings), mirror_dir=a.mirror_dir or None
    )


def influence_of(settings: Settings) -> Influence:
    """The wrapper's influence bounds (weight cap, norm cap, rejection factor, the
    absolute bound on num-examples)."""
    from fedcomp.influence import Influence

    a = settings.aggregation
    return Influence(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Influence)})


# ---------------------------------------------------------------------------------
# the flat run-config mapping
# ---------------------------------------------------------------------------------

Scalar = bool | int | float | str


def _encode_leaf(value: Any) -> Scalar:
    if isinstance(value, bool | int | float):
        return value
    if isinstance(value, str) and not value.startswith(JSON_PREFIX):
        return value
    return JSON_PREFIX + json.dumps(value, sort_keys=True)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Scalar]:
    """Flatten a nested settings dict into Flower's flat run config (dotted keys)."""
    flat: dict[str, Scalar] = {}
    for key, value in tree.items():
        if "." in key:
            raise ValueError(f"setting names cannot contain '.': {prefix + key!r}")
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, prefix + key + "."))
        else:
            flat[prefix + key] = _encode_leaf(value)
    return flat


def _decode_leaf(value: Any) -> Any:
    if isinstance(value, str) and value.startswith(JSON_PREFIX):
        return json.loads(value[len(JSON_PREFIX) :])
    return value


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Invert :func:`flatten`."""
    tree: dict[str, Any] = {}
    for dotted, value in flat.items():
        parts = dotted.split(".")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"run-config key {dotted!r} conflicts with a scalar above it")
        node[parts[-1]] = _decode_leaf(value)
    return tree


def settings_from_run_config(run_config: Mapping[str, Any]) -> Settings:
    """Settings from Flower's flat run config (what ``flwr run`` passes the apps)."""
    return validate(settings_from_dict(unflatten(run_config)))


def _toml_value(value: Scalar) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)


def default_run_config_toml() -> str:
    """The ``[tool.flwr.app.config]`` body for the default settings."""
    flat = flatten(settings_to_dict(Settings()))
    return "\n".join(f'"{k}" = {_toml_value(v)}' for k, v in flat.items())


if __name__ == "__main__":  # pragma: no cover - a maintenance helper
    print(default_run_config_toml())
