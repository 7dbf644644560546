"""The Flower-facing half of fedcomp: the client mod and the server strategy wrapper.

The two lines a Flower app needs::

    from fedcomp.flower import CompressedStrategy, CompressionMod

    app = ClientApp(mods=[CompressionMod()])                       # client
    strategy = CompressedStrategy(FedAvg(), codec={"name": "uniform", "bits": 4})  # server

This subpackage is the only part of fedcomp that imports flwr; the algorithm core
(codecs, one-bit code, control variates, trees) below it does not. The wrapper's
options (``ServerOptions`` holding ``Aggregation``, ``Influence`` and ``IdentityOptions``;
``Reporting``) are plain dataclasses, re-exported here for convenience.
"""

from fedcomp.flower.mod import CompressionMod
from fedcomp.flower.options import IdentityOptions, ServerOptions
from fedcomp.flower.strategy import CompressedStrategy
from fedcomp.handoff_options import Aggregation
from fedcomp.influence import Influence
from fedcomp.observers import Reporting

__all__ = [
    "Aggregation",
    "CompressedStrategy",
    "CompressionMod",
    "IdentityOptions",
    "Influence",
    "Reporting",
    "ServerOptions",
]
