"""The JSON schema a forced tool choice constrains the output to: vLLM 0.33's
``get_json_schema_from_tools`` (tool_parsers/utils.py), for chat tools
(``{"type": "function", "function": {"name", "parameters", ...}}``; Responses and Anthropic
tools reach it already converted to chat tools).

- a named tool: that tool's ``parameters`` (``{"type": "object", "properties": {}}`` when it
  has none), so the output is the arguments object itself;
- ``"required"``: an array of at least one ``{"name": <enum of one tool>, "parameters": ...}``
  object (``anyOf`` the tools), at most one with ``parallel_tool_calls: false``; the tools'
  ``$defs`` are hoisted to the top level (a name defined twice differently is refused).
"""
from __future__ import annotations

import copy
from typing import Any, Optional, Union

from common.errors import BadRequest


def _function(tool: Any) -> Optional[dict]:
    if isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(tool.get("function"), dict):
        return tool["function"]
    return None


def _params_or_empty_object(params: Optional[dict]) -> dict:
    return params if params else {"type": "object", "properties": {}}


def _function_tools(tools: list) -> list[dict]:
    functions = [f for f in (_function(t) for t in tools) if f is not None]
    if not functions:
        raise BadRequest("tool_choice requires a function call, but tools contains no function tool the model can "
                         "call.", "tool_choice")
    return functions


def _required_schema(tools: list, parallel_tool_calls: Optional[bool]) -> dict:
    functions = _function_tools(tools)
    all_defs: dict[str, Any] = {}
    schemas = []
    for function in functions:
        name, params = function.get("name"), function.get("parameters")
        if params is not None:
            params = copy.deepcopy(params)
            defs = params.pop("$defs", {})
            if not isinstance(defs, dict):
                raise BadRequest(f"`$defs` in the parameters of tool '{name}' must be an object, got "
                                 f"{type(defs).__name__}.", "tools")
            for def_name, def_schema in defs.items():
                if def_name in all_defs and all_defs[def_name] != def_schema:
                    raise BadRequest(f"Tool definition '{def_name}' has multiple schemas, which is not supported.",
                                     "tools")
                all_defs[def_name] = def_schema
        schemas.append({"properties": {"name": {"type": "string", "enum": [name]},
                                       "parameters": _params_or_empty_object(params)},
                        "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": schemas}}
    if parallel_tool_calls is False:  # only an explicit false limits the calls
        schema["maxItems"] = 1
    if all_defs:
        schema["$defs"] = all_defs
    return schema


def named_tool(tool_choice: Any) -> Optional[str]:
    """The function a chat ``tool_choice`` names, or None for a string choice."""
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    return None


def json_schema_from_tools(tool_choice: Union[str, dict, None], tools: Optional[list],
                           parallel_tool_calls: Optional[bool] = None) -> Optional[dict]:
    """The schema for ``"required"`` or a named tool; None for ``"none"``/``"auto"``/no tools."""
    if tool_choice in ("none", None) or tools is None:
        return None
    name = named_tool(tool_choice)
    if name is not None:
        for function in (_function(t) for t in tools):
            if function is not None and function.get("name") == name:
                return _params_or_empty_object(function.get("parameters"))
        raise BadRequest(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
    if tool_choice == "required":
        return _required_schema(tools, parallel_tool_calls)
    return None


def forced_tool_choice(tools: Optional[list], tool_choice: Any) -> tuple[Optional[str], Optional[str]]:
    """("required" | "named" | None, the named function): a tool choice whose output the
    grammar shapes into tool-call JSON (parsed by gateway/parsers/forced_tool_calls.py)."""
    if not tools:
        return None, None
    name = named_tool(tool_choice)
    if name is not None:
        return "named", name
    return ("required", None) if tool_choice == "required" else (None, None)
