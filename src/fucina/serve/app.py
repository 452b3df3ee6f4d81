"""The ASGI app (Starlette) and the `Server` that holds the engine and scheduler.

Routes: POST /v1/chat/completions, /v1/completions, /v1/responses (OpenAI),
POST /v1/messages, /v1/messages/count_tokens (Anthropic), GET /v1/models,
/v1/models/{id}, /health, /metrics (Prometheus text; see fucina.serve.metrics); each /v1
route also answers without the prefix, as llama-server's do (a client configured without
`/v1` still works).

Policy, in one place:
- errors come in the dialect of the route (Anthropic's schema under /v1/messages,
  OpenAI's elsewhere): malformed JSON and invalid fields 400 naming the field, a
  prompt that cannot fit the context 400 (`context_length_exceeded`), a body over
  MAX_BODY 413 (read no further), JSON nested deeper than MAX_DEPTH 400, a full queue
  429 with `Retry-After`, unknown routes 404, a failure inside the engine 500;
- `model` in a request is accepted whatever it names: the loaded model answers, and
  responses carry its id (clients such as agent frameworks send their own default
  names; a server with one model has nothing else to route to); with a cartridge
  fleet (`fleet`), a `model` that names one of its cartridges, or a `cartridge` field
  (which must name one, or list several to compose), puts that request behind them; a
  request naming none goes behind the cartridges retrieval picks for its text;
- with an API key, every /v1 route needs `Authorization: Bearer KEY` or
  `x-api-key: KEY` (/health stays open); with `allow_hosts`, a request whose Host
  header names another host is refused with 403 (the DNS-rebinding guard).
"""
from __future__ import annotations

import contextlib
import hmac
import json
import logging
from typing import Any, Callable, Iterable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fucina.errors import ContextFull, FucinaError, InvalidArgument, PipelineError, SamplingError
from fucina.serve import anthropic, diffusion, openai
from fucina.serve.choices import turns_of
from fucina.serve.engine import Engine, QueueFull, Scheduler, check_fits
from fucina.serve.protocol import ApiError, check_depth
from fucina.serve.turn import ClientGone, Turn
from fucina.text.chat_template import ChatTemplateError

log = logging.getLogger("fucina.serve")

MAX_BODY = 32 << 20
MAX_DEPTH = 64            # JSON nesting levels a request may use (real ones need under 10)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def query_text(body: dict) -> str:
    """What retrieval reads of a request: its last user message's text (chat, Responses,
    Anthropic), else its prompt (completions)."""
    def text(content) -> str:
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "\n".join(text(c.get("text", c.get("content")) if isinstance(c, dict) else c) for c in content)
        return ""

    for key in ("messages", "input"):
        msgs = body.get(key)
        if isinstance(msgs, str):
            return msgs
        if isinstance(msgs, list):
            for m in reversed(msgs):
                if isinstance(m, dict) and m.get("role", "user") == "user":
                    return text(m.get("content"))
    return text(body.get("prompt"))


class Server:
    def __init__(self, engine: Engine, *, api_key: str | None = None, allow_hosts: Iterable[str] = (),
                 max_queue: int = 64, model_id: str | None = None, fleet=None):
        self.engine = engine
        self.fleet = fleet     # text.cartridge.FleetPrefixes: cartridges per request, named or retrieved
        self.scheduler = Scheduler(engine, max_queue)
        self.api_key = api_key or None
        self.allow_hosts = {h.lower().strip() for h in allow_hosts if h.strip()}
        self.model_id = model_id or engine.name
        self.fingerprint = "fucina"
        from fucina.text.defaults import default_sampling

        self.sampling = default_sampling(getattr(getattr(engine.model, "gguf", None), "metadata", None))

    @classmethod
    def from_llm(cls, llm, *, slots: int = 1, batch: int | None = None, chunk: int | None = None,
                 kv_budget: int | None = None, spec: bool = False,
                 spec_max: int = 16, **kw) -> "Server":
        import os

        path = str(getattr(getattr(llm.model, "gguf", None), "path", "model"))
        name = os.path.basename(path).removesuffix(".gguf")
        kind = diffusion.DiffusionEngine if getattr(llm.model, "diffusion", False) else Engine
        engine = kind(llm.model, llm.tokenizer, llm.template, n_ctx=llm.n_ctx, slots=slots, batch=batch,
                        cache_type=llm.cache_type, name=name, kv_budget=kv_budget, spec=spec, spec_max=spec_max,
                        prefix=llm.prefix,
                        **({"chunk": chunk} if chunk else {}))
        return cls(engine, **kw)

    # -- helpers the dialects call ---------------------------------------------------
    def render(self, fn: Callable[[], Any], param: str = "messages"):
        """Run a render (template + tokenizer), turning its failures into 400s naming
        `param` (the field the prompt came from)."""
        try:
            prompt = fn()
        except ChatTemplateError as e:
            raise ApiError(400, f"the chat template cannot render these messages: {e}", param=param)
        try:
            check_fits(prompt.ids, self.engine.n_ctx)
        except ContextFull as e:
            raise ApiError(400, str(e), param=param, code="context_length_exceeded")
        except FucinaError as e:
            raise ApiError(400, str(e), param=param)
        return prompt

    def api_error(self, e: BaseException) -> ApiError:
        if isinstance(e, ApiError):
            return e
        if isinstance(e, QueueFull):
            return ApiError(429, str(e), kind="rate_limit_error", code="queue_full",
                            headers={"Retry-After": "1"})
        if isinstance(e, ContextFull):
            return ApiError(400, str(e), code="context_length_exceeded")
        if isinstance(e, PipelineError):       # a stage of the model is down: try again later
            return ApiError(503, str(e), kind="server_error", code="pipeline_unavailable",
                            headers={"Retry-After": "5"})
        if isinstance(e, (SamplingError, InvalidArgument)):
            return ApiError(400, str(e))
        if not isinstance(e, FucinaError):
            log.error("internal error: %r", e)
        return ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")

    # -- request plumbing --------------------------------------------------------------
    def guard(self, request: Request, *, auth: bool = True) -> None:
        if self.allow_hosts:
            host = (request.headers.get("host") or "").lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            name = name.strip("[]")
            if name not in self.allow_hosts and host not in self.allow_hosts:
                raise ApiError(403, f"host {host!r} is not allowed", kind="permission_error")
        if auth and self.api_key:
            given = request.headers.get("x-api-key")
            a = request.headers.get("authorization", "")
            if given is None and a[:7].lower() == "bearer ":
                given = a[7:].strip()
            if given is None or not hmac.compare_digest(given.encode(), self.api_key.encode()):
                raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY or x-api-key)",
                               kind="authentication_error", code="invalid_api_key")

    async def read_json(self, request: Request) -> Any:
        too_big = ApiError(413, f"the request body exceeds {MAX_BODY >> 20} MiB", kind="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():      # stop reading at the limit
            size += len(chunk)
            if size > MAX_BODY:
                raise too_big
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except RecursionError:                     # deeper than the decoder's own stack
            raise ApiError(400, f"the request body nests JSON deeper than {MAX_DEPTH} levels",
                           code="too_deep") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json")
        check_depth(body, MAX_DEPTH)
        return body

    def pick_cartridge(self, body: Any, turn: Turn) -> None:
        """With a fleet: the request's `cartridge` field (a name or a list of names), else a
        `model` naming one of its cartridges, puts the request behind it; a request naming
        none is put behind the cartridges retrieval picks for its last user message (on the
        engine's thread, which alone runs the model)."""
        if self.fleet is None or not isinstance(body, dict):
            return
        named = body.get("cartridge")
        if named is not None:
            names = [named] if isinstance(named, str) else named
            if not isinstance(names, list) or not names or \
                    not all(isinstance(n, str) and n in self.fleet for n in names):
                raise ApiError(400, f"'cartridge': the fleet has no trained cartridge {named!r} "
                                    f"(it serves {', '.join(self.fleet.names()) or 'none'})", param="cartridge")
        elif body.get("model") in self.fleet:
            names = [body["model"]]
        elif self.fleet.top_k == 0:      # no retrieval: the server's own cartridge, if any
            return
        else:
            names = None
        if names is not None:
            prefix = self.fleet.prefix(names)
            pick = lambda: prefix   # noqa: E731
        else:
            text, chosen = query_text(body), []

            def pick():
                if not chosen:
                    chosen.append(self.fleet.retrieve(text))
                return chosen[0]
        for t in turns_of(turn):    # every choice of an n > 1 request, one retrieval for all
            t.req.cartridge = pick

    def error_response(self, e: BaseException, dialect: str) -> JSONResponse:
        err = self.api_error(e)
        body = anthropic.error_body(err) if dialect == "anthropic" else openai.error_body(err)
        return JSONResponse(body, status_code=err.status, headers=err.headers)

    async def handle(self, request: Request, parse, respond, stream, dialect: str = "openai") -> Response:
        try:
            self.guard(request)
            body = await self.read_json(request)
            turn, opt = parse(self, body)
            diffusion.accept(self, body, turns_of(turn))
            self.pick_cartridge(body, turn)
            turn.submit()
        except Exception as e:
            return self.error_response(e, dialect)
        if opt["stream"]:
            try:
                await turn.wait_started(request)
            except ClientGone:
                return Response(status_code=499)
            if turn.error is not None:          # failed before its first byte: a real status
                return self.error_response(turn.error, dialect)
            return StreamingResponse(_guarded(turn, stream(self, turn, opt)), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        try:
            await turn.run(request)
        except ClientGone:
            return Response(status_code=499)
        if turn.error is not None:
            return self.error_response(turn.error, dialect)
        return JSONResponse(respond(self, turn, opt))

    # -- routes ----------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self.handle(request, openai.parse_chat, openai.respond_chat, openai.stream_chat)

    async def completions(self, request: Request) -> Response:
        return await self.handle(request, openai.parse_completion, openai.respond_completion,
                                 openai.stream_completion)

    async def responses(self, request: Request) -> Response:
        return await self.handle(request, openai.parse_response, openai.respond_response,
                                 openai.stream_response)

    async def messages(self, request: Request) -> Response:
        return await self.handle(request, anthropic.parse, anthropic.respond, anthropic.stream, "anthropic")

    async def count_tokens(self, request: Request) -> Response:
        try:
            self.guard(request)
            return JSONResponse(anthropic.count_tokens(self, await self.read_json(request)))
        except Exception as e:
            return self.error_response(e, "anthropic")

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": 0, "owned_by": "fucina",
                "type": "model", "display_name": self.model_id, "created_at": "1970-01-01T00:00:00Z",
                "meta": {"n_ctx": self.engine.n_ctx, "arch": getattr(self.engine.model.config, "arch", None)}}

    async def models(self, request: Request) -> Response:
        try:
            self.guard(request)
        except ApiError as e:
            return self.error_response(e, "openai")
        card = self._model_card()
        cards = [card] + [dict(card, id=n, display_name=n) for n in (self.fleet.names() if self.fleet else [])]
        return JSONResponse({"object": "list", "data": cards, "has_more": False,
                             "first_id": cards[0]["id"], "last_id": cards[-1]["id"]})

    async def model(self, request: Request) -> Response:
        try:
            self.guard(request)
        except ApiError as e:
            return self.error_response(e, "openai")
        return JSONResponse(self._model_card())     # any name: the loaded model (see policy)

    async def health(self, request: Request) -> Response:
        try:
            self.guard(request, auth=False)
        except ApiError as e:
            return self.error_response(e, "openai")
        body = {"status": "ok", "model": self.model_id, "queue": self.scheduler.depth,
                "max_queue": self.scheduler.max_queue, "batch": self.engine.batch,
                "n_ctx": self.engine.n_ctx, "slots": self.engine.pool.stats(),
                "requests": dict(self.engine.stats)}
        stages = getattr(self.engine.model, "describe", None)    # a pipeline: red while a stage is down
        if stages is not None:
            body["pipeline"] = stages()
            if not body["pipeline"]["healthy"]:
                body["status"] = "error"
                return JSONResponse(body, status_code=503)
        return JSONResponse(body)

    async def load(self, request: Request) -> Response:
        """The load report routers poll (vllm-router / sglang-router `GET /get_load`, for their
        load-aware policies): requests running plus waiting."""
        try:
            self.guard(request, auth=False)
        except ApiError as e:
            return self.error_response(e, "openai")
        running = sum(s["busy"] for s in self.engine.pool.stats())
        waiting = self.scheduler.depth
        return JSONResponse({"load": running + waiting, "num_reqs": running, "num_waiting_reqs": waiting,
                             "num_tokens": sum(s["tokens"] for s in self.engine.pool.stats() if s["busy"])})

    async def metrics(self, request: Request) -> Response:
        try:
            self.guard(request)
        except ApiError as e:
            return self.error_response(e, "openai")
        text = self.engine.metrics.render(self.scheduler.depth, self.engine.batch)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


async def _guarded(turn: Turn, chunks):
    """An SSE body whose end (finished, failed, or the client gone) always settles the job."""
    try:
        async for c in chunks:
            yield c
    finally:
        if not turn.done:
            turn.cancel()


def _dialect(request: Request) -> str:
    return "anthropic" if request.url.path.removeprefix("/v1").startswith("/messages") else "openai"


def create_app(server: Server) -> Starlette:
    async def not_found(request: Request, exc: HTTPException) -> Response:
        dialect = _dialect(request)
        msg = f"{request.method} {request.url.path}: " + ("no such route" if exc.status_code == 404
                                                          else exc.detail)
        return server.error_response(ApiError(exc.status_code, msg, kind="not_found_error"
                                              if exc.status_code == 404 else "invalid_request_error"), dialect)

    async def crashed(request: Request, exc: Exception) -> Response:
        return server.error_response(exc, _dialect(request))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.scheduler.start()
        try:
            yield
        finally:
            server.scheduler.stop()

    api = [
        ("/chat/completions", server.chat, "POST"),
        ("/completions", server.completions, "POST"),
        ("/responses", server.responses, "POST"),
        ("/messages", server.messages, "POST"),
        ("/messages/count_tokens", server.count_tokens, "POST"),
        ("/models", server.models, "GET"),
        ("/models/{model_id:path}", server.model, "GET"),
    ]
    routes = [Route(prefix + path, fn, methods=[method]) for prefix in ("/v1", "") for path, fn, method in api]
    routes.append(Route("/health", server.health, methods=["GET"]))
    routes.append(Route("/get_load", server.load, methods=["GET"]))
    routes.append(Route("/metrics", server.metrics, methods=["GET"]))
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: not_found, Exception: crashed})
    app.state.server = server
    return app


def run(server: Server, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info") -> None:
    import uvicorn

    uvicorn.run(create_app(server), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
