"""fucina.serve: the OpenAI- and Anthropic-compatible HTTP server.

    from fucina.text.api import load
    from fucina.serve import Server, run
    run(Server.from_llm(load(), slots=4), port=8080)

Layout: `app` (Starlette routes, auth/Host guard, error policy), `openai` and
`anthropic` (the dialects), `turn` (one request's events), `parsing` (reasoning and
hermes tool calls out of the reply text, incrementally), `prompt` (the stateless
render), `engine` (worker thread, bounded queue, KV slots, continuous batching),
`metrics` (the /metrics counters), `choices` (n > 1), `protocol` (validation, errors).
"""
from fucina.serve.app import Server, create_app, run
from fucina.serve.engine import Engine, GenRequest, Scheduler

__all__ = ["Engine", "GenRequest", "Scheduler", "Server", "create_app", "run"]
