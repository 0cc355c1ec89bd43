"""Sampler and detokenizer micro-benchmarks, side by side in one run.

    python benchmarks/bench_sampler.py [--batch 64] [--vocab 32000] [--steps 50]

Rows printed (time per decode step, and ratio to the first row of each group):
- sampler: all-greedy fast path vs plain temperature vs every feature on, and a
  naive reference (softmax + torch.multinomial per row, penalties rebuilt from lists);
- penalties: vLLM's dense [R, V] formulation vs our sparse (row, seen token) entries,
  with rows kept across steps (incremental) or rebuilt every step;
- detokenizer: incremental (prefix/read offsets) vs re-decoding the whole output
  every step, for a 512-token generation.
"""
from __future__ import annotations

import argparse
import time

import torch

from common.protocol import SamplingParams
from common.detokenizer import IncrementalDetokenizer
from worker.engine.sample.sampler import Sampler
from worker.engine.sample.sampling_metadata import SamplingMetadata, SamplingRow, make_generator


def _time(fn, steps: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def _rows(batch: int, prompt_len: int, out_len: int, **kw) -> list[SamplingRow]:
    rows = []
    for i in range(batch):
        p = SamplingParams(**kw)
        gen = make_generator(p.seed, i, "cpu") if p.seed is not None else None
        rows.append(SamplingRow(p, list(range(i, i + prompt_len)), list(range(out_len)),
                                generator=gen, stop_ids_for_min_tokens=[2]))
    return rows


def naive_sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    out = []
    for i, r in enumerate(rows):
        x = logits[i].clone()
        p = r.params
        counts = torch.bincount(torch.tensor(r.output_token_ids), minlength=x.shape[0]).float()
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        x /= max(p.temperature, 1e-5)
        if p.top_k > 0:
            kth = x.topk(p.top_k).values[-1]
            x[x < kth] = float("-inf")
        probs = x.softmax(-1)
        out.append(torch.multinomial(probs, 1, generator=r.generator))
    return torch.cat(out)


def bench_sampler(batch: int, vocab: int, steps: int) -> None:
    logits = torch.randn(batch, vocab)
    sampler = Sampler()
    cases = {
        "all greedy (fast path)": _rows(batch, 64, 32, temperature=0.0),
        "temperature only": _rows(batch, 64, 32, temperature=0.8),
        "top_k+top_p+min_p": _rows(batch, 64, 32, temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
        "all features + logprobs=5": _rows(
            batch, 64, 32, temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=1,
            presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
            logit_bias={1: 2.0}, min_tokens=64, logprobs=5),
    }
    print(f"sampler: batch={batch} vocab={vocab}")
    base = None
    for name, rows in cases.items():
        def step(rows=rows):
            meta = SamplingMetadata.build(rows, vocab, "cpu")
            sampler(logits.clone(), meta)
        t = _time(step, steps)
        base = base or t
        print(f"  {name:<28} {t * 1e3:8.3f} ms/step  x{t / base:6.2f}")
    pen_rows = _rows(batch, 64, 32, temperature=0.8, top_k=50, frequency_penalty=0.5,
                     presence_penalty=0.5, seed=1)
    t_naive = _time(lambda: naive_sample(logits, pen_rows), max(steps // 5, 3))
    t_ours = _time(lambda: sampler(logits.clone(), SamplingMetadata.build(pen_rows, vocab, "cpu")),
                   steps)
    print(f"  naive per-row multinomial    {t_naive * 1e3:8.3f} ms/step  "
          f"(ours on the same rows {t_ours * 1e3:.3f} ms: x{t_naive / t_ours:.1f} faster)")

    print("penalties (greedy rows, 256-token prompts, 512-token outputs):")
    kept = _rows(batch, 256, 512, temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.3,
                 presence_penalty=0.2)

    def dense_step():
        # vLLM's formulation: [R, V] bin counts and masks rebuilt every step
        x = logits.clone()
        prompt = torch.tensor([r.prompt_token_ids for r in kept])
        out = torch.tensor([r.output_token_ids for r in kept])
        counts = torch.zeros(batch, vocab + 1).scatter_add_(1, out, torch.ones_like(out, dtype=torch.float))[:, :vocab]
        pmask = torch.zeros(batch, vocab + 1, dtype=torch.bool).scatter_(1, prompt, True)[:, :vocab]
        rep = torch.full((batch, 1), 1.1)
        seen = pmask | (counts > 0)
        x *= torch.where(seen, torch.where(x > 0, 1 / rep, rep), torch.ones_like(x))
        x -= 0.3 * counts + 0.2 * (counts > 0)
        x.argmax(-1)

    def fresh_step():
        rows = [SamplingRow(r.params, r.prompt_token_ids, list(r.output_token_ids)) for r in kept]
        sampler(logits.clone(), SamplingMetadata.build(rows, vocab, "cpu"))

    def kept_step():
        for r in kept:
            r.output_token_ids.append(7)
        sampler(logits.clone(), SamplingMetadata.build(kept, vocab, "cpu"))

    plain = _rows(batch, 256, 512, temperature=0.0)
    t_plain = _time(lambda: sampler(logits.clone(), SamplingMetadata.build(plain, vocab, "cpu")),
                    steps)
    t_dense = _time(dense_step, steps)
    t_fresh = _time(fresh_step, steps)
    t_kept = _time(kept_step, steps)
    print(f"  dense [R,V] penalties (vLLM) {t_dense * 1e3:8.3f} ms/step  x1.00")
    print(f"  sparse, fresh rows           {t_fresh * 1e3:8.3f} ms/step  x{t_fresh / t_dense:.2f}")
    print(f"  sparse, kept rows            {t_kept * 1e3:8.3f} ms/step  x{t_kept / t_dense:.2f}")
    print(f"  (no penalties at all         {t_plain * 1e3:8.3f} ms/step  x{t_plain / t_dense:.2f})")


def bench_detokenizer() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, café 日本語"] * 20,
                            trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    ids = (tok.encode("the quick brown fox jumps over the lazy dog, café 日本語 ").ids * 64)[:512]

    def incremental():
        d = IncrementalDetokenizer(tok, [1, 2, 3], SamplingParams(stop=["zzz"]))
        for t in ids:
            d.update([t])
        d.flush()

    def full_redecode():
        prev = ""
        for n in range(1, len(ids) + 1):
            text = tok.decode(ids[:n])
            _ = text[len(prev):]
            prev = text

    t_full = _time(full_redecode, 3)
    t_inc = _time(incremental, 3)
    print("detokenizer: 512-token generation")
    print(f"  full re-decode each step     {t_full * 1e3:8.2f} ms  x1.00")
    print(f"  incremental                  {t_inc * 1e3:8.2f} ms  x{t_inc / t_full:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    bench_sampler(args.batch, args.vocab, args.steps)
    bench_detokenizer()


if __name__ == "__main__":
    main()
