"""Fault injection's draws, shared by the client that injects a fault and the server
that counts it (clients.faults; fedcomp.flower.rejection).

Whether and how a reply is faulty is drawn from (run seed, round, stable id), so a
faulty run reproduces exactly, and the server knows which fault each client was to
inject without reading it from the client's error text.
"""

from __future__ import annotations

from collections.abc import Mapping

from fedcomp.rng import numpy_generator

#: Fault kinds in the order their probability intervals are laid out.
KINDS = ("drop_reply", "crash_client", "corrupt_payload", "nan_update")


def draw_fault(
    rates: Mapping[str, float], run_seed: int, server_round: int, stable_id: int
) -> str | None:
    """The fault of this reply (a kind from KINDS), or None."""
    u = numpy_generator(run_seed, "fault", server_round, stable_id).random()
    edge = 0.0
    for kind in KINDS:
        edge += float(rates.get(kind, 0.0))
        if u < edge:
            return kind
    return None
