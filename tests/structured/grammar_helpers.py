"""Schemas for the grammar cache's tests: a new one per index, about 60 KB compiled each."""

from __future__ import annotations

from typing import Any

from protocol.messages import SamplingParams
from protocol.structured import StructuredOutputsParams

# patterns, not maxLength: xgrammar 0.2.8 lets a maxLength string hold raw control bytes,
# which no JSON parser takes, so the outputs could not be checked
PATTERNS = ["^[a-z ]{1,40}$", "^[a-z ]{2,40}$", "^[0-9]{1,12}$"]


def schema(i: int) -> dict[str, Any]:
    """A schema no other ``i`` gives: three patterned strings under names of its own."""
    names = [f"f{i}_{j}" for j in range(len(PATTERNS))]
    return {"type": "object", "additionalProperties": False, "required": names,
            "properties": {n: {"type": "string", "pattern": p}
                           for n, p in zip(names, PATTERNS, strict=True)}}


def params(i: int, **kw: Any) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema(i)), **kw)
