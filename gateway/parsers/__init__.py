"""vLLM 0.32-compatible reasoning and tool-call parsing of chat output text (stdlib only).

See :mod:`gateway.parsers.output` for the API and the streaming contract.
"""
from gateway.parsers.output import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    OutputParser,
    ParsedOutput,
    ParsedToolCall,
    final_finish_reason,
    make_tool_call_id,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "OutputParser",
    "ParsedOutput",
    "ParsedToolCall",
    "final_finish_reason",
    "make_tool_call_id",
]
