"""The consensus trust region (fedcomp.influence.consensus_coefficients, applied by
fedcomp.flower.bounds.hold_to_consensus), tested from its definition.

The round's consensus is c = sum_i f_i clip_r(u_i) / sum_i f_i (each update clipped
to the reference norm r, f_i its client's room); C = ||c||. Each client's contribution
v_i = s_i u_i' to the weighted mean (s_i its share of the total weight) must end with
its component along c in [-against f_i C, along f_i C] and its part across c at most
side f_i C; an update already inside is left exactly as it was. The expected values
are recomputed here in float64 from that definition.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import MetricRecord

from fedcomp.flower.bounds import hold_to_consensus
from fedcomp.flower.consensus import consensus_pass
from fedcomp.flower.round_state import Decoded
from fedcomp.influence import TrustRegion, consensus_coefficients

REGION = TrustRegion(against=0.5, along=2.0, side=3.0)


def _cases(seed: int, n: int):
    rng = np.random.default_rng(seed)
    shares = rng.dirichlet(np.ones(n))
    norms = rng.lognormal(0.0, 1.5, n)
    cosines = rng.uniform(-1.0, 1.0, n)
    along = norms * cosines
    consensus = float(rng.lognormal(-1.0, 1.0))
    room = list(rng.choice([1.0, 1.0, 0.5, 0.125], n))
    return list(shares), list(along), list(norms), consensus, room


@pytest.mark.parametrize("seed", range(40))
def test_every_contribution_ends_inside_the_region_and_inside_ones_are_untouched(seed):
    shares, along, norms, c, room = _cases(seed, 2 + seed % 9)
    coefficients = consensus_coefficients(shares, along, norms, c, REGION, room)
    for s, a, norm, f, (lam, mu) in zip(shares, along, norms, room, coefficients, strict=True):
        across = math.sqrt(max(norm * norm - a * a, 0.0))
        inside = (
            -REGION.against * f * c <= s * a <= REGION.along * f * c
            and s * across <= REGION.side * f * c
        )
        if inside:
            assert (lam, mu) == (1.0, 0.0)  # exactly: an honest run is bit for bit its own
            continue
        new_along, new_across = s * (lam * a + mu), s * lam * across
        tol = 1e-12 * max(1.0, abs(s * a), c)
        assert -REGION.against * f * c - tol <= new_along <= REGION.along * f * c + tol
        assert new_across <= REGION.side * f * c + tol
        # Nothing more than needed: a component within its bound keeps its value, one
        # beyond it ends on the bound.
        if -REGION.against * f * c <= s * a <= REGION.along * f * c:
            assert new_along == pytest.approx(s * a, rel=1e-12, abs=1e-300)
        else:
            edge = REGION.along if a > 0 else -REGION.against
            assert new_along == pytest.approx(edge * f * c, rel=1e-12)
        if s * across <= REGION.side * f * c:
            assert lam == 1.0
        else:
            assert new_across == pytest.approx(REGION.side * f * c, rel=1e-12)


def test_a_zero_consensus_sends_every_contribution_to_zero_and_a_zero_weight_none():
    (lam, mu), (lam0, mu0) = consensus_coefficients([1.0, 0.0], [0.3, 5.0], [1.0, 9.0], 0.0, REGION)
    assert lam == 0.0 and lam * 0.3 + mu == 0.0
    assert (lam0, mu0) == (1.0, 0.0)


def _decoded(sid: int, update: np.ndarray, weight: float) -> Decoded:
    return Decoded(sid, {"w": update.astype(np.float32)}, weight, MetricRecord({}), None)


@pytest.mark.parametrize("seed", range(6))
def test_holding_real_updates_matches_the_definition(seed):
    """Eight updates around a common direction, one reversed at 8 times the scale
    (its norm within the side bound, so only its direction gives it away) and one
    reversed and 50x larger: after holding, every contribution satisfies the bounds
    against the consensus recomputed here, both reversed ones are held and the others
    are untouched."""
    rng = np.random.default_rng(seed)
    common = rng.normal(size=500)
    updates = [common + rng.normal(scale=1.5, size=500) for _ in range(6)]
    updates.append(-8.0 * (common + rng.normal(scale=0.3, size=500)))  # reversed, 8x
    updates.append(-50.0 * (common + rng.normal(scale=1.5, size=500)))
    weights = list(rng.uniform(50, 150, 8))
    items = [_decoded(i, u, w) for i, (u, w) in enumerate(zip(updates, weights, strict=True))]
    room = [1.0] * 7 + [0.5]
    norms = [float(np.linalg.norm(u.astype(np.float32).astype(np.float64))) for u in updates]
    r = sorted(norms)[3]  # the reference norm: the lower median
    clipped = [
        u.astype(np.float32).astype(np.float64) * min(1.0, r / n)
        for u, n in zip(updates, norms, strict=True)
    ]
    c = sum(f * v for f, v in zip(room, clipped, strict=True)) / sum(room)
    size = float(np.linalg.norm(c))
    unit = c / size
    consensus = consensus_pass(
        [lambda item=item: item.deltas for item in items],
        [item.stable_id for item in items],
        norms,
        r,
        lambda sid: room[sid],
    )
    assert np.allclose(consensus["w"], c, rtol=1e-6, atol=1e-9 * size)
    held, got, _ = hold_to_consensus(items, consensus, REGION, room)
    assert got == pytest.approx(size, rel=1e-6)
    assert {6, 7} <= set(held) and all(0 < kept < 1 for kept in held.values())
    total = sum(weights)
    for item, original, f, s in zip(items, updates, room, weights, strict=True):
        after = item.load()["w"].astype(np.float64)
        v = (s / total) * after
        a = float(v @ unit)
        across = float(np.linalg.norm(v - a * unit))
        tol = 1e-5 * size
        assert -REGION.against * f * size - tol <= a <= REGION.along * f * size + tol
        assert across <= REGION.side * f * size + tol
        if item.stable_id not in held:
            assert np.array_equal(item.load()["w"], original.astype(np.float32))


def test_one_client_moves_the_consensus_by_at_most_two_references_over_n():
    """Whatever one client sends, the consensus the code builds moves by at most
    2 r / n (its update enters clipped to r into the plain mean of n): the consensus
    norms with any attack and with an honest update differ by at most that."""
    rng = np.random.default_rng(3)
    n, r = 10, 1.0
    honest = [rng.normal(size=300) * 0.4 for _ in range(n - 1)]
    replaced = rng.normal(size=300) * 0.4
    attacks = (rng.normal(size=300) * 1e6, -1e3 * sum(honest), np.zeros(300))

    def consensus_norm(last: np.ndarray) -> float:
        updates = [u.astype(np.float32) for u in [*honest, last]]
        norms = [float(np.linalg.norm(u.astype(np.float64))) for u in updates]
        loads = [lambda u=u: {"w": u} for u in updates]
        c = consensus_pass(loads, list(range(n)), norms, r, lambda sid: 1.0)["w"]
        return float(np.linalg.norm(c))

    base = consensus_norm(replaced)
    for attack in attacks:
        assert abs(consensus_norm(attack) - base) <= 2 * r / n * (1 + 1e-6)
    assert abs(consensus_norm(attacks[1]) - base) > r / n  # the bound is nearly reached


def test_the_regions_scale_is_never_below_its_floor():
    """Near convergence C shrinks while the clients' differences do not: the region's
    scale is max(C, floor). A contribution against the consensus by 0.3 of a floor
    of 1 (three times C) is held at the bare consensus scale and untouched with the
    floor; one against it by 0.8 of the floor is held to 0.5 of the floor."""
    c_dir = np.zeros(100)
    c_dir[0] = 1.0
    consensus = {"w": 0.1 * c_dir}  # C = 0.1
    for push, floor, held_expected, along_expected in (
        (0.3, 0.0, True, -0.05),
        (0.3, 1.0, False, -0.3),
        (0.8, 1.0, True, -0.5),
    ):
        update = -push * c_dir + 0.01 * np.eye(100)[1]
        items = [_decoded(0, update, 1.0)]
        held, size, _ = hold_to_consensus(items, consensus, REGION, [1.0], floor)
        assert size == pytest.approx(0.1)
        assert (0 in held) == held_expected
        after = items[0].load()["w"].astype(np.float64)
        assert after[0] == pytest.approx(along_expected, rel=1e-5)
