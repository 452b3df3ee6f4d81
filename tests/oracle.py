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
