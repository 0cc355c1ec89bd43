"""What a quantized checkpoint stores, read from its ``quantization_config``.

The formats are vLLM 0.33's names (``quant_method``): ``fp8`` (vLLM / llm-compressor
native and transformers' FineGrainedFP8: per-tensor scales, or DeepSeek-style blocks with
``weight_scale_inv``), ``fbgemm_fp8`` (per-channel), ``compressed-tensors``
(``float-quantized`` FP8, ``int-quantized`` int8, ``pack-quantized`` int4/int8 with
groups, zero points and activation order), ``awq`` (the GEMM layout) and ``gptq``
(v1 and v2 zero points, act-order through ``g_idx``) and ``mxfp4`` (GPT-OSS's released
experts: ``*_blocks`` FP4 e2m1 pairs per byte, ``*_scales`` e8m0 per 32 values).  Every other method is refused by
name before a weight is read: a dense load of it would serve garbage.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Optional

SUPPORTED_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors", "awq", "gptq", "mxfp4")


@dataclass(frozen=True)
class WeightScheme:
    """How one linear layer's weight is stored.

    kind: ``fp8`` (float8 weight + scale), ``mxfp4`` (``X_blocks`` + ``X_scales`` of a fused
    expert tensor ``X``, 32-value groups), ``int`` (integer weight + scale [+ zero point],
    compressed-tensors int-quantized), ``packed`` (compressed-tensors pack-quantized),
    ``awq``, ``gptq``.  ``strategy``: tensor | channel | group | block (fp8/int/packed);
    ``group_size`` for groups (awq/gptq/packed), ``block`` (rows, cols) for blocks.
    """

    kind: str
    num_bits: int = 8
    strategy: str = "tensor"
    group_size: Optional[int] = None
    block: Optional[tuple[int, int]] = None
    symmetric: bool = True
    zero_offset: int = 0  # gptq v1 stores zero - 1
    # FP8 with static activation scales (``activation_scheme: static``; compressed-tensors
    # ``input_activations.dynamic: false``): each layer carries an ``input_scale`` the
    # W8A8 GEMM quantizes its input with (quantization/kept.py), instead of per token.
    static_input: bool = False


@dataclass(frozen=True)
class CheckpointQuantization:
    method: str
    default: Optional[WeightScheme]  # the scheme of a linear layer no target below names
    targets: tuple[tuple[str, WeightScheme], ...] = ()  # compressed-tensors config groups, in order
    ignore: tuple[str, ...] = ()  # modules kept dense (lm_head, routers, ...)
    activations: str = "none"  # what the checkpoint asks for activations (dynamic fp8, ...): CPU runs them unquantized
    raw: dict = field(default_factory=dict, compare=False)

    def scheme_for(self, module: str) -> Optional[WeightScheme]:
        """The scheme of the linear layer ``module`` (its checkpoint name without
        ``.weight``), None when it is stored dense."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for pattern, scheme in self.targets:
            if _matches(pattern, module):
                return scheme
        return self.default

    def describe(self) -> str:
        s = self.default or (self.targets[0][1] if self.targets else None)
        if s is None:
            return self.method
        detail = f"{s.kind} {s.num_bits}-bit, {s.strategy}"
        if s.group_size:
            detail += f" {s.group_size}"
        if s.block:
            detail += f" {s.block[0]}x{s.block[1]}"
        return f"{self.method} ({detail})"


def _matches(pattern: str, module: str) -> bool:
    """compressed-tensors / vLLM target semantics: ``re:<regex>`` matches by regex, a
    class name such as ``Linear`` matches every linear layer, anything else is the
    module's name or a suffix of it."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if pattern == "Linear":
        return True
    return module == pattern or module.endswith("." + pattern) or fnmatch.fnmatch(module, pattern)


def quantization_method(quant: Any) -> str:
    if isinstance(quant, dict):  # old bitsandbytes configs name no method, only load_in_4bit/8bit
        return str(quant.get("quant_method") or quant.get("format") or (
            "bitsandbytes" if quant.get("load_in_4bit") or quant.get("load_in_8bit") else "unknown"))
    return str(quant)


def _refuse(method: str, why: str = "") -> ValueError:
    return ValueError(f"quantized checkpoints (quant_method={method!r}) are not supported{why}; supported "
                      f"quant_methods: {', '.join(SUPPORTED_METHODS)}, or serve an unquantized "
                      f"bfloat16/float16/float32 checkpoint")


def parse_quantization(quant: Any) -> Optional[CheckpointQuantization]:
    """The checkpoint's quantization, or None for a dense checkpoint; ValueError naming
    the method (and the supported ones) for anything this engine cannot load."""
    if not quant:
        return None
    method = quantization_method(quant)
    if not isinstance(quant, dict) or method not in SUPPORTED_METHODS:
        raise _refuse(method)
    if method == "fp8":
        block = quant.get("weight_block_size")
        if block is not None:
            if len(block) != 2:
                raise _refuse(method, f" with weight_block_size={block!r}")
            scheme = WeightScheme("fp8", 8, "block", block=(int(block[0]), int(block[1])))
        else:
            scheme = WeightScheme("fp8", 8, "tensor", static_input=quant.get("activation_scheme") == "static")
        act = f"fp8 {quant.get('activation_scheme', 'dynamic')}"
        ignore = tuple(quant.get("ignored_layers") or quant.get("modules_to_not_convert") or ())
        return CheckpointQuantization(method, scheme, ignore=ignore, activations=act, raw=quant)
    if method == "mxfp4":
        # GPT-OSS's layout: the experts' fused projections stored as blocks + scales (the
        # reader turns each pair dense); everything the config leaves out stays dense.
        return CheckpointQuantization(method, WeightScheme("mxfp4", 4, "group", group_size=32),
                                      ignore=tuple(quant.get("modules_to_not_convert") or ()), raw=quant)
    if method == "fbgemm_fp8":
        return CheckpointQuantization(method, WeightScheme("fp8", 8, "channel"),
                                      ignore=tuple(quant.get("modules_to_not_convert") or ()),
                                      activations="fp8 dynamic", raw=quant)
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        bits = int(quant.get("bits", quant.get("w_bit", 4)))
        if version != "gemm" or bits != 4:
            raise _refuse(method, f" with version={version!r}, bits={bits} (the GEMM layout, 4 bits is)")
        group = int(quant.get("group_size", quant.get("q_group_size", 128)))
        return CheckpointQuantization(method, WeightScheme("awq", 4, "group", group_size=group, symmetric=False),
                                      ignore=tuple(quant.get("modules_to_not_convert") or ()), raw=quant)
    if method == "gptq":
        bits = int(quant.get("bits", 4))
        if bits not in (4, 8):
            raise _refuse(method, f" with bits={bits} (4 and 8 are)")
        fmt = str(quant.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise _refuse(method, f" with checkpoint_format={fmt!r}")
        group = int(quant.get("group_size", 128))
        return CheckpointQuantization(
            method, WeightScheme("gptq", bits, "group" if group > 0 else "channel", group_size=group if group > 0 else None,
                                 symmetric=bool(quant.get("sym", True)), zero_offset=1 if fmt == "gptq" else 0),
            ignore=tuple(quant.get("modules_to_not_convert") or ()), raw=quant)
    return _compressed_tensors(quant)


_CT_FORMATS = ("float-quantized", "int-quantized", "pack-quantized", "naive-quantized")


def _compressed_tensors(quant: dict) -> CheckpointQuantization:
    method = "compressed-tensors"
    if quant.get("sparsity_config") and (quant["sparsity_config"].get("format") not in (None, "dense")):
        raise _refuse(method, f" with sparsity format {quant['sparsity_config'].get('format')!r}")
    if quant.get("transform_config"):
        raise _refuse(method, " with transforms (transform_config)")
    targets = []
    activations = "none"
    for name, group in (quant.get("config_groups") or {}).items():
        fmt = group.get("format") or quant.get("format")
        weights = group.get("weights")
        if weights is None:
            raise _refuse(method, f" with config group {name!r} quantizing activations only")
        if fmt not in _CT_FORMATS:
            raise _refuse(method, f" in format {fmt!r} (supported formats: {', '.join(_CT_FORMATS[:3])})")
        bits, wtype = int(weights.get("num_bits", 8)), weights.get("type", "int")
        strategy = weights.get("strategy") or "tensor"
        if strategy not in ("tensor", "channel", "group", "block"):
            raise _refuse(method, f" with weight strategy {strategy!r}")
        if weights.get("dynamic"):
            raise _refuse(method, " with dynamic weight quantization")
        if wtype == "float":
            if bits != 8:
                raise _refuse(method, f" with {bits}-bit float weights (FP8 is supported; FP4 is not)")
            kind = "fp8"
        elif fmt == "pack-quantized":
            if bits not in (4, 8):
                raise _refuse(method, f" with {bits}-bit packed weights")
            kind = "packed"
        else:
            kind = "int"
        block = weights.get("block_structure")
        if isinstance(block, str):  # older configs: "128x128"
            block = [int(x) for x in block.lower().split("x")]
        ia = group.get("input_activations") or {}
        # static per-tensor FP8 inputs (W8A8 with calibrated scales): the layers' input_scale is read
        static = kind == "fp8" and bool(ia.get("num_bits")) and ia.get("type") == "float" and \
            not ia.get("dynamic") and (ia.get("strategy") or "tensor") == "tensor"
        scheme = WeightScheme(kind, bits, strategy, group_size=weights.get("group_size"),
                              block=tuple(int(b) for b in block) if block else None,
                              symmetric=bool(weights.get("symmetric", True)), static_input=static)
        if ia.get("num_bits"):
            activations = f"{ia.get('type', 'int')}{ia['num_bits']} {'dynamic' if ia.get('dynamic') else 'static'}"
        for target in group.get("targets") or ():
            targets.append((target, scheme))
    if not targets:
        raise _refuse(method, " without config_groups")
    return CheckpointQuantization(method, None, tuple(targets), tuple(quant.get("ignore") or ()), activations, quant)


# vLLM's --quantization names that load a checkpoint of one of SUPPORTED_METHODS (its
# Marlin kernels are a choice of kernel, not of format: here the same dequantized load).
_ARG_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}
# Methods vLLM applies to an unquantized checkpoint at load (online quantization).
_ONLINE = ("fp8_per_tensor", "fp8_per_block", "int8_per_channel_weight_only", "bitsandbytes", "experts_int8")
ONLINE_SUPPORTED = ("fp8",)  # quantization/online_fp8.py


def check_quantization_arg(requested: Optional[str], checkpoint: Optional[CheckpointQuantization]) -> None:
    """``--quantization`` against what the checkpoint stores (vLLM's _verify_quantization):
    unset or naming the checkpoint's method (or its Marlin alias) is fine; another method
    is vLLM's mismatch error; on an unquantized checkpoint ``fp8`` is online quantization
    (quantization/online_fp8.py), the other online methods are refused by name, as are
    unknown ones."""
    if requested is None:
        return
    method = _ARG_ALIASES.get(requested, requested)
    if checkpoint is not None:
        if method != checkpoint.method:
            raise ValueError(f"Quantization method specified in the model config ({checkpoint.method}) does not "
                             f"match the quantization method specified in the `quantization` argument "
                             f"({requested}).")
        return
    if requested in ONLINE_SUPPORTED:
        return
    if requested in _ONLINE:
        raise ValueError(f"--quantization {requested} on an unquantized checkpoint (online quantization at load) "
                         f"is not supported (--quantization fp8 is); serve a checkpoint quantized by its quantizer (quant_methods: "
                         f"{', '.join(SUPPORTED_METHODS)}) or drop --quantization")
    known = sorted(set(SUPPORTED_METHODS) | set(_ARG_ALIASES) | set(_ONLINE) | set(ONLINE_SUPPORTED))
    raise ValueError(f"Unknown quantization method: {requested}. Must be one of {known}.")
