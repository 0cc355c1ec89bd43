"""`tokserve bench serve` against a launched stack: open-loop Poisson load, vLLM's report
fields, goodput equal to a recomputation from the per-request records, datasets; and
`benchmarks.serve --api chat` (generate vs the OpenAI facades) on the same stack."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_serve, serve
from tests.support.gateway_helpers import start_gateway
from tests.support.procs import ProcGroup, wait_for_workers

ROOT = Path(__file__).resolve().parents[2]
SHAREGPT = ROOT / "tests" / "support" / "data" / "sharegpt_small.json"
# The demo model's template: the tiny llama's tokenizer has none.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + "
                 "message['content'] | trim + eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def base_url(tmp_path_factory, llama_dir):
    with ProcGroup(tmp_path_factory.mktemp("bench-stack")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(llama_dir), "--threads", "1", "--num-kv-blocks", "256",
                     "--max-num-seqs", "16")
        wait_for_workers(broker.frontend, 1, timeout=120)
        yield start_gateway(procs, broker.frontend, "--tokenizer", str(llama_dir),
                            "--chat-template", CHAT_TEMPLATE).url


def test_bench_serve_open_loop_report_and_goodput(base_url, tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "common.cli", "bench", "serve", "--base-url", base_url,
                           "--num-prompts", "40", "--request-rate", "20", "--input-len", "24", "--output-len", "6",
                           "--random-range-ratio", "0.5", "--goodput", "ttft:400", "tpot:200",
                           "--save-result", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    for line in ("Serving Benchmark Result", "Successful requests:", "Request goodput (req/s):",
                 "Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "P90 E2EL (ms):"):
        assert line in text, line
    m = json.loads(out.read_text())
    assert m["completed"] == 40 and m["failed"] == 0 and m["request_rate"] == 20
    assert m["total_output_tokens"] == sum(m["output_lens"]) and all(n >= 3 for n in m["output_lens"])
    # 40 requests at 20/s: the arrivals alone take about two seconds.
    assert 1.0 < m["duration"] < 60 and 0 < m["request_throughput"] <= 40 / 1.0
    assert 0 < m["mean_ttft_ms"] <= m["p99_ttft_ms"] and m["median_itl_ms"] > 0
    good = sum(1 for t, p, e in zip(m["ttfts"], m["tpots"], m["e2els"]) if t * 1e3 <= 400 and (p or 0) * 1e3 <= 200)
    assert m["request_goodput"] == pytest.approx(good / m["duration"])
    assert len(m["itls"]) == 40 and all(len(i) == n - 1 for i, n in zip(m["itls"], m["output_lens"]))


def test_closed_loop_with_concurrency_and_prefix_dataset(base_url):
    requests = bench_serve.prefix_repetition_dataset(12, 32, 8, 2, 4, 256, seed=1)
    assert requests[0].prompt[:32] == requests[2].prompt[:32] != requests[1].prompt[:32]
    import asyncio

    results, duration = asyncio.run(bench_serve.run_load(base_url, requests, float("inf"), 1.0, 3, None, None, 0))
    m = bench_serve.compute_metrics(requests, results, duration, [99.0], {}, float("inf"), 3)
    assert m["completed"] == 12 and m["total_output_tokens"] == 48 and "request_goodput" not in m


def test_sharegpt_loader_and_arrival_process():
    encode = bench_serve.load_encoder(None)
    data = bench_serve.sharegpt_dataset(str(SHAREGPT), 10, encode, seed=0, output_len=None)
    assert len(data) == 4  # the too-short prompt and the conversation without a reply are skipped
    assert {r.output_len for r in data} == {len("Four."), len("Red, green and blue."),
                                            len("I am fine, thank you for asking. How are you?"),
                                            len("Waves fold into foam / the tide keeps its slow promise / salt on the "
                                                "cold wind")}
    assert all(r.output_len == 7 for r in bench_serve.sharegpt_dataset(str(SHAREGPT), 10, encode, 0, 7))
    assert bench_serve.parse_goodput(["ttft:5", "e2el:9"]) == {"ttft": 5.0, "e2el": 9.0}
    with pytest.raises(SystemExit):
        bench_serve.parse_goodput(["latency:5"])


def test_plot_and_sweep_write_pngs(base_url, tmp_path):
    from PIL import Image

    run_png, sweep_png, sweep_json = tmp_path / "run.png", tmp_path / "sweep.png", tmp_path / "sweep.json"
    common = [sys.executable, "-m", "common.cli", "bench", "serve", "--base-url", base_url, "--num-prompts", "8",
              "--input-len", "16", "--output-len", "4"]
    proc = subprocess.run(common + ["--request-rate", "40", "--plot", str(run_png)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with Image.open(run_png) as img:
        assert img.size == (1200, 400) and img.format == "PNG"
    proc = subprocess.run(common + ["--sweep-rates", "10,40", "--compare-url", base_url, "--labels", "a,b",
                                    "--plot", str(sweep_png), "--save-result", str(sweep_json)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = json.loads(sweep_json.read_text())
    assert set(points) == {"a", "b"} and [p["request_rate"] for p in points["a"]] == [10, 40]
    assert all(p["completed"] == 8 and p["output_throughput"] > 0 for pts in points.values() for p in pts)
    with Image.open(sweep_png) as img:
        assert img.size == (1200, 400)


def test_serve_api_chat_runs_one_workload_through_generate_and_the_facades(base_url, capsys):
    args = serve.parse_args(["--api", "chat", "--base-url", base_url, "--concurrency", "2", "--num-prompts", "4",
                             "--input-len", "40", "--output-len", "5"])
    rows = serve.bench_apis(base_url, args, 256, None)
    assert set(rows) == set(serve.APIS) == {"generate", "completions", "chat"}
    for api in serve.APIS:
        (row,) = rows[api]
        assert (row["requests"], row["failed"], row["concurrency"]) == (4, 0, 2), api
        # every request produced exactly max_tokens (usage.completion_tokens on the facades)
        assert row["out_tok_per_s"] * row["duration_s"] == pytest.approx(4 * 5), api
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p90_ms"] and row["first_chunk_p50_ms"] > 0, api
    assert rows["completions"][0]["prompt_tokens_mean"] == 40  # the same token ids, per usage
    assert abs(rows["chat"][0]["prompt_tokens_mean"] - 40) <= 2  # text sized with /tokenize
    serve.print_api_table(rows)
    out = capsys.readouterr().out
    assert "tok/s ratio" in out and out.count("x / ") == 2
