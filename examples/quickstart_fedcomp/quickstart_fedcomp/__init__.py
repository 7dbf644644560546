"""quickstart-fedcomp: a Flower app in the quickstart shape, compressed by fedcomp."""
