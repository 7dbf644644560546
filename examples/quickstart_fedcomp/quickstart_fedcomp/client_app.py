"""The ClientApp: Flower's quickstart handlers, plus fedcomp's mod (line 1 of 2)."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedcomp.flower import CompressionMod
from quickstart_fedcomp.task import Net, load_data, test, train

app = ClientApp(mods=[CompressionMod()])  # fedcomp, line 1 of 2


def _data(context: Context) -> tuple:
    return load_data(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )


@app.train()
def train_handler(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainset, _ = _data(context)
    loss = train(
        model,
        trainset,
        int(context.run_config["local-epochs"]),
        float(msg.content["config"]["lr"]),
    )
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(trainset[1])})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_handler(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, testset = _data(context)
    loss, accuracy = test(model, testset)
    metrics = MetricRecord(
        {"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(testset[1])}
    )
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


torch.set_num_threads(1)
