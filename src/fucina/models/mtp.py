"""The NextN block: a multi-token-prediction head drafting for its trunk (llama.cpp b11434
src/models/glm4-moe.cpp `graph_mtp`, common/speculative.cpp `draft-mtp`).

At position q it reads the token x_q and the trunk's state at q - 1, h = output_norm(last
hidden row), and predicts x_{q+1}:

    x   = eh_proj([enorm(embed(x_q)) ; hnorm(h)])
    x   = one block of the family (attention over the head's own cache, then its ffn)
    h'  = head_norm(x)              (nextn.shared_head_norm, else the trunk's output_norm)
    out = head(h')                  (nextn.shared_head_head, else the trunk's output)

h' stands in for the trunk's state when drafting on (chained drafts). The block is the
family's own layer code over a one-layer view of the model, so a dense family's head runs
the native layer step (about one layer's cost), and its cache is an ordinary one-layer
cache. Heads come from the model's own file (glm4moe's blk.{n_layer}.nextn.*) or from a
head GGUF `fucina mtp train` wrote for a model that ships none; `draft_vocab` (a head
file's most frequent tokens) lets a draft score only those rows of the output matrix.
"""
from __future__ import annotations

import copy
import dataclasses
import os

import torch

from fucina.errors import FucinaError, GGUFError
from fucina.gguf import GGUFFile
from fucina.models.base import as_ids, linear, rms_norm, vector
from fucina.models.schema import mtp as keys
from fucina.models.schema.base import Tensors
from fucina.models.schema.mtp import NEXTN


class MTPHeadError(FucinaError):
    """A head that does not fit the model it was given to (or is not a head at all)."""


class NextN:
    def __init__(self, model, t: Tensors, index: int, draft_vocab: list[int] | None = None):
        c = model.config
        w = {s.key: t[s.gguf_name(index)] for s in NEXTN}
        self.model, self.index, self.eps = model, index, c.rms_eps
        self.eh_proj = linear(w["nextn.eh_proj"])
        self.enorm, self.hnorm = vector(w["nextn.enorm"]), vector(w["nextn.hnorm"])
        self.embed_w = linear(w["nextn.embed_tokens"])
        self.head_norm = vector(w["nextn.shared_head_norm"])
        self.head_norm = self.head_norm if self.head_norm is not None else model.output_norm
        self.head_w = linear(w["nextn.shared_head_head"]) or model.output
        layer = model.layer_class(t, index, c, model.schema.tensors)
        blk = copy.copy(model)                 # a one-layer view: the family's block code, its own plan
        blk.__dict__.pop("_spec_costs", None)
        blk.mtp, blk.layers = None, [layer]
        blk.config = dataclasses.replace(c, n_layer=1, layers=[c.layer_spec(index)])
        blk.native_plan = blk.build_plan() if model.native_plan is not None else None
        self.block = blk
        self.draft_ids = self.draft_w = None
        if draft_vocab:
            ids = torch.tensor(sorted(set(int(i) for i in draft_vocab)), dtype=torch.long)
            if int(ids.min()) < 0 or int(ids.max()) >= c.n_vocab:
                raise MTPHeadError(f"draft vocabulary holds ids outside [0, {c.n_vocab})")
            self.draft_ids = ids
            self.draft_w = self.head_w.rows(ids).float().contiguous()   # [n, n_embd]

    def init_cache(self, capacity: int):
        return self.block.init_cache(capacity)

    def trunk_state(self, hidden: torch.Tensor) -> torch.Tensor:
        """The trunk's last hidden rows as the head reads them (its output norm)."""
        return rms_norm(hidden, self.model.output_norm, self.eps)

    @torch.inference_mode()
    def forward(self, cache, tokens, h: torch.Tensor, pos0: int) -> torch.Tensor:
        """Rows for tokens at pos0.. (the head's cache at pos0) with the states h [m, n_embd]
        before them; returns h' [m, n_embd] (head-normed)."""
        ids = as_ids(tokens, self.model.config.n_vocab)
        if cache.len != pos0:
            raise FucinaError(f"mtp: the head's cache holds {cache.len} positions, pos0 is {pos0}")
        cache.check_room(ids.numel())
        e = self.embed_w.rows(ids) if self.embed_w is not None else self.model.embed(ids)
        x = self.eh_proj(torch.cat([rms_norm(e.float(), self.enorm, self.eps),
                                    rms_norm(h.float(), self.hnorm, self.eps)], dim=-1))
        return rms_norm(self.block.run_layers(cache, x, pos0), self.head_norm, self.eps)

    def logits(self, hn: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits of head-normed rows."""
        return self.head_w.linear(hn)

    def draft_token(self, hn: torch.Tensor) -> tuple[int, float]:
        """The head's best token for one head-normed row and its probability among the
        scored rows (the draft vocabulary when the head has one)."""
        if self.draft_w is None:
            logits = self.logits(hn.reshape(1, -1))[0]
            p = torch.softmax(logits.float(), -1)
            i = int(torch.argmax(p))
            return i, float(p[i])
        logits = self.draft_w @ hn.reshape(-1).float()
        p = torch.softmax(logits, -1)
        i = int(torch.argmax(p))
        return int(self.draft_ids[i]), float(p[i])


def own_head(model) -> NextN | None:
    """The NextN block the model's file carries (glm4moe's blk.{n_layer}.nextn.*), or None."""
    c, t = model.config, getattr(model, "checked", None)
    if t is None or not getattr(c, "n_nextn", 0) or f"blk.{c.n_layer}.nextn.eh_proj.weight" not in t:
        return None
    return NextN(model, t, c.n_layer)


def load_head(model, path: str | os.PathLike) -> NextN:
    """A head GGUF (`fucina mtp train`) checked against `model`: its keys name the model's
    width and vocabulary, its tensors are the family's layer plus the NextN tensors."""
    try:
        f = GGUFFile(path)
    except FileNotFoundError:
        raise MTPHeadError(f"{path}: no such MTP head file") from None
    except GGUFError as e:
        raise MTPHeadError(f"{path}: not a readable MTP head ({e})") from None
    c, m = model.config, f.metadata
    if f.architecture != keys.HEAD_ARCH:
        raise MTPHeadError(f"{path}: a {f.architecture!r} file, not an MTP head (train one with `fucina mtp train`)")
    want = {keys.KEY_N_EMBD: c.n_embd, keys.KEY_N_VOCAB: c.n_vocab, keys.KEY_BASE_ARCH: c.arch}
    for key, value in want.items():
        if m.get(key) != value:
            raise MTPHeadError(f"{path}: the head was trained for {key.split('.', 1)[1]} {m.get(key)!r}, "
                               f"this model has {value!r}: train a head for this model (`fucina mtp train`)")
    index = m.get(keys.KEY_BLOCK)
    if not isinstance(index, int) or index < 0:
        raise MTPHeadError(f"{path}: {keys.KEY_BLOCK} is missing or not a layer index")
    t = Tensors(f, c)
    try:
        model.schema.check_layer(t, index)
        t.layer(index, NEXTN, keys.dims(c))
    except GGUFError as e:
        raise MTPHeadError(f"{path}: {e}") from None
    vocab = m.get(keys.KEY_DRAFT_VOCAB)
    head = NextN(model, t, index, [int(v) for v in vocab] if vocab is not None else None)
    head.gguf = f
    return head


def attach(model, head: NextN | None) -> None:
    """Make `head` draft for `model`: caches made from now on keep their hidden rows."""
    if head is not None and head.model is not model:
        raise MTPHeadError("mtp: the head was built for another model object")
    model.mtp = head


def attach_from(model, mtp) -> NextN | None:
    """`fucina.load(path, mtp=...)`'s switch: True (the model's own NextN block; an error
    when its file has none), a head file's path, or None/False (none)."""
    if mtp is None or mtp is False:
        return None
    if mtp is True:
        head = own_head(model)
        if head is None:
            raise MTPHeadError(f"this {model.config.arch} file carries no NextN block: "
                               f"pass a head trained for it (`fucina mtp train MODEL --out HEAD.gguf`)")
    else:
        head = load_head(model, mtp)
    attach(model, head)
    return head
