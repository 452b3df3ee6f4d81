"""fucina.models: the decoder contract, the KV cache, the architecture registry and one
module per family.

Names resolve lazily so that `fucina.models.hub` (where models come from) can be used
without importing torch: `fucina info`, `tokenize` and `pull` never compute.
"""
import importlib

_WHERE = {
    "default_model_path": "fucina.models.hub", "resolve_model": "fucina.models.hub",
    "BaseConfig": "fucina.models.base", "Decoder": "fucina.models.base", "DecoderBase": "fucina.models.base",
    "KVCache": "fucina.models.cache",
    "FAMILIES": "fucina.models.registry", "family": "fucina.models.registry",
    "load_model": "fucina.models.registry",
}

__all__ = list(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'fucina.models' has no attribute {name!r}")
