"""An independent numpy/torch formulation of Engram's mechanism, written from the reference
demo's description (deepseek-ai/Engram `engram_demo_v1.py`), for the tests to pin
fucina.models.engram against: the hash (shifted copies, whole-array XOR, floored mod),
the prime chain, and the layer as plain torch modules (nn.Conv1d with causal padding).

    python tests/engram_reference.py     # rewrites tests/goldens/engram_hash.json
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

GOLDEN = Path(__file__).parent / "goldens" / "engram_hash.json"


def ref_is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def ref_primes(layer_ids, vocab_per_ngram, n_head):
    seen, out = set(), {}
    for lid in layer_ids:
        per = []
        for v in vocab_per_ngram:
            heads, start = [], v - 1
            for _ in range(n_head):
                c = start + 1
                while not (ref_is_prime(c) and c not in seen):
                    c += 1
                seen.add(c)
                heads.append(c)
                start = c
            per.append(heads)
        out[lid] = per
    return out


def ref_multipliers(layer_ids, max_ngram, vocab, seed):
    half = max(1, int(np.iinfo(np.int64).max // vocab) // 2)
    return {lid: np.random.default_rng(int(seed + 10007 * lid)).integers(0, half, size=(max_ngram,),
                                                                         dtype=np.int64) * 2 + 1
            for lid in layer_ids}


def ref_hash(x: np.ndarray, mult: np.ndarray, primes, max_ngram: int, pad: int) -> np.ndarray:
    """[B, T] compressed ids -> [B, T, heads] rows WITHOUT offsets (the reference's output)."""
    x = np.asarray(x, dtype=np.int64)
    B, T = x.shape
    shifts = [x if k == 0 else np.pad(x, ((0, 0), (k, 0)), constant_values=pad)[:, :T] for k in range(max_ngram)]
    out = []
    for n in range(2, max_ngram + 1):
        mix = shifts[0] * mult[0]
        for k in range(1, n):
            mix = np.bitwise_xor(mix, shifts[k] * mult[k])
        for p in primes[n - 2]:
            out.append(mix % int(p))
    return np.stack(out, axis=2)


def golden_case():
    rng = np.random.default_rng(5)
    n_vocab = 300
    lookup = rng.integers(0, 120, size=n_vocab).astype(np.int64)   # a compression onto 120 ids
    lookup[rng.integers(0, n_vocab)] = 119
    ids = rng.integers(0, n_vocab, size=(2, 23)).astype(np.int64)
    return dict(n_vocab=n_vocab, layer_ids=[1, 4], max_ngram=3, n_head=3, vocab_per_ngram=[29, 41], pad_id=7,
                seed=11, lookup=lookup, ids=ids)


def golden_values(case):
    comp = case["lookup"][case["ids"]]
    pad = int(case["lookup"][case["pad_id"]])
    vocab = int(case["lookup"].max()) + 1
    primes = ref_primes(case["layer_ids"], case["vocab_per_ngram"], case["n_head"])
    mults = ref_multipliers(case["layer_ids"], case["max_ngram"], vocab, case["seed"])
    rows = {lid: ref_hash(comp, mults[lid], primes[lid], case["max_ngram"], pad) for lid in case["layer_ids"]}
    return primes, mults, rows


# -- the layer, as modules --------------------------------------------------------------------

def ref_layer(p: dict, x: torch.Tensor, rows: torch.Tensor, kernel: int, dilation: int) -> torch.Tensor:
    """One sequence, hc_mult = 1: p holds table, key_w, key_b, key_norm, query_norm, value_w,
    value_b, conv_norm, conv_w ([d, kernel]); rows [T, heads] offsets included."""
    d = x.shape[-1]
    emb = F.embedding(rows, p["table"]).flatten(-2)
    key = F.linear(emb, p["key_w"], p["key_b"])
    nk = F.rms_norm(key, (d,), p["key_norm"], eps=torch.finfo(torch.float32).eps)
    nq = F.rms_norm(x, (d,), p["query_norm"], eps=torch.finfo(torch.float32).eps)
    gate = (nk * nq).sum(dim=-1) / math.sqrt(d)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gate = gate.sigmoid().unsqueeze(-1)
    value = gate * F.linear(emb, p["value_w"], p["value_b"])
    vn = F.rms_norm(value, (d,), p["conv_norm"], eps=1e-5)
    conv = torch.nn.Conv1d(d, d, kernel, groups=d, bias=False, padding=(kernel - 1) * dilation, dilation=dilation)
    y = F.conv1d(vn.t().unsqueeze(0), p["conv_w"].unsqueeze(1), None, conv.stride, conv.padding, conv.dilation,
                 conv.groups)[..., :x.shape[0]]
    return value + F.silu(y[0].t())


if __name__ == "__main__":
    case = golden_case()
    primes, mults, rows = golden_values(case)
    GOLDEN.write_text(json.dumps(dict(
        case={k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in case.items()},
        primes={str(k): v for k, v in primes.items()},
        multipliers={str(k): v.tolist() for k, v in mults.items()},
        rows={str(k): v.tolist() for k, v in rows.items()}), separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN}")
