"""fucina.quant: the GGML block formats - dequantize every type, quantize the encodable ones.
Pure functions over bytes and tensors; no model knowledge."""
from fucina.quant.dequant import dequantize, dequantize_rows
from fucina.quant.formats import block_size, row_bytes, type_size
from fucina.quant.quantize import ENCODABLE, quantize

__all__ = ["dequantize", "dequantize_rows", "quantize", "ENCODABLE", "block_size", "type_size", "row_bytes"]
