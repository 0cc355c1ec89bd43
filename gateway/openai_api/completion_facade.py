"""``/v1/completions`` responses from the workers' deltas (vLLM 0.32's
``completion_full_generator`` / ``completion_stream_generator``): one generation per
prompt, choice ``index = prompt * n + choice``, ``echo`` prepending the prompt (and its
logprobs), completion logprobs in OpenAI's parallel-list shape.  ``CompletionCollector`` and ``CompletionStream``
are the relay's formatters (gateway/relay.py)."""
from __future__ import annotations

import functools
from typing import Optional

import msgspec

from common.protocol import CompletionDelta, TokenLogprobs
from gateway.generate_api import logprobs_format
from gateway.openai_api.facade import ResponseView, now, request_metrics
from gateway.openai_api.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    json_encoder,
    prompt_tokens_details,
)
from gateway.openai_api.sampling import sent
from gateway.openai_api.render import RenderedPrompt
from gateway.generate_api.response_builder import routed_experts_b64, stream_metrics
from gateway.relay import Generation, StreamFormatter, sse_event


def completion_logprobs(entries: list, text_offset: int = 0) -> CompletionLogProbs:
    """Chat-shaped entries (token, logprob, top_logprobs) -> OpenAI completion logprobs.
    ``None`` entries are positions without a logprob (the first prompt token)."""
    out = CompletionLogProbs()
    for entry in entries:
        out.text_offset.append(text_offset)
        if isinstance(entry, str):  # a prompt token with no logprob: its text only
            out.tokens.append(entry)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            text_offset += len(entry)
            continue
        out.tokens.append(entry.token)
        out.token_logprobs.append(entry.logprob)
        out.top_logprobs.append({t.token: t.logprob for t in entry.top_logprobs} if entry.top_logprobs else None)
        text_offset += len(entry.token)
    return out


def _num_entries(k: int) -> int:
    """Completions report the top k + 1 candidates (OpenAI's definition, as vLLM)."""
    return -1 if k == -1 else k + 1


def output_entries(lp: Optional[TokenLogprobs], k: Optional[int], as_token_ids: bool = False) -> list:
    if k is None or lp is None:
        return []
    return logprobs_format.text_logprobs(lp, _num_entries(k), as_token_ids)


class _Prompt:
    """One prompt's echo material: its text and, with logprobs, its logprob entries."""

    def __init__(self, rendered: RenderedPrompt, tokenizer, view: ResponseView):
        self.rendered = rendered
        self.entries: Optional[list] = None
        self.tokenizer = tokenizer
        self.view = view
        self.num_tokens = len(rendered.token_ids)
        self.prompt_logprobs = None  # vLLM's per-choice prompt_logprobs ([None, {id: Logprob}, ...])
        self.num_cached_tokens: Optional[int] = None

    @functools.cached_property
    def text(self) -> str:
        """Echo only; decoded on first use (the formatter is built before the first delta)."""
        r = self.rendered
        return r.prompt_text if r.prompt_text is not None else self.tokenizer.decode(r.token_ids)

    def observe_first(self, delta: CompletionDelta) -> None:
        if delta.num_prompt_tokens:
            self.num_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = logprobs_format.prompt_logprobs(
                delta.prompt_logprobs, sent(self.rendered.request.sampling_params.prompt_logprobs))
        if self.entries is None and self.view.echo and self.view.top_logprobs is not None:
            ids = self.rendered.token_ids[:1]
            if self.view.tokens_as_token_ids and ids:
                first = logprobs_format.token_id_placeholder(ids[0])
            else:
                first = self.tokenizer.decode(ids, skip_special_tokens=False)
            self.entries = [first] + output_entries(delta.prompt_logprobs, self.view.top_logprobs,
                                                    self.view.tokens_as_token_ids)


class CompletionCollector:
    """Non-stream (the relay's ``BodyFormatter``): every choice of every prompt, then the Completion."""

    def __init__(self, runs: list[Generation], view: ResponseView, rendered: list[RenderedPrompt], tokenizer,
                 model: str):
        self.runs, self.view, self.rendered, self.model = runs, view, rendered, model
        self.prompts = [_Prompt(r, tokenizer, view) for r in rendered]
        total = len(runs) * view.n
        self.texts = [[] for _ in range(total)]
        self.ids: list[list[int]] = [[] for _ in range(total)]
        self.entries: list[list] = [[] for _ in range(total)]
        self.finish: list = [None] * total
        self.stop: list = [None] * total
        self.routed: list[Optional[str]] = [None] * total
        self.transfer: dict[str, object] = {}  # vLLM answers with the first prompt's kv/ec_transfer_params

    def add(self, delta: CompletionDelta, run: int = 0) -> None:
        view, p = self.view, run
        self.prompts[p].observe_first(delta)
        if p == 0:
            for name in ("kv_transfer_params", "ec_transfer_params"):
                if getattr(delta, name) is not None:
                    self.transfer[name] = getattr(delta, name)
        i = p * view.n + delta.index
        self.ids[i].extend(delta.token_ids)
        if delta.text:
            self.texts[i].append(delta.text)
        self.entries[i].extend(output_entries(delta.logprobs, view.top_logprobs, view.tokens_as_token_ids))
        if view.routed_experts and delta.routed_experts is not None:  # on the finishing delta
            self.routed[i] = routed_experts_b64(delta)
        if delta.finish_reason is not None:
            self.finish[i], self.stop[i] = delta.finish_reason, delta.stop_reason

    def body(self) -> bytes:
        view, n, prompts = self.view, self.view.n, self.prompts
        choices = []
        for i in range(len(self.ids)):
            prompt = prompts[i // n]
            text = "".join(self.texts[i])
            lp_entries = self.entries[i]
            if view.echo:
                text = prompt.text + text
                lp_entries = (prompt.entries or []) + lp_entries
            choices.append(CompletionChoice(
                index=i, text=text,
                logprobs=completion_logprobs(lp_entries) if view.top_logprobs is not None else None,
                finish_reason=self.finish[i] or "stop", stop_reason=self.stop[i],
                token_ids=self.ids[i] if view.return_token_ids else None,
                prompt_logprobs=prompt.prompt_logprobs,
                prompt_token_ids=prompt.rendered.token_ids if view.return_token_ids else None,
                routed_experts=self.routed[i]))
        num_prompt = sum(p.num_tokens for p in prompts)
        completion = sum(len(x) for x in self.ids)
        body = CompletionResponse(
            id=self.rendered[0].request.request_id, created=now(), model=self.model, choices=choices,
            usage=UsageInfo(prompt_tokens=num_prompt, total_tokens=num_prompt + completion,
                            completion_tokens=completion,
                            # vLLM reads the last prompt's result
                            prompt_tokens_details=prompt_tokens_details(
                                view.prompt_tokens_details, prompts[-1].num_cached_tokens, stream=False)),
            metrics=request_metrics(self.runs, view, completion), **self.transfer)
        return json_encoder.encode(body)


class CompletionStream(StreamFormatter):
    """Stream (the relay's ``StreamFormatter``): a chunk per delta of any prompt, then the usage chunk."""

    def __init__(self, runs: list[Generation], view: ResponseView, rendered: list[RenderedPrompt], tokenizer,
                 model: str):
        self.runs, self.view, self.model = runs, view, model
        self.request_id, self.created = rendered[0].request.request_id, 0
        self.prompts = [_Prompt(r, tokenizer, view) for r in rendered]
        total = len(runs) * view.n
        self.echoed = [False] * total
        self.num_cached_tokens: Optional[int] = None  # vLLM reads the first result's, whichever prompt
        self.generated = [0] * total
        self.offsets = [0] * total

    def head(self) -> tuple:
        self.created = now()
        return ()

    def chunk(self, delta: CompletionDelta, run: int = 0) -> Optional[bytes]:
        view = self.view
        prompt = self.prompts[run]
        prompt.observe_first(delta)
        if self.num_cached_tokens is None:
            self.num_cached_tokens = delta.num_cached_tokens
        i = run * view.n + delta.index
        text = delta.text or ""
        out_entries = output_entries(delta.logprobs, view.top_logprobs, view.tokens_as_token_ids)
        prompt_ids = msgspec.UNSET
        if not self.echoed[i] and (view.echo or view.return_token_ids):
            self.echoed[i] = True
            prompt_ids = prompt.rendered.token_ids if view.return_token_ids else msgspec.UNSET
            if view.echo:
                text = prompt.text + text
                out_entries = (prompt.entries or []) + out_entries
        elif not text and not delta.token_ids and delta.finish_reason is None:
            return None
        logprobs = None
        if view.top_logprobs is not None:
            logprobs = completion_logprobs(out_entries, self.offsets[i])
            if logprobs.tokens:
                self.offsets[i] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        self.generated[i] += len(delta.token_ids)
        usage = msgspec.UNSET
        if view.continuous_usage:
            usage = UsageInfo(prompt_tokens=prompt.num_tokens, completion_tokens=self.generated[i],
                              total_tokens=prompt.num_tokens + self.generated[i])
        choice = CompletionStreamChoice(
            index=i, text=text, logprobs=logprobs, finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
            prompt_token_ids=prompt_ids, token_ids=delta.token_ids if view.return_token_ids else msgspec.UNSET)
        return sse_event(json_encoder.encode(CompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[choice], usage=usage)))

    def final(self) -> Optional[bytes]:
        if not self.view.include_usage:
            return None
        num_prompt = sum(p.num_tokens for p in self.prompts)
        completion = sum(self.generated)
        usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=completion, total_tokens=num_prompt + completion,
                          prompt_tokens_details=prompt_tokens_details(self.view.prompt_tokens_details,
                                                                      self.num_cached_tokens, stream=True),
                          completion_tokens_details=msgspec.UNSET)
        return sse_event(json_encoder.encode(CompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage,
            metrics=stream_metrics(request_metrics(self.runs, self.view, completion)))))
