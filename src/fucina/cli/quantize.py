"""`fucina quantize IN.gguf OUT.gguf --type TYPE`: re-encode a model's matrices (a
llama-quantize for Python users), with progress and a per-tensor report.

Every matrix whose rows split into whole blocks of TYPE is dequantized to f32 and encoded
with `fucina.quant.quantize` (ggml's reference quantizers, no importance matrix); vectors
(norms, biases), matrices whose rows do not split, and the embeddings and output head
(unless --all) keep their bytes; metadata is copied key for key. The report gives each
tensor's new type and relative error ||W' - W|| / ||W|| against the input's values.
`--tensors a,b` re-encodes only the named tensors (a named one that cannot take TYPE is
an error).

`--ptqtp K` (K = 1, 2 or 3) instead decorates every eligible projection (the attention
and FFN matrices of the blocks whose in-dim is a multiple of 256) with K PTQTP
trit-planes (fucina.quant.ptqtp), written as `<name>.ptqtp0..K-1` TQ2_0 tensors in place
of `<name>` (the layout: fucina/gguf/ptqtp.py); every other tensor keeps its bytes, and
the report says which were kept and what share of the model's weights they hold.
`--tie` (with `--ptqtp 2`) fits the two planes with their scales tied at 3 to 1, which
fucina serves folded, one dot pass a matrix (about K=1's decode time, K=2's bytes).
"""
from __future__ import annotations

import os
import re
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
    s = sub.add_parser("quantize", help="re-encode a GGUF's matrices to another format or to PTQTP trit-planes, "
                                        "with a per-tensor report")
    s.add_argument("input", help="GGUF file to read")
    s.add_argument("output", help="GGUF file to write")
    target = s.add_mutually_exclusive_group(required=True)
    target.add_argument("--type", type=str.upper, choices=types, metavar="TYPE",
                        help=f"target format: {', '.join(types)}")
    target.add_argument("--ptqtp", type=int, metavar="K",
                        help="decorate every eligible projection (in-dim a multiple of 256) with K = 1, 2 or 3 "
                             "PTQTP trit-planes (multiplication-free TQ2_0 planes, <name>.ptqtpN tensors)")
    s.add_argument("--tie", action="store_true",
                   help="with --ptqtp 2: tie each group's two plane scales at 3 to 1 (a 9-level code a weight), "
                        "served folded in one dot pass")
    s.add_argument("--all", action="store_true", help="re-encode the embeddings and output head too (--type only)")
    s.add_argument("--tensors", help="comma-separated tensor names: re-encode (or decorate) only these")
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


def _rel_err(approx, exact) -> float:
    import torch

    return float(torch.linalg.vector_norm(approx - exact) / max(float(torch.linalg.vector_norm(exact)), 1e-30))


def _rewrite(src: str, dst: str, only: list[str] | None, why_kept, encode, target: str, keys=None) -> list[dict]:
    """Write dst: src's metadata (plus `keys(writer)`), each tensor t with why_kept(t) None
    through encode(writer, name, t, rows) -> its report row (rows: its values f32 [-1, in]),
    every other tensor byte-verbatim. Report rows: name, src, dst, rel_err, kept (why),
    elements. `only` names the tensors to encode (a name that cannot be: QuantError)."""
    import gguf

    from fucina.gguf import GGUFFile
    from fucina.train.export import _copy_metadata, write_and_move
    from fucina.weights import LinearWeight

    if os.path.abspath(src) == os.path.abspath(dst):
        raise QuantError("the output would overwrite the input")
    f = GGUFFile(src)
    if only is not None:
        missing = [n for n in only if n not in f.tensors]
        if missing:
            raise QuantError(f"no tensor named {', '.join(missing)} in {src}")
        for n in only:
            why = why_kept(f.tensors[n], True)
            if why is not None:
                raise QuantError(f"{n} cannot be {target}: {why}")
    tmp = dst + ".tmp"
    w = gguf.GGUFWriter(tmp, f.architecture)
    _copy_metadata(src, w, None)
    if keys is not None:
        keys(w)
    report = []
    for name, t in f.tensors.items():
        why = "not asked for" if only is not None and name not in only else why_kept(t, False)
        if why is None:
            rows = LinearWeight.from_tensor(t).dequantize().reshape(-1, t.ne[0])
            report.append(dict(name=name, src=t.ggml_type.name, kept=None, elements=t.n_elements,
                               **encode(w, name, t, rows)))
        else:
            _copy_verbatim(w, name, t)
            report.append(dict(name=name, src=t.ggml_type.name, dst=t.ggml_type.name, rel_err=None, kept=why,
                               elements=t.n_elements))
    f.close()
    write_and_move(w, tmp, dst)
    return report


def requantize(src: str, dst: str, qtype, *, include_head: bool = False, only: list[str] | None = None,
               progress=None) -> list[dict]:
    """Write dst: src with its eligible matrices encoded as qtype. One report row a tensor:
    name, from, to, relative error (None: kept verbatim), why kept."""
    import gguf

    from fucina.gguf import GGMLType
    from fucina.quant import dequantize, quantize

    qt = GGMLType[qtype] if isinstance(qtype, str) else GGMLType(qtype)

    def encode(w, name, t, rows):
        q = quantize(rows, int(qt))
        w.add_tensor(name, q.numpy().reshape(tuple(t.shape[:-1]) + (-1,)),
                     raw_shape=tuple(t.shape[:-1]) + (q.shape[-1],), raw_dtype=gguf.GGMLQuantizationType(int(qt)))
        back = dequantize(q.reshape(-1), qt, rows.numel()).reshape(rows.shape)
        return dict(dst=qt.name, rel_err=_rel_err(back, rows))

    def why_kept(t, asked):
        why = eligible(t, qt, include_head or asked)
        if progress is not None and not asked:
            progress(1)
        return why

    return _rewrite(src, dst, only, why_kept, encode, f"encoded as {qt.name}")


def _copy_verbatim(w, name: str, t) -> None:
    """Tensor t into writer w under `name`, its bytes unchanged."""
    import gguf
    import numpy as np

    from fucina.gguf import GGMLType

    rows = t.n_elements // t.ne[0]
    if t.ggml_type in (GGMLType.F32, GGMLType.F16):
        w.add_tensor(name, t.data.view(np.float32 if t.ggml_type is GGMLType.F32 else np.float16).reshape(t.shape))
    else:
        w.add_tensor(name, t.data.reshape(rows, -1), raw_shape=(rows, t.data.size // rows),
                     raw_dtype=gguf.GGMLQuantizationType(int(t.ggml_type)))


#: the block matrices PTQTP decorates: attention and FFN projections (dense and shared-expert)
PROJECTIONS = re.compile(r"^blk\.\d+\.(attn_(q|k|v|qkv|output|gate)|ffn_(gate|up|down|gate_up)(_shexp)?"
                         r"|ssm_(in|out))\.weight$")


def ptqtp_eligible(t) -> str | None:
    """Why tensor t keeps its format under --ptqtp, or None when it is decorated."""
    from fucina.quant.ptqtp import GROUP

    if len(t.ne) < 2 or t.name.endswith("_norm.weight") or not t.name.endswith(".weight"):
        return "not a matrix"
    if t.name in HEAD:
        return "embeddings / head"
    if len(t.ne) > 2:
        return "expert stack"
    if not PROJECTIONS.match(t.name):
        return "not a block projection"
    if t.ne[0] % GROUP:
        return f"in-dim {t.ne[0]} is not a multiple of {GROUP}"
    return None


def decorate(src: str, dst: str, planes: int, *, only: list[str] | None = None, progress=None,
             tie: bool = False) -> list[dict]:
    """Write dst: src with each eligible projection as `planes` PTQTP trit-planes
    (`<name>.ptqtpN` TQ2_0 tensors), everything else byte-verbatim, plus the keys
    fucina.ptqtp.version and fucina.ptqtp.planes (and fucina.ptqtp.tie_scales with `tie`:
    the scale-tied fit, planes = 2). One report row a tensor: name, from, to, relative error
    of the plane sum (None: kept), why kept, elements. `progress(g)`: 256-groups solved."""
    import gguf

    from fucina.gguf import GGUFFile
    from fucina.gguf.ptqtp import PLANES_KEY, TIE_KEY, VERSION, VERSION_KEY, is_decorated, plane_name
    from fucina.quant.ptqtp import fit, plane_bytes

    if planes not in (1, 2, 3):
        raise QuantError(f"--ptqtp takes 1, 2 or 3 planes, not {planes}")
    if tie and planes != 2:
        raise QuantError(f"--tie takes --ptqtp 2 (the scale-tied fit folds two planes), not {planes}")
    with GGUFFile(src) as f:
        if is_decorated(f):
            raise QuantError(f"{src} is already PTQTP-decorated: decorate the original model")

    def encode(w, name, t, rows):
        fitted = fit(rows, planes, progress=progress, tie=tie)
        for p in range(planes):
            raw = plane_bytes(fitted, p)
            w.add_tensor(plane_name(name, p), raw.reshape(tuple(t.shape[:-1]) + (-1,)),
                         raw_shape=tuple(t.shape[:-1]) + (raw.shape[-1],),
                         raw_dtype=gguf.GGMLQuantizationType.TQ2_0)
        return dict(dst=f"PTQTP{planes}{'-tied' if tie else ''}", rel_err=_rel_err(fitted.weight(), rows),
                    unconverged=fitted.unconverged)

    def keys(w):
        w.add_uint32(VERSION_KEY, VERSION)
        w.add_uint32(PLANES_KEY, planes)
        if tie:
            w.add_uint32(TIE_KEY, 1)

    return _rewrite(src, dst, only, lambda t, asked: ptqtp_eligible(t), encode, "decorated with PTQTP planes", keys)


def shares(report: list[dict]) -> dict[str, float]:
    """The share of the model's weights (elements) decorated and kept, by reason."""
    total = sum(r["elements"] for r in report) or 1
    out = {"decorated": sum(r["elements"] for r in report if r["kept"] is None) / total}
    for r in report:
        if r["kept"] is not None:
            out[r["kept"]] = out.get(r["kept"], 0.0) + r["elements"] / total
    return out


def _groups(path: str, only: list[str] | None) -> int:
    from fucina.gguf import GGUFFile

    with GGUFFile(path) as f:
        return sum(t.n_elements // 256 for n, t in f.tensors.items()
                   if (only is None or n in only) and ptqtp_eligible(t) is None)


def _print_rows(report: list[dict]) -> list[dict]:
    """One line a tensor on stdout; returns the rows that were encoded."""
    for r in report:
        if r["kept"] is None:
            cap = r.get("unconverged")
            tail = f"rel err {r['rel_err']:.4f}" + (f" ({cap} groups at the round cap)" if cap else "")
        else:
            tail = f"kept ({r['kept']})"
        print(f"{r['name']:40s} {r['src']:>6s} -> {r['dst']:<6s} {tail}")
    return [r for r in report if r["kept"] is None]


def cmd_ptqtp(args, only: list[str] | None) -> int:
    from fucina.cli.progress import bar

    with bar(_groups(args.input, only), f"ptqtp K={args.ptqtp}", unit="group") as b:
        report = decorate(args.input, args.output, args.ptqtp, only=only, progress=b.update, tie=args.tie)
    done = _print_rows(report)
    sh = shares(report)
    kept = ", ".join(f"{why} {share:.1%}" for why, share in sh.items() if why != "decorated")
    if done:
        mean = sum(r["rel_err"] for r in done) / len(done)
        print(f"{len(done)} of {len(report)} tensors as PTQTP K={args.ptqtp} ({sh['decorated']:.1%} of the model's "
              f"weights), mean rel err {mean:.4f}; kept in their format: {kept}", file=sys.stderr)
    else:
        print(f"no tensor could be decorated; kept in their format: {kept}", file=sys.stderr)
    return 0


def cmd_quantize(args) -> int:
    from fucina.cli.progress import bar
    from fucina.gguf import GGUFFile

    only = [n.strip() for n in args.tensors.split(",") if n.strip()] if args.tensors else None
    if args.ptqtp is not None:
        if args.all:
            raise QuantError("--all is for --type: PTQTP decorates block projections only")
        return cmd_ptqtp(args, only)
    if args.tie:
        raise QuantError("--tie is for --ptqtp 2")
    with GGUFFile(args.input) as f:
        total = len(f.tensors)
    with bar(total, "quantize", unit="tensor") as b:
        report = requantize(args.input, args.output, args.type, include_head=args.all, only=only, progress=b.update)
    done = _print_rows(report)
    if done:
        mean = sum(r["rel_err"] for r in done) / len(done)
        print(f"{len(done)} of {len(report)} tensors as {args.type}, mean rel err {mean:.4f}", file=sys.stderr)
    else:
        print(f"no tensor could take {args.type}", file=sys.stderr)
    return 0
