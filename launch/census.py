"""The census of every process: the sizes of the maps and lists that grow with client input.

Each process has one function that returns {map: size} (launch/client.py EngineClient.census,
launch/serve/census.py for the HTTP frontend, engine_core/census.py, workers/census.py); the
engine core's health report carries its own and every rank's. Here they are put together as
{"frontend": {...}, "engine_core": {...}, "rank0": {...}, ...}.

Per-request maps are freed with their request, so on an idle engine they are all 0 (what the
tests and scripts/overload.py check); the names in BOUNDED outlive requests under a bound
(README, "Bounds: what grows with client input").
"""

from __future__ import annotations

import re

from engine_core.census import BOUNDED as CORE_BOUNDED
from protocol.messages import HealthReport
from workers.census import BOUNDED as RANK_BOUNDED

# the frontend's bounded maps: the serve metrics' label sets (a fixed set of names and finish
# reasons) and the frontend's compiled-grammar cache (its own budget)
FRONTEND_BOUNDED = {
    "serve.metric_label_sets": "metric names x finish reasons (stop, length, abort, error)",
    "serve.grammar_cache": "--structured-outputs-cache-mb (least recently used unheld first)",
}

Census = dict[str, dict[str, int]]

_RANK = re.compile(r"^rank(\d+)\.(.+)$")


def assemble(frontend: dict[str, int], report: HealthReport) -> Census:
    """Per process: the frontend's sizes, the core's, and each rank's (from the report)."""
    out: Census = {"frontend": dict(frontend), "engine_core": {}}
    for name, size in report.census.items():
        m = _RANK.match(name)
        if m is None:
            out["engine_core"][name] = size
        else:
            out.setdefault(f"rank{m.group(1)}", {})[m.group(2)] = size
    return out


def is_bounded(process: str, name: str) -> bool:
    if process == "frontend":
        return name in FRONTEND_BOUNDED
    if process == "engine_core":
        return name in CORE_BOUNDED
    return name in RANK_BOUNDED


def per_request(census: Census) -> Census:
    """Only the maps that must be empty on an idle engine."""
    return {proc: {k: v for k, v in sizes.items() if not is_bounded(proc, k)}
            for proc, sizes in census.items()}


def leftovers(census: Census) -> dict[str, int]:
    """The per-request maps that are not empty, as "process.map": size (none when idle)."""
    return {f"{proc}.{k}": v for proc, sizes in per_request(census).items()
            for k, v in sizes.items() if v}
