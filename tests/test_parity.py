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

import gguf

import fucina.kernels as K
import oracle as oracle_mod
from conftest import VOCAB_DIR, cached_model
from fucina.models import load_model
from fucina.text.evaluate import greedy, teacher_forced_logits
from parity_cases import CASES, GREEDY, SYNTH, TEXT

GOLDENS = Path(__file__).parent / "goldens"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(src):
        if src not in cache:
            if src in SYNTH:
                if not (VOCAB_DIR / "vocab-qwen3.gguf").exists():
                    pytest.skip("shared Qwen3 vocab not present")
                p = SYNTH[src](tmp_path_factory.mktemp("q") / f"{src}.gguf", VOCAB_DIR / "vocab-qwen3.gguf")
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


def _cos(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def oracle_tokens(path, text, tmp_path) -> list[int]:
    """llama.cpp's token ids of `text` with the file's vocabulary."""
    f = tmp_path / "p.txt"
    f.write_text(text)
    return [int(x) for x in oracle_mod.run("llama-tokenize", "-m", str(path), "-f", str(f), "--ids",
                                           "--log-disable").strip().strip("[]").split(",")]


def ours_and_exact(path, ids):
    """Our logits of `ids` and the exact model's (the reference path: f32 arithmetic)."""
    ours = teacher_forced_logits(load_model(path), ids).numpy()
    K.set_enabled(False)
    try:
        return ours, teacher_forced_logits(load_model(path), ids).numpy()
    finally:
        K.set_enabled(True)


def _live(path, ids, tmp_path, *extra):
    out = tmp_path / "ref.f32"
    oracle_mod.run("llama-logits", str(path), ",".join(map(str, ids)), str(out), *extra)
    return np.fromfile(out, dtype="<f4").reshape(len(ids), -1)


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("name", ["qwen2-synth", "phi3-synth", "qwen35-synth", "qwen3moe-synth", "qwen35moe-synth"])
def test_live_quantized_closer_to_exact_than_llama_cpp(oracle, tmp_path, name):
    """Q8_0 random weights: ours and llama.cpp's logits against the exact model (the same
    weights in f32 arithmetic, our reference path); ours must be at least as close. Measured
    when written: 1 - mean cosine qwen2 1.7e-5 (llama.cpp 9.5e-5), phi3 3.4e-5 (2.1e-4)."""
    if not (VOCAB_DIR / "vocab-qwen3.gguf").exists():
        pytest.skip("shared Qwen3 vocab not present")
    path = SYNTH[name](tmp_path / "m.gguf", VOCAB_DIR / "vocab-qwen3.gguf", gguf.GGMLQuantizationType.Q8_0)
    ids = oracle_tokens(path, TEXT, tmp_path)
    ref = _live(path, ids, tmp_path)
    ours, exact = ours_and_exact(path, ids)
    ours_err, llama_err = 1 - _cos(ours, exact).mean(), 1 - _cos(ref, exact).mean()
    # every route quantizes activations per 32 as llama.cpp does (batch-invariant kernels):
    # the same arithmetic, so the distances agree to within a few percent (qwen2 Q8_0
    # 9.55e-5 vs 9.50e-5 when measured)
    assert ours_err <= 1.05 * llama_err, (ours_err, llama_err)
    # near-tied random-weight logits: one row of slack (phi3 Q8_0 measured 52 vs 53 of 55)
    rows = exact.shape[0]
    assert (ours.argmax(1) == exact.argmax(1)).mean() >= (ref.argmax(1) == exact.argmax(1)).mean() - 1.5 / rows


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("qtype", ["IQ2_XS", "IQ1_M"])
def test_live_real_model_iquant_closer_to_exact_than_llama_cpp(oracle, tmp_path, qtype):
    """A real model's activations through the 16-group i-quant kernels: SmolLM2 requantized
    (its 1536-wide ffn_down in `qtype`, the 576-wide weights IQ4_NL or Q4_0, as llama-quantize
    falls back), ours and llama.cpp's logits against the exact model; ours must be at least
    as close. Measured when written (55 positions), 1 - mean cosine: IQ2_XS 5.6e-4 (llama.cpp
    8.6e-4), IQ1_M 8.9e-4 (1.8e-3); argmax as the exact model's 0.96 / 0.98 (0.91 / 0.91)."""
    src = cached_model("smollm2")
    if src is None:
        pytest.skip("smollm2 unavailable")
    path = oracle_mod.requantize(src, tmp_path / f"{qtype}.gguf", qtype)
    assert {t.tensor_type.name for t in gguf.GGUFReader(path).tensors} >= {qtype}
    ids, ours, ref, exact, _ = oracle_mod.versus_exact(str(path), TEXT, tmp_path)
    ours_err, llama_err = 1 - _cos(ours, exact).mean(), 1 - _cos(ref, exact).mean()
    assert ours_err <= 1.05 * llama_err, (ours_err, llama_err)
    rows = exact.shape[0]
    assert (ours.argmax(1) == exact.argmax(1)).mean() >= (ref.argmax(1) == exact.argmax(1)).mean() - 1.5 / rows


@pytest.mark.slow
@pytest.mark.oracle
def test_live_phi3_long_rope_factors(oracle, tmp_path):
    """A context past rope.scaling.original_context_length selects the long factors, in
    llama.cpp (its n_ctx) and here (the cache's capacity)."""
    if not (VOCAB_DIR / "vocab-qwen3.gguf").exists():
        pytest.skip("shared Qwen3 vocab not present")
    path = SYNTH["phi3-synth"](tmp_path / "m.gguf", VOCAB_DIR / "vocab-qwen3.gguf")
    ids = list(range(1000, 1040))
    model = load_model(path)
    ref = _live(path, ids, tmp_path, "--ctx", "2048")
    long = model.forward_step_all_logits(model.init_cache(2048), ids, 0).numpy()
    short = model.forward_step_all_logits(model.init_cache(64), ids, 0).numpy()
    assert _cos(long, ref).min() >= 0.9999
    assert _cos(short, ref).min() < 0.999         # the factors matter: the short ones differ


@pytest.mark.slow
def test_qwen25_perplexity_matches_llama_cpp():
    """Qwen2.5-Coder-0.5B-Instruct (real weights, QKV biases on the native step): perplexity
    within 1% of llama-perplexity's on tests/data/ppl.txt (b11434, -c 512 -t 2: 6.1751)."""
    from fucina.text.evaluate import perplexity
    from fucina.text.tokenizer import Tokenizer
    path = cached_model("qwen2.5-coder")
    if path is None:
        pytest.skip("qwen2.5-coder unavailable")
    model = load_model(path)
    assert model.native_plan is not None
    tok = Tokenizer.from_metadata(model.gguf.metadata)
    ids = tok.encode((Path(__file__).parent / "data" / "ppl.txt").read_text(), add_special=True,
                     parse_special=False)
    ppl, chunks = perplexity(model, ids, 512, tok.bos_id if tok.add_bos else None)
    assert abs(ppl / 6.1751 - 1) < 0.01, ppl


@pytest.mark.slow
def test_qwen3moe_synth_routing_is_well_separated(models):
    """The MoE parity case's precondition: on the exact model every row's k-th and
    (k+1)-th router logits differ by >= 2e-3 of the logits' spread, far above the
    reassociation noise of two implementations (~1e-6 of it on F32 weights)."""
    from fucina.models import moe
    _, model = models("qwen3moe-synth")
    g = json.loads((GOLDENS / "qwen3moe-synth.json").read_text())
    margins, route = [], moe.Routing.__call__

    def spy(self, logits):
        top = logits.sort(-1, descending=True).values
        margins.append(((top[:, self.k - 1] - top[:, self.k]) / logits.std()).min().item())
        return route(self, logits)

    K.set_enabled(False)
    moe.Routing.__call__ = spy
    try:
        teacher_forced_logits(load_model(model.gguf.path), g["ids"])
    finally:
        moe.Routing.__call__ = route
        K.set_enabled(True)
    assert len(margins) == model.config.n_layer and min(margins) >= 2e-3, margins
