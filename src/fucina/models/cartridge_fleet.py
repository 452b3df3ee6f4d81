"""Cartridge fleets: one cartridge per document, many documents, a RAM budget.

A fleet is a directory with a manifest, `fleet.json`:

    {"format": "fucina.cartridge-fleet", "version": 1,
     "cartridges": [{"name": "handbook", "corpus": "handbook.txt", "file": "handbook.safetensors",
                     "p": 128, "seed": 0, "conversations": 64, "steps": 16}, ...]}

`corpus` and `file` are relative to the directory (the document, and its cartridge once
trained; `file.ckpt` beside it holds the training state); `conversations`/`steps` record
the training done. Names are what a request selects a cartridge by (`fucina serve
--fleet`), so they are unique and made of letters, digits, `.`, `_` and `-`.

`Resident` is the RAM budget: at most `budget` bytes of loaded items, the least recently
used evicted first (an item's state is on disk whenever it may be evicted, so eviction
only drops it and the next use reloads it); at least one item stays resident whatever
the budget. Serving keeps loaded cartridges in one; training keeps cartridges with their
optimizer state in another (train.cartridge_fleet).
"""
from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Callable, Generic, TypeVar

from fucina.errors import CartridgeError

FORMAT = "fucina.cartridge-fleet"
VERSION = 1
MANIFEST = "fleet.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class Entry:
    name: str
    corpus: str                 # the document, relative to the fleet directory
    file: str                   # its cartridge (relative), once trained
    p: int = 128
    seed: int = 0
    conversations: int = 0      # self-study conversations trained so far
    steps: int = 0              # optimizer steps so far


class Fleet:
    """A fleet directory and its manifest (`Fleet.open(dir)`, `Fleet.create(dir)`)."""

    def __init__(self, root: str, entries: list[Entry]):
        self.root = root
        self.entries = entries

    # -- the manifest ------------------------------------------------------------------
    @staticmethod
    def manifest_path(path: str | os.PathLike) -> str:
        path = str(path)
        return path if path.endswith(".json") else os.path.join(path, MANIFEST)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Fleet":
        """The fleet at `path` (its directory or its manifest)."""
        mpath = cls.manifest_path(path)
        try:
            with open(mpath, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            raise CartridgeError(f"no fleet at {path}: {mpath} does not exist "
                                 f"(`fucina cartridge fleet add {path} ...` makes one)") from None
        except (OSError, ValueError) as e:
            raise CartridgeError(f"cannot read the fleet manifest {mpath}: {e}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CartridgeError(f"{mpath} is not a cartridge fleet manifest")
        if data.get("version") != VERSION:
            raise CartridgeError(f"{mpath}: fleet manifest version {data.get('version')!r}, "
                                 f"this fucina reads {VERSION}")
        entries = []
        for i, e in enumerate(data.get("cartridges", [])):
            try:
                entries.append(Entry(**e))
            except TypeError as err:
                raise CartridgeError(f"{mpath}: cartridge {i} is malformed ({err})") from None
        fleet = cls(os.path.dirname(os.path.abspath(mpath)), entries)
        fleet._check()
        return fleet

    @classmethod
    def create(cls, path: str | os.PathLike) -> "Fleet":
        """The fleet at `path`, an empty one when it has no manifest yet."""
        mpath = cls.manifest_path(path)
        if os.path.exists(mpath):
            return cls.open(path)
        os.makedirs(os.path.dirname(os.path.abspath(mpath)), exist_ok=True)
        fleet = cls(os.path.dirname(os.path.abspath(mpath)), [])
        fleet.save()
        return fleet

    def _check(self) -> None:
        seen = set()
        for e in self.entries:
            if not isinstance(e.name, str) or not _NAME.match(e.name):
                raise CartridgeError(f"fleet cartridge name {e.name!r}: use letters, digits, '.', '_', '-'")
            if e.name in seen:
                raise CartridgeError(f"the fleet names {e.name!r} twice")
            seen.add(e.name)

    def save(self) -> None:
        mpath = os.path.join(self.root, MANIFEST)
        tmp = mpath + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"format": FORMAT, "version": VERSION, "cartridges": [asdict(e) for e in self.entries]},
                      fh, indent=1)
            fh.write("\n")
        os.replace(tmp, mpath)

    # -- entries -----------------------------------------------------------------------
    def add(self, name: str, corpus: str, *, p: int = 128, seed: int | None = None) -> Entry:
        """Register a document (copied into the fleet directory when it lies elsewhere)."""
        if any(e.name == name for e in self.entries):
            raise CartridgeError(f"the fleet already has a cartridge named {name!r}")
        if p < 1:
            raise CartridgeError("p must be at least 1")
        src = os.path.abspath(corpus)
        if not os.path.isfile(src):
            raise CartridgeError(f"the document {corpus} does not exist")
        rel = os.path.relpath(src, self.root)
        if rel.startswith(".."):
            import shutil

            rel = f"{name}.txt"
            shutil.copyfile(src, os.path.join(self.root, rel))
        entry = Entry(name, rel, f"{name}.safetensors", p=p, seed=len(self.entries) if seed is None else seed)
        self.entries.append(entry)
        self._check()
        self.save()
        return entry

    def get(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise CartridgeError(f"the fleet has no cartridge named {name!r} "
                             f"(it has {', '.join(e.name for e in self.entries) or 'none'})")

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def corpus(self, e: Entry) -> str:
        try:
            with open(self.path(e.corpus), encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except OSError as err:
            raise CartridgeError(f"cannot read {e.name}'s document {self.path(e.corpus)}: "
                                 f"{err.strerror or err}") from None

    def trained(self, e: Entry) -> bool:
        return os.path.exists(self.path(e.file))

    def index(self, name: str) -> int:
        return next(i for i, e in enumerate(self.entries) if e.name == name)


T = TypeVar("T")


class Resident(Generic[T]):
    """Items loaded on demand under a RAM budget, the least recently used evicted first.
    `load(key)` makes an item, `size(item)` its bytes, `evict(key, item)` (optional) is
    told before an item is dropped."""

    def __init__(self, budget: int, load: Callable[[str], T], size: Callable[[T], int],
                 evict: Callable[[str, T], None] | None = None):
        self.budget = budget
        self._load, self._size, self._evict = load, size, evict
        self.items: OrderedDict[str, T] = OrderedDict()
        self.loads = 0
        self.evictions = 0

    def get(self, key: str) -> T:
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        item = self._load(key)
        self.loads += 1
        self.items[key] = item
        self._fit(keep=key)
        return item

    def _fit(self, keep: str) -> None:
        while len(self.items) > 1 and self.bytes() > self.budget:
            key = next(k for k in self.items if k != keep)
            self.drop(key)

    def drop(self, key: str) -> None:
        item = self.items.pop(key)
        self.evictions += 1
        if self._evict is not None:
            self._evict(key, item)

    def bytes(self) -> int:
        return sum(self._size(v) for v in self.items.values())

    def __contains__(self, key: str) -> bool:
        return key in self.items
