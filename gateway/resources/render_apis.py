"""``/v1/responses/render`` (OpenAI Responses) and ``/v1/messages/render`` (Anthropic
Messages): the request turned into chat messages and rendered as the chat render does
(gateway/openai_api/responses_messages.py), on the render pool."""
from __future__ import annotations

import falcon

from gateway.multimodal import load_chat_images
from gateway.openai_api.protocol import json_encoder
from gateway.openai_api.render import base_request_id
from gateway.openai_api.responses_messages import (
    MessagesRenderer,
    messages_request_decoder,
    responses_chat_request,
    responses_generate,
    responses_request_decoder,
)
from gateway.resources.openai import TextRoutes


class ResponsesRender(TextRoutes):
    async def on_post(self, req, resp) -> None:
        request = await self.decode(req, responses_request_decoder)
        await self.resolve_model(request.model)
        max_len, _, _ = await self.limits()
        options = self.renderer.options
        chat = await self.offload_light(responses_chat_request, request,
                                        auto_tools=options.enable_auto_tool_choice and bool(options.tool_call_parser))
        images = await load_chat_images(chat.messages, self.renderer.model.image, self.state.settings)

        def render() -> bytes:
            generate = self.renderer.chat(chat, max_len, "", images=images, hold=self.hold).generate
            return json_encoder.encode(responses_generate(request, generate))

        resp.data = await self.offload_light(render)
        resp.content_type = falcon.MEDIA_JSON


class MessagesRender(TextRoutes):
    def __init__(self, state, renderer):
        super().__init__(state, renderer)
        self.messages = MessagesRenderer(renderer)

    async def on_post(self, req, resp) -> None:
        request = await self.decode(req, messages_request_decoder)
        await self.resolve_model(request.model)
        max_len, _, _ = await self.limits()
        chat = await self.offload_light(self.messages.chat_request, request)
        images = await load_chat_images(chat.messages, self.renderer.model.image, self.state.settings)
        base_id = base_request_id(req.get_header("X-Request-Id"), None)

        def render() -> bytes:
            return json_encoder.encode(self.renderer.chat(chat, max_len, base_id, images=images,
                                                          hold=self.hold).generate)

        resp.data = await self.offload_light(render)
        resp.content_type = falcon.MEDIA_JSON


def add_routes(app, state, renderer) -> None:
    """The Responses and Messages render routes (beside resources/openai.py's, whose
    TextRoutes they build on; registered by the app, so the two modules form no cycle)."""
    app.add_route("/v1/responses/render", ResponsesRender(state, renderer))
    app.add_route("/v1/messages/render", MessagesRender(state, renderer))
