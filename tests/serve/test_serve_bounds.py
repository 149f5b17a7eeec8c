"""Overload gets a fast, honest answer, and nothing keyed by a request outlives it.

- `--max-queued-requests 8`, 64 concurrent clients while both running slots are taken: the
  clients beyond the bound get 503 with Retry-After at once, and every admitted request is
  served to its last token once the slots free up (admitted requests are never dropped);
- after streams and non-streaming requests whose clients leave mid-flight, requests that fail
  in a worker, constrained requests, stop strings and refusals, every per-request map of every
  process (GET /census: frontend, engine core, rank 0) is back to empty and every KV block is
  free.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_helpers import Server, make_tokenizer_dir, metric, serve

FAULT_SEED = 515151  # a request with this seed fails in the workers (request_guard.py)
LIMIT = 8
CLIENTS = 64
MAX_TOKENS = 16
ENGINE = ["--model", "dummy:micro", "--kv-cache-memory", "16M", "--max-num-seqs", "2",
          "--max-queued-requests", str(LIMIT)]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tok = make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_FAULT_REQUEST_SEED", str(FAULT_SEED))  # read by the workers at start
        with serve(*ENGINE, "--tokenizer", tok,
                   log_dir=str(tmp_path_factory.mktemp("log"))) as s:
            yield s


def census(server: Server) -> dict[str, Any]:
    r = httpx.get(server.base_url + "/census", timeout=30)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def wait_empty(server: Server, timeout_s: float = 30.0) -> dict[str, Any]:
    """Poll /census until no per-request map holds anything (ranks report every 0.5 s, the
    first time half a second after start-up: until then the census has no rank)."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = census(server)
        reported = "rank0" in body["census"]
        if reported and not body["leftovers"] and body["num_free_blocks"] == body["num_blocks"] - 1:
            return body
        assert time.monotonic() < deadline, f"not empty after {timeout_s} s: {body}"
        time.sleep(0.1)


async def _stream(c: httpx.AsyncClient, body: dict[str, Any], started: asyncio.Event,
                  path: str = "/v1/completions") -> list[str]:
    """A streamed request; `started` is set at its first token. Returns the data payloads."""
    events: list[str] = []
    async with c.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    return events


async def _running(c: httpx.AsyncClient, body: dict[str, Any], n: int = 1,
                   path: str = "/v1/completions") -> list[asyncio.Task[list[str]]]:
    """n streams started and past their first token (so they hold running slots)."""
    flags = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.create_task(_stream(c, body, f, path)) for f in flags]
    for f, t in zip(flags, tasks, strict=True):
        waiter = asyncio.ensure_future(f.wait())
        await asyncio.wait({waiter, t}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        assert f.is_set(), t.result() if t.done() else "no first token in 60 s"
    return tasks


async def _leave(tasks: list[asyncio.Task[Any]]) -> None:
    """The clients disconnect (cancelling a request closes its connection)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_full_queue_is_refused_at_once_and_admitted_requests_are_served(server: Server) -> None:
    long = {"prompt": [5, 6, 7, 8], "max_tokens": 1000, "ignore_eos": True}

    async def one(c: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"prompt": [9 + i, 10, 11], "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "temperature": 0, "return_token_ids": True}
        return await c.post("/v1/completions", json=body)

    async def main() -> tuple[list[httpx.Response], bool]:
        limits = httpx.Limits(max_connections=CLIENTS + 8)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                     limits=limits) as c:
            blockers = await _running(c, long, 2)  # both running slots taken
            tasks = [asyncio.create_task(one(c, i)) for i in range(CLIENTS)]
            # every client beyond the bound is answered while the blockers still run
            deadline = time.monotonic() + 60
            while sum(t.done() for t in tasks) < CLIENTS - LIMIT:
                assert time.monotonic() < deadline, "refusals did not come"
                await asyncio.sleep(0.02)
            blocked_throughout = not any(b.done() for b in blockers)
            await _leave(blockers)  # the slots free up: the admitted requests run
            return list(await asyncio.gather(*tasks)), blocked_throughout

    responses, blocked_throughout = asyncio.run(main())
    served = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert len(served) + len(refused) == CLIENTS, [r.status_code for r in responses]
    assert len(served) >= LIMIT and refused
    if blocked_throughout:  # nothing could start running: exactly the bound was admitted
        assert len(served) == LIMIT
    for r in refused:
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == 503 and err["type"] == "ServiceUnavailableError"
        assert f"max_queued_requests={LIMIT}" in err["message"]
    for r in served:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == MAX_TOKENS
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert metric(metrics, "tandem:request_refused_queue_full_total") == len(refused)
    wait_empty(server)


def test_census_is_empty_after_aborts_disconnects_and_errors(server: Server) -> None:
    idle = wait_empty(server)
    assert set(idle["census"]) == {"frontend", "engine_core", "rank0"}
    plain = {"prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True}
    constrained = {"prompt": "the quick", "max_tokens": 24,
                   "response_format": {"type": "json_schema",
                                       "json_schema": {"name": "a", "schema": SCHEMA}}}
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 200,
            "request_id": "dup-1"}

    async def main() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
            # a stream of 2 choices in flight, seen by every process; it and a waiting
            # non-streaming request lose their clients
            streams = await _running(c, plain | {"n": 2})
            gone = asyncio.create_task(c.post("/v1/completions", json=plain))
            deadline = time.monotonic() + 60
            while True:  # the ranks report their maps with each pong (every 0.5 s)
                busy = await asyncio.to_thread(census, server)
                if busy["census"]["rank0"]["input_batch.states"] or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            await _leave([gone, *streams])
            # requests that fail in the workers (one of 2 choices, streamed), a stop string, a
            # constrained output, and requests refused before they reach the engine
            results = await asyncio.gather(
                c.post("/v1/completions", json=plain | {"seed": FAULT_SEED}),
                c.post("/v1/completions", json=plain | {"seed": FAULT_SEED, "n": 2,
                                                        "stream": True}),
                c.post("/v1/completions", json={"prompt": "the quick brown fox",
                                                "max_tokens": 64, "stop": [" "]}),
                c.post("/v1/completions", json=constrained),
                c.post("/v1/completions", json={"prompt": [5, 99999], "max_tokens": 4}),
                c.post("/v1/completions", json=constrained | {"response_format": {
                    "type": "json_schema", "json_schema": {"schema": {"type": 7}}}}),
            )
            # a constrained stream and a chat stream left mid-flight, and a duplicate of the
            # chat's request id refused while it runs
            half = await _running(c, constrained | {"max_tokens": 200})
            half += await _running(c, chat, path="/v1/chat/completions")
            dup = await c.post("/v1/chat/completions", json=chat)
            await _leave(half)
            return {"busy": busy, "results": results, "dup": dup}

    out = asyncio.run(main())
    busy = out["busy"]["census"]
    assert busy["rank0"]["input_batch.states"] == 2
    assert busy["engine_core"]["scheduler.running"] == 2
    assert busy["frontend"]["serve.generations"] >= 2 and busy["frontend"]["client.tracked"] >= 3
    failed1, failed2, stop, fine, bad_id, bad_schema = out["results"]
    assert failed1.status_code == 400 and "injected request fault" in failed1.text
    # the stream's two choices may start in different steps (two sequences run at a time): its
    # failing choice is a 400 when its failure is the first output, else the error event of a
    # stream that had started
    assert failed2.status_code in (200, 400) and "injected request fault" in failed2.text
    assert stop.status_code == 200 and stop.json()["choices"][0]["finish_reason"] == "stop"
    assert fine.status_code == 200
    assert bad_id.status_code == 400 and bad_schema.status_code == 400
    assert out["dup"].status_code == 400 and "already in flight" in out["dup"].text
    wait_empty(server)
