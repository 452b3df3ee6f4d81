"""Serving a text-diffusion model (dream, llada, diffusion-gemma): every route answers by denoising.

A request's reply is the canvas of its prompt denoised with llama-diffusion-cli's loop
(fucina.text.diffusion.reply, what `llm.generate` / `llm.stream` run), so the same
prompt and settings give the same text as the Python API. Streaming sends the reply
block by block as each block is committed (a committed block never changes; under the
timestep schedule the canvas is one block, sent at the end).

Request fields, by the CLI's flag names: `diffusion_steps`, `diffusion_eps`,
`diffusion_block_length`, `diffusion_algorithm`, `diffusion_add_gumbel_noise`, `canvas`
(the canvas length, prompt included), with the dialect's `temperature`, `top_k`,
`top_p`, `seed`; `max_tokens` (the dialect's name for it) sizes the canvas when
`canvas` is not given (unset: 256, capped by the context). Fields a denoiser cannot
honour (stop sequences, log-probabilities, min_p and the penalties, grammars and
response formats, forced tool calls, speculation) are a 400 naming the field, and so
are diffusion fields sent to an autoregressive model.

diffusion-gemma takes `diffusion_steps` (its max steps per canvas), `entropy_bound`,
`t_min`, `t_max`, `self_conditioning` and `seed` (its canvas is the file's; the other
diffusion fields and temperature/top_k/top_p are 400s); its reply streams canvas by
canvas as each is committed.

Requests are served one at a time, in arrival order (a canvas pass is one batch of
its own; `n` choices are denoised one after another, choice i with seed + i).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from fucina.errors import FucinaError, InvalidArgument
from fucina.serve.engine import Engine, Finished, Job, Piece, Started
from fucina.serve.protocol import ApiError, Fields, bad
from fucina.text.diffusion import DiffusionConfig, fit, is_diffusion, reply

log = logging.getLogger("fucina.serve")

#: request field -> DiffusionConfig name (the CLI's flags, `--diffusion-steps` -> diffusion_steps)
FIELDS = {"diffusion_steps": "steps", "diffusion_eps": "eps", "diffusion_block_length": "block_length",
          "diffusion_algorithm": "algorithm", "diffusion_add_gumbel_noise": "add_gumbel_noise",
          "canvas": "canvas"}
#: sampling fields of the autoregressive sampler, and the value that leaves it alone
AR_SAMPLING = {"min_p": 0, "frequency_penalty": 0, "presence_penalty": 0, "repeat_penalty": 1}
#: diffusion-gemma's entropy-bound sampler (with diffusion_steps for its max steps, and seed)
EB_FIELDS = ("entropy_bound", "t_min", "t_max", "self_conditioning")
MAX_TOKENS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
DEFAULT_REPLY = 256


def accept(server, body: Any, turns) -> None:
    """Check a parsed request against the kind of model served; on a diffusion model,
    give each choice's request its DiffusionConfig. Raises ApiError(400)."""
    if not isinstance(body, dict):
        return
    if not is_diffusion(server.engine.model):
        given = [k for k in (*FIELDS, *EB_FIELDS) if body.get(k) is not None]
        if given:
            raise bad(f"{', '.join(repr(k) for k in given)}: {server.model_id} is not a diffusion model "
                      "(these fields apply to dream, llada and diffusion-gemma models)", given[0])
        return
    f = Fields(body)
    for key, inert in AR_SAMPLING.items():
        if f.num(key) not in (None, inert):
            raise _ar_only(server, key)
    kw = {"steps": f.int("diffusion_steps", None, 1), "eps": f.num("diffusion_eps", None, 0.0, 1.0),
          "block_length": f.int("diffusion_block_length", None, 0),
          "algorithm": f.int("diffusion_algorithm", None, 0, 4),
          "add_gumbel_noise": f.bool("diffusion_add_gumbel_noise", None), "canvas": f.int("canvas", None, 2)}
    kw = {k: v for k, v in kw.items() if v is not None}
    asked = next((body[k] for k in MAX_TOKENS if body.get(k) is not None), None)
    for turn in turns:
        req = turn.req
        if req.stop:
            raise _ar_only(server, "stop_sequences" if body.get("stop_sequences") is not None else "stop")
        if req.logprobs is not None:
            raise _ar_only(server, "logprobs")
        if req.processor is not None:
            key = next((k for k in ("response_format", "json_schema", "grammar", "text", "tool_choice")
                        if body.get(k) is not None), "tool_choice")
            raise _ar_only(server, key)
        if req.speculative or req.references:
            raise _ar_only(server, "prediction" if body.get("prediction") is not None else "speculative")
        n_prompt, room = len(req.ids), server.engine.n_ctx - len(req.ids)
        req.max_tokens = min(req.max_tokens, room) if asked is not None else min(DEFAULT_REPLY, room)
        s = req.sampling
        if getattr(server.engine.model, "block_diffusion", False):
            req.diffusion = _gemma(server, f, body, n_prompt, s.seed)
            continue
        for key in EB_FIELDS:
            if body.get(key) is not None:
                raise bad(f"'{key}' applies to diffusion-gemma models, not {server.model_id}", key)
        try:
            cfg = DiffusionConfig.from_kwargs(None, **fit(n_prompt, req.max_tokens, dict(
                kw, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)))
        except InvalidArgument as e:
            raise bad(str(e), _param(str(e))) from None
        if cfg.canvas > server.engine.n_ctx:
            raise ApiError(400, f"a canvas of {cfg.canvas} positions exceeds the context of {server.engine.n_ctx}",
                           param="canvas", code="context_length_exceeded")
        if cfg.canvas <= n_prompt:
            raise bad(f"the canvas ({cfg.canvas}) must be longer than the prompt ({n_prompt} tokens)", "canvas")
        req.diffusion = cfg


def _gemma(server, f: Fields, body: dict, n_prompt: int, seed: int):
    """diffusion-gemma's settings: its canvas is the file's, sampled by the EB sampler."""
    from fucina.text.diffusion_gemma import GemmaDiffusionConfig

    for key in [k for k in FIELDS if k != "diffusion_steps"] + ["temperature", "top_k", "top_p"]:
        if body.get(key) is not None:
            raise bad(f"'{key}': {server.model_id} denoises its own canvases with the entropy-bound sampler "
                      f"(it takes diffusion_steps, {', '.join(EB_FIELDS)}, seed)", key)
    C = server.engine.model.config.canvas_length
    if n_prompt + C > server.engine.n_ctx:
        raise ApiError(400, f"the prompt ({n_prompt} tokens) and a canvas of {C} exceed the context of "
                       f"{server.engine.n_ctx}", code="context_length_exceeded")
    kw = dict(steps=f.int("diffusion_steps", None, 1), entropy_bound=f.num("entropy_bound", None, 0.0),
              t_min=f.num("t_min", None), t_max=f.num("t_max", None),
              self_conditioning=f.bool("self_conditioning", None), seed=seed)
    try:
        return GemmaDiffusionConfig.for_model(server.engine.model, **kw)
    except InvalidArgument as e:
        raise bad(str(e), next((k for k in EB_FIELDS if k in str(e)), None)) from None


def _ar_only(server, key: str) -> ApiError:
    return bad(f"'{key}': {server.model_id} is a diffusion model, which denoises a canvas "
               "(no stop sequences, log-probabilities, penalties, grammars or speculation)", key)


def _param(message: str) -> str | None:
    for key, name in FIELDS.items():
        if name.replace("_", " ") in message:
            return key
    return None


class DiffusionEngine(Engine):
    """The engine for a diffusion model: the worker denoises one request at a time."""

    def __init__(self, model, tokenizer, template, *, n_ctx: int | None = None, name: str | None = None,
                 cache_type: str = "f16", **_ignored):
        super().__init__(model, tokenizer, template, n_ctx=n_ctx, slots=1, batch=1, cache_type=cache_type,
                         name=name, kv_budget=n_ctx or min(model.config.n_ctx_train, 4096))

    def run(self, take: Callable[[int, bool, Callable[[Job], bool]], list[Job] | None]) -> None:
        while True:
            jobs = take(1, True, None)
            if jobs is None:
                self.metrics.idle()
                return
            for job in jobs:
                self._denoise(job)
            self.metrics.idle()

    def _denoise(self, job: Job) -> None:
        req = job.req
        if job.cancelled:
            job.sink(Finished(None))
            return
        cfg = getattr(req, "diffusion", None)
        out, error, first = None, None, True
        try:
            if cfg is None:
                raise FucinaError("a request reached the diffusion engine without its settings")
            slot = self.pool.slots[0]
            slot.busy, slot.requests = True, slot.requests + 1
            self.metrics.prompt(len(req.ids), 0, 0)
            job.sink(Started(len(req.ids), 0))
            if isinstance(cfg, DiffusionConfig):
                gen = reply(self.model, self.tokenizer, req.ids, cfg, on_step=lambda *_: not job.cancelled)
            else:      # diffusion-gemma: cancelled between blocks
                from fucina.text import diffusion_gemma
                gen = diffusion_gemma.reply(self.model, self.tokenizer, req.ids, req.max_tokens, cfg, self.n_ctx)
            while True:
                try:
                    text = next(gen)
                except StopIteration as done:
                    out = done.value
                    break
                if job.cancelled:        # the block may have been cut short: not sent
                    gen.close()
                    break
                if first:
                    self.metrics.first_token(time.monotonic() - job.enqueued)
                    first = False
                job.sink(Piece(text))
        except Exception as e:           # this request fails alone
            if not isinstance(e, FucinaError):
                log.exception("denoising failed")
            error = e
        finally:
            self.pool.release(self.pool.slots[0])
        outcome = "failed" if error else "cancelled" if job.cancelled else "completed"
        self.stats[outcome] += 1
        self.metrics.finished(outcome)
        if out is not None:
            self.stats["tokens"] += len(out.tokens)
            self.metrics.generated(len(out.tokens))
        try:
            job.sink(Finished(out, error))
        except Exception:
            log.exception("a request's sink failed")
