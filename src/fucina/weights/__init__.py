"""fucina.weights: weights kept in their GGUF type (`LinearWeight`)."""
from fucina.weights.linear import LinearWeight, bytes_view

__all__ = ["LinearWeight", "bytes_view"]
