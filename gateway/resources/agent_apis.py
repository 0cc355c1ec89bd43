"""The generating agent APIs, each a thin mapping onto the chat path (TextRoutes.start_chat):

- ``POST /v1/messages`` (Anthropic Messages) and ``POST /v1/messages/count_tokens``:
  the request mapped to a chat request as the render route maps it
  (responses_messages.MessagesRenderer), generated, answered by messages_output's
  formatters; every error in Anthropic's shape;
- ``POST /v1/responses`` (OpenAI Responses), ``GET /v1/responses/{id}``,
  ``POST /v1/responses/{id}/cancel``: the request mapped by
  ``responses_chat_request`` (with the stored conversation ``previous_response_id``
  names), answered by responses_output's formatters, stored when asked and enabled
  (response_store.py, scoped to the caller's key); ``background: true`` runs detached
  (BackgroundResponses) and cancel stops it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import falcon
import msgspec

from common.errors import BadRequest, NotFound, ServingError
from gateway.auth import key_scope
from gateway.openai_api.messages_output import MessagesCollector, MessagesStream, anthropic_error
from gateway.openai_api.protocol import json_encoder
from gateway.openai_api.render import base_request_id
from gateway.openai_api.response_store import ResponseStore
from gateway.openai_api.responses_messages import (
    MessagesRenderer,
    MessagesRequest,
    messages_request_decoder,
    previous_messages,
    responses_chat_request,
    responses_request_decoder,
)
from gateway.openai_api.responses_output import ResponseContext, ResponsesCollector, ResponsesStream
from gateway.parsers import harmony
from gateway.parsers.reasoning import THINK_END, THINK_START
from gateway.relay import respond
from gateway.resources.openai import TextRoutes

log = logging.getLogger("tokserve.gateway")


# ---------------------------------------------------------------- Anthropic Messages
class CountTokensRequest(MessagesRequest, kw_only=True):
    """vLLM's AnthropicCountTokensRequest: a Messages request without max_tokens."""

    max_tokens: Optional[int] = None


_count_decoder = msgspec.json.Decoder(CountTokensRequest)


class AnthropicRoute(TextRoutes):
    """Errors in Anthropic's shape (``{"type": "error", "error": {...}}``) with their status."""

    def __init__(self, state, renderer, messages: MessagesRenderer):
        super().__init__(state, renderer)
        self.messages = messages

    async def on_post(self, req, resp) -> None:
        try:
            await self.post(req, resp)
        except ServingError as err:
            self._error(resp, err.status, err.message)
        except Exception as exc:  # the generic handler's 500, in this API's shape
            log.exception("unhandled error on %s %s", req.method, req.path)
            self._error(resp, 500, f"Internal server error: {type(exc).__name__}")

    @staticmethod
    def _error(resp, status: int, message: str) -> None:
        resp.status = status
        resp.content_type = falcon.MEDIA_JSON
        resp.data = anthropic_error(status, message)
        resp.stream = None

    async def post(self, req, resp) -> None:
        raise NotImplementedError


class Messages(AnthropicRoute):
    async def post(self, req, resp) -> None:
        arrival = time.time()
        request = await self.decode(req, messages_request_decoder)
        model = await self.resolve_model(request.model)
        chat = await self.offload_light(self.messages.chat_request, request)
        rendered, run = await self.start_chat(req, chat, base_request_id(req.get_header("X-Request-Id"), None),
                                              arrival)
        stream = bool(request.stream)
        formatter = (MessagesStream if stream else MessagesCollector)(run, rendered, model, request.stop_sequences)
        await respond(resp, [run], formatter, stream)


class CountTokens(AnthropicRoute):
    async def post(self, req, resp) -> None:
        request = await self.decode(req, _count_decoder)
        await self.resolve_model(request.model)
        request.stream = False
        max_len, _, _ = await self.limits()
        chat = await self.offload_light(self.messages.chat_request, request)

        def count() -> int:
            return len(self.renderer.chat(chat, max_len, "count", hold=self.hold).token_ids)

        n = await self.offload_light(count)
        resp.data = json_encoder.encode({"input_tokens": n, "context_management": {"original_input_tokens": n}})
        resp.content_type = falcon.MEDIA_JSON


# ---------------------------------------------------------------- OpenAI Responses
# Responses tool types this server generates with; the built-in ones (web_search,
# file_search, code_interpreter, computer_use, mcp, ...) need a tool runtime it has not.
_SERVED_TOOLS = ("function",)


def _refuse_unserved(request, store_enabled: bool) -> None:
    for tool in request.tools:
        kind = tool.get("type")
        if kind not in _SERVED_TOOLS:
            raise BadRequest(f"Tool type '{kind}' is not supported by this server: only function tools are.",
                             "tools")
    if request.background:
        if request.store and not store_enabled:  # vLLM's _validate_create_responses_input
            raise ServingError("This vLLM engine does not support `store=True` and therefore does not support "
                               "the background mode. To enable these features, set the environment variable "
                               "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
                               "background", status=400, type="invalid_request_error")
        if request.stream:
            raise BadRequest("background mode with stream=true is not supported by this server.", "stream")


def _check_response_id(response_id: str) -> None:
    if not response_id.startswith("resp"):
        raise ServingError(f"Invalid 'response_id': '{response_id}'. Expected an ID that begins with 'resp'.",
                           "response_id", status=400, type="invalid_request_error")


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", "response_id", type="invalid_request_error")


class BackgroundResponses:
    """``background: true`` (vLLM's; needs the store): the request is rendered and
    checked at once (its 4xx are synchronous), answered ``queued``, and generated by a
    task no connection waits on; the finished Response replaces the queued one in the
    store (``failed`` with its error when generation fails), unless it was cancelled
    meanwhile.  As vLLM, the stored status stays ``queued`` until it finishes.  Cancel
    marks it ``cancelled`` and cancels the task, which aborts the generation."""

    def __init__(self, store: ResponseStore):
        self.store = store
        self.tasks: dict[tuple[str, str], asyncio.Task] = {}

    def start(self, scope: str, run, ctx: ResponseContext, messages: list) -> dict:
        queued = ctx.response("queued", [], None)
        self.store.put(scope, queued, messages)
        key = (scope, ctx.response_id)
        task = asyncio.create_task(self._run(scope, run, ctx, messages), name=f"background-{ctx.response_id}")
        self.tasks[key] = task
        task.add_done_callback(lambda _: self.tasks.pop(key, None))
        return queued

    async def _run(self, scope: str, run, ctx: ResponseContext, messages: list) -> None:
        collector = ResponsesCollector(run, ctx)
        error_status = None
        try:
            await run.start()
            async for delta in run:
                collector.add(delta)
            response = collector.response()
        except asyncio.CancelledError:
            error_status = 499  # closing sends the workers an ABORT
            raise
        except Exception as exc:
            error_status = exc.status if isinstance(exc, ServingError) else 500
            if not isinstance(exc, ServingError):
                log.error("background response %s failed", ctx.response_id, exc_info=exc)
            message = exc.message if isinstance(exc, ServingError) else f"Internal server error: {type(exc).__name__}"
            response = dict(ctx.response("failed", [], None), error={"code": "server_error", "message": message})
        finally:
            await run.close(error_status)
        current = self.store.get(scope, ctx.response_id)
        if current is None or current.response["status"] != "cancelled":
            self.store.put(scope, response, messages)

    async def cancel(self, scope: str, response_id: str) -> dict:
        """vLLM's ``cancel_responses``."""
        stored = self.store.get(scope, response_id)
        if stored is None:
            raise _not_found(response_id)
        if stored.response["status"] not in ("queued", "in_progress"):
            raise ServingError("Cannot cancel a synchronous response.", "response_id", status=400,
                               type="invalid_request_error")
        cancelled = dict(stored.response, status="cancelled")
        self.store.put(scope, cancelled, stored.messages)
        task = self.tasks.get((scope, response_id))
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return cancelled


class ResponsesRoutes(TextRoutes):
    def __init__(self, state, renderer, store: Optional[ResponseStore], background: Optional[BackgroundResponses]):
        super().__init__(state, renderer)
        self.store = store  # None (and no background): VLLM_ENABLE_RESPONSES_API_STORE is off
        self.background = background
        tok, parser = renderer.model.tokenizer, renderer.parser
        start, end = tok.token_to_id(THINK_START), tok.token_to_id(THINK_END)
        self.markers = (start, end) if parser is not None and parser.reasoning_parser and None not in (start, end) \
            else None
        # Harmony has no think markers: its channels are counted on the token ids (vLLM's usage count).
        self.reasoning_counter = None
        if parser is not None and parser.harmony and harmony.ReasoningTokenCounter.for_tokenizer(tok) is not None:
            self.reasoning_counter = lambda: harmony.ReasoningTokenCounter.for_tokenizer(tok)
            self.markers = None


class Responses(ResponsesRoutes):
    async def on_post(self, req, resp) -> None:
        arrival = time.time()
        request = await self.decode(req, responses_request_decoder)
        model = await self.resolve_model(request.model)
        _refuse_unserved(request, self.store is not None)
        scope = key_scope(req)
        if request.store and self.store is None:
            request.store = False  # vLLM: silently not stored while its store is off
        history = None
        if request.previous_response_id is not None:
            stored = self.store.get(scope, request.previous_response_id) if self.store is not None else None
            if stored is None:
                raise _not_found(request.previous_response_id)
            history = previous_messages(stored.messages, stored.response["output"])
        options = self.renderer.options
        chat = await self.offload_light(responses_chat_request, request, history=history,
                                        auto_tools=options.enable_auto_tool_choice and bool(options.tool_call_parser))
        response_id = request.request_id or f"resp_{base_request_id(req.get_header('X-Request-Id'), None)}"
        background = bool(request.background)
        rendered, run = await self.start_chat(req, chat, "", arrival, request_id=response_id, detached=background)
        s = self.state.settings
        ctx = ResponseContext(request=request, response_id=response_id, model=model, rendered=rendered,
                              markers=self.markers, reasoning_counter=self.reasoning_counter,
                              top_logprobs=chat.top_logprobs if chat.logprobs else None,
                              tokens_as_token_ids=s.return_tokens_as_token_ids, created=int(arrival))
        if background:
            resp.data = json_encoder.encode(self.background.start(scope, run, ctx, chat.messages))
            resp.content_type = falcon.MEDIA_JSON
            return
        on_done = None
        if request.store and self.store is not None:
            store, messages = self.store, chat.messages

            def on_done(response: dict) -> None:
                store.put(scope, response, messages)

        stream = bool(request.stream)
        formatter = (ResponsesStream if stream else ResponsesCollector)(run, ctx, on_done)
        await respond(resp, [run], formatter, stream)


class ResponseById(ResponsesRoutes):
    async def on_get(self, req, resp, response_id: str) -> None:
        _check_response_id(response_id)
        stored = self.store.get(key_scope(req), response_id) if self.store is not None else None
        if stored is None:
            raise _not_found(response_id)
        resp.data = json_encoder.encode(stored.response)
        resp.content_type = falcon.MEDIA_JSON


class CancelResponse(ResponsesRoutes):
    async def on_post(self, req, resp, response_id: str) -> None:
        """vLLM's cancel: only a background response still queued can be (the cancelled
        Response is the answer); a finished one is a 400."""
        _check_response_id(response_id)
        if self.background is None:
            raise _not_found(response_id)
        resp.data = json_encoder.encode(await self.background.cancel(key_scope(req), response_id))
        resp.content_type = falcon.MEDIA_JSON


def add_routes(app, state, renderer) -> None:
    """Registered by the app beside resources/openai.py's (on a gateway with workers)."""
    messages = MessagesRenderer(renderer)
    app.add_route("/v1/messages", Messages(state, renderer, messages))
    app.add_route("/v1/messages/count_tokens", CountTokens(state, renderer, messages))
    s = state.settings
    store = ResponseStore(s.responses_store_max_entries, s.responses_store_max_bytes) \
        if s.enable_responses_store else None
    background = BackgroundResponses(store) if store is not None else None
    app.add_route("/v1/responses", Responses(state, renderer, store, background))
    app.add_route("/v1/responses/{response_id}", ResponseById(state, renderer, store, background))
    app.add_route("/v1/responses/{response_id}/cancel", CancelResponse(state, renderer, store, background))
