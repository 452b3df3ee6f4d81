"""A harmony-capable vocabulary for tiny gpt-oss models: GPT-2 byte tokens plus the
o200k_harmony special tokens gpt-oss's chat format uses (control tokens, as in the
published files; `<|return|>` is EOS), with a chat template (the built-in harmony one
unless given). `write_harmony_vocab` writes it as a vocab-only GGUF that
`synth_gptoss.write_gptoss(..., vocab=path)` copies, so the model file loads in fucina
and in llama.cpp alike."""
from __future__ import annotations

import gguf

from synth import byte_tokens

HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                    "<|start|>", "<|end|>", "<|message|>", "<|call|>", "<|endofprompt|>"]


def write_harmony_vocab(path, template: str | None = None) -> str:
    from fucina.text.chat_template import BUILTIN

    w = gguf.GGUFWriter(str(path), "gpt-oss")
    byte_tok = byte_tokens()
    tokens = [byte_tok[b] for b in range(256)] + ["ab"] + HARMONY_SPECIALS
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3] * len(HARMONY_SPECIALS))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(tokens.index("<|startoftext|>"))
    w.add_eos_token_id(tokens.index("<|return|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(template if template is not None else BUILTIN["harmony"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
