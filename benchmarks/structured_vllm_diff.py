"""Structured outputs, differential against vLLM: the same greedy constrained requests,
the same model, token ids compared.

vLLM's CPU build uses xgrammar too, so on the same random-weight model and the same
greedy request both servers must emit identical token ids: any difference in how the
grammar is compiled for the vocabulary (token strings, byte fallback, special tokens,
stop ids), in when the mask applies or in when the grammar ends the request shows up
as a divergence.

    # record vLLM's answers (needs a running `vllm serve MODEL --enable-scale-out`):
    python -m benchmarks.structured_vllm_diff --vllm-url http://127.0.0.1:8766 --record
    # compare a running tokserve stack with the recording (what tests/integration/
    # test_structured_vllm_golden.py does in CI, where vLLM is not installed):
    python -m benchmarks.structured_vllm_diff --ours-url http://127.0.0.1:8000
    # or both live, side by side:
    python -m benchmarks.structured_vllm_diff --vllm-url ... --ours-url ...

The model is the ``small`` bench preset (benchmarks/model_presets.py, seed 0), rebuilt
bit for bit on any machine; the recording carries its weights' sha256 so a changed
preset fails loudly instead of comparing against the wrong model.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import urllib.request
from pathlib import Path
from typing import Optional

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "data" / "vllm_cpu_structured_golden.json"
PRESET = "small"
GENERATE = "/inference/v1/generate"

_PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}

# (label, structured_outputs, max_tokens): JSON schemas of every common shape, regex,
# choice, EBNF and json_object.  Both servers run with the structured-outputs config
# CONFIG: a random model loves whitespace, and with any whitespace allowed its JSON
# would run to max_tokens; compact JSON ends by the grammar, which must agree too.
CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}
CASES: list[tuple[str, dict, int]] = [
    ("json-object-ints", {"json": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                   "required": ["a", "b"]}}, 48),
    ("json-person", {"json": _PERSON}, 48),
    ("json-enum", {"json": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                            "required": ["color"]}}, 32),
    ("json-array", {"json": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                             "minItems": 1, "maxItems": 4}}, 32),
    ("json-number", {"json": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}, 40),
    ("json-bool-null", {"json": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "null"}},
                                 "required": ["ok", "n"]}}, 32),
    ("json-nested", {"json": {"type": "object", "properties": {
        "user": _PERSON, "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
        "required": ["user", "tags"]}}, 80),
    ("json-ref", {"json": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                             "y": {"type": "integer"}},
                                            "required": ["x", "y"]}},
                           "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
                           "required": ["a", "b"]}}, 80),
    ("json-optional", {"json": {"type": "object", "properties": {"req": {"type": "integer"},
                                                                 "opt": {"type": "string", "maxLength": 4}},
                                "required": ["req"]}}, 40),
    ("json-anyof", {"json": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]}}, 24),
    ("json-const", {"json": {"type": "object", "properties": {"v": {"const": "1.0"}}, "required": ["v"]}}, 24),
    ("json-string-pattern", {"json": {"type": "string", "pattern": "^[a-f0-9]{4}$"}}, 16),
    ("json-closed", {"json": {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"],
                              "additionalProperties": False}}, 32),
    ("json-schema-string", {"json": json.dumps(_PERSON)}, 48),  # a schema sent as a string
    ("json-object-any", {"json_object": True}, 48),
    ("regex-email", {"regex": "[a-z]{3,8}@[a-z]{2,5}\\.com"}, 32),
    ("regex-date", {"regex": "(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"}, 16),
    ("regex-phone", {"regex": "\\(\\d{3}\\) \\d{3}-\\d{4}"}, 20),
    ("choice-3", {"choice": ["yes", "no", "maybe"]}, 8),
    ("choice-long", {"choice": ["positive sentiment", "negative sentiment", "neutral"]}, 24),
    ("grammar-xy", {"grammar": 'root ::= "x" [0-9]{1,6} "y"'}, 16),
    ("grammar-expr", {"grammar": 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [1-9] | "(" expr ")"'}, 24),
    ("grammar-list", {"grammar": 'root ::= "[" item ("," item){0,3} "]"\nitem ::= [a-c]'}, 16),
]

PROMPTS = [b"Answer in JSON: ", b"The result is ", b"Q: what now?\nA: ", b"{\"hint\": 1}\n"]


def model_dir() -> Path:
    from benchmarks.model_presets import build_preset_model
    return build_preset_model(PRESET)


def weights_sha256(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def request_body(i: int, case: tuple[str, dict, int]) -> dict:
    _, so, max_tokens = case
    prompt = list(PROMPTS[i % len(PROMPTS)])  # the preset's byte vocabulary: byte i is token i
    return {"token_ids": prompt, "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens,
                                                     "structured_outputs": so}}


def post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url + GENERATE, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def run(url: str) -> list[dict]:
    out = []
    for i, case in enumerate(CASES):
        choice = post(url, request_body(i, case))["choices"][0]
        out.append({"label": case[0], "token_ids": choice["token_ids"], "finish_reason": choice["finish_reason"]})
    return out


def compare(ours: list[dict], theirs: list[dict]) -> list[str]:
    """Human-readable differences (empty: identical)."""
    diffs = []
    for a, b in zip(ours, theirs):
        if a["token_ids"] != b["token_ids"] or a["finish_reason"] != b["finish_reason"]:
            n = next((k for k, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y),
                     min(len(a["token_ids"]), len(b["token_ids"])))
            diffs.append(f"{a['label']}: first difference at token {n}; ours {a['finish_reason']} "
                         f"{bytes(t for t in a['token_ids'] if t < 256)!r}, vLLM {b['finish_reason']} "
                         f"{bytes(t for t in b['token_ids'] if t < 256)!r}")
    return diffs


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-url", help="a running vllm serve of the preset model (--enable-scale-out)")
    ap.add_argument("--ours-url", help="a running tokserve gateway serving the preset model")
    ap.add_argument("--record", action="store_true", help=f"write vLLM's answers to {GOLDEN}")
    ap.add_argument("--vllm-version", default="vllm-cpu 0.32.0", help="recorded with the answers")
    args = ap.parse_args(argv)
    folder = model_dir()
    theirs = None
    if args.vllm_url:
        theirs = run(args.vllm_url)
        if args.record:
            GOLDEN.parent.mkdir(parents=True, exist_ok=True)
            GOLDEN.write_text(json.dumps({
                "vllm": args.vllm_version, "xgrammar": "0.2.8", "structured_outputs_config": CONFIG, "preset": PRESET, "weights_sha256": weights_sha256(folder),
                "cases": [dict(r, request=request_body(i, c)) for i, (r, c) in enumerate(zip(theirs, CASES))]},
                indent=1) + "\n")
            print(f"recorded {len(theirs)} answers to {GOLDEN}")
    if args.ours_url:
        golden = json.loads(GOLDEN.read_text())
        if theirs is None:
            if golden["weights_sha256"] != weights_sha256(folder):
                print("the preset model differs from the recorded one: re-record", file=sys.stderr)
                return 2
            theirs = golden["cases"]
        ours = run(args.ours_url)
        diffs = compare(ours, theirs)
        stops = sum(r["finish_reason"] == "stop" for r in theirs)
        print(f"{len(ours) - len(diffs)}/{len(ours)} constrained greedy requests identical to vLLM "
              f"({stops} ended by the grammar)")
        for d in diffs:
            print("  " + d)
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
