"""`fucina finetune` -> adapter.gguf -> `fucina run --lora` / `fucina export`, end to end."""
import json

import gguf
import pytest

from fucina.cli.main import main
from fucina.gguf import GGUFFile
from synth import write_model
from test_train_lora import one_thread  # noqa: F401 (autouse fixture)


@pytest.fixture()
def setup(tmp_path):
    model = write_model(tmp_path / "m.gguf", "gemma3", qtype=gguf.GGMLQuantizationType.Q8_0, ffn=64)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i % 2}"}) + "\n"
                            for i in range(6)))
    return model, data, tmp_path


def test_finetune_run_export(setup, capsys):
    model, data, tmp = setup
    out = tmp / "run"
    assert main(["finetune", model, "--data", str(data), "--valid-split", "0.34", "--out", str(out),
                 "--steps", "2", "--targets", "q,v,gate", "--rank", "2", "--ctx", "32", "--threads", "1",
                 "--no-progress", "--save-every", "1"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["history"]) == 2 and summary["valid_loss"] is not None
    f = GGUFFile(out / "adapter.gguf")
    assert f.metadata["general.type"] == "adapter" and f.architecture == "gemma3"
    assert "blk.0.ffn_gate.weight.lora_a" in f.tensors
    # resuming a finished run does no more steps and keeps the adapter
    assert main(["finetune", model, "--data", str(data), "--valid-split", "0.34", "--out", str(out),
                 "--steps", "2", "--targets", "q,v,gate", "--rank", "2", "--ctx", "32", "--threads", "1",
                 "--no-progress", "--resume", str(out)]) == 0
    assert main(["run", model, "--tokens", "1,2,3", "-n", "2", "--lora", str(out / "adapter.gguf"),
                 "--lora-scale", "0.5", "-t", "1"]) == 0
    assert main(["export", model, "--lora", str(out / "adapter.gguf"), "--out", str(tmp / "x.gguf"), "-t", "1"]) == 0
    assert GGUFFile(tmp / "x.gguf").architecture == "gemma3"


def test_finetune_errors(setup, capsys):
    model, data, tmp = setup
    bad = tmp / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"prompt": 1}\n')
    assert main(["finetune", model, "--data", str(bad), "--out", str(tmp / "o"), "--no-progress"]) == 1
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert main(["finetune", model, "--data", str(data), "--out", str(tmp / "o"), "--targets", "q,zz",
                 "--no-progress"]) == 1
    assert "unknown LoRA target" in capsys.readouterr().err
    assert main(["run", model, "--tokens", "1", "--lora", str(model)]) == 1
    assert "not 'adapter'" in capsys.readouterr().err


def test_finetune_phi3_fused_targets_and_checkpoint_modes(tmp_path):
    from fucina.cli.finetune import GRAD_CHECKPOINT, GRAD_CHECKPOINT_DEFAULT
    from fucina.train.forward import CHECKPOINT_MODES, DEFAULT_CHECKPOINT
    assert (GRAD_CHECKPOINT, GRAD_CHECKPOINT_DEFAULT) == (CHECKPOINT_MODES, DEFAULT_CHECKPOINT)
    model = write_model(tmp_path / "p.gguf", "phi3", qtype=gguf.GGMLQuantizationType.Q8_0, ffn=64)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i % 2}"}) + "\n"
                            for i in range(4)))
    out = tmp_path / "run"
    assert main(["finetune", model, "--data", str(data), "--out", str(out), "--steps", "1",
                 "--targets", "q,v,up", "--rank", "2", "--ctx", "32", "--threads", "1",
                 "--no-progress", "--grad-checkpoint", "full"]) == 0
    f = GGUFFile(out / "adapter.gguf")
    assert "blk.0.attn_qkv.weight.lora_a" in f.tensors and "blk.0.attn_q.weight.lora_a" not in f.tensors
    assert main(["run", model, "--tokens", "1,2,3", "-n", "2", "--lora", str(out / "adapter.gguf"),
                 "-t", "1"]) == 0


@pytest.mark.parametrize("arch", ["qwen35", "gemma4", "qwen3moe", "deepseek2"])
def test_finetune_then_run_the_newer_families(tmp_path, arch):
    """finetune -> adapter.gguf -> run --lora on each family the second wave added (all targets,
    the auto checkpoint mode on a tiny model: off; full: one recompute per layer)."""
    model = write_model(tmp_path / "m.gguf", arch, qtype=gguf.GGMLQuantizationType.Q8_0, ffn=64)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i % 2}"}) + "\n"
                            for i in range(4)))
    out = tmp_path / "run"
    for mode in ("auto", "full"):
        assert main(["finetune", model, "--data", str(data), "--out", str(out), "--steps", "2",
                     "--targets", "all", "--rank", "2", "--ctx", "32", "--threads", "1",
                     "--no-progress", "--grad-checkpoint", mode]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert all(h["loss"] == h["loss"] for h in summary["history"])   # finite, not NaN
    f = GGUFFile(out / "adapter.gguf")
    assert f.architecture == arch and any(n.startswith("blk.0.") for n in f.tensors)
    assert main(["run", model, "--tokens", "1,2,3", "-n", "2", "--lora", str(out / "adapter.gguf"),
                 "-t", "1"]) == 0
