"""The checkpoint's tensor stream with quantized layers turned dense.

A quantized linear layer ``X`` arrives as several tensors (``X.weight`` in FP8 and
``X.weight_scale``; ``X.qweight``, ``X.qzeros``, ``X.scales`` and ``X.g_idx``; ...), in
any order and possibly in different shards.  ``dequantize_stream`` buffers each layer's
parts until its scheme's set is complete, then yields ``(X.weight, dense)`` in their
place; every other tensor passes through unchanged, so the loader and each model's name
mapping, tensor-parallel slicing and expert stacking see a dense checkpoint.  Peak extra
memory is the parts of the layers not yet complete (one layer, in the usual order).

MXFP4 (GPT-OSS) stores a fused expert tensor ``X`` (``X [E, in, out]`` in transformers'
parameter layout) as ``X_blocks`` + ``X_scales`` over ``[E, out, in]``: the pair becomes
``(X, dense)`` in the dense checkpoint's layout, which the family loads as it loads a
bf16 checkpoint.

Activation scales (``input_scale`` ...) are dropped -- the layers quantize activations
dynamically or not at all (stated in docs/quantization.md) -- except an FP8 layer's
``input_scale`` where the config says its activations are static: then it is one of the
layer's parts (required), handed to ``keep`` with the others.  KV-cache scales
(``k_scale``, ``v_scale``, ...) go to the ``kv`` hook when one is given
(quantization/kv_scales.py: used over an FP8 KV cache), else are dropped too.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable, Iterator, Optional

import torch

from worker.engine.quantization.config import CheckpointQuantization, WeightScheme
from worker.engine.quantization.dequant import dequant_awq, dequant_float, dequant_gptq, dequant_mxfp4, dequant_packed
from worker.engine.quantization.kv_scales import kv_scale_target

log = logging.getLogger(__name__)

_FLOAT8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
           if hasattr(torch, n)}
# Parts of a quantized layer, by the suffix after the layer's name.
_PARTS = ("weight_packed", "weight_shape", "weight_scale_inv", "weight_scale", "weight_zero_point", "weight_g_idx",
          "qweight", "qzeros", "scales", "g_idx")
# Activation / KV-cache quantization parameters: not used by unquantized activations.
_DROPPED = ("input_scale", "input_zero_point", "output_scale", "output_zero_point", "k_scale", "v_scale",
            "kv_scale", "q_scale", "prob_scale", "input_global_scale", "weight_global_scale")
_KV_PARTS = ("k_scale", "v_scale", "kv_scale", "output_scale")


def _split(name: str) -> tuple[str, str]:
    layer, _, part = name.rpartition(".")
    return layer, part


def _required(scheme: WeightScheme) -> tuple[str, ...]:
    if scheme.kind == "fp8":
        return ("weight", "scale") + (("input_scale",) if scheme.static_input else ())
    if scheme.kind == "int":
        return ("weight", "weight_scale") + (() if scheme.symmetric else ("weight_zero_point",))
    if scheme.kind == "packed":
        return ("weight_packed", "weight_scale", "weight_shape") + (() if scheme.symmetric else ("weight_zero_point",))
    return ("qweight", "qzeros", "scales")  # awq, gptq


class _Layer:
    def __init__(self, scheme: WeightScheme):
        self.scheme = scheme
        self.parts: dict[str, torch.Tensor] = {}

    def add(self, part: str, tensor: torch.Tensor) -> None:
        if part in ("weight_scale", "weight_scale_inv") and self.scheme.kind == "fp8":
            self.parts["scale"] = tensor
        self.parts[part] = tensor

    def complete(self) -> bool:
        return all(p in self.parts for p in _required(self.scheme))

    def missing(self) -> list[str]:
        return [p for p in _required(self.scheme) if p not in self.parts]

    def dense(self, name: str) -> torch.Tensor:
        s, p = self.scheme, self.parts
        try:
            if s.kind == "fp8":
                return dequant_float(p["weight"], p["scale"], s)
            if s.kind == "int":
                return dequant_float(p["weight"], p["weight_scale"], s, p.get("weight_zero_point"))
            if s.kind == "packed":
                shape = tuple(int(v) for v in p["weight_shape"].tolist())
                return dequant_packed(p["weight_packed"], p["weight_scale"], shape, s, p.get("weight_zero_point"),
                                      p.get("weight_g_idx"))
            if s.kind == "awq":
                return dequant_awq(p["qweight"], p["qzeros"], p["scales"], s.group_size or 128)
            return dequant_gptq(p["qweight"], p["qzeros"], p["scales"], s, p.get("g_idx"))
        except (RuntimeError, IndexError, ValueError) as e:
            raise ValueError(f"quantized layer {name} ({s.kind}): its tensors do not fit the checkpoint's "
                             f"quantization_config ({', '.join(f'{k} {tuple(v.shape)}' for k, v in p.items())}): "
                             f"{e}") from None


def _static_input(quant: CheckpointQuantization, layer: str) -> bool:
    scheme = quant.scheme_for(layer)
    return scheme is not None and scheme.static_input


def _is_quantized_weight(tensor: torch.Tensor) -> bool:
    return tensor.dtype in _FLOAT8 or not tensor.is_floating_point()


def _check_late_part(name: str, tensor: torch.Tensor, scheme: WeightScheme) -> None:
    """A part arriving after its layer was built: only GPTQ's g_idx without act-order,
    which then maps rows to groups in order (what the layer was built with)."""
    if name.endswith("g_idx") and scheme.kind == "gptq" and scheme.group_size:
        expected = torch.arange(tensor.numel()) // scheme.group_size
        if torch.equal(tensor.long().cpu(), expected):
            return
        raise ValueError(f"checkpoint tensor {name} orders rows by activation (act-order) but the checkpoint's "
                         f"quantization_config has desc_act false")
    raise ValueError(f"checkpoint tensor {name} repeats a part of a quantized layer already loaded")


# Called with (layer name, its scheme, its parts) before the layer's dense weight is
# yielded: how a scheme that keeps weights quantized (quantization/kept.py) sees the
# checkpoint's scales and zero points beside the dense weight the model loads.
KeepHook = Callable[[str, WeightScheme, dict[str, torch.Tensor]], None]
# Called with (name, decoder layer, "k" | "v", scale) for each KV-cache scale (kv_scales.KvScales.add).
KvHook = Callable[[str, int, str, torch.Tensor], None]


def dequantize_stream(tensors: Iterable[tuple[str, torch.Tensor]], quant: Optional[CheckpointQuantization],
                      dtype: Optional[torch.dtype] = None, keep: Optional[KeepHook] = None,
                      kv: Optional[KvHook] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` with each quantized layer's parts replaced by its dense weight (in
    ``dtype`` when given), each layer's parts handed to ``keep`` first when given, the
    KV-cache scales to ``kv``.  A dense checkpoint (``quant`` None) passes through."""
    if quant is None:
        yield from tensors
        return
    if quant.method == "mxfp4":
        yield from _mxfp4_stream(tensors, dtype)
        return
    pending: dict[str, _Layer] = {}
    done: dict[str, WeightScheme] = {}  # layers already yielded (a late g_idx must be the trivial one)
    dropped = 0
    for name, tensor in tensors:
        layer, part = _split(name)
        if kv is not None and part in _KV_PARTS:
            target = kv_scale_target(name)
            if target is not None:
                kv(name, *target, tensor)
                continue
        if part in _DROPPED and not (part == "input_scale" and _static_input(quant, layer)):
            dropped += 1
            continue
        quantized_part = part in _PARTS or part == "input_scale" or (part == "weight" and _is_quantized_weight(tensor))
        if not quantized_part:
            yield name, tensor
            continue
        entry = pending.get(layer)
        if entry is None:
            scheme = quant.scheme_for(layer)
            if scheme is None:
                raise ValueError(f"checkpoint tensor {name} ({tensor.dtype}) is quantized, but the checkpoint's "
                                 f"quantization_config keeps layer {layer} unquantized")
            if layer in done:
                _check_late_part(name, tensor, done[layer])
                continue
            entry = pending[layer] = _Layer(scheme)
        entry.add(part, tensor)
        # GPTQ's g_idx is optional (absent: groups in order), so a complete layer waits for
        # it only when the config says act-order (desc_act) put it there.
        if entry.complete() and not (entry.scheme.kind == "gptq" and quant.raw.get("desc_act")
                                     and "g_idx" not in entry.parts):
            dense = entry.dense(layer)
            if keep is not None:
                keep(layer, entry.scheme, entry.parts)
            del pending[layer]
            done[layer] = entry.scheme
            yield layer + ".weight", dense if dtype is None else dense.to(dtype)
    if pending:
        layer, entry = next(iter(pending.items()))
        raise ValueError(f"quantized layer {layer} lacks {', '.join(entry.missing()) or 'g_idx'} in the checkpoint "
                         f"({len(pending)} incomplete layer(s))")
    if dropped:
        log.info("dropped %d activation/KV-cache quantization scale(s): activations run unquantized", dropped)


_MXFP4_PARTS = ("_blocks", "_scales")


def _mxfp4_stream(tensors: Iterable[tuple[str, torch.Tensor]], dtype: Optional[torch.dtype]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """``X_blocks`` + ``X_scales`` -> ``(X, dense [E, in, out])``; other tensors pass."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        suffix = next((s for s in _MXFP4_PARTS if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name[: -len(suffix)]
        parts = pending.setdefault(base, {})
        if suffix in parts:
            raise ValueError(f"checkpoint tensor {name} appears twice")
        parts[suffix] = tensor
        if len(parts) == 2:
            del pending[base]
            try:
                dense = dequant_mxfp4(parts["_blocks"], parts["_scales"]).transpose(-1, -2)
            except ValueError as e:
                raise ValueError(f"MXFP4 tensor {base}: {e}") from None
            yield base, dense if dtype is None else dense.to(dtype)
    if pending:
        base, parts = next(iter(pending.items()))
        missing = [base + s for s in _MXFP4_PARTS if s not in parts]
        raise ValueError(f"MXFP4 checkpoint lacks {', '.join(missing)} ({len(pending)} incomplete tensor(s))")
