"""Tools, documents and chat_template_kwargs as vLLM 0.32 hands them to the template.

Tools: vLLM validates each against its pydantic ``ChatCompletionToolsParam`` and
passes ``model_dump()``, so every function carries ``name``, ``description`` and
``parameters`` in that order (``null`` when absent; ``strict``/``defer_loading`` only
when set) and unknown fields are gone.  Templates that ``tojson`` a tool therefore
print ``"description": null``; the same dicts are built here.

chat_template_kwargs: vLLM merges, lowest first, ``tools`` < the request's
chat_template_kwargs (None and "auto" values dropped) < ``add_generation_prompt``,
``continue_final_message`` and a non-null ``documents`` from the request; then keeps
only names the template reads or that ``apply_chat_template`` itself takes.
"""
from __future__ import annotations

from typing import Any, Optional

from gateway.chat.errors import ChatTemplateError

_TOOL_SHAPE = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'

# transformers' apply_chat_template parameters (vLLM accepts them from
# chat_template_kwargs whatever the template reads).  Those that change tokenization
# or the return type act on tokens the caller produces, so they are not passed on.
HF_APPLY_PARAMS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
# Render arguments a kwarg cannot replace (transformers would fail with a TypeError).
_COLLIDING = ("messages", "conversation")

UNTRUSTED_TEMPLATE_MESSAGE = ("Chat template is passed with request, but --trust-request-chat-template "
                              "is not set. Refused request with untrusted chat template.")


def _optional(fn: dict, key: str, types: tuple, what: str, i: int):
    value = fn.get(key)
    if value is not None and not isinstance(value, types):
        raise ChatTemplateError(f"tools[{i}].function.{key} must be {what} or null", "tools")
    return value


def normalize_tools(tools: Any) -> Optional[list[dict]]:
    """The request's ``tools`` as vLLM's ``[tool.model_dump() for tool in request.tools]``."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatTemplateError(f"tools must be a list of {_TOOL_SHAPE} objects", "tools")
    if not tools:
        raise ChatTemplateError("`tools` must not be an empty array. "
                                "Either provide at least one tool or omit the field entirely.", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ChatTemplateError(f"tools[{i}] must be an object like {_TOOL_SHAPE}", "tools")
        if tool.get("type", "function") != "function":
            raise ChatTemplateError(f"tools[{i}].type must be 'function', got {tool.get('type')!r}", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ChatTemplateError(f"tools[{i}].function must be an object like {_TOOL_SHAPE}", "tools")
        name = fn.get("name")
        if not isinstance(name, str):
            raise ChatTemplateError(f"tools[{i}].function.name must be a string", "tools")
        dumped = {"name": name,
                  "description": _optional(fn, "description", (str,), "a string", i),
                  "parameters": _optional(fn, "parameters", (dict,), "an object", i)}
        strict = _optional(fn, "strict", (bool,), "a boolean", i)
        defer = _optional(fn, "defer_loading", (bool,), "a boolean", i)
        top_defer = tool.get("defer_loading")
        if top_defer is not None and not isinstance(top_defer, bool):
            raise ChatTemplateError(f"tools[{i}].defer_loading must be a boolean or null", "tools")
        if defer is None:
            defer = top_defer  # vLLM propagates the tool-level flag into the function
        if strict is not None:
            dumped["strict"] = strict
        if defer is not None:
            dumped["defer_loading"] = defer
        entry = {"type": "function", "function": dumped}
        if top_defer is not None:
            entry["defer_loading"] = top_defer
        out.append(entry)
    return out


def check_documents(documents: Any, param: str = "documents") -> Optional[list]:
    """vLLM types ``documents`` as ``list[dict[str, str]]``."""
    if documents is None:
        return None
    if not isinstance(documents, list) or not all(
            isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())
            for d in documents):
        raise ChatTemplateError("documents must be a list of objects with string values "
                                "(e.g. 'title' and 'text')", param)
    return documents


def merge_kwargs(chat_template_kwargs: Any, tools: Optional[list],
                 documents: Optional[list]) -> tuple[Optional[list], Optional[list], dict]:
    """(tools, documents, the remaining template kwargs) after vLLM's merge, before
    the filter by template variables.  add_generation_prompt and
    continue_final_message always come from the request, so a kwarg cannot set them."""
    if chat_template_kwargs is None:
        chat_template_kwargs = {}
    if not isinstance(chat_template_kwargs, dict):
        raise ChatTemplateError("chat_template_kwargs must be an object", "chat_template_kwargs")
    if chat_template_kwargs.get("chat_template") is not None:
        raise ChatTemplateError(UNTRUSTED_TEMPLATE_MESSAGE, "chat_template_kwargs")
    colliding = {k for k in _COLLIDING if k in chat_template_kwargs}
    if colliding:
        raise ChatTemplateError(f"Found unexpected chat template kwargs from request: {colliding}",
                                "chat_template_kwargs")
    # merge_kwargs(): None and "auto" mean "not set".
    user = {k: v for k, v in chat_template_kwargs.items() if v is not None and v != "auto"}
    if user.get("tools") is not None:
        tools = user["tools"]
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ChatTemplateError("Tools should either be a JSON schema, or a callable function with type "
                                    "hints and a docstring suitable for auto-conversion to a schema.",
                                    "chat_template_kwargs")
    if documents is None and user.get("documents") is not None:
        documents = check_documents(user["documents"], "chat_template_kwargs")
    rest = {k: v for k, v in user.items() if k not in HF_APPLY_PARAMS}
    return tools, documents, rest
