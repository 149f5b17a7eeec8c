"""The connector's counters, and the transfer-time histogram, as the flat float dict the health
report carries (``/metrics`` turns the ``kv_transfer_seconds_bucket:<le>`` keys back into a
Prometheus histogram: launch/serve/kv_metrics.py)."""

from __future__ import annotations

import bisect

# seconds; cumulative buckets as Prometheus counts them (le = less than or equal)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)
BUCKET_PREFIX = "kv_transfer_seconds_bucket:"


class ConnectorStats:
    def __init__(self) -> None:
        self.transfers = 0  # loads every rank finished
        self.transfer_bytes = 0  # over every rank
        self.transfer_seconds = 0.0  # sum of the loads' times (slowest rank of each)
        self.loaded_tokens = 0  # prompt tokens this engine pulled instead of computing
        self.failed = 0  # loads that failed on some rank (or were given up)
        self.timeouts = 0  # of those, given up after kv_transfer_timeout_s
        # ... whose lease the prefill engine refused (unknown or guessed key, ended lease,
        # blocks outside it); the failure policy applied to them as to any failed load
        self.lease_refused = 0
        self.leases = 0  # prefill side: leases granted
        self.leases_expired = 0  # ... that ran out before the decode side was done
        self.leases_released = 0  # ... that the decode side ended
        self._counts = [0] * (len(TRANSFER_BUCKETS) + 1)  # the last one is +Inf

    def on_transfer(self, seconds: float, nbytes: int, tokens: int) -> None:
        self.transfers += 1
        self.transfer_bytes += nbytes
        self.transfer_seconds += seconds
        self.loaded_tokens += tokens
        self._counts[bisect.bisect_left(TRANSFER_BUCKETS, seconds)] += 1

    def as_dict(self, waiting: int, loading: int, active_leases: int) -> dict[str, float]:
        out = {
            "kv_transfers": float(self.transfers),
            "kv_transfer_bytes": float(self.transfer_bytes),
            "kv_transfer_seconds_sum": self.transfer_seconds,
            "kv_transfer_seconds_count": float(self.transfers),
            "kv_loaded_tokens": float(self.loaded_tokens),
            "kv_transfer_failed": float(self.failed),
            "kv_transfer_timeouts": float(self.timeouts),
            "kv_lease_refused": float(self.lease_refused),
            "kv_leases": float(self.leases),
            "kv_leases_expired": float(self.leases_expired),
            "kv_leases_released": float(self.leases_released),
            "kv_leases_active": float(active_leases),
            "kv_waiting_for_remote_kvs": float(waiting),
            "kv_loads_in_flight": float(loading),
        }
        total = 0
        for le, n in zip(TRANSFER_BUCKETS, self._counts, strict=False):
            total += n
            out[f"{BUCKET_PREFIX}{le}"] = float(total)
        return out


def histogram_buckets(stats: dict[str, float]) -> list[tuple[float, float]]:
    """(le, cumulative count) pairs found in a stats dict, ascending."""
    out = []
    for key, value in stats.items():
        if key.startswith(BUCKET_PREFIX):
            out.append((float(key[len(BUCKET_PREFIX):]), value))
    return sorted(out)
