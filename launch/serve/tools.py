"""Function calling on /v1/chat/completions: ``tools`` with ``tool_choice`` "required" or a
named function become a JSON-schema constraint, and the constrained output becomes the
message's ``tool_calls`` in OpenAI's shape.

- a named function ({"type": "function", "function": {"name": ...}}): the output is that
  function's arguments, constrained to its ``parameters`` schema;
- "required": the output is a JSON array of one or more {"name", "parameters"} objects, each
  name one of the tools' and its parameters that tool's schema (vLLM's shape).
"none" and "auto" constrain nothing (the text stays the message's content).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from launch.serve.errors import bad_request
from protocol.structured import StructuredOutputsParams


@dataclass
class ToolPlan:
    """How the output becomes tool calls: one named function, or a list of calls."""

    function: str | None  # the named function; None = "required" (a list of calls)

    def tool_calls(self, text: str) -> list[dict[str, Any]] | None:
        """The output as OpenAI tool calls; None when it does not parse (cut by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.function is not None:
            calls = [(self.function, value)]
        else:
            calls = [(c["name"], c["parameters"]) for c in value]
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": n, "arguments": json.dumps(a)}} for n, a in calls]


def tool_constraint(extra: dict[str, Any]) -> tuple[StructuredOutputsParams, ToolPlan] | None:
    """The constraint and plan of the request's tools, or None when it asks for no call."""
    tools = extra.get("tools")
    choice = extra.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    schemas = _schemas(tools)
    if choice in (None, "none", "auto"):
        return None
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": n}, "parameters": s},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for n, s in schemas.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        return StructuredOutputsParams(json=schema), ToolPlan(None)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise bad_request('tool_choice must be "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in schemas:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools",
                          "tool_choice")
    return StructuredOutputsParams(json=schemas[name]), ToolPlan(name)


def _schemas(tools: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools must be a non-empty list of functions", "tools")
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                              "{\"name\": ..., \"parameters\": {...}}}", "tools")
        params = fn.get("parameters") or {"type": "object"}
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be an object", "tools")
        out[fn["name"]] = params
    return out


def with_tool_calls(choice: dict[str, Any], plan: ToolPlan | None) -> dict[str, Any]:
    """A chat choice whose constrained output is a tool call, in OpenAI's shape: content None,
    ``tool_calls`` set, finish_reason "tool_calls" (unless cut short)."""
    if plan is None:
        return choice
    msg = choice["message"]
    calls = plan.tool_calls(msg["content"])
    if calls is None:
        return choice
    choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
    if choice["finish_reason"] == "stop":
        choice["finish_reason"] = "tool_calls"
    return choice
