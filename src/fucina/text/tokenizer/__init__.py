"""Tokenizers built from GGUF metadata, token-ID-exact with llama.cpp (b11434).

    tok = Tokenizer.from_gguf(path)            # or Tokenizer.from_metadata(meta)
    ids = tok.encode("Hello")                  # BOS/EOS per the vocabulary's policy
    ids = tok.encode_raw("<|im_start|>user")   # no BOS/EOS; special tokens parsed
    text = tok.decode(ids)
    sd = StreamDecoder(tok); text = sd.push(id) ... + sd.flush()

Byte-level BPE (`tokenizer.ggml.model = gpt2`, pretokenizer by `tokenizer.ggml.pre`),
SentencePiece (`llama`, e.g. Gemma 3) and Gemma 4's SentencePiece-style BPE (`gemma4`)
are supported; other models (bert, t5, rwkv, plamo2) raise TokenizerError.

Where we differ from llama.cpp, on purpose:
- An unimplemented `tokenizer.ggml.pre` encodes with the qwen2 rules, warns once and
  is kept in `Tokenizer.pre_mismatch` (llama.cpp refuses to load).
- `decode` is lossless by default; llama_detokenize also rewrites " ," -> "," etc. for
  vocabularies with `clean_spaces` (Llama 3, GPT-2 family): pass
  `clean_spaces=tok.clean_spaces` for that. Invalid UTF-8 decodes to U+FFFD
  (`decode_bytes` gives the raw bytes).
- Malformed UTF-8 input (bytes) is tokenized exactly as llama.cpp does, except that a
  4-byte sequence above U+10FFFF, on which llama.cpp's BPE aborts, reads as U+FFFD.
- `eot_id`, when the metadata names none, is the first of llama.cpp's candidate texts
  in its list order (llama.cpp takes a hash-map order: for SmolLM2 it picks
  <|endoftext|>, we <|im_end|>). The end-of-generation set is the same.
"""
from fucina.text.tokenizer.core import Tokenizer
from fucina.text.tokenizer.stream import StreamDecoder

__all__ = ["Tokenizer", "StreamDecoder"]
