"""LoRA over HTTP through a real `python -m launch serve` (real worker rank) and the real
`openai` client, on the tiny HF Llama and PEFT adapters of tests/helpers/lora.py: `model`
selects an adapter (completions and chat, streaming too) and the tokens equal peft's;
/v1/models lists adapters with their parent; runtime load / unload
(TANDEM_ALLOW_RUNTIME_LORA_UPDATING=1) with its status codes, a name reloaded from another
directory serving the new weights; an adapter a rank refuses is a 400 naming the field at the
load endpoint, and stops the server at start-up with the rank's message."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_helpers import ROOT, Server, make_tokenizer_dir, serve

from tests.helpers.lora import LoRAWorld
from tests.helpers.procs import run_watched

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # a server and its rank

BASE = "tiny"
MAX_NEW = 8
PROMPT = [(3 * j + 11) % 256 for j in range(14)]
# vLLM extensions: run to max_tokens, return the token ids
EB = {"ignore_eos": True, "return_token_ids": True}


def _dora(world: LoRAWorld, root: Path) -> str:
    """Adapter 1's files with use_dora set: every rank refuses it (DoRA is not supported)."""
    path = root / "dora"
    shutil.copytree(world.adapters[0], path)
    cfg_path = path / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(cfg | {"use_dora": True}))
    return str(path)


def _engine_args(world: LoRAWorld) -> list[str]:
    return ["--model", world.base, "--dtype", "float32", "--block-size", "4", "--enable-lora",
            "--max-loras", "2", "--max-lora-rank", "32"]


@pytest.fixture(scope="module")
def server(lora_world: LoRAWorld, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Server]:
    # the model's vocabulary is 256 ids: ASCII text encodes below it with a byte-level BPE
    # of no merges
    tok = make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")), vocab_size=256)
    args = [*_engine_args(lora_world), "--tokenizer", tok, "--served-model-name", BASE,
            "--lora-modules", f"a={lora_world.adapters[0]}"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_ALLOW_RUNTIME_LORA_UPDATING", "1")
        with serve(*args, log_dir=str(tmp_path_factory.mktemp("log"))) as s:
            yield s


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                      timeout=120.0)
    yield c
    c.close()


def _complete(client: Any, model: str, stream: bool = False, prompt: list[int] = PROMPT,
              max_tokens: int = MAX_NEW) -> list[int]:
    kw = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=EB)
    if not stream:
        r = client.completions.create(**kw)
        assert r.model == model and r.choices[0].finish_reason == "length"
        return r.choices[0].token_ids
    ids: list[int] = []
    for chunk in client.completions.create(**kw, stream=True):
        assert chunk.model == model
        if chunk.choices:
            ids += chunk.choices[0].token_ids or []
    return ids


def _post(server: Server, path: str, **body: object) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def test_models_list_adapters_with_their_parent(client: Any, lora_world: LoRAWorld) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, "a"}
    assert cards["a"].parent == BASE and cards["a"].root == lora_world.adapters[0]


def test_completions_select_the_adapter(client: Any, lora_world: LoRAWorld) -> None:
    base, a = lora_world.expected([PROMPT, PROMPT], [0, 1], MAX_NEW)
    for stream in (False, True):
        assert _complete(client, "a", stream) == a
        assert _complete(client, BASE, stream) == base


def test_chat_selects_the_adapter(client: Any, lora_world: LoRAWorld) -> None:
    msgs = [{"role": "user", "content": "the quick brown fox"}]
    kw = dict(model="a", messages=msgs, max_tokens=MAX_NEW, temperature=0)
    r = client.chat.completions.create(**kw, extra_body=EB)
    prompt_ids = r.choices[0].prompt_token_ids
    assert max(prompt_ids) < 256
    (want,) = lora_world.expected([prompt_ids], [1], MAX_NEW)
    assert r.model == "a" and r.choices[0].token_ids == want
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body=EB))
    assert {ch.model for ch in chunks} == {"a"}
    ids = [t for ch in chunks if ch.choices for t in (ch.choices[0].token_ids or [])]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert ids == want and text == r.choices[0].message.content


def test_runtime_load_and_unload(server: Server, client: Any, lora_world: LoRAWorld,
                                 tmp_path: Path) -> None:
    want = dict(zip((1, 2, 3), lora_world.expected([PROMPT] * 3, [1, 2, 3], MAX_NEW),
                    strict=True))
    r = _post(server, "/v1/load_lora_adapter", lora_name="b", lora_path=lora_world.adapters[1])
    assert r.status_code == 200, r.text
    assert {m.id: m.parent for m in client.models.list().data}["b"] == BASE
    assert _complete(client, "b") == _complete(client, "b", stream=True) == want[2]

    # a long stream with b in flight: b cannot be unloaded until it ends
    stream = client.completions.create(model="b", prompt=PROMPT, max_tokens=200, temperature=0,
                                       stream=True, extra_body=EB)
    ids = list(next(stream).choices[0].token_ids)
    r = _post(server, "/v1/unload_lora_adapter", lora_name="b")
    assert r.status_code == 409 and "in use" in r.text, r.text
    for chunk in stream:
        if chunk.choices:
            ids += chunk.choices[0].token_ids or []
    assert len(ids) == 200 and ids[:MAX_NEW] == want[2]
    r = _post(server, "/v1/unload_lora_adapter", lora_name="b")
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "b")
    assert {m.id for m in client.models.list().data} == {BASE, "a"}

    # b again, from another directory: its new weights answer, not b's cached KV
    r = _post(server, "/v1/load_lora_adapter", lora_name="b", lora_path=lora_world.adapters[2])
    assert r.status_code == 200, r.text
    assert _complete(client, "b") == want[3]

    # refused by the rank: a 400 naming the field, and the server serves on
    r = _post(server, "/v1/load_lora_adapter", lora_name="d", lora_path=_dora(lora_world,
                                                                                 tmp_path))
    assert r.status_code == 400 and "use_dora" in r.text, r.text
    assert "refused by worker rank 0" in r.text
    assert {m.id for m in client.models.list().data} == {BASE, "a", "b"}
    assert _complete(client, "a") == want[1]
    assert _post(server, "/v1/unload_lora_adapter", lora_name="b").status_code == 200


def test_adapter_refused_at_start_up_stops_the_server(lora_world: LoRAWorld,
                                                      tmp_path: Path) -> None:
    args = [*_engine_args(lora_world), "--lora-modules", f"d={_dora(lora_world, tmp_path)}"]
    err = tmp_path / "stderr"
    with open(err, "wb") as f:
        rc, left = run_watched([sys.executable, "-m", "launch", "serve", *args], 180, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=f)
    stderr = err.read_text(errors="replace")
    assert left == [], f"processes outlived the server: {left}"
    assert rc != 0
    assert "'d' refused by worker rank 0" in stderr and "use_dora" in stderr, stderr[-2000:]
