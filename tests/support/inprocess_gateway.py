"""A gateway served in this process: the real ASGI app (gateway.app.create_app) on uvicorn in a
thread, on a free port -- real HTTP, without a process start per gateway (the chat-template tests
serve one per template)."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from tests.support.procs import free_port, wait_for


class InProcessGateway:
    def __init__(self, url: str):
        self.url = url


@contextmanager
def serve(**settings) -> Iterator[InProcessGateway]:
    """``settings``: GatewaySettings fields (``tokenizer``, ``render_only``, ``broker`` ...)."""
    import uvicorn

    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    port = free_port()
    app = create_app(GatewaySettings(host="127.0.0.1", port=port, log_level="warning", **settings))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", log_config=None,
                                           log_level="warning", loop="asyncio"))
    thread = threading.Thread(target=server.run, name=f"gateway{port}", daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), 60, f"in-process gateway on port {port}")
        if not server.started:
            raise RuntimeError(f"the in-process gateway on port {port} did not start")
        yield InProcessGateway(f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(30)
