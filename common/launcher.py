"""``tokserve serve``: the whole stack from one command.

Starts the broker, N workers and the gateway(s) as child processes (the demo model is
built once beforehand when no --model is given, so workers never race to build it),
waits until ``/health`` answers 200, then supervises: a child that dies is restarted
with a capped backoff.  SIGINT/SIGTERM stop gateways, then workers, then the broker;
whatever ignores SIGTERM past the grace period is killed.  Children also get
PR_SET_PDEATHSIG so they do not outlive a launcher that was killed outright.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

from common import config, runtime_dir
from common.structured_outputs_config import parse_structured_outputs_config
from common.logging import get_logger, setup_logging

log = get_logger("tokserve.launcher")

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
STABLE_AFTER_S = 30.0  # a child that ran this long gets its backoff reset
# A child that never got healthy and exits this many times in a row is a crash loop:
# restarting it forever only hides the error, so the launcher stops and shows it.
MAX_STARTUP_FAILURES = 3
USAGE_ERROR = 2  # argparse's exit code: the same command line will never start
TAIL_LINES = 20
PASS_THROUGH = ("--worker-args", "--gateway-args", "--broker-args")


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the launcher dies (Linux only, else no-op)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: Optional[subprocess.Popen] = None
    started_at: float = 0.0
    restarts: int = 0
    next_start: float = 0.0
    healthy: bool = False  # ran long enough, or was up when the stack became ready
    startup_failures: int = 0
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))

    def start(self) -> None:
        env = dict(os.environ, **self.env)
        # stderr passes through a thread that keeps the last lines: a crash loop is
        # reported with its error, not just an exit code.
        self.proc = subprocess.Popen(self.argv, env=env, preexec_fn=_die_with_parent, stderr=subprocess.PIPE)
        self.started_at = time.monotonic()
        threading.Thread(target=self._relay, args=(self.proc.stderr,), daemon=True).start()
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    def _relay(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            self.tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
        stream.close()

    def fatal(self) -> Optional[str]:
        """Why this exited child must not be restarted, or None."""
        code = self.proc.returncode
        if self.healthy or time.monotonic() - self.started_at > STABLE_AFTER_S:
            return None
        if code == USAGE_ERROR:
            return f"{self.name} rejected its command line (exit code 2)"
        if self.startup_failures + 1 >= MAX_STARTUP_FAILURES:
            return f"{self.name} exited during start-up {MAX_STARTUP_FAILURES} times in a row (last exit code {code})"
        return None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def schedule_restart(self) -> None:
        if self.healthy or time.monotonic() - self.started_at > STABLE_AFTER_S:
            self.restarts = 0
            self.healthy = True
        else:
            self.startup_failures += 1
        delay = RESTART_BACKOFF_S[min(self.restarts, len(RESTART_BACKOFF_S) - 1)]
        self.restarts += 1
        self.next_start = time.monotonic() + delay
        log.warning("%s exited with code %s; restarting in %.1f s", self.name, self.proc.returncode, delay)
        self.proc = None


def tokserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "common.cli", *args]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokserve serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF-format model folder (default: build and serve the demo model)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (one per GPU)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (worker i gets CUDA_VISIBLE_DEVICES=i)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs (ranks) per worker: worker i gets GPUs i*N .. i*N+N-1")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--gateways", type=int, default=1, help="gateway processes sharing the port (SO_REUSEPORT)")
    p.add_argument("--frontend", default=config.frontend_address(),
                   help="broker endpoint for clients (default: ipc://RUNTIME_DIR/frontend.sock; a tcp:// one needs "
                        "CURVE authorized keys, or --broker-args --allow-unauthenticated-tcp-frontend)")
    p.add_argument("--backend", default=config.backend_address(),
                   help="broker endpoint for workers (default: ipc://RUNTIME_DIR/backend.sock)")
    p.add_argument("--api-key", default=None, help="gateways require this Bearer key (or set $TOKSERVE_API_KEY)")
    p.add_argument("--tokens-only", action="store_true")
    p.add_argument("--enable-rl", action="store_true",
                   help="gateways serve the RL control routes (pause/resume, weight transfer, sleep/wake)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="workers record and gateways return routed_experts (mixture-of-experts models)")
    p.add_argument("--return-sampling-mask", action="store_true",
                   help="workers record and gateways return sampling_mask")
    p.add_argument("--enable-lora", action="store_true", help="workers serve LoRA adapters")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", help="adapters served from the start")
    p.add_argument("--max-loras", type=int, default=None, help="adapters resident at once per worker")
    p.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in host memory per worker")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="gateways serve /v1/load_lora_adapter and /v1/unload_lora_adapter")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan each engine step while the previous one runs (vLLM's flag; default: on for CUDA "
                        "workers, off for CPU workers; see docs/serving.md)")
    p.add_argument("--speculative-config", "-sc", default=None, metavar="JSON",
                   help="workers' speculative decoding (vLLM's JSON, method ngram)")
    p.add_argument("--per-request-spec-decode-metrics", choices=["none", "summary", "detailed"], default="none",
                   help="gateways return metrics.speculative_decoding")
    p.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help='images one prompt may carry (vLLM\'s flag, e.g. \'{"image": 4}\'; gateways count them, '
                        'and \'{"image": 0}\' makes workers load no vision tower)')
    p.add_argument("--enable-per-request-metrics", action="store_true",
                   help="gateways return per-request timing metrics (OpenAI routes, as vLLM; /generate too)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="gateways: OpenAI logprob tokens as 'token_id:N' by default (as vLLM)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="gateways report usage.prompt_tokens_details (cached_tokens), as vLLM's flag")
    p.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help="vLLM's structured outputs config for the gateways (and workers), e.g. "
                        "'{\"backend\": \"xgrammar\", \"disable_any_whitespace\": true}'; xgrammar only")
    p.add_argument("--served-model-name", nargs="+", default=[])
    p.add_argument("--routing", default="cache-aware", choices=["cache-aware", "session", "least-loaded"],
                   help="the broker's dispatch policy across workers")
    p.add_argument("--prefill-workers", type=int, default=0,
                   help="prefill/decode disaggregation: the first N workers run --role prefill, the rest --role "
                        "decode, and the broker splits each request over them (--pd auto)")
    p.add_argument("--encoder-workers", type=int, default=0,
                   help="encoder disaggregation: the last N workers run only the vision encoder (--mm-encoder-only, "
                        "an ec_producer), and the broker runs each image request's encoder there first (--epd auto)")
    p.add_argument("--broker-args", default="",
                   help="extra arguments passed to the broker, e.g. '--curve-secret-file S --curve-authorized-keys DIR'")
    p.add_argument("--worker-args", default="", help="extra arguments passed to every worker, e.g. '--max-num-seqs 64'")
    p.add_argument("--gateway-args", default="", help="extra arguments passed to every gateway")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for /health")
    p.add_argument("--grace", type=float, default=10.0, help="seconds children get to exit on shutdown")
    p.add_argument("--log-level", default=None)
    return p


EC_PRODUCER = '{"ec_connector": "ECCPUConnector", "ec_role": "ec_producer"}'


def cpu_worker_threads(num_workers: int, cpus: Optional[int] = None) -> int:
    """Torch threads per CPU worker when the whole stack shares this machine: one CPU
    stays with the gateways and broker, as vLLM's CPU server reserves one for its
    front end.  With every core computing, an OpenMP thread descheduled by the busy
    front end stalls each parallel op (measured on 2 cores: rounds of a 32-request
    burst at 754-1474 tok/s and TTFT p50 ~1.2 s, against a steady ~0.45 s at 1 thread)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, (cpus - 1) // max(1, num_workers))


def _no_images(mm_limits: Optional[str]) -> bool:
    """Whether --limit-mm-per-prompt allows no image: the only limit workers act on (the
    gateways count items; a malformed value is refused by them at start)."""
    from common.multimodal.limits import parse_mm_limits

    try:
        return parse_mm_limits(mm_limits).get("image") == 0
    except ValueError:
        return False


def plan_children(args: argparse.Namespace, model_dir: str) -> tuple[Child, list[Child], list[Child]]:
    if args.prefill_workers and not 0 < args.prefill_workers < args.workers:
        raise SystemExit("--prefill-workers must leave at least one decode worker (0 < N < --workers)")
    if args.encoder_workers and not 0 < args.encoder_workers + args.prefill_workers < args.workers:
        raise SystemExit("--encoder-workers must leave at least one worker for the language model "
                         "(0 < N + --prefill-workers < --workers)")
    log_args = ["--log-level", args.log_level] if args.log_level else []
    broker = Child("broker", tokserve_cmd("broker", "--frontend", args.frontend, "--backend", args.backend,
                                          "--routing", args.routing, *(["--pd", "auto"] if args.prefill_workers else []),
                                          *(["--epd", "auto"] if args.encoder_workers else []),
                                          *log_args, *shlex.split(args.broker_args)))
    workers = []
    cuda = args.device.startswith("cuda")
    worker_args = shlex.split(args.worker_args)
    tp = args.tensor_parallel_size
    if not cuda and "--threads" not in worker_args:
        worker_args += ["--threads", str(cpu_worker_threads(args.workers * tp))]  # per rank
    if tp > 1:
        worker_args += ["--tensor-parallel-size", str(tp)]
    # Both sides: workers compute the records, gateways relay them.
    replay_flags = [f for f, on in (("--enable-return-routed-experts", args.enable_return_routed_experts),
                                    ("--return-sampling-mask", args.return_sampling_mask)) if on]
    worker_args += replay_flags
    if args.enable_lora or args.lora_modules:
        worker_args.append("--enable-lora")
        if args.lora_modules:
            worker_args += ["--lora-modules", *args.lora_modules]
        for flag, value in (("--max-loras", args.max_loras), ("--max-lora-rank", args.max_lora_rank),
                            ("--max-cpu-loras", args.max_cpu_loras)):
            if value is not None:
                worker_args += [flag, str(value)]
    if args.async_scheduling is not None:
        worker_args.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    if args.speculative_config:
        worker_args += ["--speculative-config", args.speculative_config]
    if _no_images(args.limit_mm_per_prompt):  # workers: {"image": 0} loads no vision tower
        worker_args += ["--limit-mm-per-prompt", args.limit_mm_per_prompt]
    so_config = None
    if args.structured_outputs_config:
        try:  # a bad value stops `serve` here, not in every child
            so_config = parse_structured_outputs_config(args.structured_outputs_config).to_json()
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        worker_args += ["--structured-outputs-config", so_config]
    for rank in range(args.workers):
        # Each worker sees only its own GPUs, which it then calls cuda:0 .. cuda:N-1.
        gpus = ",".join(str(g) for g in range(rank * tp, (rank + 1) * tp))
        env = {"CUDA_VISIBLE_DEVICES": gpus} if cuda else {}
        argv = tokserve_cmd("worker", "--model", model_dir, "--rank", str(rank), "--broker", args.backend,
                            "--device", "cuda" if cuda else args.device, *log_args, *worker_args)
        if args.tokens_only:
            argv.append("--tokens-only")
        if rank >= args.workers - args.encoder_workers:
            argv += ["--mm-encoder-only", "--ec-transfer-config", EC_PRODUCER]
        elif args.prefill_workers:
            argv += ["--role", "prefill" if rank < args.prefill_workers else "decode"]
        workers.append(Child(f"worker[{rank}]", argv, env))
    gateways = []
    for i in range(args.gateways):
        argv = tokserve_cmd("gateway", "--host", args.host, "--port", str(args.port), "--broker", args.frontend,
                            *log_args, *shlex.split(args.gateway_args))
        if not args.tokens_only:
            argv += ["--tokenizer", model_dir]  # render, derender and the OpenAI routes
        if args.gateways > 1:
            argv.append("--reuse-port")
        if args.enable_rl:
            argv.append("--enable-rl")
        argv += replay_flags
        if args.allow_runtime_lora:
            argv.append("--allow-runtime-lora")
        if so_config is not None:
            argv += ["--structured-outputs-config", so_config]
        if args.per_request_spec_decode_metrics != "none":
            argv += ["--per-request-spec-decode-metrics", args.per_request_spec_decode_metrics]
        if args.enable_per_request_metrics:
            argv.append("--enable-per-request-metrics")
        if args.return_tokens_as_token_ids:
            argv.append("--return-tokens-as-token-ids")
        if args.enable_prompt_tokens_details:
            argv.append("--enable-prompt-tokens-details")
        if args.limit_mm_per_prompt:
            argv += ["--limit-mm-per-prompt", args.limit_mm_per_prompt]
        if args.tokens_only:
            argv.append("--tokens-only")
        if args.served_model_name:
            argv += ["--served-model-name", *args.served_model_name]
        # The key travels in the environment: command lines are visible to every local user.
        gateways.append(Child(f"gateway[{i}]", argv, {"TOKSERVE_API_KEY": args.api_key} if args.api_key else {}))
    return broker, workers, gateways


def health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Launcher:
    def __init__(self, args: argparse.Namespace, model_dir: str):
        self.args = args
        self.broker, self.workers, self.gateways = plan_children(args, model_dir)
        self.stopping = False
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        self.health_url = f"http://{host}:{args.port}/health"

    @property
    def children(self) -> list[Child]:
        return [self.broker, *self.workers, *self.gateways]

    def request_stop(self, signum, _frame) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        self.stopping = True

    def run(self) -> int:
        for child in self.children:
            child.start()
        deadline = time.monotonic() + self.args.ready_timeout
        ready = False
        while not self.stopping:
            failure = self.supervise()
            if failure is not None:
                log.error("%s; stopping. Its last output:\n%s", failure[0], "\n".join(failure[1].tail) or "(none)")
                self.shutdown()
                return 1
            if not ready:
                if health_ok(self.health_url):
                    ready = True
                    for child in self.children:
                        child.healthy = child.healthy or child.running()
                    print(ready_message(self.args), flush=True)
                elif time.monotonic() > deadline:
                    log.error("stack not healthy after %.0f s", self.args.ready_timeout)
                    self.shutdown()
                    return 1
            time.sleep(0.2)
        self.shutdown()
        return 0

    def supervise(self) -> Optional[tuple[str, Child]]:
        """Restart exited children; (reason, child) when one is in a crash loop."""
        now = time.monotonic()
        for child in self.children:
            if child.proc is not None and not child.running():
                reason = child.fatal()
                if reason is not None:
                    time.sleep(0.2)  # let the relay thread take the child's last lines
                    return reason, child
                child.schedule_restart()
            if child.proc is None and now >= child.next_start:
                child.start()
        return None

    def shutdown(self) -> None:
        # Front to back: no new requests, then workers drain, then the broker goes.
        for group in (self.gateways, self.workers, [self.broker]):
            procs = [c.proc for c in group if c.running()]
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.args.grace
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("pid %d ignored SIGTERM; killing it", proc.pid)
                    proc.kill()
                    proc.wait()
        log.info("all children stopped")


def build_demo_model_dir() -> str:
    """Ask the worker side to build the demo model once, before any worker starts
    (``tokserve demo-model`` prints its folder): common/ imports no other package."""
    proc = subprocess.run(tokserve_cmd("demo-model"), capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not os.path.isdir(lines[-1]):
        raise SystemExit(f"building the demo model failed: {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return lines[-1]


def ready_message(args: argparse.Namespace) -> str:
    url = f"http://{args.host}:{args.port}"
    auth = " -H 'Authorization: Bearer $TOKSERVE_API_KEY'" if args.api_key else ""
    return (f"tokserve ready: {url}\n"
            f"  try: curl -s {url}/inference/v1/generate -H 'Content-Type: application/json'{auth} "
            f"-d '{{\"token_ids\": [72, 101, 108, 108, 111], \"sampling_params\": {{\"max_tokens\": 8}}}}'")


def join_pass_through(argv: list[str]) -> list[str]:
    """``--worker-args --one-flag`` -> ``--worker-args=--one-flag``: argparse would take a
    lone value that starts with a dash for the next option and fail."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in PASS_THROUGH and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(join_pass_through(list(sys.argv[1:] if argv is None else argv)))
    setup_logging("launcher", args.log_level)
    if args.workers < 1 or args.gateways < 1:
        raise SystemExit("--workers and --gateways must be at least 1")
    if args.model:
        if not os.path.isdir(args.model):
            raise SystemExit(f"--model {args.model}: not a directory")
        model_dir = os.path.abspath(args.model)
    else:
        log.info("building the demo model (once per machine, a few seconds)")
        model_dir = build_demo_model_dir()
        log.info("serving the demo model from %s", model_dir)
    try:
        # The private runtime directory and both tokens exist before any child starts: the
        # broker, workers and (with --enable-rl / --allow-runtime-lora) gateways read them
        # from there, and an unsafe directory is reported once, here.
        for kind in (runtime_dir.WORKER, runtime_dir.CONTROL):
            runtime_dir.load_or_create_token(kind, create_explicit=True)
    except (runtime_dir.RuntimeDirError, OSError) as exc:
        raise SystemExit(f"cannot prepare the runtime directory: {exc}") from None
    launcher = Launcher(args, model_dir)
    signal.signal(signal.SIGTERM, launcher.request_stop)
    signal.signal(signal.SIGINT, launcher.request_stop)
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
