"""Training checkpoints: DIR/checkpoint.pt holds the adapters, the optimizer and schedule
state, the RNG states, the step and the loader position; resuming from it continues the
run bit for bit (the same steps as an uninterrupted run, given the same thread count).

Written to a temporary file and renamed, so a crash mid-write leaves the old one intact.
"""
from __future__ import annotations

import os

import torch

from fucina.errors import FucinaError

NAME = "checkpoint.pt"
FORMAT = 1


class CheckpointError(FucinaError):
    """A checkpoint is missing, unreadable, or from a different run setup."""


def save(out_dir: str | os.PathLike, state: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, NAME)
    tmp = path + ".tmp"
    torch.save(dict(state, format=FORMAT, torch_rng=torch.get_rng_state()), tmp)
    os.replace(tmp, path)
    return path


def load(path: str | os.PathLike) -> dict:
    p = os.path.join(path, NAME) if os.path.isdir(path) else str(path)
    if not os.path.exists(p):
        raise CheckpointError(f"no checkpoint at {p}")
    try:
        state = torch.load(p, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises many types for a damaged file
        raise CheckpointError(f"cannot read checkpoint {p}: {e}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{p} is not a fucina checkpoint (format {FORMAT})")
    torch.set_rng_state(state["torch_rng"])
    return state


def check_compatible(saved: dict, now: dict, keys: tuple[str, ...]) -> None:
    """Refuse to resume with a setup that would change what the steps compute."""
    diff = [f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in keys
            if saved.get(k) != now.get(k)]
    if diff:
        raise CheckpointError("cannot resume: the run setup differs (" + "; ".join(diff) + ")")
