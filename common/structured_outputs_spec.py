"""What the gateway and the workers agree on about a structured-outputs constraint.

The gateway checks a constraint before admission (gateway/structured_outputs/); the
worker checks it again for direct ZeroMQ clients (worker/engine/structured_output/spec.py)
and compiles it.  Both must apply the same bounds and read a spec the same way -- vLLM's
heuristics (Lark or EBNF, choices as an EBNF grammar) and its list of JSON-schema features
xgrammar cannot enforce -- so those live here, once.  Pure Python: nothing here imports
xgrammar.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional, Sequence

# Bounds on what one request may ask a compiler to do (compile time and the compiled
# grammar's memory grow with the spec); vLLM has no cap on the first two.
MAX_SPEC_CHARS = 64 * 1024  # each constraint string
MAX_CHOICES = 1024
MAX_JSON_NESTING = 64  # vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING
STRUCTURAL_TAG_WRAPPER_NESTING = 16  # the extra depth a structural tag wraps its schemas in

# String formats xgrammar's JSON-schema converter enforces (vLLM's STRING_SUPPORTED_FORMATS).
STRING_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                            "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})


def exceeds_json_nesting(spec: Any, limit: int) -> bool:
    """vLLM's ``_exceeds_json_nesting``: objects and arrays nested deeper than ``limit``
    (breadth-first, so a deep document costs no recursion).  ``spec``: a parsed value or
    JSON text (text too deep for the parser counts as too deep; malformed text does not:
    the conversion reports it)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except RecursionError:
            return True
        except ValueError:
            return False
    level = [spec]
    for _ in range(limit):
        level = [child for node in level if isinstance(node, (dict, list))
                 for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
        if not level:
            return False
    return True


def _types(node: dict) -> set:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()


def _bounded_pattern(node: dict) -> bool:
    return ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node)


def _node_feature(node: dict) -> Optional[str]:
    types = _types(node)
    if types & {"integer", "number"} and "multipleOf" in node:
        return "multipleOf"
    if "array" in types:
        for key in ("uniqueItems", "contains", "minContains", "maxContains"):
            if key in node:
                return key
    if "string" in types:
        if "format" in node and node["format"] not in STRING_FORMATS:
            return f"format {node['format']!r}"
        if _bounded_pattern(node):
            return "pattern / format with minLength / maxLength"
    if "object" in types:
        if "propertyNames" in node:
            names = node["propertyNames"]
            if (isinstance(names, dict) and _bounded_pattern(names)) or "patternProperties" in node \
                    or "properties" in node or node.get("unevaluatedProperties", True) is not True:
                return "propertyNames with properties, patternProperties, unevaluatedProperties or length bounds"
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict) and ("properties" in node or len(patterns) > 1):
            return "patternProperties with properties, or more than one pattern"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) >= 2:
        return "allOf with several branches"
    return None


def unsupported_json_feature(schema: Any) -> Optional[str]:
    """The first schema feature xgrammar's converter ignores or mis-handles (which would
    let outputs the schema forbids through), or None: vLLM's
    ``has_xgrammar_unsupported_json_features``, naming the feature.  Iterative, so a
    deep schema costs no recursion."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        found = _node_feature(node)
        if found:
            return found
        for value in node.values():
            if isinstance(value, dict):
                stack.append(value)
            elif isinstance(value, list):
                stack.extend(v for v in value if isinstance(v, dict))
    return None


def grammar_is_likely_lark(grammar: str) -> bool:
    """vLLM's heuristic: a grammar with no ``::=`` rule (comments aside) is Lark, else EBNF."""
    for line in grammar.split("\n"):
        if "::=" in re.sub(r"(#|//).*$", "", line):
            return False
    return True


_EBNF_ESCAPES = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}


def _ebnf_char(ch: str) -> str:
    if ch in _EBNF_ESCAPES:
        return _EBNF_ESCAPES[ch]
    if ord(ch) < 0x20 or ord(ch) == 0x7F:
        return f"\\u{ord(ch):04x}"
    return ch


def choice_as_grammar(choices: Sequence[str]) -> str:
    """vLLM's ``choice_as_grammar``: ``root ::= "a" | "b"``, each choice an EBNF string literal."""
    return "root ::= " + " | ".join('"' + "".join(_ebnf_char(c) for c in choice) + '"' for choice in choices)
