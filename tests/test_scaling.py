"""Past one process: data-parallel fine-tuning under torchrun (the same adapter as one
process with the same global batch), and replicas behind vllm-router (answers like one
server, keeps answering when a replica dies)."""
from __future__ import annotations

import json
import os
import shutil
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

from fucina.gguf import GGUFFile
from synth import write_model

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def _adapter(path: Path) -> dict[str, torch.Tensor]:
    f = GGUFFile(path)
    return {n: torch.from_numpy(t.data.copy().view("float32")) for n, t in f.tensors.items()}


def test_torchrun_data_parallel_finetune_equals_one_process(tmp_path):
    """Two ranks with one micro-batch each == one process accumulating two: the same global
    batch, so the same adapter up to the order the gradients are summed in."""
    model = write_model(tmp_path / "m.gguf", "qwen3", layers=2, qtype=gguf.GGMLQuantizationType.Q8_0,
                        hidden=64, heads=4, kv_heads=2, head_dim=32)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i % 3}"}) + "\n" for i in range(8)))
    common = ["finetune", model, "--data", str(data), "--steps", "3", "--rank", "2", "--ctx", "32", "--batch", "1",
              "--threads", "1", "--no-progress", "--seed", "5", "--dropout", "0"]
    one = subprocess.run([sys.executable, "-m", "fucina", *common, "--grad-accum", "2", "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert one.returncode == 0, one.stderr[-2000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "fucina", *common, "--grad-accum", "1", "--out", str(tmp_path / "two")]
    two = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(FUCINA_DIST_TIMEOUT="60"))
    if two.returncode != 0 and "SIGABRT" in two.stderr:
        # once in a full-suite run (2026-12-04) a rank died by SIGABRT, the launcher's report all
        # its stderr kept, while 11 runs of this test alone passed: one more launch; a second
        # failure fails
        two = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(FUCINA_DIST_TIMEOUT="60"))
    assert two.returncode == 0, two.stderr[:2000] + "\n...\n" + two.stderr[-2000:]
    a, b = _adapter(tmp_path / "one" / "adapter.gguf"), _adapter(tmp_path / "two" / "adapter.gguf")
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7), k


def test_distributed_timeout_is_checked(monkeypatch):
    from fucina.errors import FucinaError
    from fucina.train.trainer import init_distributed
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(FucinaError, match="timeout must be positive"):
        init_distributed(timeout=0)


# -- replicas behind vllm-router ----------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}


def _chat(port: int, content: str) -> tuple[int, str]:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _until(check, limit: float, what: str) -> None:
    t = time.monotonic()
    while time.monotonic() - t < limit:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{what} within {limit:g} s")


@pytest.mark.slow
def test_two_replicas_behind_vllm_router(smollm2_path, tmp_path):
    router = shutil.which("vllm-router")
    if router is None:
        pytest.skip("vllm-router not installed (pip install 'fucina[cluster]')")
    ports = [_free_port(), _free_port()]
    procs = [subprocess.Popen([sys.executable, "-m", "fucina", "serve", str(smollm2_path), "--port", str(p),
                               "--threads", "1", "--slots", "2"], env=_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True) for p in ports]
    rport = _free_port()
    rlog = (tmp_path / "router.log").open("w")
    rproc = subprocess.Popen([router, "--host", "127.0.0.1", "--port", str(rport), "--policy", "cache_aware",
                              "--worker-urls", *[f"http://127.0.0.1:{p}" for p in ports],
                              "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                              "--retry-max-retries", "3", "--cb-failure-threshold", "1",
                              "--log-level", "warning",
                              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())],
                             stdout=rlog, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for p in ports:
            _until(lambda p=p: _get(f"http://127.0.0.1:{p}/health")[0] == 200, 180, "a replica came up")
        _until(lambda: _chat(rport, "ping")[0] == 200, 120, "the router answered")
        prompts = ["Name a fruit.", "Name a color.", "Name an animal.", "Name a city."]
        alone = [_chat(ports[0], q) for q in prompts]
        routed = [_chat(rport, q) for q in prompts]
        assert routed == alone                                  # greedy: the same text from either replica
        os.killpg(procs[1].pid, signal.SIGKILL)                 # one replica dies
        after = [_chat(rport, q) for q in prompts]
        assert after == alone, (tmp_path / "router.log").read_text()[-3000:]
    finally:
        for p in procs + [rproc]:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
