"""Gateway settings, filled from the command line by gateway/main.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class GatewaySettings:
    broker: Optional[str] = None  # None: common.client's default address
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    tokens_only: bool = False
    # Names the model answers to; empty: the name the workers report.
    served_model_names: list[str] = field(default_factory=list)
    max_body_bytes: int = 32 * 1024 * 1024
    # Text work (tokenize, chat template, detokenize) runs on this many threads, off the
    # event loop; beyond render_workers + render_queue pending jobs a request gets 503.
    render_workers: int = 4
    render_queue: int = 64
    # The longest prompt text tokenized, and the most a chat template may write or build.
    max_prompt_chars: int = 8 * 1024 * 1024
    chat_template_timeout_s: float = 5.0  # wall clock for one chat template render
    # Slow clients: headers and body must arrive within these (None: no deadline);
    # headers over max_header_bytes get 431.  timeout_keep_alive and limit_concurrency
    # are uvicorn's.
    header_read_timeout_s: Optional[float] = 30.0
    body_read_timeout_s: Optional[float] = 60.0
    max_header_bytes: Optional[int] = 64 * 1024
    timeout_keep_alive_s: float = 5.0
    limit_concurrency: Optional[int] = None
    # Cluster info (limits, live workers) is cached this long between broker round trips.
    info_ttl_s: float = 1.0
    info_timeout_s: float = 2.0
    # After a client disconnects, the abort's terminal delta should arrive promptly;
    # past this grace the stream is cancelled locally.
    disconnect_grace_s: float = 5.0
    log_level: str = "info"
    # Bind with SO_REUSEPORT so several gateway processes share one port.
    reuse_port: bool = False
    # CURVE to the broker (common/security.py): its public key, and ours when it authenticates peers.
    curve_server_key: Optional[bytes] = None
    curve_client_key_file: Optional[str] = None
    # vLLM's RL / dev routes (/pause, /update_weights, /sleep, ...): --enable-rl or VLLM_SERVER_DEV_MODE=1.
    enable_rl: bool = False
    # RL replay fields the workers compute with the same flags: the gateway relays them
    # only when told to, so a response never carries what the operator did not enable.
    enable_return_routed_experts: bool = False
    return_sampling_mask: bool = False
    # /v1/load_lora_adapter and /v1/unload_lora_adapter: --allow-runtime-lora or
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (vLLM's switch).
    allow_runtime_lora: bool = False
    # vLLM's --per-request-spec-decode-metrics: metrics.speculative_decoding per n == 1
    # response (workers with --speculative-config); "detailed" adds per-step counts.
    per_request_spec_decode_metrics: str = "none"
    # vLLM's --enable-per-request-metrics: timing metrics on /v1/chat/completions and
    # /v1/completions responses (n == 1, one prompt; stream: the include_usage chunk).
    enable_per_request_metrics: bool = False
    # Text side (render / derender / tokenize / the OpenAI facade): the model folder whose
    # tokenizer and chat template the gateway loads; None serves tokens only.
    tokenizer: Optional[str] = None
    chat_template: Optional[str] = None  # --chat-template: a file or the template text
    default_chat_template_kwargs: dict = field(default_factory=dict)
    trust_request_chat_template: bool = False
    reasoning_parser: Optional[str] = None
    tool_call_parser: Optional[str] = None
    enable_auto_tool_choice: bool = False
    enable_tokenizer_info_endpoint: bool = False
    # vLLM's `vllm launch render`: render, derender and tokenize only, no broker.
    render_only: bool = False
    max_model_len: Optional[int] = None  # render-only: the context length (default: config.json's)
    # Image input (content_parts, Qwen2-VL family): file:// URLs only under this folder
    # (vLLM's --allowed-local-media-path); http(s) URLs only when allowed (ours; off).
    allowed_local_media_path: Optional[str] = None
    allow_remote_media: bool = False
    # vLLM's --limit-mm-per-prompt: items of a modality one prompt may carry (999 unset).
    limit_mm_per_prompt: dict = field(default_factory=dict)
