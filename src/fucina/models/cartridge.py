"""Cartridges: a corpus compressed into the K/V rows of a short virtual prefix
(Cartridges, arXiv 2506.06266), served as a prefix no tokens produced.

A cartridge holds, per layer with rows of its own, a K and a V of p rows in the exact
space of cache rows: keys after the q/k norms and after RoPE at positions 0..p-1, never
rotated again; the tokens that follow sit at positions p.. . Layers that read another
layer's K/V (shared KV) hold nothing. Row 0 is frozen by default (the attention sink:
training it destabilises a run); the rest are what training moves.

- `capture(model, ids)`: the model's own rows for `ids` (the corpus-first-p init; with
  no training the cartridge is the real prefill of those tokens, bit for bit)
- `write_to_cache(cache)`: the rows into an EMPTY cache of any row format (f16 or
  q8_0) and kind (all positions or a window), the cache advanced to p: decode goes on
  at position p exactly as after a prefill
- `compose(parts)`: cartridges concatenated in order, each keeping the rotations it
  was trained at (composition, arXiv 2606.04557)
- `save(path)` / `load(path)`: safetensors, the geometry and the model's identity in
  the header, `layers.<i>.k` / `layers.<i>.v` f32, an optional `corpus` i64 (the
  document's token ids: the serving side's speculation reference)
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Sequence

import torch

from fucina.errors import CartridgeError
from fucina.models.cache import AliasKV, KVMemory
from fucina.models.cache.rows import STORES

FORMAT = "fucina.cartridge"
VERSION = "1"
_DTYPES = {"F32": (torch.float32, 4), "F16": (torch.float16, 2), "I64": (torch.int64, 8)}
_NAMES = {v[0]: k for k, v in _DTYPES.items()}


def layer_geometry(model) -> list[tuple]:
    """Per layer ("rows", kv_heads, k_dim, v_dim) or ("alias", source layer), read from
    a small cache of the model's own; a layer with another kind of memory (a recurrent
    state, MLA's latent) cannot hold a cartridge."""
    geo = getattr(model, "_cartridge_geometry", None)
    if geo is None:
        geo = []
        for i, mem in enumerate(model.init_cache(64).memories):
            if isinstance(mem, AliasKV):
                geo.append(("alias", mem.target_layer))
            elif isinstance(mem, KVMemory) and mem.kind in ("kv", "window"):
                geo.append(("rows", mem.k.heads, mem.k.dim, mem.v.dim))
            else:
                raise CartridgeError(f"layer {i} of this {model.config.arch} model keeps a {mem.kind!r} "
                                     f"memory: a cartridge needs K/V rows in every layer")
        model._cartridge_geometry = geo
    return geo


def model_identity(model) -> dict:
    c = model.config
    return {"arch": c.arch, "n_layer": c.n_layer, "n_embd": c.n_embd, "n_vocab": c.n_vocab}


@dataclass
class Cartridge:
    k: list[torch.Tensor | None]            # per layer [p, kv_heads, k_dim] f32 (None: alias layer)
    v: list[torch.Tensor | None]
    geometry: list[tuple]                   # layer_geometry() of the model it belongs to
    identity: dict                          # model_identity() of that model
    frozen: int = 1                         # leading rows training leaves alone (the sink)
    corpus: list[int] | None = None         # the document's token ids (speculation reference)
    meta: dict = field(default_factory=dict)   # free-form provenance (steps, seed, source)

    def __post_init__(self):
        rows = [t for t in self.k if t is not None]
        if not rows:
            raise CartridgeError("a cartridge needs at least one layer with rows")
        self.p = rows[0].shape[0]
        if self.p < 1:
            raise CartridgeError("a cartridge needs at least one row")
        for i, (g, k, v) in enumerate(zip(self.geometry, self.k, self.v)):
            if g[0] == "alias":
                if k is not None or v is not None:
                    raise CartridgeError(f"layer {i} reads layer {g[1]}'s K/V: it holds no rows")
                continue
            _, h, dk, dv = g
            if k is None or v is None or tuple(k.shape) != (self.p, h, dk) or tuple(v.shape) != (self.p, h, dv):
                got = "nothing" if k is None or v is None else f"{tuple(k.shape)}/{tuple(v.shape)}"
                raise CartridgeError(f"layer {i}: rows {got}, expected [{self.p}, {h}, {dk}]/[{self.p}, {h}, {dv}]")
        if not 0 <= self.frozen <= self.p:
            raise CartridgeError(f"frozen rows {self.frozen} outside [0, {self.p}]")

    # -- construction ---------------------------------------------------------------
    @classmethod
    def capture(cls, model, ids: Sequence[int], *, cache_type: str = "f16", frozen: int = 1,
                corpus: Sequence[int] | None = None) -> "Cartridge":
        """The model's own K/V rows for `ids` (a prefill into a cache that keeps every
        position): the corpus-first-p initialization, and the real prefill bit for bit."""
        ids = [int(i) for i in ids]
        if not ids:
            raise CartridgeError("capture needs at least one token")
        geo = layer_geometry(model)
        cache = model.init_cache(len(ids), cache_type=cache_type, rewindable=True)
        model.forward_step(cache, ids, 0)
        ks, vs = [], []
        for i, g in enumerate(geo):
            if g[0] == "alias":
                ks.append(None)
                vs.append(None)
                continue
            k, v = cache.span(i, 0, len(ids))
            ks.append(k.float().clone())
            vs.append(v.float().clone())
        return cls(ks, vs, geo, model_identity(model), frozen=min(frozen, len(ids)),
                   corpus=list(corpus) if corpus is not None else None)

    @classmethod
    def random(cls, model, p: int, *, seed: int = 0, frozen: int = 1, like: "Cartridge | None" = None
               ) -> "Cartridge":
        """The random-vector ablation: rows drawn N(0, 1) scaled to `like`'s per-layer
        RMS (1 when not given)."""
        geo = layer_geometry(model)
        g = torch.Generator().manual_seed(seed)
        ks, vs = [], []
        for i, gi in enumerate(geo):
            if gi[0] == "alias":
                ks.append(None)
                vs.append(None)
                continue
            _, h, dk, dv = gi
            sk = float(like.k[i].pow(2).mean().sqrt()) if like is not None else 1.0
            sv = float(like.v[i].pow(2).mean().sqrt()) if like is not None else 1.0
            ks.append(torch.randn(p, h, dk, generator=g) * sk)
            vs.append(torch.randn(p, h, dv, generator=g) * sv)
        if like is not None and frozen:
            for i, gi in enumerate(geo):
                if gi[0] != "alias":
                    ks[i][:frozen] = like.k[i][:frozen]
                    vs[i][:frozen] = like.v[i][:frozen]
        return cls(ks, vs, geo, model_identity(model), frozen=frozen)

    # -- checks -----------------------------------------------------------------------
    def check_model(self, model) -> None:
        ident, geo = model_identity(model), layer_geometry(model)
        if ident != self.identity:
            diff = ", ".join(f"{k} {self.identity.get(k)} vs {ident[k]}" for k in ident
                             if self.identity.get(k) != ident[k])
            raise CartridgeError(f"the cartridge was made for another model ({diff})")
        for i, (a, b) in enumerate(zip(self.geometry, geo)):
            if tuple(a) != tuple(b):
                raise CartridgeError(f"the cartridge's layer {i} is {tuple(a)}, the model's {tuple(b)}")

    # -- serving ----------------------------------------------------------------------
    def write_to_cache(self, cache) -> None:
        """The p rows into an empty cache (in its row format), the cache advanced to p."""
        if cache.len != 0:
            raise CartridgeError(f"a cartridge goes into an empty cache (this one holds {cache.len} positions)")
        if self.p >= cache.capacity:
            raise CartridgeError(f"the cartridge's {self.p} rows leave no room in a context of "
                                 f"{cache.capacity} (give a larger context)")
        if cache.n_layers != len(self.geometry):
            raise CartridgeError(f"the cartridge has {len(self.geometry)} layers, the cache {cache.n_layers}")
        for i, (g, mem) in enumerate(zip(self.geometry, cache.memories)):
            if g[0] == "alias":
                if not isinstance(mem, AliasKV) or mem.target_layer != g[1]:
                    raise CartridgeError(f"cache layer {i} does not read layer {g[1]}'s K/V as the cartridge's does")
                continue
            if not isinstance(mem, KVMemory) or mem.kind not in ("kv", "window") or \
                    mem.descriptor()[:3] != tuple(g[1:]):
                raise CartridgeError(f"cache layer {i} ({mem.kind} {mem.descriptor()}) does not fit the "
                                     f"cartridge's rows {tuple(g[1:])}")
        for i, (g, mem) in enumerate(zip(self.geometry, cache.memories)):
            if g[0] == "alias":
                continue
            dtype = getattr(mem.k, "dtype", torch.float16)
            sk = STORES[mem.storage](self.p, g[1], g[2], dtype)
            sv = STORES[mem.storage](self.p, g[1], g[3], dtype)
            sk.put(0, self.k[i].detach())
            sv.put(0, self.v[i].detach())
            mem.restore(self.p, list(sk.parts + sv.parts))
        cache.len = self.p
        for mem in cache.memories:
            mem.commit(self.p)

    def nbytes(self, storage: str = "f16") -> int:
        """The KV bytes the prefix takes in a cache of that row format."""
        per = 2.0 if storage == "f16" else 34 / 32
        return int(sum(self.p * g[1] * (g[2] + g[3]) * per for g in self.geometry if g[0] == "rows"))

    # -- persistence ------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            if k is not None:
                out[f"layers.{i}.k"] = k.detach().float()
                out[f"layers.{i}.v"] = v.detach().float()
        if self.corpus is not None:
            out["corpus"] = torch.tensor(self.corpus, dtype=torch.int64)
        return out

    def header(self) -> dict[str, str]:
        return {"format": FORMAT, "version": VERSION, "p": str(self.p), "frozen": str(self.frozen),
                "model": json.dumps(self.identity), "geometry": json.dumps([list(g) for g in self.geometry]),
                "meta": json.dumps(self.meta)}

    def save(self, path: str | os.PathLike) -> str:
        write_safetensors(path, self.tensors(), self.header())
        return str(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Cartridge":
        tensors, meta = read_safetensors(path)
        if meta.get("format") != FORMAT:
            raise CartridgeError(f"{path}: not a fucina cartridge (format {meta.get('format')!r})")
        if meta.get("version") != VERSION:
            raise CartridgeError(f"{path}: cartridge version {meta.get('version')!r}, this fucina reads {VERSION}")
        try:
            geo = [tuple(g) for g in json.loads(meta["geometry"])]
            ident = json.loads(meta["model"])
            frozen = int(meta["frozen"])
            p = int(meta["p"])
            extra = json.loads(meta.get("meta", "{}"))
        except (KeyError, ValueError, TypeError) as e:
            raise CartridgeError(f"{path}: cartridge header is corrupt ({e})") from None
        ks = [tensors.get(f"layers.{i}.k") for i in range(len(geo))]
        vs = [tensors.get(f"layers.{i}.v") for i in range(len(geo))]
        corpus = tensors.get("corpus")
        cart = cls(ks, vs, geo, ident, frozen=frozen,
                   corpus=corpus.tolist() if corpus is not None else None, meta=extra)
        if cart.p != p:
            raise CartridgeError(f"{path}: header says p = {p}, the rows hold {cart.p}")
        return cart


def compose(parts: Sequence[Cartridge]) -> Cartridge:
    """Cartridges concatenated in order (each keeps the rotations it was trained at):
    tokens then continue at the sum of their p. Only the first part's sink stays frozen."""
    parts = list(parts)
    if not parts:
        raise CartridgeError("compose needs at least one cartridge")
    first = parts[0]
    for j, c in enumerate(parts[1:], 1):
        if c.identity != first.identity or [tuple(g) for g in c.geometry] != [tuple(g) for g in first.geometry]:
            raise CartridgeError(f"cartridge {j} was made for another model or geometry than cartridge 0")
    if len(parts) == 1:
        return first
    ks = [None if g[0] == "alias" else torch.cat([c.k[i] for c in parts]) for i, g in enumerate(first.geometry)]
    vs = [None if g[0] == "alias" else torch.cat([c.v[i] for c in parts]) for i, g in enumerate(first.geometry)]
    corpus = None
    if all(c.corpus is not None for c in parts):
        corpus = [t for c in parts for t in c.corpus]
    return Cartridge(ks, vs, first.geometry, first.identity, frozen=first.frozen, corpus=corpus,
                     meta={"composed_of": [c.p for c in parts]})


# -- safetensors (the format: an 8-byte little-endian header length, a JSON header, the data) --

def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    header: dict = {"__metadata__": meta}
    blobs, off = [], 0
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise CartridgeError(f"cannot store {name} as {t.dtype}")
        b = t.detach().contiguous().cpu().numpy().tobytes()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = str(path) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        data = open(path, "rb").read()
    except OSError as e:
        raise CartridgeError(f"cannot read cartridge {path}: {e.strerror or e}") from None
    if len(data) < 8:
        raise CartridgeError(f"{path}: too short for a safetensors file ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CartridgeError(f"{path}: header of {n} bytes runs past the end of the file (truncated?)")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError:
        raise CartridgeError(f"{path}: the safetensors header is not JSON (corrupt file)") from None
    if not isinstance(header, dict):
        raise CartridgeError(f"{path}: the safetensors header is not a table (corrupt file)")
    meta = header.pop("__metadata__", {}) or {}
    body = data[8 + n:]
    out = {}
    for name, info in header.items():
        try:
            dtype, size = _DTYPES[info["dtype"]]
            shape = [int(s) for s in info["shape"]]
            a, b = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CartridgeError(f"{path}: tensor {name!r} has a corrupt entry") from None
        count = 1
        for s in shape:
            count *= s
        if not 0 <= a <= b <= len(body) or b - a != count * size:
            raise CartridgeError(f"{path}: tensor {name!r} lies outside the file or has the wrong size "
                                 f"(truncated or corrupt)")
        out[name] = torch.frombuffer(bytearray(body[a:b]), dtype=dtype).reshape(shape) if count else \
            torch.zeros(shape, dtype=dtype)
    return out, meta


def equivalence(model, ids: Sequence[int], p: int, *, suffix: int = 32, greedy: int = 16,
                cache_type: str = "f16") -> dict:
    """The gate: a cartridge captured from ids[:p], untrained, written into an empty
    cache, against the real prefill of ids[:p] in the same kind of cache: logits of the
    next `suffix` corpus tokens and a `greedy` continuation after them. Also reports the
    logits of one prefill of p + suffix tokens in a single pass (another schedule, so
    equal only up to its rounding) as `one_pass_max_abs`."""
    ids = [int(i) for i in ids]
    if p < 1:
        raise CartridgeError("p must be at least 1")
    if len(ids) < p + suffix:
        raise CartridgeError(f"the corpus has {len(ids)} tokens: p = {p} + a suffix of {suffix} needs "
                             f"{p + suffix} (a longer corpus, or a smaller --p/--suffix)")
    cap = p + suffix + greedy + 1
    if cap > model.config.n_ctx_train:
        raise CartridgeError(f"p = {p} + suffix {suffix} + {greedy} greedy tokens exceed the model's "
                             f"context of {model.config.n_ctx_train}")
    tail = ids[p:p + suffix]

    def follow(cache):
        logits = model.forward_step_all_logits(cache, tail, cache.len)
        out, tok = [], int(logits[-1].argmax())
        for _ in range(greedy):
            out.append(tok)
            tok = int(model.forward_step(cache, [tok], cache.len).argmax())
        return logits, out

    real = model.init_cache(cap, cache_type=cache_type)
    model.forward_step(real, ids[:p], 0)
    want, want_greedy = follow(real)
    cart = Cartridge.capture(model, ids[:p], cache_type=cache_type)
    served = model.init_cache(cap, cache_type=cache_type)
    cart.write_to_cache(served)
    got, got_greedy = follow(served)
    one = model.forward_step_all_logits(model.init_cache(cap, cache_type=cache_type), ids[:p + suffix], 0)[p:]
    agree = next((i for i, (a, b) in enumerate(zip(got_greedy, want_greedy)) if a != b), len(want_greedy))
    return {"p": p, "suffix": suffix, "max_abs": float((got - want).abs().max()),
            "bitwise": bool(torch.equal(got, want)), "greedy_agree": agree, "greedy": greedy,
            "argmax_agree": int((got.argmax(-1) == want.argmax(-1)).sum()),
            "one_pass_max_abs": float((one - want).abs().max()),
            "kv_bytes": cart.nbytes(cache_type)}
