"""fedcomp's Flower server side: the decoding strategy wrapper and the ServerApp."""
