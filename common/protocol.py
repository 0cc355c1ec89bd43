"""Wire protocol shared by gateway, broker, worker and direct clients.

Every message is a multipart ZeroMQ frame list:
    [identity? (ROUTER side only)] [MAGIC] [type byte] [msgpack body] [extra frames...]
Bodies are msgspec Structs encoded as msgpack arrays (array_like) so that field
names never travel; ``omit_defaults`` drops trailing defaults.  No pickle anywhere.

The engine consumes ``SamplingParams`` / ``GenerateRequest`` directly and produces
``CompletionDelta`` objects directly, so no conversion layer exists between the
engine and the wire.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

MAGIC = b"TM1"  # bump when the frame layout or a Struct changes incompatibly


class MsgType:
    """Second frame after MAGIC: one byte naming the body's Struct."""

    GENERATE = b"\x01"  # client -> broker -> worker: GenerateRequest
    ABORT = b"\x02"  # client -> broker -> worker: Abort
    OUTPUTS = b"\x03"  # worker -> broker -> client: Outputs
    ERROR = b"\x04"  # anyone -> client: ErrorMsg (request level)
    READY = b"\x05"  # worker -> broker: WorkerReady
    HEARTBEAT = b"\x06"  # both ways; worker's body is WorkerLoad, others empty
    DISCONNECT = b"\x07"  # worker -> broker on graceful exit / broker -> worker
    INFO = b"\x08"  # client -> broker (empty) / broker -> client: ClusterInfo
    CONTROL = b"\x09"  # control plane: ControlRequest out, ControlReply / RankReply back
    KV_EVENTS = b"\x0a"  # worker -> broker: KvEvents (prefix-cache blocks stored / removed)


_STRUCT = dict(array_like=True, omit_defaults=True, gc=False)


# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5


class StructuredOutputs(msgspec.Struct, **_STRUCT):
    """vLLM's ``StructuredOutputsParams`` as it travels: exactly one constraint is set
    (the gateway checks it; the worker checks it again for direct ZeroMQ clients).
    ``json`` is the JSON schema serialised to a string, so the struct stays flat."""

    json: Optional[str] = None  # a JSON schema (serialised)
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None  # EBNF (xgrammar's GBNF dialect)
    json_object: Optional[bool] = None  # any JSON object
    structural_tag: Optional[str] = None  # vLLM's structural tag JSON (serialised)
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    # Reasoning models: the constraint starts only once the model has emitted this token
    # sequence (its reasoning parser's end marker, e.g. ``</think>``), as vLLM's
    # ``reasoning_ended``; None: it applies from the first generated token.  A prompt that
    # already holds the end marker after its last ``reasoning_start`` is past reasoning.
    reasoning_end: Optional[list[int]] = None
    reasoning_start: Optional[list[int]] = None


class SamplingParams(msgspec.Struct, **_STRUCT):
    """vLLM SamplingParams subset of the token-in/token-out endpoint (../shared/SPEC.md)."""

    n: int = 1
    temperature: float = 1.0  # < GREEDY_TEMPERATURE means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Optional[list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    # None means "up to max_model_len - prompt_len"; when max_tokens_is_default is
    # True the engine also caps it by generation_config.json's max_new_tokens.
    max_tokens: Optional[int] = None
    max_tokens_is_default: bool = False
    min_tokens: int = 0
    logprobs: Optional[int] = None  # -1: whole vocab
    prompt_logprobs: Optional[int] = None  # -1: whole vocab
    prompt_logprob_token_ids: Optional[list[list[int]]] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    spaces_between_special_tokens: bool = True
    routed_experts_prompt_start: int = 0  # routed_experts skips this many leading prompt positions
    structured_outputs: Optional[StructuredOutputs] = None  # constrained decoding (xgrammar)


class MultiModalItem(msgspec.Struct, **_STRUCT):
    """One pre-processed image of a request (common/multimodal/): its placeholder tokens are
    ``prompt_token_ids[offset:offset + length]``; the worker encodes it (once per
    ``mm_hash``: its encoder cache) and puts the embeddings there."""

    modality: str  # "image"
    mm_hash: str  # content hash: keys the encoder cache and the prefix-cache blocks it covers
    offset: int
    length: int
    grid_thw: list[int]  # [t, h, w] patches
    pixel_values: bytes  # C order, shape ``shape``, laid out as ``encoding`` says
    shape: list[int]
    # "uint8_hwc": the resized RGB image ``[h*P, w*P, 3]`` uint8; the worker rescales,
    # normalises and patchifies it with its model's preprocessor config (an eighth of the
    # float patches' bytes on every hop).  "float32": the patches ``[t*h*w, C*T*P*P]``
    # as HF's processor returns them (pre-processed ``features``).  "remote": no pixels
    # (``pixel_values`` empty, ``shape`` []): the embeddings come from the encoder worker
    # the request's ``ec_transfer_params`` name for this item (encoder disaggregation).
    encoding: str = "float32"


class GenerateRequest(msgspec.Struct, **_STRUCT):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first (vLLM)
    cache_salt: Optional[str] = None
    output_text: bool = False  # text mode: worker detokenizes and fills CompletionDelta.text
    data_parallel_rank: Optional[int] = None  # pin to a worker rank
    session_id: Optional[str] = None  # sticky routing key
    kv_transfer_params: Optional[Any] = None  # passed through untouched
    # vLLM's ECTransfer parameters: {mm_hash: {peer_host, peer_port, shape, ...}} naming
    # where an item's encoder output can be pulled (worker/engine/disagg/ec_transfer.py).
    ec_transfer_params: Optional[Any] = None
    arrival_time: float = 0.0  # client wall clock (time.time()); 0 = unknown
    trace_headers: Optional[dict[str, str]] = None
    # A LoRA adapter the worker serves (the gateway maps the request's `model` to it).
    lora_name: Optional[str] = None
    # Routing keys of the prompt's full blocks (common/prefix_hash.prompt_routing_hashes),
    # computed by the sender so the broker never hashes prompts: cache-aware dispatch
    # matches them against workers' KV events.  A wrong key only costs a cache miss.
    prefix_hashes: Optional[list[bytes]] = None
    # Multimodal input, in prompt order (no two placeholder ranges overlap).
    mm_items: Optional[list[MultiModalItem]] = None
    # What the broker vouches for in this request's transfer parameters (bits of
    # common/transfer_peers.py: TRUST_KV / TRUST_EC its own legs, TRUST_PEERS peers
    # checked against its registry).  The broker resets it on every client GENERATE.
    transfer_trust: int = 0


class Abort(msgspec.Struct, **_STRUCT):
    request_ids: list[str]


class TokenLogprobs(msgspec.Struct, **_STRUCT):
    """Logprobs of a run of positions (sampled tokens, or prompt tokens).

    Column-wise so that a delta of many tokens stays a handful of msgpack arrays.
    ``token_ids[i]`` is the chosen token at position i (sampled, or the prompt
    token), ``ranks[i]`` its 1-based rank in the distribution, ``top_ids[i]`` /
    ``top_logprobs[i]`` the top-k alternatives in descending order.  In text mode
    ``token_texts`` / ``top_texts`` hold the decoded strings of the same ids.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    token_texts: Optional[list[str]] = None
    top_texts: Optional[list[list[str]]] = None


class SpecDecodeStats(msgspec.Struct, **_STRUCT):
    """A request's speculative decoding counts (vLLM's RequestSpecDecodeMetrics)."""

    num_spec_tokens: int  # the configured k
    histogram: list[int]  # [k + 1]: verify steps that accepted exactly j drafts
    num_draft_tokens: int = 0
    per_step_accepted: list[int] = msgspec.field(default_factory=list)
    per_step_drafted: list[int] = msgspec.field(default_factory=list)


class CompletionDelta(msgspec.Struct, **_STRUCT):
    """What one engine step produced for one choice (request_id, index)."""

    request_id: str
    index: int = 0  # choice index, 0..n-1
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: Optional[TokenLogprobs] = None
    text: Optional[str] = None  # text mode: newly decoded text (stop strings already cut)
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None
    stop_reason: Union[int, str, None] = None  # matched stop token id or stop string
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits, set on every delta of the request
    # Only on the first delta of a request (index 0):
    prompt_logprobs: Optional[TokenLogprobs] = None  # position 0 has no logprob: starts at 1
    prompt_token_id_scores: Optional[bytes] = None  # float32 [rows, max_ids] C-order, -inf pad
    prompt_token_id_shape: Optional[list[int]] = None
    kv_transfer_params: Optional[Any] = None
    ec_transfer_params: Optional[Any] = None  # an encoder worker's answer (its final delta), as vLLM
    # Timestamps (time.time()) for /metrics and the response's metrics field.
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    # On the finishing delta of a choice only: [[version, start, end], ...] half-open
    # spans over its output-token indexes (vLLM's WeightVersionSpan list).
    weight_versions: Optional[list[tuple[str, int, int]]] = None
    # Workers started with --return-sampling-mask: per new token, the ids that survived
    # the sampler's filters (ascending).
    sampling_mask: Optional[list[list[int]]] = None
    # Workers started with --enable-return-routed-experts, on the finishing delta: the
    # .npy bytes of the uint8/uint16 array [positions, moe layers, top_k] of every
    # token the model ran (prompt from routed_experts_prompt_start, then the outputs
    # but the last).
    routed_experts: Optional[bytes] = None
    # Speculative decoding, on the delta that finishes the request: its counts.
    spec_decode: Optional[SpecDecodeStats] = None


class Outputs(msgspec.Struct, **_STRUCT):
    deltas: list[CompletionDelta]


class ErrorMsg(msgspec.Struct, **_STRUCT):
    """A request-level failure. ``status`` follows HTTP (400 bad input, 503 overloaded
    or no worker, 500 engine failure) so the gateway maps it without guessing."""

    request_id: str
    status: int
    message: str
    type: str = "BadRequestError"
    param: Optional[str] = None


class ModelInfo(msgspec.Struct, **_STRUCT):
    name: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_logprobs: int = 20
    has_tokenizer: bool = True
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    default_max_tokens: Optional[int] = None  # generation_config.json max_new_tokens
    enable_prefix_caching: bool = True
    lora_adapters: Optional[dict[str, str]] = None  # LoRA serving: adapter name -> its path
    kv_block_size: int = 16  # tokens per KV block: the unit of prefix_hashes
    dtype: Optional[str] = None  # the weights' torch dtype ("torch.bfloat16"), as vLLM's /server_info shows it
    # vLLM's lora_config (max_loras, max_lora_rank, max_cpu_loras); None without --enable-lora
    lora_config: Optional[dict[str, Any]] = None
    # the torch.distributed backend /init_weight_transfer_engine joins by default (common/dist_weight_transfer.py)
    weight_transfer_backend: str = "nccl"


class WorkerLoad(msgspec.Struct, **_STRUCT):
    running: int = 0
    waiting: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    max_num_seqs: int = 0
    # Set by the worker process (not the engine): GENERATE messages received so far.
    # The broker subtracts it from what it has sent to count requests in flight on
    # the wire, so dispatch between load reports does not pile onto one worker.
    num_received: int = 0
    # LoRA adapters now in the worker's device slots (adapter-aware dispatch prefers them).
    resident_loras: list[str] = msgspec.field(default_factory=list)
    # LoRA serving (vllm:lora_requests_info): adapters of running / waiting requests, slots.
    running_loras: list[str] = msgspec.field(default_factory=list)
    waiting_loras: list[str] = msgspec.field(default_factory=list)
    max_loras: int = 0
    # Image models (vllm:mm_cache_queries / _hits): items looked up in the encoder cache
    # since the worker started, and those found there (cumulative).
    mm_cache_queries: int = 0
    mm_cache_hits: int = 0
    # vllm:engine_sleep_state: the level of the last /sleep (0 pauses only, 1 the KV cache,
    # 2 the weights too) until a wake-up leaves the worker fully awake; -1 while awake.
    sleep_level: int = -1
    # Structured outputs: grammar matchers alive (one per constrained choice) and requests
    # waiting for their grammar to compile.
    grammar_matchers: int = 0
    grammars_compiling: int = 0
    # vllm:num_preemptions_total: sequences preempted (recompute) since the worker started.
    num_preemptions: int = 0


DEFAULT_WEIGHT_VERSION = "default"  # vLLM's label until a trainer names one


class KvBlockTokens(msgspec.Struct, **_STRUCT):
    """What an outside router needs of one stored block (vLLM's ``BlockStored``): its
    routing key, its parent's (None: first block) and its token ids (int32 little-endian)."""

    key: bytes
    parent: Optional[bytes]
    token_ids: bytes


class KvEvents(msgspec.Struct, **_STRUCT):
    """Prefix-cache changes since the worker's last report (vLLM's KV events, routing keys
    of base-model blocks; ``cleared``: everything before ``stored`` is gone).

    ``tokens``: for the stored keys an outside router can match by token ids alone (no
    cache salt, no image in the chain), the block's parent key and tokens; the broker's
    cell-wide KV-event publisher (broker/kv_publisher.py) announces only those."""

    stored: list[bytes] = msgspec.field(default_factory=list)
    removed: list[bytes] = msgspec.field(default_factory=list)
    cleared: bool = False
    tokens: list[KvBlockTokens] = msgspec.field(default_factory=list)


class WorkerReady(msgspec.Struct, **_STRUCT):
    rank: int
    model: ModelInfo
    load: WorkerLoad = msgspec.field(default_factory=WorkerLoad)
    pid: int = 0
    weight_version: str = DEFAULT_WEIGHT_VERSION
    world_size: int = 1  # devices this worker drives (its tensor-parallel size)
    # Prefill/decode disaggregation (--role): "prefill" and "decode" workers serve the two
    # legs of a request whose KV blocks move between them; "both" serves whole requests.
    # "encode": a --mm-encoder-only worker (encoder disaggregation), sent only pinned requests.
    role: str = "both"
    # The worker token (common/runtime_dir.py): the broker registers only a worker that
    # knows it, so no other process can pose as a worker and receive users' prompts.
    worker_token: str = ""
    # "host:port" of this worker's KV / encoder-output transfer server (None: it runs
    # none): the only peers the broker lets transfer parameters name.
    transfer_address: Optional[str] = None


class WorkerStatus(msgspec.Struct, **_STRUCT):
    rank: int
    load: WorkerLoad
    alive: bool = True
    weight_version: str = DEFAULT_WEIGHT_VERSION
    # Held out of dispatch: its weights are not the pool's current version.
    stale: bool = False
    world_size: int = 1


class BrokerStats(msgspec.Struct, **_STRUCT):
    """The broker's cumulative counters since it started (exported as metrics by the gateway)."""

    dispatched: int = 0  # GENERATE messages sent to workers (re-dispatches included)
    redispatched: int = 0  # unstarted requests moved off a dead worker
    failed_worker_death: int = 0  # started requests that ended with an error because their worker died
    rejected_overloaded: int = 0  # 503s: no worker, or the pending queue full
    workers_removed: int = 0  # workers dropped (missed heartbeats, disconnect)
    prefix_routed: int = 0  # dispatches that chose a worker for the prompt prefix it caches
    workers_refused: int = 0  # READY messages without the right worker token: never registered
    outputs_foreign_dropped: int = 0  # output bodies / errors for a request not dispatched to their sender
    control_refused: int = 0  # CONTROL commands without the right control token


class ClusterInfo(msgspec.Struct, **_STRUCT):
    workers: list[WorkerStatus]
    model: Optional[ModelInfo] = None
    pending: int = 0  # requests queued in the broker, waiting for worker capacity
    stats: Optional[BrokerStats] = None
    paused: bool = False
    weight_version: Optional[str] = None  # the pool's version (None: no update finished yet)
    # LoRA adapters the pool serves (name -> path): startup ones and runtime loads.
    lora_adapters: Optional[dict[str, str]] = None
    # The broker's KV-event publisher for outside routers (broker/kv_publisher.py), None: off.
    kv_events_endpoint: Optional[str] = None
    instance_id: str = ""  # this broker's boot id: names the cell to an outside router


class OutputsHeader(msgspec.Struct, **_STRUCT):
    """First body of a worker's OUTPUTS frame set (see common/framing.py).

    The broker decodes only this header, never the per-client delta bodies.
    """

    started: list[str] = msgspec.field(default_factory=list)  # first delta emitted this step
    finished: list[str] = msgspec.field(default_factory=list)  # every choice finished this step
    load: Optional[WorkerLoad] = None


class Disconnect(msgspec.Struct, **_STRUCT):
    """Worker -> broker.  ``drain=True``: take no new requests, keep streaming the
    running ones; ``drain=False``: gone now (treated like a death)."""

    drain: bool = False


class ControlRequest(msgspec.Struct, **_STRUCT):
    """A control-plane command (RL routes: pause, weight transfer, sleep, ...).

    Client -> broker: ``nonce`` is the client's, echoed in the ControlReply.  Broker ->
    worker: the broker's own nonce, echoed in the worker's RankReply.  ``rank`` targets
    one worker; None means every live worker.  Extra frames after the body (raw tensor
    bytes of a weight bucket) travel to every targeted worker untouched.
    """

    nonce: int
    op: str
    args: dict[str, Any] = msgspec.field(default_factory=dict)
    rank: Optional[int] = None
    # Client -> broker: the control token (common/runtime_dir.py); the broker refuses any
    # command without it.  Never forwarded to workers.
    token: str = ""


class RankReply(msgspec.Struct, **_STRUCT):
    """One worker's answer to a ControlRequest."""

    nonce: int
    rank: int
    ok: bool = True
    status: int = 200
    message: str = ""
    result: Any = None
    weight_version: str = DEFAULT_WEIGHT_VERSION  # after the command
    error_type: str = ""  # a refusal's vLLM error type (e.g. InvalidUserInput); "" = by status


class ControlReply(msgspec.Struct, **_STRUCT):
    """Broker -> client: the aggregate of the targeted workers' RankReplies (or the
    broker's own answer for commands it serves itself)."""

    nonce: int
    ok: bool = True
    status: int = 200
    message: str = ""
    result: Any = None
    ranks: list[RankReply] = msgspec.field(default_factory=list)
    error_type: str = ""  # the refusing ranks' common error type; "" = by status
