"""FedAvg on the float64 model, wrapped by fedcomp."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedcomp.flower import CompressedStrategy

app = ServerApp()


def initial_arrays() -> ArrayRecord:
    return ArrayRecord(
        {
            "w": Array(np.zeros((64, 10), dtype=np.float64)),
            "b": Array(np.zeros(10, dtype=np.float64)),
            "steps": Array(np.zeros(1, dtype=np.int64)),
        }
    )


@app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = CompressedStrategy(
        FedAvg(), codec={"name": "uniform", "bits": 4}, downlink={"name": "uniform", "bits": 4}
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=initial_arrays(),
        num_rounds=int(context.run_config["num-server-rounds"]),
    )
    np.savez("final_model.npz", **{k: v.numpy() for k, v in result.arrays.items()})
