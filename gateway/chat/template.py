"""Chat completions' messages -> the prompt string, as vLLM 0.32 renders it.

vLLM preprocesses the request (``gateway.chat.messages``, ``gateway.chat.inputs``),
then calls transformers' ``apply_chat_template``; this module is that second half
without transformers: the same sandboxed Jinja environment
(``gateway.chat.jinja_env``), the same render arguments (messages, tools, documents,
add_generation_prompt, the special tokens, the filtered chat_template_kwargs) and the
same ``continue_final_message`` cut.  The caller tokenizes the result with
``Tokenizer.encode(prompt, add_special_tokens=False)``, which is what
``apply_chat_template(tokenize=True)`` does, so the token ids match vLLM's.

The transformers behaviour copied is that of the releases vLLM 0.32 requires
(>=5.16.1,<5.20): messages reach the template as vLLM built them.  Later releases
also drop None-valued message keys and copy reasoning to a "thinking" key; neither
happens in a vLLM 0.32 server, so neither happens here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional, Union

import jinja2

from gateway.chat import inputs, jinja_env
from gateway.chat.errors import ChatTemplateError
from gateway.chat.loading import load_chat_template, read_tokenizer_config, special_tokens_from_config
from gateway.chat.messages import OPENAI_ROLES, parse_messages

__all__ = ["ChatTemplate", "ChatTemplateError", "load_chat_template", "OPENAI_ROLES"]

# transformers appends this to the final message, renders, and cuts the prompt at it,
# so whatever the template writes after the message (end-of-turn tokens) is gone.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_CONTENT_FORMATS = ("auto", "string", "openai")


def _plain(value: Any) -> Any:
    """A fresh copy made of JSON types only: the template never sees the caller's
    objects, and parsing tool-call arguments never edits them."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _named_templates(template) -> dict[str, str]:
    if isinstance(template, str):
        return {"": template}
    if isinstance(template, dict):
        items = list(template.items())
    elif isinstance(template, list):
        items = []
        for entry in template:
            if not isinstance(entry, dict) or "name" not in entry or "template" not in entry:
                raise ChatTemplateError('a list of chat templates must hold {"name": ..., "template": ...} objects',
                                        "chat_template")
            items.append((entry["name"], entry["template"]))
    else:
        raise ChatTemplateError(f"a chat template must be a string or a list of named templates, "
                                f"got {type(template).__name__}", "chat_template")
    if not items or not all(isinstance(n, str) and isinstance(t, str) for n, t in items):
        raise ChatTemplateError("named chat templates must map string names to template strings", "chat_template")
    return dict(items)


class ChatTemplate:
    """A model's chat template (one, or several by name) and its special tokens."""

    def __init__(self, template: Union[str, list[dict], dict[str, str]], special_tokens: dict[str, str], *,
                 content_format: str = "auto", allowed_roles: Optional[Iterable[str]] = OPENAI_ROLES):
        """``content_format``: vLLM's --chat-template-content-format ("auto" detects it
        from the template).  ``allowed_roles``: None accepts any string role, as vLLM
        does; the default accepts OpenAI's roles only."""
        if content_format not in _CONTENT_FORMATS:
            raise ValueError(f"content_format must be one of {_CONTENT_FORMATS}, got {content_format!r}")
        self._templates = _named_templates(template)
        for name, source in self._templates.items():
            try:
                jinja_env.compile_template(source)
            except jinja2.TemplateSyntaxError as e:
                label = f" {name!r}" if name else ""
                raise ChatTemplateError(f"Invalid chat template{label}: {e.message} (line {e.lineno})",
                                        "chat_template") from None
        self.special_tokens = {k: str(v) for k, v in special_tokens.items() if v is not None}
        self.content_format = content_format
        self.allowed_roles = frozenset(allowed_roles) if allowed_roles is not None else None

    @classmethod
    def from_model_dir(cls, model_dir: Union[str, Path, None], override: Optional[str] = None,
                       **kwargs) -> Optional["ChatTemplate"]:
        """None when neither the override nor the model provides a template."""
        template = load_chat_template(model_dir, override)
        if template is None:
            return None
        config = read_tokenizer_config(model_dir) if model_dir is not None else {}
        return cls(template, special_tokens_from_config(config), **kwargs)

    @property
    def names(self) -> list[str]:
        """The template names of the list form; [] for a single template."""
        return [name for name in self._templates if name]

    def template_for(self, tools: Optional[list]) -> str:
        """transformers' ``get_chat_template``: "tool_use" when tools are given and it
        exists, else "default"."""
        if "" in self._templates:
            return self._templates[""]
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        raise ChatTemplateError(
            "This model has multiple chat templates with no default specified! Please either pass a chat "
            "template or the name of the template you wish to use to the `chat_template` argument. "
            f"Available template names are {sorted(self._templates)}.", "chat_template")

    def render(self, messages: list[dict], *, tools: Optional[list[dict]] = None,
               documents: Optional[list[dict]] = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False, chat_template_kwargs: Optional[dict] = None,
               images: Optional[list] = None, limits: Optional[jinja_env.RenderLimits] = None) -> str:
        """``images``: given (a list), image_url parts are kept (the model takes images)
        and their URLs appended to it, in order.  ``limits``: what the render may spend
        (steps, seconds, characters); RenderLimits() when not given.

        The prompt for these chat-completion request fields (plain JSON values, as
        decoded from the request).  Raises ChatTemplateError (a 400) for anything the
        request got wrong, including a template that refuses the conversation
        (``raise_exception``)."""
        try:
            return self._render(messages, tools, documents, add_generation_prompt, continue_final_message,
                                chat_template_kwargs, images, limits or jinja_env.RenderLimits())
        except RecursionError:
            raise ChatTemplateError("The request is nested too deeply to render.", "messages") from None

    def _render(self, messages: Any, tools: Any, documents: Any, add_generation_prompt: bool,
                continue_final_message: bool, chat_template_kwargs: Any, images: Optional[list],
                limits: jinja_env.RenderLimits) -> str:
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                    "continue_final_message")
        tools = inputs.normalize_tools(_plain(tools))
        documents = inputs.check_documents(_plain(documents))
        tools, documents, kwargs = inputs.merge_kwargs(_plain(chat_template_kwargs), tools, documents)
        source = self.template_for(tools)
        fmt = jinja_env.detect_content_format(source) if self.content_format == "auto" else self.content_format
        conversation = parse_messages(_plain(messages), fmt,
                                      developer_role_supported=jinja_env.supports_developer_role(source),
                                      allowed_roles=self.allowed_roles, images=images)
        # vLLM passes on only the kwargs the template reads; kwargs beat special tokens.
        accepted = jinja_env.template_variables(source)
        template_kwargs = {**self.special_tokens, **{k: v for k, v in kwargs.items() if k in accepted}}
        return _apply_template(source, conversation, tools, documents, add_generation_prompt,
                               continue_final_message, template_kwargs, limits)


def _apply_template(source: str, chat: list[dict], tools: Optional[list], documents: Optional[list],
                    add_generation_prompt: bool, continue_final_message: bool, template_kwargs: dict,
                    limits: jinja_env.RenderLimits) -> str:
    """transformers' ``render_jinja_template`` for one conversation."""
    final_text = _tag_final_message(chat, source) if continue_final_message else None
    try:
        rendered = jinja_env.render_limited(
            jinja_env.compile_template(source), limits, messages=chat, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **template_kwargs)
    except jinja_env.RenderLimitExceeded as e:
        raise ChatTemplateError(str(e), "messages") from None
    except jinja2.TemplateError as e:
        if type(e) is jinja2.TemplateError:  # the template's raise_exception(): its own words
            raise ChatTemplateError(str(e), "messages") from None
        raise ChatTemplateError(f"The chat template cannot render this request: {type(e).__name__}: {e}",
                                "messages") from None
    except Exception as e:  # e.g. a TypeError from list content in a string-only template
        raise ChatTemplateError(f"The chat template cannot render this request: {type(e).__name__}: {e}",
                                "messages") from None
    if final_text is not None:
        rendered = _cut_at_tag(rendered, final_text)
    return rendered


def _tag_final_message(chat: list[dict], source: str) -> str:
    """Appends the tag to the last message's (last text part's) content; returns the
    text being continued."""
    last = chat[-1]
    content = last.get("content")
    if content is None:
        raise ChatTemplateError('continue_final_message is set but the final message has no "content" to continue!',
                                "messages")
    if "content" not in source:
        raise ChatTemplateError('continue_final_message is set to "content" but this is not an accepted field '
                                'in the chat_template', "messages")
    if isinstance(content, (list, tuple)):
        for part in reversed(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                text = part["text"]
                part["text"] = text + _CONTINUE_TAG
                return text
        raise ChatTemplateError("continue_final_message is set but we could not find any text to continue in "
                                "the final message!", "messages")
    if not isinstance(content, str):
        raise ChatTemplateError("continue_final_message needs the final message's content to be text", "messages")
    last["content"] = content + _CONTINUE_TAG
    return content


def _cut_at_tag(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the chat after applying "
            "the chat template! This can happen if the chat template deletes portions of the final message.",
            "messages")
    at = rendered.rindex(tag)
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    # The template trimmed the message's trailing space, and the tag's with it.
    return rendered[:at].rstrip()
