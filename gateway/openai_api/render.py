"""OpenAI request -> vLLM ``GenerateRequest`` JSON (``/v1/*/render``, and the facade's first step).

Mirrors vLLM 0.32's ``ServingRender``: the chat template rendered and tokenized (chat
prompts with ``add_special_tokens=False``, completion prompts with True, as vLLM), the
prompt checked against the context length, ``max_tokens`` resolved as ``get_max_tokens``
does, and the sampling parameters as ``to_sampling_params`` builds them.
"""
from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional, Union

from common.errors import BadRequest
from gateway.chat.jinja_env import RenderLimits
from gateway.chat.template import ChatTemplate, ChatTemplateError
from gateway.generate_api import parse_context as parse_ctx
from gateway.generate_api.protocol import (HttpGenerateRequest, HttpSamplingParams, ReasoningParserKwargs,
                                           StreamOptions)
from gateway.multimodal import expand_image_placeholders
from gateway.openai_api import sampling
from gateway.openai_api.chat_output import ChatParsing
from gateway.openai_api.model_files import TextModel
from gateway.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from gateway.parsers import OutputParser
from gateway.structured_outputs import openai_mapping as so_mapping
from gateway.structured_outputs.tool_schema import forced_tool_choice


MAX_REQUEST_TEMPLATE_CHARS = 128 * 1024


@dataclass(frozen=True)
class RenderOptions:
    """Server flags that shape rendering (vLLM's names)."""

    reasoning_parser: Optional[str] = None
    tool_call_parser: Optional[str] = None
    enable_auto_tool_choice: bool = False
    trust_request_chat_template: bool = False
    default_chat_template_kwargs: dict = field(default_factory=dict)
    # --max-prompt-chars: the longest prompt text tokenized (each /tokenize or completion
    # prompt, all of a completion request's prompts together, a rendered chat), and the
    # most a chat template may build; refused before the tokenizer sees it.
    max_prompt_chars: int = 8 * 1024 * 1024
    chat_template_timeout_s: float = 5.0  # --chat-template-timeout


@dataclass
class RenderedPrompt:
    # The one typed request of a chat / completion (and of the Responses and Messages
    # requests, mapped onto chat): built here once, with max_tokens decided
    # (sampling.max_tokens_for), and consumed as is by the generate path
    # (facade.map_rendered).  ``generate`` is its vLLM JSON, for the render routes.
    request: HttpGenerateRequest
    prompt_text: Optional[str]
    token_ids: list[int]

    @property
    def generate(self) -> dict:
        """vLLM's GenerateRequest, as JSON (what /render answers)."""
        return generate_json(self.request)


@dataclass
class RenderedChat(RenderedPrompt):
    parsing: ChatParsing = field(default_factory=ChatParsing)
    last_message_text: str = ""  # echo: the content of a final assistant message
    images: Optional[list] = None  # the messages' images, resized ((uint8 [H, W, 3], grid)), in prompt order


def base_request_id(header_id: Optional[str], body_id: Optional[str]) -> str:
    return header_id or body_id or uuid.uuid4().hex


def _generate_request(request_id: str, token_ids: list[int], params: HttpSamplingParams,
                      request: Union[ChatCompletionRequest, CompletionRequest], *,
                      reasoning_ended: Optional[bool] = None, reasoning_kwargs: Optional[dict] = None,
                      parse_context: Optional[dict] = None) -> HttpGenerateRequest:
    """vLLM's GenerateRequest of a rendered prompt, typed."""
    stream_options = None
    if request.stream and request.stream_options is not None:
        stream_options = StreamOptions(include_usage=request.stream_options.include_usage,
                                       continuous_usage_stats=request.stream_options.continuous_usage_stats)
    return HttpGenerateRequest(
        request_id=request_id, token_ids=token_ids, sampling_params=params, model=request.model,
        reasoning_ended=reasoning_ended,
        reasoning_parser_kwargs=ReasoningParserKwargs(reasoning_kwargs) if reasoning_kwargs is not None else None,
        return_token_ids=None, output_mode="tokens", parse_context=parse_context, stream=bool(request.stream),
        stream_options=stream_options, cache_salt=request.cache_salt, priority=request.priority,
        kv_transfer_params=request.kv_transfer_params, ec_transfer_params=request.ec_transfer_params)


def generate_json(http: HttpGenerateRequest) -> dict:
    """vLLM GenerateRequest.model_dump(): every field, in its order."""
    opts, kwargs = http.stream_options, http.reasoning_parser_kwargs
    return {
        "request_id": http.request_id, "token_ids": http.token_ids, "token_offsets": http.token_offsets,
        "features": http.features, "content_parts": http.content_parts,
        "sampling_params": sampling.sampling_params_json(http.sampling_params), "model": http.model,
        "reasoning_ended": http.reasoning_ended,
        "reasoning_parser_kwargs": {"chat_template_kwargs": kwargs.chat_template_kwargs} if kwargs else None,
        "return_token_ids": http.return_token_ids, "output_mode": http.output_mode,
        "parse_context": http.parse_context, "stream": http.stream,
        "stream_options": {"include_usage": opts.include_usage, "continuous_usage_stats": opts.continuous_usage_stats}
        if opts is not None else None,
        "cache_salt": http.cache_salt, "priority": http.priority,
        "kv_transfer_params": http.kv_transfer_params, "ec_transfer_params": http.ec_transfer_params,
    }


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _truncate(ids: list, truncate_prompt_tokens: Optional[int], side: Optional[str],
              max_model_len: int) -> list:
    """Also applied to the token offsets, which run parallel to the ids (vLLM's
    ``_PARALLEL_TO_PROMPT_TOKENS``)."""
    if truncate_prompt_tokens is None:
        return ids
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[len(ids) - keep:]


def _encode(tokenizer, text: str, add_special_tokens: bool, offsets: bool) -> tuple[list[int], Optional[list]]:
    """The ids, and with ``offsets`` (``return_token_offsets``) each token's [start, end)
    in ``text``: the fast tokenizer's offset_mapping, as vLLM's ``_tokenize_prompt``."""
    if offsets:
        return tokenizer.encode_with_offsets(text, add_special_tokens=add_special_tokens)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens), None


class Renderer:
    def __init__(self, model: TextModel, options: RenderOptions = RenderOptions()):
        self.model = model
        self.options = options
        self.limits = RenderLimits(timeout_s=options.chat_template_timeout_s, max_chars=options.max_prompt_chars)
        tok = model.tokenizer
        specials = [t for t in tok.convert_ids_to_tokens(tok.all_special_ids) if t]
        self.parser = (OutputParser(options.reasoning_parser, options.tool_call_parser, special_tokens=specials)
                       if options.reasoning_parser or options.tool_call_parser else None)

    def check_prompt_chars(self, chars: int, param: Optional[str] = "prompt") -> None:
        """Tokenizing costs time and memory in proportion to the text (a 20 MB prompt took
        seconds and gigabytes): refuse text over --max-prompt-chars before it starts."""
        limit = self.options.max_prompt_chars
        if chars > limit:
            raise BadRequest(f"The prompt has {chars} characters, more than the limit of {limit} "
                             f"(--max-prompt-chars).", param)

    def check_text_fits(self, text: str, max_model_len: int, truncate_prompt_tokens: Optional[int]) -> None:
        """vLLM's ``_text_len_check``: a text longer than max_model_len x the longest
        vocabulary string cannot fit the context, and gets its 400 before it is tokenized
        (tokenizing 8 MB took tens of seconds and gigabytes, only to be refused).  A
        prompt to be truncated is tokenized as asked."""
        if truncate_prompt_tokens is not None:
            return
        max_chars = max_model_len * self.model.tokenizer.max_chars_per_token
        if len(text) > max_chars:
            raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                             f"contains {len(text)} characters (more than {max_chars} characters, which is the upper "
                             f"bound for {max_model_len} input tokens). Please reduce the length of the input prompt.",
                             "input_text")

    # ------------------------------------------------------------------ chat
    def chat_template_kwargs(self, request: ChatCompletionRequest) -> dict:
        kwargs = dict(self.options.default_chat_template_kwargs)
        if request.reasoning_effort is not None and "enable_thinking" not in (request.chat_template_kwargs or {}):
            kwargs["enable_thinking"] = request.reasoning_effort != "none"
        kwargs.update(request.chat_template_kwargs or {})
        if request.reasoning_effort is not None:
            # vLLM's build_chat_params passes it over the request's kwargs; templates that read it
            # (GPT-OSS's "Reasoning: high", as vLLM's harmony prompt writes it) get it, others drop it.
            kwargs["reasoning_effort"] = request.reasoning_effort
        return kwargs

    def check_request_template(self, chat_template: Optional[str]) -> None:
        if chat_template is not None and not self.options.trust_request_chat_template:
            raise BadRequest("Chat template is passed with request, but --trust-request-chat-template is not set. "
                             "Refused request with untrusted chat template.", "chat_template")
        # Compiling a template costs time in proportion to its size, outside the render's
        # step budget (a 400 KB one took ~3 s); real templates are a few KB to ~20 KB.
        if isinstance(chat_template, str) and len(chat_template) > MAX_REQUEST_TEMPLATE_CHARS:
            raise BadRequest(f"The request's chat_template has {len(chat_template)} characters, more than the limit "
                             f"of {MAX_REQUEST_TEMPLATE_CHARS}.", "chat_template")

    def render_messages(self, messages, *, tools=None, documents=None, add_generation_prompt=True,
                        continue_final_message=False, chat_template_kwargs=None, chat_template=None,
                        image_urls: Optional[list] = None) -> str:
        template = self.model.chat_template
        if chat_template is not None:
            template = ChatTemplate(chat_template, template.special_tokens if template else {})
        if template is None:
            raise BadRequest("As of transformers v4.44, default chat template is no longer allowed, so you must "
                             "provide a chat template if the tokenizer does not define one.")
        try:
            return template.render(messages, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message,
                                   chat_template_kwargs=chat_template_kwargs, images=image_urls,
                                   limits=self.limits)
        except ChatTemplateError as exc:
            raise BadRequest(str(exc)) from None

    def expand_images(self, ids: list[int], image_urls: Optional[list], images: Optional[list]) -> list[int]:
        """The rendered prompt's ids with each image's single placeholder expanded to its
        tokens (vLLM's processed prompt_token_ids); ``image_urls``: the content parts
        render_messages collected, ``images``: load_chat_images' result for the same messages."""
        if not image_urls:
            return ids
        if images is None or len(images) != len(image_urls):
            raise BadRequest(f"the messages hold {len(image_urls)} image(s) that were not loaded", "messages")
        return expand_image_placeholders(ids, self.model.image, images)

    def chat(self, request: ChatCompletionRequest, max_model_len: int, base_id: str,
             images: Optional[list] = None,
             hold: Callable[[int], ContextManager] = lambda weight: contextlib.nullcontext()) -> RenderedChat:
        """``images``: the messages' images loaded and resized (``load_chat_images``),
        for a model that takes images.  ``hold(chars)``: held while the rendered prompt
        is tokenized (the render pool's ``RenderPool.hold``: the memory-heavy step)."""
        sampling.refuse_unserved(request)
        sampling.check_chat(request)
        tool_choice = request.tool_choice
        # response_format / structured_outputs / a forced tool choice (which clears response_format)
        structured = so_mapping.chat_structured_outputs(request)
        forced = forced_tool_choice(request.tools, request.tool_choice)
        tools_enabled = bool(request.tools) and tool_choice == "auto"
        if tools_enabled and not (self.options.enable_auto_tool_choice and self.options.tool_call_parser):
            raise BadRequest('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                             "tool_choice")
        self.check_request_template(request.chat_template)
        if not isinstance(request.messages, list) or not request.messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        kwargs = self.chat_template_kwargs(request)
        spec = self.model.image
        image_urls: Optional[list] = [] if spec is not None else None
        prompt = self.render_messages(request.messages, tools=request.tools, documents=request.documents,
                                      add_generation_prompt=request.add_generation_prompt,
                                      continue_final_message=request.continue_final_message,
                                      chat_template_kwargs=kwargs, chat_template=request.chat_template,
                                      image_urls=image_urls)
        self.check_text_fits(prompt, max_model_len, request.truncate_prompt_tokens)
        # Offsets only for a text prompt: vLLM gives none where the prompt holds images.
        with hold(len(prompt)):
            ids, offsets = _encode(self.model.tokenizer, prompt, request.add_special_tokens,
                                   bool(request.return_token_offsets) and not image_urls)
        ids = self.expand_images(ids, image_urls, images)
        ids = _truncate(ids, request.truncate_prompt_tokens, request.truncation_side, max_model_len)
        if offsets is not None:
            offsets = _truncate(offsets, request.truncate_prompt_tokens, request.truncation_side, max_model_len)
        if not ids:
            raise BadRequest("No token_ids rendered")
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        max_tokens = sampling.max_tokens_for(
            max_model_len, requested, len(ids), self.model.sampling_defaults, request.truncate_prompt_tokens,
            "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens")
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:
            prompt_logprobs = request.top_logprobs
        params = sampling.sampling_params(
            request, max_tokens, self.model.sampling_defaults,
            logprobs=request.top_logprobs if request.logprobs else None, prompt_logprobs=prompt_logprobs,
            structured_outputs=structured)
        if self.parser is not None and self.parser.keeps_special_tokens(tools_enabled=tools_enabled):
            params.skip_special_tokens = False  # the parser must see its markers (vLLM's adjust_request)
        parsing = ChatParsing(forced_tool_choice=forced[0], named_tool=forced[1],
                              parallel_tool_calls=request.parallel_tool_calls is not False)
        reasoning_ended = None if request.include_reasoning else True
        reasoning_kwargs = None
        if self.parser is not None:
            reasoning_open = self.parser.reasoning_open_at_start(prompt, kwargs)
            parsing = ChatParsing(self.parser, reasoning_open=reasoning_open, tools_enabled=tools_enabled,
                                  include_reasoning=request.include_reasoning,
                                  parallel_tool_calls=request.parallel_tool_calls is not False,
                                  forced_tool_choice=forced[0], named_tool=forced[1])
            if self.options.reasoning_parser:
                reasoning_kwargs = kwargs
                if request.include_reasoning:
                    reasoning_ended = not reasoning_open
        generate = _generate_request(f"chatcmpl-{base_id}", ids, params, request, reasoning_ended=reasoning_ended,
                                     reasoning_kwargs=reasoning_kwargs,
                                     parse_context=parse_ctx.from_chat(request, kwargs))
        generate.token_offsets = offsets
        if image_urls:
            generate.content_parts = image_urls
        last = request.messages[-1] if isinstance(request.messages[-1], dict) else {}
        last_text = ""
        if last.get("role") == "assistant":
            content = last.get("content") or ""
            last_text = content if isinstance(content, str) else "\n".join(
                p.get("text", "") for p in content if isinstance(p, dict))
        return RenderedChat(request=generate, prompt_text=prompt, token_ids=ids, parsing=parsing,
                            last_message_text=last_text, images=images if image_urls else None)

    # ------------------------------------------------------------------ completions
    def completion_prompts(self, request: CompletionRequest, max_model_len: Optional[int] = None
                           ) -> list[tuple[list[int], Optional[str], Optional[list]]]:
        """Each prompt's (token ids, text, token offsets); token prompts have no text until
        decoded, and no offsets (vLLM gives offsets, on ``return_token_offsets``, for text)."""
        prompt = request.prompt
        if prompt is None or prompt == []:
            raise BadRequest("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if isinstance(prompt, str):
            items: list = [prompt]
        elif all(_is_token(p) for p in prompt):
            items = [list(prompt)]
        else:
            items = list(prompt)
        self.check_prompt_chars(sum(len(item) for item in items if isinstance(item, str)))
        if max_model_len is not None:
            for item in items:
                if isinstance(item, str):
                    self.check_text_fits(item, max_model_len, request.truncate_prompt_tokens)
        out = []
        for item in items:
            if isinstance(item, str):
                ids, offsets = _encode(self.model.tokenizer, item, request.add_special_tokens,
                                       bool(request.return_token_offsets))
                out.append((ids, item, offsets))
            elif isinstance(item, list) and item and all(_is_token(t) for t in item):
                if any(t < 0 for t in item):
                    raise BadRequest("token_ids must not contain negative values", "prompt")
                out.append((list(item), None, None))
            else:
                raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of "
                                 "lists of token ids, none of them empty", "prompt")
        return out

    def completion(self, request: CompletionRequest, max_model_len: int, base_id: str) -> list[RenderedPrompt]:
        sampling.refuse_unserved(request)
        sampling.check_completion(request)
        structured = so_mapping.completion_structured_outputs(request)
        prompts = self.completion_prompts(request, max_model_len)
        rendered = []
        for i, (ids, text, offsets) in enumerate(prompts):
            ids = _truncate(ids, request.truncate_prompt_tokens, request.truncation_side, max_model_len)
            if offsets is not None:
                offsets = _truncate(offsets, request.truncate_prompt_tokens, request.truncation_side, max_model_len)
            if not ids:
                raise BadRequest("No token_ids rendered", "prompt")
            max_tokens = sampling.max_tokens_for(max_model_len, request.max_tokens, len(ids),
                                                 self.model.sampling_defaults, request.truncate_prompt_tokens)
            prompt_logprobs = request.prompt_logprobs
            if prompt_logprobs is None and request.echo:
                prompt_logprobs = request.logprobs
            params = sampling.sampling_params(request, max_tokens, self.model.sampling_defaults,
                                              logprobs=request.logprobs, prompt_logprobs=prompt_logprobs,
                                              structured_outputs=structured)
            request_id = f"cmpl-{base_id}" if len(prompts) == 1 else f"cmpl-{base_id}-{i}"
            generate = _generate_request(request_id, ids, params, request)
            generate.token_offsets = offsets
            rendered.append(RenderedPrompt(request=generate, prompt_text=text, token_ids=ids))
        return rendered
