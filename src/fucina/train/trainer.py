"""The LoRA SFT loop: optimizer, schedule, accumulation, clipping, validation, checkpoints,
progress, and data-parallel training over torch.distributed.

One optimizer step consumes `batch * grad_accum * world_size` examples from the Loader,
in consecutive chunks of `batch` (chunk c goes to rank c % world_size; a chunk is packed
into rows when `pack` is on). The loss is the mean token cross-entropy over every
supervised token of the whole step — all chunks, all ranks — so a 2-process run computes
the same step as one process with twice the accumulation. Dropout masks are a function
of (seed, step, chunk, row, layer, projection): recomputation and resume reproduce them.
"""
from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import asdict, dataclass

import torch

from fucina.errors import FucinaError
from fucina.train import checkpoint as ckpt
from fucina.train.adapters import write_adapter
from fucina.train.data import IGNORE, Example, Loader, pack
from fucina.train.forward import checkpoint_mode, loss_sum
from fucina.train.lora import LoRAConfig, LoRAModel

OPTIMIZERS = ("adamw", "sgd", "muon")
# what must match between a checkpoint and the run resuming it
_RESUME_KEYS = ("lr", "optimizer", "weight_decay", "warmup", "min_lr_ratio", "batch", "grad_accum",
                "clip", "ctx", "seed", "pack", "world_size", "total_steps")


class TrainError(FucinaError):
    """The training setup is inconsistent (or the data cannot fill a step)."""


@dataclass
class TrainConfig:
    steps: int | None = None        # optimizer steps (or derive from epochs)
    epochs: float | None = None
    lr: float = 2e-4
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    warmup: int | None = None       # steps; None: 5% of the run
    min_lr_ratio: float = 0.1       # cosine floor, as a fraction of lr
    batch: int = 4                  # examples per chunk
    grad_accum: int = 1
    clip: float = 1.0               # max grad norm; 0 = off
    ctx: int = 512
    seed: int = 0
    pack: bool = True
    checkpoint_every: int = 0       # steps; 0 = only at the end (and on Ctrl-C)
    valid_every: int = 0            # steps; 0 = only at the end
    grad_checkpoint: bool | str = True   # a forward.CHECKPOINT_MODES name; True = the default
    world_size: int = 1
    rank: int = 0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_optimizer(name: str, params, lr: float, weight_decay: float):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    if name == "muon":
        if not hasattr(torch.optim, "Muon"):
            raise TrainError("this torch has no torch.optim.Muon")
        return torch.optim.Muon(params, lr=lr, weight_decay=weight_decay)
    raise TrainError(f"unknown optimizer {name!r} (choose from {', '.join(OPTIMIZERS)})")


def lr_factor(step: int, warmup: int, total: int, floor: float) -> float:
    """Linear warmup to 1, then cosine down to `floor`."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    t = min(1.0, (step - warmup) / span)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


class Trainer:
    def __init__(self, model, lora: LoRAConfig, cfg: TrainConfig, train: list[Example],
                 valid: list[Example] | None = None, out_dir: str | None = None, *,
                 dense: bool = False, progress: bool = True, log=None):
        if cfg.batch < 1 or cfg.grad_accum < 1:
            raise TrainError("--batch and --grad-accum must be at least 1")
        if cfg.lr <= 0:
            raise TrainError(f"--lr must be positive, got {cfg.lr}")
        self.model, self.lora_cfg, self.cfg = model, lora, cfg
        self.train, self.valid = train, valid or []
        self.out_dir, self.progress, self.log = out_dir, progress, log or (lambda s: None)
        per_step = cfg.batch * cfg.grad_accum * cfg.world_size
        if cfg.steps is None:
            if cfg.epochs is None:
                raise TrainError("give --steps or --epochs")
            cfg.steps = max(1, math.ceil(cfg.epochs * len(train) / per_step))
        if cfg.steps < 1:
            raise TrainError(f"--steps must be at least 1, got {cfg.steps}")
        if cfg.warmup is None:
            cfg.warmup = max(1, cfg.steps // 20)
        self.per_step = per_step
        self.lm = LoRAModel(model, lora, seed=cfg.seed, dense=dense)
        self._warm_up()
        self.opt = make_optimizer(cfg.optimizer, self.lm.params(), cfg.lr, cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_factor(s, cfg.warmup, cfg.steps, cfg.min_lr_ratio))
        self.loader = Loader(len(train), cfg.seed)
        self.step = 0
        self._step_start = 0
        self.history: list[dict] = []
        self.tokens = 0
        self.train_s = 0.0

    def _warm_up(self) -> None:
        """One 2-token backward: builds the Q8_0 W^T copies (or the peer's f32 weights) the
        blocks use, so the first timed step does not pay for them."""
        loss, _ = loss_sum(self.model, torch.zeros(2, dtype=torch.long), torch.tensor([0, IGNORE]))
        loss.backward()
        for p in self.lm.params():
            p.grad = None

    # -- the setup a checkpoint must agree with --------------------------------------------
    def _setup(self) -> dict:
        d = asdict(self.cfg)
        d["total_steps"] = d.pop("steps")
        return d

    def state(self) -> dict:
        return dict(step=self.step, position=self.loader.position, setup=self._setup(),
                    lora=asdict(self.lora_cfg), adapters={k: v.detach().clone() for k, v in
                                                          self.lm.named_params().items()},
                    optimizer=self.opt.state_dict(), scheduler=self.sched.state_dict(),
                    history=self.history, tokens=self.tokens, train_s=self.train_s)

    def resume(self, path: str) -> None:
        s = ckpt.load(path)
        if s.get("method") == "es":
            raise ckpt.CheckpointError(f"{path}: an evolution-strategies checkpoint (resume it with --method es)")
        ckpt.check_compatible(s["setup"], self._setup(), _RESUME_KEYS)
        if s["lora"] != asdict(self.lora_cfg):
            raise ckpt.CheckpointError(f"cannot resume: LoRA setup differs ({s['lora']} vs "
                                       f"{asdict(self.lora_cfg)})")
        params = self.lm.named_params()
        if set(params) != set(s["adapters"]):
            raise ckpt.CheckpointError("cannot resume: the checkpoint's adapters do not match the model")
        with torch.no_grad():
            for k, v in params.items():
                v.copy_(s["adapters"][k])
        self.opt.load_state_dict(s["optimizer"])
        self.sched.load_state_dict(s["scheduler"])
        self.step, self.loader.position = s["step"], s["position"]
        self.history, self.tokens, self.train_s = s["history"], s["tokens"], s["train_s"]

    def save_checkpoint(self) -> str | None:
        if not self.out_dir or self.cfg.rank != 0:
            return None
        path = ckpt.save(self.out_dir, self.state())
        self.write_adapter()
        return path

    def write_adapter(self, path: str | None = None) -> str | None:
        if self.cfg.rank != 0:
            return None
        path = path or (os.path.join(self.out_dir, "adapter.gguf") if self.out_dir else None)
        if path is None:
            return None
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        pairs = self.lm.file_pairs()
        name = os.path.basename(str(getattr(getattr(self.model, "gguf", None), "path", ""))) + " LoRA"
        return write_adapter(path, self.model.config.arch, self.lora_cfg.alpha, pairs, name)

    # -- one step -------------------------------------------------------------------------
    def _rows(self, idx: list[int]) -> list[Example]:
        exs = [self.train[i] for i in idx]
        return pack(exs, self.cfg.ctx) if self.cfg.pack else exs

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.cfg.world_size > 1:
            torch.distributed.all_reduce(t)
        return t

    def train_step(self) -> dict:
        cfg, lm = self.cfg, self.lm
        self._step_start = self.loader.position   # an interrupted step is redone on resume
        idx = self.loader.take(self.per_step)
        n_chunks = cfg.grad_accum * cfg.world_size
        mine = [(c, self._rows(idx[c * cfg.batch:(c + 1) * cfg.batch]))
                for c in range(n_chunks) if c % cfg.world_size == cfg.rank]
        counts = torch.tensor([float(sum(r.n_supervised for _, rows in mine for r in rows))])
        total = float(self._all_reduce(counts)[0])
        lm.state.training, lm.state.step = True, self.step
        loss_acc, ntok = 0.0, 0
        for c, rows in mine:
            for j, r in enumerate(rows):
                lm.state.micro = c * 4096 + j
                loss, _ = loss_sum(self.model, torch.tensor(r.ids), torch.tensor(r.labels),
                                   cfg.grad_checkpoint)
                (loss / total).backward()
                loss_acc += float(loss.detach())
                ntok += len(r.ids)
        lm.state.training = False
        params = lm.params()
        if cfg.world_size > 1:
            for p in params:
                self._all_reduce(p.grad)
            loss_acc = float(self._all_reduce(torch.tensor([loss_acc]))[0])
            ntok = int(self._all_reduce(torch.tensor([float(ntok)]))[0])
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, cfg.clip)) if cfg.clip > 0 else float("nan")
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        rec = dict(step=self.step, loss=loss_acc / total, grad_norm=gnorm, tokens=ntok,
                   lr=self.opt.param_groups[0]["lr"])
        self.history.append(rec)
        return rec

    @torch.no_grad()
    def validate(self) -> float | None:
        if not self.valid:
            return None
        total, n = 0.0, 0
        for k, e in enumerate(self.valid):
            if k % self.cfg.world_size != self.cfg.rank:
                continue
            loss, c = loss_sum(self.model, torch.tensor(e.ids), torch.tensor(e.labels), False)
            total += float(loss)
            n += c
        t = self._all_reduce(torch.tensor([total, float(n)]))
        return float(t[0] / t[1])

    # -- the loop -------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg = self.cfg
        bar = None
        if self.progress and cfg.rank == 0:
            from tqdm import tqdm
            bar = tqdm(total=cfg.steps, initial=self.step, unit="step", dynamic_ncols=True,
                       desc="finetune")
        valid_loss = None
        try:
            while self.step < cfg.steps:
                t = time.perf_counter()
                rec = self.train_step()
                self.train_s += time.perf_counter() - t
                self.tokens += rec["tokens"]
                if cfg.valid_every and self.step % cfg.valid_every == 0 and self.step < cfg.steps:
                    valid_loss = rec["valid_loss"] = self.validate()
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
                if bar is not None:
                    post = dict(loss=f"{rec['loss']:.4f}", tok_s=f"{self.tokens / self.train_s:.0f}",
                                peak_mb=f"{peak_rss_mb():.0f}")
                    if valid_loss is not None:
                        post["val"] = f"{valid_loss:.4f}"
                    bar.set_postfix(post, refresh=False)
                    bar.update(1)
        except KeyboardInterrupt:
            if bar is not None:
                bar.close()
            self.loader.position = self._step_start   # drop the half-done step
            self.opt.zero_grad(set_to_none=True)
            path = self.save_checkpoint()
            if path:
                self.log(f"interrupted at step {self.step}: checkpoint written to {self.out_dir} "
                         f"(continue with --resume {self.out_dir})")
            raise
        if bar is not None:
            bar.close()
        valid_loss = self.validate()
        if valid_loss is not None and self.history:
            self.history[-1]["valid_loss"] = valid_loss
        self.save_checkpoint()
        return self.summary(valid_loss)

    def summary(self, valid_loss: float | None) -> dict:
        last = self.history[-1] if self.history else {}
        first = self.history[0] if self.history else {}
        return dict(steps=self.step, first_loss=first.get("loss"), final_loss=last.get("loss"),
                    valid_loss=valid_loss, tokens=self.tokens, train_s=self.train_s,
                    tok_s=self.tokens / self.train_s if self.train_s else 0.0,
                    peak_rss_mb=peak_rss_mb(),
                    grad_checkpoint=checkpoint_mode(self.cfg.grad_checkpoint, self.model, self.cfg.ctx),
                    trainable=sum(p.numel() for p in self.lm.params()),
                    adapter=os.path.join(self.out_dir, "adapter.gguf") if self.out_dir else None)

    def close(self) -> None:
        self.lm.detach()


#: how long a rank waits for the others at a collective (the gradient all-reduce, the
#: start-up rendezvous) before the run fails, in seconds: torch's default is 30 minutes,
#: long enough to hide a dead or hung rank; FUCINA_DIST_TIMEOUT overrides it
DIST_TIMEOUT_S = 300.0


def init_distributed(timeout: float | None = None) -> tuple[int, int]:
    """(rank, world_size) from torchrun's environment; starts a gloo group when world > 1,
    with `timeout` seconds per collective (FUCINA_DIST_TIMEOUT, else DIST_TIMEOUT_S)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    from datetime import timedelta

    import torch.distributed as dist
    if timeout is None:
        timeout = float(os.environ.get("FUCINA_DIST_TIMEOUT", DIST_TIMEOUT_S))
    if not timeout > 0:
        raise FucinaError(f"distributed timeout must be positive, got {timeout}")
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def finish_distributed() -> None:
    """Every rank waits for the others, then the group closes, so that no rank exits while a
    peer's gloo threads still talk to it. A rare abort on the way out (SIGABRT, "terminate
    called without an active exception") was seen twice in the two-process test, once after
    this barrier was in place: its cause is not known, and the test's ranks and `fucina
    finetune`'s under torchrun now leave without the interpreter's teardown
    (tests/test_train_loop.py, cli/finetune.py)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
