"""Gateway settings, filled from the command line by gateway/main.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from common.structured_outputs_config import StructuredOutputsConfig
from gateway.connection_limits import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PER_PEER
from gateway.cors import CorsPolicy


@dataclass
class GatewaySettings:
    broker: Optional[str] = None  # None: common.client's default address
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[list[str]] = None  # any of these Bearer keys (gateway/auth.py)
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
    # headers over max_header_bytes get 431.  timeout_keep_alive (uvicorn's) also bounds
    # a new connection's wait for its first byte.  limit_concurrency and its per-peer
    # twin cap open connections (gateway/connection_limits.py).
    header_read_timeout_s: Optional[float] = 30.0
    body_read_timeout_s: Optional[float] = 60.0
    max_header_bytes: Optional[int] = 64 * 1024
    timeout_keep_alive_s: float = 5.0
    limit_concurrency: int = DEFAULT_MAX_CONNECTIONS
    limit_concurrency_per_peer: int = DEFAULT_MAX_PER_PEER
    # vLLM's --allowed-origins family (gateway/cors.py); None: no CORS, OPTIONS is 401/405.
    cors: Optional[CorsPolicy] = None
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
    # The broker's control token (common/runtime_dir.py), read only when a control route is
    # served (needs_control); None: $TOKSERVE_CONTROL_TOKEN_FILE, else the runtime directory's.
    control_token_file: Optional[str] = None
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
    # vLLM's --return-tokens-as-token-ids: the OpenAI routes' default for the request's
    # return_tokens_as_token_ids (logprob tokens as "token_id:N")
    return_tokens_as_token_ids: bool = False
    # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details (cached_tokens) on
    # /inference/v1/generate, /v1/chat/completions and /v1/completions; off, it is null.
    enable_prompt_tokens_details: bool = False
    # vLLM's VLLM_ENABLE_RESPONSES_API_STORE (off: store=true is silently not stored, as
    # there); stored responses are bounded (gateway/openai_api/response_store.py).
    enable_responses_store: bool = False
    responses_store_max_entries: int = 1024
    responses_store_max_bytes: int = 64 * 1024 * 1024
    # Text side (render / derender / tokenize / the OpenAI facade): the model folder whose
    # tokenizer and chat template the gateway loads; None serves tokens only.
    tokenizer: Optional[str] = None
    chat_template: Optional[str] = None  # --chat-template: a file or the template text
    default_chat_template_kwargs: dict = field(default_factory=dict)
    trust_request_chat_template: bool = False
    reasoning_parser: Optional[str] = None
    tool_call_parser: Optional[str] = None
    enable_auto_tool_choice: bool = False
    # vLLM's --structured-outputs-config (common/structured_outputs_config.py): xgrammar only;
    # its reasoning_parser is the --reasoning-parser default.
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
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
    # Image bombs (gateway/multimodal.py): bounds checked on each image's header, before any
    # pixel is decoded.  Per image: 50 M pixels covers 48 MP photos (vLLM's own cap is
    # Pillow's 179 M); a full decode costs ~3-4 bytes a pixel, RGB conversion on top.
    max_image_decoded_pixels: int = 50_000_000
    max_request_decoded_pixels: int = 200_000_000
    max_image_bytes: int = 20 * 1024 * 1024  # encoded bytes of one image (data:, file:, http)
    # gateway/media_pools.py: decoding runs on its own threads; past the queue, 503.
    image_decode_threads: int = 2
    image_decode_queue: int = 16
    # http(s) media (--allow-remote-media): vLLM's --allowed-media-domains (exact host names,
    # every redirect hop; empty: any host); private/loopback/link-local addresses refused
    # unless inside these networks (CIDR; VLLM_MEDIA_EGRESS_BLOCK_PRIVATE=0: all of them);
    # one deadline for the whole fetch (vLLM's VLLM_IMAGE_FETCH_TIMEOUT, default 5 s).
    allowed_media_domains: list = field(default_factory=list)
    media_private_networks: list = field(default_factory=list)
    image_fetch_timeout_s: float = 5.0
    media_fetch_threads: int = 8

    def needs_control(self) -> bool:
        """Whether any served route sends CONTROL commands (RL routes, runtime LoRA)."""
        return self.enable_rl or self.allow_runtime_lora
