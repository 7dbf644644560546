"""The Flower-facing half of fedcomp: the client mod and the server strategy wrapper.

The two lines a Flower app needs::

    from fedcomp.flower import CompressedStrategy, CompressionMod

    app = ClientApp(mods=[CompressionMod()])                       # client
    strategy = CompressedStrategy(FedAvg(), codec={"name": "uniform", "bits": 4})  # server

This subpackage is the only part of fedcomp that imports flwr; the algorithm core
(codecs, one-bit code, control variates, trees) below it does not.
"""

from fedcomp.flower.mod import CompressionMod
from fedcomp.flower.strategy import CompressedStrategy

__all__ = ["CompressedStrategy", "CompressionMod"]
