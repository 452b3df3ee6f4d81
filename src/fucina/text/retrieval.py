"""Retrieval over a cartridge fleet: which documents' cartridges a request composes.

A document is cut into chunks of `chunk` tokens; a text's embedding is the serving
model's last-layer rows, each RMS-normalised (a decoder's residual rows differ in scale
by orders of magnitude, the first one most), averaged over the text's tokens. The
fleet's chunk embeddings are centred on their mean (pooled decoder states share one
large common direction that would otherwise dominate every cosine) and L2-normalised; a
query is embedded the same way, centred by the same mean and normalised; a document
scores its best chunk's cosine, and the top k documents are the request's cartridges,
composed in manifest order (so one set of documents is one prefix, whatever the scores).

The index is saved beside the manifest (`index.safetensors`) with what it was built
from (the model's identity, the chunk length, each document's hash) and one chunk's
embedding that a load recomputes: an index for another model, another quantization of
it, or an edited document is rebuilt, never used.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from fucina.errors import CartridgeError
from fucina.models.cartridge import model_identity, read_safetensors, write_safetensors
from fucina.models.cartridge_fleet import Fleet

INDEX = "index.safetensors"
CHUNK = 128


@torch.inference_mode()
def embed(model, ids: Sequence[int]) -> torch.Tensor:
    """The pooled embedding [n_embd] (f32) of a token sequence: its last-layer rows,
    each RMS-normalised, averaged. Row 0 is left out when there are others (it is the
    attention sink: its row is an outlier whatever the text)."""
    ids = [int(i) for i in ids]
    if not ids:
        raise CartridgeError("cannot embed an empty text")
    cache = model.init_cache(len(ids) + 1)
    rows = model.forward_hidden(cache, ids, 0).float()
    if rows.shape[0] > 1:
        rows = rows[1:]
    rows = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6)
    return rows.mean(0)


def chunks_of(ids: Sequence[int], chunk: int) -> list[list[int]]:
    """`ids` cut into consecutive pieces of `chunk` tokens (the last may be shorter;
    a last piece under a quarter of `chunk` joins the one before)."""
    ids = [int(i) for i in ids]
    out = [ids[s:s + chunk] for s in range(0, len(ids), chunk)]
    if len(out) > 1 and len(out[-1]) < chunk // 4:
        out[-2].extend(out.pop())
    return out


@dataclass
class FleetIndex:
    names: list[str]              # the documents indexed, in manifest order
    owner: torch.Tensor           # [chunks] int64: the document (index into names) of each chunk
    vectors: torch.Tensor         # [chunks, n_embd] f32: centred, L2-normalised
    mean: torch.Tensor            # [n_embd]: the centre
    key: dict                     # what it was built from (model, chunk, documents' hashes)
    probe: torch.Tensor           # [n_embd]: the raw embedding of the first chunk (model check)

    @classmethod
    def build(cls, model, tokenizer, fleet: Fleet, names: Sequence[str], chunk: int = CHUNK) -> "FleetIndex":
        if chunk < 8:
            raise CartridgeError("a retrieval chunk is at least 8 tokens")
        if not names:
            raise CartridgeError("the fleet has no trained cartridge to retrieve from")
        raw, owner = [], []
        for d, name in enumerate(names):
            ids = _ids(tokenizer, fleet.corpus(fleet.get(name)))
            if not ids:
                raise CartridgeError(f"the fleet's document {name!r} is empty")
            for piece in chunks_of(ids, chunk):
                raw.append(embed(model, piece))
                owner.append(d)
        raw = torch.stack(raw)
        mean = raw.mean(0)
        return cls(list(names), torch.tensor(owner, dtype=torch.int64), _unit(raw - mean), mean,
                   index_key(model, fleet, names, chunk), raw[0].clone())

    def scores(self, vector: torch.Tensor) -> list[tuple[str, float]]:
        """Every document's score for a raw embedding (its best chunk's cosine), best first
        (ties in manifest order)."""
        cos = self.vectors @ _unit(vector - self.mean)
        best = torch.full((len(self.names),), -2.0).scatter_reduce(0, self.owner, cos, "amax")
        ranked = sorted(range(len(self.names)), key=lambda d: (-float(best[d]), d))
        return [(self.names[d], float(best[d])) for d in ranked]

    def pick(self, model, tokenizer, text: str, k: int = 1) -> list[str]:
        """The k documents `text` is closest to, in manifest order."""
        ids = _ids(tokenizer, text) if text else []
        if not ids:                       # nothing to go by: the first k documents
            top = self.names[:k]
        else:
            top = [n for n, _ in self.scores(embed(model, ids))[:k]]
        return [n for n in self.names if n in top]

    # -- persistence ---------------------------------------------------------------------
    def save(self, path: str) -> None:
        write_safetensors(path, {"owner": self.owner, "vectors": self.vectors, "mean": self.mean,
                                 "probe": self.probe},
                          {"format": "fucina.fleet-index", "names": json.dumps(self.names),
                           "key": json.dumps(self.key, sort_keys=True)})

    @classmethod
    def load(cls, path: str) -> "FleetIndex":
        try:
            t, meta = read_safetensors(path)
            if meta.get("format") != "fucina.fleet-index":
                raise CartridgeError("not a fleet index")
            names, key = json.loads(meta["names"]), json.loads(meta["key"])
            owner, vectors, mean, probe = t["owner"], t["vectors"], t["mean"], t["probe"]
            ok = (isinstance(names, list) and vectors.ndim == 2 and owner.shape == (vectors.shape[0],)
                  and mean.shape == probe.shape == (vectors.shape[1],) and owner.dtype == torch.int64
                  and bool(((owner >= 0) & (owner < len(names))).all()))
            if not ok:
                raise CartridgeError("its tensors do not fit together")
        except (CartridgeError, KeyError, ValueError) as e:
            raise CartridgeError(f"cannot read the fleet index {path}: {e}") from None
        return cls(names, owner, vectors.float(), mean.float(), key, probe.float())


def index_key(model, fleet: Fleet, names: Sequence[str], chunk: int) -> dict:
    docs = {}
    for n in names:
        with open(fleet.path(fleet.get(n).corpus), "rb") as fh:
            docs[n] = hashlib.sha256(fh.read()).hexdigest()
    return {"model": model_identity(model), "chunk": chunk, "documents": docs}


def fleet_index(model, tokenizer, fleet: Fleet, names: Sequence[str], chunk: int = CHUNK,
                log=lambda s: None) -> FleetIndex:
    """The fleet's index for `names` (its trained documents): the saved one when it was
    built from this model, chunk length and these documents, else built and saved."""
    path = fleet.path(INDEX)
    if os.path.exists(path):
        try:
            idx = FleetIndex.load(path)
            if idx.names == list(names) and idx.key == index_key(model, fleet, names, chunk):
                first = chunks_of(_ids(tokenizer, fleet.corpus(fleet.get(names[0]))), chunk)[0]
                if torch.allclose(embed(model, first), idx.probe, rtol=1e-3, atol=1e-4):
                    return idx
            log(f"the fleet index {path} is stale: rebuilding it")
        except CartridgeError as e:
            log(f"{e}: rebuilding it")
    idx = FleetIndex.build(model, tokenizer, fleet, names, chunk)
    try:
        idx.save(path)
    except OSError as e:             # a read-only fleet still serves; the index is rebuilt next time
        log(f"cannot save the fleet index {path}: {e.strerror or e}")
    return idx


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special=False, parse_special=False)
