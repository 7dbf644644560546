"""Heavy-tailed update perturbations: the one-bit experiments' stress test.

Each client's update gets independent Student-t noise, ``scale * t_df`` per
coordinate, added after local training and before compression, so every codec sees
the same heavy-tailed updates (docs/onebit.md's setting: a large, unknown offset plus
heavy tails). Seeded from (run seed, round, stable client id): runs are reproducible.
"""

from __future__ import annotations

import torch

from fedcomp.rng import numpy_generator


def perturb_update(
    model: torch.nn.Module,
    *,
    df: float,
    scale: float,
    run_seed: int,
    server_round: int,
    stable_id: int,
) -> None:
    """Add ``scale * Student-t(df)`` noise to every floating-point parameter, in place.

    ``df <= 0`` or ``scale == 0`` leaves the model unchanged. Buffers (BatchNorm
    statistics, counters) are not touched: they are not part of the optimized update.
    """
    if df <= 0 or scale == 0:
        return
    rng = numpy_generator(run_seed, "update-noise", server_round, stable_id)
    with torch.no_grad():
        for param in model.parameters():
            if not param.is_floating_point():
                continue
            noise = rng.standard_t(df, size=tuple(param.shape)) * scale
            param.add_(torch.from_numpy(noise).to(param.dtype).to(param.device))
