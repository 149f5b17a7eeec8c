"""The constraint of a structured-output request, as it crosses every wire.

Only the constraint's text travels (once, inside NewRequestData): every worker compiles it and
runs its own grammar matcher from the tokens it sampled, so no token bitmask ever crosses a
process boundary. Field names are vLLM's ``StructuredOutputsParams``; exactly one is set.
"""

from __future__ import annotations

import json as _json
from typing import Any

import msgspec


class StructuredOutputsParams(msgspec.Struct, array_like=True, kw_only=True, omit_defaults=True):
    """One constraint: a JSON schema, any JSON object, a regex, a choice or an EBNF grammar.

    ``json`` may be given as a dict (the Python API); it is kept as canonical JSON text so
    every rank compiles the same string and the grammar cache key does not depend on key order.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF), as xgrammar reads it
    json_object: bool = False  # any JSON object (response_format {"type": "json_object"})

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = _json.dumps(self.json, sort_keys=True, separators=(",", ":"))

    def kind(self) -> str:
        """The one constraint that is set (call after structured_error found none)."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached by."""
        kind = self.kind()
        if kind == "choice":
            return kind, _json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, str(getattr(self, kind))


def structured_error(p: StructuredOutputsParams) -> str | None:
    """What is wrong with the constraint's shape, or None. Whether a schema, regex or grammar
    compiles is checked by the frontend with the grammar engine itself."""
    given = [n for n in ("json", "regex", "choice", "grammar") if getattr(p, n) is not None]
    if p.json_object:
        given.append("json_object")
    if not given:
        return "structured_outputs sets no constraint: give one of json, regex, choice, grammar"
    if len(given) > 1:
        return f"structured_outputs takes one constraint, got {len(given)}: {', '.join(given)}"
    if p.choice is not None:
        if not p.choice:
            return "structured_outputs.choice is an empty list: give at least one choice"
        if not all(isinstance(c, str) for c in p.choice):
            return "structured_outputs.choice must be a list of strings"
    for name in ("json", "regex", "grammar"):
        v = getattr(p, name)
        if v is not None and not isinstance(v, str):
            return f"structured_outputs.{name} must be a string, got {type(v).__name__}"
        if v is not None and not v:
            return f"structured_outputs.{name} is empty"
    return None
