"""What the random-weight GGUF writers (synth_*.py) share: the writer with its first keys,
the random matrices and norms, the dense ffn and MoE tensor blocks, and the write-out.
Each piece draws from the caller's generator in the order the writers always did, so a
writer's file is the same byte for byte whichever of these it uses."""
from __future__ import annotations

import argparse

import gguf
import numpy as np

from synth import _byte_vocab, _copy_tokenizer, shape_keys


def begin(path, arch: str, *, vocab: str | None, ctx: int, hidden: int, layers: int, ffn: int, heads: int,
          chat_template: bool = True) -> tuple[gguf.GGUFWriter, int]:
    """A writer for `arch` at `path` with its tokenizer (a copy of `vocab`'s, else bytes),
    name, context, embedding, block count, ffn width and head count; returns (writer, n_vocab)."""
    w = gguf.GGUFWriter(str(path), arch)
    n_vocab = _copy_tokenizer(vocab, w) if vocab else _byte_vocab(w, chat_template)
    shape_keys(w, arch, ctx, hidden, layers, ffn, heads)
    return w, n_vocab


def dropping(adder, drop):
    """`adder` that leaves out the tensors named in `drop` (a malformed file for error tests)."""
    return lambda name, a, quantize=True: None if name in drop else adder(name, a, quantize)


def random_makers(rng: np.random.Generator):
    """(mat, norm): mat(*shape, scale=1/sqrt(last dim)) a normal matrix, norm(n) weights near 1."""
    def mat(*shape, scale=None):
        return rng.standard_normal(shape, dtype=np.float32) * (scale if scale is not None else 1.0 / np.sqrt(shape[-1]))

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)
    return mat, norm


def dense_ffn(add, mat, b: str, hidden: int, ffn: int) -> None:
    """Block `b`'s SwiGLU ffn: ffn_gate, ffn_up [ffn, hidden], ffn_down [hidden, ffn]."""
    add(b + "ffn_gate.weight", mat(ffn, hidden))
    add(b + "ffn_up.weight", mat(ffn, hidden))
    add(b + "ffn_down.weight", mat(hidden, ffn))


def router(add, mat, b: str, experts: int, hidden: int, scale: float) -> None:
    """Block `b`'s F32 router (as converters keep it), scaled so its logits spread widely."""
    add(b + "ffn_gate_inp.weight", mat(experts, hidden, scale=scale / np.sqrt(hidden)), quantize=False)


def expert_stack(add, mat, b: str, experts: int, ffn_exp: int, width: int, fused_gate_up: bool = False) -> None:
    """Block `b`'s routed experts over rows of `width`: gate and up (or one gate_up) and down."""
    if fused_gate_up:
        add(b + "ffn_gate_up_exps.weight", mat(experts, 2 * ffn_exp, width))
    else:
        add(b + "ffn_gate_exps.weight", mat(experts, ffn_exp, width))
        add(b + "ffn_up_exps.weight", mat(experts, ffn_exp, width))
    add(b + "ffn_down_exps.weight", mat(experts, width, ffn_exp))


def shared_experts(add, mat, b: str, hidden: int, width: int) -> None:
    """Block `b`'s shared experts as one SwiGLU ffn `width` wide (ffn_exp * shared)."""
    add(b + "ffn_gate_shexp.weight", mat(width, hidden))
    add(b + "ffn_up_shexp.weight", mat(width, hidden))
    add(b + "ffn_down_shexp.weight", mat(hidden, width))


def write_out(w: gguf.GGUFWriter, path) -> str:
    """Header, keys and tensors to the file; returns its path."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def bench_args(out: str, *, layers: int, hidden: int, experts: int):
    """The command line of a bench file maker (benchmarks/make_*_bench.py):
    [OUT.gguf] [--layers N] [--hidden N] [--experts N], with these defaults."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=out)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument("--experts", type=int, default=experts)
    return ap.parse_args()


def mla_tensors(add, mat, norm, b: str, *, hidden: int, heads: int, q_lora: int, kv_lora: int, nope: int,
                rope: int, v_head: int, split: bool = True) -> None:
    """Block `b`'s MLA projections up to (not including) its output: attn_q, or the low-rank
    attn_q_a / attn_q_a_norm / attn_q_b when `q_lora`; attn_kv_a_mqa and its norm; then the
    per-head key and value up-projections, split as the current converter writes them
    (attn_k_b transposed per head, attn_v_b) or, with `split` False, one attn_kv_b."""
    if q_lora:
        add(b + "attn_q_a.weight", mat(q_lora, hidden))
        add(b + "attn_q_a_norm.weight", norm(q_lora))
        add(b + "attn_q_b.weight", mat(heads * (nope + rope), q_lora))
    else:
        add(b + "attn_q.weight", mat(heads * (nope + rope), hidden))
    add(b + "attn_kv_a_mqa.weight", mat(kv_lora + rope, hidden))
    add(b + "attn_kv_a_norm.weight", norm(kv_lora))
    kv_b = mat(heads * (nope + v_head), kv_lora)
    if not split:
        add(b + "attn_kv_b.weight", kv_b)
        return
    per = kv_b.reshape(heads, nope + v_head, kv_lora)
    add(b + "attn_k_b.weight", np.ascontiguousarray(per[:, :nope].transpose(0, 2, 1)))
    add(b + "attn_v_b.weight", np.ascontiguousarray(per[:, nope:]))
