"""vLLM 0.32's chat-message preprocessing for text-only requests
(``renderers/chat_utils.parse_chat_messages`` and the request validators before it),
so the conversation a template sees here is the one it sees in vLLM.

Each message is rebuilt from the fields vLLM keeps (role, content, name, task,
tool_calls, reasoning, tool_call_id, developer tools); other fields are dropped, as
vLLM drops them.  Content becomes one string ("string" format, text parts joined with
"\\n") or a list of ``{"type": "text", "text": ...}`` parts ("openai" format).
Multimodal parts are refused by name, except ``image_url`` parts for a model that takes
images (``images``: a list that collects them, in order, as /generate content parts): in the "openai" format
they become ``{"type": "image"}``, as vLLM hands them to the template.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Iterable, Optional

from gateway.chat.errors import ChatTemplateError
from gateway.chat.jinja_env import ContentFormat
from gateway.multimodal import image_uuid

log = logging.getLogger(__name__)

# The roles of OpenAI's ChatCompletionMessageParam.  vLLM itself also accepts any
# other string role (its CustomChatCompletionMessageParam); ChatTemplate can be told
# to, with allowed_roles=None.
OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

# Part types vLLM reads as text, and the field each keeps its text in.
_TEXT_PART_FIELDS = {"text": "text", "input_text": "text", "output_text": "text",
                     "refusal": "refusal", "thinking": "thinking"}
# Text parts whose missing text vLLM skips instead of rendering None.
_SKIP_NONE_TYPES = ("text", "refusal")
# Part types (and type-less keys) that carry media.
MULTIMODAL_PART_TYPES = ("image_url", "input_image", "image_pil", "image_embeds", "audio_url",
                         "input_audio", "audio_embeds", "video_url", "video_embeds", "prompt_embeds",
                         "file")
_TYPELESS_MEDIA_KEYS = ("image_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds",
                        "prompt_embeds", "audio_url", "input_audio", "video_url")
# Every field of vLLM's content-part TypedDicts: the rest of a text part's fields are
# "extra" and travel with it in the openai format.
_KNOWN_PART_FIELDS = frozenset({"type", "text", "image_url", "input_audio", "file", "refusal", "audio_url",
                                "video_url", "image_embeds", "audio_embeds", "video_embeds", "uuid", "data",
                                "image_pil", "thinking", "closed", "name"})
# vLLM lists its media types here too; this server renders text only.
_SUPPORTED_PART_TYPES = sorted(set(_TEXT_PART_FIELDS) | {"tool_reference"})
# Claude Code's per-request attribution line: vLLM drops it from system text so the
# prompt prefix stays cacheable.
_BILLING_HEADER = "x-anthropic-billing-header"


def _err(message: str, param: str = "messages") -> ChatTemplateError:
    return ChatTemplateError(message, param)


def _image_part(part: dict, where: str, wrap: bool, images: list) -> dict:
    inner = part.get("image_url")
    url = inner.get("url") if isinstance(inner, dict) else inner
    if url is None and part.get("uuid") is not None:
        raise _err(f"{where}: an image given only by its uuid (a reference to a cached item) is not supported: this "
                   "server keeps no multimodal processor cache; send the image's url")
    if not isinstance(url, str) or not url:
        raise _err(f"{where}: an image_url part needs a non-empty `image_url.url` string")
    if not wrap:
        raise _err(f"{where}: image input needs a chat template that reads content parts "
                   f"(the 'openai' content format)")
    try:
        uuid = image_uuid(part)
    except ValueError as exc:
        raise _err(f"{where}: {exc}") from None
    # The image as a /generate content part (its uuid, when given, identifies it as vLLM's does).
    images.append({"type": "image_url", "url": url, **({"uuid": uuid} if uuid is not None else {})})
    return {"type": "image"}


def _part_text(part: Any, where: str, wrap: bool, images: Optional[list] = None) -> Optional[Any]:
    """One content part as vLLM's ``_parse_chat_message_content_part`` sees it: a
    string or ``{"type": "text", ...}`` (wrap) / a string (no wrap), or None to skip."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if wrap else part
    if not isinstance(part, dict):
        raise _err(f"{where} must be a string or an object, got {type(part).__name__}")
    part_type = part.get("type")
    if part_type is None:
        media = next((key for key in _TYPELESS_MEDIA_KEYS if key in part), None)
        if media == "image_url" and images is not None:
            return _image_part(part, where, wrap, images)
        if media is not None:
            raise _multimodal(media, where, images is not None)
        if "tool_reference" in part:
            part_type = "tool_reference"
        else:
            raise _err("Missing 'type' field in multimodal part.", "type")
    if not isinstance(part_type, str):
        raise _err("Invalid 'type' field in multimodal part.", "type")
    if part_type in _TEXT_PART_FIELDS:
        text = part.get(_TEXT_PART_FIELDS[part_type])
        if text is None and part_type in _SKIP_NONE_TYPES:
            log.warning("Skipping content part %s with empty / unparsable content.", where)
            return None
        if text is not None and not isinstance(text, str):
            raise _err(f"{where}.{_TEXT_PART_FIELDS[part_type]} must be a string")
        if not wrap:
            return text
        wrapped = {"type": "text", "text": text}
        wrapped.update({k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS})
        return wrapped
    if part_type == "tool_reference":
        # Not media: a reference to a deferred tool that the template expands.
        name = part.get("name")
        return {"type": "tool_reference", "name": name} if wrap else name
    if part_type == "image_url" and images is not None:
        return _image_part(part, where, wrap, images)
    if part_type in MULTIMODAL_PART_TYPES:
        raise _multimodal(part_type, where, images is not None)
    raise _err(f"Unsupported chat content part type: {part_type!r}. "
               f"Supported types: {', '.join(_SUPPORTED_PART_TYPES)}.", "type")


def _multimodal(kind: str, where: str, images_ok: bool = False) -> ChatTemplateError:
    served = "text and image_url parts" if images_ok else "only text parts"
    return _err(f"Multimodal content is not supported yet: {where} is a {kind!r} part; "
                f"{served} can be rendered by this server.")


def _strip_billing_header(parts: list) -> list:
    out = []
    for part in parts:
        text = part if isinstance(part, str) else (part.get("text") if isinstance(part, dict)
                                                   and part.get("type") == "text" else None)
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _content(message: dict, role: str, where: str, fmt: ContentFormat, images: Optional[list] = None) -> Any:
    content = message.get("content")
    if content is None:
        parts: list = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise _err(f"{where}.content must be a string, a list of content parts or null, "
                   f"got {type(content).__name__}")
    if role == "system":
        parts = _strip_billing_header(parts)
    wrap = fmt == "openai"
    parsed = [_part_text(part, f"{where}.content[{i}]", wrap, images) for i, part in enumerate(parts)]
    # vLLM keeps only truthy results: in the string format an empty text part adds no
    # separator to the join.
    parsed = [p for p in parsed if p]
    return parsed if wrap else "\n".join(parsed)


def _tool_content_as_string(content: Any) -> Any:
    # Clients (Claude Code, Cursor) send tool results as text parts, but most
    # templates only handle a string there; other parts (tool_reference) stay.
    if not isinstance(content, list):
        return content
    if any(isinstance(item, dict) and item.get("type") != "text" for item in content):
        return content
    return "\n".join(item.get("text", "") for item in content
                     if isinstance(item, dict) and item.get("type") == "text")


def _convert_message(message: Any, i: int, fmt: ContentFormat, allowed_roles, images: Optional[list] = None) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _err(f"{where} must be an object, got {type(message).__name__}")
    if "role" not in message:
        raise _err(f"{where} has no 'role' field")
    role = message["role"]
    if not isinstance(role, str) or not role:
        raise _err(f"{where}.role must be a non-empty string")
    if allowed_roles is not None and role not in allowed_roles:
        raise _err(f"{where} has an unknown role {role!r}; expected one of: {', '.join(sorted(allowed_roles))}")
    out: dict = {"role": role, "content": _content(message, role, where, fmt, images)}
    # vLLM's request validator renames the deprecated reasoning_content.
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    if role == "assistant":
        if message.get("tool_calls") is not None:
            tool_calls = message["tool_calls"]
            out["tool_calls"] = list(tool_calls) if isinstance(tool_calls, (list, tuple)) else tool_calls
        if reasoning is not None:
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        out["content"] = _tool_content_as_string(out["content"])
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if isinstance(message.get("task"), str):
        out["task"] = message["task"]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _parse_arguments(function: dict) -> None:
    """Tool-call arguments arrive as the JSON string OpenAI clients send back, but
    templates expect the object (``arguments | tojson``, ``arguments | items``)."""
    arguments = function.get("arguments")
    if not arguments:
        function["arguments"] = {}
        return
    if isinstance(arguments, dict):
        return
    parsed = arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
            # A malformed string lives on in the conversation history; failing here
            # would fail every later turn, so vLLM coerces it to an empty object.
            log.warning("Tool call %r has arguments that are not valid JSON (%d chars); "
                        "coercing to an empty object.", function.get("name"), len(arguments))
            parsed = None
    if not isinstance(parsed, dict):
        function["arguments"] = {}
    else:
        function["arguments"] = parsed


def _postprocess_tool_calls(conversation: list[dict]) -> None:
    for message in conversation:
        if message["role"] != "assistant" or "tool_calls" not in message:
            continue
        tool_calls = message["tool_calls"]
        if not isinstance(tool_calls, list):
            continue
        if not tool_calls:
            # Keeps templates on their plain-assistant path.
            del message["tool_calls"]
            continue
        for item in tool_calls:
            if not isinstance(item, dict):
                raise _err("assistant tool_calls entries must be objects.", "tool_calls")
            function = item.get("function")
            if item.get("type", "function") != "function" or not isinstance(function, dict):
                raise _err("chat completions only support assistant tool_calls of type 'function'.",
                           "tool_calls")
            _parse_arguments(function)


def _developer_to_system(conversation: list[dict]) -> list[dict]:
    """For templates that never mention "developer": developer messages become
    system ones, and all system messages merge into one first message (some
    templates, e.g. Qwen 3.6, insist the system message comes first)."""
    converted = []
    for msg in conversation:
        if msg["role"] == "developer":
            msg = {k: v for k, v in msg.items() if k != "tools"}
            msg["role"] = "system"
        converted.append(msg)
    system_texts: list[str] = []
    others: list[dict] = []
    needs_merge = False
    for i, msg in enumerate(converted):
        if msg["role"] != "system":
            others.append(msg)
            continue
        if i > 0 or system_texts:
            needs_merge = True
        content = msg.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            system_texts.append(content)
    if not needs_merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]


def parse_messages(messages: Any, fmt: ContentFormat, *, developer_role_supported: bool,
                   allowed_roles: Optional[Iterable[str]] = OPENAI_ROLES,
                   images: Optional[list] = None) -> list[dict]:
    """The conversation vLLM hands ``apply_chat_template`` for these request messages.
    ``messages`` must already be a plain-JSON copy: tool-call arguments are parsed in place.
    ``images``: given (a list), image_url parts are kept and appended to it as content parts."""
    if not isinstance(messages, list):
        raise _err(f"messages must be a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise _err("Cannot apply chat template to an empty conversation. Provide at least one message.")
    roles = frozenset(allowed_roles) if allowed_roles is not None else None
    conversation = [_convert_message(m, i, fmt, roles, images) for i, m in enumerate(messages)]
    _postprocess_tool_calls(conversation)
    if not developer_role_supported and any(m["role"] == "developer" for m in conversation):
        log.debug("chat template does not support the 'developer' role; sending developer messages as system")
        conversation = _developer_to_system(conversation)
    return conversation
