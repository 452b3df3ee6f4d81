"""One request's generation as a handler sees it.

A `Turn` submits a `Job` to the scheduler and turns the worker's events (pushed from
the worker thread onto this request's own asyncio queue) into parsed events:
`Started`, `LogProbs`, then the `OutputParser`'s `Text` / `Reasoning` / `ToolStart` /
`ToolArgs` / `ToolEnd`, accumulating the final result as it goes. Streaming handlers
format the events as they come; plain handlers drain them and read the totals, so
both come from the same events.

`cancel()` (the client is gone) stops generation at the next token. With
`single_call` (a forced named tool, or `parallel_tool_calls: false`) the turn stops
the model as soon as the first call is complete.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

from fucina.serve.engine import Finished, GenRequest, Job, Piece, Started
from fucina.serve.parsing import Reasoning, Text, ToolArgs, ToolEnd, ToolStart, parser_for
from fucina.serve.prompt import Prompt


@dataclass
class LogProbs:
    entries: list[tuple]


class Turn:
    def __init__(self, server, prompt: Prompt, req: GenRequest, *, single_call: bool = False,
                 id_prefix: str = "call_"):
        self.server, self.prompt, self.req = server, prompt, req
        self.single_call = single_call
        self.parser = parser_for(prompt, id_prefix)
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict] = []          # {"id", "name", "arguments"}
        self.logprobs: list[tuple] = []
        self.reply = None
        self.error: BaseException | None = None
        self.reused = 0
        self.halted = False
        self.done = False
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._peeked = None
        self.job = Job(req, self._sink)

    # -- plumbing ------------------------------------------------------------------
    def _sink(self, ev) -> None:             # worker thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, ev)
        except RuntimeError:                  # the event loop is gone
            self.job.cancel()

    def submit(self) -> None:
        self.server.scheduler.submit(self.job)

    def cancel(self) -> None:
        self.job.cancel()

    # -- events --------------------------------------------------------------------
    async def _next(self):
        if self._peeked is not None:
            ev, self._peeked = self._peeked, None
            return ev
        return await self._queue.get()

    async def wait_started(self, request=None) -> None:
        """Wait for the worker to take the job (its prefill done, or its failure), so a
        stream can still answer with an error status. Raises ClientGone."""
        async def first():
            self._peeked = await self._queue.get()
            if isinstance(self._peeked, Finished):
                self.reply, self.error = self._peeked.reply, self._peeked.error
        await self._race(first(), request)

    async def events(self) -> AsyncIterator[object]:
        early = list(self.parser.events)        # from primed text (a forced tool call)
        while True:
            ev = await self._next()
            if isinstance(ev, Started):
                self.reused = ev.reused_tokens
                yield ev
                for e in early:
                    yield self._note(e)
                early = []
            elif isinstance(ev, Piece):
                if ev.logprobs:
                    self.logprobs += ev.logprobs
                    yield LogProbs(ev.logprobs)
                if not self.halted:
                    for e in self.parser.feed(ev.text):
                        yield self._note(e)
            elif isinstance(ev, Finished):
                self.reply, self.error = ev.reply, ev.error
                if ev.logprobs:
                    self.logprobs += ev.logprobs
                    yield LogProbs(ev.logprobs)
                if not self.halted and self.error is None:
                    for e in early + self.parser.finish():
                        yield self._note(e)
                self.done = True
                return

    def _note(self, e):
        if isinstance(e, Text):
            self.text.append(e.text)
        elif isinstance(e, Reasoning):
            self.reasoning.append(e.text)
        elif isinstance(e, ToolStart):
            self.calls.append({"id": e.id, "name": e.name, "arguments": ""})
        elif isinstance(e, ToolArgs):
            self.calls[-1]["arguments"] += e.text
        elif isinstance(e, ToolEnd):
            self.calls[-1]["arguments"] = e.arguments
            if self.single_call:
                self.halted = True
                self.job.cancel()
        return e

    async def run(self, request=None) -> None:
        """Drain the events (plain responses), cancelling if the client goes away."""
        async def drain():
            async for _ in self.events():
                pass
        await self._race(drain(), request)

    async def _race(self, coro, request) -> None:
        """Run coro; if the client disconnects first, cancel the job and raise ClientGone."""
        task = asyncio.ensure_future(coro)
        waits = {task}
        watch = None
        if request is not None:
            watch = asyncio.ensure_future(_disconnected(request))
            waits.add(watch)
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                raise ClientGone()
            task.result()
        finally:
            if not task.done():
                self.cancel()
                task.cancel()
            if watch is not None:
                watch.cancel()

    # -- totals --------------------------------------------------------------------
    @property
    def content(self) -> str:
        return "".join(self.text)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)

    @property
    def finish(self) -> str:
        """stop | length | tool_calls | stop_sequence"""
        r = self.reply
        if self.calls and (self.halted or (r is not None and r.finish_reason == "stop"
                                            and r.fired_stop is None)):
            return "tool_calls"
        if r is None:
            return "stop"
        if r.finish_reason in ("length", "context"):
            return "length"
        return "stop_sequence" if r.fired_stop is not None else "stop"

    @property
    def stop_sequence(self) -> str | None:
        r = self.reply
        if r is not None and r.fired_stop is not None and r.fired_stop < len(self.req.stop):
            return self.req.stop[r.fired_stop]
        return None

    @property
    def prompt_tokens(self) -> int:
        return len(self.req.ids) - self.req.prefix

    @property
    def completion_tokens(self) -> int:
        return len(self.reply.tokens) if self.reply is not None else 0


class ClientGone(Exception):
    pass


async def _disconnected(request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
