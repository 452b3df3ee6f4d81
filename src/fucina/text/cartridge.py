"""Serving behind a cartridge: its rows seated at the start of a cache, shadowed in the
token history by sentinel ids (negative: no real token equals one), so the generic
prefix reuse keeps them and the prompt that follows starts at position p.

A history describing a cache behind a cartridge is `prefix.ids + prompt + reply`; the
cache is re-seated (reset, rows written again) whenever it cannot keep all p rows,
since no token can re-create them.
"""
from __future__ import annotations

import os
import threading
from typing import Sequence

from fucina.errors import CartridgeError
from fucina.models.cartridge import Cartridge, compose
from fucina.models.cartridge_fleet import Fleet, Resident
from fucina.text.generate import common_prefix

CartridgeSpec = "str | os.PathLike | Cartridge | Sequence[str | os.PathLike | Cartridge]"


def load_cartridges(spec, model=None) -> Cartridge | None:
    """A path, a Cartridge, or a sequence of them (composed in order) as one Cartridge
    checked against `model` (when given); None or an empty sequence: None."""
    if spec is None:
        return None
    items = [spec] if isinstance(spec, (str, os.PathLike, Cartridge)) else list(spec)
    if not items:
        return None
    parts = []
    for it in items:
        if isinstance(it, Cartridge):
            parts.append(it)
        elif isinstance(it, (str, os.PathLike)):
            parts.append(Cartridge.load(it))
        else:
            raise CartridgeError(f"a cartridge is a path or a Cartridge, got {type(it).__name__}")
    cart = compose(parts)
    if model is not None:
        cart.check_model(model)
    return cart


class Prefix:
    """A cartridge as the fixed start of a cache and of its history. `tag` tells the
    sentinel ids of different cartridges apart (a fleet's: a slot that holds one
    cartridge's rows never matches a request for another)."""

    def __init__(self, cart: Cartridge, tag: int = 0):
        self.cart = cart
        self.p = cart.p
        base = -1 - (int(tag) << 24)
        self.ids = [base - i for i in range(cart.p)]

    def seat(self, cache, history: list[int]) -> None:
        cache.reset()
        history.clear()
        self.cart.write_to_cache(cache)
        history.extend(self.ids)

    def ensure(self, cache, history: list[int], ids: Sequence[int]) -> None:
        """Before a prefill of `ids` (which start with self.ids): re-seat the cache unless
        it holds the prefix and the rewind to the common prefix keeps all of it."""
        if len(history) < self.p or history[:self.p] != self.ids or cache.len < self.p:
            self.seat(cache, history)
            return
        keep = cache.truncate_point(min(common_prefix(history, ids), len(ids) - 1, cache.len))
        if keep < self.p:
            self.seat(cache, history)

    def add(self, ids: Sequence[int]) -> list[int]:
        return self.ids + [int(i) for i in ids]


class FleetPrefixes:
    """A fleet's trained cartridges as serving prefixes (`fucina serve --fleet`), loaded
    on first use and kept under `budget` bytes of RAM, the least recently used dropped
    first (reloaded from its file when asked for again). A request names its cartridges,
    or `retrieve` picks the `top_k` its text is closest to (text.retrieval, which needs
    the model and its tokenizer; top_k 0: none is retrieved); several compose in
    manifest order into one prefix."""

    def __init__(self, fleet: "Fleet | str | os.PathLike", model=None, budget: int = 1 << 30,
                 tokenizer=None, top_k: int = 0):
        self.fleet = fleet if isinstance(fleet, Fleet) else Fleet.open(fleet)
        self.model, self.tokenizer = model, tokenizer
        if top_k < 0:
            raise CartridgeError("top_k is the number of cartridges retrieval composes (0: no retrieval)")
        self.top_k = top_k
        self.index = None          # text.retrieval.FleetIndex, made by build_index()
        # named requests load in the server's handler, retrieved ones on the engine's thread
        self._lock = threading.RLock()
        self.resident: Resident[Prefix] = Resident(budget, self._load, lambda pr: 4 * sum(
            t.numel() for t in pr.cart.k + pr.cart.v if t is not None))

    def names(self) -> list[str]:
        """The cartridges that can be served (trained ones), in manifest order."""
        return [e.name for e in self.fleet.entries if self.fleet.trained(e)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.names()

    def prefix(self, name: str | Sequence[str]) -> Prefix:
        """The prefix of one cartridge, or of several composed in manifest order."""
        names = [name] if isinstance(name, str) else list(name)
        if not names:
            raise CartridgeError("no cartridge named")
        order = self.names()
        for n in names:
            if n not in order:
                raise CartridgeError(f"the fleet has no trained cartridge {n!r} "
                                     f"(it serves {', '.join(order) or 'none'})")
        with self._lock:
            return self.resident.get("+".join(n for n in order if n in names))   # '+' is in no name

    def build_index(self, log=lambda s: None):
        """The retrieval index over the trained documents (the saved one when current)."""
        from fucina.text.retrieval import fleet_index

        if self.model is None or self.tokenizer is None:
            raise CartridgeError("retrieval over a fleet needs the serving model and its tokenizer")
        self.index = fleet_index(self.model, self.tokenizer, self.fleet, self.names(), log=log)
        return self.index

    def retrieve(self, text: str) -> Prefix:
        """The prefix of the top_k cartridges `text` is closest to (runs the model)."""
        if self.index is None or self.index.names != self.names():
            self.build_index()
        return self.prefix(self.index.pick(self.model, self.tokenizer, text, self.top_k))

    def _load(self, key: str) -> Prefix:
        import zlib

        names = key.split("+")
        if len(names) > 1:     # composed: its own sentinel ids, from its parts' (above any one's)
            parts = [self.resident.get(n) for n in names]
            tag = (1 << 24) | (zlib.crc32(repr([pr.ids[0] for pr in parts]).encode()) & 0xFFFFFF)
            return Prefix(compose([pr.cart for pr in parts]), tag)
        e = self.fleet.get(key)
        path = self.fleet.path(e.file)
        if not os.path.exists(path):
            raise CartridgeError(f"the fleet's cartridge {key!r} is not trained yet ({path} does not exist)")
        cart = Cartridge.load(path)
        if self.model is not None:
            cart.check_model(self.model)
        st = os.stat(path)   # a retrained file gets new sentinel ids: no slot reuses the old rows
        tag = ((self.fleet.index(key) + 1) << 12) | (zlib.crc32(f"{st.st_mtime_ns}:{st.st_size}".encode()) & 0xFFF)
        return Prefix(cart, tag)
