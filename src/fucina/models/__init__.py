"""fucina.models: the decoder contract, the KV cache, the architecture registry and one
module per family."""
from fucina.models.base import BaseConfig, Decoder, DecoderBase
from fucina.models.cache import KVCache
from fucina.models.hub import default_model_path, resolve_model
from fucina.models.registry import FAMILIES, family, load_model

__all__ = ["default_model_path", "resolve_model", "BaseConfig", "Decoder", "DecoderBase", "KVCache", "FAMILIES", "family", "load_model"]
