"""``/v1/responses/render`` and ``/v1/messages/render``: an OpenAI Responses or an
Anthropic Messages request -> vLLM's ``GenerateRequest``, as vLLM 0.33's
``ServingRender.render_responses_request`` / ``render_messages_request`` do.

Both turn the request into chat messages and render them as a chat request:

- Responses (``construct_input_messages``): ``instructions`` -> a leading system
  message; ``input`` a string -> one user message, else its items in order: messages
  with a role as they are (``input_text`` parts are text), an assistant ``message``
  -> its first part's text, ``reasoning`` -> the assistant's ``reasoning``,
  ``function_call`` -> a tool call (merged into the assistant message before it),
  ``function_call_output`` -> a ``tool`` message; any other item is a 400.  Function
  ``tools`` (a namespace's flattened, a custom tool as a one-string function) -> chat tools.  ``previous_response_id`` is a 400 (the render
  route is stateless).  The GenerateRequest keeps the request's ``request_id``
  (``resp_<uuid>`` when unset).
- Messages (``AnthropicServingMessages.to_chat_completion_request``): ``system``
  (text blocks joined, Claude Code's billing header dropped) -> a leading system
  message, inline ``system`` messages merged into it when the template wants the
  system message first (Qwen's), ``text`` / ``image`` blocks -> content parts,
  ``thinking`` -> ``reasoning``, ``tool_use`` -> tool calls, a user's
  ``tool_result`` -> a ``tool`` message; ``tools`` -> chat tools with tool_choice
  ``auto``; ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``
  as chat's.  Then exactly the chat render (``chatcmpl-`` id).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Optional, Union

import msgspec
from msgspec import Meta
from typing_extensions import Annotated

from common.errors import BadRequest, ServingError
from gateway.openai_api.protocol import ChatCompletionRequest, Int64, JsonObject, StopParam
from gateway.openai_api.render import Renderer
from gateway.structured_outputs.openai_mapping import responses_structured_outputs


# ---------------------------------------------------------------- Responses
class ResponsesRequest(msgspec.Struct, kw_only=True):
    """vLLM's ResponsesRequest: the fields rendering reads (others are accepted and ignored)."""

    input: Union[str, list[Any]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    model: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    parallel_tool_calls: Optional[bool] = True
    previous_response_id: Optional[str] = None
    prompt: Optional[Any] = None
    reasoning: Optional[JsonObject] = None
    include_reasoning: bool = True
    include: Optional[list[str]] = None
    background: Optional[bool] = False
    store: Optional[bool] = True
    metadata: Optional[JsonObject] = None  # echoed in the Response
    user: Optional[str] = None
    stream: Optional[bool] = False
    temperature: Optional[float] = None
    text: Optional[JsonObject] = None
    tool_choice: Union[str, JsonObject] = "auto"
    tools: list[JsonObject] = msgspec.field(default_factory=list)
    top_logprobs: Optional[int] = 0
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    truncation: Optional[Literal["auto", "disabled"]] = "disabled"
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: Optional[Annotated[float, Meta(ge=-2.0, le=2.0)]] = None
    frequency_penalty: Optional[Annotated[float, Meta(ge=-2.0, le=2.0)]] = None
    request_id: Optional[str] = None
    priority: Int64 = 0
    cache_salt: Optional[Annotated[str, Meta(min_length=1, max_length=1024)]] = None
    # vLLM's: the Response also carries the exact prompt and output as text and token ids
    # (``input_messages`` / ``output_messages``, raw_message_tokens), what RL trainers keep
    enable_response_messages: bool = False
    repetition_penalty: Optional[float] = None
    seed: Optional[Int64] = None
    stop: StopParam = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    chat_template_kwargs: Optional[JsonObject] = None
    kv_transfer_params: Optional[JsonObject] = None
    ec_transfer_params: Optional[JsonObject] = None
    structured_outputs: Optional[JsonObject] = None  # vLLM's; exclusive with text.format
    # vLLM fields not served here: refused by name when set, as on chat.
    vllm_xargs: Optional[JsonObject] = None
    watermarking: Optional[bool] = None
    mm_processor_kwargs: Optional[JsonObject] = None
    media_io_kwargs: Optional[JsonObject] = None


responses_request_decoder = msgspec.json.Decoder(ResponsesRequest)


def _item_type(item: Any) -> Any:
    return item.get("type") if isinstance(item, dict) else None


def _assistant(prev: Optional[dict]) -> Optional[dict]:
    return prev if prev is not None and prev.get("role") == "assistant" else None


def _first_text(content: Any) -> Optional[str]:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        return content[0].get("text")
    return None


def _response_item_message(item: Any, prev: Optional[dict]) -> Optional[dict]:
    """vLLM's ``_construct_message_from_response_item``: a new message, or None when the
    item was merged into ``prev`` (the assistant message before it)."""
    if not isinstance(item, dict):
        raise BadRequest(f"Unsupported input item type: {type(item).__name__}", "input")
    kind = item.get("type")
    prev_assistant = _assistant(prev)
    if kind in ("function_call", "custom_tool_call"):
        for key in ("call_id", "name"):
            if not isinstance(item.get(key), str):
                raise BadRequest(f"input {kind} item needs a string `{key}`", "input")
        if kind == "function_call":
            name = item["name"]
            if item.get("namespace"):
                name = _flat_name(item["namespace"], name)
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise BadRequest("input function_call item needs a string `arguments`", "input")
        else:
            name, arguments = item["name"], json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
        call = {"id": item["call_id"], "function": {"name": name, "arguments": arguments}, "type": "function"}
        if prev_assistant is not None and isinstance(prev_assistant.get("tool_calls", []), list):
            prev_assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise BadRequest("Encrypted content is not supported.", "input")
        reasoning = ""
        content, summary = item.get("content"), item.get("summary") or []
        if isinstance(content, list) and content:
            reasoning = content[0].get("text", "") if isinstance(content[0], dict) else ""
        elif isinstance(summary, list) and summary:
            reasoning = summary[0].get("text", "") if isinstance(summary[0], dict) else ""
        if prev_assistant is not None and prev_assistant.get("reasoning") is None:
            prev_assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        text = _first_text(item.get("content"))
        if text is not None:
            if prev_assistant is not None and prev_assistant.get("content") is None:
                prev_assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if "role" in item:
        return item
    raise BadRequest(f"Unsupported input item type: {kind}", "input")


def _items_messages(items: list) -> list[dict]:
    converted: list[dict] = []
    for item in items:
        message = _response_item_message(item, converted[-1] if converted else None)
        if message is not None:
            converted.append(message)
    return converted


def previous_messages(messages: list[dict], output: list) -> list[dict]:
    """The conversation a stored response leaves for ``previous_response_id``: the
    messages it answered but their system ones (instructions do not carry over, as
    vLLM's ``construct_input_messages``), then its output items.  vLLM replays only the
    output's ``message`` items; here reasoning and ``function_call`` items are replayed
    too, through the same item conversion as ``input`` -- otherwise the next turn's
    ``function_call_output`` answers a call the prompt never shows."""
    return [m for m in messages if m.get("role") != "system"] + _items_messages(output)


def responses_messages(request: ResponsesRequest, history: Optional[list[dict]] = None) -> list[dict]:
    """vLLM's ``construct_input_messages``: instructions, the previous response's
    conversation (``history``, from :func:`previous_messages`), the input."""
    messages: list[dict] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    messages.extend(history or ())
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        return messages
    return messages + _items_messages(request.input)


def _continue_final(request_input: Any) -> bool:
    """vLLM's ``should_continue_final_message``: the last item a partial assistant
    message (or reasoning) -> continue it instead of opening a new turn."""
    if not isinstance(request_input, list) or not request_input:
        return False
    last = request_input[-1]
    if not isinstance(last, dict):
        return False
    if last.get("type", "message") not in ("message", "reasoning"):
        return False
    return last.get("status") in ("in_progress", "incomplete")


def _flat_name(namespace: str, name: Any) -> str:
    """vLLM's ``flat_namespace_tool_name``."""
    return f"{namespace}__{name}"


# The single-string function a ``custom`` tool is shown as (vLLM's custom_tool_parameters).
_CUSTOM_TOOL_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The freeform text payload for this tool."}},
    "required": ["input"], "additionalProperties": False,
}


def _chat_tool(name: Any, description: Any, parameters: Any, strict: Any, defer_loading: Any = None) -> dict:
    """``ChatCompletionToolsParam.model_dump()``: description and parameters always,
    strict and defer_loading only when set."""
    function = {"name": name, "description": description, "parameters": parameters}
    if strict is not None:
        function["strict"] = strict
    if defer_loading is not None:
        function["defer_loading"] = defer_loading
    return {"type": "function", "function": function}


def _function_tool(tool: dict, name: Any) -> dict:
    if not isinstance(name, str):
        raise BadRequest("a function tool needs a string `name`", "tools")
    return _chat_tool(name, tool.get("description"), tool.get("parameters"), tool.get("strict"),
                      tool.get("defer_loading"))


def responses_tools(tools: list) -> Optional[list[dict]]:
    """vLLM's ``construct_tool_dicts`` (``get_function_tools``): function tools, a
    namespace's functions named ``namespace__name``, a custom tool as a function of one
    string ``input``, as chat tools in request order; other tool types are not rendered."""
    out: list[dict] = []
    for tool in tools:
        kind = tool.get("type")
        if kind == "function":
            out.append(_function_tool(tool, tool.get("name")))
        elif kind == "namespace":
            for inner in tool.get("tools") or []:
                if isinstance(inner, dict) and inner.get("type") == "function":
                    out.append(_function_tool(inner, _flat_name(tool.get("name"), inner.get("name"))))
        elif kind == "custom":
            if not isinstance(tool.get("name"), str):
                raise BadRequest("a custom tool needs a string `name`", "tools")
            out.append(_chat_tool(tool["name"], tool.get("description"), _CUSTOM_TOOL_PARAMETERS, None))
    return out or None


def _chat_tool_choice(tool_choice: Union[str, JsonObject], tools: Optional[list], auto_tools: bool):
    """A Responses tool_choice as the chat render reads it: ``"required"`` and a function
    (``{"type": "function", "name": ...}``) force calls through structured outputs (vLLM's
    adjust_request); ``"auto"`` needs the server's tool parser; anything else renders the
    tools without parsing calls."""
    if not tools:
        return None
    if tool_choice == "required":
        return "required"
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        if not isinstance(tool_choice.get("name"), str):
            raise BadRequest("tool_choice of type 'function' needs a string `name`", "tool_choice")
        if not any(isinstance(t.get("function"), dict) and t["function"].get("name") == tool_choice["name"]
                   for t in tools):
            raise BadRequest(f"Tool '{tool_choice['name']}' has not been passed in `tools`.", "tool_choice")
        return {"type": "function", "function": {"name": tool_choice["name"]}}
    return "auto" if auto_tools and tool_choice == "auto" else None


def responses_chat_request(request: ResponsesRequest, *, auto_tools: bool = False,
                           history: Optional[list[dict]] = None) -> ChatCompletionRequest:
    """``auto_tools``: the server parses tool calls (--enable-auto-tool-choice with a
    --tool-call-parser), so tool_choice ``auto`` reaches the chat render, whose parser
    keeps its markers (vLLM's ``adjust_request``); without it the tools are still
    rendered (vLLM's Responses render does not ask for the flag).  ``history``: the
    stored conversation ``previous_response_id`` names (the generating route looks it
    up; the render route has none)."""
    if request.previous_response_id is not None and history is None:
        # vLLM's render_responses_request types this one "invalid_request_error" (the Responses
        # API's own type); its other 400s here are validation errors, "BadRequestError".
        raise ServingError("previous_response_id is not supported by the stateless render endpoint.",
                           "previous_response_id", status=400, type="invalid_request_error")
    if request.prompt is not None:
        raise BadRequest("prompt template is not supported", "prompt")
    if request.background and request.store is False:
        raise BadRequest("background can only be used when `store` is true", "background")
    if isinstance(request.input, list) and not request.input:
        raise BadRequest("input must be a string or a non-empty list of items", "input")
    structured_outputs = responses_structured_outputs(request.text, request.structured_outputs)
    tool_choice = request.tool_choice
    continue_final = _continue_final(request.input)
    effort = request.reasoning.get("effort") if isinstance(request.reasoning, dict) else None
    logprobs = bool(request.include and "message.output_text.logprobs" in request.include)
    tools = responses_tools(request.tools)
    return ChatCompletionRequest(
        messages=responses_messages(request, history), model=request.model, tools=tools,
        tool_choice=_chat_tool_choice(tool_choice, tools, auto_tools),
        parallel_tool_calls=request.parallel_tool_calls, include_reasoning=request.include_reasoning,
        reasoning_effort=effort, add_generation_prompt=not continue_final, continue_final_message=continue_final,
        chat_template_kwargs=request.chat_template_kwargs, max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, min_p=request.min_p,
        repetition_penalty=request.repetition_penalty, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, seed=request.seed, stop=request.stop,
        stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos, logit_bias=request.logit_bias,
        skip_special_tokens=True if request.skip_special_tokens is None else request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output, logprobs=logprobs,
        top_logprobs=request.top_logprobs if logprobs else 0, stream=request.stream,
        truncate_prompt_tokens=-1 if request.truncation not in (None, "disabled") else None,
        cache_salt=request.cache_salt, priority=request.priority, kv_transfer_params=request.kv_transfer_params,
        ec_transfer_params=request.ec_transfer_params, vllm_xargs=request.vllm_xargs,
        structured_outputs=structured_outputs, watermarking=request.watermarking,
        mm_processor_kwargs=request.mm_processor_kwargs, media_io_kwargs=request.media_io_kwargs)


def responses_generate(request: ResponsesRequest, generate: dict) -> dict:
    """The chat render's GenerateRequest as vLLM's ``render_responses_request`` builds it:
    the request's own request_id, no reasoning_ended, stream_options, token offsets."""
    generate["request_id"] = request.request_id or f"resp_{uuid.uuid4().hex}"
    generate["reasoning_ended"] = None
    generate["stream_options"] = None
    generate["return_token_ids"] = None
    generate["token_offsets"] = None
    if "parse_context" in generate:
        generate["parse_context"] = None
    return generate


# ---------------------------------------------------------------- Anthropic Messages
BlockType = Literal["text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking",
                    "tool_addition", "tool_removal"]


class AnthropicContentBlock(msgspec.Struct, kw_only=True):
    type: BlockType
    text: Optional[str] = None
    source: Optional[JsonObject] = None
    id: Optional[str] = None
    tool_use_id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[JsonObject] = None
    content: Union[str, list[JsonObject], None] = None
    is_error: Optional[bool] = None
    tool_name: Optional[str] = None
    thinking: Optional[str] = None
    signature: Optional[str] = None
    data: Optional[str] = None
    tool: Optional[JsonObject] = None


class AnthropicMessage(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[AnthropicContentBlock]]


class AnthropicTool(msgspec.Struct, kw_only=True):
    name: str
    input_schema: JsonObject
    description: Optional[str] = None
    strict: Optional[bool] = None
    defer_loading: Optional[bool] = None


class AnthropicToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class AnthropicThinking(msgspec.Struct, kw_only=True):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None
    display: Optional[str] = None


class AnthropicOutputConfig(msgspec.Struct, kw_only=True):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None
    format: Optional[JsonObject] = None


class MessagesRequest(msgspec.Struct, kw_only=True):
    """vLLM's AnthropicMessagesRequest (model, messages and max_tokens required)."""

    model: str
    messages: list[AnthropicMessage]
    max_tokens: int
    metadata: Optional[JsonObject] = None
    output_config: Optional[AnthropicOutputConfig] = None
    thinking: Optional[AnthropicThinking] = None
    stop_sequences: Optional[list[str]] = None
    stream: Optional[bool] = False
    system: Union[str, list[AnthropicContentBlock], None] = None
    temperature: Optional[float] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    tools: Optional[list[AnthropicTool]] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    cache_salt: Optional[Annotated[str, Meta(min_length=1, max_length=1024)]] = None
    kv_transfer_params: Optional[JsonObject] = None
    ec_transfer_params: Optional[JsonObject] = None
    chat_template_kwargs: Optional[JsonObject] = None
    vllm_xargs: Optional[JsonObject] = None
    watermarking: Optional[bool] = None


messages_request_decoder = msgspec.json.Decoder(MessagesRequest)

_BILLING = "x-anthropic-billing-header"


def _check_messages_request(request: MessagesRequest) -> None:
    """vLLM's pydantic validators on the Anthropic request."""
    for i, msg in enumerate(request.messages):
        if msg.role != "system" and not isinstance(msg.content, str):
            for block in msg.content:
                if block.type in ("tool_addition", "tool_removal"):
                    raise BadRequest(f'{block.type} blocks are only allowed in messages with role "system"',
                                     f"messages.{i}.content")
        if msg.role == "system" and not isinstance(msg.content, str):
            if any(b.type in ("tool_addition", "tool_removal") for b in msg.content):
                # Tool changes re-resolve the declared tools (vLLM's _resolve_tools): not served here.
                raise BadRequest("tool_addition and tool_removal blocks are not supported by this server.",
                                 f"messages.{i}.content")
    choice = request.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise BadRequest("tool_choice.name is required when type is 'tool'", "tool_choice")
    thinking = request.thinking
    if thinking is not None and thinking.type == "enabled":
        if thinking.budget_tokens is None or thinking.budget_tokens < 1024:
            raise BadRequest("thinking.budget_tokens must be an integer of at least 1024", "thinking.budget_tokens")


def _image_url(source: dict) -> str:
    """``_convert_image_source_to_url``: a url source as it is, else a base64 data URI."""
    if source.get("type") == "url":
        return source.get("url", "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _system_text(msg: AnthropicMessage) -> Optional[str]:
    if isinstance(msg.content, str):
        return None if msg.content.startswith(_BILLING) else msg.content
    parts = [b.text for b in msg.content if b.type == "text" and b.text and not b.text.startswith(_BILLING)]
    return "".join(parts) if parts else None


def _tool_result_messages(block: AnthropicContentBlock, out: list[dict]) -> None:
    """``_convert_user_tool_result``: a tool message (text parts joined by newlines),
    then a user message with its images, then its tool references."""
    text, images, references = "", [], []
    if isinstance(block.content, str):
        text = block.content
    elif isinstance(block.content, list):
        texts = []
        for item in block.content:
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image":
                url = _image_url(item.get("source", {}))
                if url:
                    images.append(url)
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    out.append({"role": "tool", "tool_call_id": block.tool_use_id or "", "content": text or ""})
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    if references:
        out.append({"role": "tool", "tool_call_id": block.tool_use_id or "", "content": references})


def anthropic_messages(request: MessagesRequest, merge_inline_system: bool) -> list[dict]:
    """``_convert_system_message`` + ``_convert_messages``."""
    out: list[dict] = []
    system: list[str] = []
    if request.system:
        if isinstance(request.system, str):
            system.append(request.system)
        else:
            system.extend(b.text for b in request.system
                          if b.type == "text" and b.text and not b.text.startswith(_BILLING))
    if merge_inline_system:
        system.extend(t for t in (_system_text(m) for m in request.messages if m.role == "system") if t)
    if system:
        out.append({"role": "system", "content": "".join(system)})
    for msg in request.messages:
        if msg.role == "system":
            if not merge_inline_system:
                text = _system_text(msg)
                if text:
                    out.append({"role": "system", "content": text})
            continue
        message: dict[str, Any] = {"role": msg.role}
        if isinstance(msg.content, str):
            message["content"] = msg.content
        else:
            parts: list[dict] = []
            tool_calls: list[dict] = []
            reasoning: list[str] = []
            for block in msg.content:
                if block.type == "text" and block.text:
                    parts.append({"type": "text", "text": block.text})
                elif block.type == "image" and block.source:
                    parts.append({"type": "image_url", "image_url": {"url": _image_url(block.source)}})
                elif block.type == "thinking" and block.thinking is not None:
                    reasoning.append(block.thinking)
                elif block.type == "tool_use":
                    tool_calls.append({"id": block.id or f"call_{int(time.time())}", "type": "function",
                                       "function": {"name": block.name or "",
                                                    "arguments": json.dumps(block.input or {})}})
                elif block.type == "tool_result":
                    if msg.role == "user":
                        _tool_result_messages(block, out)
                    else:
                        parts.append({"type": "text",
                                      "text": f"Tool result: {str(block.content) if block.content else ''}"})
            if reasoning:
                message["reasoning"] = "".join(reasoning)
            if tool_calls:
                message["tool_calls"] = tool_calls
            if parts:
                message["content"] = (parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text"
                                      else parts)
        if not (msg.role == "user" and "content" not in message):
            out.append(message)
    return out


def messages_chat_request(request: MessagesRequest, *, merge_inline_system: bool,
                          disabled_thinking_effort: str = "none") -> ChatCompletionRequest:
    """``AnthropicServingMessages.to_chat_completion_request``."""
    _check_messages_request(request)
    chat = ChatCompletionRequest(
        messages=anthropic_messages(request, merge_inline_system), model=request.model,
        max_tokens=request.max_tokens, max_completion_tokens=request.max_tokens, stop=request.stop_sequences,
        temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
        watermarking=request.watermarking, cache_salt=request.cache_salt,
        kv_transfer_params=request.kv_transfer_params, ec_transfer_params=request.ec_transfer_params,
        vllm_xargs=request.vllm_xargs, chat_template_kwargs=request.chat_template_kwargs)
    if request.stream:
        from gateway.generate_api.protocol import StreamOptions

        chat.stream = True
        chat.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)
    config = request.output_config
    if config is not None and config.format and config.format.get("schema") is not None:
        chat.response_format = {"type": config.format.get("type", "json_schema"),
                                "json_schema": {"schema": config.format["schema"],
                                                "name": config.format.get("type", "json_schema")}}
    if config is not None and config.effort is not None:
        chat.reasoning_effort = config.effort
    if request.thinking is not None:
        if request.thinking.type == "disabled":
            chat.reasoning_effort = disabled_thinking_effort
        elif request.thinking.type == "enabled":
            chat.thinking_token_budget = request.thinking.budget_tokens
    choice = request.tool_choice
    if choice is not None:
        chat.parallel_tool_calls = not choice.disable_parallel_tool_use
        chat.tool_choice = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
            "type": "function", "function": {"name": choice.name}}
    if request.tools is not None:
        chat.tools = [_chat_tool(t.name, t.description,
                                 t.input_schema if "type" in t.input_schema else {**t.input_schema, "type": "object"},
                                 t.strict, t.defer_loading) for t in request.tools]
        if chat.tool_choice is None:
            chat.tool_choice = "auto"
    return chat


class MessagesRenderer:
    """What the Messages render learns once from the chat template: whether inline system
    messages must merge into the leading one (``_should_merge_inline_system``) and the
    reasoning effort ``thinking: disabled`` maps to (``DisabledThinkingEffortResolver``)."""

    def __init__(self, renderer: Renderer):
        self.renderer = renderer
        self._merge: Optional[bool] = None
        self._disabled_effort: Optional[str] = None

    def merge_inline_system(self) -> bool:
        if self._merge is None:
            probe = [{"role": "system", "content": "t"}, {"role": "user", "content": "t"},
                     {"role": "system", "content": "t"}, {"role": "user", "content": "t"}]
            template = self.renderer.model.chat_template
            merge = template is None
            if template is not None:
                for tools in (None, []):
                    try:
                        self.renderer.render_messages(probe, tools=tools, add_generation_prompt=False)
                    except BadRequest:
                        merge = True
            self._merge = merge
        return self._merge

    def disabled_thinking_effort(self, request: MessagesRequest) -> str:
        if request.thinking is None or request.thinking.type != "disabled":
            return "none"
        if self._disabled_effort is None:
            none = self._probe("none")
            effort = "none"
            if none is None or any(self._probe(e) == none for e in ("low", "medium", "high", "xhigh", "max")):
                effort = "low"
            self._disabled_effort = effort
        return self._disabled_effort

    def _probe(self, effort: str) -> Optional[list[int]]:
        try:
            rendered = self.renderer.chat(ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}],
                                                                reasoning_effort=effort), 1 << 30, "probe")
        except BadRequest:
            return None
        return rendered.token_ids

    def chat_request(self, request: MessagesRequest) -> ChatCompletionRequest:
        """The chat request vLLM's ``render_messages_request`` renders (its probes render
        the template: on the render pool)."""
        return messages_chat_request(request, merge_inline_system=self.merge_inline_system(),
                                     disabled_thinking_effort=self.disabled_thinking_effort(request))
