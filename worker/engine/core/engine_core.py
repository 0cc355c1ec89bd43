"""The engine core: requests in, per-step ``SequenceOutput``s out.

``step()`` = schedule -> forward -> logits of the rows that need them -> sample ->
append tokens, check stops, detokenize.  Requests join and leave between steps
(continuous batching).  What a step produced stays engine state (``records.SequenceOutput``);
packing it into the wire's CompletionDelta is ``Engine``'s job (engine.py).
"""
from __future__ import annotations

import collections
import itertools
import logging
import time
from typing import Any, Optional

import torch

from common.detokenizer import IncrementalDetokenizer, attach_token_texts, needs_detokenizer
from common.errors import BadRequest, NotFound
from common.protocol import GenerateRequest, KvEvents, ModelInfo, WorkerLoad
from common.tokenizer import load_tokenizer
from common.validation import validate_request
from worker.engine.component import EngineComponent, EngineWiring, Hooks
from worker.engine.config import EngineConfig
from worker.engine.core.block_manager import BlockManager
from worker.engine.core.context import CoreContext
from worker.engine.core.gates import Gates
from worker.engine.core.inflight import DeviceStep, StepExecutor, placeholder_fill
from worker.engine.core.scheduler import ScheduledSeq, Scheduler
from worker.engine.loading.model_setup import build_model
from worker.engine.quantization.config import check_quantization_arg
from worker.engine.models.config import ModelConfig, generation_defaults
from worker.engine.records import EngineSequence, FinishReason, Request, SequenceOutput
from worker.engine.runner.model_runner import ModelRunner
from worker.engine.sample.logprobs import (compute_prompt_logprobs, extend_token_logprobs, prompt_token_logprobs,
                                           score_token_ids, to_token_logprobs)
from worker.engine.sample.verify import verified_tokens
from worker.engine.sample.sampler import Sampler
from worker.engine.sample.sampling_metadata import (MetadataCache, SamplingMetadata, SamplingRow, draft_sampling_rows,
                                                    make_generator, reads_output_history, tokenize_bad_words)

log = logging.getLogger(__name__)


class EngineCore:
    """The step loop.  ``features`` (component.EngineWiring; worker/engine/build.py's
    ``EngineFeatures``, which ``Engine`` hands over) builds the features it runs with;
    None: the bare loop, no feature."""

    def __init__(self, config: EngineConfig, features: Optional[EngineWiring] = None):
        self.config = config
        device = config.torch_device
        if device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        if device.type == "cuda":
            # cuda:N must be the current device: CUDA events, graph capture and the
            # default stream otherwise land on device 0.
            device = config.resolved_device
            torch.cuda.set_device(device)
        torch.manual_seed(config.seed)  # unseeded sampling is reproducible per engine run
        self.model_config = ModelConfig.from_dir(config.model)
        check_quantization_arg(config.quantization, self.model_config.quantization)
        mc = self.model_config
        self.device = device
        self.features = features
        self.context = CoreContext(self)  # what the components may do to the engine
        if features is not None:
            features.start(self.context)  # tensor parallelism's followers join before the model is built
        self._build_model_and_cache(config, mc, device)
        self.vocab_size = mc.vocab_size
        # vLLM's generate endpoint takes only max_tokens from these (when the client omits
        # it); the other sampling defaults are the OpenAI endpoints' (scale_out serving.py).
        self.generation_defaults = generation_defaults(config.generation_config, config.model)
        self.default_max_tokens = self.generation_defaults.get("max_tokens")
        self.model_info = ModelInfo(
            name=config.served_model_name or config.model,
            vocab_size=mc.vocab_size,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_logprobs=config.max_logprobs,
            has_tokenizer=self.tokenizer is not None,
            eos_token_ids=list(mc.eos_token_ids),
            default_max_tokens=self.default_max_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            lora_adapters=None,  # LoRA's component lists its adapters here
            kv_block_size=config.block_size,
            dtype=str(config.torch_dtype),
            lora_config=({"max_loras": config.max_loras, "max_lora_rank": config.max_lora_rank,
                          "max_cpu_loras": config.max_cpu_loras or config.max_loras}
                         if config.enable_lora else None),
            weight_transfer_backend="nccl" if device.type == "cuda" else "gloo",
        )
        self.requests: dict[str, Request] = {}
        self.gates = Gates()  # per request, what it waits for before its first step
        self._admitting: Optional[Request] = None  # the request whose admit hooks run
        self._arrivals = itertools.count()
        # (request id, HTTP status, message, param)
        self._request_errors: list[tuple[str, int, str, str]] = []
        self.components: list[EngineComponent] = (features.components(self.context, self.runner)
                                                  if features is not None else [])
        self.hooks = Hooks(self.components)
        for allocated in self.hooks.on_kv_cache_allocated:  # a draft model's cache beside the target's
            allocated()
        self.runner.capture_cuda_graphs()
        self._sampler_masks = any(c.needs_sampler_masks for c in self.components)
        # An encoder-only engine runs its features' step (EncoderDisaggregation.encode_step).
        self._run_step = (features.step if features is not None else None) or self._model_step
        # Async scheduling (core/inflight.py): the step in flight, outputs finished outside
        # a step (drain), the requests whose steps run synchronously.
        self._async = self._resolve_async_scheduling(config)
        self.executor = StepExecutor(self._async, device)
        self._inflight: Optional[DeviceStep] = None
        self._drained: list[SequenceOutput] = []
        self._sync_only: set[str] = set()
        self.step_counts: collections.Counter = collections.Counter()  # model steps: overlapped / synchronous
        log.info("engine ready: %s on %s (%s%s, %s attention), %d KV blocks x %d tokens%s, max_model_len %d, "
                 "async scheduling %s", mc.architecture, device, config.torch_dtype,
                 f", {self.cpu_linear} linears" if device.type == "cpu" else "", self.attention_backend.describe(),
                 self.block_manager.num_blocks, config.block_size,
                 f" in {self.runner.kv_dtype}" if self.runner.kv_dtype != config.torch_dtype else "",
                 self.max_model_len,
                 "on" if self._async else "off")

    @property
    def model(self) -> Any:
        """The model the runner runs (RL's sleep releases it, wake-up reloads it)."""
        return self.runner.model

    def _resolve_async_scheduling(self, config: EngineConfig) -> bool:
        """vLLM's --async-scheduling, where it can run: on by default on CUDA; on CPU only
        when asked for (as vLLM's CPU platform, which turns it off: there the forward runs
        on the host's own cores, and side by side it was no faster, 15 % slower at batch 1:
        benchmarks/README.md, "Async scheduling")."""
        if config.async_scheduling is False:
            return False
        if config.async_scheduling is None and self.device.type != "cuda":
            log.info("async scheduling off on CPU (as vLLM's CPU platform; --async-scheduling turns it on)")
            return False
        why = self.features.overlap_blocker if self.features is not None else None  # build.py names the feature
        if why is not None:
            (log.warning if config.async_scheduling else log.info)("async scheduling off: %s", why)
            return False
        return True

    def _build_model_and_cache(self, config: EngineConfig, mc: ModelConfig, device: torch.device) -> None:
        """Model, tokenizer, runner (with the features' runner hooks), KV cache, block
        manager, scheduler and sampler; sets ``max_model_len`` (lowered when the KV cache
        holds less)."""
        max_model_len = config.resolve_max_model_len(mc.max_position_embeddings)
        model, self.attention_backend, self.cpu_linear = build_model(config, mc, device)
        self.cpu_attention = "native" if self.attention_backend.name == "native" else "torch"
        self.tokenizer = None if config.tokens_only else load_tokenizer(config.model, mc.eos_token_ids)

        self.runner = ModelRunner(config, mc, model, max_model_len, self.attention_backend)
        if self.features is not None:  # features reach the runner through its hooks (runner.hooks)
            self.features.install(self.context, self.runner)
        num_blocks = self.runner.decide_num_blocks()
        if num_blocks * config.block_size < max_model_len:
            # One sequence must always fit, or recompute preemption could never finish it.
            log.warning("KV cache holds %d tokens < max_model_len %d; lowering max_model_len",
                        num_blocks * config.block_size, max_model_len)
            max_model_len = num_blocks * config.block_size
            self.runner.set_max_model_len(max_model_len)
        self.max_model_len = max_model_len
        self.runner.allocate_kv_cache(num_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   token_budget=config.step_token_budget(max_model_len),
                                   max_model_len=max_model_len,
                                   enable_chunked_prefill=config.enable_chunked_prefill)
        self.sampler = Sampler()
        self._sampling_metadata = MetadataCache()

    # --- what RL control does to the engine (through the context) ---------------------
    def release_kv_cache(self) -> None:
        self.runner.release_kv_cache()
        for hook in self.hooks.on_kv_cache_released:
            hook()

    def allocate_kv_cache(self) -> None:
        self.runner.allocate_kv_cache(self.block_manager.num_blocks)
        for hook in self.hooks.on_kv_cache_allocated:
            hook()

    def replace_model(self, model: Any) -> None:
        self.runner.model = model
        for hook in self.hooks.on_model_replaced:
            hook(model)

    # --- requests ------------------------------------------------------------------
    def add_request(self, req: GenerateRequest) -> None:
        if req.request_id in self.requests:
            raise BadRequest(f"Request id {req.request_id} is already running.", "request_id")
        validate_request(req, self.model_info, tokens_only=self.tokenizer is None)
        mm = self._parse_images(req)
        for check in self.hooks.check:  # encoder and KV transfer, LoRA, ...: a refusal leaves nothing behind
            check(req, mm)
        if req.lora_name is not None and self.model_info.lora_adapters is None:  # LoRA is off
            raise NotFound(f"The model `{req.lora_name}` does not exist.", "model")
        p = req.params
        prompt_len = len(req.prompt_token_ids)
        room = self.max_model_len - prompt_len
        # Like vLLM's generate endpoint, a max_tokens past the context is accepted and the
        # generation stops at max_model_len (finish_reason "length"), not rejected.
        max_tokens = room if p.max_tokens is None else min(p.max_tokens, room)
        if p.max_tokens_is_default and self.default_max_tokens:
            max_tokens = min(max_tokens, self.default_max_tokens)
        request = Request(req, arrival_seq=next(self._arrivals), max_tokens=max_tokens,
                          eos_token_ids=list(self.model_config.eos_token_ids), now=time.time())
        request.mm = mm
        if p.bad_words and self.tokenizer is not None:
            try:
                request.bad_words_ids = tokenize_bad_words(self.tokenizer, p.bad_words)
            except ValueError as e:
                raise BadRequest(str(e), "bad_words") from None
        seq = self._new_sequence(request, 0, list(req.prompt_token_ids))
        self.requests[req.request_id] = request
        self._admitting = request
        try:
            for admit in self.hooks.admit:  # each may close gates the request then waits for
                admit(request, seq)
        except BaseException:
            self.forget_request(request)
            raise
        finally:
            self._admitting = None
        if not all(ok(request) for ok in self.hooks.can_overlap):
            self._sync_only.add(request.request_id)  # its steps run synchronously
        if request.request_id not in self.gates:
            self.scheduler.add(seq)

    # --- readiness gates (core/gates.py) ---------------------------------------------
    def close_gate(self, request: Request, name: str) -> None:
        """The request waits for ``name`` (a pull, a compile) before its first step.
        Gates are closed in ``admit``, before the request is queued (or while another
        of its gates is still closed)."""
        if self.requests.get(request.request_id) is not request:
            return  # gone already
        if request is not self._admitting and request.request_id not in self.gates:
            raise RuntimeError(f"gate {name!r} of request {request.request_id}: gates are closed at admission, "
                               "before the request is queued")
        self.gates.close(request.request_id, name)

    def open_gate(self, request: Request, name: str) -> None:
        """``name`` is done: the request is queued when it was its last closed gate.  A
        request that is gone (aborted, failed) or a gate that is not closed: nothing."""
        if self.requests.get(request.request_id) is not request:
            return
        if self.gates.open(request.request_id, name) and request is not self._admitting:
            self.scheduler.add(request.sequences[0])

    def _parse_images(self, req: GenerateRequest) -> Any:
        """The request's images (MultiModalState, checked against the model), None without."""
        if self.features is not None:
            return self.features.parse_images(req)
        if req.mm_items:
            raise BadRequest("this engine serves no image input", "mm_items")
        return None

    def tick(self) -> None:
        """Housekeeping of the components (every step, and by the worker while idle):
        released KV transfers, finished pulls."""
        for hook in self.hooks.tick:
            hook()

    def fail_request(self, request: Request, status: int, message: str, param: str) -> None:
        """A request failed outside a step's outputs (a pull, a grammar, a gate that never
        opens): its choices are aborted (blocks freed, pulls cancelled, gates dropped) and
        the error is its only answer -- the worker reports it (``take_request_errors``).
        A request already gone: nothing."""
        if self.requests.get(request.request_id) is not request:
            return
        self.abort(request.request_id)
        self._request_errors.append((request.request_id, status, message, param))

    def _stalled(self) -> None:
        """Requests wait but none can start, nothing runs: only blocks held for remote
        decode (or a request bigger than the whole cache) can cause it.  Held blocks come
        back (FREE or the timeout), so a request that fits the cache then waits for them,
        never spinning; one that can never fit fails alone with a 503, not every request
        with a 500."""
        seq = self.scheduler.head_waiting()
        bm = self.block_manager
        if bm.blocks_needed(seq.num_tokens) > bm.num_blocks:
            self.fail_request(seq.request, 503, f"the request needs {bm.blocks_needed(seq.num_tokens)} KV blocks; "
                              f"this worker's KV cache holds {bm.num_blocks}", "prompt")
            return
        for stalled in self.hooks.on_stalled:  # blocks held for remote decode come back
            if stalled():
                return
        raise RuntimeError("scheduler stalled: waiting requests but nothing can run")  # a bug: fail loudly

    def take_request_errors(self) -> list[tuple[str, int, str, str]]:
        """Requests that failed outside a step's outputs (a decode leg's KV pull, an
        encoder output's pull): (request id, HTTP status, message, param); they are gone
        from the engine."""
        errors, self._request_errors = self._request_errors, []
        return errors

    def forget_request(self, request: Request) -> None:
        """The request is done (finished or aborted)."""
        self._sync_only.discard(request.request_id)
        self.gates.drop(request.request_id)
        if self.requests.pop(request.request_id, None) is not None:
            for forget in self.hooks.forget:
                forget(request)

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> EngineSequence:
        seq = EngineSequence(request, index, token_ids)
        p = request.params
        if p.seed is not None and p.seed != -1:  # vLLM: seed=-1 means no seed
            seq.generator = make_generator(p.seed, index, self.device)
        if self.tokenizer is not None and needs_detokenizer(p, request.req.output_text):
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, p)
        min_stop_ids: list[int] = []
        if p.min_tokens:
            min_stop_ids = sorted(request.stop_token_ids)
            if request.primary_eos is not None:
                min_stop_ids.insert(0, request.primary_eos)
        seq.sampling_row = SamplingRow(params=p, prompt_token_ids=request.prompt_token_ids,
                                       output_token_ids=seq.output_ids, generator=seq.generator,
                                       stop_ids_for_min_tokens=min_stop_ids,
                                       bad_words_ids=request.bad_words_ids)
        request.sequences.append(seq)
        return seq

    def abort(self, request_id: str) -> list[SequenceOutput]:
        request = self.requests.get(request_id)
        if request is None:
            return []
        self.forget_request(request)
        # Outputs a control command finished early go first: the client gets every token.
        outs = [o for o in self._drained if o.request is request]
        if outs:
            self._drained = [o for o in self._drained if o.request is not request]
        for seq in request.sequences:
            if not seq.is_finished():
                seq.finish(FinishReason.ABORT)
                for hook in self.hooks.on_finished:
                    hook(seq)
                self.scheduler.remove(seq)
                held = seq.detokenizer.release_held() if seq.detokenizer is not None else None
                outs.append(SequenceOutput(request, seq.index, seq, [], held))
        for index in range(len(request.sequences), request.n):  # choices not forked yet
            outs.append(SequenceOutput(request, index, None, []))
        return outs

    def close(self) -> None:
        """Stop the step executor and the tensor-parallel followers (idempotent)."""
        self.drain()
        self.executor.shutdown()
        for close in self.hooks.close:  # tensor parallelism's followers last
            close()

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._request_errors or self._drained) or self._inflight is not None

    def load(self) -> WorkerLoad:
        load = WorkerLoad(running=self.scheduler.num_running, waiting=self.scheduler.num_waiting,
                          free_kv_blocks=self.block_manager.num_free_blocks,
                          total_kv_blocks=self.block_manager.num_blocks,
                          max_num_seqs=self.config.max_num_seqs, num_preemptions=self.scheduler.num_preemptions)
        for fill in self.hooks.fill_load:  # LoRA adapters, encoder cache, a released KV cache
            fill(load)
        return load

    # --- KV events (prefix-cache changes, for the broker's cache-aware dispatch) ----------
    def drain_kv_events(self) -> Optional[KvEvents]:
        """Routing keys of base-model blocks stored in / removed from the prefix cache
        since the last drain or snapshot (None: no change)."""
        return self.block_manager.drain_kv_events()

    def snapshot_kv_events(self) -> KvEvents:
        """The whole published cache (``cleared`` + every key), for a (re)registration."""
        return self.block_manager.snapshot_kv_events()

    # --- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[SequenceOutput]:
        if any(held() for held in self.hooks.holds_steps):  # asleep: requests wait for wake_up
            return self._take_drained()
        self.tick()
        return self._run_step()  # _model_step (an encoder-only engine: EncoderDisaggregation.encode_step)

    def _model_step(self) -> list[SequenceOutput]:
        """nano-vllm's step -- schedule, run the model and sample, process the outputs --
        with async scheduling: this step is planned and launched while the previous one
        still runs on the device, whose outputs are processed while this one runs.  A
        step with a choice that cannot be planned before its last token is known
        (``_overlaps``) first finishes the step in flight and runs synchronously."""
        outs = self._take_drained()
        scheduled = self._schedule()
        if not scheduled:
            return outs + self._finish_inflight()
        overlap = self._async and self._overlaps(scheduled)
        if not overlap and self._inflight is not None:
            outs += self._finish_inflight()  # the plan reads what that step samples
            scheduled = [s for s in scheduled if not s.seq.is_finished()]
            if not scheduled:
                return outs
        step = self._launch(scheduled)
        self.step_counts["overlapped" if overlap else "synchronous"] += 1
        outs += self._finish_inflight()  # the previous step's outputs, while this one runs
        if overlap:
            self._inflight = step
        else:
            outs += self._finish(step)
        return outs

    def _overlaps(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether every choice of the plan can run with its last token still in flight, and
        planning it touches nothing the step in flight reads (``overlaps_step``)."""
        sync_only = self._sync_only
        if sync_only and any(s.seq.request.request_id in sync_only for s in scheduled):
            return False
        return self._inflight is None or all(ok(scheduled) for ok in self.hooks.overlaps_step)

    def _launch(self, scheduled: list[ScheduledSeq]) -> DeviceStep:
        """Plan the step on the host (layout, logit rows, forks, sampling metadata) and
        hand it to the executor, which runs it after the step in flight."""
        run_plan = self.runner.plan(scheduled)
        self.scheduler.update_after_step(scheduled)
        prompt_jobs, sample_seqs, rows, specs = self._select_rows(scheduled)
        num_sampling = len(sample_seqs)
        if not any(specs):  # no drafts to verify: one logits row per sampling choice
            num_prompt_rows = len(rows) - num_sampling
            sample_rows = list(range(num_prompt_rows, len(rows)))
            self._fork_choices(sample_seqs, sample_rows)
            sample_index = None if len(sample_rows) == num_sampling else sample_rows  # a fork reuses rows
            specs = [()] * len(sample_seqs)
            sampling_rows = [seq.sampling_row for seq in sample_seqs]
        else:
            num_prompt_rows = len(rows) - num_sampling - sum(len(sp) for sp in specs)
            # Each sampling choice's first logits row; a choice verifying drafts owns the
            # rows after it too (one per draft: the distribution after that draft).
            sample_rows, at = [], num_prompt_rows
            for sp in specs:
                sample_rows.append(at)
                at += 1 + len(sp)
            self._fork_choices(sample_seqs, sample_rows)
            specs += [()] * (len(sample_seqs) - len(specs))  # forked choices verify nothing
            flat = [r + j for r, sp in zip(sample_rows, specs) for j in range(len(sp) + 1)]
            sample_index = None if len(flat) == len(rows) - num_prompt_rows else flat
            sampling_rows = [row for seq, sp in zip(sample_seqs, specs) for row in draft_sampling_rows(seq, sp)]
        meta, meta_rows = None, None
        if sample_seqs:
            if self._inflight is not None and any(map(reads_output_history, sampling_rows)):
                # Penalties, min_tokens' stop masks and bad words read the tokens generated so
                # far, the one in flight included: the metadata is built on the device side
                # once the previous step's outputs reached the sequences (its forward still
                # overlaps; vLLM fills its async output placeholders before sampling likewise).
                meta_rows = sampling_rows
            else:
                # The previous step's metadata when the same rows sample again (sampling_metadata.py).
                meta = self._sampling_metadata.build(sampling_rows, self.vocab_size, self.device)
        step = DeviceStep(run_plan, rows, num_prompt_rows, sample_index, prompt_jobs, sample_seqs, specs, meta,
                          meta_rows=meta_rows)
        if self._inflight is not None and sample_seqs and (meta_rows is not None or any(
                needs(sample_seqs) for needs in self.hooks.needs_outputs_first)):
            step.wait_before_logits = self._inflight.outputs_done
        row_of = step.row_of
        r = 0
        for seq, sp in zip(sample_seqs, specs):
            seq.num_pending += 1
            row_of[seq.seq_id] = r
            r += 1 + len(sp)
        fill = placeholder_fill(run_plan.holes, run_plan.hole_seqs, self._inflight)
        step.future = self.executor.submit(self._run_on_device, step, fill)
        return step

    @torch.inference_mode()
    def _run_on_device(self, step: DeviceStep, fill) -> None:
        """Forward, logits of the rows that need them, grammar masks, sampling, and the
        host copy of the sampled ids (the executor's thread under async scheduling)."""
        hidden = self.runner.run(step.run_plan, fill)
        if not step.rows:
            return
        logits = self.runner.compute_logits(hidden, step.rows, step.run_plan)
        n = step.num_prompt_rows
        if step.prompt_jobs:
            step.prompt_logits = logits[:n]
        if not step.sample_seqs:
            return
        if step.sample_index is None:
            sample_logits = logits[n:]
        else:
            sample_logits = logits.index_select(
                0, torch.tensor(step.sample_index, dtype=torch.long, device=logits.device))
        if step.wait_before_logits is not None:  # the previous step's outputs reach the sequences first
            step.wait_before_logits.wait()
        if step.meta_rows is not None:  # rows reading their output history, the token in flight now in it
            step.meta = SamplingMetadata.build(step.meta_rows, self.vocab_size, self.device)
        for process in self.hooks.process_logits:  # grammar masks (structured outputs)
            process(step.sample_seqs, step.specs, sample_logits)
        # CPU: listed now; CUDA: the host copy starts, this thread goes on to queue the next step
        step.set_result(self.sampler(sample_logits, step.meta, self._sampler_masks))

    def _finish_inflight(self) -> list[SequenceOutput]:
        step, self._inflight = self._inflight, None
        return self._finish(step) if step is not None else []

    def _finish(self, step: DeviceStep) -> list[SequenceOutput]:
        """Wait for a launched step; score its prompt rows and process its samples."""
        try:
            step.future.result()  # a device failure fails the step (the worker fails its requests)
            step.collect()  # CUDA: wait for the sampled ids' host copy
            if step.prompt_jobs:
                self._score_prompts(step.prompt_jobs, step.prompt_logits)
            if not step.sample_seqs:
                return []
            return self._process_outputs(step)
        finally:
            step.outputs_done.set()  # (also on failure: a step waiting on it must not hang)

    def drain(self) -> None:
        """Finish the step in flight now (before weights change, the cache is released,
        ...); its outputs go out with the next ``step()``."""
        if self._inflight is not None:
            self._drained += self._finish_inflight()

    def _take_drained(self) -> list[SequenceOutput]:
        outs, self._drained = self._drained, []
        return outs

    def _schedule(self) -> list[ScheduledSeq]:
        """The step's batch, with the components' hooks around the scheduler."""
        if not self.scheduler.has_unfinished():  # only pulls in flight: wait for one a little
            any(wait() for wait in self.hooks.wait_idle)
        for hook in self.hooks.before_schedule:  # speculative decoding proposes its drafts
            hook()
        out = self.scheduler.schedule()
        if not out:
            # (With a step in flight nothing is stalled: its outputs free blocks or let a
            # preempted choice whose last token it samples queue again.)
            if self.scheduler.num_waiting and not self.scheduler.num_running and self._inflight is None:
                self._stalled()
            return []
        for hook in self.hooks.on_scheduled:  # LoRA orders the batch, draft models fill their slots
            hook(out.scheduled)
        return out.scheduled

    def _process_outputs(self, step: DeviceStep) -> list[SequenceOutput]:
        """Append each choice's sampled token (after the drafts it accepted), check stops,
        detokenize; the components see the step's outputs (``on_sampled``).  A choice
        that finished or was aborted while the step ran drops its sample (async
        scheduling: a step planned before the choice's stop was known)."""
        sampled, lp_lists = step.sampled, step.logprob_lists
        now = time.time()
        outs, first_rows, r = [], [], 0
        max_model_len = self.max_model_len
        for seq, sp in zip(step.sample_seqs, step.specs):
            seq.num_pending -= 1
            if not seq.is_finished():
                first_rows.append(r)
                if sp:  # rows r..r+len(sp): the drafts it verifies, then the token after them
                    outs.append(self._append_tokens(seq, verified_tokens(sampled, r, sp), lp_lists, r, now))
                elif lp_lists is None and seq.detokenizer is None:
                    # append_token without logprobs or text (the stop check is all), inlined:
                    # every choice, every step
                    token = sampled[r]
                    request = seq.request
                    if request.first_token_time is None:
                        request.first_token_time = now
                    seq.token_ids.append(token)
                    seq.output_ids.append(token)
                    if seq.check_token_stop(max_model_len):
                        self._sequence_finished(seq)
                    outs.append(SequenceOutput(request, seq.index, seq, [token]))
                else:
                    outs.append(self.append_token(seq, sampled[r], lp_lists, r, now))
            r += 1 + len(sp)
        for hook in self.hooks.on_sampled:  # routed experts, sampling masks, weight versions
            hook(outs, first_rows, step.result)
        return outs

    def _fork_choices(self, sample_seqs: list[EngineSequence], sample_rows: list[int]) -> None:
        """The first time choice 0 of an n>1 request samples, create choices 1..n-1:
        they share its full prompt blocks and draw their first token from the same
        logits row (appended to ``sample_seqs`` / ``sample_rows``)."""
        for i in range(len(sample_seqs)):
            seq = sample_seqs[i]
            request = seq.request
            if request.forked:
                continue
            request.forked = True
            for index in range(1, request.n):
                child = self._new_sequence(request, index, list(request.prompt_token_ids))
                self.block_manager.fork(seq, child)
                self.scheduler.add_running(child)
                sample_seqs.append(child)
                sample_rows.append(sample_rows[i])

    def _select_rows(self, scheduled: list[ScheduledSeq]):
        """Logit rows this step needs: prompt positions to score, then one row per
        sequence that reached its end (its next token is sampled), followed by one per
        draft it verifies (``specs``: the drafts of each sampling sequence)."""
        prompt_jobs: list[tuple[Request, int, int]] = []  # (request, first position, count)
        prompt_rows: list[int] = []
        sample_seqs: list[EngineSequence] = []
        sample_rows: list[int] = []
        specs: list[tuple] = []
        row = 0
        for s in scheduled:
            seq, n, spec = s.seq, s.num_new_tokens, s.spec
            if spec:
                n -= len(spec)
            request = seq.request
            if request.wants_prompt_scores and seq.index == 0:
                start = seq.num_computed_tokens - n
                # Logits at position p score prompt token p+1; recompute after preemption
                # must not score a position twice.
                first = max(start, request.num_prompt_scored)
                last = min(start + n, request.num_prompt_tokens - 1)
                if last > first:
                    prompt_jobs.append((request, first, last - first))
                    prompt_rows.extend(range(row + first - start, row + last - start))
                    request.num_prompt_scored = last
            if seq.num_computed_tokens == len(seq.token_ids) + seq.num_pending:  # reached its end
                sample_seqs.append(seq)
                if spec:
                    sample_rows.extend(range(row + n - 1, row + n + len(spec)))
                    row += len(spec)
                else:
                    sample_rows.append(row + n - 1)
                specs.append(spec)
            elif spec:
                row += len(spec)
            row += n
        return prompt_jobs, sample_seqs, prompt_rows + sample_rows, specs

    def _score_prompts(self, jobs: list[tuple[Request, int, int]], logits: torch.Tensor) -> None:
        offset = 0
        for request, first, count in jobs:
            rows = logits[offset:offset + count]
            offset += count
            p = request.params
            targets = request.prompt_token_ids[first + 1:first + 1 + count]
            if p.prompt_logprobs is not None:
                target_t = torch.tensor(targets, dtype=torch.long, device=rows.device)
                lists = compute_prompt_logprobs(rows, target_t, p.prompt_logprobs).tolists()
                entry = prompt_token_logprobs(lists)
                if p.detokenize and self.tokenizer is not None:
                    # vLLM fills decoded_token whenever it detokenizes, tokens mode included;
                    # the prompt tokens before this chunk are the split-character context, from
                    # position 1 on (vLLM's context is the prompt logprob entries; position 0 has none).
                    attach_token_texts(entry, self.tokenizer, request.prompt_token_ids[max(first - 3, 1):first + 1])
                request.prompt_logprobs = extend_token_logprobs(request.prompt_logprobs, entry)
            if p.prompt_logprob_token_ids:
                request.prompt_token_id_rows.append(
                    score_token_ids(rows, p.prompt_logprob_token_ids[first:first + count]))

    def append_token(self, seq: EngineSequence, token: int, lp_lists: Any, row: int, now: float) -> SequenceOutput:
        request = seq.request
        if request.first_token_time is None:
            request.first_token_time = now
        seq.append_token(token)
        p = request.params
        if p.logprobs is not None and lp_lists is not None:
            entry = to_token_logprobs(lp_lists, row, p.logprobs)
            if request.req.output_text and self.tokenizer is not None:
                attach_token_texts(entry, self.tokenizer, seq.output_ids[-5:-1])  # split-char context
            seq.pending_logprobs = extend_token_logprobs(seq.pending_logprobs, entry)
        new_tokens = [token]
        seq.check_token_stop(self.max_model_len)
        text: Optional[str] = None
        if seq.detokenizer is not None:
            stop_by_token = seq.is_finished() and seq.finish_reason == FinishReason.STOP
            text, stop_str = seq.detokenizer.update(
                new_tokens, stop_terminated=stop_by_token, finished=seq.is_finished() and not stop_by_token)
            if seq.detokenizer.dropped_token_count:
                dropped = seq.detokenizer.dropped_token_count
                del seq.token_ids[-dropped:]
                del seq.output_ids[-dropped:]
                new_tokens = new_tokens[:-dropped]
            if stop_str is not None:
                seq.finish(FinishReason.STOP, stop_str)
        if seq.is_finished():
            self._sequence_finished(seq)
        return SequenceOutput(request, seq.index, seq, new_tokens, text)

    def _append_tokens(self, seq: EngineSequence, tokens: list[int], lp_lists: Any, r: int,
                       now: float) -> SequenceOutput:
        """Append a run of sampled tokens (rows ``r..``), stopping where the choice
        finishes; every token after the first was computed at its position as a draft
        this step, so its K/V is already in the cache (``Scheduler.accept_draft``)."""
        new, texts = [], []
        for j, token in enumerate(tokens):
            if j:
                self.scheduler.accept_draft(seq)
            out = self.append_token(seq, token, lp_lists, r + j, now)
            new += out.new_token_ids
            if out.text:
                texts.append(out.text)
            if seq.is_finished():
                break
        return SequenceOutput(seq.request, seq.index, seq, new, "".join(texts) if texts else None)

    def _sequence_finished(self, seq: EngineSequence) -> None:
        for hook in self.hooks.on_finished:
            hook(seq)
        self.scheduler.remove(seq)
        if seq.request.is_finished():
            self.forget_request(seq.request)
