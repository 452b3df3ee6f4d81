"""Tokenizers built from GGUF metadata, token-ID-exact with llama.cpp (b11434).

    tok = Tokenizer.from_gguf(path)            # or Tokenizer.from_metadata(meta)
    ids = tok.encode("Hello")                  # BOS/EOS per the vocabulary's policy
    ids = tok.encode_raw("<|im_start|>user")   # no BOS/EOS; special tokens parsed
    text = tok.decode(ids)
    sd = StreamDecoder(tok); text = sd.push(id) ... + sd.flush()

Byte-level BPE (`tokenizer.ggml.model = gpt2`, pretokenizer by `tokenizer.ggml.pre`)
and SentencePiece (`llama`, e.g. Gemma) are supported.
"""
from fucina.text.tokenizer.core import Tokenizer
from fucina.text.tokenizer.stream import StreamDecoder

__all__ = ["Tokenizer", "StreamDecoder"]
