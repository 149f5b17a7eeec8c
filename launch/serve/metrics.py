"""GET /metrics: Prometheus text (prometheus_client), with vLLM's metric names under `tandem:`.

Latency histograms and token counters are fed by the frontend as outputs arrive (engine
timestamps); the running/waiting/KV gauges come from the engine core's health report, fetched
when the metrics are scraped.

Every metric carries one label value, the base model's served name, also for requests that
ran with a LoRA adapter: adapters come and go at run time, and a label per adapter would grow
the label sets without bound. The adapter slots are engine-wide gauges.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from launch.serve.kv_metrics import KVConnectorCollector
from launch.serve.vllm_metrics import VLLMMetrics

if TYPE_CHECKING:
    from protocol.messages import HealthReport

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)

_CONTINUUM_STATS = {
    "continuum_pinned_blocks": "KV blocks held by pins of finished agent turns",
    "continuum_pin_hits": "Pins claimed by the job's next turn (total)",
    "continuum_pin_expiries": "Pins released when their TTL ran out (total)",
    "continuum_pressure_releases": "Pins released to make room (total)",
    "continuum_tokens_saved": "Prompt tokens a claimed pin spared a prefill (total)",
}

# the LoRA adapter slots (engine totals from the health report; absent without --enable-lora)
_LORA_STATS = {
    "lora_max_loras": "Device slots for LoRA adapters (--max-loras)",
    "lora_slots_used": "Slots holding an adapter",
    "lora_running_adapters": "Adapters of running requests (at most --max-loras)",
    "lora_loads": "Adapters loaded into a slot (total)",
    "lora_evictions": "Adapters evicted from a slot for another (total)",
    "lora_skips": "Admission passes that skipped a request for want of a slot (total)",
}

# images: the encoder-output cache and the encoder's time (absent for text-only models)
_ENCODER_STATS = {
    "encoder_cache_usage": "Fraction of the encoder cache (--encoder-cache-size) in use",
    "encoder_cache_entries": "Encoder outputs cached",
    "encoder_cache_hits": "Images whose cached encoder output was read (total)",
    "encoder_cache_misses": "Images the encoder ran on (total)",
    "encoder_cache_evictions": "Encoder outputs evicted for room (total)",
    "encoder_seconds": "Rank 0's time in the vision encoder (total)",
}


class ServerMetrics:
    """Every metric of one server, in its own registry (several apps can share a process)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("tandem:num_requests_running", "Requests in the engine's running set",
                             labels, registry=r)
        self.waiting = Gauge("tandem:num_requests_waiting", "Requests waiting to be scheduled",
                             labels, registry=r)
        self.kv_usage = Gauge("tandem:kv_cache_usage_perc",
                              "Fraction of KV cache blocks in use (1 = full)", labels, registry=r)
        self.in_flight = Gauge("tandem:num_requests_in_flight_http",
                               "Engine requests the HTTP frontend is waiting on", labels,
                               registry=r)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Time between output tokens",
                             labels, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Arrival to finish",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens of finished requests",
                                     labels, registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Generated tokens",
                                         labels, registry=r)
        self.finished = Counter("tandem:request_success", "Finished requests by finish reason",
                                labels + ["finished_reason"], registry=r)
        self.client_aborts = Counter("tandem:request_aborted_by_client",
                                     "Engine requests aborted because the HTTP client left",
                                     labels, registry=r)
        self.refused = Counter("tandem:request_refused_queue_full",
                               "Requests answered 503 because max_queued_requests were waiting",
                               labels, registry=r)
        # the continuum policy's pins (engine totals from the health report; absent otherwise)
        self.continuum = {
            key: Gauge(f"tandem:{key}", doc, labels, registry=r)
            for key, doc in _CONTINUUM_STATS.items()
        }
        self.lora = {
            key: Gauge(f"tandem:{key}", doc, labels, registry=r) for key, doc in _LORA_STATS.items()
        }
        self.encoder = {
            key: Gauge(f"tandem:{key}", doc, labels, registry=r)
            for key, doc in _ENCODER_STATS.items()
        }
        self._labels = {"model_name": model_name}
        self._ttft = self.ttft.labels(**self._labels)
        self._itl = self.itl.labels(**self._labels)
        self._e2e = self.e2e.labels(**self._labels)
        self._gen = self.generation_tokens.labels(**self._labels)
        self._prompt = self.prompt_tokens.labels(**self._labels)
        self._gone = self.client_aborts.labels(**self._labels)  # exported from 0 on
        self.kv_connector = KVConnectorCollector(model_name)  # P/D transfers and leases
        r.register(self.kv_connector)
        self._refused = self.refused.labels(**self._labels)
        # the same figures under vLLM's names, for routers and dashboards of a vLLM fleet
        self.vllm = VLLMMetrics(r, model_name)

    def on_tokens(self, n: int, ts: float, arrival: float, last_token_ts: float | None) -> None:
        """n tokens of one choice arrived at ts; last_token_ts: the choice's previous tokens
        (None: these are its first)."""
        if last_token_ts is None:
            self._ttft.observe(max(0.0, ts - arrival))
            self.vllm.on_first_token(max(0.0, ts - arrival))
        else:
            gap = max(0.0, ts - last_token_ts) / n  # speculative steps bring several at once
            for _ in range(n):
                self._itl.observe(gap)
            self.vllm.on_gap(gap, n)
        self._gen.inc(n)
        self.vllm.generation_tokens.inc(n)

    def on_finish(self, ts: float, arrival: float, prompt_tokens: int,
                  finish_reason: str | None) -> None:
        """A choice finished; prompt_tokens is counted once per request (0 for its other
        choices)."""
        self._e2e.observe(max(0.0, ts - arrival))
        self.vllm.e2e.observe(max(0.0, ts - arrival))
        if prompt_tokens:
            self._prompt.inc(prompt_tokens)
            self.vllm.prompt_tokens.inc(prompt_tokens)
        self.finished.labels(finished_reason=finish_reason or "unknown", **self._labels).inc()

    def on_client_gone(self, n: int) -> None:
        self._gone.inc(n)

    def on_refused(self) -> None:
        self._refused.inc()

    def num_label_sets(self) -> int:
        """Label sets across every metric (the census: bounded by the finish reasons)."""
        seen = set()
        for family in self.registry.collect():
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
                seen.add((family.name, labels))
        return len(seen)

    def render(self, report: HealthReport | None, in_flight: int) -> bytes:
        if report is not None:
            self.kv_connector.report = report
            self.running.labels(**self._labels).set(report.num_running)
            self.waiting.labels(**self._labels).set(report.num_waiting)
            self.kv_usage.labels(**self._labels).set(report.kv_usage)
            self.vllm.on_report(report)
            for key, gauge in (self.continuum | self.lora | self.encoder).items():
                if key in report.stats:
                    gauge.labels(**self._labels).set(report.stats[key])
        self.in_flight.labels(**self._labels).set(in_flight)
        return generate_latest(self.registry)
