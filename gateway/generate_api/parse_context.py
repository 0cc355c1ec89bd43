"""vLLM 0.33's ``parse_context`` of ``/inference/v1/generate`` (``output_mode: "derender"``).

``/v1/chat/completions/render`` puts it in the GenerateRequest it returns (:func:`from_chat`):
the chat request's tools, ``tool_choice``, ``parallel_tool_calls``, ``include_reasoning``,
the effective ``chat_template_kwargs`` (server defaults applied) and the count of tool calls
already in the conversation.  ``/generate`` reads it only with ``output_mode="derender"``,
to parse the output text into the assistant message with the same parsers as
``/v1/chat/completions`` (gateway/openai_api/chat_output.py, gateway/parsers; the parsing is set up by
gateway/openai_api/generate_derender.py, which builds vLLM's ``to_chat_request`` from it).

As vLLM's ``ParseContext`` (``extra="allow"``): its known fields are type-checked at every
``output_mode``; fields a newer ``/render`` added are kept, refused only in derender mode
(where they would be read) and ignored otherwise, so a rendered request can be sent to a
prefill leg unchanged.
"""
from __future__ import annotations

import logging
from typing import Any, Literal, Optional, Union

import msgspec
from typing_extensions import Annotated

from common.errors import BadRequest

JsonObject = dict[str, Any]
log = logging.getLogger("tokserve.gateway")
_warned: set[tuple[tuple[str, ...], str]] = set()  # vLLM's warning_once


class ToolFunction(msgspec.Struct):
    """vLLM's ``FunctionDefinition``."""

    name: str
    description: Optional[str] = None
    parameters: Optional[JsonObject] = None
    strict: Optional[bool] = None
    defer_loading: Optional[bool] = None


class Tool(msgspec.Struct):
    """vLLM's ``ChatCompletionToolsParam``."""

    function: ToolFunction
    type: Literal["function"] = "function"
    defer_loading: Optional[bool] = None


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    """vLLM's ``ChatCompletionNamedToolChoiceParam``."""

    function: NamedFunction
    type: Literal["function"] = "function"


class ParseContext(msgspec.Struct):
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = "none"
    parallel_tool_calls: Optional[bool] = True
    include_reasoning: bool = True
    chat_template_kwargs: JsonObject = msgspec.field(default_factory=dict)
    history_tool_call_cnt: Annotated[int, msgspec.Meta(ge=0)] = 0


FIELDS = frozenset(ParseContext.__struct_fields__)


def read(raw: Optional[JsonObject], output_mode: str) -> Optional[ParseContext]:
    """The request's ``parse_context`` type-checked (400 naming the field otherwise, at
    every output_mode as vLLM's model validates it); unknown fields are a 400 in derender
    mode only.  None when absent."""
    if raw is None:
        return None
    try:
        ctx = msgspec.convert(raw, ParseContext)
    except msgspec.ValidationError as exc:
        message = str(exc).replace(" - at `$", " - at `$.parse_context")
        if " - at `$." not in message:
            message += " - at `$.parse_context`"
        param = message.rsplit(" - at `$.", 1)[1].rstrip("`")
        raise BadRequest(message, param) from None
    unknown = sorted(k for k in raw if k not in FIELDS)
    if unknown and output_mode == "derender":
        message = f"Unknown parse_context fields {unknown}; the render server is newer than this generate server"
        if len(message) > 1000:  # vLLM's validation handler bounds each error at 1000 characters
            message = message[:1000] + "...[truncated]"
        raise BadRequest(message, "parse_context")
    names = tuple(repr(k[:64]) for k in unknown[:8])  # client-chosen: bounded in the log
    if names and len(_warned) < 64 and (names, output_mode) not in _warned:
        _warned.add((names, output_mode))
        log.warning("Ignoring unknown parse_context fields %s at output_mode=%r", ", ".join(names), output_mode)
    return ctx


def check_tool_choice(ctx: ParseContext) -> None:
    """vLLM's ``ParseContext.to_chat_request`` check (a named tool must be among the tools;
    "required" and named output is parsed as the forced tool-call JSON)."""
    choice = ctx.tool_choice
    if isinstance(choice, NamedToolChoice):
        if not any(tool.function.name == choice.function.name for tool in ctx.tools or ()):
            raise BadRequest("The tool specified in `tool_choice` does not match any of the specified `tools`",
                             "tool_choice")


# ---------------------------------------------------------------- render side
def _tool_json(tool: Any) -> Any:
    """A request tool as vLLM dumps ``ChatCompletionToolsParam``: its model fields only,
    ``strict`` / ``defer_loading`` left out when unset (tool-level defer_loading copied
    into the function, as vLLM's validator does)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        return tool
    fn = tool["function"]
    function = {"name": fn.get("name"), "description": fn.get("description"), "parameters": fn.get("parameters")}
    if fn.get("strict") is not None:
        function["strict"] = fn["strict"]
    defer = fn.get("defer_loading")
    if defer is None:
        defer = tool.get("defer_loading")
    if defer is not None:
        function["defer_loading"] = defer
    out = {"type": tool.get("type", "function"), "function": function}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def _count_tool_calls(tool_calls: Any) -> int:
    if tool_calls is None:
        return 0
    if isinstance(tool_calls, (str, bytes, dict)):
        return 1
    if isinstance(tool_calls, (list, tuple)):
        return len(tool_calls)
    return 1


def history_tool_call_count(messages: Any) -> int:
    """Tool calls of the conversation's assistant messages (vLLM's count_chat_history_tool_calls)."""
    return sum(_count_tool_calls(m.get("tool_calls")) for m in messages or ()
               if isinstance(m, dict) and m.get("role") == "assistant")


def from_chat(request, chat_template_kwargs: dict) -> dict:
    """``parse_context`` of a rendered chat request, as vLLM's ``_build_parse_context``
    dumps it (``request`` already through the chat checks: tool_choice "auto" when tools
    came without one)."""
    tool_choice = request.tool_choice
    if tool_choice is None and not request.tools:
        tool_choice = "none"  # vLLM's default when the request sets none
    return {
        "tools": [_tool_json(t) for t in request.tools] if request.tools is not None else None,
        "tool_choice": tool_choice,
        "parallel_tool_calls": request.parallel_tool_calls,
        "include_reasoning": request.include_reasoning,
        "chat_template_kwargs": dict(chat_template_kwargs),
        "history_tool_call_cnt": history_tool_call_count(request.messages),
    }
