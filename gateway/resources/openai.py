"""vLLM's OpenAI-compatible and scale-out text routes on the gateway:

- ``/v1/chat/completions`` and ``/v1/completions``: render -> generate -> derender in
  this process (the OpenAI facade);
- ``/v1/chat/completions/render``, ``/v1/completions/render``: the GenerateRequest(s);
  ``/v1/responses/render``, ``/v1/messages/render`` (gateway/resources/render_apis.py):
  a Responses / Anthropic Messages request's;
- ``/v1/chat/completions/derender``, ``/v1/completions/derender``: generate output ->
  OpenAI objects;
- ``/tokenize``, ``/detokenize`` and (``--enable-tokenizer-info-endpoint``) ``/tokenizer_info``.

Render, derender and tokenize need no worker: a ``--render-only`` gateway serves them
with no broker at all, as ``vllm launch render`` does.
"""
from __future__ import annotations

import time
from typing import Optional

import falcon

from common.errors import NotFound, Overloaded, ServingError
from gateway.body import decode_json, is_json, read_body
from gateway.openai_api.chat_facade import ChatCollector, ChatStream
from gateway.openai_api.completion_facade import CompletionCollector, CompletionStream
from gateway.openai_api.derender import Derenderer
from gateway.openai_api.facade import ResponseView, generations, map_rendered
from gateway.openai_api.protocol import (
    DetokenizeResponse,
    TokenizeResponse,
    chat_request_decoder,
    completion_request_decoder,
    derender_request_decoder,
    detokenize_request_decoder,
    json_encoder,
    tokenize_request_decoder,
)
from gateway.multimodal import attach_images, load_chat_images
from gateway.openai_api.render import RenderedChat, Renderer, base_request_id
from gateway.generate_api.request_mapping import base_model_names, check_model
from gateway.relay import Generation, respond
from gateway.state import GatewayState


class TextRoutes:
    """What every text route shares: the renderer and where the model limits come from."""

    def __init__(self, state: GatewayState, renderer: Renderer):
        self.state = state
        self.renderer = renderer

    async def decode(self, req, decoder):
        if not is_json(req.content_type):
            raise ServingError("Unsupported Media Type: Only 'application/json' is allowed", status=400,
                               type="BadRequestError")
        body = await read_body(req, self.state.settings.max_body_bytes)
        req.context.body_bytes = len(body)
        return decode_json(decoder, body)

    async def offload(self, req, fn, *args, **kwargs):
        """Tokenizing, template rendering, detokenizing and encoding big answers take
        time in proportion to the input (seconds for megabytes): they run on the render
        pool so the event loop keeps serving everything else.  The body's size stands
        for the job's memory (RenderPool's weight)."""
        return await self.state.render_pool.run(fn, *args, weight=req.context.get("body_bytes", 0), **kwargs)

    async def offload_light(self, fn, *args, **kwargs):
        """A job that enters the pool light: turning a Responses / Messages request into
        chat messages, or rendering a chat (``fn`` calls Renderer.chat with
        ``hold=self.hold``), weighed by its rendered prompt only when it tokenizes it
        (RenderPool.hold); so an over-long chat's 400 does not wait behind heavy jobs."""
        return await self.state.render_pool.run(fn, *args, weight=0, **kwargs)

    @property
    def hold(self):
        return self.state.render_pool.hold

    def check_completion_fits(self, request, max_len: int) -> None:
        """Completion text prompts against the cheap length bound (Renderer.check_text_fits)
        here on the event loop, before the job queues behind heavy ones for its 400."""
        prompt = request.prompt
        texts = [prompt] if isinstance(prompt, str) else (
            [p for p in prompt if isinstance(p, str)] if isinstance(prompt, list) and prompt
            and isinstance(prompt[0], str) else [])
        self.renderer.check_prompt_chars(sum(len(t) for t in texts if isinstance(t, str)))  # named first, as before
        for text in texts:
            self.renderer.check_text_fits(text, max_len, request.truncate_prompt_tokens)

    def render_only(self) -> bool:
        return self.state.settings.render_only

    async def limits(self) -> tuple[int, int, list[str]]:
        """(max_model_len, max_logprobs, served names): from the workers, or the model files."""
        s = self.state.settings
        if self.render_only():
            names = s.served_model_names or [str(self.renderer.model.path)]
            max_len = s.max_model_len or self.renderer.model.max_position_embeddings
            if not max_len:
                raise ServingError("--max-model-len is required: the model's config.json has no "
                                   "max_position_embeddings", status=500)
            return max_len, 20, names
        cluster = await self.state.cluster.get()
        if cluster.model is None:
            raise Overloaded("No inference worker is available yet.")
        return (cluster.model.max_model_len, cluster.model.max_logprobs,
                base_model_names(cluster.model, s.served_model_names))

    async def resolve_model(self, requested: Optional[str]) -> str:
        """The name answers use (the requested one, else the first served name); vLLM's 404
        for a model this server does not serve (request_mapping.check_model).  The pool's
        LoRA adapters are read fresh, and only for a name that is not the base model's."""
        _, _, names = await self.limits()
        adapters = None
        if requested and requested not in names and not self.render_only():
            adapters = (await self.state.cluster.fresh()).lora_adapters
        check_model(requested, names, adapters)
        return requested or names[0]


    async def start_chat(self, req, request, base_id: str, arrival: float, request_id: Optional[str] = None,
                         detached: bool = False) -> tuple[RenderedChat, Generation]:
        """A chat request rendered, mapped and checked for the workers: the one path
        /v1/chat/completions, /v1/responses and /v1/messages generate through (the last
        two map their protocol onto a ChatCompletionRequest first).  ``request_id``
        replaces the rendered one (``resp_...`` for a Responses request); ``detached``: the
        generation outlives the connection (a background Response)."""
        max_len, _, _ = await self.limits()
        images = await load_chat_images(request.messages, self.renderer.model.image, self.state.settings)
        rendered = await self.offload_light(self.renderer.chat, request, max_len, base_id, images=images,
                                           hold=self.hold)
        if request_id is not None:
            rendered.request.request_id = request_id
        mapped = await map_rendered(self.state, req, rendered.request, arrival)
        await attach_images(mapped, self.renderer.model.image, self.state.settings, processed=rendered.images)
        return rendered, generations(self.state, req, [mapped], detached=detached)[0]


class ChatCompletions(TextRoutes):
    async def on_post(self, req, resp) -> None:
        arrival = time.time()
        request = await self.decode(req, chat_request_decoder)
        model = await self.resolve_model(request.model)
        rendered, run = await self.start_chat(
            req, request, base_request_id(req.get_header("X-Request-Id"), request.request_id), arrival)
        view = ResponseView.of(request, request.top_logprobs if request.logprobs else None, self.state.settings)
        stream = bool(request.stream)
        formatter = (ChatStream if stream else ChatCollector)(run, view, rendered, model)
        await respond(resp, [run], formatter, stream)


class Completions(TextRoutes):
    async def on_post(self, req, resp) -> None:
        arrival = time.time()
        request = await self.decode(req, completion_request_decoder)
        model = await self.resolve_model(request.model)
        max_len, _, _ = await self.limits()
        self.check_completion_fits(request, max_len)
        rendered = await self.offload(req, self.renderer.completion, request, max_len,
                                      base_request_id(req.get_header("X-Request-Id"), request.request_id))
        mapped = [await map_rendered(self.state, req, r.request, arrival) for r in rendered]
        view = ResponseView.of(request, request.logprobs, self.state.settings)
        runs = generations(self.state, req, mapped)
        stream = bool(request.stream)
        formatter = (CompletionStream if stream else CompletionCollector)(runs, view, rendered,
                                                                          self.renderer.model.tokenizer, model)
        await respond(resp, runs, formatter, stream)


class ChatRender(TextRoutes):
    async def on_post(self, req, resp) -> None:
        request = await self.decode(req, chat_request_decoder)
        await self.resolve_model(request.model)
        max_len, _, _ = await self.limits()
        images = await load_chat_images(request.messages, self.renderer.model.image, self.state.settings)
        base_id = base_request_id(req.get_header("X-Request-Id"), request.request_id)

        def render() -> bytes:
            return json_encoder.encode(self.renderer.chat(request, max_len, base_id, images=images,
                                                          hold=self.hold).generate)

        resp.data = await self.offload_light(render)
        resp.content_type = falcon.MEDIA_JSON


class CompletionRender(TextRoutes):
    async def on_post(self, req, resp) -> None:
        request = await self.decode(req, completion_request_decoder)
        await self.resolve_model(request.model)
        max_len, _, _ = await self.limits()
        self.check_completion_fits(request, max_len)
        base_id = base_request_id(req.get_header("X-Request-Id"), request.request_id)

        def render() -> bytes:
            return json_encoder.encode([r.generate for r in self.renderer.completion(request, max_len, base_id)])

        resp.data = await self.offload(req, render)
        resp.content_type = falcon.MEDIA_JSON


class ChatDerender(TextRoutes):
    async def on_post(self, req, resp) -> None:
        body = await self.decode(req, derender_request_decoder)
        model = await self.resolve_model(body.model)
        max_len, max_logprobs, _ = await self.limits()
        derenderer = Derenderer(self.renderer, max_len, max_logprobs)
        resp.data = await self.offload(req, derenderer.chat_stream if body.stream else derenderer.chat, body, model)
        resp.content_type = falcon.MEDIA_JSON


class CompletionDerender(TextRoutes):
    async def on_post(self, req, resp) -> None:
        body = await self.decode(req, derender_request_decoder)
        model = await self.resolve_model(body.model)
        max_len, max_logprobs, _ = await self.limits()
        derenderer = Derenderer(self.renderer, max_len, max_logprobs)
        resp.data = await self.offload(req, derenderer.completion_stream if body.stream else derenderer.completion,
                                       body, model)
        resp.content_type = falcon.MEDIA_JSON


class Tokenize(TextRoutes):
    async def on_post(self, req, resp) -> None:
        request = await self.decode(req, tokenize_request_decoder)
        await self.resolve_model(request.model)
        max_len, _, _ = await self.limits()
        images = None
        if request.messages is not None:
            if request.continue_final_message and request.add_generation_prompt:
                raise ServingError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                   status=400, type="BadRequestError")
            self.renderer.check_request_template(request.chat_template)
            images = await load_chat_images(request.messages, self.renderer.model.image, self.state.settings)
        elif request.prompt is not None:
            self.renderer.check_prompt_chars(len(request.prompt))
        else:
            raise ServingError("Either `prompt` or `messages` must be given.", status=400, type="BadRequestError")
        resp.data = await self.offload(req, self._tokenize, request, images, max_len)
        resp.content_type = falcon.MEDIA_JSON

    def _tokenize(self, request, images, max_len: int) -> bytes:
        tok = self.renderer.model.tokenizer
        if request.messages is not None:
            # As vLLM's create_tokenize: the tokens are the processed prompt's, each image's
            # placeholder expanded to its tokens (and counted); nothing else about the images.
            image_urls: Optional[list] = [] if self.renderer.model.image is not None else None
            prompt = self.renderer.render_messages(
                request.messages, tools=request.tools, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=dict(self.renderer.options.default_chat_template_kwargs,
                                          **(request.chat_template_kwargs or {})),
                chat_template=request.chat_template, image_urls=image_urls)
            if image_urls:
                prompt = self.renderer.model.image.expand_text(prompt)
            ids = self.renderer.expand_images(tok.encode(prompt, add_special_tokens=bool(request.add_special_tokens)),
                                              image_urls, images)
        else:
            add = True if request.add_special_tokens is None else request.add_special_tokens
            ids = tok.encode(request.prompt, add_special_tokens=add)
        strs = [t or "" for t in tok.convert_ids_to_tokens(ids)] if request.return_token_strs else None
        return json_encoder.encode(TokenizeResponse(count=len(ids), max_model_len=max_len, tokens=ids,
                                                    token_strs=strs))


class Detokenize(TextRoutes):
    async def on_post(self, req, resp) -> None:
        request = await self.decode(req, detokenize_request_decoder)
        await self.resolve_model(request.model)
        resp.data = await self.offload(req, self._detokenize, request.tokens)
        resp.content_type = falcon.MEDIA_JSON

    def _detokenize(self, tokens: list[int]) -> bytes:
        tok = self.renderer.model.tokenizer
        # As vLLM: any id of the model's vocabulary, those past the tokenizer's (padding
        # ids) decoding to "" as the fast tokenizer decodes unknown ids.
        bad = next((t for t in tokens if t >= self.renderer.model.vocab_size), None)
        if bad is not None:
            raise ServingError(f"Token id {bad} is out of vocabulary", param="tokens", status=400,
                               type="BadRequestError")
        return json_encoder.encode(DetokenizeResponse(prompt=tok.decode(tokens, skip_special_tokens=False)))


class TokenizerInfo(TextRoutes):
    async def on_get(self, req, resp) -> None:
        config = {k: v for k, v in self.renderer.model.tokenizer_config.items()
                  if k not in ("vocab_file", "merges_file")}
        config = _plain(config)
        config["tokenizer_class"] = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
        if self.renderer.model.chat_template_text:
            config["chat_template"] = self.renderer.model.chat_template_text
        resp.data = json_encoder.encode(config)
        resp.content_type = falcon.MEDIA_JSON


def _plain(obj):
    """AddedToken dicts -> their content, as vLLM's TokenizerInfo does."""
    if isinstance(obj, dict):
        if obj.get("__type") == "AddedToken" and "content" in obj:
            return obj["content"]
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def add_routes(app, state: GatewayState, renderer: Renderer) -> None:
    if not state.settings.render_only:
        app.add_route("/v1/chat/completions", ChatCompletions(state, renderer))
        app.add_route("/v1/completions", Completions(state, renderer))
    app.add_route("/v1/chat/completions/render", ChatRender(state, renderer))
    app.add_route("/v1/completions/render", CompletionRender(state, renderer))
    app.add_route("/v1/chat/completions/derender", ChatDerender(state, renderer))
    app.add_route("/v1/completions/derender", CompletionDerender(state, renderer))
    app.add_route("/tokenize", Tokenize(state, renderer))
    app.add_route("/detokenize", Detokenize(state, renderer))
    if state.settings.enable_tokenizer_info_endpoint:
        app.add_route("/tokenizer_info", TokenizerInfo(state, renderer))
