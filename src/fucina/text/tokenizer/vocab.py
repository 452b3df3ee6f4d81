"""The vocabulary as llama.cpp reads it from GGUF metadata (llama_vocab::impl::load).

Everything policy-like lives here: which tokens are special (split out before
pretokenizing), the BOS/EOS defaults per tokenizer kind, the end-of-generation set,
and the per-pre flags. The encoders (`bpe.py`, `spm.py`) only consume it.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from fucina.errors import TokenizerError
from fucina.text.tokenizer.pretokenize import FALLBACK_PRE, PRE_SPECS, PreSpec

log = logging.getLogger("fucina.tokenizer")

# llama_token_attr bits
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8
# tokenizer.ggml.token_type values -> attribute (index = type; 0 and >6 are UNDEFINED)
_TYPE_TO_ATTR = np.array([ATTR_UNDEFINED, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_CONTROL,
                          ATTR_USER_DEFINED, ATTR_UNUSED, ATTR_BYTE], dtype=np.int32)

_ID_KEYS = {
    "bos": "bos_token_id", "eos": "eos_token_id", "eot": "eot_token_id", "eom": "eom_token_id",
    "unk": "unknown_token_id", "sep": "seperator_token_id", "pad": "padding_token_id",
    "mask": "mask_token_id", "fim_pre": "fim_pre_token_id", "fim_suf": "fim_suf_token_id",
    "fim_mid": "fim_mid_token_id", "fim_pad": "fim_pad_token_id", "fim_rep": "fim_rep_token_id",
    "fim_sep": "fim_sep_token_id",
}
_DEPRECATED_KEYS = {"fim_pre": "prefix_token_id", "fim_suf": "suffix_token_id",
                    "fim_mid": "middle_token_id"}

# Texts llama.cpp recognises when the metadata names no such token (first found wins).
_AUTODETECT = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
            "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
            "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def _merges(meta: Mapping[str, Any]) -> list[str]:
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise TokenizerError("BPE vocabulary without tokenizer.ggml.merges")
    return merges


class Vocab:
    """Tokens, attributes, special ids and flags, decided the way llama.cpp decides them."""

    def __init__(self, meta: Mapping[str, Any]):
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("GGUF has no tokenizer.ggml.model")
        if model == "llama":
            self.kind = "spm"
        elif model == "gpt2":
            self.kind = "bpe"
        elif model == "gemma4":
            self.kind = "gemma4"   # SentencePiece-style BPE (text/tokenizer/gemma4.py)
        else:
            raise TokenizerError(f"unsupported tokenizer model {model!r} (supported: gpt2, llama, gemma4)")
        self.model = str(model)
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens[:8]):
            raise TokenizerError("tokenizer.ggml.tokens is missing or not a string array")
        n = len(tokens)
        self.n_vocab = n

        # --- flags by kind, then by pre (llama.cpp's defaults; metadata wins below) ---
        self.pre = meta.get("tokenizer.ggml.pre")
        self.pre_spec: PreSpec | None = None
        self.pre_mismatch: str | None = None
        self.add_bos = self.add_eos = False
        self.add_space_prefix = False
        self.ignore_merges = False
        self.clean_spaces = False
        self.escape_whitespaces = True
        ids = {k: None for k in _ID_KEYS}
        ids.update(bos=1, eos=2, unk=0)
        if self.kind == "bpe":
            self.merges: list[str] = _merges(meta)
            ids.update(bos=11, eos=11, unk=None)
            self.escape_whitespaces = False
            self.clean_spaces = True
            pre = self.pre or "default"
            spec = PRE_SPECS.get(pre)
            if spec is None:
                self.pre_mismatch = pre
                log.warning("tokenizer.ggml.pre %r is not implemented; encoding with the %s rules "
                            "(token ids may differ from llama.cpp)", pre, FALLBACK_PRE)
                spec = PRE_SPECS[FALLBACK_PRE]
            self.pre_spec = spec
            self.ignore_merges = spec.ignore_merges
            self.clean_spaces = spec.clean_spaces
            if spec.add_bos is not None:
                self.add_bos = spec.add_bos
            if spec.bos_null:
                ids["bos"] = None
        elif self.kind == "gemma4":   # merges required, no default special ids, BOS always (below)
            self.merges = _merges(meta)
            ids.update(bos=None, eos=None, unk=None)
        else:
            self.merges = []
            self.add_space_prefix = True
            self.add_bos = True
        v = meta.get("tokenizer.ggml.add_space_prefix")
        if v is not None:
            self.add_space_prefix = bool(v)
        self.remove_extra_whitespaces = bool(meta.get("tokenizer.ggml.remove_extra_whitespaces", False))

        # --- tokens, scores, attributes ---
        token_to_id = dict(zip(tokens, range(n)))          # duplicates: the last id wins
        if "" in token_to_id:
            tokens = list(tokens)
            for i, t in enumerate(tokens):
                if t == "":
                    tokens[i] = f"[EMPTY_{i}]"
            token_to_id = dict(zip(tokens, range(n)))
        self.tokens: list[str] = tokens
        self.token_to_id: dict[str, int] = token_to_id
        scores = meta.get("tokenizer.ggml.scores")
        if scores is not None:
            scores = np.asarray(scores)
            if scores.ndim != 1 or len(scores) < n:
                raise TokenizerError("tokenizer.ggml.scores is shorter than the vocabulary")
        self.scores = scores
        types = meta.get("tokenizer.ggml.token_type")
        if types is None:
            attrs = np.full(n, ATTR_NORMAL, dtype=np.int32)
        else:
            types = np.asarray(types)
            if types.ndim != 1 or len(types) < n:
                raise TokenizerError("tokenizer.ggml.token_type is shorter than the vocabulary")
            t = types[:n].astype(np.int64)
            t = np.where((t < 0) | (t >= len(_TYPE_TO_ATTR)), 0, t)
            attrs = _TYPE_TO_ATTR[t]
        self.attrs: list[int] = attrs.tolist()

        # --- special ids: defaults out of range are disabled, metadata overrides in range ---
        for k, key in _ID_KEYS.items():
            if ids[k] is not None and ids[k] >= n:
                ids[k] = None
            for full in ("tokenizer.ggml." + key, "tokenizer.ggml." + _DEPRECATED_KEYS.get(k, key)):
                val = meta.get(full)
                if val is None:
                    continue
                try:
                    val = int(val)
                except (TypeError, ValueError) as e:
                    raise TokenizerError(f"{full} is not an integer: {val!r}") from e
                if 0 <= val < n:
                    ids[k] = val
                else:
                    log.warning("%s = %d is out of the vocabulary; keeping %s", full, val, ids[k])
        for k, flag in (("add_bos", "add_bos_token"), ("add_eos", "add_eos_token")):
            val = meta.get("tokenizer.ggml." + flag)
            if val is not None:
                setattr(self, k, bool(val))
        if self.kind == "gemma4":
            self.add_bos = True   # llama.cpp overrides add_bos_token = false for Gemma 4

        # --- tokens recognised by text when the metadata is silent ---
        control_texts = []
        for k, texts in _AUTODETECT.items():
            if ids[k] is None:
                for text in texts:
                    tid = token_to_id.get(text)
                    if tid is not None:
                        ids[k] = tid
                        control_texts.append(tid)
                        break
        eog: set[int] = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] is not None}
        for text in _EOG_TEXTS:
            tid = token_to_id.get(text)
            if tid is not None:
                eog.add(tid)
                control_texts.append(tid)
        for tid in control_texts:
            self.attrs[tid] |= ATTR_CONTROL
        for text in _ALWAYS_RENDERED:
            tid = token_to_id.get(text)
            if tid is not None:
                self.attrs[tid] = ATTR_USER_DEFINED
        for k in ("eos", "eot", "eom"):
            if ids[k] is not None:
                eog.add(ids[k])
        texts_in_eog = {tokens[i]: i for i in eog}
        has_call = "<|call|>" in texts_in_eog or "<|calls|>" in texts_in_eog
        if "<|end|>" in texts_in_eog and has_call and (
                "<|return|>" in texts_in_eog or "<|flush|>" in texts_in_eog):
            end = texts_in_eog["<|end|>"]
            eog.discard(end)
            self.attrs[end] = ATTR_USER_DEFINED
        if "</s>" in texts_in_eog and ("<|tool_response>" in texts_in_eog
                                       or "<|plamo:eos|>" in texts_in_eog):
            s_id = texts_in_eog["</s>"]
            eog.discard(s_id)
            self.attrs[s_id] = ATTR_NORMAL
        self.eog_ids: frozenset[int] = frozenset(eog)
        self.ids = ids

        # --- per-model attribute tweaks llama.cpp applies by name ---
        name = str(meta.get("general.name", "")).lower()
        if "phi-3" in name or "phi3" in name:
            for i, a in enumerate(self.attrs):
                if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN):
                    self.attrs[i] = a | ATTR_RSTRIP
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                tid = token_to_id.get(text)
                if tid is not None:
                    self.attrs[tid] = (self.attrs[tid] | ATTR_RSTRIP) if on else (self.attrs[tid] & ~ATTR_RSTRIP)

    def special_tokens(self, parse_special: bool) -> list[tuple[str, int, int]]:
        """(text, id, attr) of the tokens split out before pretokenizing, longest first."""
        special = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        hidden = 0 if parse_special else ATTR_CONTROL | ATTR_UNKNOWN   # user-defined always split
        out = [(self.tokens[i], i, a) for i, a in enumerate(self.attrs)
               if a & special and not a & hidden]
        out.sort(key=lambda x: -len(x[0].encode("utf-8", "surrogatepass")))
        return out
