"""``adaptive``: EDEN's bits chosen per tensor and per round from the update itself,
under one bit budget for the whole reply.

A reply may spend ``bits`` bits a coordinate on average over its compressed tensors.
After EDEN's random rotation a tensor's coordinates are close to Gaussian whatever the
tensor, so b-bit EDEN leaves an expected squared error of nu(b) ||x_t||^2 on tensor t
(nu: EDEN's normalized MSE, :func:`fedcomp.codecs.eden.normalized_mse`, 0.571 at 1
bit, 0.133 at 2) and costs b n_t bits (n_t its coordinates). :func:`allocate_bits`
chooses each tensor's b_t among the allowed widths to make sum_t nu(b_t) ||x_t||^2
small under sum_t b_t n_t <= bits sum_t n_t: tensors with more energy per coordinate
get more bits (reverse water-filling), the rest the fewest. The choice is the
client's, from its own update in this round; the server reads each tensor's width
from its payload and checks the reply against the budget, not the choice.

It is the per-tensor half of adaptive quantization (compare NVIDIA FLARE's ADAQUANT and
DAdaQuant, whose width also adapts over rounds and across clients: not built here).
The codes stay EDEN's: unbiased with its default unbiased scale and two rotations.

Body layout (little-endian), after the common header: the inner EDEN payload of the
tensor's coordinates as one float32 vector (fedcomp.codecs.base.pack_inner: one byte,
codec id and seed flag, then EDEN's body, which names its width; the inner header, a
float32 vector of numel values seeded inner_seed(seed), is the reader's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

import torch

from fedcomp.codecs.base import (
    Codec,
    decode_inner,
    header_for,
    inner_seed,
    pack_inner,
    parse_inner_vector,
    register,
)
from fedcomp.codecs.eden import MAX_BITS, EdenCodec, normalized_mse
from fedcomp.codecs.wire import Payload, PayloadError, SpecMismatch, check_field


def allocate_bits(
    sizes: Mapping[str, int],
    energies: Mapping[str, float],
    budget: float,
    choices: Sequence[int],
    nmse: Callable[[int], float],
) -> dict[str, int]:
    """Each tensor's width: sum_t nmse(b_t) energy_t made small under sum_t b_t size_t
    <= budget sum_t size_t.

    Greedy first (the step with the largest error reduction per extra bit that still
    fits, until none fits), then single-step exchanges (one tensor one width up,
    another one down, or one alone) while one lowers the error and fits: the result
    admits no such improving move. Deterministic: ties go to the first name.
    """
    names = [n for n in sizes if sizes[n] > 0]  # an empty tensor costs nothing at any width
    cap = budget * sum(sizes.values())
    level = dict.fromkeys(sizes, 0)

    def err(n: str, i: int) -> float:
        return nmse(choices[i]) * energies[n]

    def cost(n: str, i: int) -> float:
        return choices[i] * sizes[n]

    spent = sum(cost(n, 0) for n in names)
    while True:  # greedy: the best error reduction per bit that fits
        best: tuple[float, str] | None = None
        for n in names:
            i = level[n]
            if i + 1 < len(choices) and spent + cost(n, i + 1) - cost(n, i) <= cap:
                gain = (err(n, i) - err(n, i + 1)) / (cost(n, i + 1) - cost(n, i))
                if best is None or gain > best[0]:
                    best = (gain, n)
        if best is None:
            break
        n = best[1]
        spent += cost(n, level[n] + 1) - cost(n, level[n])
        level[n] += 1
    _exchange(level, names, len(choices), cap, spent, err, cost)
    return {n: choices[level[n]] for n in sizes}


def _exchange(
    level: dict[str, int],
    names: list[str],
    widths: int,
    cap: float,
    spent: float,
    err: Callable[[str, int], float],
    cost: Callable[[str, int], float],
) -> None:
    """Apply the best improving move (one tensor up a width and one down, or one tensor
    up alone) that fits, until there is none."""
    while True:
        best: tuple[float, str, str | None] | None = None
        for up in names:
            i = level[up]
            if i + 1 >= widths:
                continue
            d_err, d_cost = err(up, i + 1) - err(up, i), cost(up, i + 1) - cost(up, i)
            for down in [None, *names]:
                if down == up:
                    continue
                e, c = d_err, d_cost
                if down is not None:
                    j = level[down]
                    if j == 0:
                        continue
                    e += err(down, j - 1) - err(down, j)
                    c += cost(down, j - 1) - cost(down, j)
                if spent + c <= cap and e < -1e-12 * max(1.0, abs(err(up, i))):
                    if best is None or e < best[0]:
                        best = (e, up, down)
        if best is None:
            return
        _, up, down = best
        spent += cost(up, level[up] + 1) - cost(up, level[up])
        level[up] += 1
        if down is not None:
            spent += cost(down, level[down] - 1) - cost(down, level[down])
            level[down] -= 1


@cache
def eden_nmse(bits: int) -> float:
    """EDEN's normalized MSE at ``bits`` (cached: a Lloyd-Max design per width)."""
    return normalized_mse(bits)


@register
class AdaptiveCodec(Codec):
    """EDEN at a width chosen per tensor under a reply's bit budget (see the module).

    Parameters
    ----------
    bits : float
        The budget: bits a coordinate on average over a reply's compressed tensors
        (EDEN's per-block scales not counted), within the allowed widths.
    choices : sequence of int in 1..4
        The allowed widths.
    scale, block, rotations
        EDEN's (fedcomp.codecs.eden.EdenCodec).
    schedule : {"fixed", "loss"}
        The budget over the rounds: ``bits`` every round, or DAdaQuant's time rule
        (fedcomp.budgets.LossSchedule): from ``start``, one bit more after ``patience``
        rounds without a new lowest server loss, at most ``bits``.
    start : float, optional
        The loss schedule's first budget (default: the narrowest width).
    patience : int >= 1
        The loss schedule's rounds without a new lowest loss before a bit is added.
    clients : {"same", "weights"}
        One budget for every client, or DAdaQuant's client rule for EDEN's curve
        (fedcomp.budgets.weight_budgets: one bit more for twice the weight, the mean
        kept). Both rules are the server's: it sends each client its budget.
    """

    codec_id = 17
    name = "adaptive"
    family = "adaptive"
    needs_seed = True
    unbiased = True  # set from EDEN's

    def __init__(
        self,
        bits: float = 1.5,
        choices: Sequence[int] = (1, 2, 3, 4),
        scale: str = "unbiased",
        block: int = 1024,
        rotations: int = 2,
        schedule: str = "fixed",
        start: float | None = None,
        patience: int = 5,
        clients: str = "same",
    ) -> None:
        widths = list(choices) if isinstance(choices, list | tuple) else None
        if (
            not widths
            or any(
                isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_BITS
                for b in widths
            )
            or widths != sorted(set(widths))
        ):
            raise ValueError(
                f"adaptive: choices must be increasing distinct integers in 1..{MAX_BITS}, "
                f"got {choices!r}"
            )
        if (
            isinstance(bits, bool)
            or not isinstance(bits, int | float)
            or not (math.isfinite(bits) and widths[0] <= bits <= widths[-1])
        ):
            raise ValueError(
                f"adaptive: bits (the budget) must be in [{widths[0]}, {widths[-1]}], "
                f"the allowed widths' range, got {bits!r}"
            )
        self.bits, self.choices = float(bits), tuple(widths)
        self.schedule, self.clients, self.patience, self.start = _adaptation(
            schedule, clients, patience, widths[0] if start is None else start, self.choices
        )
        if self.start > self.bits:
            raise ValueError(f"adaptive: start {self.start!r} is above bits {self.bits!r}")
        self.eden = {b: EdenCodec(b, scale=scale, block=block, rotations=rotations) for b in widths}
        self.unbiased = self.eden[widths[0]].unbiased

    def spec(self) -> dict[str, Any]:
        eden = self.eden[self.choices[0]].spec()
        return {
            "name": self.name,
            "bits": self.bits,
            "choices": list(self.choices),
            **{k: eden[k] for k in ("scale", "block", "rotations")},
            **(
                {"schedule": self.schedule, "start": self.start, "patience": self.patience}
                if self.schedule != "fixed"
                else {}
            ),
            **({"clients": self.clients} if self.clients != "same" else {}),
        }

    @property
    def adapts(self) -> bool:
        """Whether the server sets each client's budget each round."""
        return self.schedule != "fixed" or self.clients != "same"

    def check_budget_value(self, budget: float) -> float:
        """A budget the server sent: within the allowed widths and at most ``bits``."""
        if not (math.isfinite(budget) and self.choices[0] <= budget <= self.bits):
            raise ValueError(
                f"{self.name}: budget {budget!r} is not in [{self.choices[0]}, {self.bits}]"
            )
        return float(budget)

    def allocate(
        self, deltas: Mapping[str, torch.Tensor], budget: float | None = None
    ) -> dict[str, int]:
        """Each tensor's width for this reply (the client's choice), under ``budget``
        (the server's for this round, else ``bits``)."""
        energies = {n: float(torch.sum(d.detach().double() ** 2)) for n, d in deltas.items()}
        sizes = {n: d.numel() for n, d in deltas.items()}
        cap = self.bits if budget is None else budget
        return allocate_bits(sizes, energies, cap, self.choices, eden_nmse)

    def encode(self, x: torch.Tensor, *, seed: int) -> Payload:
        """A tensor alone (a downlink step, a tool): the widest width the budget pays."""
        return self.encode_at(x, self.lone_width, seed=seed)

    def encode_at(self, x: torch.Tensor, bits: int, *, seed: int) -> Payload:
        """``x`` in ``bits``-bit EDEN, one of the allowed widths."""
        if not x.is_floating_point():
            raise ValueError(f"{self.name} codec needs a floating-point tensor, got {x.dtype}")
        flat = x.detach().reshape(-1).to(torch.float32).contiguous()
        inner = self.eden[bits].encode(flat, seed=inner_seed(seed))
        return Payload(header_for(self.codec_id, x, seed), pack_inner(inner))

    @classmethod
    def _inner(cls, payload: Payload) -> Payload:
        if not payload.header.dtype.is_floating_point:
            raise PayloadError(f"{cls.name}: payload declares a non-float dtype")
        inner = parse_inner_vector(cls, payload.body, payload.header.numel, payload.header.seed)
        if inner.header.codec_id != EdenCodec.codec_id:
            raise PayloadError(f"{cls.name}: inner codec id {inner.header.codec_id} is not EDEN's")
        return inner

    @classmethod
    def read_params(cls, payload: Payload) -> dict[str, int]:
        return EdenCodec.read_params(cls._inner(payload))

    @classmethod
    def width_of(cls, payload: Payload) -> int:
        """The EDEN width a payload of this codec uses."""
        return int(cls.read_params(payload)["bits"])

    def check_payload(self, payload: Payload) -> None:
        """The codec id, then the inner EDEN payload against EDEN at an allowed width
        (its other parameters and its seed as this spec says)."""
        check_field(self.name, "codec id", payload.header.codec_id, self.codec_id)
        inner = self._inner(payload)
        bits = EdenCodec.read_params(inner)["bits"]
        if bits not in self.choices:
            raise SpecMismatch(
                f"{self.name}: width {bits} is not one of the allowed {list(self.choices)}"
            )
        self.eden[bits].check_payload(inner)
        check_field(
            f"{self.name} inner eden", "seed", inner.header.seed, inner_seed(payload.header.seed)
        )

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        h = payload.header
        values = decode_inner(cls._inner(payload), cls.name).reshape(-1).to(torch.float32)
        return values.reshape(h.shape).to(h.dtype)

    def nominal_bits(self, numel: int) -> float:
        """What :meth:`encode` spends on a lone tensor (the widest width the budget pays,
        with EDEN's scales); a reply spends at most the budget (the server checks)."""
        return self.eden[self.lone_width].nominal_bits(numel)

    @property
    def lone_width(self) -> int:
        """The width of a tensor encoded alone: the widest the budget pays."""
        return max(b for b in self.choices if b <= self.bits)


def _adaptation(
    schedule: Any, clients: Any, patience: Any, start: Any, choices: Sequence[int]
) -> tuple[str, str, int, float]:
    """The adaptive codec's server-side rules, checked (fedcomp.budgets)."""
    if schedule not in ("fixed", "loss"):
        raise ValueError(f"adaptive: schedule must be fixed or loss, got {schedule!r}")
    if clients not in ("same", "weights"):
        raise ValueError(f"adaptive: clients must be same or weights, got {clients!r}")
    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
        raise ValueError(f"adaptive: patience must be an integer >= 1, got {patience!r}")
    if (
        isinstance(start, bool)
        or not isinstance(start, int | float)
        or not (math.isfinite(start) and choices[0] <= start <= choices[-1])
    ):
        raise ValueError(
            f"adaptive: start must be in [{choices[0]}, {choices[-1]}], got {start!r}"
        )
    return schedule, clients, patience, float(start)
