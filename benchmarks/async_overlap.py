"""Host work of an engine step against a simulated device (issue 41's overlap measurement).

    python -m benchmarks.async_overlap                          # batch 1/64/256, T = 5 ms, 3 rounds, sync and async
    python -m benchmarks.async_overlap --rounds 5 --steps 200 --device-ms 5 --batches 1 64 256
    python -m benchmarks.async_overlap --profile 256            # + cProfile of the decode steps at batch 256
    python -m benchmarks.async_overlap --device-models queue    # only the asynchronous-device stand-in

A real ``Engine`` (tokens_only, random tiny Llama, CPU) whose model is replaced by a
stand-in: the forward returns hidden rows of the right shape after a fixed device
time T spent in ``time.sleep`` (the GIL is released, as while a host thread waits on
a GPU), and the lm head returns precomputed logits.  Everything above the model is
the real code: scheduler, block manager (prefix caching on, as served), the runner's
batch layout and attention plan, sampling metadata, the sampler, appending tokens and
stop checks, the Engine's CompletionDelta packing.  So ``step time - T`` is the host
time a GPU would sit idle for in a synchronous step: what async scheduling must hide.

Two device models (``--device-models``, both by default, each with its own rounds and
table): ``sleep``, the forward *call* takes T (a synchronous forward, as on the CPU,
with the GIL released), so whatever the device thread does after it -- logits, the
sampler -- is serial with the device time; and ``queue``, an asynchronous device as a
GPU is: the forward call queues T of device work behind what is already queued and
returns (kernel launches, graph replays), and the host blocks only where the CUDA path
blocks, the sampled ids' host copy (``DeviceStep.collect``).  ``queue`` is the model of
the GPU the overlap is for; ``sleep`` is the stricter bound.

The vocabulary is small (``--vocab``, 512) on purpose: on a GPU the sampler's tensor
math runs on the device, here it runs on the host, and a real vocabulary would make
the argmax over [256, 150k] logits the dominant "host" cost.  Greedy sampling only:
the sampler modifies logits in place when it applies temperature or penalties, and
the stand-in hands out shared precomputed logits.

Workload per (mode, batch): ``batch`` requests of ``--prompt-len`` random tokens
(fresh each round), ignore_eos; the prefill and ``--warmup`` decode steps are not
timed, then ``--steps`` decode steps are, one by one (every sequence decodes one
token per timed step), then the requests finish untimed.  Rounds alternate the
modes and print every round; the table gives medians over rounds.

Modes map to EngineConfig options (``MODES``): ``sync`` (``--no-async-scheduling``)
and ``async`` (async scheduling, the default: step N+1 is planned and launched while
step N runs on the executor's thread, step N's outputs processed meanwhile).  Both run
in the same process, rounds alternating; the table prints each one's tok/s against
the first mode's.
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import datetime
import io
import os
import platform
import pstats
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.protocol import GenerateRequest, SamplingParams  # noqa: E402
from worker.engine import Engine, EngineConfig  # noqa: E402
from benchmarks.engine_throughput import write_llama  # noqa: E402

# mode -> EngineConfig overrides: the synchronous step, and async scheduling (the default).
MODES: dict[str, dict] = {"sync": {"async_scheduling": False}, "async": {"async_scheduling": True}}

# The real model never runs (the stand-in replaces it); the smallest Llama keeps the
# engine's start-up and its KV cache cheap.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, max_position_embeddings=4096)
NUM_LOGITS = 8  # precomputed logits tensors, cycled: greedy picks change from step to step


def write_model(out: Path, vocab: int, seed: int = 0) -> Path:
    return write_llama(out, dict(TINY_LLAMA, vocab_size=vocab), seed)


class StandInModel:
    """The runner's model with the device work replaced by a wait of ``device_s``.

    ``time.sleep`` releases the GIL, so another thread's host work can overlap it as it
    overlaps a GPU's kernels.  ``device_time`` sums what the waits really took (a wake-up
    comes late by the timer's slack and the load), so the report can tell the engine's
    host time from the timer's.  Timer slack is per thread: whichever thread calls the
    forward (the step loop's today, maybe another with async scheduling) gets it tightened."""

    def __init__(self, hidden_size: int, vocab: int, max_tokens: int, max_rows: int, device_s: float,
                 seed: int = 0):
        self.device_s = device_s
        self.device_time = 0.0
        self.forwards = 0
        self._hidden = torch.zeros(max_tokens, hidden_size)
        gen = torch.Generator().manual_seed(seed)
        self._logits = [torch.randn(max_rows, vocab, generator=gen) for _ in range(NUM_LOGITS)]
        self._next_logits = 0
        self._thread = threading.local()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, kv_cache, lora=None,
                 **model_kwargs) -> torch.Tensor:
        if not getattr(self._thread, "slack_set", False):
            self._thread.slack_set = True
            tighten_timer_slack()
        started = time.perf_counter()
        time.sleep(self.device_s)
        self.device_time += time.perf_counter() - started
        self.forwards += 1
        return self._hidden[:input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor, lora=None) -> torch.Tensor:
        rows = hidden.shape[0]
        table = self._logits[self._next_logits % NUM_LOGITS]
        self._next_logits += 1
        if rows > table.shape[0]:
            raise ValueError(f"{rows} logits rows asked, the stand-in holds {table.shape[0]}")
        return table[:rows]


class QueuedDeviceStandIn(StandInModel):
    """An asynchronous device, as a GPU is: a forward call only queues ``device_s`` of
    device work behind what is already queued and returns at once (kernel launches and
    CUDA-graph replays do not wait for the device); the step's results are readable when
    the queue gets there, so the host blocks only where the CUDA path blocks -- the
    sampled ids' host copy (``DeviceStep.collect``: ``install`` makes each step's collect
    wait for its forward's completion time).  The logits and the sampler still run on
    the host here, after the forward is queued and before it completes, as their kernel
    launches do on a GPU.  ``device_time``: T per forward plus how late each wait woke."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._busy_until = 0.0
        self.last_ready = 0.0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, kv_cache, lora=None,
                 **model_kwargs) -> torch.Tensor:
        start = max(time.perf_counter(), self._busy_until)  # behind the work already queued
        self._busy_until = self.last_ready = start + self.device_s
        self.device_time += self.device_s
        self.forwards += 1
        return self._hidden[:input_ids.shape[0]]

    def wait_until(self, ready: float) -> None:
        if not getattr(self._thread, "slack_set", False):
            self._thread.slack_set = True
            tighten_timer_slack()
        left = ready - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self.device_time += time.perf_counter() - ready  # the wake-up's lateness

    def install(self, engine: Engine) -> None:
        """Make each launched step's host copy wait for its forward (a benchmark-only seam on
        the engine instance, like ``PhaseTimes``)."""
        run_on_device = engine._run_on_device

        def run(step, fill):
            before = self.forwards
            run_on_device(step, fill)
            if self.forwards != before:
                ready, collect = self.last_ready, step.collect
                step.collect = lambda: (self.wait_until(ready), collect())

        engine._run_on_device = run


STAND_INS = {"sleep": StandInModel, "queue": QueuedDeviceStandIn}


def tighten_timer_slack() -> bool:
    """Linux wakes a sleeping thread up to its timer slack (50 us by default) late; 1 us
    keeps the stand-in's device time close to T.  False where prctl is not available."""
    try:
        pr_set_timerslack = 29
        return ctypes.CDLL(None, use_errno=True).prctl(pr_set_timerslack, 1000, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def build_engine(model_dir: Path, mode: str, *, max_batch: int, max_model_len: int, device_s: float,
                 max_num_batched_tokens: int = 2048, device_model: str = "sleep") -> Engine:
    """A real Engine for ``mode`` with the stand-in model (``STAND_INS[device_model]``)
    installed in its runner."""
    blocks_per_seq = -(-max_model_len // 16)
    config = EngineConfig(model=str(model_dir), tokens_only=True, dtype="float32", num_threads=1,
                          max_num_seqs=max_batch, max_model_len=max_model_len,
                          max_num_batched_tokens=max_num_batched_tokens, block_size=16,
                          num_kv_blocks=max_batch * blocks_per_seq + 1, **MODES[mode])
    engine = Engine(config)
    mc = engine.model_config
    # The seam: the runner calls model(...) for the hidden states and model.compute_logits
    # for the selected rows; nothing above it knows the difference.
    stand_in = STAND_INS[device_model](mc.hidden_size, mc.vocab_size, max_num_batched_tokens, max_batch, device_s)
    engine.runner.model = stand_in
    if isinstance(stand_in, QueuedDeviceStandIn):
        stand_in.install(engine)
    return engine


@dataclass
class Round:
    mode: str
    batch: int
    step_s: list[float] = field(default_factory=list)  # each timed decode step's wall time
    device_s: list[float] = field(default_factory=list)  # what the stand-in's wait really took, per step
    tokens: int = 0  # tokens the timed steps produced

    @property
    def tok_per_s(self) -> float:
        return self.tokens / sum(self.step_s)

    def median_step(self) -> float:
        return statistics.median(self.step_s)


def _requests(batch: int, prompt_len: int, max_tokens: int, vocab: int, seed: int) -> list[GenerateRequest]:
    """Fresh random prompts per seed (ids >= 3: no special tokens), greedy, fixed length."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    return [GenerateRequest(request_id=f"r{seed}-{i}", prompt_token_ids=p, params=params)
            for i, p in enumerate(prompts)]


def _count(deltas, counts: dict[str, int]) -> int:
    n = 0
    for d in deltas:
        counts[d.request_id] = counts.get(d.request_id, 0) + len(d.token_ids)
        n += len(d.token_ids)
    return n


def measure(engine: Engine, mode: str, batch: int, *, steps: int, warmup: int = 4, prompt_len: int = 8,
            seed: int = 0, profiler: Optional[Any] = None) -> Round:
    """Time ``steps`` decode steps of ``batch`` sequences through ``engine.step()``;
    ``profiler`` (``enable()`` / ``disable()``: cProfile, PhaseTimes) covers the timed steps only."""
    stand_in: StandInModel = engine.runner.model
    max_tokens = 1 + warmup + steps + 1  # first token, warm-up, timed, one more: finishing is not timed
    reqs = _requests(batch, prompt_len, max_tokens, engine.vocab_size, seed)
    for req in reqs:
        engine.add_request(req)
    counts: dict[str, int] = {}
    while len(counts) < batch:  # prefill (chunked when the prompts exceed the step budget)
        _count(engine.step(), counts)
    for _ in range(warmup):
        _count(engine.step(), counts)
    result = Round(mode, batch)
    if profiler is not None:
        profiler.enable()
    timed = []
    for _ in range(steps):
        device_before = stand_in.device_time
        started = time.perf_counter()
        timed.append(engine.step())
        result.step_s.append(time.perf_counter() - started)
        result.device_s.append(stand_in.device_time - device_before)
    if profiler is not None:
        profiler.disable()
    result.tokens = sum(_count(deltas, counts) for deltas in timed)  # counted outside the profiled loop
    if result.tokens != batch * steps:  # a timed step that was not one token per sequence
        raise RuntimeError(f"{steps} timed steps of batch {batch} gave {result.tokens} tokens")
    while engine.has_unfinished():
        _count(engine.step(), counts)
    wrong = {rid: n for rid, n in counts.items() if n != max_tokens}
    if len(counts) != batch or wrong:  # every request must get exactly its tokens: the harness is sound
        raise RuntimeError(f"expected {batch} requests x {max_tokens} tokens, got {len(counts)} ({wrong})")
    return result


# --- report --------------------------------------------------------------------------------
def print_round(r: Round, index: int, device_s: float) -> None:
    ms = [s * 1e3 for s in r.step_s]
    median = statistics.median(ms)
    over = statistics.median(r.device_s) - device_s
    print(f"  round {index} {r.mode:>6} batch {r.batch:>4} (load {os.getloadavg()[0]:4.1f}): step median "
          f"{median:7.3f} ms (mean {statistics.fmean(ms):7.3f}, p90 {_pct(ms, 0.9):7.3f})  exposed host "
          f"{median - device_s * 1e3:6.3f} ms/step (timer overshoot {over * 1e3:5.3f})  "
          f"{r.tok_per_s:9.1f} tok/s", flush=True)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def print_table(rounds: list[Round], modes: list[str], batches: list[int], device_s: float) -> None:
    """Medians over rounds: exposed host ms/step (median step - T), decode tok/s, and the
    ratio of each mode's tok/s to the first mode's."""
    print(f"\nmedians over rounds (T = {device_s * 1e3:g} ms; exposed host = median step - T; "
          f"overshoot = median stand-in wait - T, part of the exposed host time)")
    print(f"{'batch':>5} {'mode':>6} {'step ms':>9} {'exposed host ms':>16} {'overshoot ms':>13} "
          f"{'tok/s':>10} {'vs ' + modes[0]:>8}")
    for batch in batches:
        base = None
        for mode in modes:
            sel = [r for r in rounds if r.mode == mode and r.batch == batch]
            step = statistics.median(r.median_step() for r in sel)
            over = statistics.median(statistics.median(r.device_s) for r in sel) - device_s
            tps = statistics.median(r.tok_per_s for r in sel)
            base = tps if base is None else base
            print(f"{batch:>5} {mode:>6} {step * 1e3:9.3f} {(step - device_s) * 1e3:16.3f} {over * 1e3:13.3f} "
                  f"{tps:10.1f} {tps / base:7.2f}x")


def print_profile(profiler: cProfile.Profile, steps: int, top: int) -> None:
    """Top host costs by own time; cProfile inflates Python calls, so read it as shares."""
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    print(f"\ncProfile over {steps} decode steps (own time, top {top}; time.sleep is the stand-in's device time):")
    print(stream.getvalue())


# --- where the host time goes ------------------------------------------------------------------
# (owner attribute of the engine, method, label), in step order; none contains another except
# _launch, which contains the indented ones: its remainder is mostly the sampling metadata.
# The "device step" phases run on the executor's thread under async scheduling (then they
# overlap the host's; the profile is of the first mode: run it with --modes sync async).
PHASES = [("", "_schedule", "schedule (scheduler + hooks)"),
          ("", "_launch", "launch (host plan of the step)"),
          ("runner", "plan", "  runner: batch layout"),
          ("scheduler", "update_after_step", "  scheduler.update_after_step"),
          ("", "_select_rows", "  select rows"),
          ("runner", "to_inputs", "device step: input tensors + attention plan"),
          ("runner", "compute_logits", "device step: runner.compute_logits"),
          ("", "sampler", "device step: sampler"),
          ("", "_process_outputs", "process outputs (append, stops)"),
          ("", "_deltas", "Engine: CompletionDelta packing")]


class PhaseTimes:
    """Wall time of each phase in each step, by wrapping the engine's own methods on the
    instance (a benchmark-only seam; ``restore`` puts the originals back).  Costs a
    wrapper call per phase and step, far less than cProfile's per-call overhead.
    ``steps``: one {label: seconds} per step run while enabled."""

    def __init__(self, engine: Engine):
        self.steps: list[dict[str, float]] = []
        self.enabled = False
        self._current: dict[str, float] = {}
        self._restore: list[tuple[object, str, object, bool]] = []
        for owner_name, name, label in PHASES:
            owner = getattr(engine, owner_name) if owner_name else engine
            self._wrap(owner, name, self._timed(label))
        self._wrap(engine, "step", self._step_boundary)

    def _wrap(self, owner: object, name: str, make) -> None:
        fn = getattr(owner, name)
        self._restore.append((owner, name, fn, name in vars(owner)))
        setattr(owner, name, make(fn))

    def _timed(self, label: str):
        def make(fn):
            def timed(*args, **kwargs):
                if not self.enabled:
                    return fn(*args, **kwargs)
                started = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._current[label] = self._current.get(label, 0.0) + time.perf_counter() - started
            return timed
        return make

    def _step_boundary(self, fn):
        def step(*args, **kwargs):
            self._current = {}
            try:
                return fn(*args, **kwargs)
            finally:
                if self.enabled:
                    self.steps.append(self._current)
        return step

    def restore(self) -> None:
        for owner, name, fn, own in reversed(self._restore):
            if own:
                setattr(owner, name, fn)
            else:
                delattr(owner, name)  # the class's method shows through again

    def enable(self) -> None:
        self.enabled = True

    def disable(self) -> None:
        self.enabled = False


def print_phases(phases: PhaseTimes, r: Round, device_s: float) -> None:
    """Median microseconds per step of each phase and its share of the exposed host time
    (median step - T).  Medians, not means: on a shared box a step now and then loses
    the CPU for milliseconds.  No phase contains the forward's wait; what the stand-in
    overslept is its own row, what no phase covers in a step is "rest"; medians of the
    parts need not add up to the median of the whole."""
    us = 1e6
    rows: list[tuple[str, list[float]]] = []
    for _, _, label in PHASES:
        rows.append((label, [p.get(label, 0.0) * us for p in phases.steps]))
        if label == "  select rows":  # what _launch spends outside its timed parts: SamplingMetadata.build mostly
            rows.append(("  sampling metadata + rest of launch",
                         [(p.get("launch (host plan of the step)", 0.0) - p.get("  runner: batch layout", 0.0)
                           - p.get("  scheduler.update_after_step", 0.0) - p.get("  select rows", 0.0)) * us
                          for p in phases.steps]))
    tops = [label for label, _ in rows if not label.startswith("  ")]
    rows.append(("stand-in wait past T (timer overshoot)", [(w - device_s) * us for w in r.device_s]))
    rows.append(("rest (step/tick hooks, forward plumbing, phase timers)",
                 [(step - wait - sum(p.get(label, 0.0) for label in tops)) * us
                  for step, wait, p in zip(r.step_s, r.device_s, phases.steps)]))
    exposed = (r.median_step() - device_s) * us
    print(f"\nhost time per decode step at batch {r.batch} (phase timers, {len(phases.steps)} steps, medians): "
          f"step {r.median_step() * us:.0f} us, exposed host (step - T) {exposed:.0f} us")
    for label, values in rows:
        median = statistics.median(values)
        print(f"  {label:<58} {median:8.1f} us  {median / exposed * 100:5.1f} %")


def profile_host(engine: Engine, args, device_s: float) -> None:
    """Where the exposed host time goes at one batch: a run with phase timers, then one
    under cProfile (separately: cProfile's overhead would distort the phases)."""
    phases = PhaseTimes(engine)
    try:
        r = measure(engine, args.modes[0], args.profile, steps=args.steps, warmup=args.warmup,
                    prompt_len=args.prompt_len, seed=999_998, profiler=phases)
    finally:
        phases.restore()
    print_phases(phases, r, device_s)
    profiler = cProfile.Profile()
    measure(engine, args.modes[0], args.profile, steps=args.steps, warmup=args.warmup,
            prompt_len=args.prompt_len, seed=999_999, profiler=profiler)
    print_profile(profiler, args.steps, args.profile_top)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64, 256])
    ap.add_argument("--device-ms", type=float, default=5.0, help="the stand-in forward's device time T")
    ap.add_argument("--device-models", nargs="+", default=list(STAND_INS), choices=list(STAND_INS),
                    help="sleep: the forward call takes T (a synchronous forward, the GIL released); queue: an "
                         "asynchronous device as a GPU's, the forward queued, the sampled ids' host copy waiting "
                         "for it. Each gets its own rounds and table")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps per (round, mode, batch)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed decode steps before the timed ones")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--profile", type=int, default=None, metavar="BATCH",
                    help="after the rounds, where the host time goes at this batch (first mode): one more run "
                         "with phase timers, one under cProfile")
    ap.add_argument("--profile-top", type=int, default=25)
    args = ap.parse_args(argv)

    device_s = args.device_ms / 1e3
    slack = tighten_timer_slack()
    max_batch = max(args.batches + ([args.profile] if args.profile else []))
    max_model_len = args.prompt_len + 1 + args.warmup + args.steps + 1
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["python -m benchmarks.async_overlap", *(sys.argv[1:] if argv is None else argv)])
    print(f"{now}, {_cpu_name()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}: {command}")
    for device_model in args.device_models:
        run_device_model(args, device_model, device_s, slack, max_batch, max_model_len)
    return 0


def run_device_model(args, device_model: str, device_s: float, slack: bool, max_batch: int,
                     max_model_len: int) -> None:
    """The rounds, table (and profile) of one stand-in device model."""
    with tempfile.TemporaryDirectory(prefix="tokserve-overlap-") as tmp:
        model_dir = write_model(Path(tmp), args.vocab)
        engines = {mode: build_engine(model_dir, mode, max_batch=max_batch, max_model_len=max_model_len,
                                      device_s=device_s, device_model=device_model) for mode in args.modes}
        first = engines[args.modes[0]]
        how = ("time.sleep in the forward call" if device_model == "sleep" else
               "a queued asynchronous device; the host copy waits")
        print(f"\n== device model {device_model!r}: stand-in device T = {args.device_ms:g} ms ({how}; timer slack "
              f"1 us: {slack}); batches {args.batches}, {args.steps} timed decode steps after {args.warmup} warm-up, "
              f"prompts {args.prompt_len} tokens, vocab {args.vocab}, greedy; modes {args.modes}; {args.rounds} "
              f"rounds; {first.attention_backend.describe()} attention plan, torch threads {torch.get_num_threads()}")
        rounds: list[Round] = []
        for r in range(args.rounds):
            order = args.modes[r % len(args.modes):] + args.modes[:r % len(args.modes)]  # alternate who goes first
            for batch in args.batches:
                for mode in order:
                    res = measure(engines[mode], mode, batch, steps=args.steps, warmup=args.warmup,
                                  prompt_len=args.prompt_len, seed=r * 1000 + batch)
                    rounds.append(res)
                    print_round(res, r, device_s)
        print_table(rounds, args.modes, args.batches, device_s)
        if args.profile:
            profile_host(first, args, device_s)
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    sys.exit(main())
