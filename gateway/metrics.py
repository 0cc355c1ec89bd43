"""Prometheus metrics under vLLM's names, measured at the gateway.

Request timings (TTFT, inter-token latency, end-to-end, queue time) and token counters
are observed here as deltas pass by; scheduler gauges (running/waiting, KV cache usage)
come from the worker loads the broker reports, refreshed on each scrape.  Each app gets
its own CollectorRegistry so several apps can live in one process (tests).
"""
from __future__ import annotations

import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.protocol import ClusterInfo, CompletionDelta

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class BrokerCollector:
    """The broker's view, as of the last cluster answer: live workers, the dispatch
    queue and its cumulative counters (every gateway exports the same broker values;
    dashboards take the max across gateways)."""

    _COUNTERS = (
        ("dispatched", "tokserve:broker_requests_dispatched", "Requests the broker sent to workers."),
        ("redispatched", "tokserve:broker_requests_redispatched", "Unstarted requests moved off a dead worker."),
        ("failed_worker_death", "tokserve:broker_requests_failed_worker_death",
         "Started requests that failed because their worker died."),
        ("rejected_overloaded", "tokserve:broker_requests_rejected_overloaded",
         "Requests refused with 503: no worker, or the dispatch queue full."),
        ("workers_removed", "tokserve:broker_workers_removed", "Workers dropped (missed heartbeats, disconnects)."),
        ("prefix_routed", "tokserve:broker_requests_prefix_routed",
         "Requests sent to a worker for the prompt prefix it has cached (cache-aware routing)."),
        ("outputs_foreign_dropped", "tokserve:broker_outputs_foreign_dropped",
         "Outputs or errors a worker sent for a request not dispatched to it (dropped, never reach the client)."),
        ("workers_refused", "tokserve:broker_workers_refused",
         "Worker registrations refused for a missing or wrong worker token."),
        ("control_refused", "tokserve:broker_control_refused",
         "Control commands refused for a missing or wrong control token."),
    )

    def __init__(self) -> None:
        self.info: Optional[ClusterInfo] = None
        self.fetched_at = 0.0  # wall clock of ``info``
        self.model_name = ""  # the served model name (vLLM's model_name label)

    def describe(self):
        return []  # values only exist once the broker answered

    def collect(self):
        info = self.info
        if info is None:
            return
        live = GaugeMetricFamily("tokserve:broker_live_workers", "Workers registered and alive at the broker.")
        live.add_metric([], sum(1 for w in info.workers if w.alive))
        yield live
        pending = GaugeMetricFamily("tokserve:broker_pending_requests",
                                    "Requests queued in the broker, waiting for worker capacity.")
        pending.add_metric([], info.pending)
        yield pending
        received = CounterMetricFamily("tokserve:worker_requests_received",
                                       "Requests each worker has received (its last load report).", labels=["engine"])
        for w in info.workers:
            received.add_metric([str(w.rank)], w.load.num_received)
        yield received
        # vLLM's scheduler counter (recompute preemptions), per engine as its other counters.
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                          labels=["model_name", "engine"])
        for w in info.workers:
            preemptions.add_metric([self.model_name, str(w.rank)], w.load.num_preemptions)
        yield preemptions
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters", "engine"])
        for w in info.workers:
            if w.load.max_loras:  # a worker serving LoRA; the value is when it was reported, as in vLLM
                lora.add_metric([str(w.load.max_loras), ",".join(w.load.waiting_loras),
                                 ",".join(w.load.running_loras), str(w.rank)], self.fetched_at)
        if lora.samples:
            yield lora
        if any(w.load.mm_cache_queries for w in info.workers):  # image models only, as vLLM
            queries = CounterMetricFamily("vllm:mm_cache_queries",
                                          "Multi-modal cache queries, in terms of number of queried items.",
                                          labels=["model_name", "engine"])
            hits = CounterMetricFamily("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached "
                                       "items.", labels=["model_name", "engine"])
            for w in info.workers:
                queries.add_metric([self.model_name, str(w.rank)], w.load.mm_cache_queries)
                hits.add_metric([self.model_name, str(w.rank)], w.load.mm_cache_hits)
            yield queries
            yield hits
        if info.workers:
            yield self._sleep_state(info)
        stats = info.stats
        if stats is not None:
            for field, name, doc in self._COUNTERS:
                c = CounterMetricFamily(name, doc)
                c.add_metric([], getattr(stats, field))
                yield c

    def _sleep_state(self, info: ClusterInfo) -> GaugeMetricFamily:
        """vLLM's ``record_sleep_state``: awake 1 until a /sleep; asleep, weights_offloaded
        marks level 1 and discard_all level 2 (level 0, a paused scheduler, sets neither)."""
        gauge = GaugeMetricFamily("vllm:engine_sleep_state", _SLEEP_STATE_DOC,
                                  labels=["model_name", "engine", "sleep_state"])
        for w in info.workers:
            level = w.load.sleep_level
            values = {"awake": int(level < 0), "weights_offloaded": int(level == 1), "discard_all": int(level == 2)}
            for state in ("awake", "weights_offloaded", "discard_all"):
                gauge.add_metric([self.model_name, str(w.rank), state], values[state])
        return gauge


_SLEEP_STATE_DOC = ("Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
                    "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        req = ["model_name"]
        eng = ["model_name", "engine"]
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", eng,
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", eng,
                             registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", eng,
                              registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", req, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", req,
                                         registry=r)
        self.cached_tokens = Counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens.", req,
                                     registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               req + ["finished_reason"], registry=r)
        self.failures = Counter("tokserve:request_errors", "Requests that ended with an error response.",
                                req + ["status"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              req, buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             req, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             req, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", req,
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.req_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                           req, buckets=_TOKEN_BUCKETS, registry=r)
        self.req_gen_tokens = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                        req, buckets=_TOKEN_BUCKETS, registry=r)
        self.in_flight = Gauge("tokserve:gateway_requests_in_flight", "Requests this gateway is serving.",
                               registry=r)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", req,
                                   registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", req,
                                         registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", req,
                                     registry=r)
        self.spec_accepted_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted tokens per draft position.", req + ["position"], registry=r)
        self.broker = BrokerCollector()
        r.register(self.broker)

    def update_cluster(self, info: Optional[ClusterInfo], model_name: str) -> None:
        self.broker.info, self.broker.fetched_at, self.broker.model_name = info, time.time(), model_name
        for w in info.workers if info is not None else ():
            labels = (model_name, str(w.rank))
            self.running.labels(*labels).set(w.load.running if w.alive else 0)
            self.waiting.labels(*labels).set(w.load.waiting if w.alive else 0)
            total = w.load.total_kv_blocks
            self.kv_usage.labels(*labels).set(1.0 - w.load.free_kv_blocks / total if total else 0.0)

    def observe_spec_decode(self, model_name: str, stats) -> None:
        """A finished request's speculation counts (vLLM's SpecDecodingProm)."""
        hist = stats.histogram
        self.spec_drafts.labels(model_name).inc(sum(hist))
        self.spec_draft_tokens.labels(model_name).inc(stats.num_draft_tokens)
        self.spec_accepted.labels(model_name).inc(sum(j * c for j, c in enumerate(hist)))
        for pos in range(stats.num_spec_tokens):  # steps that accepted more than pos drafts
            self.spec_accepted_pos.labels(model_name, str(pos)).inc(sum(hist[pos + 1:]))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def tracker(self, model_name: str, num_prompt_tokens: int, arrival_time: float) -> "RequestTracker":
        return RequestTracker(self, model_name, num_prompt_tokens, arrival_time)


class RequestTracker:
    """Per-request timing as its deltas arrive (perf_counter, gateway-side)."""

    __slots__ = ("m", "model", "start", "last", "generated", "num_prompt", "reason", "first_delta", "done", "arrival", "itl")

    def __init__(self, metrics: GatewayMetrics, model_name: str, num_prompt_tokens: int, arrival_time: float):
        self.m, self.model = metrics, model_name
        self.arrival = arrival_time  # wall clock, comparable with the worker's timestamps
        self.start = time.perf_counter()
        self.last: Optional[float] = None
        self.generated = 0
        self.num_prompt = num_prompt_tokens
        self.reason: Optional[str] = None
        self.first_delta: Optional[CompletionDelta] = None
        self.done = False
        self.itl = metrics.itl.labels(model_name)  # resolved once: observed on every token
        metrics.in_flight.inc()

    def observe(self, delta: CompletionDelta) -> None:
        if self.first_delta is None:
            self.first_delta = delta
        if delta.token_ids:
            now = time.perf_counter()
            if self.last is None:
                self.m.ttft.labels(self.model).observe(now - self.start)
            else:
                self.itl.observe(now - self.last)
            self.last = now
            self.generated += len(delta.token_ids)
        if delta.finish_reason is not None:
            self.reason = delta.finish_reason
        if delta.spec_decode is not None:
            self.m.observe_spec_decode(self.model, delta.spec_decode)

    def finish(self, error_status: Optional[int] = None) -> None:
        """Record the outcome once: success with its finish reason, or an error status."""
        if self.done:
            return
        self.done = True
        m, model = self.m, self.model
        m.in_flight.dec()
        if error_status is not None:
            m.failures.labels(model, str(error_status)).inc()
            return
        first = self.first_delta
        num_prompt = (first.num_prompt_tokens if first and first.num_prompt_tokens else self.num_prompt)
        m.e2e.labels(model).observe(time.perf_counter() - self.start)
        m.prompt_tokens.labels(model).inc(num_prompt)
        m.generation_tokens.labels(model).inc(self.generated)
        m.req_prompt_tokens.labels(model).observe(num_prompt)
        m.req_gen_tokens.labels(model).observe(self.generated)
        if first is not None:
            m.cached_tokens.labels(model).inc(first.num_cached_tokens)
            if first.first_scheduled_time:
                m.queue_time.labels(model).observe(max(0.0, first.first_scheduled_time - self.arrival))
        m.success.labels(model, self.reason or "stop").inc()
