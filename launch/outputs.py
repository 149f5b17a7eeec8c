"""What the Python API hands back: per-request outputs, timings and stream events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) as seen by the engine core when tokens were known."""

    arrival_time: float
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    logprobs: list[float] | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    # a prefill request's answer (P/D): protocol.kv_connector.KVTransferParams
    kv_transfer_params: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamEvent:
    """New tokens of one request, as they come (LLM.generate_stream)."""

    index: int  # position of the prompt in the input list
    request_id: str
    new_token_ids: list[int]
    text_delta: str | None
    finish_reason: str | None
    error: str | None = None
