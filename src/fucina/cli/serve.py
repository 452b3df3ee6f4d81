"""`fucina serve [MODEL] [--host 127.0.0.1] [--port 8080] [--api-key KEY]
[--allow-host H ...] [--ctx N] [--slots N] [--batch N] [--chunk N] [--kv-budget N] [--queue N]
[--cartridge C] [--fleet DIR [--fleet-ram MB] [--fleet-top-k K]]`.

OpenAI- and Anthropic-compatible HTTP server (see fucina.serve). Binds to loopback
unless --host says otherwise.
"""
from __future__ import annotations

import os
import sys

from fucina.cli.chat import MODEL_HELP, load_llm
from fucina.cli.moe_args import moe_budget
from fucina.cli.mtp import mtp_value
from fucina.cli.pipeline_args import pipeline_kwargs


def _port(text: str) -> int:
    import argparse

    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {text!r}")
    return int(text)


def check_bind(host: str, port: int) -> None:
    """Fail before loading the model (and before saying "serving") when the address is
    taken or not ours; uvicorn binds the same address a moment later."""
    import socket

    from fucina.errors import FucinaError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise FucinaError(f"--host {host}: {e.strerror}") from e
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise FucinaError(f"cannot listen on {host}:{port}: {e.strerror}") from e


def add_parser(sub) -> None:
    from fucina.cli.common import positive

    s = sub.add_parser("serve", help="OpenAI/Anthropic-compatible HTTP server",
                       epilog="Routes: POST /v1/chat/completions, /v1/completions, /v1/responses, "
                              "/v1/messages; GET /v1/models, /health, /metrics (each /v1 route also without "
                              "the prefix). Any `model` name in a request is answered by the loaded "
                              "model; unset sampling fields take the model's recommendation, else "
                              "llama.cpp's defaults, with a fresh seed per request. A text-diffusion model (dream, "
                              "llada, diffusion-gemma) is served by denoising, one request at a time, its settings "
                              "request fields named after run's flags (diffusion_steps, canvas, entropy_bound, ...).")
    s.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=_port, default=8080)
    s.add_argument("--api-key", default=os.environ.get("FUCINA_API_KEY"),
                   help="require this key (Authorization: Bearer / x-api-key); default $FUCINA_API_KEY")
    s.add_argument("--allow-host", action="append", default=[], metavar="H",
                   help="accept only requests whose Host header names H (repeatable; DNS-rebinding guard)")
    s.add_argument("--ctx", "-c", type=positive, default=None, help="context per slot (default min(train, 4096))")
    s.add_argument("--slots", type=int, default=4, help="KV slots kept warm for prefix reuse (default 4; at least --batch)")
    s.add_argument("--batch", type=int, default=None,
                   help="streams served at once, each model pass serving all of them (default: as many "
                        "full contexts as the KV budget holds, at most 32)")
    s.add_argument("--chunk", type=int, default=None,
                   help="prompt tokens computed per pass, all arriving requests together (default 128): "
                        "bounds what a long prompt adds to the other streams' time per token")
    s.add_argument("--kv-budget", type=int, default=None, metavar="TOKENS",
                   help="KV positions the running streams may reserve together (prompt + max_tokens, "
                        "at most --ctx each); more wait in the queue (default: a quarter of the "
                        "available memory, at most 4 GiB)")
    s.add_argument("--queue", type=int, default=64, help="requests allowed to wait; more get 429 (default 64)")
    s.add_argument("--cache-type", choices=("f16", "q8_0"), default="f16")
    s.add_argument("--spec", action="store_true",
                   help="lossless speculative decoding for every request (a request's "
                        "'speculative': false opts out; an OpenAI 'prediction' turns it on)")
    s.add_argument("--spec-max", type=int, default=16, metavar="N", help="max draft tokens per pass (16)")
    s.add_argument("--fleet", metavar="DIR",
                   help="serve a cartridge fleet (fucina cartridge fleet): a request whose 'model' names one of "
                        "its trained cartridges, or whose 'cartridge' field names one or several, runs behind "
                        "them; any other request runs behind the cartridges its last user message is closest "
                        "to (retrieval over the documents' chunks, indexed at startup)")
    s.add_argument("--fleet-top-k", type=int, default=1, metavar="K",
                   help="cartridges retrieval composes for a request that names none (default 1; "
                        "0: no retrieval, such requests run behind --cartridge or nothing)")
    s.add_argument("--fleet-ram", type=positive, default=1024, metavar="MB",
                   help="RAM for loaded fleet cartridges; the least recently used are dropped (default 1024)")
    s.add_argument("--threads", "-t", type=positive)
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    s.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from fucina.errors import FucinaError
    from fucina.serve import Server, run

    for name, v in (("--slots", args.slots), ("--batch", args.batch), ("--queue", args.queue),
                    ("--chunk", args.chunk), ("--kv-budget", args.kv_budget)):
        if v is not None and v < 1:
            raise FucinaError(f"{name} must be at least 1, got {v}")
    if not args.pipeline or os.environ.get("RANK", "0") == "0":   # a pipeline's other ranks serve no HTTP
        check_bind(args.host, args.port)
    llm = load_llm(args.model, threads=args.threads, n_ctx=args.ctx, cache_type=args.cache_type,
                   lora=getattr(args, "lora", None), lora_scale=getattr(args, "lora_scale", None),
                   moe_ram=moe_budget(args), moe_policy=getattr(args, "moe_policy", "heat"),
                   engram=getattr(args, "engram", None), mtp=mtp_value(args),
                   cartridge=getattr(args, "cartridge", None) or None,   # every conversation starts behind it
                   **pipeline_kwargs(args))
    fleet = None
    if getattr(args, "fleet", None):
        from fucina.text.cartridge import FleetPrefixes
        if args.fleet_top_k < 0:
            raise FucinaError(f"--fleet-top-k must be 0 or more, got {args.fleet_top_k}")
        fleet = FleetPrefixes(args.fleet, llm.model, args.fleet_ram << 20, tokenizer=llm.tokenizer,
                              top_k=args.fleet_top_k)
        for name in fleet.names():      # a file for another model or a corrupt one fails here, not per request
            fleet.prefix(name)
        if not fleet.names():
            raise FucinaError(f"the fleet {args.fleet} has no trained cartridge yet (fucina cartridge fleet train)")
        if fleet.top_k:
            fleet.build_index(log=lambda s: print(f"fucina: {s}", file=sys.stderr))
    server = Server.from_llm(llm, slots=args.slots, batch=args.batch, chunk=args.chunk,
                             kv_budget=args.kv_budget, spec=args.spec, spec_max=args.spec_max,
                             api_key=args.api_key,
                             allow_hosts=args.allow_host, max_queue=args.queue, fleet=fleet)
    print(f"fucina: serving {server.model_id} on http://{args.host}:{args.port} "
          f"(ctx {server.engine.n_ctx}, slots {len(server.engine.pool.slots)}, batch {server.engine.batch}, "
          f"kv budget {server.engine.kv_budget} tokens)",
          file=sys.stderr)
    run(server, args.host, args.port, log_level=args.log_level)
    return 0
