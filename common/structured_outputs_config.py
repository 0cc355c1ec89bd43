"""``--structured-outputs-config``: vLLM's ``StructuredOutputsConfig`` (vllm/config/structured_outputs.py),
same flag name, JSON shape, defaults and start-up checks, shared by the gateway, the workers and
``tokserve serve`` so every process reads one value the same way.

tokserve compiles grammars with xgrammar only: ``backend`` ``auto`` (vLLM's default, which
here always means xgrammar) and ``xgrammar`` are served; vLLM's other backends (guidance,
outlines, lm-format-enforcer) are refused at start-up with a message that says so, instead of
silently serving a backend other than the one asked for.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Optional

BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")  # vLLM's Literal
SERVED_BACKENDS = ("auto", "xgrammar")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    reasoning_parser_plugin: str = ""
    enable_in_reasoning: bool = False

    def to_json(self) -> str:
        """The flag's value for a child process (only what differs from the defaults)."""
        default = StructuredOutputsConfig()
        return json.dumps({k: v for k, v in asdict(self).items() if getattr(default, k) != v})


_TYPES = {"backend": str, "disable_any_whitespace": bool, "disable_additional_properties": bool,
          "reasoning_parser": str, "reasoning_parser_plugin": str, "enable_in_reasoning": bool}


def parse_structured_outputs_config(text: Optional[str]) -> StructuredOutputsConfig:
    """The flag's JSON -> the config; ValueError with the reason for anything vLLM would refuse
    (unknown keys, wrong types, its model validator) or that tokserve does not serve."""
    if text is None or text == "":
        return StructuredOutputsConfig()
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--structured-outputs-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--structured-outputs-config must be a JSON object")
    unknown = sorted(set(raw) - set(_TYPES))
    if unknown:
        raise ValueError(f"--structured-outputs-config: unknown field(s) {unknown}; known: {sorted(_TYPES)}")
    for key, kind in _TYPES.items():
        if key in raw and type(raw[key]) is not kind:
            raise ValueError(f"--structured-outputs-config: {key} must be a {kind.__name__}, got {raw[key]!r}")
    config = StructuredOutputsConfig(**raw)
    if config.backend not in BACKENDS:
        raise ValueError(f"--structured-outputs-config: backend must be one of {list(BACKENDS)}, "
                         f"got {config.backend!r}")
    # vLLM's _validate_structured_output_config, in its order and words.
    if config.disable_any_whitespace and config.backend not in ("xgrammar", "guidance"):
        raise ValueError("disable_any_whitespace is only supported for xgrammar and guidance backends.")
    if config.disable_additional_properties and config.backend != "guidance":
        raise ValueError("disable_additional_properties is only supported for the guidance backend.")
    if config.backend not in SERVED_BACKENDS:
        raise ValueError(f"--structured-outputs-config: backend {config.backend!r} is not served by tokserve, "
                         "which compiles structured outputs with xgrammar only; use 'auto' or 'xgrammar'.")
    if config.reasoning_parser_plugin:
        raise ValueError("--structured-outputs-config: reasoning_parser_plugin is not supported by tokserve "
                         "(no plugins are loaded); use one of the built-in reasoning parsers.")
    return config
