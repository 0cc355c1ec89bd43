"""A protocol-correct fake worker for broker tests and benchmarks (never used in production).

It runs the real ``worker.server.WorkerServer`` around ``FakeEngine``, an engine
with the real engine's API that "generates" deterministic tokens without a model:
choice ``i`` of a request served by rank ``r`` emits tokens
``r * 1000 + i * 100 + k`` for k = 0..max_tokens-1, one per step, then finishes
with "length".  So tests can tell which worker served a request from its tokens.

For the gateway's text routes: ``--has-tokenizer`` reports a tokenizer (structured outputs
need one); ``--reply-file PATH`` (JSON ``{"text": ..., "chunk": N}``, read per request) makes
a request that asks for text emit that text, N characters per step, then finish with "stop";
``--record-dir DIR`` writes each request's ``params.structured_outputs`` there
(``<request_id>.json``), so tests see what reached a worker.

    python -m tests.support.fake_worker [--broker tcp://127.0.0.1:5556] --rank 0 [--step-delay 0.01]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field

from common.errors import BadRequest
from common.logging import setup_logging
from types import SimpleNamespace

from common.protocol import DEFAULT_WEIGHT_VERSION, CompletionDelta, GenerateRequest, ModelInfo, WorkerLoad

BAD_TOKEN = 999_999  # a prompt starting with it is rejected like invalid input
CRASH_TOKEN = 999_998  # a prompt starting with it makes the next step raise
GIL_HOG_TOKEN = 999_997  # a prompt starting with it makes the next step hold the GIL (--gil-hog-seconds)
DEFAULT_MAX_TOKENS = 8


@dataclass
class _Req:
    req: GenerateRequest
    start_at: float  # not scheduled ("waiting") before this time
    produced: list = field(default_factory=list)  # per choice
    reply: list = field(default_factory=list)  # --reply-file: the text pieces to emit, one per step


def _hold_gil(seconds: float) -> None:
    """A step that keeps the GIL (a long pure-Python or GIL-holding C step): with the switch
    interval above the hold, the interpreter hands the GIL to no other thread, so the
    worker's heartbeat thread sends nothing until it ends."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 60.0)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(previous)


class _FakeRL:
    """engine.rl: weight version and prefix-cache reset (no weights to update here)."""

    def __init__(self):
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.is_asleep = False

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    def reset_prefix_cache(self) -> bool:
        return True


class FakeEngine:
    def __init__(self, rank: int = 0, max_num_seqs: int = 64, vocab_size: int = 1_000_000,
                 step_delay: float = 0.0, first_delay: float = 0.0, num_kv_blocks: int = 128,
                 hold_token: int | None = None, has_tokenizer: bool = False, reply_file: str | None = None,
                 record_dir: str | None = None, gil_hog_seconds: float = 0.0):
        self.rank = rank
        self.gil_hog_seconds = gil_hog_seconds
        self._hog_next = False
        self.step_delay = step_delay
        self.first_delay = first_delay
        self.num_kv_blocks = num_kv_blocks
        self.hold_token = hold_token  # prompts starting with it stay "waiting" forever here
        self.model_info = ModelInfo(name="fake-model", vocab_size=vocab_size, max_model_len=4096,
                                    max_num_seqs=max_num_seqs, eos_token_ids=[2], has_tokenizer=has_tokenizer)
        self.reply_file = reply_file
        self.record_dir = record_dir
        self.reqs: dict[str, _Req] = {}
        self._crash_next = False
        # The control-plane surface the worker needs (no weights to update here).
        self.rl = _FakeRL()
        self.lora = None
        self.config = SimpleNamespace(tensor_parallel_size=1)

    def add_request(self, req: GenerateRequest) -> None:
        if req.prompt_token_ids and req.prompt_token_ids[0] == BAD_TOKEN:
            raise BadRequest(f"Token id {BAD_TOKEN} is out of vocabulary", "token_ids")
        if req.prompt_token_ids and req.prompt_token_ids[0] == CRASH_TOKEN:
            self._crash_next = True
        if req.prompt_token_ids and req.prompt_token_ids[0] == GIL_HOG_TOKEN:
            self._hog_next = True
        held = self.hold_token is not None and req.prompt_token_ids[:1] == [self.hold_token]
        start_at = float("inf") if held else time.monotonic() + self.first_delay
        if self.record_dir is not None:
            import msgspec

            so = req.params.structured_outputs  # an array_like struct: recorded by field name
            record = {"request_id": req.request_id,
                      "structured_outputs": None if so is None else msgspec.structs.asdict(so)}
            path = os.path.join(self.record_dir, req.request_id + ".json")
            with open(path + ".tmp", "w") as f:
                json.dump(record, f)
            os.replace(path + ".tmp", path)  # whole or absent for a reader polling the folder
        reply = []
        if self.reply_file is not None and req.output_text:
            with open(self.reply_file) as f:
                spec = json.load(f)
            text, chunk = spec["text"], max(1, int(spec.get("chunk", 4)))
            reply = [text[i:i + chunk] for i in range(0, len(text), chunk)] or [""]
        self.reqs[req.request_id] = _Req(req, start_at, [0] * max(1, req.params.n), reply)

    def has_unfinished(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[CompletionDelta]:
        if self._crash_next:
            self._crash_next = False
            raise RuntimeError("simulated engine failure")
        if self._hog_next:
            self._hog_next = False
            _hold_gil(self.gil_hog_seconds)
        if self.step_delay:
            time.sleep(self.step_delay)
        elif not any(r.start_at <= time.monotonic() for r in self.reqs.values()):
            time.sleep(0.005)  # everything is still "waiting": don't spin the CPU
        now = time.monotonic()
        out = []
        for rid, r in list(self.reqs.items()):
            if r.start_at > now:
                continue
            max_tokens = len(r.reply) if r.reply else (r.req.params.max_tokens or DEFAULT_MAX_TOKENS)
            for i, k in enumerate(r.produced):
                if k >= max_tokens:
                    continue
                if r.reply:
                    r.produced[i] = k + 1
                    done = k + 1 >= max_tokens
                    out.append(CompletionDelta(request_id=rid, index=i, token_ids=[100 + k], text=r.reply[k],
                                               finish_reason="stop" if done else None,
                                               num_prompt_tokens=len(r.req.prompt_token_ids)))
                    continue
                r.produced[i] = k + 1
                done = k + 1 >= max_tokens
                out.append(CompletionDelta(request_id=rid, index=i, token_ids=[self.rank * 1000 + i * 100 + k],
                                           finish_reason="length" if done else None,
                                           num_prompt_tokens=len(r.req.prompt_token_ids)))
            if all(k >= max_tokens for k in r.produced):
                del self.reqs[rid]
        return out

    def abort(self, request_id: str) -> list[CompletionDelta]:
        r = self.reqs.pop(request_id, None)
        if r is None:
            return []
        max_tokens = len(r.reply) if r.reply else (r.req.params.max_tokens or DEFAULT_MAX_TOKENS)
        return [CompletionDelta(request_id=request_id, index=i, finish_reason="abort")
                for i, k in enumerate(r.produced) if k < max_tokens]

    # The rest of worker/engine/api.py's EngineAPI: no KV cache, transfers or followers here.
    def tick(self) -> None:
        pass

    def take_request_errors(self) -> list:
        return []

    def snapshot_kv_events(self) -> None:
        return None

    def drain_kv_events(self) -> None:
        return None

    def transfer_address(self) -> None:
        return None

    def close(self) -> None:
        pass

    def load(self) -> WorkerLoad:
        now = time.monotonic()
        waiting = sum(1 for r in self.reqs.values() if r.start_at > now)
        running = len(self.reqs) - waiting
        return WorkerLoad(running=running, waiting=waiting, free_kv_blocks=self.num_kv_blocks - running,
                          total_kv_blocks=self.num_kv_blocks, max_num_seqs=self.model_info.max_num_seqs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fake_worker")
    p.add_argument("--broker", default=None, help="default: as tokserve worker's")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds slept per engine step")
    p.add_argument("--first-delay", type=float, default=0.0, help="seconds a request waits before its first token")
    p.add_argument("--curve-server-key", default=None, help="broker's CURVE public key (Z85)")
    p.add_argument("--curve-client-key-file", default=None, help="this worker's CURVE certificate (.key_secret)")
    p.add_argument("--worker-token-file", default=None, help="as tokserve worker's flag")
    p.add_argument("--hold-token", type=int, default=None, help="prompts starting with it never start here")
    p.add_argument("--has-tokenizer", action="store_true", help="report a tokenizer (structured outputs need one)")
    p.add_argument("--reply-file", default=None, help='JSON {"text": ..., "chunk": N}: text requests emit that text')
    p.add_argument("--record-dir", default=None, help="write each request's structured_outputs here")
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--liveness", type=int, default=3)
    p.add_argument("--unresponsive-timeout", type=float, default=None, help="as tokserve worker's flag")
    p.add_argument("--gil-hog-seconds", type=float, default=0.0,
                   help=f"a prompt starting with {GIL_HOG_TOKEN} makes the next step hold the GIL this long")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--role", default="both", help="the role READY reports (encode: pinned requests only)")
    p.add_argument("--transfer-address", default=None,
                   help="host:port READY announces as its transfer server (a registered peer nothing answers on)")
    args = p.parse_args(argv)
    setup_logging(f"fake-worker{args.rank}")
    from common import config, runtime_dir
    from common.security import load_keypair
    from worker.server import WorkerServer

    client_keys = load_keypair(args.curve_client_key_file) if args.curve_client_key_file else None
    engine = FakeEngine(args.rank, args.max_num_seqs, step_delay=args.step_delay, first_delay=args.first_delay,
                        hold_token=args.hold_token, has_tokenizer=args.has_tokenizer, reply_file=args.reply_file,
                        record_dir=args.record_dir, gil_hog_seconds=args.gil_hog_seconds)
    engine.transfer_address = lambda: args.transfer_address
    server = WorkerServer(engine, args.broker or config.backend_address(), args.rank,
                          interval=args.heartbeat_interval, liveness=args.liveness,
                          unresponsive_timeout=args.unresponsive_timeout or config.unresponsive_timeout(),
                          drain_timeout=args.drain_timeout,
                          curve_server_key=args.curve_server_key.encode() if args.curve_server_key else None,
                          curve_client_keys=client_keys, role=args.role,
                          worker_token=runtime_dir.load_or_create_token(runtime_dir.WORKER, args.worker_token_file))
    server.install_signal_handlers()
    return server.run()


if __name__ == "__main__":
    sys.exit(main())
