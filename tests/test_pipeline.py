"""Pipeline stages (models/pipeline.py): the split, a stage as its family's model over a
slice, the chain of stages == the one-process model bitwise, and the group under torchrun
on loopback (same text as one process, bad splits fail on every rank, a dead stage is a 503)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import gguf
import pytest
import torch

from fucina.errors import InvalidArgument, PipelineError
from fucina.gguf import GGUFFile
from fucina.models import load_model
from fucina.models.pipeline import (STAGE_FAMILIES, WANT_ALL, WANT_LAST, Entry, PipelineCache, PhantomKV,
                                    PhantomWindow, Stage, build_stage, layer_bytes, plan_split, stage_tensors)
from fucina.models.registry import check
from synth import write_model

Q = gguf.GGMLQuantizationType
IDS = [5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 33, 200]
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _geometry(arch: str) -> dict:
    return dict(hidden=64, heads=4, kv_heads=2, head_dim=16) if arch in ("llama", "phi3") else \
        dict(hidden=64, heads=4, kv_heads=2, head_dim=32)


@pytest.fixture(scope="module", params=STAGE_FAMILIES)
def tiny(request, tmp_path_factory):
    arch = request.param
    return write_model(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch, layers=6, qtype=Q.Q8_0,
                       sliding_window=5, **_geometry(arch))


def _stages(path, ranges):
    f = GGUFFile(path)
    t = check(f)
    return [Stage(build_stage(f, t, lo, hi), r, len(ranges), lo, hi, t.config.n_layer, 10.0)
            for r, (lo, hi) in enumerate(ranges)]


def _chain(stages, ids, batch: bool = False):
    """The stages' layers run one after the other in this process (what the group does over gloo)."""
    x = stages[0].model.embed(torch.tensor(ids)).float().contiguous()
    caches = [[st.model.init_cache(64) for _ in (ids if batch else [0])] for st in stages]
    entries = [Entry(i, 64, 0, 0, 1, WANT_LAST) for i in range(len(ids))] if batch else \
        [Entry(1, 64, 0, 0, len(ids), WANT_ALL)]
    for st, cs in zip(stages, caches):
        for c, e in zip(cs, entries):
            c.reserve(e.m)
        with torch.inference_mode():
            x = st.run_layers(x, cs, entries)
        for c, e in zip(cs, entries):
            c.advance(e.m)
    with torch.inference_mode():
        return stages[-1].model.head(x)


# -- the split -------------------------------------------------------------------------------

def test_split_balances_bytes_and_carries_the_head_on_the_last_stage():
    assert plan_split([10] * 30, 2) == [(0, 15), (15, 30)]
    three = plan_split([10] * 30, 3, head_bytes=50)
    assert [b - a for a, b in three] == [11, 12, 7]
    assert plan_split([5, 100, 5, 5], 3) == [(0, 1), (1, 2), (2, 4)]
    assert plan_split([1] * 4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert plan_split([10] * 6, 2, split=[2, 4]) == [(0, 2), (2, 6)]


@pytest.mark.parametrize("world, split, msg", [
    (1, None, "at least 2 ranks"), (7, None, "at most one rank per layer"),
    (2, [3, 4], "summing to 6"), (2, [6, 0], "positive"), (3, [3, 3], "3 positive"),
])
def test_split_errors(world, split, msg):
    with pytest.raises(InvalidArgument, match=msg):
        plan_split([10] * 6, world, split)


def test_stage_reads_only_its_layers(tiny):
    f = GGUFFile(tiny)
    t = check(f)
    sub = stage_tensors(t, 2, 5)
    assert sub.config.n_layer == 3 and sub.config.layers == t.config.layers[2:5]
    assert sub["blk.0.attn_norm.weight"] is t["blk.2.attn_norm.weight"]
    assert "blk.3.attn_norm.weight" not in sub
    assert sub["token_embd.weight"] is t["token_embd.weight"]
    assert sum(layer_bytes(f, 6)) == sum(i.data.nbytes for n, i in f.tensors.items() if n.startswith("blk."))


# -- the chain of stages is the model --------------------------------------------------------

@pytest.mark.parametrize("ranges", [[(0, 2), (2, 5), (5, 6)], [(0, 3), (3, 6)]])
def test_stages_chained_equal_the_model_bitwise(tiny, ranges):
    full = load_model(tiny)
    want = full.forward_step_all_logits(full.init_cache(64), IDS, 0)
    assert torch.equal(_chain(_stages(tiny, ranges), IDS), want)


def test_stages_chained_equal_the_model_one_row_per_stream(tiny):
    full = load_model(tiny)
    want = full.forward_step_batch([full.init_cache(64) for _ in IDS[:4]], IDS[:4])
    assert torch.equal(_chain(_stages(tiny, [(0, 4), (4, 6)]), IDS[:4], batch=True), want)


def test_stages_on_the_torch_blocks(tiny):
    full = load_model(tiny)
    stages = _stages(tiny, [(0, 3), (3, 6)])
    full.use_native_step = False
    for st in stages:
        st.model.use_native_step = False
    want = full.forward_step_all_logits(full.init_cache(64), IDS, 0)
    assert torch.equal(_chain(stages, IDS), want)


def test_a_family_outside_the_list_is_a_typed_error(tmp_path):
    path = write_model(tmp_path / "q.gguf", "qwen35", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32)
    f = GGUFFile(path)
    with pytest.raises(PipelineError, match="not supported for the qwen35 family"):
        build_stage(f, check(f), 0, 1)


def test_phantom_layers_rewind_like_the_real_ones(tmp_path):
    """Rank 0 decides rewinds for every stage from shape-only memories: they must answer
    exactly as the real window memories do, through moves and rewinds."""
    path = write_model(tmp_path / "g.gguf", "gemma3", layers=6, sliding_window=5, **_geometry("gemma3"))
    model = load_model(path)
    real = model.init_cache(2048)
    shape = PipelineCache.of([PhantomWindow(2048, 0, s.head_dim, s.head_dim, "f16", torch.float16, window=s.window,
                                            slack=model.window_slack) if s.window else
                              PhantomKV(2048, 0, s.head_dim, s.head_dim) for s in model.config.layers], 2048)
    assert shape.nbytes() == 0 and shape.native_table() is None
    pos = 0
    for m, back in ((300, 0), (400, 120), (500, 30), (20, 600), (300, 10)):
        for c in (real, shape):
            c.reserve(m)
            c.advance(m)
        pos += m
        assert shape.step_limit() == real.step_limit()
        for n in (pos - back, pos - 3, 40, 0):
            assert shape.truncate_point(n) == real.truncate_point(n)
        keep = real.truncate_point(pos - back)
        real.truncate(keep)
        shape.truncate(keep)
        pos = keep


# -- the group on loopback (torchrun) -------------------------------------------------------

def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def _torchrun(n: int, *args, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "fucina", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())


def _fucina(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fucina", *args], capture_output=True, text=True, timeout=240,
                          env=_env())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ids(path: Path) -> list[int]:
    return [int(v) for v in path.read_text().split()]


def test_torchrun_two_and_three_stages_print_the_one_process_text(tmp_path):
    """Greedy on 2 stages; speculation (verify passes of many rows, rewinds) under a regex
    constraint on 3: each the one-process tokens."""
    model = write_model(tmp_path / "m.gguf", "qwen3", layers=4, qtype=Q.Q8_0, **_geometry("qwen3"))
    common = ["run", model, "--tokens", "1,2,3,4,5,6,7,1,2,3,4,5,6,7", "--gen", "16", "--threads", "1"]
    for n, extra in ((2, []), (3, ["--spec", "--regex", "[a-d]{4}( [a-d]{4})*"])):
        one = _fucina(*common, *extra, "--ids-out", str(tmp_path / "one.ids"))
        assert one.returncode == 0, one.stderr
        r = _torchrun(n, *common, *extra, "--pipeline", "--ids-out", str(tmp_path / f"{n}.ids"))
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout == one.stdout
        assert _ids(tmp_path / f"{n}.ids") == _ids(tmp_path / "one.ids")


def _rank_proc(rank: int, world: int, master: int, *args) -> subprocess.Popen:
    env = _env(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master))
    return subprocess.Popen([sys.executable, "-m", "fucina", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_ranks_that_disagree_on_the_split_fail_alike(tmp_path):
    model = write_model(tmp_path / "m.gguf", "llama", layers=4, **_geometry("llama"))
    master = _free_port()
    procs = [_rank_proc(r, 2, master, "run", model, "--tokens", "1,2,3", "--gen", "2", "--pipeline",
                        "--split", split) for r, split in enumerate(("1,3", "2,2"))]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 1 and "ranks disagree on the model or the split" in err, err[-2000:]


@pytest.mark.slow
def test_torchrun_more_ranks_than_layers_fails_on_every_rank(tmp_path):
    model = write_model(tmp_path / "m.gguf", "llama", layers=2, **_geometry("llama"))
    r = _torchrun(3, "run", model, "--tokens", "1,2,3", "--gen", "2", "--pipeline", timeout=120)
    assert r.returncode != 0
    assert r.stderr.count("at most one rank per layer") >= 3, r.stderr[-2000:]     # every rank says why


def test_pipeline_flags_need_pipeline(tmp_path, capsys):
    from fucina.cli.main import main
    model = write_model(tmp_path / "m.gguf", "llama", layers=2, **_geometry("llama"))
    assert main(["run", model, "--tokens", "1,2", "--gen", "1", "--split", "1,1"]) == 1
    assert "--split needs --pipeline" in capsys.readouterr().err


def test_pipeline_outside_a_group_is_a_typed_error(tmp_path, capsys, monkeypatch):
    from fucina.cli.main import main
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    model = write_model(tmp_path / "m.gguf", "llama", layers=2, **_geometry("llama"))
    assert main(["run", model, "--tokens", "1,2", "--gen", "1", "--pipeline"]) == 1
    assert "torchrun --nproc-per-node N" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name, n, sampling", [("smollm2", 2, []), ("smollm2", 3, []), ("gemma3", 2, []),
                                               ("smollm2", 2, ["--temp", "0.8", "--seed", "11"])])
def test_torchrun_real_models_match_one_process(request, tmp_path, name, n, sampling):
    path = request.getfixturevalue(f"{name}_path")
    common = ["run", str(path), "--prompt", "The three primary colors are", "--gen", "20", "--threads", "1",
              *sampling]
    one = _fucina(*common, "--ids-out", str(tmp_path / "one.ids"))
    r = _torchrun(n, *common, "--pipeline", "--ids-out", str(tmp_path / "p.ids"))
    assert one.returncode == 0 and r.returncode == 0, r.stderr[-2000:]
    assert _ids(tmp_path / "p.ids") == _ids(tmp_path / "one.ids")


# -- the server under --pipeline: same tokens, and a dead stage is a 503 ----------------------

def _post(port: int, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _health(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_up(port: int, procs, limit: float = 180) -> None:
    t = time.monotonic()
    while time.monotonic() - t < limit:
        assert all(p.poll() is None for p in procs), [p.stderr.read() if p.stderr else "" for p in procs]
        try:
            if _health(port)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not come up")


def _stage_proc(rank: int, world: int, master: int, port: int, model: str, log: Path) -> subprocess.Popen:
    env = _env(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master),
               FUCINA_PIPELINE_TIMEOUT="8")
    return subprocess.Popen([sys.executable, "-m", "fucina", "serve", model, "--port", str(port), "--pipeline",
                             "--threads", "1", "--slots", "4"], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
def test_server_under_pipeline_answers_like_one_process_and_survives_a_dead_stage(smollm2_path, tmp_path):
    """Ranks started on their own (no torchrun agent, which would end the whole group): the
    server's tokens equal one process's for concurrent requests; killing the last stage turns
    requests into 503s within seconds with /health red, and restarting it serves again."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"Name {k} fruits." for k in (2, 3, 4)]
    bodies = [{"messages": [{"role": "user", "content": p}], "max_tokens": 16, "temperature": 0}
              for p in prompts]
    port, master = _free_port(), _free_port()
    model = str(smollm2_path)
    procs = [_stage_proc(r, 2, master, port, model, tmp_path / f"r{r}.log") for r in range(2)]
    try:
        _wait_up(port, procs)
        one_port = _free_port()
        single = subprocess.Popen([sys.executable, "-m", "fucina", "serve", model, "--port", str(one_port),
                                   "--threads", "1", "--slots", "4"], env=_env(), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            _wait_up(one_port, [single])
            with ThreadPoolExecutor(3) as pool:
                piped = list(pool.map(lambda b: _post(port, b), bodies))
            alone = [_post(one_port, b) for b in bodies]
        finally:
            os.killpg(single.pid, signal.SIGKILL)
        for (s1, a), (s2, b) in zip(piped, alone):
            assert s1 == s2 == 200
            assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]

        os.killpg(procs[1].pid, signal.SIGKILL)            # the last stage dies
        t = time.monotonic()
        status, body = _post(port, bodies[0], timeout=60)
        assert status == 503 and time.monotonic() - t < 30, body
        assert body["error"]["code"] == "pipeline_unavailable"
        h = _health(port)
        assert h[0] == 503 and h[1]["pipeline"]["healthy"] is False

        procs[1] = _stage_proc(1, 2, master, port, model, tmp_path / "r1b.log")   # restarted
        t = time.monotonic()
        while _health(port)[0] != 200:
            assert time.monotonic() - t < 120, (tmp_path / "r1b.log").read_text()[-2000:]
            time.sleep(0.5)
        status, body = _post(port, bodies[0])
        assert status == 200
        assert body["choices"][0]["message"]["content"] == piped[0][1]["choices"][0]["message"]["content"]

        os.killpg(procs[1].pid, signal.SIGSTOP)            # a stage stops answering: the 8 s timeout
        t = time.monotonic()
        status, body = _post(port, bodies[1], timeout=60)
        assert status == 503 and time.monotonic() - t < 30, body
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
