"""The model registry: which Hugging Face ``architectures`` name runs on which model
implementation, what the config parser must know about the family, and what the
family supports (docs/models.md's table and ``tokserve models`` print it).

Like vLLM's ``ModelRegistry`` (vllm/model_executor/models/registry.py) an entry names
its implementation by module and class and is imported only when a model of that
architecture is built: reading a config.json, listing the architectures or refusing
an unsupported one import no model code.

Every implementation follows the small ``Model`` protocol of models/interface.py.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

# The projections of the Llama-family decoder a LoRA may target, by their HF names
# (what worker/engine/lora serves).
LLAMA_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelFamily:
    """One registered architecture.

    ``switches`` are read by the config parser (models/config.py): the attention
    biases (``qkv_bias_default``), per-head q/k RMSNorm (``qk_norm``: ``"head"``, or
    ``"full"`` over the whole projection as OLMo 2), the MoE variant (``moe``), the
    vision tower (``vision``), where sliding windows apply when the config has no
    ``layer_types`` (``sliding``: ``"all"`` = every layer, ``"qwen"`` = from
    ``max_window_layers`` with ``use_sliding_window``), the decoder block layout
    (``norm``: ``"pre"``, ``"post"`` OLMo 2, ``"sandwich"`` Gemma 3), the MLP
    activations the implementation has (``acts``).
    """

    architecture: str
    module: str  # under worker.engine.models
    class_name: str
    label: str  # the family as users name it (README, `tokserve models`)
    switches: Mapping[str, Any] = field(default_factory=dict)
    lora_modules: tuple[str, ...] = LLAMA_LORA_MODULES  # HF names an adapter may target; () = no LoRA
    lora_served: bool = True  # worker/engine/lora serves this family's adapters (not only declared)
    tensor_parallel: bool = True
    routed_experts: bool = False  # MoE routing capture (--enable-return-routed-experts)
    images: bool = False
    sliding_window: bool = False  # honours per-layer sliding windows of its configs
    notes: str = ""

    def model_class(self) -> type:
        """The implementation class (imported now, not at registration)."""
        module = importlib.import_module(f"worker.engine.models.{self.module}")
        return getattr(module, self.class_name)

    def supports(self) -> dict[str, bool]:
        return {"LoRA": bool(self.lora_modules) and self.lora_served, "TP": self.tensor_parallel,
                "routed_experts": self.routed_experts, "images": self.images,
                "sliding window": self.sliding_window}


class _ModelRegistry:
    def __init__(self, families: Iterable[ModelFamily] = ()):
        self._families: dict[str, ModelFamily] = {}
        for family in families:
            self.register(family)

    def register(self, family: ModelFamily) -> None:
        """Add (or replace) an architecture: out-of-tree implementations plug in here."""
        self._families[family.architecture] = family

    def unregister(self, arch: str) -> None:
        self._families.pop(arch, None)

    def get_supported_archs(self) -> tuple[str, ...]:
        return tuple(self._families)

    def families(self) -> tuple[ModelFamily, ...]:
        return tuple(self._families.values())

    def __contains__(self, arch: str) -> bool:
        return arch in self._families

    def resolve(self, architectures: Optional[Iterable[str]]) -> ModelFamily:
        """The first registered name of a config's ``architectures`` list; an
        unsupported one is refused by name with the supported list."""
        archs = list(architectures or [])
        for arch in archs:
            if arch in self._families:
                return self._families[arch]
        raise ValueError(f"Unsupported architecture {'/'.join(archs) or '(none given)'}; supported: "
                         f"{', '.join(self._families)}")

    def model_class(self, arch: str) -> type:
        return self.resolve([arch]).model_class()


_LLAMA = "llama"
_MOE = dict(lora_modules=("q_proj", "k_proj", "v_proj", "o_proj"), tensor_parallel=True, routed_experts=True)
_VL = dict(tensor_parallel=False, images=True, sliding_window=True)
_GEMMA3 = dict(qkv_bias_default=False, qk_norm="head", norm="sandwich", gemma=True, acts=("gelu_pytorch_tanh",))

ModelRegistry = _ModelRegistry([
    # The Llama-family decoder (models/llama.py) and its switches.
    ModelFamily("LlamaForCausalLM", _LLAMA, "LlamaForCausalLM", "Llama",
                dict(qkv_bias_default=False, qk_norm=None)),
    ModelFamily("MistralForCausalLM", _LLAMA, "LlamaForCausalLM", "Mistral",
                dict(qkv_bias_default=False, qk_norm=None, sliding="all"), sliding_window=True),
    ModelFamily("Qwen2ForCausalLM", _LLAMA, "LlamaForCausalLM", "Qwen2 / Qwen2.5",
                dict(qkv_bias_default=True, qk_norm=None, sliding="qwen"), sliding_window=True),
    ModelFamily("Qwen3ForCausalLM", _LLAMA, "LlamaForCausalLM", "Qwen3",
                dict(qkv_bias_default=False, qk_norm="head", sliding="qwen"), sliding_window=True),
    ModelFamily("MixtralForCausalLM", _LLAMA, "LlamaForCausalLM", "Mixtral",
                dict(qkv_bias_default=False, qk_norm=None, moe="mixtral", sliding="all"), sliding_window=True,
                **_MOE),
    ModelFamily("Qwen2MoeForCausalLM", _LLAMA, "LlamaForCausalLM", "Qwen2-MoE",
                dict(qkv_bias_default=True, qk_norm=None, moe="qwen2_moe", sliding="qwen"), sliding_window=True,
                **_MOE),
    ModelFamily("Qwen3MoeForCausalLM", _LLAMA, "LlamaForCausalLM", "Qwen3-MoE",
                dict(qkv_bias_default=False, qk_norm="head", moe="qwen3_moe", sliding="qwen"),
                sliding_window=True, **_MOE),
    # Vision-language: a Qwen2 LM with M-RoPE behind a Qwen2-VL / Qwen2.5-VL vision tower.
    ModelFamily("Qwen2VLForConditionalGeneration", "qwen2_vl", "Qwen2VLForConditionalGeneration", "Qwen2-VL",
                dict(qkv_bias_default=True, qk_norm=None, vision="qwen2_vl", sliding="qwen"), **_VL),
    ModelFamily("Qwen2_5_VLForConditionalGeneration", "qwen2_vl", "Qwen2VLForConditionalGeneration",
                "Qwen2.5-VL", dict(qkv_bias_default=True, qk_norm=None, vision="qwen2_5_vl", sliding="qwen"), **_VL),
    ModelFamily("Glm4MoeForCausalLM", _LLAMA, "LlamaForCausalLM", "GLM-4.5 / GLM-4.6",
                dict(qkv_bias_default=False, o_bias=False, qk_norm="config", moe="glm4_moe"), **_MOE,
                notes="sigmoid grouped top-k routing with the correction bias, shared experts, dense first "
                      "layers, partial rotary"),
    # Dense families composed of the same decoder (models/llama.py) with their variations.
    ModelFamily("Phi3ForCausalLM", "phi3", "Phi3ForCausalLM", "Phi-3 / Phi-4",
                dict(qkv_bias_default=False, qk_norm=None, sliding="all"), sliding_window=True,
                lora_modules=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
                notes="fused qkv_proj / gate_up_proj; LongRoPE (factors chosen per position: see Differences from "
                      "vLLM); partial rotary"),
    ModelFamily("SmolLM3ForCausalLM", _LLAMA, "LlamaForCausalLM", "SmolLM3",
                dict(qkv_bias_default=False, qk_norm=None, nope="smollm3", sliding="gated"), sliding_window=True,
                notes="NoPE layers (no_rope_layers)"),
    # OLMo 2/3: the q/k norms span all heads (under TP their mean square is all-reduced).
    ModelFamily("Olmo2ForCausalLM", _LLAMA, "LlamaForCausalLM", "OLMo 2",
                dict(qkv_bias_default=False, qk_norm="full", norm="post"),
                notes="post-norm blocks, q/k norm over the whole projection"),
    ModelFamily("Olmo3ForCausalLM", _LLAMA, "LlamaForCausalLM", "OLMo 3",
                dict(qkv_bias_default=False, qk_norm="full", norm="post"), sliding_window=True, notes="as OLMo 2; sliding layers with their own rope parameters"),
    ModelFamily("GraniteForCausalLM", "granite", "GraniteForCausalLM", "Granite 3.x",
                dict(qkv_bias_default=False, qk_norm=None, granite=True),
                notes="embedding, residual, attention and logits multipliers"),
    ModelFamily("Gemma3ForCausalLM", "gemma3", "Gemma3ForCausalLM", "Gemma 3 (text)", _GEMMA3, sliding_window=True,
                notes="local/global layers with their own rope; its (1 + w) norms and GeGLU run on torch ops; "
                      "final_logit_softcapping; attention soft-capping refused (not set by Gemma 3 configs)"),
    ModelFamily("Gemma3ForConditionalGeneration", "gemma3", "Gemma3ForConditionalGeneration", "Gemma 3 (image-text)",
                {**_GEMMA3, "text_config": True}, sliding_window=True, lora_served=False,
                notes="the text tower only: text requests served, image input refused; LoRA not served (its "
                      "adapters also name the vision tower's q/k/v projections)"),
    ModelFamily("GptOssForCausalLM", "gpt_oss", "GptOssForCausalLM", "GPT-OSS",
                dict(qkv_bias_default=False, qk_norm=None, moe="gpt_oss", sinks=True), sliding_window=True,
                lora_modules=("q_proj", "k_proj", "v_proj", "o_proj"), tensor_parallel=True,
                routed_experts=True,
                notes="attention sinks (CPU: torch SDPA; CUDA: Triton), biased top-k-softmax router, expert biases, clamped "
                      "SwiGLU (experts on the grouped torch path), YaRN; MXFP4 experts dequantized on load; LoRA on the "
                      "attention projections"),
])
