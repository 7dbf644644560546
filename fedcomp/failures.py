"""Why a reply was rejected: one vocabulary for the decoders, the wrapper and the records.

Every rejection carries one :class:`Failure` kind, so counters and logs never depend on
the wording of an error message. The wrapper counts rejections per kind in each round's
``rejected`` record; docs/reliability.md lists which check raises which kind.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Failure(StrEnum):
    """The kinds of failed reply, as counted in the round record."""

    #: The client answered with a Flower Error (crash, injected fault, precondition).
    ERROR_REPLY = "error_reply"
    #: A reply from a node that was not sent an instruction this round.
    NOT_ASKED = "not_asked"
    #: More than one reply from the same client in one round (all of them are dropped:
    #: keeping "the first" would depend on reply order).
    DUPLICATE = "duplicate"
    #: No fedcomp header: the ClientApp lacks the compression mod.
    MISSING_MOD = "missing_mod"
    #: A protocol version the server does not speak.
    PROTOCOL = "protocol"
    #: The header names another client than the node that sent it.
    WRONG_CLIENT = "wrong_client"
    #: The header is for another round.
    WRONG_ROUND = "wrong_round"
    #: A missing, non-finite or non-positive example count.
    BAD_WEIGHT = "bad_weight"
    #: Train metrics that are not finite scalars, or whose names differ from those
    #: most of the round's replies carry (Flower's metric aggregation needs one key
    #: set; anything else would end the ServerApp).
    BAD_METRICS = "bad_metrics"
    #: Records, tensor names, shapes or dtypes that do not match the global model.
    BAD_LAYOUT = "bad_layout"
    #: A payload that is not well formed (truncated, extended, bad lengths or codes).
    MALFORMED = "malformed"
    #: A well-formed payload of another codec or with other parameters than the ones
    #: the server asked this client for (codec id, bits, block, levels, k, seed, ...).
    SPEC_MISMATCH = "spec_mismatch"
    #: Decoded values that are NaN or infinite.
    NONFINITE = "nonfinite"
    #: An update whose norm is beyond ``reject_factor`` x the round's median norm.
    OUTLIER = "outlier"
    #: A control-variate reply that does not match the server's mirror (a full
    #: resync is requested from that client).
    RESYNC = "resync"
    #: Anything else a decoder raised: a bug, logged with its traceback, and still
    #: only that client's failure.
    UNEXPECTED = "unexpected"


class Rejection(ValueError):
    """A reply (or payload) that fails a check, with the kind of failure.

    Parameters
    ----------
    message : str
        What is wrong, naming the field, the value and what was expected.
    kind : Failure
        The failure kind recorded for it.
    field, value, expected : optional
        The offending field and the values, for callers and tests that inspect them.
    """

    default_kind = Failure.MALFORMED

    def __init__(
        self,
        message: str,
        kind: Failure | None = None,
        *,
        field: str | None = None,
        value: Any = None,
        expected: Any = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind or self.default_kind
        self.field = field
        self.value = value
        self.expected = expected


def failure_of(exc: BaseException) -> Failure:
    """The failure kind of an exception raised while checking or decoding a reply."""
    return exc.kind if isinstance(exc, Rejection) else Failure.UNEXPECTED


class RunFailed(RuntimeError):
    """A run that ended but cannot have learned (no reply accepted in any round, or a
    global model whose central loss is no longer finite). Raised by
    ``CompressedStrategy.start`` after the last round; the round records are complete,
    so a caller can write them before reporting the failure."""


def short_reason(reason: str, limit: int = 300) -> str:
    """The informative last line of a (possibly multi-line, remote) error reason."""
    lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."
