"""The ServerApp: Flower's FedAvg, wrapped by fedcomp (line 2 of 2)."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedcomp.flower import CompressedStrategy
from quickstart_fedcomp.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    torch.manual_seed(0)
    model = Net()
    strategy = CompressedStrategy(  # fedcomp, line 2 of 2
        FedAvg(fraction_evaluate=float(context.run_config["fraction-evaluate"])),
        codec={"name": "uniform", "bits": 2},
        downlink={"name": "uniform", "bits": 4},
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        train_config=ConfigRecord({"lr": float(context.run_config["lr"])}),
        num_rounds=int(context.run_config["num-server-rounds"]),
    )
    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")
