"""`tokserve worker`: one inference worker process (one per device) serving the broker."""
from __future__ import annotations

import argparse
import os

from common import config
from common.logging import get_logger, setup_logging

log = get_logger("tokserve.worker")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokserve worker", description=__doc__)
    p.add_argument("--model", default=None, help="HF-format model folder (default: the built-in demo model)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--rank", type=int, default=0, help="data-parallel rank (X-data-parallel-rank pins to it)")
    p.add_argument("--broker", default=config.backend_address(),
                   help="broker backend endpoint (env TOKSERVE_BACKEND; default: ipc://RUNTIME_DIR/backend.sock)")
    p.add_argument("--worker-token-file", default=None,
                   help="the broker's worker token, without which it does not register this worker (env "
                        "TOKSERVE_WORKER_TOKEN_FILE; default: RUNTIME_DIR/worker.token, shared with a local broker)")
    p.add_argument("--ready-file", default=os.environ.get("TOKSERVE_WORKER_READY_FILE"), metavar="PATH",
                   help="keep PATH fresh while the broker acknowledges this worker (env TOKSERVE_WORKER_READY_FILE); "
                        "`tokserve worker-ready PATH` is the matching readiness probe (common/readiness.py)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", "-q", default=None,
                   help="the checkpoint's quantization method, as vLLM (awq, awq_marlin, gptq, gptq_marlin, fp8, "
                        "fbgemm_fp8, compressed-tensors); default: what its config.json says. A method other than "
                        "the checkpoint's is an error; fp8 on an unquantized checkpoint quantizes it online, W8A8 "
                        "(docs/quantization.md)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="what the KV cache stores, as vLLM: auto (the model dtype), fp8 / fp8_e4m3 or fp8_e5m2 (a "
                        "byte per value: twice bf16's tokens in the same memory; scale 1.0, saturated on write)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV cache size in bytes (vLLM's flag); skips the GPU memory profiling")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU this worker may fill (weights, activations, CUDA graphs, KV cache)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks this worker owns (torch.distributed: NCCL on CUDA, gloo on CPU); "
                        "on CUDA they use cuda:i .. cuda:i+N-1 from --device cuda:i")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults as vLLM: auto (the model's generation_config.json), vllm (none), "
                        "or a folder with a generation_config.json; the generate endpoint takes max_tokens from it")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "native", "torch", "triton", "flash_attn"],
                   help="auto: triton on CUDA (flash_attn, then torch SDPA without it), --cpu-attention's choice on CPU")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan step N+1 while step N runs (vLLM's flag); default: on for CUDA (off under tensor "
                        "parallelism, speculative decoding, routed-experts capture), off on CPU")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--tokens-only", action="store_true", help="serve without a tokenizer")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--cpu-attention", default="auto", choices=["auto", "native", "torch"],
                   help="CPU kernels: compiled (decode and prefill attention reading the paged cache in place, "
                        "RMSNorm, SwiGLU, rotary) "
                        "or torch's (SDPA); "
                        "auto: native when it builds (`tokserve build-kernels` at install time, else at first start: "
                        "1 to 3 minutes, then cached)")
    p.add_argument("--cpu-linear", default="auto", choices=["auto", "native", "onednn", "torch"],
                   help="CPU GEMMs: native (our bf16 GEMM over prepacked weights: AVX512-BF16 or AVX2), oneDNN with "
                        "prepacked weights, or torch's (MKL); auto: native for bf16 on CPUs without AMX, else oneDNN "
                        "where supported, else torch")
    p.add_argument("--heartbeat-interval", type=float, default=config.heartbeat_interval())
    p.add_argument("--liveness", type=int, default=config.heartbeat_liveness(),
                   help="link heartbeats (libzmq's, answered without the GIL) missed before the broker counts as gone")
    p.add_argument("--unresponsive-timeout", type=float, default=config.unresponsive_timeout(),
                   help="seconds the broker's link may be up with no message from it before this worker "
                        "reconnects and registers again (env TOKSERVE_UNRESPONSIVE_TIMEOUT)")
    p.add_argument("--malloc-trim-interval", type=float, default=60.0, metavar="SECONDS",
                   help="CPU workers: give freed heap memory back to the OS (glibc malloc_trim) at most this often, "
                        "between steps; bounds the RSS growth of a long-running worker (0: never)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for running requests before aborting them")
    p.add_argument("--curve-server-key", default=None,
                   help="broker's CURVE public key (Z85 text or its .key file) to encrypt the link")
    p.add_argument("--curve-client-key-file", default=None,
                   help="this worker's CURVE certificate (.key_secret), for a broker that authenticates peers")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="record the experts every token was routed to and return them per choice "
                        "(routed_experts; mixture-of-experts models only)")
    p.add_argument("--return-sampling-mask", action="store_true",
                   help="return, per sampled token, the token ids that survived the sampler's filters "
                        "(sampling_mask)")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT folders) on the base model")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="adapters served from the start: name=path, or vLLM's JSON {\"name\": ..., \"path\": ...}")
    p.add_argument("--max-loras", type=int, default=1, help="adapters resident at once (device slots)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank a slot holds")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory (default: --max-loras); others are re-read from disk")
    p.add_argument("--speculative-config", "-sc", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    p.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help='structured outputs, vLLM\'s JSON: {"backend": "xgrammar", "disable_any_whitespace": false, '
                        '"enable_in_reasoning": false} (backends: auto, xgrammar)')
    p.add_argument("--spec-max-step-tokens", type=int, default=None,
                   help="speculative decoding: decode rows plus drafts per step stay within this "
                        "(default 8 on CPU, where compute binds past a few rows; no cap on CUDA; 0: no cap)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="refused: expert parallelism is not implemented (one worker serves every expert)")
    p.add_argument("--role", default="both", choices=["prefill", "decode", "both"],
                   help="prefill/decode disaggregation: which legs the broker sends here (reported in READY); "
                        "prefill or decode also lets clients' kv_transfer_params ask this worker for either leg "
                        "(with the default, both, only the broker's own legs or a --kv-transfer-config do)")
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='vLLM\'s flag: {"kv_connector": "NixlConnector", "kv_role": "kv_both"} lets clients\' '
                        "kv_transfer_params (NixlConnector's shape; blocks move over --kv-transfer-address) ask "
                        "this worker for prefill or decode legs; without it (or a --role prefill|decode) they are "
                        "refused (400)")
    p.add_argument("--kv-transfer-max-held", type=float, default=0.5, metavar="FRACTION",
                   help="fraction of the KV cache that prefill legs may hold for their decode side (finished and "
                        "running ones together); a prefill leg past it is refused with 503, so held blocks never "
                        "starve ordinary requests")
    p.add_argument("--kv-transfer-address", default="tcp://127.0.0.1:*",
                   help="ZeroMQ endpoint of this worker's KV transfer server (prefill legs' blocks are pulled "
                        "from it; its host and port go into kv_transfer_params); default: a random local port")
    p.add_argument("--kv-transfer-timeout", type=float, default=480.0,
                   help="seconds a finished prefill leg's KV blocks wait for the decode side to pull them "
                        "(vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)")
    p.add_argument("--ec-transfer-config", default=None, metavar="JSON",
                   help='encoder disaggregation, vLLM\'s JSON: {"ec_connector": "ECCPUConnector", "ec_role": '
                        '"ec_producer"} exports every encoder output (through the --kv-transfer-address server) and '
                        'answers image requests with ec_transfer_params naming them; any worker pulls what a '
                        "request's ec_transfer_params announce")
    p.add_argument("--mm-encoder-only", action="store_true",
                   help="vLLM's flag: run only the vision encoder of each request (no language-model step, no "
                        "tokens) and answer with ec_transfer_params; needs an ec_producer --ec-transfer-config; "
                        "the broker sends such a worker only requests pinned to it")
    p.add_argument("--log-level", default=None)
    return p


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """vLLM's --lora-modules forms: ``name=path`` or a JSON object with name and path."""
    import json

    out = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {item!r}: expected JSON with 'name' and 'path'") from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {item!r}: expected name=path")
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out


def engine_config_from_args(args):
    from worker.engine import EngineConfig
    from worker.engine.disagg.ec_transfer import parse_ec_transfer_config
    from worker.engine.disagg.kv_transfer import parse_kv_transfer_config

    model = args.model
    if model is None:
        from worker.engine.loading.demo_model import build_demo_model

        model = str(build_demo_model())
    return EngineConfig(model=model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                        kv_cache_dtype=args.kv_cache_dtype,
                        block_size=args.block_size,
                        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                        enable_chunked_prefill=not args.no_chunked_prefill,
                        async_scheduling=args.async_scheduling, max_logprobs=args.max_logprobs,
                        seed=args.seed, served_model_name=args.served_model_name, tokens_only=args.tokens_only,
                        num_threads=args.threads, enforce_eager=args.enforce_eager, cpu_linear=args.cpu_linear,
                        cpu_attention=args.cpu_attention, attention_backend=args.attention_backend,
                        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        tensor_parallel_size=args.tensor_parallel_size, generation_config=args.generation_config,
                        enable_return_routed_experts=args.enable_return_routed_experts,
                        return_sampling_mask=args.return_sampling_mask,
                        enable_lora=args.enable_lora, lora_modules=parse_lora_modules(args.lora_modules) or None,
                        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                        max_cpu_loras=args.max_cpu_loras, speculative_config=args.speculative_config,
                        spec_max_step_tokens=args.spec_max_step_tokens,
                        structured_outputs_config=args.structured_outputs_config,
                        kv_transfer_address=args.kv_transfer_address, kv_transfer_timeout=args.kv_transfer_timeout,
                        kv_transfer_enabled=args.role in ("prefill", "decode") or
                        parse_kv_transfer_config(args.kv_transfer_config) is not None,
                        kv_transfer_max_held=args.kv_transfer_max_held,
                        ec_role=parse_ec_transfer_config(args.ec_transfer_config),
                        mm_encoder_only=args.mm_encoder_only)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(f"worker{args.rank}", args.log_level)
    if args.rank < 0:
        raise SystemExit("--rank must be >= 0")
    if args.malloc_trim_interval < 0:
        raise SystemExit("--malloc-trim-interval must be >= 0")
    if args.heartbeat_interval <= 0 or args.liveness < 1 or args.unresponsive_timeout <= 0:
        raise SystemExit("--heartbeat-interval and --unresponsive-timeout must be > 0 and --liveness >= 1")
    if args.enable_expert_parallel:
        raise SystemExit("--enable-expert-parallel is not supported: expert parallelism is not implemented; each "
                         "worker holds every expert, split along their intermediate dimension across --tensor-parallel-size "
                         "ranks (scale out with more workers behind the broker)")
    try:
        cfg = engine_config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"invalid engine configuration: {exc}") from None
    from common import security
    from worker.engine import Engine
    from worker.server import WorkerServer

    from common import readiness, runtime_dir
    from worker.engine.disagg import transfer_auth
    try:
        if args.ready_file:  # first: a refused command line creates no token
            readiness.check_location(args.ready_file)  # a shared folder would let others redirect the write
        server_key = security.load_public_key(args.curve_server_key) if args.curve_server_key else None
        client_keys = security.load_keypair(args.curve_client_key_file) if args.curve_client_key_file else None
        worker_token = runtime_dir.load_or_create_token(runtime_dir.WORKER, args.worker_token_file)
        transfer_auth.configure(worker_token)  # the transfer servers admit this cluster's workers only
        runtime_dir.check_before_connect(args.broker)  # before the (slow) model load
    except (ValueError, OSError, runtime_dir.RuntimeDirError) as exc:
        raise SystemExit(str(exc)) from None
    if cfg.torch_device.type == "cpu":
        from common.malloc_tuning import keep_freed_memory

        keep_freed_memory()  # before the model loads: every big CPU buffer stays in the heap
    from common.memory_report import start_from_env

    start_from_env(f"worker[{args.rank}]")  # debug aid, off unless TOKSERVE_MEMORY_REPORT_S is set
    try:
        engine = Engine(cfg)
    except (OSError, ValueError) as exc:  # missing/invalid model folder, bad sizes, device
        log.error("cannot start the engine: %s", exc)
        return 1
    server = WorkerServer(engine, args.broker, args.rank, interval=args.heartbeat_interval, liveness=args.liveness,
                          unresponsive_timeout=args.unresponsive_timeout,
                          drain_timeout=args.drain_timeout, curve_server_key=server_key,
                          curve_client_keys=client_keys, worker_token=worker_token,
                          role="encode" if args.mm_encoder_only else args.role, ready_file=args.ready_file,
                          malloc_trim_interval=args.malloc_trim_interval if cfg.torch_device.type == "cpu" else 0.0)
    server.install_signal_handlers()
    return server.run()
