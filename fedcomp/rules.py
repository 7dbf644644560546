"""The server's cross-field rules, written once.

The settings check that runs before Ray starts (``fedcomp.settings.validate``) and
``CompressedStrategy``'s constructor both call :func:`check_server_options`, so a
combination of settings either passes both or fails both, with the same message naming
the key, the value and what is allowed (tests/test_settings_grid.py checks it on a grid).
No flwr and no torch here: the settings module imports this.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NoReturn

from fedcomp.influence import Influence

HANDOFFS = ("per_client", "pre_aggregated")
#: Joint codes: no per-client decoder; the server decodes only the mean of all replies.
JOINT_CODES = ("onebit",)
#: Codes the server sums before it decodes (FetchSGD's count sketches): like the joint
#: codes, only their mean is ever decoded.
SUMMED_CODES = ("sketch",)
#: Inner strategies whose aggregate is a weighted mean of the replies: the only ones a
#: single pre-aggregated reply can stand in for (FedMedian and FedTrimmedAvg subclass
#: FedAvg in Flower but are not means). Names are Flower's class names, lower-cased.
MEAN_BASED = ("fedavg", "fedavgm", "fedprox", "fedadam", "fedyogi", "fedadagrad")
#: Clients per round below which a joint code is refused unless the user overrides the
#: check: the one-bit code averages its clients' one-bit answers, so its error falls
#: with the number of clients; measured (make bench-dme, docs/onebit.md), at 16 clients
#: it loses to the best same-bits baseline in every cell, at 100 it wins only when the
#: updates' range is far wider than their spread, and a 10-client run of the default
#: job ends at chance accuracy with its loss 1000x the initial one.
JOINT_MIN_CLIENTS = 100


class SettingsError(ValueError):
    """A setting (or the data it names) that cannot run, found before anything starts:
    entry points print its message as one line and exit with status 2."""


def fail(key: str, value: Any, allowed: str) -> NoReturn:
    """Raise the one error shape of a bad setting."""
    raise ValueError(f"invalid setting {key}={value!r}: {allowed}")


def _check_fraction(key: str, value: float, *, allow_zero: bool) -> None:
    low_ok = value >= 0.0 if allow_zero else value > 0.0
    if not (low_ok and value <= 1.0):
        fail(key, value, f"must be in {'[0, 1]' if allow_zero else '(0, 1]'}")


def _check_factor(key: str, value: float) -> None:
    if value != 0 and not (math.isfinite(value) and value >= 1):
        fail(key, value, "must be 0 (off) or a number >= 1")


def changed_tree_options(trees: Any) -> list[tuple[str, Any]]:
    """The (``aggregation.<field>``, value) pairs of a TreeConfig that differ from its
    defaults: any of them means the user asked for a reduction tree's behaviour."""
    default = type(trees)()
    return [
        (f"aggregation.{f.name}", getattr(trees, f.name))
        for f in dataclasses.fields(trees)
        if getattr(trees, f.name) != getattr(default, f.name)
    ]


def check_codec_regime(codec_name: str, clients_per_round: int, *, regime_check: bool) -> None:
    """Refuse a joint code with fewer clients a round than it needs (see
    JOINT_MIN_CLIENTS), naming the threshold, the alternatives and the override."""
    if not regime_check or codec_name not in JOINT_CODES:
        return
    if clients_per_round < JOINT_MIN_CLIENTS:
        fail(
            "codec.name",
            codec_name,
            f"the {codec_name} code needs at least {JOINT_MIN_CLIENTS} clients a round "
            f"(this run samples {clients_per_round}: fraction_train x num_clients); below "
            "that it loses to the per-client codecs at the same bits (docs/onebit.md). "
            "Use codec=eden1, codec=ef_sign or codec=uniform2, or set regime_check=false "
            "to run it anyway",
        )


#: Codecs that send a few coordinates of each update (alone or inside a memory).
SPARSE_CODECS = ("topk", "randk", "sparseq", "subsample")
#: Inner strategies that aggregate coordinate by coordinate with a median or a trimmed
#: mean: over sparse updates, where most clients send 0 for a coordinate, the result
#: is 0 almost everywhere and the model does not move (measured: FedMedian with
#: codec=ef_topk stays at chance accuracy, loss flat, docs/reliability.md).
COORDINATEWISE_ROBUST = ("fedmedian", "fedtrimmedavg")


def codec_chain(codec: Mapping[str, Any]) -> list[str]:
    """The names in a codec spec, outermost first: its name, then its inner codec's
    (a name or a whole spec, fedcomp.codecs.memory.inner_fields), and so on."""
    names: list[str] = []
    node: Any = codec
    while isinstance(node, Mapping):
        names.append(str(node.get("name")))
        node = node.get("inner")
    if isinstance(node, str):
        names.append(node)
    return names


def is_sparse(codec: Mapping[str, Any]) -> bool:
    """Whether a codec spec sends sparse updates (its name or an inner codec's)."""
    return any(name in SPARSE_CODECS for name in codec_chain(codec))


def check_learnable(codec: Mapping[str, Any], strategy_name: str, *, regime_check: bool) -> None:
    """Refuse combinations known not to learn, naming why and the override."""
    if regime_check and is_sparse(codec) and strategy_name in COORDINATEWISE_ROBUST:
        fail(
            "strategy.name",
            strategy_name,
            "a coordinate-wise median or trimmed mean of sparse updates (codec "
            + " around ".join(codec_chain(codec))
            + ") is zero almost everywhere, so the model does not move; use a dense "
            "codec (codec=uniform8, codec=eden1) or a mean-based strategy (fedavg), or "
            "set regime_check=false to run it anyway",
        )


def check_server_options(
    *,
    codec_name: str,
    handoff: str,
    strategy_name: str,
    trees: Any,
    fraction_train: float,
    fraction_evaluate: float,
    influence: Influence,
) -> None:
    """Check the combination of server options that only the server half can judge.

    ``strategy_name`` is the inner strategy's name (``type(strategy).__name__.lower()``
    for a Flower class); ``trees`` a :class:`fedcomp.trees.aggregate.TreeConfig`.

    Raises
    ------
    ValueError
        ``invalid setting <key>=<value>: <what is allowed>``.
    """
    _check_handoff(codec_name, handoff, strategy_name, trees)
    _check_fraction("fraction_train", fraction_train, allow_zero=False)
    _check_fraction("fraction_evaluate", fraction_evaluate, allow_zero=True)
    check_influence(influence)


def check_influence(influence: Influence) -> None:
    """The influence bounds (fedcomp.influence.Influence), each named by its
    ``aggregation.*`` key."""
    for name in ("weight_cap", "norm_cap", "reject_factor", "collapse_ratio"):
        _check_factor(f"aggregation.{name}", getattr(influence, name))
    # Past 2^53 (9e15) float64 weights stop being exact integers.
    limit = influence.max_num_examples
    if not (isinstance(limit, int | float) and 1 <= limit <= 1e15):
        fail("aggregation.max_num_examples", limit, "must be a number in [1, 1e15]")
    region = {
        k: getattr(influence, k)
        for k in ("push_against", "push_along", "push_side", "consensus_floor")
    }
    for key, value in region.items():
        if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            fail(f"aggregation.{key}", value, "must be a finite number >= 0")
    if influence.push_along > 0 and influence.push_side <= 0:
        fail(
            "aggregation.push_side",
            influence.push_side,
            "must be > 0 while the consensus trust region is on (push_along > 0)",
        )
    if influence.push_along == 0 and (influence.push_side or influence.push_against):
        fail(
            "aggregation.push_along",
            0,
            "0 turns the consensus trust region off: set push_side and push_against to 0 too",
        )


def check_client_evaluation(evaluate_in_train: bool, fraction_evaluate: float) -> None:
    """Evaluation inside the train round replaces the evaluate messages: refuse a run
    that asks for both (forcing fraction_evaluate to 0 would leave results.json's
    config saying evaluate instructions were sampled when none were)."""
    if evaluate_in_train and fraction_evaluate > 0:
        fail(
            "fraction_evaluate",
            fraction_evaluate,
            "evaluate_in_train=true sends no evaluate instructions (the train replies "
            "carry the clients' evaluation): set fraction_evaluate=0",
        )


def _check_handoff(codec_name: str, handoff: str, strategy_name: str, trees: Any) -> None:
    """The hand-off against what it hands over: a mean needs a mean-based strategy, a
    joint code needs the mean, reduction trees need a mean they sum themselves."""
    if handoff not in HANDOFFS:
        fail("aggregation.handoff", handoff, f"allowed: {', '.join(HANDOFFS)}")
    pre = handoff == "pre_aggregated"
    if pre and strategy_name not in MEAN_BASED:
        fail(
            "strategy.name",
            strategy_name,
            "aggregation.handoff=pre_aggregated hands the inner strategy one averaged "
            f"reply, so it needs a mean-based strategy ({', '.join(MEAN_BASED)}); "
            "use aggregation=per_client for the others",
        )
    joint = codec_name in JOINT_CODES + SUMMED_CODES
    if joint and not pre:
        fail(
            "aggregation.handoff",
            handoff,
            f"codec {codec_name} is decoded only as the mean of all replies (a joint or a "
            "summed code): use aggregation=pre_aggregated",
        )
    changed = changed_tree_options(trees)
    if changed and not pre:
        key, value = changed[0]
        fail(
            key,
            value,
            "reduction-tree options need aggregation.handoff=pre_aggregated (per-client "
            "mode hands every reply to the inner strategy); leave them at their defaults",
        )
    if changed and joint:
        key, value = changed[0]
        fail(
            key,
            value,
            f"reduction trees do not apply to the code {codec_name}: its decoder sums "
            "the replies itself, in float64; leave the aggregation.* tree options "
            "at their defaults",
        )
