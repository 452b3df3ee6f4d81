"""Grammar-constrained decoding: llguidance behind the sampler's logit-processor seam.

`lltokenizer(tokenizer)` is the bridge from our GGUF tokenizers: every id's raw bytes
(`token_to_piece`: byte-level BPE decoded, SentencePiece `▁` as a space, `<0xXX>` as its
byte), control/unknown tokens and user-defined markers shaped `<...>` marked special
(so grammar text that spells `<|im_end|>` can never steer the model into the control
token), our own exact tokenizer as llguidance's tokenize callback. It is built lazily,
once per (tokenizer, vocabulary width, stop ids), and cached.

`Constraint` is one stream's matcher as a `LogitProcessor`:
- `process(row)` writes -inf over every forbidden token (the generic seam path);
- the sampler's cheaper path computes the packed bitmask (`allowed_words()`, into a
  reusable buffer), tests its first choice's bit (`allows`) and applies the mask to
  the row only when that choice is forbidden (`Sampler._pick_constrained`);
- `commit(token)` advances the matcher; `reset()` re-arms it for a new reply;
- `forced_tokens()` (llguidance's fast-forward) and `valid_prefix_len(draft)` are the
  structural lookahead hooks speculation uses;
- once the grammar is complete only the stop ids are allowed, so a finished grammar
  ends the turn through the decoder's ordinary stop handling; a matcher that fails
  mid-reply (a resource limit) also degrades to that forced stop, and says why in
  `error`;
- `clone()` is an independent twin for another stream (no recompilation).
"""
from __future__ import annotations

import logging
import time
from collections import deque
import weakref
from typing import Iterable, Sequence

import numpy as np
import torch

from fucina.errors import GrammarError
from fucina.text import grammar as grammars
from fucina.text.harmony import is_harmony
from fucina.text.logit_processor import LogitProcessor
from fucina.text.tokenizer.special import special_ids

log = logging.getLogger("fucina.constraint")

_BRIDGES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Vocab:
    """The TokenizerWrapper shape llguidance's LLTokenizer reads."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer, n_vocab: int, eos: int):
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_id
        n = tokenizer.n_vocab
        self.tokens = [tokenizer.token_to_piece(i) for i in range(n)] + [b""] * (n_vocab - n)
        self.special_token_ids = sorted(special_ids(tokenizer))
        self._special = frozenset(self.special_token_ids)
        self._byte = {}                      # byte -> a plain single-byte token
        for i, b in enumerate(self.tokens):
            if len(b) == 1 and i not in self._special:
                self._byte.setdefault(b[0], i)
        self._encode = weakref.WeakMethod(tokenizer.encode_raw)

    def __call__(self, text: str) -> list[int]:
        """Our exact tokenization, with no special token in it: a user-defined marker
        our tokenizer always splits out (`<think>`) is text here, spelled in single
        bytes (llguidance's tokens must decode to exactly `text`)."""
        encode = self._encode()
        ids = [] if encode is None else encode(text, parse_special=False)
        if not self._special.intersection(ids):
            return ids
        out: list[int] = []
        for i in ids:
            if i in self._special:
                out += [self._byte[b] for b in self.tokens[i] if b in self._byte]
            else:
                out.append(i)
        return out


def lltokenizer(tokenizer, n_vocab: int | None = None, stop_ids: Iterable[int] = ()) -> llg.LLTokenizer:
    """The llguidance view of `tokenizer` (cached). `n_vocab`: the logits width when the
    model pads its vocabulary (extra ids get empty bytes: never allowed); `stop_ids`:
    the ids a complete grammar allows (default: the end-of-generation set)."""
    n_vocab = max(int(n_vocab or 0), tokenizer.n_vocab)
    stops = tuple(sorted(int(i) for i in stop_ids)) or tuple(sorted(tokenizer.eog_ids)) \
        or ((tokenizer.eos_id,) if tokenizer.eos_id is not None else ())
    if not stops:
        raise GrammarError("the vocabulary has no end-of-generation token to end a grammar with")
    per_tok = _BRIDGES.setdefault(tokenizer, {})
    key = (n_vocab, stops)
    llt = per_tok.get(key)
    if llt is None:
        t0 = time.perf_counter()
        llt = grammars._llg().LLTokenizer(_Vocab(tokenizer, n_vocab, stops[0]), n_vocab=n_vocab, eos_token=list(stops))
        log.info("llguidance tokenizer for %d ids built in %.2f s", n_vocab, time.perf_counter() - t0)
        per_tok[key] = llt
    return llt


class Constraint(LogitProcessor):
    """One decode stream's grammar state over a compiled llguidance grammar."""

    def __init__(self, tokenizer, grammar: str, *, stop_ids: Iterable[int] = (), n_vocab: int | None = None,
                 log_level: int = 0):
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.llt = lltokenizer(tokenizer, n_vocab, stop_ids)
        self.stop_ids = list(self.llt.eos_tokens)
        self.n_vocab = self.llt.vocab_size
        self.matcher = grammars._llg().LLMatcher(self.llt, grammar, log_level=log_level)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error().strip())
        self.schema = getattr(grammar, "schema", None)   # a schema enforced in part: checked at the end
        self._init_state()

    def _init_state(self) -> None:
        self._words = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
        self._fresh = False            # _words holds the mask of the current state
        self.error: str | None = None  # why the matcher failed mid-reply, if it did
        self.mask_ns: deque[int] = deque(maxlen=4096)   # recent mask computation times
        self.forced = 0                # tokens committed by fast_forward (no sampling, no step of their own)
        self.reply_ids: list[int] | None = [] if self.schema is not None else None
        self.violation: str | None = None   # how the finished reply breaks the partly enforced schema

    @classmethod
    def build(cls, tokenizer, *, stop_ids: Iterable[int] = (), n_vocab: int | None = None,
              **options) -> "Constraint | None":
        """A Constraint from the keyword options (json_schema=, regex=, lark=, grammar=,
        choices=); None when none is given."""
        g = grammars.from_options(**options)
        return None if g is None else cls(tokenizer, g, stop_ids=stop_ids, n_vocab=n_vocab)

    def clone(self) -> "Constraint":
        twin = object.__new__(Constraint)
        twin.tokenizer, twin.grammar, twin.llt = self.tokenizer, self.grammar, self.llt
        twin.stop_ids, twin.n_vocab, twin.schema = self.stop_ids, self.n_vocab, self.schema
        twin.matcher = self.matcher.deep_copy()
        twin._init_state()
        return twin

    # -- state -------------------------------------------------------------------------
    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()

    def reset(self) -> None:
        self.matcher.reset()
        self._fresh = False
        self.error = None
        self.reply_ids = [] if self.schema is not None else None
        self.violation = None

    def commit(self, token: int) -> None:
        self._fresh = False
        if self.error is not None:
            return
        if not self.matcher.consume_token(int(token)):
            self._fail(f"token {token} rejected: {self.matcher.get_error().strip()}")
        elif self.reply_ids is not None:
            if int(token) in self.stop_ids:
                self._check_reply()
            else:
                self.reply_ids.append(int(token))

    def _check_reply(self) -> None:
        """The reply ended: check it against the whole schema (the keywords the grammar
        could not enforce); a violation is logged and kept in `violation`."""
        text = self.tokenizer.decode(self.reply_ids)
        body = text.rsplit("</think>", 1)[-1].rsplit("<|message|>", 1)[-1].strip()  # past a harmony header
        self.violation = grammars.reply_problem(self.schema, body)
        if self.violation is not None:
            log.warning("the reply breaks its JSON schema where the grammar could not enforce it: %s",
                        self.violation)

    def _fail(self, why: str) -> None:
        self.error = why
        log.warning("constraint failed, forcing the stop token: %s", why)

    # -- masks -------------------------------------------------------------------------
    def allowed_words(self) -> np.ndarray:
        """The packed mask of the current state (bit i of word i//32 = token i allowed)."""
        if not self._fresh:
            w = self._words
            t0 = time.perf_counter_ns()
            if self.error is None:
                self.matcher.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
                if self.matcher.is_error():
                    self._fail(self.matcher.get_error().strip())
            if self.error is not None or not w.any():
                w[:] = 0
                for t in self.stop_ids:
                    w[t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
            self.mask_ns.append(time.perf_counter_ns() - t0)
            self._fresh = True
        return self._words

    def allows(self, token: int) -> bool:
        """The mask's bit for `token`. (Not the cheaper one-token validate_tokens: where
        the grammar forces bytes the mask admits only their canonical tokenization, and
        validate_tokens also accepts the other spellings, so the distribution would
        change.)"""
        w = self.allowed_words()
        return 0 <= token < self.n_vocab and bool((int(w[token >> 5]) >> (token & 31)) & 1)

    def process(self, logits: torch.Tensor, history: Sequence[int]) -> None:
        apply_mask(logits, self.allowed_words())

    # -- structural hooks --------------------------------------------------------------
    def forced_tokens(self) -> list[int]:
        if self.error is not None:
            return []
        return list(self.matcher.compute_ff_tokens())

    def fast_forward(self, limit: int) -> list[int]:
        """Commit and return (up to `limit` of) the tokens the grammar forces now."""
        toks = self.forced_tokens()[:max(0, limit)]
        if toks:
            self._fresh = False
            if not self.matcher.consume_tokens(toks):
                self._fail(f"forced tokens rejected: {self.matcher.get_error().strip()}")
                return []
            self.forced += len(toks)
            if self.reply_ids is not None:
                self.reply_ids.extend(int(t) for t in toks)
        return toks

    def valid_prefix_len(self, tokens: Sequence[int]) -> int:
        if self.error is not None:
            return 0
        return int(self.matcher.validate_tokens([int(t) for t in tokens]))


def mask_bools(words: np.ndarray, n: int) -> np.ndarray:
    """The packed mask unpacked to one bool per token id (first n)."""
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:n].view(bool)


def apply_mask(logits: torch.Tensor, words: np.ndarray) -> None:
    """-inf over every token the packed mask forbids (and past its width)."""
    row = logits.view(-1)
    n = row.shape[0]
    ok = torch.from_numpy(mask_bools(words, min(n, words.shape[0] * 32)))
    if ok.shape[0] < n:
        row[ok.shape[0]:] = float("-inf")
    row[:ok.shape[0]].masked_fill_(~ok, float("-inf"))


CONSTRAINT_KEYS = frozenset({"json_schema", "regex", "lark", "grammar", "choices", "strict"})


def pop_options(options: dict) -> dict:
    """Take the constraint keywords out of an options dict (None values dropped)."""
    taken = {k: options.pop(k) for k in list(options) if k in CONSTRAINT_KEYS}
    return {k: v for k, v in taken.items() if v is not None}


def thinks(template) -> bool:
    """Whether the template's model writes think blocks (as serve/prompt.py decides)."""
    return "think>" in (template.source or "")


def primed_think(template) -> bool:
    """Whether the template's generation prompt (thinking on) already opens the block."""
    try:
        text = template.render([{"role": "user", "content": "x"}], add_generation_prompt=True,
                               enable_thinking=True)
    except Exception:                          # a template that needs more context: assume not
        return False
    return text.rstrip().endswith("<think>")


def for_reply(tokenizer, grammar: str | None, *, stop_ids: Iterable[int], n_vocab: int | None = None,
              template=None, think: bool | None = False) -> Constraint | None:
    """A Constraint for one assistant reply: on a thinking template with thinking on,
    the model writes its think block freely and `grammar` governs what follows."""
    if grammar is None:
        return None
    if template is not None and is_harmony(template):
        grammar = grammars.harmony_wrapped(grammar, tokenizer)
    elif template is not None and think is not False and thinks(template):
        grammar = grammars.think_wrapped(grammar, tokenizer, primed=primed_think(template))
    return Constraint(tokenizer, grammar, stop_ids=stop_ids, n_vocab=n_vocab)
