"""benchmarks/compare_vllm.py and benchmarks/model_presets.py: the parts that run
without vLLM (skip path, agreement maths, table, server lifecycle) and the preset
model folders loading in our engine."""
from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

from benchmarks import compare_vllm
from benchmarks.model_presets import SIZES, build_preset_model, special_tokens
from benchmarks.serve import free_port


def test_skips_cleanly_without_vllm(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(compare_vllm, "DEFAULT_VLLM_BIN", str(tmp_path / "missing"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert compare_vllm.main(["--vllm-bin", str(tmp_path / "nope")]) == 0
    assert "skipped, vLLM is not installed" in capsys.readouterr().err


def test_agreement_counts_identical_and_prefix():
    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    theirs = [[1, 2, 3, 4], [5, 6, 0, 8], [1, 9]]
    exact, prefix = compare_vllm.agreement(ours, theirs)
    assert exact == pytest.approx(1 / 3)
    assert prefix == pytest.approx((1.0 + 0.5 + 0.0) / 3)


def test_parse_args_sizes_max_model_len_and_cells():
    args = compare_vllm.parse_args(["--concurrency", "1,8", "--input-lens", "128,512", "--output-len", "128"])
    assert args.max_model_len == 768  # 512 + 128 rounded up to 256
    assert compare_vllm.level_sizes(args) == [(128, 1, 8), (128, 8, 16), (512, 1, 8), (512, 8, 16)]
    with pytest.raises(SystemExit):
        compare_vllm.parse_args(["--concurrency", ""])


def test_table_has_one_row_per_cell_with_ratios():
    row = dict(input_len=128, concurrency=32, requests=64, failed=0, out_tok_per_s=200.0, ttft_p50_ms=10.0,
               ttft_p99_ms=20.0, itl_p50_ms=1.0, itl_p99_ms=2.0, tpot_p50_ms=1.5, cpu_cores=1.0)
    other = dict(row, out_tok_per_s=100.0, ttft_p50_ms=20.0, itl_p50_ms=0.0)
    lines = compare_vllm.format_table([(row, other)]).splitlines()
    cell = lines[2].split()
    assert cell[:3] == ["128", "32", "64"]
    assert cell[3:6] == ["200.0", "100.0", "2.00"]  # tok/s ours, vLLM, ratio
    assert cell[6:9] == ["10.0", "20.0", "0.50"]  # TTFT p50
    assert "n/a" in lines[2]  # division by a zero ITL is reported, not raised


_FAKE_SERVER = textwrap.dedent("""
    import http.server, subprocess, sys
    # A grandchild that would outlive a naive kill of the leader only.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: session id
                    pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_managed_server_ready_and_stop_kills_whole_session(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(_FAKE_SERVER)
    port = free_port()
    server = compare_vllm.ManagedServer("fake", [sys.executable, str(script), str(port)], {}, port, str(tmp_path))
    server.start()
    try:
        server.wait_ready(time.monotonic() + 30)
        sid = server.proc.pid
        deadline = time.monotonic() + 10
        while len(_session_pids(sid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_session_pids(sid)) >= 2  # leader + grandchild
        assert server.cpu_seconds() > 0.0  # interpreter start-up of the session's processes
    finally:
        server.stop(grace=0.2)  # the fake ignores nothing, but the grandchild needs the SIGKILL sweep
    time.sleep(0.2)
    assert _session_pids(sid) == []


def test_wait_ready_reports_an_early_exit_with_the_log(tmp_path):
    port = free_port()
    server = compare_vllm.ManagedServer(
        "broken", [sys.executable, "-c", "import sys; print('boom: bad flag'); sys.exit(3)"], {}, port, str(tmp_path))
    server.start()
    with pytest.raises(RuntimeError, match=r"broken exited with code 3(.|\n)*boom: bad flag"):
        server.wait_ready(time.monotonic() + 30)
    server.stop()


def test_special_tokens_fill_the_vocabulary():
    toks = special_tokens(300)
    assert len(toks) == 300 - 256 and toks[2] == "<|reserved_0|>"
    with pytest.raises(ValueError):
        special_tokens(100)
    assert all(cfg["head_dim"] in (64, 128) for cfg in SIZES.values())  # vLLM's CPU kernels need these


def test_small_preset_loads_in_our_engine(tmp_path):
    from worker.engine.models.config import ModelConfig
    from common.tokenizer import load_tokenizer

    path = build_preset_model("small", tmp_path / "m")
    assert build_preset_model("small", tmp_path / "m") == path  # cached, not rebuilt
    cfg = ModelConfig.from_dir(path)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (256, 4, 258)
    tok = load_tokenizer(path, cfg.eos_token_ids)
    assert tok is not None
    with pytest.raises(ValueError, match="unknown model size"):
        build_preset_model("7b", tmp_path / "x")


def test_median_row_takes_per_metric_medians():
    rows = [dict(input_len=128, out_tok_per_s=v, ttft_p50_ms=t) for v, t in ((100.0, 9.0), (300.0, 1.0), (200.0, 5.0))]
    med = compare_vllm.median_row(rows)
    assert (med["out_tok_per_s"], med["ttft_p50_ms"], med["input_len"], med["rounds"]) == (200.0, 5.0, 128, 3)
    assert compare_vllm.median_row(rows[:2])["out_tok_per_s"] == 200.0  # even count: mean of the middle two
    counts = compare_vllm.median_row([dict(num_requests=n, failed=f) for n, f in ((32, 0), (32, 1))])
    assert counts["num_requests"] == 32 and counts["failed"] == 0 and isinstance(counts["failed"], int)
