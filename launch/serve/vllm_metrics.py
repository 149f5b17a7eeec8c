"""vLLM's own metric names on GET /metrics, beside Tandem's ``tandem:`` ones.

A router or dashboard built for a vLLM fleet reads ``vllm:`` lines: vllm-router counts a P/D
server's engines by their ``engine="N"`` label and schedules by ``num_requests_running``,
``num_requests_waiting`` and ``kv_cache_usage_perc``. The names, types, label names and
histogram buckets are vLLM v1's (vllm/v1/metrics/loggers.py), for the figures both engines have.
One engine core per server: ``engine="0"``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from protocol.messages import HealthReport

_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
# time_per_output_token and inter_token_latency share these
_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
_LABELS = ["model_name", "engine"]


class _PrefixCacheCollector(Collector):
    """The engine's prefix-cache token counters (queried, hit), as of the last scrape's report:
    counters owned by the engine core, so exported as families rather than incremented here."""

    def __init__(self, labels: list[str]) -> None:
        self.labels = labels
        self.stats: dict[str, float] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        for key, doc in (("prefix_cache_queries", "Prefix cache queries, in terms of tokens"),
                         ("prefix_cache_hits", "Prefix cache hits, in terms of tokens")):
            c = CounterMetricFamily(f"vllm:{key}", doc, labels=_LABELS)
            c.add_metric(self.labels, self.stats.get(key, 0.0))
            yield c


class VLLMMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        r = registry
        lv = {"model_name": model_name, "engine": "0"}
        self.running = Gauge("vllm:num_requests_running",
                             "Number of requests in model execution batches.", _LABELS,
                             registry=r).labels(**lv)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be "
                             "processed.", _LABELS, registry=r).labels(**lv)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.", _LABELS,
                              registry=r).labels(**lv)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     _LABELS, registry=r).labels(**lv)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.", _LABELS,
                                         registry=r).labels(**lv)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", _LABELS,
                              buckets=_TTFT_BUCKETS, registry=r).labels(**lv)
        # vLLM >= 0.11 names the per-token gap inter_token_latency and keeps the older name
        # time_per_output_token for the same observations
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", _LABELS,
                              buckets=_TPOT_BUCKETS, registry=r).labels(**lv)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", _LABELS,
                             buckets=_TPOT_BUCKETS, registry=r).labels(**lv)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", _LABELS,
                             buckets=_E2E_BUCKETS, registry=r).labels(**lv)
        self.prefix = _PrefixCacheCollector([model_name, "0"])
        r.register(self.prefix)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_gap(self, gap_s: float, n: int) -> None:
        for _ in range(n):
            self.tpot.observe(gap_s)
            self.itl.observe(gap_s)

    def on_report(self, report: HealthReport) -> None:
        self.running.set(report.num_running)
        self.waiting.set(report.num_waiting)
        self.kv_usage.set(report.kv_usage)
        self.prefix.stats = report.stats
