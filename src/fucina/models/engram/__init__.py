"""Engram: conditional n-gram memory grafted onto a decoder's residual stream
(plan: the hash geometry; layer: one memory layer; graft: the whole-model wrapper, its
file and its residual hooks; store: the safetensors file)."""
from fucina.models.engram.graft import Engram, attach_file, model_identity  # noqa: F401
from fucina.models.engram.plan import EngramError, HashPlan  # noqa: F401
