"""PTQTP planes in a GGUF file: how a trit-plane-decorated matrix is stored and found.

A matrix `<name>` decorated with K trit-planes (fucina.quant.ptqtp, K in 1..3) is stored
as K tensors `<name>.ptqtp0` .. `<name>.ptqtp{K-1}` in place of `<name>`, each a plain
TQ2_0 tensor of `<name>`'s shape: every 256 values of a row are one 66-byte TQ2_0 block,
64 bytes of 2-bit codes q = trit + 1 and the group's scale as the block's f16 `d` (the
plane's magnitude for that row and 256-column group, >= 0; a negative fitted scale is
folded into the trits). The matrix is the sum of the K dequantized planes in plane
order. Every other tensor and key is copied byte for byte; the writer adds the keys
`fucina.ptqtp.version` (the layout above: 1) and `fucina.ptqtp.planes` (the K it wrote).
A scale-tied fit (fucina.quant.ptqtp, `--ptqtp 2 --tie`) keeps this layout, its plane 0's d
exactly 3 times plane 1's in every group, and adds `fucina.ptqtp.tie_scales` = 1: fucina
then serves each matrix folded (one dot pass, its own canonical result); a reader that
ignores the key reads the same weights as two planes.

Detection (`planes_of`) is gated on `fucina.ptqtp.version`: a file without it never
has its `.ptqtpN` tensors read as planes. Torch-free (the schema check uses it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from fucina.errors import GGUFError
from fucina.gguf.reader import GGUFFile, TensorInfo
from fucina.gguf.types import GGMLType

VERSION_KEY, PLANES_KEY, TIE_KEY = "fucina.ptqtp.version", "fucina.ptqtp.planes", "fucina.ptqtp.tie_scales"
VERSION = 1
SUFFIX = ".ptqtp"
MAX_PLANES = 3
_PLANE_RE = re.compile(r"^(?P<base>.+)\.ptqtp(?P<p>\d+)$")


@dataclass(frozen=True)
class PtqtpInfo(TensorInfo):
    """A decorated matrix as the schema sees it: `<name>`'s shape, its planes' tensors."""

    planes: tuple[TensorInfo, ...] = ()
    tied: bool = False


def plane_name(name: str, p: int) -> str:
    return f"{name}{SUFFIX}{p}"


def is_decorated(f: GGUFFile) -> bool:
    return f.metadata.get(VERSION_KEY) is not None


def _check_header(f: GGUFFile) -> None:
    v = f.metadata.get(VERSION_KEY)
    if v != VERSION:
        raise GGUFError(f"{f.path}: {VERSION_KEY} is {v!r}; this version of fucina reads PTQTP layout {VERSION}")


def planes_of(f: GGUFFile, name: str) -> PtqtpInfo | None:
    """`name` stored as PTQTP planes in f, checked, or None (not decorated, or no planes).
    Raises GGUFError for a plane missing from 0..K-1, a plane index past 2 (K outside
    1..3), planes that are not TQ2_0 or differ in shape, or `name` present beside them."""
    if not is_decorated(f):
        return None
    _check_header(f)
    found = {}
    prefix = name + SUFFIX
    for tname, t in f.tensors.items():
        if tname.startswith(prefix):
            m = _PLANE_RE.match(tname)
            if m is not None and m["base"] == name:
                found[int(m["p"])] = t
    if not found:
        return None
    k = max(found) + 1
    if k > MAX_PLANES:
        raise GGUFError(f"{f.path}: {name} has a plane {plane_name(name, k - 1)}: PTQTP takes 1, 2 or 3 planes")
    want = f.metadata.get(PLANES_KEY)
    if want is not None and int(want) > k:
        k = int(want)
    missing = [plane_name(name, p) for p in range(k) if p not in found]
    if missing:
        raise GGUFError(f"{f.path}: PTQTP matrix {name} lacks plane tensor(s) {', '.join(missing)} "
                        f"(the file's {PLANES_KEY} is {want}); the file is incomplete: write it again")
    if name in f.tensors:
        raise GGUFError(f"{f.path}: {name} is stored both whole and as PTQTP planes")
    tied = bool(f.metadata.get(TIE_KEY))
    if tied and k != 2:
        raise GGUFError(f"{f.path}: {name} has {k} PTQTP planes but the file's {TIE_KEY} says scale-tied "
                        "(2 planes): the file is inconsistent: write it again")
    planes = tuple(found[p] for p in range(k))
    first = planes[0]
    for t in planes:
        if t.ggml_type is not GGMLType.TQ2_0 or t.ne != first.ne or len(t.ne) != 2:
            raise GGUFError(f"{f.path}: PTQTP plane {t.name} must be a TQ2_0 matrix of {name}'s shape "
                            f"(got {t.ggml_type.name} {list(t.ne)})")
    return PtqtpInfo(name=name, ggml_type=GGMLType.TQ2_0, ne=first.ne, offset=first.offset,
                     nbytes=sum(t.nbytes for t in planes), part=first.part, data=first.data, planes=planes,
                     tied=tied)


def decorated_names(f: GGUFFile) -> list[str]:
    """The matrices f stores as planes (each checked by `planes_of`), in file order."""
    if not is_decorated(f):
        return []
    names = []
    for tname in f.tensors:
        m = _PLANE_RE.match(tname)
        if m is not None and m["base"] not in names:
            names.append(m["base"])
    for n in names:
        planes_of(f, n)
    return names
