"""benchmarks/gpu_check.py's CPU-runnable parts: options, the ~1B presets (counted by
arithmetic and on the meta device, nothing allocated), the table, the pytest-run row,
the near-tie logic, a dry run end to end, the watchdog, and the clear exit without a GPU."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def _script(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=ENV)


def test_options():
    a = gpu_check.parse_args([])
    assert a.model_list == ["llama", "qwen3", "qwen3_moe"] and a.batch_list == [1, 32, 128] and a.peak_gbps == 4800
    assert (a.prompt_len, a.output_len, a.size, a.device) == (128, 128, "full", "cuda")
    assert not a.skip_tests and not a.skip_vl and a.out is None and a.deadline_s < 480
    assert gpu_check.parse_args(["--skip-vl"]).skip_vl
    q = gpu_check.parse_args(["--quick", "--batches", "1,32,128"])
    assert q.batch_list == [1, 32] and q.output_len == 32 and q.prompt_len == 64 and q.size == "quick"
    d = gpu_check.parse_args(["--dry-run", "--models", "qwen3", "--skip-tests", "--peak-gbps", "3350"])
    assert d.size == "tiny" and d.model_list == ["qwen3"] and d.skip_tests and d.peak_gbps == 3350
    assert d.output_len == 8 and d.parity_tokens == 8
    o = gpu_check.parse_args(["--batches", "4, 8", "--device", "cuda:1", "--out", "x.md"])
    assert o.batch_list == [4, 8] and o.device == "cuda:1" and o.out == "x.md"
    for bad in (["--models", "gpt2"], ["--models", ""], ["--batches", "1,x"], ["--batches", "0"],
                ["--peak-gbps", "0"], ["--output-len", "1"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(bad)


@pytest.mark.parametrize("preset", ["llama", "qwen3"])
def test_presets_are_about_one_billion_parameters(preset):
    import transformers

    cfg = gpu_check.hf_config_dict(preset)
    n = gpu_check.param_count(cfg)
    assert 0.9e9 < n < 1.2e9, n
    quick = gpu_check.param_count(gpu_check.hf_config_dict(preset, "quick"))
    assert quick < 0.45 * n
    # transformers agrees, built on the meta device (no memory)
    arch = cfg.pop("arch")
    with torch.device("meta"):
        model = getattr(transformers, arch)(getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg))
    assert sum(p.numel() for p in model.parameters()) == n
    if preset == "qwen3":
        assert cfg["head_dim"] == 128 and cfg.get("arch", arch) == "Qwen3ForCausalLM"
        assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA


def test_moe_preset_counts_its_experts():
    import transformers

    cfg = gpu_check.hf_config_dict("qwen3_moe")
    n = gpu_check.param_count(cfg)
    assert 1.0e9 < n < 1.2e9, n
    arch = cfg.pop("arch")
    with torch.device("meta"):
        model = getattr(transformers, arch)(transformers.Qwen3MoeConfig(**cfg))
    assert sum(p.numel() for p in model.parameters()) == n
    weights, _ = gpu_check.decode_bytes_per_token(model, 0, 0)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    embed = model.model.embed_tokens.weight.numel()
    assert weights == (n - embed - experts + experts * 4 // 32) * 4  # only the top-4 of 32 experts are read


def test_param_count_matches_transformers_on_a_tiny_model():
    import transformers

    for preset in ("llama", "qwen3", "qwen3_moe"):
        cfg = gpu_check.hf_config_dict(preset, "tiny")
        arch = cfg.pop("arch")
        model = getattr(transformers, arch)(getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg))
        assert gpu_check.param_count({**cfg, "arch": arch}) == sum(p.numel() for p in model.parameters())


def test_table_format():
    out = gpu_check.table([gpu_check.Row("cuda tests", "-", "pass", "3 passed"),
                           gpu_check.Row("throughput bs=1", "llama", "2.00x HF", "a | b\nc")], "header")
    lines = out.splitlines()
    assert lines[0] == "header" and lines[1] == "" and lines[2] == "| check | model | result | detail |"
    assert lines[3] == "| --- | --- | --- | --- |" and lines[4] == "| cuda tests | - | pass | 3 passed |"
    assert lines[5] == "| throughput bs=1 | llama | 2.00x HF | a \\| b c |" and len(lines) == 6


def test_pytest_summary_and_test_files():
    s = gpu_check.parse_pytest_summary
    assert s("..F\n==== 2 passed, 1 failed, 3 skipped, 40 deselected in 9.1s ====") == \
        {"passed": 2, "failed": 1, "skipped": 3, "deselected": 40}
    assert s("= 1 passed, 2 errors in 1s =") == {"passed": 1, "error": 2}
    assert s("no tests ran") == {}
    files = gpu_check.cuda_test_files()
    assert "tests/cuda/test_engine_cuda.py" in files and "tests/cuda/test_triton_cuda.py" in files
    assert "tests/integration/test_gpu_check.py" not in files and all(f.startswith("tests/") for f in files)


def test_cuda_tests_row_from_a_subprocess(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: gpu\n")
    (tmp_path / "test_x.py").write_text(
        "import pytest\npytestmark = pytest.mark." + "cuda\n"  # split: this file carries no such mark
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 == 2\n"
        "@pytest.mark.skip(reason='no')\ndef test_skip():\n    pass\n"
        "def test_slow():\n    import os, time\n    if os.environ.get('SLOW'): time.sleep(60)\n")
    log = tmp_path / "log.txt"
    row = gpu_check.run_cuda_tests(timeout=60, files=["test_x.py"], cwd=tmp_path, log_path=log)
    assert row.result == "FAIL" and "2 passed, 1 failed, 1 skipped" in row.detail
    assert "failed: test_bad" in row.detail and "assert 1 == 2" in log.read_text()
    os.environ["SLOW"] = "1"
    try:
        row = gpu_check.run_cuda_tests(timeout=4, files=["test_x.py::test_slow"], cwd=tmp_path)
    finally:
        del os.environ["SLOW"]
    assert row.result == "FAIL" and "timed out after 4 s" in row.detail


def _delta(ids, tops):
    return SimpleNamespace(token_ids=ids, logprobs=SimpleNamespace(top_logprobs=tops))


def test_graphs_vs_eager_counts_near_ties():
    eager = [_delta([1, 2, 3], [[-0.1, -3.0]] * 3), _delta([1, 2, 3], [[-0.1, -3.0], [-0.70, -0.72], [-1, -2]]),
             _delta([4, 5], [[-0.1, -0.2], [-0.1, -5.0]])]
    graphed = [_delta([1, 2, 3], None), _delta([1, 9, 9], None), _delta([4, 6], None)]
    assert gpu_check.graphs_vs_eager(eager, graphed, tie_tol=0.05) == (1, 1, 1)
    row = gpu_check.graphs_row("m", {3: eager}, {3: graphed}, 0.05, "attention triton, 3 CUDA graphs", 3)
    assert row.result == "FAIL" and "1/3 identical" in row.detail
    row = gpu_check.graphs_row("m", {3: eager[:2]}, {3: graphed[:2]}, 0.05, "", 3)
    assert row.result == "pass (1 near-ties)"
    row = gpu_check.graphs_row("m", {1: eager[:1]}, {1: graphed[:1]}, 0.05, "", 0)
    assert row.result == "FAIL" and "no CUDA graph captured" in row.detail
    assert gpu_check.graph_batches(128) == [1, 11, 32, 100] and gpu_check.graph_batches(32) == [1, 11, 32]


def test_dense_logprobs_and_engine_kwargs():
    tl = SimpleNamespace(top_ids=[[2, 0, 1], [1, 2, 0]], top_logprobs=[[-0.25, -2.0, -3.0], [-0.5, -1.0, -4.0]])
    assert gpu_check.dense_logprobs(tl, 3).tolist() == [[-2.0, -3.0, -0.25], [-4.0, -0.5, -1.0]]
    kw = gpu_check.engine_kwargs(Path("/m"), "cuda", "bfloat16", max_num_seqs=128, eager=False, max_model_len=320,
                                 kv_bytes=1 << 30, attention_backend="auto")
    assert kw["enforce_eager"] is False and kw["max_num_seqs"] == 128 and kw["tokens_only"]
    assert kw.get("kv_cache_memory_bytes", 1 << 30) == 1 << 30 and "attention_backend" not in kw
    assert not kw["enable_prefix_caching"] and kw["max_logprobs"] == -1
    cpu = gpu_check.engine_kwargs(Path("/m"), "cpu", "float32", max_num_seqs=4, eager=True, max_model_len=64,
                                  kv_bytes=1 << 30, attention_backend="torch")
    assert "kv_cache_memory_bytes" not in cpu and cpu.get("attention_backend", "torch") == "torch"


def test_dry_run_end_to_end(tmp_path):
    out = tmp_path / "table.md"
    proc = _script("--dry-run", "--skip-tests", "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text.strip() in proc.stdout  # the same table printed and written
    assert text.startswith("GPU check on CPU dry run")
    for check in ("HF parity: logits", "HF parity: top-1 (teacher-forced)", "HF parity: greedy",
                  "CUDA graphs vs eager", "throughput bs=1", "throughput bs=32", "roofline bs=1"):
        assert text.count(f"| {check} |") == 3, check  # one row per model
    assert "FAIL" not in text and text.count("| pass |") == 9  # fp32 parity holds for every model
    assert "llama (" in text and "qwen3 (" in text and "qwen3_moe (" in text and "[gpu_check" in proc.stderr
    # the last stage: Qwen2-VL images/s, engine vs HF at concurrency 8 (8 requests in the dry run)
    last = text.strip().splitlines()[-1]
    assert last.startswith(f"| {gpu_check.VL_CHECK} | qwen2-vl tiny random"), last
    m = re.search(r"\| (\d+\.\d+)x HF \(target >= 3x: (met|NOT met)\) \| engine (\d+\.\d) images/s .*"
                  r"HF generate (\d+\.\d) images/s .*8 requests, 20 images", last)
    assert m and float(m.group(1)) > 0 and float(m.group(3)) > 0 and float(m.group(4)) > 0, last
    assert "engine-only" in last and (m.group(2) == "met") == (float(m.group(1)) >= 3)


def _vl_row(tmp_path, monkeypatch, *extra):
    """main() in-process with the model checks stubbed out: the VL stage's row (or None)."""
    monkeypatch.setattr(gpu_check, "check_model", lambda *a, **k: None)
    out = tmp_path / "t.md"
    assert gpu_check.main(["--dry-run", "--skip-tests", "--out", str(out), *extra]) == 0
    rows = [ln for ln in out.read_text().splitlines() if ln.startswith(f"| {gpu_check.VL_CHECK} |")]
    assert len(rows) <= 1
    return rows[0] if rows else None


def test_vl_stage_skips_clearly(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "_have_pillow", lambda: False)
    row = _vl_row(tmp_path, monkeypatch)
    assert "| skipped |" in row and "Pillow is not installed" in row
    monkeypatch.setattr(gpu_check, "_VL_ESTIMATE_S", {"tiny": 1e9})
    row = _vl_row(tmp_path, monkeypatch)
    assert "| skipped |" in row and "time budget" in row
    assert _vl_row(tmp_path, monkeypatch, "--skip-vl") is None


def test_a_missing_engine_wheel_is_one_clear_row(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "_engine_import_error", lambda: "ModuleNotFoundError: No module named 'zmq'")
    monkeypatch.setattr(gpu_check, "check_model", lambda *a, **k: pytest.fail("ran an engine stage"))
    out = tmp_path / "t.md"
    assert gpu_check.main(["--dry-run", "--skip-tests", "--out", str(out)]) == 1
    rows = out.read_text().strip().splitlines()[4:]
    assert rows == ["| engine import | - | FAIL | ModuleNotFoundError: No module named 'zmq' |"]


def test_watchdog_writes_the_partial_table_and_exits_3(tmp_path):
    out = tmp_path / "t.md"
    proc = _script("--dry-run", "--skip-tests", "--deadline-s", "0.5", "--out", str(out))
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "TIMED OUT" in out.read_text() and "| check | model | result | detail |" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_a_gpu_it_exits_2():
    proc = _script()
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr
    assert proc.stdout == ""


def test_a_cpu_device_without_dry_run_exits_2():
    proc = _script("--device", "cpu", "--skip-tests")
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr
