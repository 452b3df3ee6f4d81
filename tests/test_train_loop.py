"""The training loop: it learns, resumes bit-exactly, runs data-parallel, and its adapter
file loads back (merged at inference) with the values it trained."""
import os
import socket

import gguf
import pytest
import torch
import torch.multiprocessing as mp

from fucina.gguf import GGUFFile
from fucina.models import load_model
from fucina.text.chat_template import ChatTemplate
from fucina.text.tokenizer import Tokenizer
from fucina.train.adapters import apply_adapters, read_adapter, write_adapter
from fucina.train.checkpoint import CheckpointError
from fucina.train.data import encode_record
from fucina.train.lora import LoRAConfig, LoRAError
from fucina.train.trainer import TrainConfig, Trainer
from synth import write_model
from test_train_lora import one_thread  # noqa: F401 (autouse fixture)

Q = gguf.GGMLQuantizationType


def _setup(path):
    model = load_model(path)
    meta = GGUFFile(path).metadata
    tok = Tokenizer.from_metadata(meta)
    tpl = ChatTemplate.from_metadata(meta, tok)
    data = [encode_record({"messages": [{"role": "user", "content": f"n{i}"},
                                        {"role": "assistant", "content": f"<{i % 3}>"}]}, tok, tpl)
            for i in range(12)]
    return model, data


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("m") / "q.gguf", "qwen3", qtype=Q.Q8_0, ffn=64, layers=2)


def _run(path, out, steps, *, resume=None, stop_at=None, **kw):
    model, data = _setup(path)
    cfg = TrainConfig(steps=steps, lr=5e-3, batch=2, grad_accum=kw.pop("grad_accum", 2), seed=3,
                      checkpoint_every=kw.pop("checkpoint_every", 0), ctx=64, **kw)
    tr = Trainer(model, LoRAConfig(rank=4, alpha=8, dropout=0.1, targets="q,v,down"), cfg, data,
                 data[:3], str(out) if out else None, progress=False)
    try:
        if resume:
            tr.resume(resume)
        if stop_at is not None:
            while tr.step < stop_at:
                tr.train_step()
            tr.save_checkpoint()
            return tr.history, None
        summary = tr.fit()
        return tr.history, {k: v.detach().clone() for k, v in tr.lm.named_params().items()}, summary
    finally:
        tr.close()


def test_loss_falls(model_path, tmp_path):
    hist, params, summary = _run(model_path, tmp_path / "a", 12)
    assert hist[-1]["loss"] < 0.7 * hist[0]["loss"]
    assert summary["valid_loss"] is not None and summary["tok_s"] > 0
    assert os.path.exists(tmp_path / "a" / "adapter.gguf")


def test_resume_is_bit_exact(model_path, tmp_path):
    _, straight, _ = _run(model_path, None, 6)
    _run(model_path, tmp_path / "r", 6, stop_at=3)
    _, resumed, _ = _run(model_path, tmp_path / "r", 6, resume=str(tmp_path / "r"))
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k


def test_ctrl_c_writes_a_checkpoint_that_resumes_exactly(model_path, tmp_path, monkeypatch):
    import fucina.train.trainer as T
    _, straight, _ = _run(model_path, None, 5)
    real, calls = T.loss_sum, []

    def interrupting(*a, **k):   # Ctrl-C between two chunks of one step
        calls.append(1)
        if len(calls) == 2 * 2 * 2 + 1:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(T, "loss_sum", interrupting)
    with pytest.raises(KeyboardInterrupt):
        _run(model_path, tmp_path / "c", 5)
    monkeypatch.setattr(T, "loss_sum", real)
    _, resumed, _ = _run(model_path, tmp_path / "c", 5, resume=str(tmp_path / "c"))
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k


def test_resume_refuses_a_different_setup(model_path, tmp_path):
    _run(model_path, tmp_path / "r", 4, stop_at=1)
    with pytest.raises(CheckpointError, match="lr"):
        model, data = _setup(model_path)
        tr = Trainer(model, LoRAConfig(rank=4, alpha=8, dropout=0.1, targets="q,v,down"),
                     TrainConfig(steps=4, lr=1e-3, batch=2, grad_accum=2, seed=3, ctx=64), data,
                     progress=False)
        tr.resume(str(tmp_path / "r"))


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _ddp_worker(rank, world, port, path, q, all_closed):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from fucina.train.trainer import finish_distributed
    try:
        _, params, _ = _run(path, None, 3, grad_accum=1, world_size=world, rank=rank)
        if rank == 0:
            q.put({k: v.numpy() for k, v in params.items()})
        finish_distributed()
        q.put(("closed", rank))    # the group closed on this rank without an error
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    # What is under test ends here. Twice in many CI runs a rank whose work was done aborted
    # on its way out (SIGABRT, "terminate called without an active exception"), the barrier
    # before the close notwithstanding. "closed" tells a close that failed from the
    # interpreter's teardown, which this process skips: it leaves once every rank has closed
    # its group and the queue is flushed.
    q.close()
    q.join_thread()
    all_closed.wait(120)
    os._exit(0)


@pytest.mark.slow   # two spawned interpreters: ~20 s of imports on a busy box
def test_two_process_gloo_matches_single_process(model_path):
    torch.set_num_threads(1)
    _, single, _ = _run(model_path, None, 3, grad_accum=2)
    ctx = mp.get_context("spawn")
    q, all_closed = ctx.Queue(), ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=_ddp_worker, args=(r, 2, port, model_path, q, all_closed)) for r in range(2)]
    for p in procs:
        p.start()
    got, closed = None, set()
    for _ in range(3):             # rank 0's parameters and each rank's closed group, any order
        msg = q.get(timeout=120)
        if isinstance(msg, dict):
            got = msg
        else:
            closed.add(msg[1])
    all_closed.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert got is not None and closed == {0, 1}
    for k, v in single.items():
        assert torch.allclose(torch.from_numpy(got[k]), v, rtol=1e-5, atol=1e-7), k


def test_adapter_file_round_trip_and_merge(model_path, tmp_path):
    hist, params, summary = _run(model_path, tmp_path / "a", 4)
    ad = read_adapter(summary["adapter"])
    assert ad.arch == "qwen3" and ad.alpha == 8.0
    for name, (a, b) in ad.pairs.items():
        assert torch.equal(a, params[name + ".lora_a"]) and torch.equal(b, params[name + ".lora_b"])
    # merged inference (native step) == the trained LoRA forward (torch path)
    model, data = _setup(model_path)
    ids = data[0].ids
    from fucina.train.forward import hidden
    from fucina.train.lora import LoRAModel
    lm = LoRAModel(model, LoRAConfig(rank=4, alpha=8, targets="q,v,down"))
    with torch.no_grad():
        for k, v in lm.named_params().items():
            v.copy_(params[k])
        want = model.head(hidden(model, torch.tensor(ids))[-1:])[0]
    lm.detach()
    base = model.forward_last_logits(ids)
    assert apply_adapters(model, [(ad, 1.0)]) == len(ad.pairs)
    assert model.native_plan is not None or not model.use_native_step
    got = model.forward_last_logits(ids)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got - want).abs().max() < 0.5 * (base - want).abs().max()


def test_adapter_errors(model_path, tmp_path):
    a, b = torch.zeros(4, 64), torch.zeros(64, 4)
    p = write_adapter(tmp_path / "x.gguf", "llama", 8, {"blk.0.attn_q.weight": (a, b)})
    model, _ = _setup(model_path)
    with pytest.raises(LoRAError, match="architecture 'llama'"):
        apply_adapters(model, [(read_adapter(p), 1.0)])
    p = write_adapter(tmp_path / "y.gguf", "qwen3", 8, {"blk.0.attn_q.weight": (torch.zeros(4, 32), b)})
    with pytest.raises(LoRAError, match="do not fit"):
        apply_adapters(model, [(read_adapter(p), 1.0)])
    with pytest.raises(LoRAError, match="not 'adapter'"):
        read_adapter(model_path)
    w = gguf.GGUFWriter(str(tmp_path / "z.gguf"), "qwen3")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_tensor("blk.0.attn_q.weight.lora_a", a.numpy())
    w.add_tensor("blk.0.attn_q.weight.lora_b", b.numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(LoRAError, match="alpha is missing"):
        read_adapter(tmp_path / "z.gguf")
