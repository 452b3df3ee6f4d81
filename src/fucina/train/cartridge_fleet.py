"""Training a cartridge fleet (models.cartridge_fleet): every document's cartridge by
self-study, as many at once as a RAM budget holds.

Each document trains as `train.cartridge.train_cartridge` would train it alone (its own
p and seed from the manifest, the run's other settings), in turns of `turn` optimizer
steps: the document with the fewest conversations so far goes next (the resident ones
first among equals), loaded if it is not resident, the least recently used resident
evicted while the budget is exceeded. A document's rows and Adam moments are on disk
after every step (its cartridge file and `file.ckpt`), so eviction drops them and a
reload continues bit for bit: the cartridges a fleet run produces do not depend on the
budget or the turn length (pinned by a test). With `cfg.distract`, a document trains
against the other documents' corpus-initialised rows as distractors (fixed rows, so the
result still does not depend on the order the fleet trains in).
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Callable, Sequence

from fucina.errors import CartridgeError
from fucina.models.cartridge import Cartridge
from fucina.models.cartridge_fleet import Fleet, Resident
from fucina.train.cartridge import CartridgeRun, SelfStudyConfig, Trainable, init_cartridge


def fleet_run(model, tokenizer, fleet: Fleet, name: str, cfg: SelfStudyConfig,
              log: Callable[[str], None] = lambda s: None) -> CartridgeRun:
    """Document `name`'s training state: resumed from its files when it has a checkpoint,
    else initialised from its document."""
    e = fleet.get(name)
    out = fleet.path(e.file)
    resume = os.path.exists(out + ".ckpt")
    start = None
    if resume:
        start = Cartridge.load(out)
        start.check_model(model)
    distractors = []
    if cfg.distract > 0:      # the other documents' first rows: fixed, whatever order the fleet trains in
        distractors = [init_cartridge(model, tokenizer, fleet.corpus(o), replace(cfg, p=o.p, seed=o.seed, init="corpus"))
                       for o in fleet.entries if o.name != name]
    return CartridgeRun(model, tokenizer, fleet.corpus(e), replace(cfg, p=e.p, seed=e.seed), out=out,
                        resume=resume, start=start, log=lambda s: log(f"[{name}] {s}"), distractors=distractors)


def train_fleet(model, tokenizer, fleet: Fleet, cfg: SelfStudyConfig, *, budget: int, turn: int = 4,
                names: Sequence[str] | None = None, log: Callable[[str], None] = lambda s: None) -> dict:
    """Train the fleet's documents (`names`, default all) to `cfg.conversations` each
    (times `cfg.epochs` passes),
    with at most `budget` bytes of training state resident (at least one document).
    Returns {"loads", "evictions", "trained": {name: conversations}}."""
    if turn < 1:
        raise CartridgeError("a turn is at least one optimizer step")
    wanted = [fleet.get(n).name for n in names] if names else [e.name for e in fleet.entries]
    if not wanted:
        raise CartridgeError("the fleet has no documents (fucina cartridge fleet add)")

    def load(name: str) -> CartridgeRun:
        run = fleet_run(model, tokenizer, fleet, name, cfg, log)
        log(f"[{name}] loaded: {run.prog.done} conversations done, {run.nbytes() / 1e6:.1f} MB resident")
        return run

    def evict(name: str, run: CartridgeRun) -> None:
        log(f"[{name}] evicted after {run.prog.done} conversations (its state is on disk)")

    target = cfg.conversations * max(1, cfg.epochs)   # visits: each conversation once per pass
    resident: Resident[CartridgeRun] = Resident(budget, load, lambda r: r.nbytes(), evict)
    trainable = Trainable(model)
    try:
        while True:
            todo = [fleet.get(n) for n in wanted if fleet.get(n).conversations < target]
            if not todo:
                break
            e = min(todo, key=lambda e: (e.conversations, e.name not in resident, fleet.index(e.name)))
            run = resident.get(e.name)
            run.advance(run.prog.done + turn * cfg.accum)
            e.conversations, e.steps = run.prog.done, run.prog.steps
            fleet.save()
    finally:
        trainable.close()
    return {"loads": resident.loads, "evictions": resident.evictions,
            "trained": {n: fleet.get(n).conversations for n in wanted}}
