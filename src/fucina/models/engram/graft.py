"""The whole-model Engram: one hash plan, one EngramLayer per memory layer, a state dict in
safetensors, and the residual hooks that graft it onto a decoder.

Attached (`attach(model)`), each memory layer's output is added to the residual stream
entering its decoder layer (`DecoderBase.add_residual_hook`), on the torch blocks, the
native step and the training forward alike. On the native step the memory layers run
inside it (`native_hook`, `bind`: one native call a token for the whole model); with
`in_step` off, or where the step cannot take them, the step is cut at the hooked layers
and each memory layer is its own native call between the pieces. A sequence's
state, the compressed ids and each layer's normed value rows by position (what the hash
and the ShortConv read before a step's first position), is kept per cache, so rewinds
and prefix reuse read what the positions they keep wrote.

File (safetensors): `engram.multipliers` I64 [layers, max_ngram], `engram.lookup` I64
[n_vocab] (when compressed), `engram.layers.<id>.<param>` F32; the metadata holds the
plan's settings, the layer geometry and the model it was made for (architecture, sizes
and a digest of its token embeddings), checked on attach.
"""
from __future__ import annotations

import hashlib
import json
import os
import weakref

import numpy as np
import torch

from fucina.kernels import engram as native_engram
from fucina.models.cache import KVCache
from fucina.models.engram import store
from fucina.models.engram.layer import PARAMS, EngramLayer
from fucina.models.engram.plan import EngramError, HashPlan

FORMAT = "fucina-engram/1"
MAX_CHECKED_BYTES = 1 << 30   # tables up to this are scanned for non-finite values on load
# a table above this stays mapped from its file (the kernel reads the rows it gathers, and
# each step's rows are read ahead before layer 0); below, it is copied into RAM on load
MMAP_AUTO_BYTES = 1 << 30
# load()'s default: None automatic (by size), True every table mapped, False every table in
# RAM (`--engram-mmap` sets True for the process)
MMAP_DEFAULT: bool | None = None


def model_identity(model) -> dict:
    """What a graft records about its model: architecture, sizes, a digest of the token
    embeddings' first rows (as stored in the file)."""
    c = model.config
    raw = model.tok_embd.raw[:64].contiguous()
    digest = hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]
    return dict(arch=type(model).__module__.rsplit(".", 1)[-1], n_vocab=int(c.n_vocab), n_embd=int(c.n_embd),
                n_layer=int(c.n_layer), embd_digest=digest)


class _Stream:
    """One sequence's history: compressed ids and per-layer normed value rows by position
    (with their addresses, which the native forward writes through)."""

    def __init__(self, capacity: int, layer_ids, n_embd: int):
        self.ids = np.zeros(capacity, dtype=np.int64)
        self.conv = {lid: torch.zeros(capacity, n_embd) for lid in layer_ids}
        self.known = 0
        self.ids_ptr = self.ids.ctypes.data
        self.conv_ptr = {lid: t.data_ptr() for lid, t in self.conv.items()}
        self.conv_ptrs = np.array([self.conv_ptr[lid] for lid in layer_ids], dtype=np.int64)   # plan order
        self.conv_ptrs_ptr = self.conv_ptrs.ctypes.data


class Engram(torch.nn.Module):
    # False: every step runs the torch layer (the reference the native forward is tested against)
    native = True
    # False: the native step is cut at the memory layers, each one native call between the
    # pieces (the reference the in-step path is tested against, bitwise)
    in_step = True

    def __init__(self, plan: HashPlan, n_embd: int, head_dim: int, *, kernel: int = 4, model_id: dict | None = None,
                 graft: bool = True, seed: int = 0):
        super().__init__()
        if head_dim < 1 or kernel < 1 or n_embd < 1:
            raise EngramError("engram: head_dim, kernel and n_embd must be >= 1")
        self.plan, self.n_embd, self.head_dim, self.kernel = plan, n_embd, head_dim, kernel
        self.model_id = dict(model_id or {})
        g = torch.Generator().manual_seed(seed)
        self.layers = torch.nn.ModuleDict({
            str(lid): EngramLayer(plan.table_rows[i], n_embd, head_dim, plan.n_heads_total, kernel, plan.max_ngram,
                                  graft=graft, generator=g)
            for i, lid in enumerate(plan.layer_ids)})
        self._streams: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._attached, self._packs = None, {}
        self._mapped, self.rows_prefetched = {}, 0    # {layer: its table mapped from the file}
        self._graft, self._graft_set = None, {}        # the in-step context, {layer: (fixed, hook context)}
        self._binding = None                           # bind()'s checked state (_bind_slow)

    @classmethod
    def for_model(cls, model, layer_ids, *, capacity: int = 20011, n_head: int = 4, head_dim: int = 32,
                  max_ngram: int = 3, kernel: int = 4, seed: int = 0, lookup: np.ndarray | None = None,
                  pad_id: int = 0, graft: bool = True) -> "Engram":
        """A fresh graft for `model`: `capacity` rows per head (primes from there; 1: the
        one-row control), zero-init value path when `graft`."""
        c = model.config
        for lid in layer_ids:
            if not 0 <= lid < c.n_layer:
                raise EngramError(f"engram: layer {lid} out of range [0, {c.n_layer})")
        plan = HashPlan(n_vocab=c.n_vocab, layer_ids=layer_ids, max_ngram=max_ngram, n_head=n_head,
                        vocab_per_ngram=[capacity] * (max_ngram - 1), pad_id=pad_id, seed=seed, lookup=lookup)
        return cls(plan, c.n_embd, head_dim, kernel=kernel, model_id=model_identity(model), graft=graft, seed=seed)

    # -- the hooks ------------------------------------------------------------------------
    def check_model(self, model) -> None:
        mine, theirs = self.model_id, model_identity(model)
        diff = [k for k in theirs if k in mine and mine[k] != theirs[k]]
        if diff:
            raise EngramError("engram: this graft was made for another model (" + ", ".join(
                f"{k} {mine[k]} here, {theirs[k]} in the model" for k in diff) + ")")
        if self.plan.n_vocab != theirs["n_vocab"] or self.n_embd != theirs["n_embd"] or \
                max(self.plan.layer_ids) >= theirs["n_layer"]:
            raise EngramError("engram: the graft's vocabulary, width or layers do not fit the model")

    def attach(self, model) -> "Engram":
        self.check_model(model)
        if self._attached is not None:
            raise EngramError("engram: already attached to a model")
        for lid in self.plan.layer_ids:
            model.add_residual_hook(lid, self)
        self._attached = weakref.ref(model)
        KVCache.copy_listeners.add(self)
        return self

    def rows_copied(self, dst, src, start: int, end: int) -> None:
        """A cache adopted rows [start, end) of another (a server slot's shared prefix): so
        does its history, when both have one that reaches."""
        s = self._streams.get(src)
        if s is None or s.known < end or end > dst.capacity:
            return
        d = self._stream(dst)
        if d.known < start:
            return
        d.ids[start:end] = s.ids[start:end]
        for lid in self.plan.layer_ids:
            d.conv[lid][start:end] = s.conv[lid][start:end]
        d.known = end

    def detach(self) -> None:
        model = self._attached() if self._attached is not None else None
        if model is not None:
            model.remove_residual_hooks(self)
        KVCache.copy_listeners.discard(self)
        self._attached = None

    def _stream(self, cache) -> _Stream:
        s = self._streams.get(cache)
        if s is None or s.ids.shape[0] < cache.capacity:
            s = self._streams[cache] = _Stream(cache.capacity, self.plan.layer_ids, self.n_embd)
        return s

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, pos0: int, cache) -> torch.Tensor:
        mod = self.layers[str(layer)]
        m = x.shape[0]
        if getattr(cache, "training", False):      # a training sequence: starts at 0, nothing kept
            comp = self.plan.compress(ids.numpy() if isinstance(ids, torch.Tensor) else ids)
            out, _ = mod(x, torch.from_numpy(self.plan.rows(layer, comp)), None)
            return x + out
        s = self._stream(cache)
        if pos0 > s.known:
            raise EngramError(f"engram: this cache's positions before {pos0} were not computed with the graft "
                              f"attached (it knows {s.known}); reset the cache")
        fixed = self._native_args(layer, mod) if self.native and not torch.is_grad_enabled() and \
            native_engram.available() else None
        if fixed is not None:
            return self._native_forward(layer, fixed, x, ids, pos0, m, s)
        comp = self.plan.compress(ids.numpy() if isinstance(ids, torch.Tensor) else ids)
        k, p = self.plan.max_ngram - 1, mod.history
        rows = self.plan.rows(layer, comp, s.ids[max(0, pos0 - k):pos0])
        if pos0 >= p:
            prev = s.conv[layer][pos0 - p:pos0]
        else:
            prev = torch.cat([x.new_zeros(p - pos0, self.n_embd), s.conv[layer][:pos0]])
        out, vn = mod(x, torch.from_numpy(rows), prev)
        s.ids[pos0:pos0 + m] = comp
        s.conv[layer][pos0:pos0 + m] = vn.detach()
        s.known = pos0 + m
        return x + out

    def prefetch(self, ids, pos0: int, cache) -> None:
        """Before layer 0 runs: start reading this step's rows of every table mapped from
        its file (MADV_WILLNEED), so the pages arrive while the layers below the memory run."""
        if not self._mapped or getattr(cache, "training", False) or not native_engram.available():
            return
        s = self._streams.get(cache)
        if s is None or pos0 > s.known:
            return
        comp = self.plan.compress(np.asarray(ids).reshape(-1))
        prev = s.ids[max(0, pos0 - self.plan.max_ngram + 1):pos0]
        for lid, table in self._mapped.items():
            rows = np.ascontiguousarray(self.plan.rows(lid, comp, prev).reshape(-1))
            self.rows_prefetched += native_engram.willneed(table.ctypes.data, table.shape[1] * 4, table.shape[0],
                                                           rows.ctypes.data, rows.size)

    # -- inside the native step (DecoderBase's native residual hooks) ----------------------
    def native_hook(self, layer: int) -> tuple[int, int] | None:
        """(the step's hook, this layer's context) for a plan that runs the memory layer
        inside the decoder step (`DecoderPlan.with_hooks`); None: not on the native path."""
        if not (self.native and self.in_step and native_engram.available()):
            return None
        ctx = self._graft_layer(layer)
        return None if ctx is None else (native_engram.hook_address(), ctx)

    def _graft_layer(self, layer: int) -> int | None:
        """The layer's hook context, its arguments given again when a parameter moved (the
        context's address stays, so a plan built on it stays valid)."""
        fixed = self._native_args(layer, self.layers[str(layer)])
        if fixed is None:
            return None
        if self._graft is None:
            lookup = self.plan.lookup
            self._graft = native_engram.graft_new(len(self.plan.layer_ids), self.n_embd, self.plan.n_vocab,
                                                  0 if lookup is None else lookup.ctypes.data)
        got = self._graft_set.get(layer)
        if got is None or got[0] is not fixed:
            mapped = self._mapped.get(layer)
            ctx = native_engram.graft_layer(self._graft, self.plan.index(layer), fixed,
                                            0 if mapped is None else mapped.shape[1] * 4)
            got = self._graft_set[layer] = (fixed, ctx)
        return got[1]

    def bind(self, ids: torch.Tensor, pos0: int, cache) -> bool:
        """Before a native step that runs the memory layers inside it: hand the step's ids
        and this cache's history to the layers (ids checked and compressed, mapped tables'
        rows read ahead). False: this step cannot run them inside (the caller cuts the step).

        Once a step, so it is kept short: between two decode steps the model's weights have
        streamed through the caches, and each Python or torch call here starts cold (the
        full checks cost ~100 us a token there, against ~16 us in a warm loop). The checks
        run again when the cache, its stream or any parameter's storage changed."""
        if not (self.native and self.in_step) or torch.is_grad_enabled() or getattr(cache, "training", False):
            return False
        b = self._binding
        if b is None or b[0]() is not cache or b[1] is not self._streams.get(cache) or \
                tuple(p.data_ptr() for p in b[2]) != b[3]:
            b = self._bind_slow(cache)
            if b is None:
                return False
        s = b[1]
        if pos0 > s.known:
            raise EngramError(f"engram: this cache's positions before {pos0} were not computed with the graft "
                              f"attached (it knows {s.known}); reset the cache")
        if not (isinstance(ids, torch.Tensor) and ids.dtype is torch.long and ids.dim() == 1 and ids.is_contiguous()):
            ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).contiguous()
        m = ids.numel()
        try:
            self.rows_prefetched += native_engram.graft_bind(self._graft, ids.data_ptr(), m, s.ids_ptr, pos0,
                                                             s.ids.shape[0], s.conv_ptrs_ptr)
        except (IndexError, ValueError) as e:
            raise EngramError(str(e)) from None
        s.known = pos0 + m
        return True

    def _bind_slow(self, cache) -> tuple | None:
        """The checks `bind` skips while nothing moved: the native kernel, every layer's
        arguments (given again when a parameter moved), this cache's stream. Returns the
        binding (weak cache, stream, parameters, their addresses); None: not native."""
        self._binding = None
        if not native_engram.available() or any(self._graft_layer(lid) is None for lid in self.plan.layer_ids):
            return None
        params = tuple(p for lid in self.plan.layer_ids for p in self.layers[str(lid)]._parameters.values())
        self._binding = (weakref.ref(cache), self._stream(cache), params, tuple(p.data_ptr() for p in params))
        return self._binding

    @property
    def mapped_layers(self) -> list[int]:
        """The memory layers whose table is read from the mapped file."""
        return sorted(self._mapped)

    def _native_args(self, layer: int, mod: EngramLayer) -> tuple | None:
        """The layer's fixed arguments of the native forward (plan geometry and parameter
        addresses), rebuilt when a parameter's storage moved; None: a parameter the kernel
        cannot read (not f32 contiguous)."""
        ptrs = tuple(p.data_ptr() for p in mod._parameters.values())   # cheap: no Module.__getattr__
        pack = self._packs.get(layer)
        if pack is None or pack[0] != ptrs:
            params = [getattr(mod, name) for name in PARAMS]
            if any(p.dtype != torch.float32 or not p.is_contiguous() for p in params):
                return None
            ptrs = tuple(p.data_ptr() for p in mod._parameters.values())
            li, plan = self.plan.index(layer), self.plan
            keep = (np.ascontiguousarray(plan.multipliers[li]), plan.mods[li], plan.offsets[li])
            pt = {name: p.data_ptr() for name, p in zip(PARAMS, params)}
            fixed = (plan.max_ngram, plan.n_head, plan.pad, *(a.ctypes.data for a in keep), pt["table"],
                     plan.table_rows[li], self.head_dim, pt["key_w"], pt["key_b"], pt["key_norm"], pt["query_norm"],
                     pt["value_w"], pt["value_b"], pt["conv_norm"], pt["conv_w"], mod.kernel, mod.dilation)
            pack = self._packs[layer] = (ptrs, fixed, keep)
        return pack[1]

    def _native_forward(self, layer: int, fixed: tuple, x: torch.Tensor, ids, pos0: int, m: int,
                        s: _Stream) -> torch.Tensor:
        """x + the layer's output, one native call (the residual rows are copied, not
        written in place: the caller may hold them)."""
        if not (isinstance(ids, torch.Tensor) and ids.dtype is torch.long and ids.dim() == 1 and ids.is_contiguous()):
            ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).contiguous()
        out = x.clone() if x.dtype is torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
        if ids.numel() != m or out.shape != (m, self.n_embd):
            raise EngramError(f"engram: {tuple(x.shape)} residual rows and {ids.numel()} ids do not fit a layer "
                              f"of width {self.n_embd}")
        lookup = self.plan.lookup
        try:
            native_engram.forward(out.data_ptr(), m, self.n_embd, ids.data_ptr(), self.plan.n_vocab,
                                  0 if lookup is None else lookup.ctypes.data, s.ids_ptr, pos0, s.ids.shape[0],
                                  *fixed, s.conv_ptr[layer])
        except (IndexError, ValueError) as e:
            raise EngramError(str(e)) from None
        s.known = pos0 + m
        return out

    # -- the file -------------------------------------------------------------------------
    def tensors(self) -> dict[str, np.ndarray]:
        out = {"engram.multipliers": self.plan.multipliers}
        if self.plan.lookup is not None:
            out["engram.lookup"] = self.plan.lookup
        for lid, mod in self.layers.items():
            for name in PARAMS:
                out[f"engram.layers.{lid}.{name}"] = getattr(mod, name).detach().float().numpy()
        return out

    def config(self) -> dict:
        return dict(self.plan.describe(), n_embd=self.n_embd, head_dim=self.head_dim, kernel=self.kernel,
                    table_rows=self.plan.table_rows)

    def save(self, path: str | os.PathLike, extra: dict | None = None) -> None:
        meta = {"format": FORMAT, "config": json.dumps(self.config()), "model": json.dumps(self.model_id)}
        meta.update({k: json.dumps(v) for k, v in (extra or {}).items()})
        store.write(path, self.tensors(), meta)

    @classmethod
    def load(cls, path: str | os.PathLike, mmap: bool | None = None) -> "Engram":
        """A graft from its file; `mmap`: keep the tables mapped from the file (True), copy
        them into RAM (False), or by size (None: MMAP_DEFAULT, else above MMAP_AUTO_BYTES)."""
        mmap = MMAP_DEFAULT if mmap is None else mmap
        arrays, meta = store.read(path)
        if meta.get("format") != FORMAT:
            raise EngramError(f"{path}: not a fucina Engram file (format {meta.get('format')!r}, want {FORMAT})")
        try:
            cfg, model_id = json.loads(meta["config"]), json.loads(meta["model"])
            plan = HashPlan(n_vocab=cfg["n_vocab"], layer_ids=cfg["layer_ids"], max_ngram=cfg["max_ngram"],
                            n_head=cfg["n_head"], vocab_per_ngram=cfg["vocab_per_ngram"], pad_id=cfg["pad_id"],
                            seed=cfg["seed"], lookup=arrays.get("engram.lookup"),
                            multipliers=arrays["engram.multipliers"])
            n_embd, head_dim, kernel = int(cfg["n_embd"]), int(cfg["head_dim"]), int(cfg["kernel"])
        except (KeyError, TypeError, ValueError) as e:
            raise EngramError(f"{path}: the Engram metadata is incomplete or malformed ({e})") from None
        if cfg.get("table_rows") != plan.table_rows:
            raise EngramError(f"{path}: table sizes {cfg.get('table_rows')} disagree with the plan's {plan.table_rows}")
        eng = cls.__new__(cls)
        torch.nn.Module.__init__(eng)
        eng.plan, eng.n_embd, eng.head_dim, eng.kernel, eng.model_id = plan, n_embd, head_dim, kernel, model_id
        eng._streams, eng._attached, eng._packs = weakref.WeakKeyDictionary(), None, {}
        eng._mapped, eng.rows_prefetched = {}, 0
        eng._graft, eng._graft_set, eng._binding = None, {}, None
        e, layers = head_dim * plan.n_heads_total, {}
        shapes = dict(table=None, key_w=(n_embd, e), key_b=(n_embd,), key_norm=(n_embd,), query_norm=(n_embd,),
                      value_w=(n_embd, e), value_b=(n_embd,), conv_norm=(n_embd,), conv_w=(n_embd, kernel))
        expected = {"engram.multipliers"} | ({"engram.lookup"} if plan.lookup is not None else set())
        for i, lid in enumerate(plan.layer_ids):
            mod = EngramLayer.__new__(EngramLayer)
            torch.nn.Module.__init__(mod)
            mod.n_embd, mod.head_dim, mod.n_heads, mod.kernel, mod.dilation = (
                n_embd, head_dim, plan.n_heads_total, kernel, plan.max_ngram)
            for name in PARAMS:
                key = f"engram.layers.{lid}.{name}"
                expected.add(key)
                a = arrays.get(key)
                want = (plan.table_rows[i], head_dim) if name == "table" else shapes[name]
                if a is None or a.dtype != np.float32 or tuple(a.shape) != want:
                    raise EngramError(f"{path}: {key} is missing or not f32 {list(want)}")
                if name == "table" and (mmap if mmap is not None else a.nbytes > MMAP_AUTO_BYTES):
                    eng._mapped[lid] = a
                else:
                    a = np.array(a)          # into RAM
                t = torch.from_numpy(a)
                if a.nbytes <= MAX_CHECKED_BYTES and not bool(torch.isfinite(t).all()):
                    raise EngramError(f"{path}: {key} holds NaN or infinite values (a corrupt table)")
                setattr(mod, name, torch.nn.Parameter(t, requires_grad=False))
            layers[str(lid)] = mod
        extra = set(arrays) - expected
        if extra:
            raise EngramError(f"{path}: unexpected tensors {sorted(extra)[:4]}")
        eng.layers = torch.nn.ModuleDict(layers)
        return eng


def attach_file(model, path: str | os.PathLike, mmap: bool | None = None) -> Engram:
    """Load an Engram file and graft it onto `model` (checked against it); `mmap` as load's."""
    return Engram.load(path, mmap=mmap).attach(model)
