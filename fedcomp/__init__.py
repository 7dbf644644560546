"""fedcomp: communication-efficient federated learning for Flower.

The ``fedcomp`` package is the core: codecs and their wire format, public
randomness, settings, datasets, models and the results schema, none of which imports
``flwr``; and one Flower-facing subpackage, ``fedcomp.flower``, with the client mod
and the server strategy wrapper (``from fedcomp.flower import CompressionMod,
CompressedStrategy``). The repository's own ClientApp and ServerApp (``clients/``,
``strategies/``) are built from them.
"""

__version__ = "0.1.0"
