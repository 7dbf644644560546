"""fedcomp: communication-efficient federated learning for Flower.

The ``fedcomp`` package is the core: codecs and their wire format, public
randomness, settings, datasets, models and the results schema. It never imports
``flwr``; the Flower side lives in the ``clients`` and ``strategies`` packages.
"""

__version__ = "0.1.0"
