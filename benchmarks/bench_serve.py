"""``tokserve bench serve``: load a token-in/token-out deployment the way ``vllm bench
serve`` does, against any base URL (ours or vLLM's ``--enable-scale-out``).

    tokserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 10
    tokserve bench serve --dataset sharegpt-json FILE --tokenizer MODEL_DIR --request-rate inf --max-concurrency 32
    tokserve bench serve --dataset prefix-repetition --prefix-len 512 --suffix-len 64 --num-prefixes 4 \\
        --goodput ttft:500 tpot:50 --save-result out.json

Arrivals are a gamma process at ``--request-rate`` (``--burstiness 1`` = Poisson; ``inf``
sends everything at once), capped by ``--max-concurrency``.  Each request streams its
output (``ignore_eos``, so lengths are what the dataset asks), and TTFT / TPOT / ITL /
end-to-end latency are measured from the SSE chunks.  The report uses vLLM's text
layout and ``--save-result`` its JSON field names, plus the per-request records
(``ttfts``, ``tpots``, ``e2els``, ``itls``, ``errors``) goodput is computed from.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import msgspec

from benchmarks.serve import Result, http_one, percentile
from benchmarks.sse_client import SseConnection

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class SampleRequest:
    prompt: list[int]
    output_len: int


# ----------------------------------------------------------------------------- datasets
def random_dataset(num: int, input_len: int, output_len: int, range_ratio: float, vocab: int,
                   seed: int) -> list[SampleRequest]:
    """Uniform token ids; lengths uniform in [len * (1 - r), len * (1 + r)] (vLLM's random dataset)."""
    rng = random.Random(seed)

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    return [SampleRequest([rng.randrange(vocab) for _ in range(length(input_len))], length(output_len))
            for _ in range(num)]


def prefix_repetition_dataset(num: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int,
                              vocab: int, seed: int) -> list[SampleRequest]:
    """Each prompt = one of ``num_prefixes`` shared prefixes + its own suffix (prefix-cache reuse)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(max(1, num_prefixes))]
    return [SampleRequest(prefixes[i % len(prefixes)] + [rng.randrange(vocab) for _ in range(suffix_len)],
                          output_len) for i in range(num)]


def load_encoder(tokenizer_dir: Optional[str]):
    """text -> token ids: the model's tokenizer.json, else UTF-8 bytes (the demo model's byte vocabulary)."""
    if tokenizer_dir is None:
        return lambda text: list(text.encode("utf-8"))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def sharegpt_dataset(path: str, num: int, encode, seed: int, output_len: Optional[int],
                     max_len: int = 4096) -> list[SampleRequest]:
    """ShareGPT JSON (a list of {"conversations": [{"from", "value"}, ...]}): the first human
    turn is the prompt, the reply's token count the output length (unless --output-len)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    convs = [d.get("conversations") or d.get("conversation") or [] for d in data]
    convs = [c for c in convs if len(c) >= 2]
    random.Random(seed).shuffle(convs)
    out = []
    for conv in convs:
        prompt = encode(conv[0]["value"])
        completion = len(encode(conv[1]["value"]))
        n_out = output_len or completion
        if len(prompt) < 4 or n_out < 1 or len(prompt) + n_out > max_len:  # vLLM's filter, roughly
            continue
        out.append(SampleRequest(prompt, n_out))
        if len(out) == num:
            break
    if not out:
        raise SystemExit(f"{path}: no usable conversations")
    return out


# ----------------------------------------------------------------------------- load
async def arrivals(n: int, rate: float, burstiness: float, seed: int):
    """Yield request indices at gamma-distributed intervals (mean 1/rate; shape = burstiness)."""
    rng = random.Random(seed)
    for i in range(n):
        yield i
        if math.isinf(rate) or i == n - 1:
            continue
        await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))


def body_for(req: SampleRequest, model: Optional[str]) -> bytes:
    body = {"token_ids": req.prompt, "stream": True,
            "sampling_params": {"max_tokens": req.output_len, "min_tokens": req.output_len, "ignore_eos": True,
                                "temperature": 0.0, "detokenize": False}}
    if model:
        body["model"] = model
    return msgspec.json.encode(body)


async def one_request(pool: asyncio.Queue, body: bytes) -> Result:
    conn: SseConnection = await pool.get()  # a free connection slot: the concurrency cap
    try:
        return await http_one(conn, body)
    finally:
        pool.put_nowait(conn)


async def run_load(base_url: str, requests: list[SampleRequest], rate: float, burstiness: float,
                   max_concurrency: Optional[int], model: Optional[str], api_key: Optional[str],
                   seed: int) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    conns = max_concurrency or len(requests)
    pool: asyncio.Queue = asyncio.Queue()
    for _ in range(conns):  # a connection slot is the concurrency cap
        pool.put_nowait(SseConnection(base_url, headers))
    tasks = []
    start = time.perf_counter()
    async for i in arrivals(len(requests), rate, burstiness, seed):
        tasks.append(asyncio.create_task(one_request(pool, body_for(requests[i], model))))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    while not pool.empty():
        await pool.get_nowait().close()
    return list(results), duration


# ----------------------------------------------------------------------------- report
def parse_goodput(items: Optional[list[str]]) -> dict[str, float]:
    slos = {}
    for item in items or ():
        name, _, value = item.partition(":")
        if name not in GOODPUT_METRICS or not value:
            raise SystemExit(f"--goodput takes {'|'.join(GOODPUT_METRICS)}:MS pairs, got {item!r}")
        slos[name] = float(value)
    return slos


def is_good(ttft_ms: float, tpot_ms: Optional[float], e2el_ms: float, slos: dict[str, float]) -> bool:
    values = {"ttft": ttft_ms, "tpot": tpot_ms if tpot_ms is not None else 0.0, "e2el": e2el_ms}
    return all(values[k] <= v for k, v in slos.items())


def compute_metrics(requests: list[SampleRequest], results: list[Result], duration: float,
                    percentiles: list[float], slos: dict[str, float], rate: float,
                    max_concurrency: Optional[int]) -> dict:
    ok = [(q, r) for q, r in zip(requests, results) if r.error is None]
    ttfts = [r.ttft * 1e3 for _, r in ok]
    tpots = [r.tpot * 1e3 for _, r in ok if r.tpot is not None]
    itls = [x * 1e3 for _, r in ok for x in r.itls]
    e2els = [r.e2e * 1e3 for _, r in ok]
    total_in = sum(len(q.prompt) for q, _ in ok)
    total_out = sum(r.output_tokens for _, r in ok)
    out = {
        "request_rate": rate if not math.isinf(rate) else "inf", "max_concurrency": max_concurrency,
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    if slos:
        good = sum(is_good(r.ttft * 1e3, r.tpot * 1e3 if r.tpot is not None else None, r.e2e * 1e3, slos)
                   for _, r in ok)
        out["request_goodput"] = good / duration
        out["goodput_slos_ms"] = slos
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        out[f"mean_{name}_ms"] = sum(values) / len(values) if values else float("nan")
        out[f"median_{name}_ms"] = percentile(values, 50)
        out[f"std_{name}_ms"] = (math.sqrt(sum((v - out[f"mean_{name}_ms"]) ** 2 for v in values) / len(values))
                                 if values else float("nan"))
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = percentile(values, p)
    # Per-request records, in request order (failed requests: zeros and their error).
    out["input_lens"] = [len(q.prompt) for q in requests]
    out["output_lens"] = [r.output_tokens for r in results]
    out["ttfts"] = [r.ttft for r in results]
    out["tpots"] = [r.tpot for r in results]
    out["e2els"] = [r.e2e for r in results]
    out["itls"] = [r.itls for r in results]
    out["errors"] = [r.error or "" for r in results]
    return out


def format_report(m: dict, percentiles: list[float]) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value, fmt: str = ".2f") -> None:
        lines.append(f"{label:<40}{value:<10{fmt}}" if fmt else f"{label:<40}{value:<10}")

    row("Successful requests:", m["completed"], "")
    row("Failed requests:", m["failed"], "")
    if m["max_concurrency"] is not None:
        row("Maximum request concurrency:", m["max_concurrency"], "")
    row("Request rate configured (RPS):", m["request_rate"], ".2f" if m["request_rate"] != "inf" else "")
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "")
    row("Total generated tokens:", m["total_output_tokens"], "")
    row("Request throughput (req/s):", m["request_throughput"])
    if "request_goodput" in m:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    for name, title, header in (("ttft", "TTFT", "Time to First Token"),
                                ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                                ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency")):
        lines.append("{s:{c}^50}".format(s=header, c="-"))
        row(f"Mean {title} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {title} (ms):", m[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{p:g} {title} (ms):", m[f"p{p:g}_{name}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots
def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot / --sweep-rates need matplotlib: pip install 'tokserve[bench]'") from None
    return plt


def plot_run(results: list[Result], path: str, title: str = "") -> None:
    """1200 x 400 px: TTFT CDF, ITL CDF, output tokens/s over time (1 s bins)."""
    plt = _pyplot()
    ok = [r for r in results if r.error is None]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4), dpi=100)
    for ax, values, label in ((axes[0], [r.ttft * 1e3 for r in ok], "TTFT (ms)"),
                              (axes[1], [x * 1e3 for r in ok for x in r.itls], "ITL (ms)")):
        values = sorted(values)
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))] if values else [])
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests" if label.startswith("TTFT") else "fraction of tokens")
        ax.grid(alpha=0.3)
    t0 = min((r.start for r in results), default=0.0)
    times = [t - t0 for r in ok for t in r.token_times]
    bins = max(1, math.ceil(max(times, default=1.0)))
    counts = [0] * bins
    for t in times:
        counts[min(int(t), bins - 1)] += 1
    axes[2].step(range(bins), counts, where="post")
    axes[2].set_xlabel("time (s)")
    axes[2].set_ylabel("output tokens / s")
    axes[2].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def sweep(args: argparse.Namespace, requests: list[SampleRequest], api_key: Optional[str],
          percentiles: list[float]) -> int:
    """Each rate on each URL, side by side; a chart of output tok/s vs p99 TTFT and E2EL."""
    rates = [float(r) for r in args.sweep_rates.split(",") if r]
    urls = [args.base_url] + ([args.compare_url] if args.compare_url else [])
    labels = (args.labels.split(",") + ["other"])[:len(urls)]
    points: dict[str, list[dict]] = {label: [] for label in labels}
    for rate in rates:
        for url, label in zip(urls, labels):  # alternate servers at each rate: drift hits both
            results, duration = asyncio.run(run_load(url, requests, rate, args.burstiness, args.max_concurrency,
                                                     args.model, api_key, args.seed))
            m = compute_metrics(requests, results, duration, sorted(set(percentiles) | {99.0}), {}, rate,
                                args.max_concurrency)
            points[label].append({k: m[k] for k in ("request_rate", "completed", "failed", "output_throughput",
                                                    "p99_ttft_ms", "p99_e2el_ms", "median_ttft_ms")})
            print(f"{label:>10}  rate {rate:6.2f}/s  {m['output_throughput']:9.1f} tok/s  "
                  f"p99 TTFT {m['p99_ttft_ms']:8.1f} ms  p99 E2EL {m['p99_e2el_ms']:8.1f} ms  failed {m['failed']}")
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(points, indent=1), encoding="utf-8")
    if args.plot:
        plt = _pyplot()
        fig, axes = plt.subplots(1, 2, figsize=(12, 4), dpi=100)
        for label, pts in points.items():
            for ax, key in zip(axes, ("p99_ttft_ms", "p99_e2el_ms")):
                ax.plot([p["output_throughput"] for p in pts], [p[key] for p in pts], marker="o", label=label)
        for ax, name in zip(axes, ("p99 TTFT (ms)", "p99 end-to-end latency (ms)")):
            ax.set_xlabel("output tokens / s")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(f"request rates {args.sweep_rates}/s, {len(requests)} requests each")
        fig.tight_layout()
        fig.savefig(args.plot)
        plt.close(fig)
    return 0 if all(p["completed"] for pts in points.values() for p in pts) else 1


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokserve bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="'model' sent with each request (default: none, the served model)")
    p.add_argument("--api-key", default=None, help="Bearer key (or $TOKSERVE_API_KEY)")
    p.add_argument("--dataset", default="random", choices=["random", "sharegpt-json", "prefix-repetition"])
    p.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file")
    p.add_argument("--tokenizer", default=None,
                   help="model folder with tokenizer.json for text datasets (default: UTF-8 bytes, the demo model)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=None, help="default 64 (sharegpt: the reply's length)")
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 -/+ r)")
    p.add_argument("--vocab-size", type=int, default=256, help="random token ids are drawn below this")
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--metric-percentiles", default="90,99")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS", help="SLOs, e.g. ttft:500 tpot:50")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default=None, metavar="FILE.json")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="latency CDFs (TTFT, ITL) and output tokens/s over time (needs matplotlib: the bench extra)")
    p.add_argument("--sweep-rates", default=None, metavar="R1,R2,...",
                   help="run each request rate (on --base-url and --compare-url) and chart throughput vs p99 latency")
    p.add_argument("--compare-url", default=None, help="a second server for --sweep-rates (e.g. vLLM)")
    p.add_argument("--labels", default="tokserve,other", help="names of --base-url and --compare-url in the sweep")
    return p


def dataset_from(args: argparse.Namespace) -> list[SampleRequest]:
    out_len = args.output_len
    if args.dataset == "random":
        return random_dataset(args.num_prompts, args.input_len, out_len or 64, args.random_range_ratio,
                              args.vocab_size, args.seed)
    if args.dataset == "prefix-repetition":
        return prefix_repetition_dataset(args.num_prompts, args.prefix_len, args.suffix_len, args.num_prefixes,
                                         out_len or 64, args.vocab_size, args.seed)
    if not args.dataset_path:
        raise SystemExit("--dataset sharegpt-json needs --dataset-path FILE")
    return sharegpt_dataset(args.dataset_path, args.num_prompts, load_encoder(args.tokenizer), args.seed, out_len)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        print("usage: tokserve bench serve [options]  (see: tokserve bench serve --help)")
        return 2
    args = build_parser().parse_args(argv[1:])
    if args.request_rate <= 0 or args.burstiness <= 0 or args.num_prompts < 1:
        raise SystemExit("--request-rate, --burstiness and --num-prompts must be positive")
    import os

    api_key = args.api_key or os.environ.get("TOKSERVE_API_KEY")
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p]
    slos = parse_goodput(args.goodput)
    requests = dataset_from(args)
    if args.sweep_rates:
        return sweep(args, requests, api_key, percentiles)
    results, duration = asyncio.run(run_load(args.base_url, requests, args.request_rate, args.burstiness,
                                             args.max_concurrency, args.model, api_key, args.seed))
    metrics = compute_metrics(requests, results, duration, percentiles, slos, args.request_rate,
                              args.max_concurrency)
    print(format_report(metrics, percentiles))
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(metrics, indent=1), encoding="utf-8")
    if args.plot:
        plot_run(results, args.plot, title=f"{args.base_url}, {args.num_prompts} requests at {args.request_rate:g}/s")
    return 0 if metrics["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
