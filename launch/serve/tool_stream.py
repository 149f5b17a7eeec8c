"""Streaming a forced tool call as OpenAI's ``delta.tool_calls``: for each call, one entry with
its index, id, type and function name (arguments ""), then entries with argument chunks only.

The constrained output's shape is known (launch.serve.tools): a named function streams its
arguments verbatim. "required" streams a JSON array ``[{"name": N, "parameters": {...}}, ...]``
written compactly in schema order (the grammar allows no other), so a small scanner finds each
call's name and then passes its parameters' text through as argument chunks as it arrives,
without waiting for the call, or the output, to end.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from launch.serve.tools import ToolPlan

# the text before a call's arguments: "[" (first call) or "}," (after the previous call),
# then {"name": <string>, "parameters":
_CALL_HEAD = re.compile(
    r'\s*\}?\s*[\[,]\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """Turns a choice's text deltas into ``tool_calls`` delta entries."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0  # calls whose head (id, name) was sent
        self._buf = ""  # "required": text not yet turned into entries
        self._in_args = False
        self._depth = 0  # bracket depth inside the current arguments
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The delta entries ``text`` adds (possibly none: a call's head still incomplete)."""
        if self.plan.function is not None:
            return self._feed_named(text)
        self._buf += text
        out: list[dict[str, Any]] = []
        while True:
            if not self._in_args:
                m = _CALL_HEAD.match(self._buf)
                if m is None:
                    return out  # wait for more text (or the array's end: nothing more)
                self._buf = self._buf[m.end():]
                out.append(self._head(json.loads(m.group(1))))
                self._in_args, self._depth = True, 0
                self._in_string = self._escape = False
            end = self._scan_args()
            chunk, self._buf = self._buf[:end], self._buf[end:]
            if chunk:
                out.append({"index": self.num_calls - 1, "function": {"arguments": chunk}})
            if self._in_args:
                return out

    def _feed_named(self, text: str) -> list[dict[str, Any]]:
        if self.num_calls == 0:
            assert self.plan.function is not None
            head = self._head(self.plan.function)
            head["function"]["arguments"] = text
            return [head]
        if not text:
            return []
        return [{"index": 0, "function": {"arguments": text}}]

    def _head(self, name: str) -> dict[str, Any]:
        self.num_calls += 1
        return {"index": self.num_calls - 1, "id": _call_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}

    def _scan_args(self) -> int:
        """How much of the buffer belongs to the current call's arguments; clears _in_args
        when they end there (their closing bracket, or a bare value's end)."""
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                if self._depth == 0:  # a bare value ended at the call object's "}"
                    self._in_args = False
                    return i
                self._depth -= 1
                if self._depth == 0:
                    self._in_args = False
                    return i + 1
            elif ch == "," and self._depth == 0:
                self._in_args = False
                return i
        return len(self._buf)
