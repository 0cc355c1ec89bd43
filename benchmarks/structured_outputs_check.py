"""What checking a structured-outputs constraint costs the gateway per request, cold (the
xgrammar grammar conversion, what a new spec pays once, on the render pool) vs warm (the
cached outcome: a digest and an LRU lookup, on the event loop), for typical constraints:
a 10-tool ``tool_choice="required"`` schema, a nested JSON schema, a regex, an EBNF grammar.
Both measured in one run, back to back; the ratio is what the cache saves.

    python -m benchmarks.structured_outputs_check [--repeat 200]
"""
from __future__ import annotations

import argparse
import time

from gateway.structured_outputs.grammar_check import GrammarChecker, convert
from gateway.structured_outputs.params import parse_structured_outputs
from gateway.structured_outputs.tool_schema import json_schema_from_tools


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {
        "type": "object", "required": ["query", "limit"],
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
                       "filters": {"type": "array", "items": {"type": "object", "properties": {
                           "field": {"type": "string"}, "value": {"type": "string"}}}},
                       "mode": {"type": "string", "enum": ["fast", "exact", "fuzzy"]}}}}} for i in range(n)]


def _nested(depth: int) -> dict:
    node: dict = {"type": "string"}
    for i in range(depth):
        node = {"type": "object", "properties": {f"k{i}": node, "n": {"type": "number"}}, "required": [f"k{i}"]}
    return node


CASES = {
    "required, 10 tools": {"json": json_schema_from_tools("required", _tools(10))},
    "json schema, depth 12": {"json": _nested(12)},
    "regex (phone)": {"regex": r"\+?\d{1,3}[- ]?\(?\d{3}\)?[- ]?\d{3}[- ]?\d{4}"},
    "ebnf grammar": {"grammar": 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+ | "(" expr ")"'},
}


def _per_call_us(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=200)
    args = p.parse_args()
    import xgrammar  # noqa: F401  (its import is a one-off start-up cost, not a request's)

    print(f"{'constraint':24} {'parse us':>9} {'cold us':>9} {'warm us':>9} {'cold/warm':>10}")
    for name, raw in CASES.items():
        parse_us = _per_call_us(lambda: parse_structured_outputs(raw), args.repeat)
        so = parse_structured_outputs(raw)
        cold_us = _per_call_us(lambda: convert(so), args.repeat)  # what a cache miss pays
        checker = GrammarChecker()
        checker.check(so)
        warm_us = _per_call_us(lambda: checker.check(so), args.repeat)
        print(f"{name:24} {parse_us:9.1f} {cold_us:9.1f} {warm_us:9.1f} {cold_us / warm_us:9.1f}x")


if __name__ == "__main__":
    main()
