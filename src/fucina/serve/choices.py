"""`n > 1` choices: n Turns over one prompt, seen by the handlers as one turn.

Every choice is its own Job (own sampler: choice i draws from seed + i), submitted
together; the engine computes the shared prompt once and copies its rows to the other
choices' slots (`prompt_tokens_cached_total{source="copied"}`), so n choices cost one
prefill plus n decoding rows per step. `events()` yields (choice index, event) in the
order the worker produced them, and (index, None) once a choice is over.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator, Callable

from fucina.serve.engine import GenRequest
from fucina.serve.turn import Turn

MAX_CHOICES = 16


def make_turns(server, prompt, req: GenRequest, n: int, new_processor: Callable[[], Any] | None = None,
               **kw) -> "Turn | Choices":
    """One Turn (n == 1) or n choices; choice i > 0 gets seed + i and, when the request
    has a (stateful) logit processor, a fresh one from `new_processor`."""
    if n == 1:
        return Turn(server, prompt, req, **kw)

    def choice(i: int) -> GenRequest:
        sampling = dataclasses.replace(req.sampling, seed=(req.sampling.seed + i) & 0xFFFFFFFF)
        proc = req.processor if i == 0 or req.processor is None or new_processor is None else new_processor()
        return dataclasses.replace(req, sampling=sampling, processor=proc)
    reqs = [choice(i) for i in range(n)]
    return Choices([Turn(server, prompt, r, **kw) for r in reqs])


def turns_of(turn) -> list[Turn]:
    return turn.turns if isinstance(turn, Choices) else [turn]


async def indexed_events(turn) -> AsyncIterator[tuple[int, object | None]]:
    """(choice index, event), then (index, None) when that choice is over, for one Turn
    or Choices."""
    if not isinstance(turn, Choices):
        async for ev in turn.events():
            yield 0, ev
        yield 0, None
        return
    async for item in turn.events():
        yield item


class Choices:
    def __init__(self, turns: list[Turn]):
        self.turns = turns
        self.prompt, self.req = turns[0].prompt, turns[0].req

    def submit(self) -> None:
        done = []
        try:
            for t in self.turns:
                t.submit()
                done.append(t)
        except Exception:
            for t in done:          # all or none
                t.cancel()
            raise

    def cancel(self) -> None:
        for t in self.turns:
            t.cancel()

    @property
    def error(self) -> BaseException | None:
        return next((t.error for t in self.turns if t.error is not None), None)

    @property
    def done(self) -> bool:
        return all(t.done for t in self.turns)

    @property
    def reused(self) -> int:
        return self.turns[0].reused

    @property
    def prompt_tokens(self) -> int:
        return self.turns[0].prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return sum(t.completion_tokens for t in self.turns)

    async def _race(self, coro, request) -> None:
        try:
            await self.turns[0]._race(coro, request)
        except BaseException:          # the client left (or the wait broke): every choice stops
            self.cancel()
            raise

    async def wait_started(self, request=None) -> None:
        await self._race(asyncio.gather(*(t.wait_started() for t in self.turns)), request)

    async def run(self, request=None) -> None:
        async def drain(t: Turn):
            async for _ in t.events():
                pass
        await self._race(asyncio.gather(*(drain(t) for t in self.turns)), request)

    async def events(self) -> AsyncIterator[tuple[int, object | None]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, t: Turn):
            try:
                async for ev in t.events():
                    await queue.put((i, ev))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, t)) for i, t in enumerate(self.turns)]
        try:
            left = len(tasks)
            while left:
                i, ev = await queue.get()
                left -= ev is None
                yield i, ev
        finally:
            for task in tasks:
                task.cancel()
