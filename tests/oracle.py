"""The llama.cpp oracle, found through $FUCINA_LLAMA_CPP (its bin/ directory).

The shared copy stores its shared-library symlinks as small text files naming the
target and is read-only, so we lay out a runnable copy once per session: binaries
copied (their rpath is $ORIGIN), real libraries symlinked, link files made links.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def oracle_dir() -> Path | None:
    src = os.environ.get("FUCINA_LLAMA_CPP")
    if not src or not Path(src, "llama-logits").exists():
        return None
    src = Path(src).resolve()
    tag = hashlib.sha1(str(src).encode()).hexdigest()[:10]
    dst = Path(tempfile.gettempdir()) / f"fucina-oracle-{tag}"
    if (dst / ".ready").exists():
        return dst
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        out = dst / f.name
        if out.exists() or out.is_symlink():
            out.unlink()
        head = f.read_bytes()[:64] if f.stat().st_size < 64 else b""
        if head and not head.startswith(b"\x7fELF"):
            out.symlink_to(head.decode().strip())      # a link stored as text
        elif ".so" in f.name:
            out.symlink_to(f)
        else:
            shutil.copy2(f, out)
    (dst / ".ready").touch()
    return dst


def run(tool: str, *args: str, timeout: int = 600) -> str:
    d = oracle_dir()
    assert d is not None
    env = dict(os.environ, LD_LIBRARY_PATH=str(d))  # the tools' RUNPATH points at their build dir
    r = subprocess.run([str(d / tool), *args], capture_output=True, text=True, timeout=timeout,
                       env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{tool} failed ({r.returncode}): {r.stderr[-2000:]}")
    return r.stdout


# the types llama-quantize refuses to write without an importance matrix
NEEDS_IMATRIX = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "Q2_K_S"}


def write_uniform_imatrix(src: Path, out: Path) -> Path:
    """An importance matrix of all ones for every 2-D weight of `src` but the embedding, in
    llama.cpp's legacy .dat form (one call per entry; an empty dataset name at the end)."""
    import struct

    from gguf import GGUFReader

    rows = [(t.name, int(t.shape[0])) for t in GGUFReader(src).tensors
            if t.name.endswith(".weight") and len(t.shape) == 2 and t.name != "token_embd.weight"]
    with open(out, "wb") as f:
        f.write(struct.pack("<i", len(rows)))
        for name, width in rows:
            f.write(struct.pack("<i", len(name)) + name.encode())
            f.write(struct.pack(f"<ii{width}f", 1, width, *([1.0] * width)))
        f.write(struct.pack("<ii", 1, 0))
    return out


def requantize(src: Path, dst: Path, qtype: str) -> Path:
    """llama-quantize `src` to `qtype`, with a uniform importance matrix where it needs one."""
    extra = []
    if qtype in NEEDS_IMATRIX:
        extra = ["--imatrix", str(write_uniform_imatrix(src, dst.with_suffix(".imatrix.dat")))]
    run("llama-quantize", "--allow-requantize", *extra, str(src), str(dst), qtype, "2")
    return dst


def versus_exact(path: str, text: str, tmp: Path):
    """llama.cpp's and our logits of `text` (tokenized by llama.cpp) beside the exact model
    (the same weights through our torch path, kernels off): (ids, ours, theirs, exact, model)."""
    import numpy as np

    import fucina.kernels as K
    from fucina.models import load_model
    from fucina.text.evaluate import teacher_forced_logits

    src = tmp / "p.txt"
    src.write_text(text)
    ids = [int(x) for x in run("llama-tokenize", "-m", path, "-f", str(src), "--ids",
                               "--log-disable").strip().strip("[]").split(",")]
    out = tmp / "ref.f32"
    run("llama-logits", path, ",".join(map(str, ids)), str(out))
    ref = np.fromfile(out, dtype="<f4").reshape(len(ids), -1)
    model = load_model(path)
    ours = teacher_forced_logits(model, ids).numpy()
    K.set_enabled(False)
    try:
        exact = teacher_forced_logits(load_model(path), ids).numpy()
    finally:
        K.set_enabled(True)
    return ids, ours, ref, exact, model


def greedy_tokens(path: str, ids: list[int], n: int, tmp: Path) -> list[int]:
    """llama.cpp's greedy continuation of `ids`, n tokens (one llama-logits call a token)."""
    import numpy as np

    seq, out, theirs = list(ids), tmp / "last.f32", []
    for _ in range(n):
        run("llama-logits", path, ",".join(map(str, seq)), str(out), "--last", "1")
        theirs.append(int(np.argmax(np.fromfile(out, dtype="<f4"))))
        seq.append(theirs[-1])
    return theirs
