"""A live uvicorn server over a fucina Server on a free loopback port, for the tests that
drive the HTTP stack (kept apart from test_serve so a test can use it without importing
the openai / anthropic SDKs, seconds of import on a busy machine)."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from fucina.serve import Server, create_app

uvicorn = pytest.importorskip("uvicorn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live(server: Server):
    port = free_port()
    cfg = uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning",
                         timeout_graceful_shutdown=2)
    srv = uvicorn.Server(cfg)
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.time() + 30
    while not srv.started:
        if time.time() > deadline or not t.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(10)
