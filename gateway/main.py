"""``tokserve gateway``: the HTTP front end (Falcon ASGI on uvicorn + uvloop + httptools)."""
from __future__ import annotations

import argparse
import socket
import sys
from typing import Optional

from common.logging import setup_logging
from gateway.connection_limits import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PER_PEER, DEFAULT_PROBE_HEADROOM
from gateway.settings import GatewaySettings

# The gateway's GIL switch interval (CPython's default: 5 ms); see serve().
GIL_SWITCH_INTERVAL_S = 0.001


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokserve gateway", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--broker", default=None,
                   help="broker frontend address (default: $TOKSERVE_FRONTEND, else ipc://RUNTIME_DIR/frontend.sock)")
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (any of the keys) on every route but /health, "
                        "/metrics and /version (default: $TOKSERVE_API_KEY, else $VLLM_API_KEY)")
    p.add_argument("--tokens-only", action="store_true",
                   help="no tokenizer: detokenization off, text mode and stop strings refused")
    p.add_argument("--served-model-name", nargs="+", default=[],
                   help="model name(s) the API answers to; default: the workers' model name")
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024, help="larger bodies get 413")
    p.add_argument("--render-workers", type=int, default=None,
                   help="threads that tokenize, render chat templates and detokenize, off the event loop "
                        "(default: the CPU count, at most 8)")
    p.add_argument("--render-queue", type=int, default=64,
                   help="render jobs that may wait for a thread; beyond that a request gets 503")
    p.add_argument("--max-prompt-chars", type=int, default=8 * 1024 * 1024,
                   help="longest prompt text tokenized (a /tokenize or completion prompt, a rendered chat) and "
                        "the most a chat template may build; longer gets 400 (default 8 MiB characters, ~2M tokens)")
    p.add_argument("--chat-template-timeout", type=float, default=5.0,
                   help="seconds one chat template render may run before it is stopped with a 400")
    p.add_argument("--header-read-timeout", type=float, default=30.0,
                   help="seconds a request's headers may take to arrive (408 and close); 0: no limit")
    p.add_argument("--body-read-timeout", type=float, default=60.0,
                   help="seconds a request's body may take to arrive after its headers (408 and close); 0: no limit")
    p.add_argument("--max-header-bytes", type=int, default=64 * 1024,
                   help="larger request headers get 431 and the connection closed")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle connection stays open: between keep-alive requests, and before a new "
                        "connection's first byte")
    p.add_argument("--limit-concurrency", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="open connections: a new one past it closes the longest-idle connection; with none idle "
                        f"it may only ask for /health, /metrics or /version ({DEFAULT_PROBE_HEADROOM} such), "
                        f"else it is closed (default {DEFAULT_MAX_CONNECTIONS})")
    p.add_argument("--limit-concurrency-per-peer", type=int, default=DEFAULT_MAX_PER_PEER,
                   help="open connections from one client address, enforced the same way "
                        f"(default {DEFAULT_MAX_PER_PEER})")
    p.add_argument("--allowed-origins", type=_json_list("--allowed-origins"), default=None, metavar="JSON",
                   help="CORS (vLLM's flag): origins whose browsers may call the API, e.g. "
                        "'[\"https://app.example\"]' or '[\"*\"]' (default: no CORS: OPTIONS is 401/405 as any "
                        "method; vLLM allows every origin)")
    p.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), default=None, metavar="JSON",
                   help="CORS: methods a preflight may ask for (default '[\"*\"]'; needs --allowed-origins)")
    p.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), default=None, metavar="JSON",
                   help="CORS: request headers a preflight may ask for (default '[\"*\"]'; needs --allowed-origins)")
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: answer Access-Control-Allow-Credentials: true (needs --allowed-origins)")
    p.add_argument("--info-ttl", type=float, default=1.0, help="seconds cluster info is cached")
    p.add_argument("--reuse-port", action="store_true",
                   help="bind with SO_REUSEPORT so several gateways can share the port")
    p.add_argument("--curve-server-key", default=None,
                   help="broker's CURVE public key (Z85 text or its .key file): encrypt the broker link")
    p.add_argument("--curve-client-key-file", default=None,
                   help="this gateway's CURVE certificate (.key_secret), for a broker that authenticates peers")
    p.add_argument("--control-token-file", default=None,
                   help="the broker's control token, read only with --enable-rl / --allow-runtime-lora (env "
                        "TOKSERVE_CONTROL_TOKEN_FILE; default: RUNTIME_DIR/control.token of a local broker)")
    p.add_argument("--enable-rl", action="store_true",
                   help="serve vLLM's RL control routes (pause/resume, weight transfer, sleep/wake, prefix cache "
                        "reset) across the worker pool; also on with VLLM_SERVER_DEV_MODE=1")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="relay routed_experts (workers started with the same flag compute them)")
    p.add_argument("--return-sampling-mask", action="store_true",
                   help="relay sampling_mask (workers started with the same flag compute it)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (workers need --enable-lora); "
                        "also on with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
    p.add_argument("--per-request-spec-decode-metrics", choices=["none", "summary", "detailed"], default="none",
                   help="return metrics.speculative_decoding (n == 1) from workers with --speculative-config")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprob tokens of /v1/chat/completions and /v1/completions as 'token_id:N' unless the "
                        "request sets return_tokens_as_token_ids (as vLLM)")
    p.add_argument("--enable-per-request-metrics", action="store_true",
                   help="include per-request timing metrics in /v1/chat/completions and /v1/completions responses "
                        "(as vLLM) and, beyond vLLM, in /inference/v1/generate ones")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details (cached_tokens) on /inference/v1/generate and the OpenAI "
                        "routes, as vLLM's flag")
    p.add_argument("--responses-store-max-entries", type=int, default=1024,
                   help="with VLLM_ENABLE_RESPONSES_API_STORE=1: the most stored /v1/responses kept (oldest "
                        "evicted first)")
    p.add_argument("--responses-store-max-bytes", type=int, default=64 * 1024 * 1024,
                   help="with VLLM_ENABLE_RESPONSES_API_STORE=1: the most bytes of stored /v1/responses kept "
                        "(oldest evicted first)")
    p.add_argument("--tokenizer", "--model", dest="tokenizer", default=None,
                   help="model folder whose tokenizer and chat template serve render, derender, /tokenize and the "
                        "OpenAI routes (/v1/chat/completions, /v1/completions)")
    p.add_argument("--chat-template", default=None, help="chat template file (or the template text itself)")
    p.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                   help="chat template kwargs applied to every request, e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template given in the request")
    p.add_argument("--reasoning-parser", default=None,
                   help="split reasoning from content: deepseek_r1 | qwen3 | openai_gptoss")
    p.add_argument("--tool-call-parser", default=None, help="parse tool calls: hermes | llama3_json | openai")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice 'auto': the model's tool calls are parsed (needs --tool-call-parser)")
    p.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help="vLLM's structured outputs config, e.g. '{\"backend\": \"xgrammar\", "
                        "\"disable_any_whitespace\": true}' (backend auto|xgrammar: tokserve serves xgrammar only; "
                        "reasoning_parser, enable_in_reasoning)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true", help="serve GET /tokenizer_info")
    p.add_argument("--render-only", action="store_true",
                   help="serve render, derender and tokenize only, with no broker (vLLM's `vllm launch render`)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="--render-only: context length (default: the model's max_position_embeddings)")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="content_parts may load file:// images from under DIR (default: no local files)")
    p.add_argument("--allow-remote-media", action="store_true",
                   help="content_parts may load http(s) image URLs (default: data: URLs and allowed files only)")
    p.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                   help="with --allow-remote-media: fetch only from these host names (vLLM's flag; exact match, "
                        "checked on every redirect hop; default: any public host)")
    p.add_argument("--allow-media-private-networks", nargs="+", default=[], metavar="CIDR",
                   help="with --allow-remote-media: let fetches reach these private/loopback/link-local networks "
                        "(default: none; VLLM_MEDIA_EGRESS_BLOCK_PRIVATE=0 allows all)")
    p.add_argument("--image-fetch-timeout", type=float, default=None, metavar="SECONDS",
                   help="deadline for a whole http(s) image fetch, redirects included (default: "
                        "$VLLM_IMAGE_FETCH_TIMEOUT or 5)")
    p.add_argument("--media-fetch-threads", type=int, default=8, help="threads fetching http(s) images")
    p.add_argument("--max-image-bytes", type=int, default=20 * 1024 * 1024,
                   help="encoded bytes one image may have (data:, file:, http)")
    p.add_argument("--max-image-decoded-pixels", type=int, default=50_000_000,
                   help="pixels one image may decode to, checked on its header before decoding (default 50M)")
    p.add_argument("--max-request-decoded-pixels", type=int, default=200_000_000,
                   help="pixels all images of one request may decode to (default 200M)")
    p.add_argument("--image-decode-threads", type=int, default=2, help="threads decoding and resizing images")
    p.add_argument("--image-decode-queue", type=int, default=16,
                   help="requests that may wait for an image decode thread; past that, 503")
    p.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help='images one prompt may carry, vLLM\'s flag: \'{"image": 4}\' or \'{"image": {"count": 4}}\' '
                        '(default 999)')
    p.add_argument("--log-level", default=None, help="debug|info|warning|error")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    return p


def _json_list(flag: str):
    """vLLM's CORS flags take a JSON list of strings."""
    import json

    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
        return value

    parse.__name__ = flag  # argparse names the type in its error
    return parse


def _cors_policy(args: argparse.Namespace):
    from gateway.cors import CorsPolicy

    if args.allowed_origins is None:
        if args.allowed_methods is not None or args.allowed_headers is not None or args.allow_credentials:
            raise SystemExit("--allowed-methods, --allowed-headers and --allow-credentials need --allowed-origins")
        return None
    return CorsPolicy(allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods or ["*"],
                      allowed_headers=args.allowed_headers or ["*"], allow_credentials=args.allow_credentials)


def _env_api_key() -> Optional[list[str]]:
    import os

    key = os.environ.get("TOKSERVE_API_KEY") or os.environ.get("VLLM_API_KEY")
    return [key] if key else None


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    import os

    if args.port < 0 or args.port > 65535:
        raise SystemExit(f"--port must be in [0, 65535], got {args.port}")
    if args.max_body_bytes < 1:
        raise SystemExit("--max-body-bytes must be positive")
    from gateway.render_pool import default_render_workers

    render_workers = default_render_workers() if args.render_workers is None else args.render_workers
    for flag, value, low in (("--render-workers", render_workers, 1), ("--render-queue", args.render_queue, 0),
                             ("--max-prompt-chars", args.max_prompt_chars, 1),
                             ("--max-header-bytes", args.max_header_bytes, 1024),
                             ("--limit-concurrency", args.limit_concurrency, 1),
                             ("--limit-concurrency-per-peer", args.limit_concurrency_per_peer, 1)):
        if value < low:
            raise SystemExit(f"{flag} must be at least {low}, got {value}")
    for flag, value in (("--chat-template-timeout", args.chat_template_timeout),
                        ("--header-read-timeout", args.header_read_timeout),
                        ("--body-read-timeout", args.body_read_timeout),
                        ("--timeout-keep-alive", args.timeout_keep_alive)):
        if not value >= 0:
            raise SystemExit(f"{flag} must be a non-negative number of seconds, got {value}")
    if args.chat_template_timeout == 0:
        raise SystemExit("--chat-template-timeout must be positive")
    from common import security

    try:
        curve_server_key = security.load_public_key(args.curve_server_key) if args.curve_server_key else None
        if args.curve_client_key_file:
            security.load_keypair(args.curve_client_key_file)  # fail at startup, not at first connect
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    import json

    kwargs = {}
    if args.default_chat_template_kwargs:
        try:
            kwargs = json.loads(args.default_chat_template_kwargs)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--default-chat-template-kwargs is not JSON: {exc}") from None
        if not isinstance(kwargs, dict):
            raise SystemExit("--default-chat-template-kwargs must be a JSON object")
    from common.structured_outputs_config import parse_structured_outputs_config

    try:
        so_config = parse_structured_outputs_config(args.structured_outputs_config)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    # vLLM: --reasoning-parser wins; the config's reasoning_parser is the default.
    args.reasoning_parser = args.reasoning_parser or so_config.reasoning_parser or None
    if (args.render_only or args.reasoning_parser or args.tool_call_parser) and not args.tokenizer:
        raise SystemExit("--render-only, --reasoning-parser and --tool-call-parser need --tokenizer MODEL_DIR")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice requires --tool-call-parser")
    from gateway.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, OutputParser

    for flag, value, choices in (("--reasoning-parser", args.reasoning_parser, REASONING_PARSERS),
                                 ("--tool-call-parser", args.tool_call_parser, TOOL_CALL_PARSERS)):
        if value is not None and value not in choices:
            raise SystemExit(f"{flag} {value!r} is not one of: {', '.join(choices)}")
    try:  # e.g. harmony's openai_gptoss next to a non-harmony tool parser
        OutputParser(args.reasoning_parser, args.tool_call_parser)
    except ValueError as exc:
        raise SystemExit(f"--reasoning-parser / --tool-call-parser: {exc}") from None
    if args.allowed_local_media_path is not None and not os.path.isdir(args.allowed_local_media_path):
        raise SystemExit(f"--allowed-local-media-path {args.allowed_local_media_path!r} is not a directory")
    from gateway.multimodal import parse_mm_limits

    media = _media_settings(args)

    try:
        mm_limits = parse_mm_limits(args.limit_mm_per_prompt)
    except ValueError as exc:
        raise SystemExit(f"--limit-mm-per-prompt: {exc}") from None
    return GatewaySettings(
        **media,
        limit_mm_per_prompt=mm_limits,
        allowed_local_media_path=args.allowed_local_media_path,
        allow_remote_media=args.allow_remote_media,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        default_chat_template_kwargs=kwargs,
        trust_request_chat_template=args.trust_request_chat_template,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        structured_outputs_config=so_config,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        render_only=args.render_only,
        max_model_len=args.max_model_len,
        broker=args.broker,
        host=args.host,
        port=args.port,
        api_key=args.api_key or _env_api_key(),
        tokens_only=args.tokens_only,
        served_model_names=list(args.served_model_name),
        max_body_bytes=args.max_body_bytes,
        render_workers=render_workers,
        render_queue=args.render_queue,
        max_prompt_chars=args.max_prompt_chars,
        chat_template_timeout_s=args.chat_template_timeout,
        header_read_timeout_s=args.header_read_timeout or None,
        body_read_timeout_s=args.body_read_timeout or None,
        max_header_bytes=args.max_header_bytes,
        timeout_keep_alive_s=args.timeout_keep_alive,
        limit_concurrency=args.limit_concurrency,
        limit_concurrency_per_peer=args.limit_concurrency_per_peer,
        cors=_cors_policy(args),
        info_ttl_s=args.info_ttl,
        reuse_port=args.reuse_port,
        log_level=(args.log_level or "info").lower(),
        curve_server_key=curve_server_key,
        curve_client_key_file=args.curve_client_key_file,
        control_token_file=args.control_token_file,
        enable_rl=args.enable_rl or os.environ.get("VLLM_SERVER_DEV_MODE", "") == "1",
        enable_return_routed_experts=args.enable_return_routed_experts,
        return_sampling_mask=args.return_sampling_mask,
        per_request_spec_decode_metrics=args.per_request_spec_decode_metrics,
        enable_per_request_metrics=args.enable_per_request_metrics,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        # vLLM's env switch, off by default as there: store=true is then silently not stored.
        enable_responses_store=os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "0") not in ("", "0"),
        responses_store_max_entries=args.responses_store_max_entries,
        responses_store_max_bytes=args.responses_store_max_bytes,
        allow_runtime_lora=args.allow_runtime_lora
        or os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
    )


def _media_settings(args: argparse.Namespace) -> dict:
    """The image input bounds and the remote media policy (checked here: a typo fails at startup)."""
    import ipaddress
    import os

    for flag in ("media_fetch_threads", "image_decode_threads", "max_image_bytes", "max_image_decoded_pixels",
                 "max_request_decoded_pixels"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be positive")
    if args.image_decode_queue < 0:
        raise SystemExit("--image-decode-queue must be >= 0")
    timeout = args.image_fetch_timeout
    if timeout is None:
        try:
            timeout = float(os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", "5"))
        except ValueError:
            raise SystemExit("VLLM_IMAGE_FETCH_TIMEOUT must be a number of seconds") from None
    if not timeout > 0:
        raise SystemExit("--image-fetch-timeout must be positive")
    networks = list(args.allow_media_private_networks)
    if os.environ.get("VLLM_MEDIA_EGRESS_BLOCK_PRIVATE", "").lower() in ("0", "false"):
        networks += ["0.0.0.0/0", "::/0"]  # vLLM's switch: private destinations allowed
    for net in networks:
        try:
            ipaddress.ip_network(net, strict=False)
        except ValueError as exc:
            raise SystemExit(f"--allow-media-private-networks: {exc}") from None
    return dict(allowed_media_domains=list(args.allowed_media_domains), media_private_networks=networks,
                image_fetch_timeout_s=timeout, media_fetch_threads=args.media_fetch_threads,
                max_image_bytes=args.max_image_bytes, max_image_decoded_pixels=args.max_image_decoded_pixels,
                max_request_decoded_pixels=args.max_request_decoded_pixels,
                image_decode_threads=args.image_decode_threads, image_decode_queue=args.image_decode_queue)


def bind_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


# File descriptors kept beside the connections: broker sockets, model files, threads' pipes.
FD_RESERVE = 256


def fit_to_fd_limit(max_connections: int) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit, and lower ``max_connections`` if the
    descriptors still could not hold it with the probe headroom and FD_RESERVE: the cap is
    only a defence if it is reached before the fd limit is."""
    import logging
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    fits = soft - DEFAULT_PROBE_HEADROOM - FD_RESERVE
    if max_connections > fits:
        logging.getLogger("tokserve.gateway").warning(
            "--limit-concurrency %d lowered to %d: the open file limit is %d", max_connections, max(fits, 16), soft)
        return max(fits, 16)
    return max_connections


def serve(settings: GatewaySettings, client=None, access_log: bool = False) -> None:
    import uvicorn

    from gateway.app import create_app

    from gateway.connection_limits import ConnectionLimiter
    from gateway.guards import close_evicted, guarded_protocol
    from common.malloc_tuning import return_large_allocations

    return_large_allocations()  # before the first big allocation (common/malloc_tuning.py)
    # Render-pool threads run pure-Python work (chat templates) that holds the GIL until
    # the interpreter's switch interval asks for it back; the event loop then waits that
    # long for each of its turns.  At the default 5 ms, /health took a median 36 ms and a
    # p99 of 165 ms beside eight hostile template renders; 1 ms: see GIL_SWITCH_INTERVAL_S.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    app = create_app(settings, client)
    limiter = ConnectionLimiter(fit_to_fd_limit(settings.limit_concurrency), settings.limit_concurrency_per_peer,
                                DEFAULT_PROBE_HEADROOM, close_evicted)
    # log_config=None: uvicorn's loggers go through common.logging's root handler.
    # The protocol is uvicorn's httptools one with deadlines for slow headers and the
    # connection caps (guards.py); uvicorn's own limit_concurrency stays off: it would
    # answer 503 to /health too while the connections are at the cap.
    config = uvicorn.Config(app, loop="uvloop", lifespan="on", log_level=settings.log_level,
                            http=guarded_protocol(settings.header_read_timeout_s, settings.max_header_bytes,
                                                  settings.timeout_keep_alive_s, limiter),
                            timeout_keep_alive=settings.timeout_keep_alive_s,
                            access_log=access_log, timeout_graceful_shutdown=5, log_config=None)
    sock = bind_socket(settings.host, settings.port, settings.reuse_port)
    uvicorn.Server(config).run(sockets=[sock])


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    settings = settings_from_args(args)
    setup_logging("gateway", args.log_level)
    serve(settings, access_log=args.access_log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
