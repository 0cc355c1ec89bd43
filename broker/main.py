"""`tokserve broker`: run the ZeroMQ broker between clients and workers."""
from __future__ import annotations

import argparse
import signal

import zmq

from broker import disagg, kv_publisher
from broker.broker import Broker, BrokerConfig
from common import config, runtime_dir, security
from common.logging import get_logger, setup_logging

log = get_logger("tokserve.broker")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokserve broker", description=__doc__)
    p.add_argument("--frontend", default=config.frontend_address(),
                   help="endpoint clients/gateways connect to (env TOKSERVE_FRONTEND; default: ipc://RUNTIME_DIR/"
                        "frontend.sock); tcp:// needs --curve-secret-file with --curve-authorized-keys (else any "
                        f"local user gets in), or {security.INSECURE_TCP_FRONTEND_FLAG}")
    p.add_argument("--backend", default=config.backend_address(),
                   help="endpoint workers connect to (env TOKSERVE_BACKEND; default: ipc://RUNTIME_DIR/backend.sock)")
    p.add_argument("--control-token-file", default=None,
                   help="the token CONTROL commands must carry (env TOKSERVE_CONTROL_TOKEN_FILE; default: "
                        "RUNTIME_DIR/control.token, created if missing)")
    p.add_argument("--worker-token-file", default=None,
                   help="the token a worker's READY must carry (env TOKSERVE_WORKER_TOKEN_FILE; default: "
                        "RUNTIME_DIR/worker.token, created if missing)")
    p.add_argument("--heartbeat-interval", type=float, default=config.heartbeat_interval())
    p.add_argument("--liveness", type=int, default=config.heartbeat_liveness(),
                   help="link heartbeats (libzmq's, answered without the GIL) missed before a worker counts as dead")
    p.add_argument("--unresponsive-timeout", type=float, default=config.unresponsive_timeout(),
                   help="seconds a worker whose link is up may send nothing before it counts as hung and is dropped " \
                        "(env TOKSERVE_UNRESPONSIVE_TIMEOUT); a dead, stopped or cut-off worker is dropped after " \
                        "--liveness x --heartbeat-interval by link heartbeats")
    p.add_argument("--max-pending", type=int, default=config.MAX_PENDING,
                   help="requests queued while no worker has capacity; beyond this: 503")
    p.add_argument("--no-worker-timeout", type=float, default=config.NO_WORKER_TIMEOUT_S,
                   help="seconds without any live worker after which queued/new requests fail with 503")
    p.add_argument("--max-inflight-per-worker", type=int, default=0,
                   help=f"requests in flight per worker (0: {config.INFLIGHT_PER_SEQ_SLOT} x its max_num_seqs)")
    p.add_argument("--max-frame-bytes", type=int, default=config.MAX_CLIENT_FRAME_BYTES,
                   help="clients sending a bigger frame are disconnected")
    p.add_argument("--curve-secret-file", default=None,
                   help="zmq.auth secret certificate: enable CURVE encryption on both sockets")
    p.add_argument("--curve-authorized-keys", default=None, metavar="DIR",
                   help="with --curve-secret-file: accept only peers whose public certificate (*.key) is in DIR")
    p.add_argument(security.INSECURE_TCP_FRONTEND_FLAG, action="store_true",
                   help="let a tcp:// --frontend admit any peer (plaintext on loopback, or CURVE without "
                        "--curve-authorized-keys): every local user can then send requests past the gateway's API "
                        "key (a single-user machine only)")
    p.add_argument("--routing", default="cache-aware", choices=["cache-aware", "session", "least-loaded"],
                   help="dispatch: cache-aware (longest cached prompt prefix within a load guard; sessions sticky "
                        "unless their worker is full), session (sticky sessions, else least-loaded), least-loaded")
    p.add_argument("--pd", default="off", choices=disagg.PD_MODES,
                   help="auto: run requests as a prefill leg on a --role prefill worker, then the decode on a "
                        "--role decode worker that pulls the prompt's KV blocks (no proxy needed)")
    p.add_argument("--epd", default="off", choices=disagg.EPD_MODES,
                   help="auto: run an image request's vision encoder on a --mm-encoder-only worker first, then the "
                        "request on another worker that pulls the encodings (no proxy needed)")
    p.add_argument("--kv-events-endpoint", nargs="?", const=kv_publisher.default_endpoint(), default=None,
                   metavar="ipc://PATH|tcp://HOST:PORT",
                   help="publish the cell's cached prefixes as vLLM KV events on this ZeroMQ PUB socket, for an "
                        "outside router (vllm-router --policy kv_aware); subscribers read cached prompts' token ids. "
                        f"Without a value: ipc://RUNTIME_DIR/{kv_publisher.DEFAULT_SOCKET} (the same user only); "
                        "tcp:// needs --kv-events-allow-tcp")
    p.add_argument("--kv-events-allow-tcp", action="store_true",
                   help="let --kv-events-endpoint bind a loopback tcp:// address (every local user can subscribe)")
    p.add_argument("--kv-events-allow-remote", action="store_true",
                   help="let --kv-events-endpoint bind beyond loopback (keep it to the router's hosts)")
    p.add_argument("--log-level", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("broker", args.log_level)
    for name in ("heartbeat_interval", "no_worker_timeout", "unresponsive_timeout"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    if args.liveness < 1 or args.max_pending < 0:
        raise SystemExit("--liveness must be >= 1 and --max-pending >= 0")
    cfg = BrokerConfig(frontend=args.frontend, backend=args.backend, heartbeat_interval=args.heartbeat_interval,
                       liveness=args.liveness, unresponsive_timeout=args.unresponsive_timeout,
                       max_pending=args.max_pending,
                       no_worker_timeout=args.no_worker_timeout,
                       max_inflight_per_worker=args.max_inflight_per_worker,
                       max_client_frame_bytes=args.max_frame_bytes, routing=args.routing, pd=args.pd,
                       epd=args.epd, kv_events_endpoint=args.kv_events_endpoint,
                       kv_events_allow_tcp=args.kv_events_allow_tcp, kv_events_allow_remote=args.kv_events_allow_remote,
                       allow_unauthenticated_tcp_frontend=args.allow_unauthenticated_tcp_frontend)
    if args.curve_authorized_keys and not args.curve_secret_file:
        raise SystemExit("--curve-authorized-keys needs --curve-secret-file")
    try:  # before the tokens are created: a refused command line leaves nothing behind
        for flag, endpoint in (("--frontend", args.frontend), ("--backend", args.backend)):
            security.refuse_plaintext_beyond_host(flag, endpoint, bool(args.curve_secret_file))
        security.refuse_unauthenticated_tcp_frontend(args.frontend,
                                                     bool(args.curve_secret_file and args.curve_authorized_keys),
                                                     args.allow_unauthenticated_tcp_frontend)
        if args.kv_events_endpoint:
            kv_publisher.check_endpoint(args.kv_events_endpoint, args.kv_events_allow_tcp,
                                        args.kv_events_allow_remote)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    try:
        cfg.worker_token = runtime_dir.load_or_create_token(runtime_dir.WORKER, args.worker_token_file,
                                                            create_explicit=True)
        cfg.control_token = runtime_dir.load_or_create_token(runtime_dir.CONTROL, args.control_token_file,
                                                             create_explicit=True)
    except (runtime_dir.RuntimeDirError, OSError) as exc:
        raise SystemExit(f"cannot load the broker's tokens: {exc}") from None
    if args.curve_secret_file:
        try:
            keys = security.load_keypair(args.curve_secret_file)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        cfg.curve_public_key, cfg.curve_secret_key = keys.public, keys.secret
        cfg.curve_authorized_dir = args.curve_authorized_keys
    try:
        broker = Broker(cfg)
    except zmq.ZMQError as exc:  # bad scheme, address in use, ...
        log.error("cannot bind %s / %s: %s", cfg.frontend, cfg.backend, exc)
        return 1
    except (ValueError, runtime_dir.RuntimeDirError) as exc:  # a missing --curve-authorized-keys folder, a
        raise SystemExit(str(exc)) from None  # live broker on the ipc path, an unsafe runtime directory
    signal.signal(signal.SIGTERM, lambda *_: broker.stop())
    signal.signal(signal.SIGINT, lambda *_: broker.stop())
    try:
        broker.run()
    finally:
        broker.close()
        log.info("broker stopped")
    return 0
