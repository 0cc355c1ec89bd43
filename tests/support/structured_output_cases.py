"""Structured-output constraints and how to check a generated text against each: ~20
JSON schemas (nested objects, arrays, enums, numbers, optional fields, $ref, anyOf ...)
plus regex, choice, EBNF grammar, json_object and a structural tag.

A random-weight model emits random tokens, so every schema bounds what it allows
(maxLength, enums, maxItems, number ranges) and the JSON ones turn off free whitespace
(vLLM's ``disable_any_whitespace``): then the grammar ends within a few hundred tokens
and the only token left is EOS.  ``is_valid(case, text)`` is the independent check:
``jsonschema`` for JSON, Python's ``re`` for regexes, xgrammar's own matcher for EBNF.
"""
from __future__ import annotations

import json
import re
from typing import Any

from common.protocol import StructuredOutputs

S = {"type": "string", "maxLength": 6}

JSON_SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"type": "integer", "minimum": -50, "maximum": 50}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"a": S, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["a"]},  # b optional
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"const": "fixed"}, "n": {"type": "integer", "minimum": 1, "maximum": 3}},
     "required": ["kind", "n"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                      {"type": "boolean"}]}}, "required": ["v"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "label": S},
        "required": ["id", "label"]}}}, "required": ["items"]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["x"]}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
     "required": ["from", "to"]},
    {"type": "object", "properties": {"status": {"enum": ["active", "inactive", "pending"]},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 1000}},
     "required": ["status", "count"]},
    {"type": "object", "properties": {"nested": {"type": "object", "properties": {"deeper": {
        "type": "object", "properties": {"leaf": {"enum": [1, 2, 3]}}, "required": ["leaf"]}}, "required": ["deeper"]}},
     "required": ["nested"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 4}},
     "required": ["flag", "note"]},
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {"type": "object", "properties": {"ids": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 2,
                                              "maxItems": 3}}, "required": ["ids"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": S, "role": {"enum": ["admin", "user"]},
        "langs": {"type": "array", "maxItems": 2, "items": {"enum": ["en", "fr", "de"]}}},
        "required": ["name", "role", "langs"]}, "active": {"type": "boolean"}}, "required": ["user", "active"]},
    {"type": "object", "properties": {"choice": {"oneOf": [{"const": "A"}, {"const": "B"}]}}, "required": ["choice"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
]

REGEXES = [r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", r"(\+|-)?[0-9]{1,4}(\.[0-9]{1,2})?", r"(yes|no|maybe)!{0,3}",
           r"[A-F0-9]{8}"]
CHOICES = [["positive", "negative", "neutral"], ["A", "B", "C", "D"]]
GRAMMARS = ['root ::= "(" expr ")"\nexpr ::= term ("+" term){0,3}\nterm ::= [0-9] | "x"',
            'root ::= ("cat" | "dog") " " [a-z]{1,4} "."']
LARK = 'start: pair ("," pair)~0..2\npair: KEY "=" VALUE\nKEY: /[a-z]{1,3}/\nVALUE: /[0-9]{1,2}/'
# A structural tag's JSON content allows free whitespace (no disable_any_whitespace there),
# which a random model never stops emitting inside an object: a string enum has no inside.
STRUCTURAL_TAG_SCHEMA = {"type": "string", "enum": ["get", "put", "delete"]}
STRUCTURAL_TAG = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<call>", "content": {"type": "json_schema", "json_schema": STRUCTURAL_TAG_SCHEMA},
    "end": "</call>"}}


def cases() -> list[tuple[str, StructuredOutputs, Any]]:
    """(name, wire constraint, what to check the text against)."""
    out: list[tuple[str, StructuredOutputs, Any]] = []
    for i, schema in enumerate(JSON_SCHEMAS):
        out.append((f"json{i}", StructuredOutputs(json=json.dumps(schema), disable_any_whitespace=True),
                    ("json", schema)))
    for i, rx in enumerate(REGEXES):
        out.append((f"regex{i}", StructuredOutputs(regex=rx), ("regex", rx)))
    for i, ch in enumerate(CHOICES):
        out.append((f"choice{i}", StructuredOutputs(choice=ch), ("choice", ch)))
    for i, g in enumerate(GRAMMARS):
        out.append((f"grammar{i}", StructuredOutputs(grammar=g), ("grammar", g)))
    out.append(("lark", StructuredOutputs(grammar=LARK), ("regex", r"[a-z]{1,3}=[0-9]{1,2}(,[a-z]{1,3}=[0-9]{1,2}){0,2}")))
    out.append(("json_object", StructuredOutputs(json_object=True, disable_any_whitespace=True),
                ("json_object", None)))
    out.append(("structural_tag", StructuredOutputs(structural_tag=json.dumps(STRUCTURAL_TAG)),
                ("structural_tag", STRUCTURAL_TAG_SCHEMA)))
    return out


def is_valid(check: Any, text: str) -> bool:
    kind, spec = check
    if kind == "json":
        import jsonschema

        try:
            # strict=False: xgrammar's JSON strings admit raw control characters other than
            # CR / LF (as in vLLM), which Python's strict parser refuses.
            jsonschema.validate(json.loads(text, strict=False), spec)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "json_object":
        try:
            return isinstance(json.loads(text, strict=False), dict)
        except ValueError:
            return False
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    if kind == "grammar":
        import xgrammar as xgr

        return bool(xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(spec), text))
    if kind == "structural_tag":
        if not (text.startswith("<call>") and text.endswith("</call>")):
            return False
        return is_valid(("json", spec), text[len("<call>"):-len("</call>")])
    raise ValueError(kind)


def grammar_text_decoder(tokenizer, vocab_size: int, stop_token_ids):
    """``decode(ids)``: the text a grammar saw -- each token's bytes as xgrammar reads
    them, the final stop token dropped -- decoded with ``surrogatepass``.  xgrammar (and so
    vLLM) lets a JSON string hold a UTF-16 surrogate code point encoded in UTF-8 (e.g.
    ``ED B1 96``); that is one character to the grammar (and to ``maxLength``), but
    three U+FFFD to a strict decode, which would fail a valid output."""
    from worker.engine.structured_output.backend_xgrammar import build_tokenizer_info

    vocab = build_tokenizer_info(tokenizer, vocab_size, list(stop_token_ids)).decoded_vocab
    stops = set(stop_token_ids)

    def decode(ids) -> str:
        ids = list(ids)
        if ids and ids[-1] in stops:
            ids = ids[:-1]
        return b"".join(vocab[i] for i in ids).decode("utf-8", "surrogatepass")

    return decode
