"""Thin entry points (Hydra runs, reports) that wire fedcomp, clients and strategies.

Importing this package sets the process hygiene Flower and Ray need before flwr is
imported: no telemetry, a project-local FLWR_HOME, and a Ray temp dir of our own.
"""

from experiments.runtime import prepare_environment

prepare_environment()
