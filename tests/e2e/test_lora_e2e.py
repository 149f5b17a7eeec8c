"""LoRA end to end through the real frontend, engine core process and ZeroMQ, with stub ranks
(tests/helpers/lora_stub_worker.py) whose tokens depend on the adapter in the request's slot:
the Python API (lora_request, start-up modules, refusals) and the HTTP server (the `model`
field, /v1/models, the runtime load / unload endpoints and their status codes) through the real
`openai` client. Outputs are checked against the stub model computed here, so a request that
ran with the wrong adapter (or none) fails."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from launch import LLM, LoRARequest, SamplingParams
from launch.lora_modules import LoRAModule
from launch.processes import free_port
from launch.serve.context import ServerContext
from protocol.request_options import RequestOptions
from tests.helpers.lora_e2e import expected_tokens, make_adapter, stub_llm

pytestmark = pytest.mark.timeout(180)


def test_generate_mixes_the_base_model_and_adapters_in_one_batch(tmp_path: Path) -> None:
    sql, chat = make_adapter(tmp_path, "sql"), make_adapter(tmp_path, "chat", r=4)
    with stub_llm(max_loras=1, lora_modules=[LoRARequest("sql", 1, sql)]) as llm:
        assert llm.config.max_lora_rank == 8  # the largest rank among the start-up modules
        prompts = [[11, 12, 13], [11, 12, 13], [14, 15, 16, 17], [11, 12, 13], [18, 19]]
        loras = [None, LoRARequest("sql", 1, sql), LoRARequest("chat", 2, chat),
                 LoRARequest("chat", 2, chat), LoRARequest("sql", 1, sql)]
        sp = SamplingParams(max_tokens=6, temperature=0.0)
        outs = llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
        for o, p, lora in zip(outs, prompts, loras, strict=True):
            assert o.finish_reason == "length", o.error
            assert o.token_ids == expected_tokens(p, 6, lora and lora.lora_path)
        # the same prompt differs per adapter: the right adapter ran for each
        assert len({tuple(outs[i].token_ids) for i in (0, 1, 3)}) == 3
        one = llm.generate([[21, 22]], sp, lora_request=LoRARequest("sql", 1, sql),
                           use_tqdm=False)[0]
        assert one.token_ids == expected_tokens([21, 22], 6, sql)
        stats = llm.get_stats()
        assert stats["lora_max_loras"] == 1 and stats["lora_loads"] >= 2


def test_refused_adapters_fail_only_their_requests(tmp_path: Path) -> None:
    dora = make_adapter(tmp_path, "dora", use_dora=True)
    picky = make_adapter(tmp_path, "picky", stub_refuse_rank=1)
    wide = make_adapter(tmp_path, "wide", r=64)
    broken = make_adapter(tmp_path, "broken")
    (Path(broken) / "adapter_model.safetensors").unlink()
    good = make_adapter(tmp_path, "good")
    with stub_llm(max_loras=2) as llm:
        assert llm.config.max_lora_rank == 16  # no start-up modules: vLLM's default
        cases = [
            (LoRARequest("dora", 1, dora), "use_dora is not supported"),
            (LoRARequest("picky", 2, picky), "worker rank 1"),
            (LoRARequest("wide", 3, wide), "max_lora_rank 16"),
            (LoRARequest("broken", 4, broken), "adapter_model.safetensors not found"),
            (LoRARequest("dora2", 5, good), None),
            (LoRARequest("good", 5, good), "LoRA id 5 is registered"),
        ]
        sp = SamplingParams(max_tokens=3)
        outs = llm.generate([[30, 31]] * (len(cases) + 1), sp,
                            lora_request=[c[0] for c in cases] + [None], use_tqdm=False)
        for o, (_, err) in zip(outs, cases, strict=False):
            if err is None:
                assert o.finish_reason == "length"
            else:
                assert o.finish_reason == "error" and err in (o.error or ""), o.error
        assert outs[-1].token_ids == expected_tokens([30, 31], 3, None)
        with pytest.raises(ValueError, match="use_dora"):
            llm.add_lora(LoRARequest("dora", 6, dora))
        llm.add_lora(LoRARequest("good", 7, good))
        with pytest.raises(ValueError, match="not loaded"):
            llm.remove_lora("nope")
        llm.remove_lora("good")


def test_an_adapter_refused_at_start_up_stops_it(tmp_path: Path) -> None:
    dora = make_adapter(tmp_path, "dora", use_dora=True)
    with pytest.raises(ValueError, match="'dora' refused: .*use_dora"):
        with stub_llm(lora_modules=[LoRARequest("dora", 1, dora)]):
            pass


# ------------------------------------------------------------------------------ HTTP


@contextmanager
def http_server(llm: LLM, modules: list[LoRAModule]) -> Iterator[tuple[str, ServerContext]]:
    """The real app and uvicorn, in this process, on the stub engine; yields the base URL
    and the server's context."""
    import uvicorn

    from launch.serve.adapters import ServedAdapters
    from launch.serve.app import build_app
    from launch.serve.engine import AsyncEngine

    ctx = ServerContext(engine=AsyncEngine(llm, None), served_names=["base-model"],
                        model_path="dummy:tiny",
                        adapters=ServedAdapters(modules, llm.config.lora_modules, "base-model"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(ctx), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}", ctx
    finally:
        server.should_exit = True
        thread.join(30)


def test_http_adapters_and_runtime_updates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    sql, chat = make_adapter(tmp_path, "sql"), make_adapter(tmp_path, "chat")
    stall = make_adapter(tmp_path, "stall", stub_stall=True)
    dora = make_adapter(tmp_path, "dora", use_dora=True)
    modules = [LoRAModule("sql", sql, "base-model")]
    with stub_llm(max_loras=2, lora_modules=[LoRARequest("sql", 1, sql)]) as llm:
        monkeypatch.delenv("TANDEM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
        with http_server(llm, modules) as (url, _):  # runtime updating off: no such routes
            r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "chat",
                                                                 "lora_path": chat})
            assert r.status_code == 404
            r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert r.status_code == 404
        monkeypatch.setenv("TANDEM_ALLOW_RUNTIME_LORA_UPDATING", "1")
        with http_server(llm, modules) as (url, ctx):
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            cards = {m.id: m for m in client.models.list().data}
            assert set(cards) == {"base-model", "sql"}
            assert cards["sql"].parent == "base-model" and cards["sql"].root == sql

            def complete(model: str, stream: bool = False) -> tuple[str, list[int]]:
                extra = {"return_token_ids": True}
                if not stream:
                    c = client.completions.create(model=model, prompt=[11, 12, 13],
                                                  max_tokens=5, extra_body=extra)
                    return c.model, c.choices[0].token_ids  # type: ignore[attr-defined]
                ids: list[int] = []
                name = ""
                for chunk in client.completions.create(model=model, prompt=[11, 12, 13],
                                                       max_tokens=5, stream=True,
                                                       extra_body=extra):
                    name = chunk.model
                    if chunk.choices:
                        ids += chunk.choices[0].token_ids or []  # type: ignore[attr-defined]
                return name, ids

            for stream in (False, True):
                assert complete("sql", stream) == ("sql", expected_tokens([11, 12, 13], 5, sql))
                assert complete("base-model", stream) == (
                    "base-model", expected_tokens([11, 12, 13], 5, None))
            with pytest.raises(openai.NotFoundError):
                complete("chat")
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(model="chat", messages=[{"role": "user",
                                                                        "content": "hi"}])

            def post(path: str, **body: object) -> httpx.Response:
                return httpx.post(url + path, json=body, timeout=60)

            r = post("/v1/load_lora_adapter", lora_name="chat", lora_path=chat)
            assert r.status_code == 200, r.text
            assert complete("chat") == ("chat", expected_tokens([11, 12, 13], 5, chat))
            cards = {m.id: m for m in client.models.list().data}
            assert cards["chat"].parent == "base-model"
            r = post("/v1/load_lora_adapter", lora_name="chat", lora_path=chat)
            assert r.status_code == 400 and "already been loaded" in r.text
            r = post("/v1/load_lora_adapter", lora_name="gone", lora_path=str(tmp_path / "no"))
            assert r.status_code == 400 and "adapter_config.json not found" in r.text
            r = post("/v1/load_lora_adapter", lora_name="dora", lora_path=dora)
            assert r.status_code == 400 and "use_dora" in r.text
            r = post("/v1/load_lora_adapter", lora_name="x")
            assert r.status_code == 400
            assert post("/v1/unload_lora_adapter", lora_name="nope").status_code == 404

            # a request in flight keeps its adapter: 409 until it is gone
            assert post("/v1/load_lora_adapter", lora_name="stall",
                        lora_path=stall).status_code == 200
            assert llm.client is not None
            # sent on the socket the unload below takes, so the engine has it first
            stalled = llm.client.add_request("held", [40, 41], SamplingParams(max_tokens=4),
                                             queue.Queue(),
                                             options=RequestOptions(
                                                 lora=ctx.adapters.get("stall")))
            r = post("/v1/unload_lora_adapter", lora_name="stall")
            assert r.status_code == 409 and "in use" in r.text
            assert "stall" in {m.id for m in client.models.list().data}
            llm.client.abort([stalled.request_id])
            assert post("/v1/unload_lora_adapter", lora_name="stall").status_code == 200
            assert post("/v1/unload_lora_adapter", lora_name="chat").status_code == 200
            with pytest.raises(openai.NotFoundError):
                complete("chat")
            assert {m.id for m in client.models.list().data} == {"base-model", "sql"}
            # loaded again (a new id): served again
            assert post("/v1/load_lora_adapter", lora_name="chat",
                        lora_path=chat).status_code == 200
            assert complete("chat") == ("chat", expected_tokens([11, 12, 13], 5, chat))
            metrics = httpx.get(url + "/metrics").text
            assert 'tandem:lora_slots_used{model_name="base-model"}' in metrics
            assert 'model_name="sql"' not in metrics and 'model_name="chat"' not in metrics
