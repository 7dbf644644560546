"""A float64 NumPy logistic regression on scikit-learn's digits, plus fedcomp's mod.

The model is float64 weights and biases and an int64 step counter: the mod encodes the
float tensors (in float32 inside the codecs where they need it) and the counter raw,
and the app gets its own dtypes back."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from sklearn.datasets import load_digits

from fedcomp.flower import CompressionMod

app = ClientApp(mods=[CompressionMod()])
X, Y = load_digits(return_X_y=True)
X = X / 16.0


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _partition(context: Context) -> tuple[np.ndarray, np.ndarray]:
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    return X[pid::n], Y[pid::n]


@app.train()
def train(msg: Message, context: Context) -> Message:
    arrays = msg.content["arrays"]
    w, b = arrays["w"].numpy().copy(), arrays["b"].numpy().copy()
    x, y = _partition(context)
    lr = float(context.run_config.get("lr", 0.5))
    for _ in range(int(context.run_config.get("local-steps", 20))):
        p = _softmax(x @ w + b)
        p[np.arange(len(y)), y] -= 1.0
        w -= lr * x.T @ p / len(y)
        b -= lr * p.mean(axis=0)
    steps = arrays["steps"].numpy() + 1
    model = ArrayRecord({"w": Array(w), "b": Array(b), "steps": Array(steps)})
    metrics = MetricRecord({"num-examples": len(y)})
    return Message(RecordDict({"arrays": model, "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    arrays = msg.content["arrays"]
    x, y = _partition(context)
    accuracy = float((np.argmax(x @ arrays["w"].numpy() + arrays["b"].numpy(), 1) == y).mean())
    metrics = MetricRecord({"accuracy": accuracy, "num-examples": len(y)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
