"""fucina.gguf: the file format - reader (mmap, zero-copy views, split files),
typed metadata helpers, the GGML type table. Writing uses the `gguf` package."""
from fucina.gguf.meta import Zero, meta_float, meta_float_opt, meta_int, meta_int_opt, meta_per_layer
from fucina.gguf.reader import GGUFFile, TensorInfo, open_gguf
from fucina.gguf.types import TYPE_SIZES, GGMLType, tensor_nbytes, type_name

__all__ = [
    "GGUFFile", "TensorInfo", "open_gguf", "GGMLType", "TYPE_SIZES", "tensor_nbytes",
    "type_name", "Zero", "meta_int", "meta_int_opt", "meta_float", "meta_float_opt",
    "meta_per_layer",
]
