"""Tool-call gaps (a turn's finish to the next turn's arrival), learned online, and the TTL
rule that weighs keeping a finished turn's KV pinned against losing it.

Let G be the gap before the job's next turn (its distribution: the observed gaps of the same
tool, else of the same job, else of every job), C the cost of losing the pin (recomputing the
context's n tokens, n * c_prefill; or restoring it from the host tier, a share r of that) and
M the price of holding the pin's blocks (the context's n / block_size blocks) for one second.
Pinning for a TTL t gains C when the job returns within t and pays M for min(G, t) seconds:

    B(t) = C * P(G <= t) - M * E[min(G, t)]

M is priced as "holding a context for HOLD_HORIZON_S seconds on a full pool costs as much as
recomputing it", scaled by how full the pool is (u = device KV usage): M = u * n * c_prefill /
HOLD_HORIZON_S. Both terms carry n * c_prefill, so the rule divides it out:

    B(t) / (n * c_prefill) = r * P(G <= t) - u * E[min(G, t)] / HOLD_HORIZON_S

with r = 1 without the host tier. The TTL is the candidate t (each observed gap plus a margin,
up to the cap) that maximizes B; when no candidate has B > 0 the turn is not pinned. With fewer
than MIN_SAMPLES gaps anywhere the cold-start TTL applies.
"""

from __future__ import annotations

import bisect
from collections import deque

COLD_START_TTL_S = 2.0
MIN_SAMPLES = 3  # gaps a scope needs before its distribution is trusted
WINDOW = 64  # recent gaps kept per tool and per job: tools change behaviour over time
GLOBAL_WINDOW = 256
HOLD_HORIZON_S = 10.0
GAP_MARGIN = 1.2  # a TTL candidate sits this much above an observed gap (arrival jitter)
MAX_SCOPES = 4096  # tools and jobs remembered (oldest forgotten first)
# restoring a context from the host tier, as a share of recomputing it (a copy of the blocks
# over the host link against a prefill; both measured per step elsewhere, this is the ratio)
HOST_RESTORE_COST_RATIO = 0.2


def best_ttl(gaps: list[float], loss_ratio: float, usage: float, max_ttl: float) -> float:
    """argmax_t B(t) over the candidates (sorted ``gaps``); 0.0 when pinning cannot pay."""
    n = len(gaps)
    best_t, best_b = 0.0, 0.0
    below = 0.0  # sum of the gaps <= t
    for i, g in enumerate(gaps):
        t = min(g * GAP_MARGIN, max_ttl)
        if t < g:
            break
        k = bisect.bisect_right(gaps, t, lo=i)
        below_t = below + sum(gaps[i:k])
        p_return = k / n
        held = (below_t + t * (n - k)) / n  # E[min(G, t)]
        b = loss_ratio * p_return - usage * held / HOLD_HORIZON_S
        if b > best_b:
            best_t, best_b = t, b
        below += g
    return best_t


class GapModel:
    """Observed gaps per tool, per job and overall; picks a TTL for a finished turn."""

    def __init__(self, max_ttl: float, fixed_ttl: float | None = None) -> None:
        self.max_ttl = max_ttl
        self.fixed_ttl = fixed_ttl
        self.by_tool: dict[str, deque[float]] = {}
        self.by_job: dict[str, deque[float]] = {}
        self.overall: deque[float] = deque(maxlen=GLOBAL_WINDOW)

    def observe(self, job_id: str, tool: str | None, gap: float) -> None:
        gap = max(gap, 0.0)
        self.overall.append(gap)
        _remember(self.by_job, job_id, gap)
        if tool is not None:
            _remember(self.by_tool, tool, gap)

    def forget_job(self, job_id: str) -> None:
        self.by_job.pop(job_id, None)

    def samples(self, job_id: str, tool: str | None) -> deque[float] | None:
        """The most specific scope with enough gaps: the tool, the job, then every job."""
        for scope in (self.by_tool.get(tool) if tool is not None else None,
                      self.by_job.get(job_id), self.overall):
            if scope is not None and len(scope) >= MIN_SAMPLES:
                return scope
        return None

    def choose(self, job_id: str, tool: str | None, loss_ratio: float, usage: float) -> float:
        """The TTL in seconds for a turn that just finished (0.0: do not pin)."""
        if self.fixed_ttl is not None:
            return min(self.fixed_ttl, self.max_ttl)
        gaps = self.samples(job_id, tool)
        if gaps is None:
            return min(COLD_START_TTL_S, self.max_ttl)
        return best_ttl(sorted(gaps), loss_ratio, usage, self.max_ttl)

    def expected_gap(self, job_id: str, tool: str | None) -> float:
        """The median gap (what orders pins for release under pressure)."""
        gaps = self.samples(job_id, tool)
        if gaps is None:
            return COLD_START_TTL_S
        ordered = sorted(gaps)
        return ordered[len(ordered) // 2]


def _remember(table: dict[str, deque[float]], key: str, gap: float) -> None:
    q = table.get(key)
    if q is None:
        if len(table) >= MAX_SCOPES:
            del table[next(iter(table))]  # dicts keep insertion order: the oldest scope
        q = table[key] = deque(maxlen=WINDOW)
    q.append(gap)
