"""diffusion-gemma (block text diffusion on Gemma 4's transformer) on tiny random-weight
files written from the family's description (tests/synth_diffusion_gemma.py): the canvas
pass against gemma4's own blocks on the same weights, the cache contract, the
entropy-bound sampler against a plain numpy formulation, thread-count independence,
and the typed errors."""
import numpy as np
import pytest
import torch

from fucina.errors import ContextFull, FucinaError, GGUFError, InvalidArgument
from fucina.models import load_model
from fucina.models.base import rms_norm
from fucina.text import diffusion_gemma as dg
from synth_diffusion_gemma import write_diffusion_gemma

PROMPT = [2, 40, 41, 42, 43]          # shorter than the window (8): every layer's canvas sees all of it
CANVAS = list(range(60, 76))          # the files' canvas_length is 16


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dgemma")
    return (write_diffusion_gemma(d / "dg.gguf"), write_diffusion_gemma(d / "g4.gguf", twin=True),
            write_diffusion_gemma(d / "nosc.gguf", self_cond=False))


@pytest.fixture(scope="module")
def model(files):
    return load_model(files[0])


def gemma4_reference(g4, enc_scale, prompt, canvas, monkeypatch) -> torch.Tensor:
    """gemma4's torch blocks on the twin file: the prompt causally with the encoder
    scales, then the canvas with every attention unmasked and its embedding rms-normed."""
    import fucina.models.base as base
    import fucina.models.gemma4 as gemma4

    g4.use_native_step = False
    cache = g4.init_cache(64)
    scales = [L.out_scale for L in g4.layers]
    if prompt:
        for L, s in zip(g4.layers, enc_scale):
            L.out_scale = s
        g4.forward_step_all_logits(cache, prompt, 0)
        for L, s in zip(g4.layers, scales):
            L.out_scale = s
    def both_ways(q, cache, layer, pos0, scale, window=0, softcap=0.0, causal=True):
        lo = max(0, pos0 + 1 - window) if window else 0     # a sliding layer reaches window - 1 back
        return base._full_attention(q, *cache.span(layer, lo, pos0 + q.shape[0]), scale)
    monkeypatch.setattr(base, "attention", both_ways)
    monkeypatch.setattr(gemma4, "attention", both_ways)
    embed = g4.embed
    monkeypatch.setattr(g4, "embed", lambda ids: rms_norm(embed(ids), None, g4.config.rms_eps))
    return g4.forward_step_all_logits(cache, canvas, len(prompt))


@pytest.mark.parametrize("prompt", [[], PROMPT, PROMPT + list(range(50, 58))],
                         ids=["no-prefix", "prefix", "prefix-past-the-window"])
def test_the_canvas_pass_is_gemma4s_bidirectional_forward(files, model, prompt, monkeypatch):
    g4 = load_model(files[1])
    assert g4.config.arch == "gemma4" and model.config.arch == "diffusion-gemma"
    cache = model.init_cache(64)
    if prompt:
        model.encode_step(cache, prompt, 0)
    got = model.canvas_forward(cache, CANVAS)
    late = CANVAS[:-1] + [99]                 # a change at the last position reaches the first row
    assert (model.canvas_forward(cache, late)[0] - got[0]).abs().max() > 1e-4
    want = gemma4_reference(g4, model.enc_scale, prompt, CANVAS, monkeypatch)   # patches attention: last
    assert got.shape == (16, model.config.n_vocab)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_canvas_pass_leaves_the_cache_as_it_was(model):
    cache = model.init_cache(64)
    model.encode_step(cache, PROMPT, 0)
    rows = [t.clone() for t in cache.span(0, 0, len(PROMPT))]
    first = model.canvas_forward(cache, CANVAS)
    assert cache.len == len(PROMPT)
    assert all(torch.equal(a, b) for a, b in zip(rows, cache.span(0, 0, len(PROMPT))))
    model.canvas_forward(cache, list(range(100, 116)))   # another canvas overwrites the scratch rows
    assert torch.equal(model.canvas_forward(cache, CANVAS), first)
    model.encode_step(cache, CANVAS, cache.len)          # committing a canvas advances
    assert cache.len == len(PROMPT) + 16


def test_self_conditioning_feeds_the_previous_distribution(files, model):
    cache = model.init_cache(64)
    model.encode_step(cache, PROMPT, 0)
    logits = model.canvas_forward(cache, CANVAS).numpy()
    p = dg.sampler_pass(logits, 0.8, np.full(16, 0.5, np.float32))
    assert p.sc.rows == 16 and np.allclose(np.add.reduceat(p.sc.probs, p.sc.offsets[:-1]), 1.0, atol=1e-5)
    conditioned = model.canvas_forward(cache, CANVAS, p.sc)
    assert (conditioned - torch.from_numpy(logits)).abs().max() > 1e-3
    bare = load_model(files[2])
    assert not bare.has_self_conditioning
    c2 = bare.init_cache(64)
    bare.encode_step(c2, PROMPT, 0)
    with pytest.raises(InvalidArgument, match="no self-conditioning"):
        bare.canvas_forward(c2, CANVAS, p.sc)


def reference_row(z: np.ndarray, t: float, u: float):
    """One row, the textbook way: softmax(z / t) in float64, its entropy, the first id
    whose cumulative probability reaches u."""
    x = z.astype(np.float64) / t
    p = np.exp(x - x.max())
    p /= p.sum()
    h = -(p * np.log(np.where(p > 0, p, 1))).sum()
    return int(z.argmax()), int(np.searchsorted(np.cumsum(p), u)), h, p


def test_the_sampler_pass_against_numpy():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((37, 300)) * 3).astype(np.float32)   # more rows than one chunk
    u = rng.random(37, dtype=np.float32)
    got = dg.sampler_pass(logits, 0.7, u, sc_p_min=1e-3)
    for r in range(37):
        top, draw, h, p = reference_row(logits[r], 0.7, float(u[r]))
        assert got.argmax[r] == top and got.sampled[r] == draw
        assert abs(got.entropy[r] - h) < 1e-4
        lo, hi = got.sc.offsets[r], got.sc.offsets[r + 1]
        keep = np.nonzero(p >= 1e-3)[0]
        assert got.sc.ids[lo:hi].tolist() == keep.tolist()
        np.testing.assert_allclose(got.sc.probs[lo:hi], p[keep] / p[keep].sum(), rtol=1e-4)


def reference_accept(h: np.ndarray, bound: float) -> np.ndarray:
    order = sorted(range(len(h)), key=lambda i: (h[i], i))
    out, lower = np.zeros(len(h), bool), 0.0
    for i in order:
        out[i] = lower <= bound
        lower += float(h[i])
    return out


def test_the_entropy_bound_acceptance_against_numpy():
    h = np.array([0.02, 0.05, 0.6, 0.01], np.float32)
    assert dg.entropy_bound_accept(h, 0.1).tolist() == [True, True, True, True]   # 0.6 goes in on 0.08 below it
    assert dg.entropy_bound_accept(h, 0.04).tolist() == [True, True, False, True]
    rng = np.random.default_rng(2)
    for _ in range(50):
        h = np.round(rng.exponential(0.05, 40), 3).astype(np.float32)     # rounded: ties
        bound = float(rng.uniform(0, 0.5))
        assert dg.entropy_bound_accept(h, bound).tolist() == reference_accept(h, bound).tolist()


def test_generation_commits_block_after_block(files):
    import fucina
    llm = fucina.load(files[0])
    m = llm.model
    text = llm.generate(PROMPT, 40, seed=11, steps=6)
    r = llm.last
    assert r.prompt_tokens == len(PROMPT) and len(r.tokens) <= 40 and text == llm.tokenizer.decode(r.tokens)
    cfg = dg.GemmaDiffusionConfig.for_model(m, seed=11, steps=6)
    cache = m.init_cache(64)
    m.encode_step(cache, PROMPT, 0)
    first, steps = dg.denoise_canvas(m, cache, cfg, 11)
    assert 1 <= steps <= 6 and cache.len == len(PROMPT)
    eog = set(llm.tokenizer.eog_ids)
    cut = next((i for i, t in enumerate(first.tolist()) if t in eog), None)
    cut = dg.repetition_onset(first) if cut is None else cut
    assert r.tokens[:16] == first[:16 if cut is None else cut].tolist()
    if cut is None and len(r.tokens) > 16:    # the second block denoised over the first, committed
        m.encode_step(cache, first, cache.len)
        second, _ = dg.denoise_canvas(m, cache, cfg, 12)
        assert r.tokens[16:32] == second[:len(r.tokens[16:32])].tolist()
    pieces = list(llm.stream(PROMPT, 40, seed=11, steps=6))
    assert "".join(pieces) == text and len(pieces) <= 4


def test_same_seed_same_text_at_one_and_two_threads(files):
    import fucina
    from fucina import kernels
    llm = fucina.load(files[0])
    before = kernels.get_threads()
    try:
        out = []
        for n in (1, 2):
            kernels.set_threads(n)
            llm.generate(PROMPT, 32, seed=5, steps=8)
            out.append(llm.last.tokens)
    finally:
        kernels.set_threads(before)
    assert out[0] == out[1] and out[0]
    llm.generate(PROMPT, 32, seed=6, steps=8)
    assert llm.last.tokens != out[0]


def test_the_repetition_trim():
    assert dg.repetition_onset([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) is None
    assert dg.repetition_onset([1, 2, 3, 9, 9, 9, 9, 9, 9, 9]) == 3
    assert dg.repetition_onset([5, 1, 2, 1, 2, 1, 2, 1, 2, 1]) == 1


def test_bad_files_settings_and_flags_are_typed_errors(files, model, tmp_path, capsys):
    import fucina
    from fucina.cli.main import main
    with pytest.raises(GGUFError, match="diffusion.canvas_length"):
        load_model(write_diffusion_gemma(tmp_path / "nocanvas.gguf", canvas=0))
    with pytest.raises(GGUFError, match="enc_layer_output_scale"):
        load_model(write_diffusion_gemma(tmp_path / "noenc.gguf", enc_scale=False))
    eb = load_model(write_diffusion_gemma(tmp_path / "eb.gguf", eb={"max_steps": 7, "t_max": 0.9}))
    assert eb.config.eb.max_steps == 7 and eb.config.eb.t_max == pytest.approx(0.9)
    with pytest.raises(FucinaError, match="no next-token step"):
        model.forward_step(model.init_cache(8), [1], 0)
    llm = fucina.load(files[0])
    with pytest.raises(InvalidArgument, match="top_k do not apply"):
        llm.generate("hi", 8, top_k=3)
    with pytest.raises(InvalidArgument, match="t_min"):
        llm.generate("hi", 8, t_min=0.9, t_max=0.5)
    with pytest.raises(ContextFull, match="exceed the context"):
        fucina.load(files[0], n_ctx=18).generate(PROMPT, 8)      # 5 + a canvas of 16 > 18
    with pytest.raises(InvalidArgument, match="not a diffusion model"):
        fucina.load(files[1]).generate("hi", 2, entropy_bound=0.2)
    assert main(["run", files[0], "-p", "hi", "--diffusion-eps", "0.1"]) == 1
    assert "entropy-bound sampler" in capsys.readouterr().err
    assert main(["run", files[1], "-p", "hi", "--entropy-bound", "0.2"]) == 1
    assert "not a diffusion model" in capsys.readouterr().err


def test_run_denoises_with_the_eb_flags(files, tmp_path, capsys):
    import fucina
    from fucina.cli.main import main
    ids_out = tmp_path / "ids.txt"
    assert main(["run", files[0], "-p", "hi", "--gen", "20", "--diffusion-steps", "5", "--entropy-bound", "0.3",
                 "--seed", "4", "--ids-out", str(ids_out)]) == 0
    llm = fucina.load(files[0])
    ids = llm.tokenizer.encode(llm.template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True))
    llm.generate(ids, 20, seed=4, steps=5, entropy_bound=0.3)
    assert [int(x) for x in ids_out.read_text().split()] == llm.last.tokens
    assert "[block" not in capsys.readouterr().out          # piped: no live view
