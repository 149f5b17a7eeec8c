"""The tool-call stream scanner: however the text is cut into deltas, the entries rebuild the
same calls (name once, then arguments whose concatenation is the call's JSON)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from launch.serve.tool_stream import ToolCallStream
from launch.serve.tools import ToolPlan

CALLS = ('[{"name":"weather","parameters":{"city":"a}\\"b","n":[1,{"x":2}]}},'
         '{"name":"noop","parameters":{}}]')


def _rebuild(plan: ToolPlan, text: str, step: int) -> list[tuple[str, Any]]:
    stream = ToolCallStream(plan)
    calls: dict[int, list[str]] = {}
    for i in range(0, len(text), step):
        for e in stream.feed(text[i : i + step]):
            if "id" in e:  # a call's head: id, type and name, once
                assert e["type"] == "function" and e["id"].startswith("call_")
                assert e["index"] not in calls
                calls[e["index"]] = [e["function"]["name"], ""]
            calls[e["index"]][1] += e["function"]["arguments"]
    return [(n, json.loads(a)) for n, a in calls.values()]


@pytest.mark.parametrize("step", [1, 2, 5, len(CALLS)])
def test_required_calls_stream_name_then_arguments(step: int) -> None:
    want = [(c["name"], c["parameters"]) for c in json.loads(CALLS)]
    assert _rebuild(ToolPlan(None), CALLS, step) == want


def test_named_function_streams_its_arguments() -> None:
    args = '{"city":"x","n":[1]}'
    assert _rebuild(ToolPlan("weather"), args, 3) == [("weather", json.loads(args))]
