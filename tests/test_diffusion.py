"""Text diffusion (dream, llada): the bidirectional canvas pass and llama.cpp's denoising
loop, on tiny random-weight models written in-process.

The committed goldens (goldens/diffusion-synth.json) are llama-diffusion-cli's canvases
for these same files and settings (make: `python tests/test_diffusion.py`, with the
oracle); the oracle tests re-run it live."""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from fucina.errors import FucinaError, GGUFError, InvalidArgument, KVCacheError
from fucina.models import load_model
from fucina.text.diffusion import DiffusionConfig, StdMT, denoise, sample_rows, transfer_count
from synth import DIFFUSION_ARCHS, write_model

GOLDEN = Path(__file__).parent / "goldens" / "diffusion-synth.json"
GEOMETRY = dict(layers=2, hidden=128, heads=8, kv_heads=4, head_dim=16)
PROMPT = "hi"
# settings the goldens and the oracle test cover: deterministic (top-k 1) and seeded,
# every algorithm, both schedules
CASES = [dict(top_k=1), dict(top_k=1, algorithm=2), dict(top_k=1, algorithm=0),
         dict(seed=7), dict(seed=7, algorithm=0), dict(seed=7, algorithm=1), dict(seed=3, algorithm=3),
         dict(seed=5, top_k=0, top_p=0.9, temperature=1.5, algorithm=2),
         dict(seed=9, block_length=16, eps=0.0, steps=24)]


def config(case: dict) -> DiffusionConfig:
    return DiffusionConfig(**{**dict(canvas=64, steps=16, eps=0.001), **case})


@pytest.fixture(scope="module", params=DIFFUSION_ARCHS)
def synth(request, tmp_path_factory):
    arch = request.param
    path = write_model(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch, **GEOMETRY)
    return arch, path, load_model(path)


def prompt_ids(path: str) -> list[int]:
    import fucina
    llm = fucina.load(path)
    return llm.tokenizer.encode(llm.template.render([{"role": "user", "content": PROMPT}], add_generation_prompt=True))


def text_of(model, path: str, canvas: list[int], n_input: int) -> bytes:
    """llama-diffusion-cli's output: the canvas after the prompt, detokenized (special=false)."""
    import fucina
    tok = fucina.load(path).tokenizer
    return b"".join(tok.token_to_piece(i, False) for i in canvas[n_input:])


# -- the canvas pass -----------------------------------------------------------------

def test_the_canvas_attends_both_ways_and_native_equals_torch(synth):
    arch, _, m = synth
    mask = m.config.mask_token_id
    ids = list(range(20, 44)) + [mask] * 8
    c = m.canvas_cache(len(ids))
    got = m.forward_canvas(ids, c)
    late = ids[:-1] + [77]                        # a change at the last position ...
    moved = m.forward_canvas(late, c)
    assert (got[0] - moved[0]).abs().max() > 1e-3   # ... reaches the first row: bidirectional
    assert m.native_plan is not None
    m.use_native_step = False
    try:
        ref = m.forward_canvas(ids, c)
    finally:
        m.use_native_step = True
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() > 0.99999
    rows = torch.tensor([3, 30])
    assert torch.allclose(m.forward_canvas(ids, c, rows=rows), got[rows], atol=1e-5)
    assert m.config.shift_logits is (arch == "dream")


def test_autoregressive_entry_points_and_oversized_canvases_are_typed_errors(synth):
    _, _, m = synth
    with pytest.raises(FucinaError, match="diffusion model"):
        m.forward_step(m.init_cache(8), [1, 2], 0)
    with pytest.raises(KVCacheError, match="exceeds the model's context"):
        m.canvas_cache(m.config.n_ctx_train + 1)


def test_a_diffusion_file_without_a_mask_token_or_with_a_bad_one_fails_its_check(synth):
    from fucina.gguf import GGUFFile
    from fucina.models.registry import check
    _, path, _ = synth
    for value, match in ((None, "needs tokenizer.ggml.mask_token_id"), (10**6, "is not a token id"),
                         ("x", "is not a token id")):
        f = GGUFFile(path)
        if value is None:
            del f.metadata["tokenizer.ggml.mask_token_id"]
        else:
            f.metadata["tokenizer.ggml.mask_token_id"] = value
        with pytest.raises(GGUFError, match=match):
            check(f)
    f = GGUFFile(path)
    f.metadata["diffusion.shift_logits"] = 1
    with pytest.raises(GGUFError, match="not a boolean"):
        check(f)


# -- the loop's pieces ----------------------------------------------------------------

def test_settings_llama_cpp_would_assert_on_are_typed_errors():
    with pytest.raises(InvalidArgument, match="not both"):
        DiffusionConfig(eps=0.01, block_length=32)
    with pytest.raises(InvalidArgument, match="multiple of the block length"):
        DiffusionConfig(canvas=100, block_length=32)
    with pytest.raises(InvalidArgument, match="multiple of the number of blocks"):
        DiffusionConfig(canvas=128, block_length=32, steps=6)
    with pytest.raises(InvalidArgument, match="algorithm"):
        DiffusionConfig(algorithm=5)


def test_the_rng_is_std_mt19937_and_the_schedule_float32():
    assert StdMT(5489)._bg.random_raw(1)[0] == 3499211612       # std::mt19937's first output
    assert 0.0 <= StdMT(1).floats(1000).min() and StdMT(1).doubles(1000).max() < 1.0
    # the timestep schedule keeps every remaining position at the last step, none early at eps ~1
    assert transfer_count(15, 16, 7, 0.001, None) == 7
    total, left = 0, 40
    for s in range(16):
        k = transfer_count(s, 16, left, 0.001, None)
        total, left = total + k, left - k
    assert total == 40 and left == 0


def test_the_chain_draws_like_a_per_row_reference():
    """sample_rows on many rows at once == a plain loop over one row (top-k, top-p, temp,
    then the cumulative draw at u)."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 300)).astype(np.float32) * 3
    u = rng.random(50)
    for top_k, top_p, temp in ((40, 0.95, 0.8), (0, 1.0, 0.0), (1, 0.95, 0.8), (0, 0.7, 1.3)):
        d = sample_rows(logits, top_k, top_p, temp, u)
        for i in range(50):
            ids = np.argsort(-logits[i], kind="stable")
            if top_k:
                ids = ids[:top_k]
            if top_p < 1:
                p = np.exp(logits[i][ids] - logits[i][ids[0]])
                cum = np.cumsum(p / p.sum())
                ids = ids[:int(np.searchsorted(cum, top_p)) + 1]
            v = logits[i][ids] / (temp if temp > 0 else 1.0)
            if not (top_k or top_p < 1):
                ids, v = np.arange(300), logits[i] / (temp if temp > 0 else 1.0)
            p = np.exp(v - v.max())
            pick = ids[int(np.searchsorted(np.cumsum(p), p.sum() * u[i]))]
            assert d.tokens[i] == pick, (top_k, top_p, temp, i)


# -- the whole loop: the committed goldens, and the oracle live -------------------------

def _golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("case", range(len(CASES)))
def test_canvas_equals_llama_diffusion_cli_golden(synth, case):
    arch, path, m = synth
    want = _golden()[arch][case]
    assert want["case"] == CASES[case]
    ids = prompt_ids(path)
    out = denoise(m, ids, config(CASES[case]))
    assert text_of(m, path, out, len(ids)).hex() == want["text"]


def oracle_canvas(path: str, cfg: DiffusionConfig) -> bytes:
    """llama-diffusion-cli's output text (its log is written by a thread that may be cut
    off at exit: a run whose log lacks the result is repeated)."""
    from oracle import oracle_dir
    d = oracle_dir()
    cmd = [str(d / "llama-diffusion-cli"), "-m", path, "-p", PROMPT, "-ub", str(cfg.canvas), "-c", str(cfg.canvas),
           "-b", str(cfg.canvas), "--diffusion-steps", str(cfg.steps), "--diffusion-algorithm", str(cfg.algorithm),
           "--top-k", str(cfg.top_k), "--top-p", str(cfg.top_p), "--temp", str(cfg.temperature),
           "--seed", str(cfg.seed), "-t", "2"]
    cmd += ["--diffusion-block-length", str(cfg.block_length)] if cfg.block_length else ["--diffusion-eps", str(cfg.eps)]
    for _ in range(8):
        r = subprocess.run(cmd, capture_output=True, timeout=300, env=dict(os.environ, LD_LIBRARY_PATH=str(d)))
        assert r.returncode == 0, r.stderr[-2000:]
        err = r.stderr
        i = err.rfind(b"time per step")
        if i < 0:
            continue
        tail = err[i:]
        j = tail.find(b"I \n")
        if j >= 0 and tail.endswith(b"\n"):
            return tail[j + 3:-1]
    raise AssertionError("llama-diffusion-cli never logged its result")


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("case", range(len(CASES)))
def test_canvas_equals_llama_diffusion_cli_live(synth, oracle, case):
    arch, path, m = synth
    ids = prompt_ids(path)
    cfg = config(CASES[case])
    assert text_of(m, path, denoise(m, ids, cfg), len(ids)) == oracle_canvas(path, cfg)


@pytest.mark.slow
@pytest.mark.oracle
def test_canvas_logits_equal_llama_cpp(synth, oracle):
    """One canvas pass against llama-logits (a non-causal model: llama.cpp attends both ways)."""
    from oracle import run
    arch, path, m = synth
    ids = [5, 17, 99, 3, 250, 42, 7, 8] + [m.config.mask_token_id] * 8
    out = Path(path).with_suffix(".f32")
    run("llama-logits", path, ",".join(map(str, ids)), str(out), "--threads", "2")
    want = torch.from_numpy(np.fromfile(out, dtype=np.float32).reshape(len(ids), -1))
    got = m.forward_canvas(ids)
    # fucina keeps K/V in f16 (llama.cpp's cacheless canvas: f32)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99999
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def make_goldens(tmp: Path) -> None:
    out = {}
    for arch in DIFFUSION_ARCHS:
        path = write_model(tmp / f"{arch}.gguf", arch, **GEOMETRY)
        out[arch] = [dict(case=c, text=oracle_canvas(path, config(c)).hex()) for c in CASES]
    GOLDEN.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as t:
        make_goldens(Path(t))


# -- the interfaces: API, CLI ------------------------------------------------------------

def test_the_api_generates_and_streams_by_committed_blocks(synth):
    import fucina
    arch, path, m = synth
    llm = fucina.load(path)
    ids = prompt_ids(path)
    cfg = config(dict(seed=9, block_length=16, eps=0.0, steps=24))
    pieces = list(llm.stream(ids, canvas=64, steps=24, block_length=16, seed=9))
    assert 1 <= len(pieces) <= 4 and llm.last.prompt_tokens == len(ids)     # at most one piece a block
    canvas = denoise(m, ids, cfg)[len(ids):]
    eog = set(llm.tokenizer.eog_ids)
    cut = next((i for i, t in enumerate(canvas) if t in eog), len(canvas))
    assert llm.last.tokens == canvas[:cut] and llm.last.finish_reason == ("stop" if cut < len(canvas) else "length")
    assert "".join(pieces) == llm.last.text == llm.tokenizer.decode(canvas[:cut])


def test_api_keywords_of_the_other_kind_are_typed_errors(synth, tmp_path):
    import fucina
    _, path, _ = synth
    with pytest.raises(InvalidArgument, match="min_p do not apply"):
        fucina.load(path).generate("hi", min_p=0.1)
    ar = fucina.load(write_model(tmp_path / "ar.gguf", "qwen2"))
    with pytest.raises(InvalidArgument, match="not a diffusion model"):
        ar.generate("hi", max_tokens=2, steps=8)


def test_run_denoises_with_llama_diffusion_cli_flags(synth, tmp_path, capsys):
    from fucina.cli.main import main
    arch, path, m = synth
    ids_out = tmp_path / "ids.txt"
    rc = main(["run", path, "-p", PROMPT, "--canvas", "64", "--diffusion-steps", "16", "--diffusion-eps", "0.001",
               "--top-k", "1", "--seed", "1", "-t", "2", "--ids-out", str(ids_out)])
    assert rc == 0
    ids = prompt_ids(path)
    canvas = denoise(m, ids, config(dict(top_k=1, seed=1)))[len(ids):]
    got = [int(x) for x in ids_out.read_text().split()]
    assert got == canvas[:len(got)]
    assert "[step" not in capsys.readouterr().out          # piped: no live view
    assert main(["run", path, "-p", "hi", "--min-p", "0.1"]) == 1
    assert "is a diffusion model" in capsys.readouterr().err
    assert main(["run", path, "-p", "hi", "--canvas", str(m.config.n_ctx_train + 1)]) == 1
    assert "exceeds the model's context" in capsys.readouterr().err
    ar = write_model(tmp_path / "ar.gguf", "llama")
    assert main(["run", ar, "-p", "hi", "--diffusion-steps", "4"]) == 1
    assert "not a diffusion model" in capsys.readouterr().err


def test_the_live_view_redraws_the_canvas_on_a_terminal(synth):
    import io

    import fucina
    from fucina.cli.diffusion_args import LiveView
    _, path, m = synth

    class Tty(io.StringIO):
        def isatty(self):
            return True
    out = Tty()
    view = LiveView(fucina.load(path).tokenizer, 2, m.config.mask_token_id, out)
    view(0, 4, np.array([5, 6, m.config.mask_token_id, 70]))
    view(1, 4, np.array([5, 6, 70, 70]))
    view.clear()
    s = out.getvalue()
    b = fucina.load(path).tokenizer.token_to_piece(70).decode()
    assert f"[step 0/4]\n_{b}\n" in s and f"[step 1/4]\n{b}{b}\n" in s and s.endswith("\x1b[2F\x1b[J")
    piped = io.StringIO()
    LiveView(fucina.load(path).tokenizer, 2, m.config.mask_token_id, piped)(0, 4, np.array([5, 6, 7]))
    assert piped.getvalue() == ""


def test_chat_denoises_each_turn_over_the_whole_conversation(synth, tmp_path, monkeypatch, capsys):
    import io

    import fucina
    from fucina.cli.main import main
    arch, path, m = synth
    ids_out = tmp_path / "ids.txt"
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nagain\n"))
    assert main(["chat", path, "--repl", "--gen", "24", "--diffusion-steps", "8", "--seed", "2", "-t", "2",
                 "--ids-out", str(ids_out)]) == 0
    got = [int(x) for x in ids_out.read_text().split()]
    llm = fucina.load(path)
    msgs = [{"role": "user", "content": "hello"}]
    first = llm.tokenizer.encode(llm.template.render(msgs))
    want = denoise(m, first, DiffusionConfig(canvas=len(first) + 24, steps=8, eps=0.001, seed=2))[len(first):]
    eog = set(llm.tokenizer.eog_ids)
    first_reply = want[:next((i for i, t in enumerate(want) if t in eog), len(want))]
    assert got[:len(first_reply)] == first_reply       # then the second turn's, if it wrote any
    assert main(["chat", path, "hey", "--regex", "a+"]) == 1
    assert "is a diffusion model" in capsys.readouterr().err


def test_a_kernels_build_without_the_bidir_field_keeps_the_torch_path(synth, monkeypatch):
    """An older native build would attend causally: the plan is refused, not misused."""
    from fucina import kernels
    _, path, _ = synth
    plan, layer = kernels.plan_schema()
    monkeypatch.setattr(kernels, "plan_schema", lambda: (plan, tuple(f for f in layer if f[0] != "bidir")))
    assert load_model(path).native_plan is None
