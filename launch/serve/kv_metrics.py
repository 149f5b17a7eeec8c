"""The KV connector's figures on GET /metrics (P/D): bytes and seconds of transfers (a
histogram), failed transfers and expired leases, from the engine's counters in the health
report (engine_core/kv_connector/stats.py). Absent on an engine without --kv-transfer-config."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from engine_core.kv_connector.stats import histogram_buckets

if TYPE_CHECKING:
    from protocol.messages import HealthReport

_COUNTERS = {
    "kv_transfer_bytes": "Bytes of KV pulled from prefill engines, over every rank",
    "kv_transfers": "KV transfers every rank finished",
    "kv_transfer_failed": "KV transfers that failed or were given up",
    "kv_transfer_timeouts": "KV transfers given up after kv_transfer_timeout_s",
    "kv_lease_refused": "KV transfers whose lease the prefill engine refused (unknown, guessed "
                        "or ended key, blocks outside the lease)",
    "kv_loaded_tokens": "Prompt tokens whose KV was pulled instead of computed",
    "kv_leases": "Leases granted on finished prefills",
    "kv_leases_expired": "Leases that ran out before the decode engine was done",
}
_GAUGES = {
    "kv_leases_active": "Prefill blocks held for decode engines now (leases)",
    "kv_waiting_for_remote_kvs": "Requests waiting for their KV to arrive",
}


class KVConnectorCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.report: HealthReport | None = None  # the last scrape's

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily
                                  | HistogramMetricFamily]:
        stats = self.report.stats if self.report is not None else {}
        if "kv_transfers" not in stats:
            return
        labels = ["model_name"]
        for key, doc in _COUNTERS.items():
            c = CounterMetricFamily(f"tandem:{key}", doc, labels=labels)
            c.add_metric([self.model_name], stats.get(key, 0.0))
            yield c
        for key, doc in _GAUGES.items():
            g = GaugeMetricFamily(f"tandem:{key}", doc, labels=labels)
            g.add_metric([self.model_name], stats.get(key, 0.0))
            yield g
        h = HistogramMetricFamily("tandem:kv_transfer_seconds",
                                  "Time of a KV transfer (its slowest rank)", labels=labels)
        buckets = [(str(le), count) for le, count in histogram_buckets(stats)]
        buckets.append(("+Inf", stats.get("kv_transfers", 0.0)))
        h.add_metric([self.model_name], buckets, stats.get("kv_transfer_seconds_sum", 0.0))
        yield h
