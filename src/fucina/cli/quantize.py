"""`fucina quantize IN.gguf OUT.gguf --type TYPE`: re-encode a model's matrices (a
llama-quantize for Python users), with progress and a per-tensor report.

Every matrix whose rows split into whole blocks of TYPE is dequantized to f32 and encoded
with `fucina.quant.quantize` (ggml's reference quantizers, no importance matrix); vectors
(norms, biases), matrices whose rows do not split, and the embeddings and output head
(unless --all) keep their bytes; metadata is copied key for key. The report gives each
tensor's new type and relative error ||W' - W|| / ||W|| against the input's values.
`--tensors a,b` re-encodes only the named tensors (a named one that cannot take TYPE is
an error).
"""
from __future__ import annotations

import os
import sys

from fucina.errors import QuantError

#: kept in their type unless --all (llama-quantize keeps them wider too)
HEAD = ("token_embd.weight", "output.weight")


#: fucina.quant.ENCODABLE's names, spelled out so building the parser imports no torch
#: (tests/test_quantize_cli.py keeps the two equal)
TYPES = ("BF16", "F16", "F32", "MXFP4", "Q1_0", "Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K",
         "Q6_K", "Q8_0", "Q8_1", "Q8_K", "TQ1_0", "TQ2_0")


def add_parser(sub) -> None:
    types = TYPES
    s = sub.add_parser("quantize", help="re-encode a GGUF's matrices to another format, with a per-tensor report")
    s.add_argument("input", help="GGUF file to read")
    s.add_argument("output", help="GGUF file to write")
    s.add_argument("--type", required=True, type=str.upper, choices=types, metavar="TYPE",
                   help=f"target format: {', '.join(types)}")
    s.add_argument("--all", action="store_true", help="re-encode the embeddings and output head too")
    s.add_argument("--tensors", help="comma-separated tensor names: re-encode only these")
    s.set_defaults(func=cmd_quantize)


def eligible(t, qt, include_head: bool) -> str | None:
    """Why tensor t keeps its bytes under target qt, or None when it is re-encoded."""
    from fucina.quant import block_size

    if len(t.ne) < 2 or t.name.endswith("_norm.weight") or not t.name.endswith(".weight"):
        return "not a matrix"
    if t.ne[0] % block_size(qt):
        return f"rows of {t.ne[0]} do not split into {block_size(qt)}-value blocks"
    if t.name in HEAD and not include_head:
        return "embeddings / head (--all re-encodes them)"
    return None


def requantize(src: str, dst: str, qtype, *, include_head: bool = False, only: list[str] | None = None,
               progress=None) -> list[dict]:
    """Write dst: src with its eligible matrices encoded as qtype. One report row a tensor:
    name, from, to, relative error (None: kept verbatim), why kept."""
    import gguf
    import numpy as np
    import torch

    from fucina.gguf import GGMLType, GGUFFile
    from fucina.quant import dequantize, quantize
    from fucina.train.export import _copy_metadata, write_and_move
    from fucina.weights import LinearWeight

    qt = GGMLType[qtype] if isinstance(qtype, str) else GGMLType(qtype)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise QuantError("the output would overwrite the input")
    f = GGUFFile(src)
    if only is not None:
        missing = [n for n in only if n not in f.tensors]
        if missing:
            raise QuantError(f"no tensor named {', '.join(missing)} in {src}")
        for n in only:
            why = eligible(f.tensors[n], qt, True)
            if why is not None:
                raise QuantError(f"{n} cannot be encoded as {qt.name}: {why}")
    tmp = dst + ".tmp"
    w = gguf.GGUFWriter(tmp, f.architecture)
    _copy_metadata(src, w, None)
    report = []
    for name, t in f.tensors.items():
        why = "not asked for" if only is not None and name not in only else eligible(t, qt, include_head)
        if why is None:
            rows = LinearWeight.from_tensor(t).dequantize().reshape(-1, t.ne[0])
            q = quantize(rows, int(qt))
            w.add_tensor(name, q.numpy().reshape(tuple(t.shape[:-1]) + (-1,)),
                         raw_shape=tuple(t.shape[:-1]) + (q.shape[-1],), raw_dtype=gguf.GGMLQuantizationType(int(qt)))
            back = dequantize(q.reshape(-1), qt, rows.numel()).reshape(rows.shape)
            err = float(torch.linalg.vector_norm(back - rows) / max(float(torch.linalg.vector_norm(rows)), 1e-30))
            report.append(dict(name=name, src=t.ggml_type.name, dst=qt.name, rel_err=err, kept=None))
        else:
            rows = t.n_elements // t.ne[0]
            if t.ggml_type in (GGMLType.F32, GGMLType.F16):
                w.add_tensor(name, t.data.view(np.float32 if t.ggml_type is GGMLType.F32 else np.float16)
                             .reshape(t.shape))
            else:
                w.add_tensor(name, t.data.reshape(rows, -1), raw_shape=(rows, t.data.size // rows),
                             raw_dtype=gguf.GGMLQuantizationType(int(t.ggml_type)))
            report.append(dict(name=name, src=t.ggml_type.name, dst=t.ggml_type.name, rel_err=None, kept=why))
        if progress is not None:
            progress(1)
    f.close()
    write_and_move(w, tmp, dst)
    return report


def cmd_quantize(args) -> int:
    from fucina.cli.progress import bar
    from fucina.gguf import GGUFFile

    only = [n.strip() for n in args.tensors.split(",") if n.strip()] if args.tensors else None
    with GGUFFile(args.input) as f:
        total = len(f.tensors)
    with bar(total, "quantize", unit="tensor") as b:
        report = requantize(args.input, args.output, args.type, include_head=args.all, only=only, progress=b.update)
    done = [r for r in report if r["kept"] is None]
    for r in report:
        tail = f"rel err {r['rel_err']:.4f}" if r["kept"] is None else f"kept ({r['kept']})"
        print(f"{r['name']:40s} {r['src']:>6s} -> {r['dst']:<6s} {tail}")
    if done:
        mean = sum(r["rel_err"] for r in done) / len(done)
        print(f"{len(done)} of {len(report)} tensors as {args.type}, mean rel err {mean:.4f}", file=sys.stderr)
    else:
        print(f"no tensor could take {args.type}", file=sys.stderr)
    return 0
