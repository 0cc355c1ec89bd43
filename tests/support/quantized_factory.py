"""Quantized test checkpoints written from the tiny dense ones, in the formats users
download.  Two kinds of reference:

* compressed-tensors (``float-quantized`` FP8, ``pack-quantized`` int4/int8) and
  transformers' FineGrainedFP8 (``quant_method: fp8`` with 128x128-style blocks) are written
  and read back by their real libraries: ``compressed_tensors`` compresses the model, and
  transformers loads it with ``dequantize=True`` as the reference model.
* AWQ (AutoAWQ's GEMM layout) and GPTQ (AutoGPTQ / GPTQModel's v1 and v2 layouts): their
  libraries need CUDA builds that do not install here (autoawq's kernels, gptqmodel's
  extensions), so the writers below pack the integers the way those libraries' packers do
  (loops over columns, AutoAWQ's 0 2 4 6 1 3 5 7 nibble order; GPTQ's row packing and
  v1's zero - 1), independently of the engine's unpacking, and the reference is the HF
  model with each linear set to the dequantized values ``(q - zero) * scale`` the
  writer quantized to.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from tests.support.model_factory import _quiet_transformers

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "w1", "w2", "w3")  # Mixtral experts (the router, ``gate``, stays dense as the libraries leave it)


def _copy_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)


def _linears(state: dict) -> list[str]:
    return [k[:-len(".weight")] for k in state if k.endswith(".weight") and k.split(".")[-2] in LINEAR_SUFFIXES]


# --- compressed-tensors (the real library) ---------------------------------------------
def write_compressed_tensors(src: Path, dst: Path, scheme: str, group_size: int = 32) -> Path:
    """``scheme``: w4a16 (symmetric int4 groups), w4a16_asym, w8a16 (int8 packed, channel),
    fp8 (FP8 weights per channel, dynamic per-token FP8 activations), fp8_block (32x32
    blocks)."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    _quiet_transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    if scheme.startswith("w4a16") or scheme == "w8a16":
        bits = 8 if scheme == "w8a16" else 4
        strategy = "channel" if scheme == "w8a16" else "group"
        weights = QuantizationArgs(num_bits=bits, type="int", symmetric=not scheme.endswith("asym"),
                                   group_size=group_size if strategy == "group" else None, strategy=strategy)
        fmt, acts = "pack-quantized", None
    else:
        block = scheme == "fp8_block"
        weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block" if block else "channel",
                                   block_structure=[32, 32] if block else None)
        acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group" if block else "token",
                                group_size=32 if block else None, dynamic=True)
        fmt = "float-quantized"
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=weights, input_activations=acts)}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    for _, module in model.named_modules():
        qs = getattr(module, "quantization_scheme", None)
        if qs is None:
            continue
        w, args = module.weight.detach().float(), qs.weights
        if args.strategy == "group":
            g = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = g.amin(-1), g.amax(-1)
        elif args.strategy == "block":
            r, c = args.block_structure
            b = w.reshape(w.shape[0] // r, r, w.shape[1] // c, c)
            lo, hi = b.amin((1, 3)), b.amax((1, 3))
        else:
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale, zero = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.to(module.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def load_dequantized_reference(path: Path):
    """transformers' own dequantizing load of a compressed-tensors / FP8 checkpoint (fp32)."""
    import transformers

    _quiet_transformers()
    cfg = json.loads((path / "config.json").read_text())
    method = cfg["quantization_config"]["quant_method"]
    if method == "compressed-tensors":
        from transformers.utils.quantization_config import CompressedTensorsConfig
        qc = CompressedTensorsConfig(dequantize=True)
    else:
        from transformers.utils.quantization_config import FineGrainedFP8Config
        qc = FineGrainedFP8Config(weight_block_size=tuple(cfg["quantization_config"]["weight_block_size"]),
                                  dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=qc,
                                                              attn_implementation="eager")
    return model.float().eval()


# --- FP8 blocks as DeepSeek-V3 / transformers' FineGrainedFP8 store them -----------------
def write_fp8_block(src: Path, dst: Path, block: tuple[int, int] = (32, 32)) -> Path:
    """``quant_method: fp8`` with ``weight_block_size``: FP8 weights and float32
    ``weight_scale_inv`` per block (dequant: ``w * scale_inv``)."""
    _copy_side_files(src, dst)
    state = load_file(str(src / "model.safetensors"))
    out = dict(state)
    r, c = block
    for layer in _linears(state):
        w = state[layer + ".weight"].float()
        blocks = w.reshape(w.shape[0] // r, r, w.shape[1] // c, c)
        scale = blocks.abs().amax((1, 3)) / torch.finfo(torch.float8_e4m3fn).max
        q = (blocks / scale[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
        out[layer + ".weight"] = q
        out[layer + ".weight_scale_inv"] = scale.float()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def calibrated_input_scales(src: Path, prompts: int = 4, length: int = 24) -> dict[str, torch.Tensor]:
    """{linear layer: its input's absmax / 448} over a few random prompts through the dense
    HF model: what a static FP8 calibration (llm-compressor, ModelOpt) stores as ``input_scale``."""
    from tests.support.model_factory import load_hf_model

    hf = load_hf_model(src)
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] in LINEAR_SUFFIXES and isinstance(module, torch.nn.Linear):
            def hook(mod, args, name=name):
                amax[name] = torch.maximum(amax.get(name, torch.tensor(0.0)), args[0].detach().abs().max().float())
            hooks.append(module.register_forward_pre_hook(hook))
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for _ in range(prompts):
            hf(torch.randint(3, hf.config.vocab_size, (1, length), generator=gen))
    for h in hooks:
        h.remove()
    return {name: a / torch.finfo(torch.float8_e4m3fn).max for name, a in amax.items()}


def static_input_scales(path: Path) -> dict[str, torch.Tensor]:
    """{module: the static input scale its fused projection runs with}: the largest of the
    layers reading one input (q/k/v, gate/up), as vLLM merges them."""
    state = load_file(str(path / "model.safetensors"))
    own = {k[: -len(".input_scale")]: v.float() for k, v in state.items() if k.endswith(".input_scale")}
    fused: dict[str, torch.Tensor] = {}
    for layer, s in own.items():
        key = _input_key(layer)
        fused[key] = torch.maximum(fused.get(key, s), s)
    return {layer: fused[_input_key(layer)] for layer in own}


def with_static_fp8_inputs(hf, scales: dict[str, torch.Tensor]):
    """``hf`` with each projection's input quantized with its static FP8 scale (saturated),
    what the W8A8 GEMM multiplies under ``activation_scheme: static``."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    for name, module in hf.named_modules():
        if name in scales:
            s = scales[name]
            module.register_forward_pre_hook(lambda mod, args, s=s: (
                ((args[0].float() / s).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn).float() * s).to(
                    args[0].dtype),))
    return hf


def write_fp8_tensor(src: Path, dst: Path, kv_scales: Optional[dict[int, tuple[float, float]]] = None,
                     static: bool = False) -> Path:
    """``quant_method: fp8`` per tensor (vLLM / llm-compressor's FP8 with one
    ``weight_scale`` per linear: q/k/v with different scales), optionally with KV-cache
    scales ``{layer: (k_scale, v_scale)}`` as ``model.layers.{i}.self_attn.{k,v}_scale``;
    ``static``: ``activation_scheme: static`` with each layer's calibrated ``input_scale``."""
    _copy_side_files(src, dst)
    state = load_file(str(src / "model.safetensors"))
    out = dict(state)
    inputs = calibrated_input_scales(src) if static else {}
    for layer in _linears(state):
        w = state[layer + ".weight"].float()
        scale = w.abs().max() / torch.finfo(torch.float8_e4m3fn).max
        out[layer + ".weight"] = (w / scale).to(torch.float8_e4m3fn)
        out[layer + ".weight_scale"] = scale.reshape(())
        if static:
            out[layer + ".input_scale"] = inputs[layer].reshape(())
    for i, (k, v) in (kv_scales or {}).items():
        out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
        out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    if kv_scales:
        cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                         "dynamic": False, "symmetric": True}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def dequantized_fp8(path: Path) -> dict:
    """{checkpoint name: dense fp32 weight} of an FP8 checkpoint (FP8 values times scales)."""
    state = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    dense = {}
    for name, t in state.items():
        if t.dtype != torch.float8_e4m3fn:
            continue
        layer = name[: -len(".weight")]
        s = state.get(layer + ".weight_scale", state.get(layer + ".weight_scale_inv")).float()
        if s.dim() == 2 and s.shape[1] > 1:
            r, c = cfg.get("weight_block_size") or cfg["config_groups"]["group_0"]["weights"]["block_structure"]
            s = s.repeat_interleave(r, 0).repeat_interleave(c, 1)
        elif s.dim() >= 1 and s.numel() > 1:
            s = s.reshape(-1, 1)
        dense[name] = t.float() * s
    return dense


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def with_fp8_rounded_inputs(hf, group: Optional[int] = None):
    """``hf`` with each projection's input rounded to its FP8 values times their scale,
    per token (per token and ``group`` columns beside FP8 blocks): what a W8A8 GEMM with
    dynamic activation scales multiplies."""
    from worker.engine.quantization.online_fp8 import round_rows

    def rounded(x: torch.Tensor) -> torch.Tensor:
        if group is None:
            return round_rows(x)
        return round_rows(x.reshape(-1, group)).reshape(x.shape)

    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] in _PROJECTIONS:
            module.register_forward_pre_hook(lambda mod, args: (rounded(args[0]),))
    return hf


class _RoundedLinear:
    """Inside an HF experts module (3-D expert stacks, ``nn.functional.linear`` per expert):
    each call's input rounded per row (and ``group`` columns), as the W8A8 expert GEMMs
    quantize it."""

    def __init__(self, rounded):
        self.orig = torch.nn.functional.linear
        self.rounded = rounded

    def __call__(self, x, w, b=None):
        return self.orig(self.rounded(x), w, b)

    def enter(self, mod, args):
        torch.nn.functional.linear = self

    def leave(self, mod, args, out):
        torch.nn.functional.linear = self.orig


def with_fp8_rounded_expert_inputs(hf, group: Optional[int] = None):
    """``hf`` with every routed expert's GEMM inputs rounded to their FP8 values per token (per
    token and ``group`` columns beside FP8 blocks), through HF's own per-expert loop: what
    the fused-MoE W8A8 kernel multiplies.  The router and shared-expert gate stay as they are."""
    from worker.engine.quantization.online_fp8 import round_rows

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return round_rows(x) if group is None else round_rows(x.reshape(-1, group)).reshape(x.shape)

    patch = _RoundedLinear(rounded)
    found = 0
    for name, module in hf.named_modules():
        if name.endswith("mlp.experts") and hasattr(module, "gate_up_proj"):
            # HF's own per-expert loop (its default here is torch's grouped_mm, no F.linear)
            module.config._experts_implementation = "eager"
            module.register_forward_pre_hook(patch.enter)
            module.register_forward_hook(patch.leave)
            found += 1
    assert found, "no HF experts module with 3-D stacks found"
    return hf


def assert_paged_matches(model, ref, *, atol: float, n: int = 30, prompt: int = 21, seed: int = 3):
    """The paged model teacher-forced over ``n`` tokens (a ``prompt``-token prefill, then
    one decode step per token) gives the HF reference's logits within ``atol``; returns
    the tokens and those reference logits."""
    from tests.unit.engine.test_model import PagedSeqs, _tokens, hf_logits

    ids = _tokens(n, seed=seed)
    want = hf_logits(ref, ids)
    seqs = PagedSeqs(model)
    (got,) = seqs.step([("a", ids[:prompt])])
    torch.testing.assert_close(got, want[:prompt], atol=atol, rtol=0)
    for pos in range(prompt, n):
        (got,) = seqs.step([("a", [ids[pos]])])
        torch.testing.assert_close(got[0], want[pos], atol=atol, rtol=0)
    return ids, want


def greedy(ref, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy ids of an HF model by full forward passes."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


# --- AWQ / GPTQ (packers written after the libraries' own) ------------------------------
def _int_quantize(w_t: torch.Tensor, group: int, sym: bool, bits: int = 4):
    """Rows of ``w_t`` ([in, out]) in groups of ``group`` rows -> (q [in, out] ints,
    zeros [groups, out] ints, scales [groups, out])."""
    inp, out = w_t.shape
    g = w_t.reshape(inp // group, group, out)
    qmax = (1 << bits) - 1
    if sym:
        scale = g.abs().amax(1) / ((qmax - 1) / 2)
        zero = torch.full_like(scale, (qmax + 1) // 2, dtype=torch.int32)
    else:
        lo, hi = g.amin(1), g.amax(1)
        scale = (hi - lo).clamp_min(1e-8) / qmax
        zero = torch.round(-lo / scale).clamp(0, qmax).to(torch.int32)
    scale = scale.half().float()  # the checkpoints store fp16 scales
    q = torch.round(g / scale[:, None] + zero[:, None]).clamp(0, qmax).to(torch.int32)
    return q.reshape(inp, out), zero, scale


def _pack_columns(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[rows, cols] 4-bit ints -> [rows, cols / 8] int32, word j's nibble i = column 8j + order[i]."""
    rows, cols = values.shape
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for j in range(cols // 8):
        for i in range(8):
            packed[:, j] |= values[:, 8 * j + order[i]].to(torch.int64) << (4 * i)
    return _as_int32(packed)


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ: [rows, cols] ints -> [rows * bits / 32, cols] int32, row i in word i // (32/bits)."""
    per = 32 // bits
    rows, cols = values.shape
    packed = torch.zeros(rows // per, cols, dtype=torch.int64)
    for i in range(rows):
        packed[i // per] |= values[i].to(torch.int64) << (bits * (i % per))
    return _as_int32(packed)


def _pack_columns_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    rows, cols = values.shape
    packed = torch.zeros(rows, cols // per, dtype=torch.int64)
    for j in range(cols):
        packed[:, j // per] |= values[:, j].to(torch.int64) << (bits * (j % per))
    return _as_int32(packed)


def _as_int32(packed64: torch.Tensor) -> torch.Tensor:
    return ((packed64 + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)


def write_awq(src: Path, dst: Path, group: int = 32) -> tuple[Path, dict]:
    """AutoAWQ GEMM checkpoint (zero points, fp16 scales); returns it and the dequantized
    weights {layer.weight: [out, in]} the reference model holds."""
    _copy_side_files(src, dst)
    state = load_file(str(src / "model.safetensors"))
    out, dense = dict(state), {}
    for layer in _linears(state):
        w_t = state.pop(layer + ".weight").float().t().contiguous()  # [in, out]
        del out[layer + ".weight"]
        q, zero, scale = _int_quantize(w_t, group, sym=False)
        out[layer + ".qweight"] = _pack_columns(q, (0, 2, 4, 6, 1, 3, 5, 7))
        out[layer + ".qzeros"] = _pack_columns(zero, (0, 2, 4, 6, 1, 3, 5, 7))
        out[layer + ".scales"] = scale.half()
        groups = torch.arange(w_t.shape[0]) // group
        dense[layer + ".weight"] = ((q - zero[groups]).float() * scale[groups]).t().contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
                                  "zero_point": True, "modules_to_not_convert": None}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst, dense


def _input_key(layer: str) -> str:
    """Layers reading the same input share a key: q/k/v, gate/up (w1/w3 of experts)."""
    head, _, last = layer.rpartition(".")
    return head + "." + {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                         "up_proj": "gate_up", "w1": "w13", "w3": "w13"}.get(last, last)


def write_gptq(src: Path, dst: Path, group: int = 32, bits: int = 4, sym: bool = True, act_order: bool = False,
               checkpoint_format: str = "gptq", seed: int = 0, shared_order: bool = True) -> tuple[Path, dict]:
    """GPTQ checkpoint (AutoGPTQ v1: zeros stored minus one; ``gptq_v2``: as they are);
    act-order permutes which group each input row belongs to (``g_idx``)."""
    _copy_side_files(src, dst)
    state = load_file(str(src / "model.safetensors"))
    out, dense = dict(state), {}
    gen = torch.Generator().manual_seed(seed)
    orders: dict[str, torch.Tensor] = {}
    for layer in _linears(state):
        w_t = state[layer + ".weight"].float().t().contiguous()  # [in, out]
        del out[layer + ".weight"]
        inp = w_t.shape[0]
        # GPTQ orders a layer's columns by its input's Hessian, so layers reading one input
        # (q/k/v, gate/up) share one order; ``shared_order=False`` gives each its own.
        key = _input_key(layer) if shared_order else layer
        if act_order and key not in orders:
            orders[key] = torch.randperm(inp, generator=gen)
        perm = orders[key] if act_order else torch.arange(inp)
        # quantize rows in the permuted order (act-order); row perm[k] is in group k // group
        q_p, zero, scale = _int_quantize(w_t[perm], group, sym=sym, bits=bits)
        q = torch.empty_like(q_p)
        q[perm] = q_p
        g_idx = torch.empty(inp, dtype=torch.int32)
        g_idx[perm] = (torch.arange(inp) // group).to(torch.int32)
        stored_zero = zero - 1 if checkpoint_format == "gptq" else zero
        out[layer + ".qweight"] = _pack_rows(q, bits)
        out[layer + ".qzeros"] = _pack_columns_bits(stored_zero & ((1 << bits) - 1), bits)
        out[layer + ".scales"] = scale.half()
        out[layer + ".g_idx"] = g_idx
        gl = g_idx.long()
        dense[layer + ".weight"] = ((q - zero[gl]).float() * scale[gl]).t().contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
                                  "sym": sym, "checkpoint_format": checkpoint_format}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst, dense


def reference_with_weights(src: Path, dense: dict, root: Optional[Path] = None):
    """The dense tiny model's HF reference with its linears replaced by ``dense``
    (checkpoint names): written as a dense checkpoint and loaded by transformers, which
    maps the names (fused MoE experts included) as it does for any checkpoint."""
    import tempfile

    from tests.support.model_factory import load_hf_model

    state = load_file(str(src / "model.safetensors"))
    for name, w in dense.items():
        state[name] = w.to(state[name].dtype)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        _copy_side_files(src, Path(tmp))
        save_file(state, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        return load_hf_model(Path(tmp))


# --- MXFP4 (GPT-OSS's released experts) ---------------------------------------------------
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def write_mxfp4(src: Path, dst: Path, seed: int = 0) -> tuple[Path, dict]:
    """A GPT-OSS checkpoint whose experts' ``gate_up_proj`` / ``down_proj`` are MXFP4 as the
    released ones: random FP4 codes (``X_blocks [E, out, in / 32, 16]``) and e8m0 exponents
    (``X_scales [E, out, in / 32]``).  Returns it and the dense tensors the reference holds,
    dequantized by transformers' own ``convert_moe_packed_tensors`` (its MXFP4 reader)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _copy_side_files(src, dst)
    state = load_file(str(src / "model.safetensors"))
    out, dense = dict(state), {}
    gen = torch.Generator().manual_seed(seed)
    for name in [k for k in state if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        e, inp, rows = state[name].shape  # transformers' layout [E, in, out]
        blocks = torch.randint(0, 256, (e, rows, inp // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(121, 125, (e, rows, inp // 32), generator=gen, dtype=torch.uint8)  # 2^-6 .. 2^-3
        del out[name]
        out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = dict(MXFP4_CONFIG)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst, dense
