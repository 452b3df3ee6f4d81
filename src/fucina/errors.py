"""The typed errors every layer raises. Bad input gets one of these, never a crash."""


class FucinaError(Exception):
    """Base of every error fucina raises on purpose."""


class InvalidArgument(FucinaError, ValueError):
    """A caller's argument has the wrong type or is out of range; the message names it."""


class GGUFError(FucinaError):
    """A GGUF file is unreadable, corrupt, or uses something we do not support."""


class InvalidConfig(FucinaError):
    """Model metadata is present but unusable (negative, zero where forbidden, inconsistent)."""


class MissingMetadata(InvalidConfig):
    """A required metadata key is absent."""


class UnsupportedArchitecture(FucinaError):
    """`general.architecture` names a family fucina does not implement."""


class KVCacheError(FucinaError):
    """KV cache overflow, shape mismatch, or a head_dim a storage type cannot hold."""


class ContextFull(KVCacheError):
    """A prompt or turn does not fit the context window."""


class TokenizerError(FucinaError):
    """Tokenizer metadata is missing or inconsistent."""


class SamplingError(FucinaError):
    """Sampling cannot proceed (e.g. every token masked by a logit processor)."""


class GrammarError(FucinaError):
    """A JSON schema, regex or grammar is malformed, or uses a feature that cannot be enforced."""


class QuantError(FucinaError):
    """A GGML block buffer is malformed (wrong length) or its type is unknown or not encodable."""


class PipelineError(FucinaError):
    """A pipeline stage group (torch.distributed) cannot serve: a stage died, stopped
    answering, or the ranks disagree on the model or the split."""


class CartridgeError(FucinaError):
    """A cartridge (a trained KV prefix) does not fit the model or cache it is given, its
    file is corrupt, or its prefix does not fit the context."""


class SchemaWarning(UserWarning):
    """A JSON schema keyword the grammar engine cannot enforce while generating (lenient
    structured output): the rest is enforced and the reply is checked after generation."""
