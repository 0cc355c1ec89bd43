"""Engine configuration: what the operator asks for, plus the resolution of the
values that depend on the model and the device (dtype, max_model_len, KV blocks)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from common.structured_outputs_config import StructuredOutputsConfig, parse_structured_outputs_config
from common.dtype_policy import checkpoint_dtype, resolve_auto_dtype

# vLLM's --kv-cache-dtype values this engine stores: fp8 is e4m3 (vLLM's default FP8 on
# CUDA); the scale is 1.0 (vLLM's without calibrated k/v scales): values are saturated
# to the format's range when written, converted back to the model dtype when read.
KV_CACHE_DTYPES: dict[str, Optional[torch.dtype]] = {
    "auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

# Fraction of device memory the engine may use on CUDA (weights + activations + KV).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
CPU_LINEAR_CHOICES = ("auto", "native", "onednn", "torch")
CPU_ATTENTION_CHOICES = ("auto", "native", "torch")
ATTENTION_BACKEND_CHOICES = ("auto", "native", "torch", "triton", "flash_attn")
# CPU KV cache default when the operator gives neither num_kv_blocks nor a size.
DEFAULT_CPU_KV_CACHE_GB = 1.0


@dataclass
class EngineConfig:
    model: str
    device: str = "cpu"  # "cpu", "cuda", "cuda:N"
    dtype: str = "auto"  # auto: the checkpoint's, fp32 -> bf16 (on CPU where bf16 is native): dtype_policy
    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    kv_cache_memory_gb: Optional[float] = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_model_len: Optional[int] = None  # capped by the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # vLLM's --async-scheduling: plan step N+1 while step N runs (core/inflight.py).
    # None: on for CUDA where it can run, off on CPU (as vLLM's CPU platform); True / False: forced.
    async_scheduling: Optional[bool] = None
    max_logprobs: int = 20
    seed: int = 0
    served_model_name: Optional[str] = None
    tokens_only: bool = False  # serve without a tokenizer
    num_threads: Optional[int] = None  # torch intra-op threads on CPU
    enforce_eager: bool = False  # False: CUDA graphs for decode batches
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype: auto (the model dtype), fp8 / fp8_e4m3, fp8_e5m2
    quantization: Optional[str] = None  # vLLM's --quantization: must name the checkpoint's method when given
    cpu_linear: str = "auto"  # CPU GEMMs: native (our bf16 GEMM), onednn (prepacked), torch (MKL); auto: see cpu_gemm
    cpu_attention: str = "auto"  # CPU attention + RMSNorm/SwiGLU/rotary: native (compiled), torch, auto: native if it builds
    # auto: triton on CUDA (flash_attn, then torch without it), cpu_attention's choice on CPU
    attention_backend: str = "auto"
    kv_cache_memory_bytes: Optional[int] = None  # KV cache size, overrides gpu_memory_utilization's profiling
    generation_config: str = "auto"  # auto: the model's generation_config.json; vllm: none; else a folder
    tensor_parallel_size: int = 1  # ranks (devices) one worker owns; cuda:i..i+N-1 on CUDA
    # RL replay records (vLLM's flags): every token's routed experts (MoE models only)
    # and every sampled token's surviving vocabulary after the sampler's filters.
    enable_return_routed_experts: bool = False
    return_sampling_mask: bool = False
    # Multi-LoRA serving (vLLM's flags): adapters by name -> PEFT folder at start,
    # device slots, the largest rank a slot holds, adapters kept in host memory.
    enable_lora: bool = False
    lora_modules: Optional[dict[str, str]] = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None
    # Speculative decoding: vLLM's --speculative-config (JSON text or dict), e.g.
    # {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}.
    speculative_config: Optional[Union[str, dict]] = None
    # Speculative decoding: decode rows plus drafts per step stay within this; None:
    # 8 on CPU (compute binds past a few rows there), no cap on CUDA; 0: no cap.
    spec_max_step_tokens: Optional[int] = None
    # Structured outputs: vLLM's --structured-outputs-config (JSON text or dict), e.g.
    # {"backend": "xgrammar"}; parsed by structured_outputs_config() below (common's parser, one
    # for gateway, workers and `tokserve serve`).
    structured_outputs_config: Optional[Union[str, dict]] = None
    # vLLM's --limit-mm-per-prompt (parsed: modality -> count; common/multimodal/limits.py);
    # {"image": 0} serves a vision-language checkpoint as its language model alone.
    limit_mm_per_prompt: Optional[dict] = None
    # P/D disaggregation (disagg/kv_transfer.py): where the KV transfer server binds (None:
    # tcp://127.0.0.1:*, a random port; bound on the first prefill leg) and how long a
    # finished prefill leg's blocks wait for their decode side (vLLM's 480 s).
    kv_transfer_address: Optional[str] = None
    kv_transfer_timeout: float = 480.0
    # Client kv_transfer_params are honoured only with this set (--role prefill|decode or
    # --kv-transfer-config, as vLLM needs a KV connector); the broker's own legs always are.
    kv_transfer_enabled: bool = False
    # At most this fraction of the KV blocks may be held for remote decode (finished
    # prefill legs' blocks plus those of prefill legs running): the rest stays for
    # ordinary requests, whatever clients ask for.
    kv_transfer_max_held: float = 0.5
    # Encoder disaggregation (disagg/ec_transfer.py): vLLM's ec_role from --ec-transfer-config;
    # ec_producer / ec_both export every encoder output for consumers to pull.
    ec_role: Optional[str] = None
    # vLLM's --mm-encoder-only: run the vision encoder of each request and finish it (no
    # language model step, no tokens); an encoder worker of encoder disaggregation.
    mm_encoder_only: bool = False

    def spec_step_token_cap(self, device) -> Optional[int]:
        cap = self.spec_max_step_tokens
        if cap is None:
            return 8 if device.type == "cpu" else None
        return cap or None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.mm_encoder_only:
            if self.ec_role not in ("ec_producer", "ec_both"):
                raise ValueError("--mm-encoder-only runs only the vision encoder, whose outputs reach the language "
                                 "model through encoder disaggregation: start it with --ec-transfer-config "
                                 "'{\"ec_connector\": \"ECCPUConnector\", \"ec_role\": \"ec_producer\"}'")
            self.enforce_eager = True  # no decode steps: nothing to capture
        if self.cpu_attention not in CPU_ATTENTION_CHOICES:
            raise ValueError(f"cpu_attention must be one of {', '.join(CPU_ATTENTION_CHOICES)}, "
                             f"got {self.cpu_attention!r}")
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKEND_CHOICES)}, "
                             f"got {self.attention_backend!r}")
        if not self.kv_transfer_timeout > 0:
            raise ValueError(f"kv_transfer_timeout must be > 0, got {self.kv_transfer_timeout}")
        if not 0.0 <= self.kv_transfer_max_held <= 1.0:
            raise ValueError(f"kv_transfer_max_held must be a fraction of the KV cache in [0, 1], "
                             f"got {self.kv_transfer_max_held}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.cpu_linear not in CPU_LINEAR_CHOICES:
            raise ValueError(f"cpu_linear must be one of {', '.join(CPU_LINEAR_CHOICES)}, got {self.cpu_linear!r}")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("--enable-lora with --tensor-parallel-size > 1 is not supported")
        if SpeculativeConfig.parse(self.speculative_config) is not None and self.tensor_parallel_size > 1:
            raise ValueError("--speculative-config with --tensor-parallel-size > 1 is not supported")
        structured_outputs_config(self.structured_outputs_config)  # ValueError naming what is wrong
        self.torch_device  # validates the device string
        self.dtype_for(self.torch_device)  # validates the dtype string
        self.kv_dtype  # validates --kv-cache-dtype

    @property
    def torch_device(self) -> torch.device:
        try:
            dev = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"invalid device {self.device!r}: {e}") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        return dev

    @property
    def resolved_device(self) -> torch.device:
        """The device with its index: plain ``cuda`` means the current CUDA device."""
        dev = self.torch_device
        if dev.type == "cuda" and dev.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return dev

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    def dtype_for(self, device: torch.device) -> torch.dtype:
        return self.dtype_choice(device)[0]

    def dtype_choice(self, device: torch.device) -> tuple[torch.dtype, str]:
        """(dtype, why): an explicit --dtype as given, ``auto`` from the checkpoint."""
        name = self.dtype.lower()
        if name == "auto":
            return resolve_auto_dtype(checkpoint_dtype(self.model), device)
        if name not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        return _DTYPES[name], f"--dtype {self.dtype}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.dtype_for(self.torch_device)

    @property
    def kv_dtype(self) -> Optional[torch.dtype]:
        """The KV cache's storage dtype when it differs from the model's (FP8), else None."""
        name = self.kv_cache_dtype.lower()
        if name not in KV_CACHE_DTYPES:
            if name in ("bfloat16", "fp8_ds_mla", "fp8_inc"):
                raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} is not supported (the KV cache holds the "
                                 f"model dtype with auto, or FP8: {', '.join(KV_CACHE_DTYPES)})")
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        return KV_CACHE_DTYPES[name]

    @property
    def language_model_only(self) -> bool:
        """No image input (``--limit-mm-per-prompt '{"image": 0}'``): the vision tower is not loaded."""
        return (self.limit_mm_per_prompt or {}).get("image") == 0

    def resolve_max_model_len(self, max_position_embeddings: Optional[int]) -> int:
        limits = [x for x in (self.max_model_len, max_position_embeddings) if x]
        if not limits:
            raise ValueError("max_model_len is unknown: the model config has no max_position_embeddings")
        return min(limits)

    def step_token_budget(self, max_model_len: int) -> int:
        # Without chunking a whole prompt must fit in one step.
        if self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, max_model_len)

    def max_blocks_per_seq(self, max_model_len: int) -> int:
        return -(-max_model_len // self.block_size)


# --- ``--speculative-config`` (the spec_decode package's settings; validated with the rest) --
# Keys of vLLM's SpeculativeConfig each method takes here.
_KEYS = {"ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                   "disable_by_batch_size"},
         "draft_model": {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size",
                         "disable_by_batch_size"}}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    disable_by_batch_size: Optional[int] = None  # vLLM: no drafts once this many requests run
    model: Optional[str] = None  # draft_model: the draft checkpoint's folder

    @classmethod
    def parse(cls, value: Union[str, dict, None]) -> Optional["SpeculativeConfig"]:
        """None when speculation is off; ValueError naming what is wrong."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object")
        cfg: dict[str, Any] = dict(value)
        method = cfg.get("method")
        if method is None and cfg.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling
            method = cfg.pop("model")
        if method == "[ngram]":
            method = "ngram"
        if method is None and cfg.get("model"):
            method = "draft_model"
        if method not in _KEYS:
            raise ValueError(f"--speculative-config: method {method!r} is not supported; supported: "
                             f"'ngram', 'draft_model'")
        unknown = sorted(set(cfg) - _KEYS[method])
        if unknown:
            raise ValueError(f"--speculative-config: {', '.join(unknown)} not supported with method {method!r}")
        k = cfg.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        disable = cfg.get("disable_by_batch_size")
        if disable is not None and (not isinstance(disable, int) or disable < 2):
            raise ValueError(f"--speculative-config: disable_by_batch_size must be an integer >= 2, got {disable!r}")
        if method == "draft_model":
            model = cfg.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError("--speculative-config: method 'draft_model' needs 'model' (the draft checkpoint)")
            if cfg.get("draft_tensor_parallel_size", 1) != 1:
                raise ValueError("--speculative-config: draft_tensor_parallel_size must be 1")
            return cls("draft_model", k, disable_by_batch_size=disable, model=model)
        lo, hi = cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max")
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"--speculative-config: {name} must be an integer >= 1, got {v!r}")
        if lo is None and hi is None:
            lo = hi = 5  # vLLM's defaults
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        return cls("ngram", k, lo, hi, disable)


def structured_outputs_config(value: Union[str, dict, None]) -> StructuredOutputsConfig:
    """The worker's ``--structured-outputs-config`` (JSON text, or a dict from Python
    callers): common's parser, so gateway and workers accept and refuse the same values."""
    return parse_structured_outputs_config(json.dumps(value) if isinstance(value, dict) else value)
