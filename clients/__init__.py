"""fedcomp's Flower client side: the compression mod and the example ClientApp."""
