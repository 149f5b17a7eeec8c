"""The `openai` client against a real `python -m launch serve` subprocess (dummy:micro).

Completions and chat, streaming and not, token-id prompts, n > 1, stop strings, seeded
sampling, exact usage, and greedy output equal to LLM.generate on the same prompts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_helpers import Server, make_tokenizer_dir, serve

openai = pytest.importorskip("openai")

MODEL = "micro"
ENGINE = ["--model", "dummy:micro", "--kv-cache-memory", "16M", "--served-model-name", MODEL]
# vLLM extensions, sent as extra fields: run to max_tokens, return the token ids
EB = {"ignore_eos": True, "return_token_ids": True}
PROMPTS = ["the quick brown fox", "hello world, how are", "lazy dog and then"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def server(tok_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(*ENGINE, "--tokenizer", tok_dir, log_dir=str(tmp_path_factory.mktemp("log"))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                      timeout=60.0)
    yield c
    c.close()


def tokenize(server: Server, text: str, add_special_tokens: bool = True) -> list[int]:
    r = httpx.post(server.base_url + "/tokenize", timeout=10,
                   json={"prompt": text, "add_special_tokens": add_special_tokens})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def test_models_health_version(server: Server, client: Any) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    m = models[0].model_dump()
    assert m["object"] == "model" and m["root"] == "dummy:micro" and m["owned_by"]
    assert m["max_model_len"] == 1024 and m["created"] > 0
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.base_url + "/version", timeout=10).json()["version"]


def test_tokenize_detokenize_special_tokens(server: Server) -> None:
    with_bos = tokenize(server, "hello world")
    without = tokenize(server, "hello world", add_special_tokens=False)
    assert with_bos[0] == 1 and with_bos[1:] == without
    r = httpx.post(server.base_url + "/detokenize", json={"tokens": without}, timeout=10)
    assert r.json()["prompt"] == "hello world"
    r = httpx.post(server.base_url + "/tokenize", timeout=10,
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["count"] == len(r.json()["tokens"]) > 3


def test_completion_usage_and_text(server: Server, client: Any) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                  extra_body=EB)
    (c,) = r.choices
    assert r.object == "text_completion" and r.model == MODEL
    assert c.finish_reason == "length"
    assert len(c.token_ids) == 12
    assert r.usage.prompt_tokens == len(tokenize(server, PROMPTS[0]))
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    d = httpx.post(server.base_url + "/detokenize", json={"tokens": c.token_ids}, timeout=10)
    assert c.text == d.json()["prompt"]


def test_streaming_equals_non_streaming(server: Server, client: Any) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=0,
                              extra_body=EB)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(ch.choices for ch in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert len(chunks) - 1 == 10  # one event per token


def test_raw_sse_framing(server: Server) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    token_chunks = payloads[:-1]
    assert len(token_chunks) == 4
    assert all(len(p["choices"][0]["token_ids"]) == 1 for p in token_chunks)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4


def test_token_id_prompts_batch_and_n(client: Any) -> None:
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0,
                                  n=2, extra_body=EB)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    # greedy: both samples of a prompt are the same; the two prompts differ
    assert r.choices[0].token_ids == r.choices[1].token_ids
    assert r.choices[2].token_ids == r.choices[3].token_ids
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 24
    single = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=6,
                                       temperature=0, extra_body=EB)
    assert single.choices[0].token_ids == r.choices[2].token_ids


def test_seeded_sampling_reproducible(client: Any) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt=[3, 4, 5, 6], max_tokens=16, temperature=1.0,
                              n=3, seed=1234, extra_body=EB)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    ids_a = [c.token_ids for c in a.choices]
    assert ids_a == [c.token_ids for c in b.choices]
    assert len({tuple(x) for x in ids_a}) > 1  # the n samples are not copies of each other
    c = client.completions.create(**(kw | {"seed": 99}))
    assert [x.token_ids for x in c.choices] != ids_a


def test_stop_strings(client: Any) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0,
                              extra_body=EB)
    text = client.completions.create(**kw).choices[0].text
    printable = [i for i in range(4, len(text) - 2) if text[i : i + 2].isprintable()]
    assert printable, f"no printable pair in {text!r}"
    i = printable[0]
    stop = text[i : i + 2]
    cut = text.index(stop)
    r = client.completions.create(**kw, stop=[stop, "never-here"])
    assert r.choices[0].text == text[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == text[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"
    inc_kw = kw | {"extra_body": EB | {"include_stop_str_in_output": True}}
    inc = client.completions.create(**inc_kw, stop=stop)
    assert inc.choices[0].text == text[: cut + 2]


def test_chat_completions(client: Any) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    parts = [msgs[0], {"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    a = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
    b = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert a.object == "chat.completion"
    assert a.choices[0].message.role == "assistant"
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == 8 and a.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == a.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == a.usage.prompt_tokens


def test_logprobs_shape(client: Any) -> None:
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5, temperature=0,
                                  logprobs=1, extra_body=EB)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=1, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and content[0].top_logprobs[0].token == content[0].token


def test_logprob_values(client: Any) -> None:
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5, temperature=0,
                                  logprobs=1, extra_body=EB)
    values = r.choices[0].logprobs.token_logprobs
    assert all(x is not None and x <= 0.0 for x in values)


def test_greedy_equals_llm_generate(server: Server, client: Any, tok_dir: str) -> None:
    from launch import LLM, SamplingParams
    from launch.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_dir)
    ids = [tok.encode(p) for p in PROMPTS]
    with LLM("dummy:micro", kv_cache_memory=16 * 2**20) as llm:
        ref = llm.generate(ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                           use_tqdm=False, timeout_s=120)
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=16, temperature=0,
                                  extra_body=EB)
    for ch, want in zip(r.choices, ref, strict=True):
        assert ch.token_ids == want.token_ids
        assert ch.text == tok.decode(want.token_ids)
