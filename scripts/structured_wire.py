"""Wire bytes of structured outputs, worker-side matchers vs a scheduler-side bitmask.

Shared by bench_structured.py and profile_ipc.py (one computation, two reports). The workers
advance their own matchers, so a constrained request adds bytes only on arrival (its
constraint's text in PrepareGrammar and NewRequestData, a few bytes of GrammarReady per rank)
and the steady decode diff is unchanged; a scheduler-side matcher (vLLM's design) would add
vocab/32 int32 words per constrained request to every step.
"""

from __future__ import annotations

import msgspec

from protocol.codec import pack
from protocol.messages import (
    GrammarReady,
    NewRequestData,
    PrepareGrammar,
    SamplingParams,
    SchedulerOutput,
)
from protocol.structured import StructuredOutputsParams

# an endless object (the array never has to close) keeps every request decoding to max_tokens
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
    "required": ["id", "name"]}}}, "required": ["items"]}


def encoded(obj: object) -> int:
    return len(msgspec.msgpack.encode(obj))  # the codec's framing: msgpack of the struct


def bitmask_bytes(vocab: int) -> int:
    """One request's token bitmask in one step: 32 tokens per int32."""
    return -(-vocab // 32) * 4


def wire(vocab: int, batch: int) -> dict[str, float]:
    """Bytes of a steady decode step of ``batch`` constrained requests both ways, and of a new
    request's diff with and without a JSON-schema constraint."""

    def new_request(spec: StructuredOutputsParams | None) -> NewRequestData:
        return NewRequestData(handle=1, prompt_token_ids=pack(list(range(32))),
                              sampling_params=SamplingParams(max_tokens=64,
                                                             structured_outputs=spec),
                              block_ids=pack([1, 2]), num_computed_tokens=0,
                              num_scheduled_tokens=32)

    steady = SchedulerOutput(step_id=1000, num_running=batch, total_num_scheduled_tokens=batch)
    spec = StructuredOutputsParams(json=SCHEMA)
    return {
        "decode_diff_bytes": float(encoded(steady)),
        # + the masks and one msgpack bin header for them
        "decode_diff_bytes_scheduler_side": float(
            encoded(steady) + batch * bitmask_bytes(vocab) + 8),
        "new_request_bytes_plain": float(
            encoded(SchedulerOutput(step_id=1, new_reqs=[new_request(None)]))),
        "new_request_bytes_constrained": float(
            encoded(SchedulerOutput(step_id=1, new_reqs=[new_request(spec)]))),
        # once per constrained request before admission: the core's ask, one rank's answer
        "prepare_grammar_bytes": float(encoded(PrepareGrammar(1, spec, 1))),
        "grammar_ready_bytes": float(encoded(
            GrammarReady(rank=0, ticket=1, size_bytes=70_000, cache_bytes=2**27))),
    }
