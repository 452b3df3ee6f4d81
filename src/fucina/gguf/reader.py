"""GGUF reader: mmap the file, parse the header, hand out zero-copy tensor views.

Every length, count, offset and dimension is validated against the file before it
is used, so a corrupt or truncated file raises `GGUFError` naming the problem.
Split files (`name-00001-of-00003.gguf`) open as one model.
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from fucina.errors import GGUFError
from fucina.gguf.types import TYPE_SIZES, GGMLType, type_name

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_ELEMENTS = 1 << 40          # no real tensor comes near this; bounds size arithmetic
MAX_STRING = 1 << 30

# value type id -> (numpy dtype, struct code); 8 = string, 9 = array
_SCALARS = {
    0: ("<u1", "B"), 1: ("<i1", "b"), 2: ("<u2", "H"), 3: ("<i2", "h"),
    4: ("<u4", "I"), 5: ("<i4", "i"), 6: ("<f4", "f"), 7: ("<u1", "?"),
    10: ("<u8", "Q"), 11: ("<i8", "q"), 12: ("<f8", "d"),
}
T_STRING, T_ARRAY, T_BOOL = 8, 9, 7

_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: `shape` is torch order (outermost first), `ne` is GGML order."""

    name: str
    ggml_type: GGMLType
    ne: tuple[int, ...]
    offset: int            # absolute byte offset in its file
    nbytes: int
    part: int              # which split file holds it
    data: np.ndarray       # uint8 view into the mmap, zero-copy

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


_U64 = struct.Struct("<Q")


class _Cursor:
    """Bounds-checked little-endian reads over a buffer."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(f"{self.path}: truncated while reading {what} "
                            f"(need {n} bytes at offset {self.pos}, file has {self.size})")

    def scalar(self, code: str, what: str):
        n = struct.calcsize("<" + code)
        self.need(n, what)
        v = struct.unpack_from("<" + code, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("Q", what + " length")
        if n > MAX_STRING:
            raise GGUFError(f"{self.path}: absurd string length {n} in {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row: the vocabulary (~100k entries) is read here, so this
        loop stays tight (one unpack and one slice per string, the bound checked inline)."""
        buf, pos, size, out = self.buf, self.pos, self.size, [None] * count
        u64 = _U64.unpack_from
        for i in range(count):
            if pos + 8 > size:
                break
            (n,) = u64(buf, pos)
            end = pos + 8 + n
            if n > MAX_STRING or end > size:
                break
            out[i] = buf[pos + 8:end].decode("utf-8", "replace")
            pos = end
        else:
            self.pos = pos
            return out
        self.pos = pos
        self.string(what)              # raises the precise truncation/length error
        raise AssertionError("unreachable")

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            v = self.scalar(_SCALARS[vtype][1], what)
            return bool(v) if vtype == T_BOOL else v
        if vtype == T_STRING:
            return self.string(what)
        if vtype == T_ARRAY:
            sub = self.scalar("I", what + " element type")
            count = self.scalar("Q", what + " element count")
            if sub in _SCALARS:
                dt = np.dtype(_SCALARS[sub][0])
                self.need(count * dt.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.astype(bool) if sub == T_BOOL else arr.copy()
            if sub == T_STRING:
                self.need(count * 8, what)  # each string has at least its length field
                return self.strings(count, what)
            if sub == T_ARRAY:
                self.need(count * 12, what)
                return [self.value(T_ARRAY, what) for _ in range(count)]
            raise GGUFError(f"{self.path}: unknown array element type {sub} in {what}")
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} in {what}")


class _Part:
    def __init__(self, path: str):
        self.path = path
        try:
            self.fh = open(path, "rb")
        except OSError as e:
            raise GGUFError(f"cannot open {path}: {e.strerror or e}") from e
        size = os.fstat(self.fh.fileno()).st_size
        if size < 24:
            self.fh.close()
            raise GGUFError(f"{path}: too small to be a GGUF file ({size} bytes)")
        self.mm = mmap.mmap(self.fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = size


def _parse(part: _Part, index: int):
    cur = _Cursor(part.mm, part.path)
    magic = bytes(part.mm[:4])
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{part.path}: bad magic {magic!r}, not a GGUF file")
    cur.pos = 4
    version = cur.scalar("I", "version")
    if version not in (2, 3):
        if version and (version & 0xFFFF) == 0:
            raise GGUFError(f"{part.path}: big-endian GGUF is not supported")
        raise GGUFError(f"{part.path}: unsupported GGUF version {version} (need 2 or 3)")
    n_tensors = cur.scalar("Q", "tensor count")
    n_kv = cur.scalar("Q", "metadata count")
    # every kv needs >= 12 bytes, every tensor info >= 28: cheap sanity before looping
    if n_kv * 12 + n_tensors * 28 > part.size:
        raise GGUFError(f"{part.path}: header claims {n_tensors} tensors and {n_kv} "
                        f"metadata entries, more than the file can hold")
    meta: dict[str, Any] = {}
    types: dict[str, int] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        vtype = cur.scalar("I", f"type of {key}")
        meta[key] = cur.value(vtype, key)
        types[key] = vtype
    alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{part.path}: general.alignment must be a power of two, got {alignment!r}")
    raw = []
    for _ in range(n_tensors):
        name = cur.string("tensor name")
        n_dims = cur.scalar("I", f"dims of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{part.path}: tensor {name!r} has {n_dims} dims (1..{MAX_DIMS} allowed)")
        ne = tuple(cur.scalar("Q", f"shape of {name}") for _ in range(n_dims))
        t = cur.scalar("I", f"type of {name}")
        off = cur.scalar("Q", f"offset of {name}")
        raw.append((name, ne, t, off))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, ne, t, off in raw:
        try:
            gt = GGMLType(t)
            block, bsize = TYPE_SIZES[gt]
        except (ValueError, KeyError):
            raise GGUFError(f"{part.path}: tensor {name!r} has unknown type {type_name(t)}") from None
        n = 1
        for d in ne:
            if d <= 0 or d > MAX_ELEMENTS:
                raise GGUFError(f"{part.path}: tensor {name!r} has absurd shape {ne}")
            n *= d
            if n > MAX_ELEMENTS:
                raise GGUFError(f"{part.path}: tensor {name!r} has absurd shape {ne}")
        if ne[0] % block:
            raise GGUFError(f"{part.path}: tensor {name!r} row length {ne[0]} is not a multiple "
                            f"of the {gt.name} block size {block}")
        nbytes = n // block * bsize
        start = data_start + off
        if off % alignment:
            raise GGUFError(f"{part.path}: tensor {name!r} offset {off} is not {alignment}-aligned")
        if start + nbytes > part.size:
            raise GGUFError(f"{part.path}: tensor {name!r} data [{start}, {start + nbytes}) runs "
                            f"past the end of the file ({part.size} bytes)")
        if name in tensors:
            raise GGUFError(f"{part.path}: duplicate tensor name {name!r}")
        view = np.frombuffer(part.mm, dtype=np.uint8, count=nbytes, offset=start)
        tensors[name] = TensorInfo(name, gt, ne, start, nbytes, index, view)
    return version, meta, types, tensors


class GGUFFile:
    """A parsed GGUF model (one file or all parts of a split set).

    `metadata`: key -> Python value (int/float/bool/str, numpy array for numeric
    arrays, list of str for string arrays). `tensors`: name -> TensorInfo.
    """

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if not os.path.exists(path):
            raise GGUFError(f"no such file: {path}")
        if os.path.isdir(path):
            raise GGUFError(f"{path} is a directory, not a GGUF file")
        self.path = path
        self._parts: list[_Part] = []
        try:
            self._load(path)
        except BaseException:
            self.close()
            raise

    def _load(self, path: str) -> None:
        first = _Part(path)
        self._parts.append(first)
        self.version, self.metadata, self.value_types, self.tensors = _parse(first, 0)
        count = int(self.metadata.get("split.count", 1) or 1)
        if count <= 1:
            return
        m = _SPLIT_RE.match(path)
        if not m or int(m["no"]) != 1:
            raise GGUFError(f"{path}: split file set (split.count={count}); open the first part "
                            f"(NAME-00001-of-{count:05d}.gguf)")
        for i in range(2, count + 1):
            p = f"{m['stem']}-{i:05d}-of-{count:05d}.gguf"
            part = _Part(p)
            self._parts.append(part)
            _, meta_i, _, tensors_i = _parse(part, i - 1)
            if int(meta_i.get("split.no", i - 1)) != i - 1:
                raise GGUFError(f"{p}: split.no is {meta_i.get('split.no')}, expected {i - 1}")
            for name, info in tensors_i.items():
                if name in self.tensors:
                    raise GGUFError(f"{p}: tensor {name!r} also appears in an earlier part")
                self.tensors[name] = info
        want = self.metadata.get("split.tensors.count")
        if want is not None and int(want) != len(self.tensors):
            raise GGUFError(f"{path}: split set holds {len(self.tensors)} tensors, "
                            f"split.tensors.count says {want}")

    # -- convenience -------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise GGUFError(f"{self.path}: general.architecture is missing")
        return arch

    @property
    def file_size(self) -> int:
        return sum(p.size for p in self._parts)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: missing tensor {name!r}") from None

    def part_path(self, t: TensorInfo) -> str:
        """The file (of a split GGUF, the part) that holds `t`'s bytes at `t.offset`."""
        return self._parts[t.part].path

    def release(self, t: TensorInfo) -> None:
        """Drop `t`'s pages from this process's resident set (after its bytes were copied
        into a repacked or fused weight), so the model is not held twice in memory.
        The mapping stays valid: a later read faults the pages back in."""
        page = mmap.PAGESIZE
        start = -(-t.offset // page) * page
        end = (t.offset + t.nbytes) // page * page
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            self._parts[t.part].mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def close(self) -> None:
        # numpy views may still reference the mmap; let GC close it in that case
        for p in self._parts:
            try:
                p.mm.close()
            except BufferError:
                pass
            p.fh.close()
        self._parts = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, {len(self.tensors)} tensors, {len(self.metadata)} keys)"


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    return GGUFFile(path)
