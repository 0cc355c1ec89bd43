"""benchmarks/gpu_check.py's CPU-runnable parts: options, the ~1B presets, the table,
a dry run end to end, and the clear exit without a GPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[1]


def test_options():
    a = gpu_check.parse_args([])
    assert a.model_list == ["llama", "qwen3"] and a.batch_list == [1, 32, 128] and a.peak_gbps == 4800
    q = gpu_check.parse_args(["--quick", "--batches", "1,32,128"])
    assert q.batch_list == [1, 32] and q.output_len == 32
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--models", "gpt2"])
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--batches", "1,x"])


@pytest.mark.parametrize("preset", ["llama", "qwen3"])
def test_presets_are_about_one_billion_parameters(preset):
    n = gpu_check.param_count(gpu_check.hf_config_dict(preset))
    assert 0.9e9 < n < 1.5e9, n


def test_param_count_matches_transformers_on_a_tiny_model():
    import transformers

    for preset in ("llama", "qwen3"):
        cfg = gpu_check.hf_config_dict(preset, tiny=True)
        arch = cfg.pop("arch")
        model = getattr(transformers, arch)(getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg))
        assert gpu_check.param_count({**cfg, "arch": arch}) == sum(p.numel() for p in model.parameters())


def test_table_format():
    out = gpu_check.table([gpu_check.Row("cuda tests", "-", "pass", "3 passed"),
                           gpu_check.Row("throughput bs=1", "llama", "2.00x HF", "a | b")], "header")
    lines = out.splitlines()
    assert lines[0] == "header" and lines[2] == "| check | model | result | detail |"
    assert lines[4] == "| cuda tests | - | pass | 3 passed |" and len(lines) == 6


def test_dry_run_end_to_end(tmp_path):
    out = tmp_path / "table.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for check in ("HF parity: prompt logprobs", "HF parity: greedy", "CUDA graphs vs eager", "throughput bs=1",
                  "roofline bs=1"):
        assert check in text
    assert "FAIL" not in text and text.count("| pass |") == 2  # fp32 parity holds for both models


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_a_gpu_it_exits_2():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
