"""numpy-logreg: Flower's NumPy/scikit-learn quickstart shape (float64 arrays)."""
