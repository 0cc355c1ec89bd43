"""Falcon ASGI application factory.

``create_app(settings, client=None)`` builds the routes over one shared broker client;
the client is started and closed with the ASGI lifespan.  The returned callable is the
Falcon app wrapped so that resources can reach the raw ASGI ``receive`` (client
disconnect detection, see gateway/disconnect.py).
"""
from __future__ import annotations

import falcon.asgi

from gateway import errors
from gateway.auth import ApiKeyMiddleware
from gateway.cluster_info import ClusterInfoCache
from gateway.cors import http_middleware
from gateway.disconnect import keep_receive_in_scope
from gateway.guards import guard_requests
from gateway.metrics import GatewayMetrics
from gateway.render_pool import MemoryTrimmer, RenderPool
from gateway.structured_outputs.policy import StructuredOutputsPolicy
from gateway.resources.abort import AbortResource
from gateway.resources.generate import GenerateResource
from gateway.resources.health import HealthResource
from gateway.resources.metrics import MetricsResource
from gateway.resources.models import ModelsResource, VersionResource
from gateway.resources import agent_apis, dev, kv_events, lora, openai, render_apis, rl
from gateway.settings import GatewaySettings
from gateway.state import GatewayState


class ClientLifecycle:
    """Falcon lifespan middleware: start the broker client with the server, close it after."""

    def __init__(self, client):
        self.client = client

    async def process_startup(self, scope, event) -> None:
        await self.client.start()

    async def process_shutdown(self, scope, event) -> None:
        await self.client.close()


def make_client(settings: GatewaySettings):
    from common import security
    from common.client import AsyncClient  # imported late: tests may pass their own client

    keys = security.load_keypair(settings.curve_client_key_file) if settings.curve_client_key_file else None
    # Only a gateway serving control routes reads the control token: a plain one cannot
    # pause the pool or touch weights even if its process is compromised.
    return AsyncClient(settings.broker, curve_server_key=settings.curve_server_key, curve_client_keys=keys,
                       control_token_file=settings.control_token_file,
                       read_control_token=settings.needs_control())


def create_falcon_app(settings: GatewaySettings, client=None) -> tuple[falcon.asgi.App, GatewayState]:
    if client is None:
        client = None if settings.render_only else make_client(settings)
    state = GatewayState(
        settings=settings,
        client=client,
        cluster=ClusterInfoCache(client, ttl=settings.info_ttl_s, timeout=settings.info_timeout_s),
        metrics=GatewayMetrics(),
        render_pool=RenderPool(settings.render_workers, settings.render_queue, settings.max_prompt_chars),
        trimmer=MemoryTrimmer(),
    )
    renderer = make_renderer(settings)
    state.image = renderer.model.image if renderer is not None else None
    state.structured_outputs = StructuredOutputsPolicy.build(
        settings.structured_outputs_config, settings.reasoning_parser,
        renderer.model.tokenizer if renderer is not None else None)
    if settings.render_only:
        return render_only_app(settings, state, renderer), state
    # vLLM guards only /v1; here every route but the probes needs the key (gateway/auth.py).
    auth = ApiKeyMiddleware(settings.api_key) if settings.api_key else None
    app = falcon.asgi.App(middleware=[ClientLifecycle(client), *http_middleware(settings.cors, auth)])
    app.req_options.strip_url_path_trailing_slash = True
    errors.install(app)
    abort = AbortResource(state)
    app.add_route("/inference/v1/generate", GenerateResource(state, renderer))
    app.add_route("/inference/v1/abort_requests", abort)
    if settings.enable_rl:
        rl.add_routes(app, state)  # its /abort_requests also takes the legacy {"request_ids": [...]}
        dev.add_routes(app, state)  # /server_info, /collective_rpc: vLLM's dev-mode routes
    elif settings.tokens_only:
        app.add_route("/abort_requests", abort)  # vLLM's unauthenticated legacy path
    app.add_route("/health", HealthResource(state))
    app.add_route("/metrics", MetricsResource(state))
    app.add_route("/v1/models", ModelsResource(state))
    if settings.allow_runtime_lora:
        lora.add_routes(app, state)
    app.add_route("/version", VersionResource())
    kv_events.add_routes(app, state)  # /kv_event_sources, /get_server_info: for an outside KV-aware router
    if renderer is not None:
        openai.add_routes(app, state, renderer)
        render_apis.add_routes(app, state, renderer)
        agent_apis.add_routes(app, state, renderer)  # /v1/messages, /v1/responses: they generate
    return app, state


def make_renderer(settings: GatewaySettings):
    """The text side (tokenizer, chat template, parsers), when the gateway has a model folder."""
    if not settings.tokenizer:
        return None
    from gateway.openai_api.model_files import TextModel
    from gateway.openai_api.render import RenderOptions, Renderer

    model = TextModel.load(settings.tokenizer, settings.chat_template)
    return Renderer(model, RenderOptions(
        reasoning_parser=settings.reasoning_parser, tool_call_parser=settings.tool_call_parser,
        enable_auto_tool_choice=settings.enable_auto_tool_choice,
        trust_request_chat_template=settings.trust_request_chat_template,
        default_chat_template_kwargs=settings.default_chat_template_kwargs,
        max_prompt_chars=settings.max_prompt_chars, chat_template_timeout_s=settings.chat_template_timeout_s))


class _Alive:
    async def on_get(self, req, resp) -> None:
        resp.data = b""


def render_only_app(settings: GatewaySettings, state: GatewayState, renderer) -> falcon.asgi.App:
    """No broker: render, derender and tokenize, plus /health and /version."""
    auth = ApiKeyMiddleware(settings.api_key) if settings.api_key else None
    app = falcon.asgi.App(middleware=http_middleware(settings.cors, auth))
    app.req_options.strip_url_path_trailing_slash = True
    errors.install(app)
    openai.add_routes(app, state, renderer)
    render_apis.add_routes(app, state, renderer)
    app.add_route("/health", _Alive())
    app.add_route("/version", VersionResource())
    app.add_route("/kv_event_sources", kv_events.KvEventSources(state, has_broker=False))  # {} (vLLM: "empty on render-only servers")
    return app


def untyped_health(app):
    """vLLM's ``/health`` is a bare ``Response(status_code=...)``: an empty body and no
    content-type.  Falcon adds its default media type to every response, so the header
    is dropped here, for GET /health answers without a body only (errors keep theirs)."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http" or scope.get("path", "").rstrip("/") != "/health":
            await app(scope, receive, send)
            return

        async def send_untyped(message):
            if message["type"] == "http.response.start" and message["status"] in (200, 503):
                headers = list(message.get("headers") or ())
                if (b"content-length", b"0") in headers:
                    message = dict(message, headers=[(k, v) for k, v in headers if k.lower() != b"content-type"])
            await send(message)

        await app(scope, receive, send_untyped)

    return wrapped


def create_app(settings: GatewaySettings, client=None):
    """The ASGI callable to hand to uvicorn."""
    app, state = create_falcon_app(settings, client)
    return guard_requests(untyped_health(keep_receive_in_scope(app)), settings.body_read_timeout_s, state.trimmer)
