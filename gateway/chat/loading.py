"""Where a model's chat template and special tokens come from.

Lookup order for a model directory is transformers': ``chat_template.jinja`` and
``additional_chat_templates/*.jinja`` (the newer layout) win over
``tokenizer_config.json``'s ``chat_template``, which is either a string or a list of
``{"name", "template"}``.  A ``--chat-template`` override is read as vLLM's
``load_chat_template`` reads it: a file when it opens, else the template text itself
unless it looks like a path (no ``{``, ``}`` or newline), which is an error.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

from gateway.chat.errors import ChatTemplateError

# A template, or several by name (the tokenizer_config list form).
TemplateSource = Union[str, list[dict]]

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_JINJA_CHARS = "{}\n"


def read_template_override(override: Union[str, Path]) -> str:
    try:
        with open(override, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the "path"
        if isinstance(override, Path) or not any(c in override for c in _JINJA_CHARS):
            raise ChatTemplateError(
                f"The supplied chat template ({override}) looks like a file path, but it failed to be "
                f"opened. Tried: {override}. Reason: {e}", "chat_template") from None
        return override


def read_tokenizer_config(model_dir: Union[str, Path]) -> dict:
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return config if isinstance(config, dict) else {}


def _template_files(model_dir: Path) -> Optional[TemplateSource]:
    named: list[dict] = []
    main = model_dir / "chat_template.jinja"
    if main.is_file():
        named.append({"name": "default", "template": main.read_text(encoding="utf-8")})
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            named.append({"name": path.name.removesuffix(".jinja"), "template": path.read_text(encoding="utf-8")})
    if not named:
        return None
    if len(named) == 1 and named[0]["name"] == "default":
        return named[0]["template"]
    return named


def load_chat_template(model_dir: Union[str, Path, None], override: Optional[str] = None) -> Optional[TemplateSource]:
    """The override's text, else the model's template (a string, or the named list so
    a request with tools can pick "tool_use"); None when there is none."""
    if override is not None:
        return read_template_override(override)
    if model_dir is None:
        return None
    model_dir = Path(model_dir)
    from_files = _template_files(model_dir)
    if from_files is not None:
        return from_files
    template = read_tokenizer_config(model_dir).get("chat_template")
    if isinstance(template, (str, list)) and template:
        return template
    return None


def token_content(value) -> Optional[str]:
    """tokenizer_config stores a special token as a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def special_tokens_from_config(config: dict) -> dict[str, str]:
    """transformers' ``special_tokens_map``: the named special tokens that are set."""
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        content = token_content(config.get(key))
        if content is not None:
            tokens[key] = content
    return tokens
