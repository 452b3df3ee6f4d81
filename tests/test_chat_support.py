"""Test support for the generation stack (imported by test_conversation*, test_api*,
test_kv*, ...): a byte-level fake tokenizer, a scripted fake decoder, and a tiny
random-weight llama GGUF written with gguf's GGUFWriter. Its own tests check the
helpers."""
from __future__ import annotations

import functools
import re

import numpy as np
import torch

from fucina.models.base import BaseConfig, DecoderBase
from fucina.models.cache import KVCache

SPECIALS = ["<|im_start|>", "<|im_end|>", "<s>", "</s>", "<think>", "</think>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<start_of_turn>", "<end_of_turn>"]
N_VOCAB = 300
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")


class FakeTokenizer:
    """Bytes 0..255 are tokens 0..255; SPECIALS follow from 256. The fucina tokenizer
    API subset the generation stack uses."""

    def __init__(self, add_bos: bool = False):
        self.specials = {s: 256 + i for i, s in enumerate(SPECIALS)}
        self.bos_id, self.eos_id = self.specials["<s>"], self.specials["</s>"]
        self.eog_ids = {self.eos_id, self.specials["<|im_end|>"], self.specials["<|eot_id|>"],
                        self.specials["<end_of_turn>"]}
        self.add_bos = add_bos
        self._split = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")

    @property
    def n_vocab(self) -> int:
        return N_VOCAB

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        out = [self.bos_id] if add_special and self.add_bos else []
        parts = self._split.split(text) if parse_special else [text]
        for p in parts:
            if parse_special and p in self.specials:
                out.append(self.specials[p])
            else:
                out.extend(p.encode("utf-8"))
        return out

    def encode_raw(self, text: str) -> list[int]:
        return self.encode(text, add_special=False, parse_special=True)

    def token_to_piece(self, i: int) -> bytes:
        if i < 256:
            return bytes([i])
        if i < 256 + len(SPECIALS):
            return SPECIALS[i - 256].encode()
        return b""

    def decode(self, ids) -> str:
        return b"".join(self.token_to_piece(int(i)) for i in ids).decode("utf-8", "replace")

    def token_id(self, text: str):
        return self.specials.get(text)

    def is_eog(self, i: int) -> bool:
        return i in self.eog_ids


class ScriptedDecoder(DecoderBase):
    """A fake model whose next token is a pure function of the token history, which it
    keeps in its own KV cache (so rewinds and reuse behave like a real model): after
    the last `<|im_start|>assistant\\n` it spells `reply` (bytes), then the stop id."""

    def __init__(self, reply: bytes | str = b"Hello!", stop: int = 257, n_layer: int = 2):
        self.reply = list(reply.encode() if isinstance(reply, str) else reply) + [stop]
        self.config = BaseConfig(arch="fake", n_vocab=N_VOCAB, n_embd=8, n_layer=n_layer, n_head=1,
                                 n_head_kv=1, head_dim=32, n_ff=8, n_ctx_train=512, rms_eps=1e-6,
                                 rope_base=10000.0, n_rot=32)
        self.marker = FakeTokenizer().encode("<|im_start|>assistant\n")
        self.steps = 0
        self.forwarded = 0

    def init_cache(self, capacity=None, dtype=torch.float16):
        return KVCache(self.config.n_layer, 1, 32, capacity or 512, dtype)

    def embed(self, ids):
        return ids.float()[:, None].expand(-1, 32)

    def block(self, i, x, cache, pos0):
        rows = x[:, None, :]
        cache.append(i, rows, rows)
        return x

    def _hidden(self, cache, tokens, pos0):
        self._cache = cache
        return super()._hidden(cache, tokens, pos0)

    def history(self, cache) -> list[int]:
        return [int(round(float(v))) for v in cache.keys(0, cache.len)[:, 0, 0]]

    def logits_for(self, _):
        hist = self.history(self._cache)
        m = self.marker
        start = None
        for j in range(len(hist) - len(m), -1, -1):
            if hist[j:j + len(m)] == m:
                start = j + len(m)
                break
        k = 0 if start is None else len(hist) - start
        target = self.reply[min(k, len(self.reply) - 1)]
        out = torch.full((N_VOCAB,), -5.0)
        out[target] = 5.0
        out[(target + 1) % N_VOCAB] = 4.0   # a runner-up so sampling has a choice
        return out

    def forward_step(self, cache, tokens, pos0):
        self._hidden(cache, tokens, pos0)
        self.steps += 1
        self.forwarded += len(tokens)
        return self.logits_for(None)

    def forward_step_all_logits(self, cache, tokens, pos0):
        raise NotImplementedError


def tiny_llama_gguf(path, *, n_layer=2, n_embd=64, n_head=2, n_head_kv=1, n_ff=128,
                    chat_template: str | None = CHATML, seed=0, arch="llama") -> str:
    """A random-weight llama GGUF (F32) with a byte vocabulary of N_VOCAB tokens."""
    import gguf

    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(N_VOCAB)
    w.add_tokenizer_model("gpt2")
    toks = [bytes([i]).decode("latin-1") for i in range(256)] + SPECIALS
    toks += [f"<unused{i}>" for i in range(N_VOCAB - len(toks))]
    w.add_token_list(toks)
    w.add_token_types([1] * 256 + [3] * (N_VOCAB - 256))
    w.add_bos_token_id(258)
    w.add_eos_token_id(259)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    def t(name, *shape, scale=None):
        a = rng.standard_normal(shape).astype(np.float32) * (scale or 1 / np.sqrt(shape[-1]))
        w.add_tensor(name, a)

    t("token_embd.weight", N_VOCAB, n_embd, scale=1.0)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    t("output.weight", N_VOCAB, n_embd, scale=3 / np.sqrt(n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, np.float32))
        if arch == "qwen3":
            w.add_tensor(p + "attn_q_norm.weight", (1 + 0.1 * rng.standard_normal(head_dim)).astype(np.float32))
            w.add_tensor(p + "attn_k_norm.weight", (1 + 0.1 * rng.standard_normal(head_dim)).astype(np.float32))
        t(p + "attn_q.weight", n_head * head_dim, n_embd)
        t(p + "attn_k.weight", n_head_kv * head_dim, n_embd)
        t(p + "attn_v.weight", n_head_kv * head_dim, n_embd)
        t(p + "attn_output.weight", n_embd, n_head * head_dim)
        t(p + "ffn_gate.weight", n_ff, n_embd)
        t(p + "ffn_up.weight", n_ff, n_embd)
        t(p + "ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@functools.lru_cache(maxsize=None)
def tiny_llama(tmp_dir: str, **kw):
    from fucina.models import load_model
    import os
    os.makedirs(tmp_dir, exist_ok=True)
    name = "tiny-" + "-".join(f"{k}{v}" for k, v in sorted(kw.items())) + ".gguf"
    return load_model(tiny_llama_gguf(os.path.join(tmp_dir, name), **kw))


def test_fake_tokenizer_round_trip():
    tok = FakeTokenizer()
    ids = tok.encode("<|im_start|>user\nhé<|im_end|>")
    assert ids[0] == 256 and ids[-1] == 257 and tok.decode(ids) == "<|im_start|>user\nhé<|im_end|>"
    assert tok.encode("<|im_end|>", parse_special=False) == list(b"<|im_end|>")


def test_tiny_llama_cached_equals_uncached(tmp_path):
    m = tiny_llama(str(tmp_path))
    ids = [1, 5, 9, 200, 7]
    c = m.init_cache(16)
    m.forward_step(c, ids[:3], 0)
    step = m.forward_step(c, ids[3:], 3)
    full = m.forward_last_logits(ids)
    assert torch.allclose(step, full, atol=1e-3)
