"""What the engine needs to know about a Hugging Face model directory.

Reads ``config.json`` (+ ``generation_config.json`` when present) into one frozen
``ModelConfig``.  Both config generations are understood: the classic
``rope_theta`` + ``rope_scaling`` keys and transformers 5's ``rope_parameters``.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch

from worker.engine.models.registry import ModelRegistry
from worker.engine.quantization.config import CheckpointQuantization, parse_quantization

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16,
    "half": torch.float16, "bfloat16": torch.bfloat16,
}
# generation_config.json keys of vLLM's ModelConfig.get_diff_sampling_param (with
# max_new_tokens, which becomes max_tokens).  vLLM's generate endpoint applies only
# max_tokens of them; the rest are the OpenAI endpoints' defaults.
_GENERATION_DEFAULT_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                            "top_p", "min_p")


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _ids(value: Any) -> tuple[int, ...]:
    """eos_token_id may be an int, a list of ints or null."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of a mixture-of-experts family, in HF's terms.

    Routing is softmax over the router logits, then the top ``top_k`` experts, their
    weights renormalised to sum 1 when ``norm_topk_prob`` (Mixtral always).  Layer i
    is sparse when ``sparse_layers[i]``; the others keep a dense MLP of
    ``intermediate_size``.
    """

    family: str  # mixtral | qwen2_moe | qwen3_moe
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-on expert behind a sigmoid gate
    # Checkpoint names: the block's attribute and the experts' gate / up / down projections.
    block_name: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # GLM-4.5 (DeepSeek-V3's router): sigmoid scores, a per-expert correction bias that only
    # steers the choice, top-k within the topk_group best of n_group expert groups (a
    # group's score: its two best), weights times routed_scaling_factor; always-on shared
    # experts without a gate (shared_experts_intermediate_size).
    scoring: str = "softmax"  # softmax | sigmoid
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_experts_intermediate_size: int = 0
    # GPT-OSS: scoring "topk_softmax" (top-k of the raw logits, softmax over those k), a
    # router bias, per-expert biases on both projections, gate/up stored interleaved in
    # one fused tensor, and the clamped SwiGLU (alpha, limit) instead of plain SwiGLU.
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_clamp: Optional[tuple[float, float]] = None

    @property
    def router_fp32(self) -> bool:
        """transformers scores these routers in float32 (weights and hidden cast up):
        GLM-4.5 / DeepSeek-V3's sigmoid and DeepSeek-V2's grouped softmax."""
        return self.scoring in ("sigmoid", "softmax_grouped")

    @property
    def num_moe_layers(self) -> int:
        return sum(self.sparse_layers)

    @property
    def moe_layer_index(self) -> tuple[int, ...]:
        """Decoder layer -> its index among the sparse layers (-1 for a dense one)."""
        out, n = [], 0
        for sparse in self.sparse_layers:
            out.append(n if sparse else -1)
            n += sparse
        return tuple(out)


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-V2/V3's multi-head latent attention, in HF's terms.

    Each token's keys and values are compressed into one latent ``c_kv`` of
    ``kv_lora_rank`` (normalised by kv_a_layernorm) plus one shared roped key ``k_pe`` of
    ``qk_rope_head_dim``: that pair is what the paged cache stores.  ``kv_b_proj`` expands
    the latent per head into ``qk_nope_head_dim`` of key and ``v_head_dim`` of value.
    Queries come from ``q_proj``, or through the ``q_lora_rank`` bottleneck
    (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``) when that is set.
    """

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary over interleaved pairs (x0, x1), (x2, x3) ... (V2 always; V3's default)
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values one token stores per layer: the latent and the roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]  # rope_type + its parameters; None = plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # RMS-normalise q and k (per head, or over the whole projection: qk_norm_full)
    dtype: torch.dtype  # checkpoint's torch_dtype (float32 when unspecified)
    eos_token_ids: tuple[int, ...]  # union of config.json and generation_config.json
    bos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    sliding_window: Optional[int] = None  # the window of the layers that use one
    layer_sliding_windows: tuple[Optional[int], ...] = ()  # per layer: keys within the last w positions, None = full
    max_new_tokens: Optional[int] = None  # generation_config default, None = unbounded
    moe: Optional[MoEConfig] = None  # mixture-of-experts MLPs; None = every layer dense
    # Vision-language models (Qwen2-VL / Qwen2.5-VL): the tower's HF vision_config and
    # variant, the placeholder / vision-start token ids and the LM's M-RoPE sections.
    vision_config: Optional[dict] = field(default=None, compare=False, hash=False)
    vision_variant: Optional[str] = None
    image_token_id: Optional[int] = None
    vision_start_token_id: Optional[int] = None
    mrope_section: Optional[tuple[int, ...]] = None
    # Gemma 3 (vision "siglip"): the image tokens each image becomes (the projector's pooled grid).
    mm_tokens_per_image: Optional[int] = None
    # Family variations of the decoder (defaults: Llama's).
    qk_norm_full: bool = False  # OLMo 2/3: q_norm/k_norm over all heads' [heads * head_dim] at once
    norm_scheme: str = "pre"  # pre: x + f(norm(x)); post (OLMo 2/3): x + norm(f(x)); sandwich (Gemma 3): both
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0  # rotate the first rotary_dim of each head only (Phi-4-mini)
    layer_rope: tuple[bool, ...] = ()  # per layer: rotary applied; () = every layer (SmolLM3: NoPE layers)
    # The sliding-window layers' own (rope_theta, rope_scaling) where they differ from the
    # full-attention layers' (Gemma 3's local base, OLMo 3's per-layer-type parameters).
    local_rope: Optional[tuple[float, Optional[dict]]] = None
    query_pre_attn_scalar: Optional[float] = None  # attention scale = this ** -0.5 (Gemma 3); None: head_dim's
    final_logit_softcapping: Optional[float] = None  # logits = cap * tanh(logits / cap) (Gemma)
    # Granite's scalars (models/granite.py): embeddings x embedding_multiplier, each block's
    # attention and MLP outputs x residual_multiplier before they join the residual stream,
    # attention scale attention_multiplier (not head_dim ** -0.5), logits / logits_scaling.
    granite_multipliers: Optional[tuple[float, float, float, float]] = None
    # How the checkpoint's linear layers are stored when quantized (None: dense).
    quantization: Optional[CheckpointQuantization] = field(default=None, compare=False, hash=False)
    # GPT-OSS: a learned per-head logit (``self_attn.sinks``) joins every softmax denominator.
    attention_sinks: bool = False
    # DeepSeek-V2/V3: multi-head latent attention (head_dim is then qk_rope_head_dim: the
    # rotary part, which is all the rope table covers).
    mla: Optional[MLAConfig] = None

    @property
    def is_multimodal(self) -> bool:
        return self.vision_config is not None

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def family(self):
        """This architecture's registry entry (models/registry.py)."""
        return ModelRegistry.resolve([self.architecture])

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | Path, *, language_model_only: bool = False) -> "ModelConfig":
        """``language_model_only``: a vision-language checkpoint served as its language
        model (vLLM's ``--limit-mm-per-prompt '{"image": 0}'``: no vision tower loaded,
        image input refused)."""
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        cfg = _read_json(cfg_file)
        gen = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
        mc = cls.from_dicts(path, cfg, gen)
        return mc.language_model_only() if language_model_only and mc.is_multimodal else mc

    def language_model_only(self) -> "ModelConfig":
        """This vision-language model without its vision side, where the family's model
        can be built so (``serves_language_model_only``)."""
        if not getattr(self.family.model_class(), "serves_language_model_only", False):
            raise ValueError(f"{self.architecture}: serving the language model only (--limit-mm-per-prompt "
                             f"'{{\"image\": 0}}') is not implemented for this family")
        return replace(self, vision_config=None, vision_variant=None, image_token_id=None, vision_start_token_id=None,
                       mm_tokens_per_image=None)

    @classmethod
    def from_dicts(cls, path: Path, cfg: dict, gen: Optional[dict] = None) -> "ModelConfig":
        gen = gen or {}
        entry = ModelRegistry.resolve(cfg.get("architectures"))
        arch, family = entry.architecture, entry.switches
        vision = family.get("vision")
        top = cfg
        if vision or family.get("text_config"):
            # transformers 5 nests the LM's settings under text_config (Gemma 3's image-text
            # checkpoints always); older configs keep them top-level.  The text config's values win.
            text = cfg.get("text_config")
            if isinstance(text, dict):
                cfg = {**cfg, **{k: v for k, v in text.items() if v is not None and k != "architectures"}}
        # A quantized checkpoint loads when its format is one the loader can turn dense
        # (quantization/config.py); any other is refused by name here, before a weight is read.
        quantization = parse_quantization(cfg.get("quantization_config") or cfg.get("compression_config"))
        act = cfg.get("hidden_act", cfg.get("hidden_activation")) or "silu"
        acts = family.get("acts", ("silu", "swish"))
        if act not in acts:
            raise ValueError(f"Unsupported hidden_act {act!r}; {arch} implements {', '.join(acts)}")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            inter = int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None
        if cfg.get("attn_logit_softcapping"):
            # No attention backend here caps the attention logits (Gemma 2's setting;
            # Gemma 3's configs leave it unset).
            raise ValueError(f"{arch}: attn_logit_softcapping={cfg['attn_logit_softcapping']} is not supported "
                             f"(no attention backend implements soft-capped attention logits)")
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if family.get("mla"):
            if cfg.get("attention_bias"):
                raise ValueError(f"{arch}: attention_bias=True is not supported with multi-head latent attention "
                                 f"(no released DeepSeek checkpoint sets it)")
            try:
                head_dim = int(cfg["qk_rope_head_dim"])  # the rope table's width
            except KeyError:
                raise ValueError("config.json lacks required key 'qk_rope_head_dim'") from None
            kv_heads = heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")

        rope = dict(cfg.get("rope_parameters") or {})
        local_rope = None
        # transformers 5 may nest per-layer-type parameters: full attention's are the
        # model's, the sliding layers' are kept beside them when they differ.
        if "full_attention" in rope and isinstance(rope["full_attention"], dict):
            nested = rope
            rope = dict(nested["full_attention"])
            local = nested.get("sliding_attention")
            if isinstance(local, dict) and local != nested["full_attention"]:
                local_rope = _local_rope(local, cfg)
        elif cfg.get("rope_local_base_freq") is not None:  # Gemma 3's legacy key
            local_rope = (float(cfg["rope_local_base_freq"]), None)
        legacy = cfg.get("rope_scaling")
        if legacy:
            rope.update(legacy)
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope.pop("type", None)
        if rope_type in ("su", "longrope"):  # Phi-3's LongRoPE (legacy name "su")
            rope_type = rope["rope_type"] = "longrope"
            if rope.get("original_max_position_embeddings") is None:
                rope["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings")
            lacking = [k for k in ("short_factor", "long_factor", "original_max_position_embeddings")
                       if rope.get(k) is None]
            if lacking:
                raise ValueError(f"rope_type longrope needs {', '.join(lacking)}")
        mrope_section = rope.pop("mrope_section", None)
        if rope_type == "mrope":  # Qwen2-VL's legacy name for default frequencies split by mrope_section
            rope_type = "default"
            rope["rope_type"] = "default"
        if vision and vision != "siglip":  # Qwen2-VL / 2.5-VL: M-RoPE (Gemma 3 keeps plain RoPE)
            if not mrope_section:
                raise ValueError(f"{arch} config has no rope_scaling.mrope_section")
            mrope_section = tuple(int(v) for v in mrope_section)
            if sum(mrope_section) != head_dim // 2:
                raise ValueError(f"mrope_section {list(mrope_section)} must sum to head_dim // 2 = {head_dim // 2}")
        else:
            mrope_section = None
        # transformers names Gemma 3's image token ``image_token_index`` (older configs) or ``image_token_id``
        image_token = top.get("image_token_id", top.get("image_token_index"))
        if vision:
            if not isinstance(top.get("vision_config"), dict):
                raise ValueError(f"{arch} config has no vision_config")
            if image_token is None:
                raise ValueError(f"{arch} config has no image_token_id")
            if vision == "siglip" and not top.get("mm_tokens_per_image"):
                raise ValueError(f"{arch} config has no mm_tokens_per_image")
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        mla = _mla_config(cfg, rope_scaling) if family.get("mla") else None

        attention_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = family.get("qkv_bias_default", False) or attention_bias
        # GLM-4.5: attention_bias biases q/k/v only, o_proj never.
        o_bias = attention_bias and not family.get("qkv_bias_default", False) and family.get("o_bias", True)
        qk_norm = family.get("qk_norm")
        if qk_norm == "config":  # GLM-4.5: per-head q/k norms when use_qk_norm
            qk_norm = "head" if cfg.get("use_qk_norm") else None

        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        if dtype_name not in _DTYPES:
            raise ValueError(f"Unsupported torch_dtype {dtype_name!r}; supported: {', '.join(_DTYPES)}")

        eos: list[int] = []
        for value in (cfg.get("eos_token_id"), gen.get("eos_token_id")):
            for i in _ids(value):
                if i not in eos:
                    eos.append(i)

        layer_windows = _layer_sliding_windows(cfg, family.get("sliding"), layers)
        sliding = next((w for w in layer_windows if w), None)

        max_new = gen.get("max_new_tokens")
        moe = _moe_config(cfg, family.get("moe"), layers) if family.get("moe") else None
        return cls(
            path=Path(path),
            architecture=arch,
            model_type=str(cfg.get("model_type", "")),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=inter,
            vocab_size=vocab,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=bool(qk_norm),
            dtype=_DTYPES[dtype_name],
            eos_token_ids=tuple(eos),
            bos_token_id=cfg.get("bos_token_id", gen.get("bos_token_id")),
            pad_token_id=cfg.get("pad_token_id", gen.get("pad_token_id")),
            sliding_window=sliding,
            layer_sliding_windows=layer_windows,
            max_new_tokens=int(max_new) if max_new is not None else None,
            moe=moe,
            vision_config=dict(top["vision_config"]) if vision else None,
            vision_variant=vision,
            image_token_id=int(image_token) if vision else None,
            vision_start_token_id=(int(top["vision_start_token_id"]) if vision and
                                   top.get("vision_start_token_id") is not None else None),
            mrope_section=mrope_section,
            mm_tokens_per_image=int(top["mm_tokens_per_image"]) if vision == "siglip" else None,
            qk_norm_full=qk_norm == "full",
            norm_scheme=family.get("norm", "pre"),
            hidden_act=act,
            partial_rotary_factor=partial,
            layer_rope=_layer_rope(cfg, family.get("nope"), layers),
            local_rope=local_rope if any(layer_windows) else None,
            query_pre_attn_scalar=(float(cfg["query_pre_attn_scalar"]) if family.get("gemma") and
                                   cfg.get("query_pre_attn_scalar") is not None else None),
            final_logit_softcapping=(float(cfg["final_logit_softcapping"]) if cfg.get("final_logit_softcapping")
                                     else None),
            granite_multipliers=(tuple(float(cfg.get(k, d)) for k, d in (
                ("embedding_multiplier", 1.0), ("residual_multiplier", 1.0),
                ("attention_multiplier", 1.0), ("logits_scaling", 1.0))) if family.get("granite") else None),
            quantization=quantization,
            attention_sinks=bool(family.get("sinks")),
            mla=mla,
        )


def _yarn_mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _mla_config(cfg: dict, rope_scaling: Optional[dict]) -> MLAConfig:
    """DeepSeek's attention dimensions; the softmax scale as transformers'
    ``yarn_apply_mscale``: with any rope scaling, YaRN's ``mscale_all_dim`` correction
    scales every q.k (not only the rotary dims) by mscale squared."""
    try:
        kv_lora, nope, rope, v = (int(cfg[k]) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                         "v_head_dim"))
    except KeyError as e:
        raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None
    scale = (nope + rope) ** -0.5
    if rope_scaling and rope_scaling.get("mscale_all_dim"):
        m = _yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
        scale = scale * m * m
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=kv_lora, qk_nope_head_dim=nope,
                     qk_rope_head_dim=rope, v_head_dim=v,
                     # transformers' DeepSeek-V2 always rotates interleaved pairs; V3 unless rope_interleave=False
                     rope_interleave=bool(cfg.get("rope_interleave", True)), softmax_scale=scale)


_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _moe_config(cfg: dict, family: str, num_layers: int) -> MoEConfig:
    """The sparse-MLP settings of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json, with
    the variants this engine cannot serve refused by name."""
    if family in ("glm4_moe", "deepseek_v3", "deepseek_v2"):
        # GLM-4.5 routes as DeepSeek-V3 (noaux_tc); DeepSeek-V2 by a softmax, its experts
        # limited to the topk_group best groups (a group's score: its best expert) with
        # group_limited_greedy, and never renormalised (transformers ignores norm_topk_prob).
        experts = int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 0)) or 0)
        first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
        try:
            inter = int(cfg["moe_intermediate_size"])
        except KeyError:
            raise ValueError("config.json lacks required key 'moe_intermediate_size'") from None
        n_group = int(cfg.get("n_group", 1) or 1)
        scoring, norm = "sigmoid", bool(cfg.get("norm_topk_prob", True))
        if family == "deepseek_v2":
            method = cfg.get("topk_method") or "greedy"
            if method not in _V2_TOPK_METHODS:
                raise ValueError(f"DeepseekV2ForCausalLM: topk_method {method!r} is not supported; supported: "
                                 f"{', '.join(_V2_TOPK_METHODS)}")
            scoring, norm = "softmax_grouped", False
            if method == "greedy":
                n_group = 1
        if experts % n_group:
            raise ValueError(f"n_group={n_group} does not divide the {experts} routed experts")
        return _checked_moe(MoEConfig(
            family, experts, int(cfg.get("num_experts_per_tok", 0)), inter,
            norm_topk_prob=norm,
            sparse_layers=tuple(i >= first_dense for i in range(num_layers)), scoring=scoring, n_group=n_group,
            topk_group=int(cfg.get("topk_group", 1) or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            shared_experts_intermediate_size=inter * int(cfg.get("n_shared_experts", 0) or 0)))
    if family == "gpt_oss":
        # Every layer sparse; intermediate_size is the per-expert size (there is no dense MLP).
        return _checked_moe(MoEConfig(
            family, int(cfg.get("num_local_experts", 0) or 0),
            int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0),
            int(cfg["intermediate_size"]), norm_topk_prob=False, sparse_layers=(True,) * num_layers,
            scoring="topk_softmax", router_bias=True, expert_bias=True,
            swiglu_clamp=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0)))))
    if family == "mixtral":
        experts, top_k = int(cfg.get("num_local_experts", 8)), int(cfg.get("num_experts_per_tok", 2))
        inter = int(cfg["intermediate_size"])
        sparse = (True,) * num_layers
        return _checked_moe(MoEConfig(family, experts, top_k, inter, norm_topk_prob=True, sparse_layers=sparse,
                                      block_name="block_sparse_moe", expert_names=("w1", "w3", "w2")))
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts.
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
    top_k = int(cfg.get("num_experts_per_tok", 0))
    try:
        inter = int(cfg["moe_intermediate_size"])
    except KeyError:
        raise ValueError("config.json lacks required key 'moe_intermediate_size'") from None
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_only = {int(i) for i in cfg.get("mlp_only_layers") or []}
    # transformers' rule: layer i is sparse unless listed in mlp_only_layers, and then
    # only every decoder_sparse_step-th layer (1-based).
    sparse = tuple(experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(num_layers))
    shared = int(cfg.get("shared_expert_intermediate_size", 0) or 0) if family == "qwen2_moe" else 0
    if family == "qwen2_moe" and shared <= 0:
        raise ValueError("Qwen2-MoE config has no shared_expert_intermediate_size; its checkpoints always carry a "
                         "shared expert")
    return _checked_moe(MoEConfig(family, experts, top_k, inter, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                                  sparse_layers=sparse, shared_expert_intermediate_size=shared))


def _checked_moe(moe: MoEConfig) -> MoEConfig:
    if moe.num_experts <= 0 or not any(moe.sparse_layers):
        raise ValueError(f"{moe.family} config has no expert layers (num_experts={moe.num_experts})")
    if not 1 <= moe.top_k <= moe.num_experts:
        raise ValueError(f"num_experts_per_tok={moe.top_k} must be between 1 and the {moe.num_experts} experts")
    if moe.num_experts > 65535:
        raise ValueError(f"{moe.num_experts} experts: routed expert ids are stored as uint16, at most 65535 experts")
    return moe


def _local_rope(params: dict, cfg: dict) -> tuple[float, Optional[dict]]:
    """(theta, scaling or None) of one layer type's rope parameters."""
    params = dict(params)
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)
    rope_type = params.pop("type", None) or params.get("rope_type", "default")
    return theta, (None if rope_type == "default" else {**params, "rope_type": rope_type})


def _layer_rope(cfg: dict, rule: Optional[str], num_layers: int) -> tuple[bool, ...]:
    """Per layer: whether it rotates q/k.  SmolLM3's ``no_rope_layers`` holds 1 for a
    layer with rotary, 0 for a NoPE layer (transformers' reading); absent, every
    ``no_rope_layer_interval``-th layer (1-based) is NoPE."""
    if rule != "smollm3":
        return ()
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % every != 0) for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(bool(f) for f in flags)


def _layer_sliding_windows(cfg: dict, rule: Optional[str], num_layers: int) -> tuple[Optional[int], ...]:
    """Which layers attend within ``sliding_window`` positions, as transformers decides:
    an explicit ``layer_types`` list wins; the family's ``sliding`` rule (registry)
    otherwise: ``all`` (Mistral, Phi-3) windows every layer when ``sliding_window`` is
    set; ``qwen`` (Qwen2/Qwen3) only with ``use_sliding_window``, and then the layers
    from ``max_window_layers`` on; ``gated`` (SmolLM3): ``layer_types`` only with
    ``use_sliding_window``; none: no layer."""
    window = cfg.get("sliding_window")
    if not window or (rule == "gated" and not cfg.get("use_sliding_window", False)):
        return (None,) * num_layers
    window = int(window)
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"Unsupported layer_types {unknown}; supported: full_attention, sliding_attention")
        return tuple(window if t == "sliding_attention" else None for t in types)
    if rule == "qwen":
        if not cfg.get("use_sliding_window", False):
            return (None,) * num_layers
        first = int(cfg.get("max_window_layers", 28))
        return tuple(window if i >= first else None for i in range(num_layers))
    if rule == "all":
        return (window,) * num_layers
    return (None,) * num_layers


def generation_defaults(source: str, model_dir: str | Path) -> dict:
    """Sampling defaults as vLLM's ``--generation-config``: ``auto`` reads the model's
    generation_config.json, ``vllm`` uses none, any other value is a folder holding a
    generation_config.json.  Keys: vLLM's diff sampling params, with HF's
    ``max_new_tokens`` as ``max_tokens``."""
    if source == "vllm":
        return {}
    folder = Path(model_dir) if source == "auto" else Path(source)
    path = folder / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise ValueError(f"--generation-config {source}: no generation_config.json in that folder")
        return {}
    gen = _read_json(path)
    out = {k: gen[k] for k in _GENERATION_DEFAULT_KEYS if gen.get(k) is not None}
    if gen.get("max_new_tokens") is not None:
        out["max_tokens"] = int(gen["max_new_tokens"])
    return out
