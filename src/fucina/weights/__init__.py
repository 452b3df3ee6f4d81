"""fucina.weights: weights kept in their GGUF type (`LinearWeight`, `ExpertStack`)."""
from fucina.weights.experts import ExpertStack
from fucina.weights.linear import LinearWeight, bytes_view

__all__ = ["ExpertStack", "LinearWeight", "bytes_view"]
