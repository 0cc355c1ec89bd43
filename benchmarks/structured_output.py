"""Structured outputs: constrained vs unconstrained decode throughput, and time to first
token with a cold vs warm grammar cache, side by side from one run of one engine.

Model: the ``125m`` preset shape (benchmarks/model_presets.py, random weights) with a
32000-token byte-level BPE written for this run (256 bytes, every printable-ASCII pair
and the first triples, merges included), so the grammar masks cover a real-sized
vocabulary (the presets' byte tokenizer has 256 ordinary tokens and specials).

- throughput: N concurrent requests x O output tokens (EOS ignored, greedy), once
  unconstrained and once constrained by a JSON schema (an array of objects that never has
  to end) whose compiled grammar is already cached; at concurrency 1 and 32.
- TTFT: one request, its first token: unconstrained; the engine's first structured
  request (backend start: TokenizerInfo + compiler); a new schema (cold cache: compile);
  the same schema again (warm cache).

    python benchmarks/structured_output.py                 # 125m, c=1 and 32, 64 output tokens
    python benchmarks/structured_output.py --size small --output-len 32
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.protocol import GenerateRequest, SamplingParams, StructuredOutputs  # noqa: E402
from worker.engine import Engine, EngineConfig  # noqa: E402

ARRAY_SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"]}}


def cold_schema(i: int) -> dict:
    """A schema nobody compiled yet (its key differs), of a realistic size."""
    props = {f"field_{i}_{k}": {"type": t} for k, t in enumerate(["string", "integer", "number", "boolean"] * 4)}
    props["nested"] = {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "label": {"enum": ["a", "b", "c"]}},
        "required": ["id"]}}}, "required": ["items"]}
    return {"type": "object", "properties": props, "required": list(props)}


def write_bpe_tokenizer(out: Path, vocab_size: int, specials: list[str]) -> None:
    """A byte-level BPE of ``vocab_size`` ids: the 256 byte symbols, printable pairs, triples."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_syms = sorted(alphabet)
    printable = [c for c in byte_syms if c.isprintable()][:95]
    vocab = {s: i for i, s in enumerate(byte_syms)}
    merges = []
    room = vocab_size - len(specials)
    for a in printable:
        for b in printable:
            if len(vocab) >= room:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    for a in printable:
        for b in printable:
            for c in printable:
                if len(vocab) >= room:
                    break
                vocab[a + b + c] = len(vocab)
                merges.append((a + b, c))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {str(tok.token_to_id(t)): {"content": t, "special": True} for t in specials}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    config = json.loads((out / "config.json").read_text())
    config["bos_token_id"], config["eos_token_id"] = tok.token_to_id(specials[0]), tok.token_to_id(specials[1])
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": config["bos_token_id"],
                                                            "eos_token_id": config["eos_token_id"]}))


def build_model(tmp: Path, size: str) -> Path:
    from benchmarks.model_presets import BOS_TOKEN, EOS_TOKEN, SIZES, build_preset_model

    src = build_preset_model(size)
    out = tmp / "model"
    shutil.copytree(src, out)
    write_bpe_tokenizer(out, SIZES[size]["vocab_size"], [BOS_TOKEN, EOS_TOKEN])
    return out


def _request(rid: str, prompt: list[int], output_len: int, so=None) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, structured_outputs=so))


def throughput(engine: Engine, concurrency: int, output_len: int, so, tag: str) -> float:
    reqs = [_request(f"{tag}-{concurrency}-{i}", [5 + i % 50] * 16, output_len, so) for i in range(concurrency)]
    t0 = time.perf_counter()
    res = engine.generate(reqs)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(d.token_ids) for r in res.values() for d in r)
    return tokens / elapsed


def ttft(engine: Engine, rid: str, so) -> float:
    t0 = time.perf_counter()
    engine.add_request(_request(rid, [7] * 16, 1, so))
    while rid in engine.requests:
        engine.step()
    errors = engine.take_request_errors()
    if errors:
        raise RuntimeError(errors)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="125m", help="benchmarks/model_presets.py size (vocab >= 9400)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3,
                    help="alternate unconstrained / constrained rounds and keep each one's best (noisy hosts)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="tokserve-so-bench-") as tmp:
        model_dir = build_model(Path(tmp), args.size)
        engine = Engine(EngineConfig(model=str(model_dir), max_num_seqs=max(args.concurrency),
                                     max_model_len=16 + args.output_len + 16, enable_prefix_caching=False,
                                     num_threads=args.threads))
        engine.generate([_request("warmup", [5] * 16, 4)])
        print(f"model {args.size} preset, vocab {engine.vocab_size} (byte-level BPE), {args.output_len} output "
              f"tokens/request, greedy, ignore_eos; torch threads {torch.get_num_threads()}")
        so_json = StructuredOutputs(json=json.dumps(ARRAY_SCHEMA), disable_any_whitespace=True)

        t_first = ttft(engine, "ttft-first", StructuredOutputs(json=json.dumps(cold_schema(0))))
        t_plain, t_cold, t_warm = (float("inf"),) * 3
        for r in range(args.repeat):  # best of: a new schema each round for the cold one
            t_plain = min(t_plain, ttft(engine, f"ttft-plain{r}", None))
            t_cold = min(t_cold, ttft(engine, f"ttft-cold{r}", StructuredOutputs(json=json.dumps(cold_schema(1 + r)))))
            t_warm = min(t_warm, ttft(engine, f"ttft-warm{r}", StructuredOutputs(json=json.dumps(cold_schema(1 + r)))))
        engine.generate([_request("warm-grammar", [5] * 16, 2, so_json)])  # the throughput grammar is cached

        print(f"\n{'concurrency':>11} | {'unconstrained tok/s':>19} | {'json schema tok/s':>17} | ratio")
        for c in args.concurrency:
            plain = constrained = 0.0
            for r in range(args.repeat):
                plain = max(plain, throughput(engine, c, args.output_len, None, f"plain{r}"))
                constrained = max(constrained, throughput(engine, c, args.output_len, so_json, f"json{r}"))
            print(f"{c:>11} | {plain:>19.1f} | {constrained:>17.1f} | {constrained / plain:5.2f}x")
        cache = engine.structured_output.cache
        print(f"\nTTFT (1 request, 16 prompt tokens, best of {args.repeat})")
        print(f"  unconstrained                              {t_plain * 1000:8.1f} ms")
        print(f"  first structured request (backend start)   {t_first * 1000:8.1f} ms")
        print(f"  new schema, cold grammar cache (compile)   {t_cold * 1000:8.1f} ms")
        print(f"  same schema, warm grammar cache            {t_warm * 1000:8.1f} ms")
        print(f"grammar cache: {len(cache)} entries, {cache.num_bytes / 1e6:.1f} MB, {cache.hits} hits, "
              f"{cache.misses} misses")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
