"""The real `openai` client against a real server: response_format, vLLM's structured fields,
forced tool calls in OpenAI's shape, and bad constraints as 400s that leave the engine serving,
a schema too slow to compile among them."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest

from tests.serve.serve_helpers import Server, make_tokenizer_dir, serve

openai = pytest.importorskip("openai")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["city", "n"], "additionalProperties": False}
MSG = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tok = make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))
    # a 1 s compile limit: the schemas here compile in milliseconds, the deep one in seconds
    with serve("--model", "dummy:micro", "--kv-cache-memory", "16M", "--served-model-name",
               "micro", "--tokenizer", tok, "--structured-outputs-compile-timeout", "1",
               log_dir=str(tmp_path_factory.mktemp("log"))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                      timeout=120.0)
    yield c
    c.close()


def test_response_format_json_schema_chat_and_completions(client: Any) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="micro", messages=MSG, max_tokens=60,
                                       temperature=0.0, response_format=rf)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    c = client.completions.create(model="micro", prompt="hello", max_tokens=60, temperature=0.7,
                                  extra_body={"response_format": rf})
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMA)


def test_vllm_fields(client: Any) -> None:
    r = client.completions.create(model="micro", prompt="hello", max_tokens=20,
                                  extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert r.choices[0].text in ("red", "blue") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="micro", prompt="hello", max_tokens=20,
                                  extra_body={"guided_regex": r"\d{3}-[a-z]{2}"})
    assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == "-"


def test_forced_tool_call(client: Any) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}},
             {"type": "function", "function": {"name": "noop", "parameters": {
                 "type": "object", "properties": {}, "additionalProperties": False}}}]
    r = client.chat.completions.create(
        model="micro", messages=MSG, max_tokens=60, temperature=0.0, tools=tools,
        tool_choice={"type": "function", "function": {"name": "weather"}})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    r = client.chat.completions.create(model="micro", messages=MSG, max_tokens=120,
                                       temperature=0.0, tools=tools, tool_choice="required")
    calls = r.choices[0].message.tool_calls or []
    if r.choices[0].finish_reason == "tool_calls":  # random weights may run out of tokens
        assert calls and all(c.function.name in ("weather", "noop") for c in calls)


def test_streamed_tool_call(client: Any) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}]
    stream = client.chat.completions.create(
        model="micro", messages=MSG, max_tokens=60, temperature=0.0, tools=tools,
        tool_choice={"type": "function", "function": {"name": "weather"}}, stream=True)
    heads, args, finish, pieces = [], "", None, 0
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content
        for tc in delta.tool_calls or []:
            assert tc.index == 0
            if tc.id is not None:  # the head: id, type, name; arguments follow in chunks
                heads.append((tc.type, tc.function.name))
            args += tc.function.arguments or ""
            pieces += bool(tc.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert heads == [("function", "weather")] and finish == "tool_calls"
    assert pieces > 1  # the arguments arrived as they were generated, not in one piece
    jsonschema.validate(json.loads(args), SCHEMA)


@pytest.mark.parametrize("extra,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}}},
     "json"),
    ({"guided_regex": "[a-"}, "regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "grammar"),
    ({"guided_choice": []}, "choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "more than one"),
])
def test_bad_constraints_are_400(server: Server, extra: dict[str, Any], needle: str) -> None:
    body = {"model": "micro", "prompt": "hi", "max_tokens": 4} | extra
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    ok = httpx.post(server.base_url + "/v1/completions", timeout=60,
                    json={"model": "micro", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_a_schema_too_slow_to_compile_is_a_400_naming_the_limit(server: Server) -> None:
    # each level doubles the schema (700 KB at 13) and compiling it takes seconds (about 9 s
    # on a CI core): far past the 1 s limit, which counts from the request's arrival
    deep = functools.reduce(
        lambda inner, _: {"type": "object", "properties": {"a": inner, "b": inner},
                          "required": ["a"]}, range(13), {"type": "string"})
    rf = {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}
    url = server.base_url + "/v1/completions"
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(httpx.post, url, timeout=120, json={
            "model": "micro", "prompt": "hi", "max_tokens": 4, "response_format": rf})
        # meanwhile other requests are served, a constrained one too (the pool's other thread)
        plain = httpx.post(url, timeout=120, json={"model": "micro", "prompt": "hi",
                                                   "max_tokens": 2})
        choice = httpx.post(url, timeout=120, json={
            "model": "micro", "prompt": "hi", "max_tokens": 8,
            "structured_outputs": {"choice": ["left", "right"]}})
        r = slow.result(timeout=120)
    assert plain.status_code == 200, plain.text
    assert choice.status_code == 200 and choice.json()["choices"][0]["text"] in ("left", "right")
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "did not compile within 1 s" in message, message
    assert "--structured-outputs-compile-timeout" in message, message
