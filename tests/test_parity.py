"""Whole-model parity with llama.cpp: committed goldens always, the live oracle when present.

Thresholds from the foundation issue: top-1 agreement >= 98% and the 32-token greedy
continuation equal to llama.cpp's on the real quantized files; per-position cosine >= 0.999
where the arithmetic is defined the same on both sides.

Why the cosine bound is checked on F32 copies: llama.cpp quantizes activations to 8 bits
before every quantized matmul, and on these small models (activation outliers make the
int8 grid coarse) that rounding alone moves some positions' logits to cosine ~0.99 of the
exact result: llama.cpp on SmolLM2 Q4_1 vs llama.cpp on the same weights stored as F32 has
min cosine 0.989 over 588 positions (mean 0.9992); Gemma-3 Q4_K_M vs its F32 copy, mean
0.9985, min 0.9916 over the golden's 96 positions. So on the quantized files we bound the
mean cosine (>= 0.998) and the worst position (>= 0.98); on F32 copies made with llama-quantize (same
weight values, no activation rounding) every position must reach 0.999.
"""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import oracle as oracle_mod
from conftest import VOCAB_DIR, cached_model
from fucina.models import load_model
from fucina.text.evaluate import greedy, teacher_forced_logits
from parity_cases import CASES, GREEDY, qwen3_synth

GOLDENS = Path(__file__).parent / "goldens"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(src):
        if src not in cache:
            if src == "qwen3-synth":
                if not (VOCAB_DIR / "vocab-qwen3.gguf").exists():
                    pytest.skip("shared Qwen3 vocab not present")
                p = qwen3_synth(tmp_path_factory.mktemp("q") / "qwen3-synth.gguf",
                                VOCAB_DIR / "vocab-qwen3.gguf")
            else:
                p = cached_model(src)
                if p is None:
                    pytest.skip(f"{src} unavailable")
            cache[src] = (p, load_model(p))
        return cache[src]
    return get


def _scored_logits(model, g):
    return teacher_forced_logits(model, g["ids"], last=len(g["ids"]) - g["first_scored"]).numpy()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_golden_logits(models, case):
    g = json.loads((GOLDENS / f"{case}.json").read_text())
    _, model = models(g["model"])
    ours = _scored_logits(model, g)
    top_ref = np.array(g["topk_ids"])
    top1 = (ours.argmax(1) == top_ref[:, 0]).mean()
    assert top1 >= 0.98, f"top-1 agreement {top1:.3f}"
    # the reference's top-k log-probabilities, re-read from our logits
    ref_lp = np.array(g["topk_logits"]) - np.array(g["logsumexp"])[:, None]
    lse = torch.logsumexp(torch.from_numpy(ours).double(), 1).numpy()
    our_lp = np.take_along_axis(ours, top_ref, 1) - lse[:, None]
    p = np.exp(ref_lp)
    err = (p * np.abs(our_lp - ref_lp)).sum(1) / p.sum(1)   # probability-weighted log-prob error
    assert np.median(err) < 0.05 and err.max() < 0.25, (np.median(err), err.max())


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_golden_greedy(models, case):
    g = json.loads((GOLDENS / f"{case}.json").read_text())
    _, model = models(g["model"])
    assert greedy(model, g["ids"], GREEDY) == g["greedy"]


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("case", list(CASES))
def test_live_logits(models, oracle, tmp_path, case):
    g = json.loads((GOLDENS / f"{case}.json").read_text())
    path, model = models(g["model"])
    n = len(g["ids"]) - g["first_scored"]
    out = tmp_path / "ref.f32"
    oracle_mod.run("llama-logits", str(path), ",".join(map(str, g["ids"])), str(out), "--last", str(n))
    ref = np.fromfile(out, dtype="<f4").reshape(n, -1)
    ours = _scored_logits(model, g)
    cos = (ref * ours).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(ours, axis=1)
    assert cos.mean() >= 0.998 and cos.min() >= 0.98, (cos.mean(), cos.min())
    assert (ref.argmax(1) == ours.argmax(1)).mean() >= 0.98


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("case", ["smollm2", "gemma3"])
def test_live_logits_exact_arithmetic(models, oracle, tmp_path, case):
    """Same weight values as F32: every position's cosine >= 0.999 (the issue's bound)."""
    g = json.loads((GOLDENS / f"{case}.json").read_text())
    path, _ = models(g["model"])
    f32 = tmp_path / "f32.gguf"
    oracle_mod.run("llama-quantize", "--allow-requantize", str(path), str(f32), "F32")
    model = load_model(f32)
    ids = g["ids"][:300] if case == "smollm2" else g["ids"][:700]   # gemma: past the 512 window
    n = 200
    out = tmp_path / "ref.f32"
    oracle_mod.run("llama-logits", str(f32), ",".join(map(str, ids)), str(out), "--last", str(n))
    ref = np.fromfile(out, dtype="<f4").reshape(n, -1)
    ours = teacher_forced_logits(model, ids, last=n).numpy()
    cos = (ref * ours).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(ours, axis=1)
    assert cos.min() >= 0.999, f"min cosine {cos.min():.6f}"
    assert (ref.argmax(1) == ours.argmax(1)).mean() >= 0.98
