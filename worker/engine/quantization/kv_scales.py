"""KV-cache scales an FP8 checkpoint carries (``--kv-cache-dtype fp8``), as vLLM 0.33
reads them (model_loader/weight_utils.maybe_remap_kv_scale_name, compressed-tensors'
get_cache_scale, layers/quantization/kv_cache.BaseKVCacheMethod).

Names, per decoder layer ``P = model.layers.{i}.self_attn``: ``P.k_scale`` /
``P.v_scale`` (llm-compressor, compressed-tensors' ``kv_cache_scheme``),
``P.attn.k_scale`` (vLLM's own), ``P.k_proj.k_scale`` / ``P.v_proj.v_scale`` (ModelOpt),
``P.k_proj.output_scale`` / ``P.v_proj.output_scale`` (older compressed-tensors
``kv_cache_scheme``), and the deprecated ``P.kv_scale`` (one scale: K's, duplicated).
One value per tensor: per-head scales are refused, as vLLM 0.33 refuses them.

Meaning (vLLM's): the cache stores ``k / k_scale`` and ``v / v_scale`` in FP8 and
attention reads them back times the scale, so a calibrated scale maps the layer's K/V
range onto e4m3's (±448) instead of saturating it.  The attention layer applies them
(attention/layer.PagedAttention.set_kv_scales) only over an FP8 cache; with the cache in
the model dtype they are ignored, as vLLM forces them to 1.0 then.
"""
from __future__ import annotations

import logging
import re
from typing import Optional

import torch

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^(.*\.layers\.(\d+))\.self_attn\.(?:attn\.)?(?:([kv])_proj\.)?(k_scale|v_scale|kv_scale|"
                    r"output_scale)$")


def kv_scale_target(name: str) -> Optional[tuple[int, str]]:
    """(decoder layer index, ``k`` | ``v``) of a KV-cache scale's checkpoint name, None
    for any other tensor (an ``output_scale`` only on k_proj / v_proj)."""
    m = _LAYER.match(name)
    if m is None:
        return None
    proj, kind = m.group(3), m.group(4)
    if kind == "output_scale":
        return (int(m.group(2)), proj) if proj else None
    if kind == "kv_scale":
        return int(m.group(2)), "k"  # deprecated single scale: K's, duplicated to V (vLLM)
    if proj is not None and proj != kind[0]:
        return None  # e.g. k_proj.v_scale: not a cache scale
    return int(m.group(2)), kind[0]


class KvScales:
    """Collects the checkpoint's KV scales (the reader's ``kv`` hook) and hands each
    attention layer its (k_scale, v_scale)."""

    def __init__(self) -> None:
        self.found: dict[int, dict[str, float]] = {}

    def add(self, name: str, layer: int, which: str, tensor: torch.Tensor) -> None:
        if tensor.numel() != 1:
            raise ValueError(f"checkpoint tensor {name} holds {tensor.numel()} KV-cache scales "
                             f"{tuple(tensor.shape)}: only one scale per tensor is supported (as vLLM)")
        self.found.setdefault(layer, {})[which] = float(tensor.reshape(()).float())

    def scales(self) -> dict[int, tuple[float, float]]:
        """Layer -> (k_scale, v_scale) by vLLM's rule: both present and positive: each its
        own; one present (the deprecated ``kv_scale``): the larger for both."""
        out = {}
        for layer, s in self.found.items():
            k, v = s.get("k", -1.0), s.get("v", -1.0)
            if k > 0 and v > 0:
                out[layer] = (k, v)
            elif k > 0 or v > 0:
                out[layer] = (max(k, v),) * 2
        return out

    def apply(self, model, fp8_cache: bool) -> int:
        """Give each decoder layer's attention its scales when the cache is FP8; returns
        how many layers got one."""
        scales = self.scales()
        if not scales:
            return 0
        if not fp8_cache:
            log.info("the checkpoint's KV-cache scales (%d layers) are not used: the KV cache holds the model dtype "
                     "(--kv-cache-dtype fp8 uses them)", len(scales))
            return 0
        n = 0
        for i, layer in enumerate(model.layers):
            attn = getattr(layer, "attn", None)
            if i in scales and hasattr(attn, "set_kv_scales"):
                attn.set_kv_scales(*scales[i])
                n += 1
        log.info("FP8 KV cache with the checkpoint's k/v scales on %d of %d layers (1.0 elsewhere)", n,
                 len(model.layers))
        return n
