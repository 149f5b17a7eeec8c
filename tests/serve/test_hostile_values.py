"""The guard: a table of hostile values for every field a client controls (the request body's
fields that become an AddRequest, `kv_transfer_params`, and adapter files and configs through
the runtime load endpoint), sent to one real server (real engine core and rank) with LoRA and
the KV connector on. After each value the answer is a 2xx or a 4xx in the OpenAI error shape
with no traceback or source path, the engine is healthy, and /census is back at idle: no value
may raise inside the engine core or a rank, or leave state behind."""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_helpers import Server, make_tokenizer_dir, serve

from tests.helpers.lora import LoRAWorld

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

GOOD = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
KV_DEAD_PEER = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "127.0.0.1",
                "remote_port": 1, "remote_block_ids": [1], "remote_request_id": "k",
                "remote_rank_ports": [1], "tp_size": 1, "remote_num_tokens": 3}

# (field, value): each merged into GOOD. Values a JSON body can carry that are wrong by type,
# sign, size or content; the engine must refuse or survive every one.
BODY_VALUES: list[tuple[str, Any]] = [
    ("request_id", "\x00kv-held:victim#1"), ("request_id", "x" * 10_000),
    ("request_id", "a\nb"), ("request_id", ""), ("request_id", 7), ("request_id", ["a"]),
    ("prompt", []), ("prompt", [-1]), ("prompt", [2**31]), ("prompt", [2**70]),
    ("prompt", [[1, 2], [3, 4]]), ("prompt", [1.5]), ("prompt", {"a": 1}), ("prompt", None),
    ("prompt", "\udcff"), ("prompt", [1] * 5000),
    ("max_tokens", -1), ("max_tokens", 0), ("max_tokens", 2**63), ("max_tokens", "2"),
    ("min_tokens", 2**40), ("n", 0), ("n", 10**6), ("n", -3),
    ("temperature", -1), ("temperature", 1e308), ("temperature", "hot"),
    ("top_p", 0), ("top_p", 7), ("top_k", -5), ("top_k", 2**40), ("min_p", -0.5),
    ("seed", -(2**64)), ("seed", 2**64), ("seed", 1.5),
    ("stop", [""] * 3), ("stop", ["x" * 100_000]), ("stop", [1, 2]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [2**33]),
    ("logit_bias", {"99999": 5}), ("logit_bias", {"1": 1e30}), ("logit_bias", {"x": 1}),
    ("logprobs", -1), ("logprobs", 10**6),
    ("priority", 2**40), ("priority", "high"),
    ("cache_salt", "s" * 100_000), ("cache_salt", 5), ("cache_salt", "\x00"),
    ("job_id", 5), ("job_id", "j" * 10_000), ("is_last_step", "yes"), ("tool_name", ["t"]),
    ("model", "no-such-adapter"), ("model", "../" * 50), ("model", 3),
    ("stream_options", {"include_usage": "x"}),
    ("kv_transfer_params", "not an object"), ("kv_transfer_params", [1]),
    ("kv_transfer_params", {"do_remote_prefill": "yes"}),
    ("kv_transfer_params", KV_DEAD_PEER),  # a peer that is not there: fails or recomputes
    ("kv_transfer_params", KV_DEAD_PEER | {"remote_port": -1}),
    ("kv_transfer_params", KV_DEAD_PEER | {"remote_port": 70_000}),
    ("kv_transfer_params", KV_DEAD_PEER | {"remote_port": "1"}),
    ("kv_transfer_params", KV_DEAD_PEER | {"remote_block_ids": [-1, 2**40]}),
    ("kv_transfer_params", KV_DEAD_PEER | {"remote_block_ids": list(range(100_000))}),
    ("kv_transfer_params", KV_DEAD_PEER | {"remote_rank_ports": [0] * 1000}),
    ("kv_transfer_params", KV_DEAD_PEER | {"tp_size": 10**9}),
    ("kv_transfer_params", KV_DEAD_PEER | {"remote_lease_s": -1}),
    ("kv_transfer_params", KV_DEAD_PEER | {"remote_lease_s": 1e308}),
    ("kv_transfer_params", KV_DEAD_PEER | {"remote_num_tokens": 2**62}),
    ("kv_transfer_params", KV_DEAD_PEER | {"remote_host": "h" * 10_000}),
    ("kv_transfer_params", KV_DEAD_PEER | {"remote_host": "999.1.1.1:5;rm"}),
    ("kv_transfer_params", KV_DEAD_PEER | {"remote_request_id": "\x00kv-held:x"}),
    ("kv_transfer_params", KV_DEAD_PEER | {"remote_engine_id": "\x00" * 64}),
    ("kv_transfer_params", {"do_remote_decode": True, "unknown_key": {"deep": [1, 2]}}),
]

# adapter_config.json edits (merged into a real adapter's config), each refused at load
CONFIG_EDITS: list[dict[str, Any]] = [
    {"r": 0}, {"r": -4}, {"r": 10**9}, {"r": "8"}, {"lora_alpha": math.inf},
    {"lora_alpha": math.nan}, {"target_modules": "(a+)+$"}, {"target_modules": ["(.*a){20}"]},
    {"target_modules": []}, {"target_modules": 7}, {"rank_pattern": {"(x+)+y": 4}},
    {"rank_pattern": {"q_proj": -1}}, {"alpha_pattern": {"q_proj": "big"}},
    {"rank_pattern": [1, 2]}, {"use_dora": True}, {"peft_type": "PREFIX_TUNING"},
]


def _assert_clean_answer(r: httpx.Response, what: str) -> None:
    assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:500]}"
    text = r.text
    for leak in ("Traceback", 'File "', ".py", "/work/", "/tmp/"):
        assert leak not in text, f"{what}: the answer leaks {leak!r}: {text[:500]}"


def _assert_idle(server: Server, what: str, timeout_s: float = 60.0) -> None:
    """Healthy, and every per-request map of every process empty again (ranks report their
    census every 0.5 s, so poll)."""
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200, what
    deadline = time.monotonic() + timeout_s
    while True:
        body = httpx.get(server.base_url + "/census", timeout=30).json()
        if "rank0" in body["census"] and not body["leftovers"]:
            return
        assert time.monotonic() < deadline, f"{what}: not idle after {timeout_s} s: {body}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(lora_world: LoRAWorld, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Server]:
    tok = make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")), vocab_size=256)
    args = ["--model", lora_world.base, "--dtype", "float32", "--tokenizer", tok,
            "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "32", "--max-model-len", "256",
            "--kv-transfer-config", '{"kv_role": "kv_both", "kv_transfer_timeout_s": 5}']
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_ALLOW_RUNTIME_LORA_UPDATING", "1")
        with serve(*args, log_dir=str(tmp_path_factory.mktemp("log"))) as s:
            yield s


def test_hostile_body_values(server: Server) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        for i, (name, value) in enumerate(BODY_VALUES):
            what = f"{name}={json.dumps(value)[:80]}"
            body = GOOD | {name: value, "request_id": f"guard-{i}"} if name != "request_id" \
                else GOOD | {name: value}
            raw = json.dumps(body).encode()
            for route, payload in (("/v1/completions", raw),
                                   ("/v1/completions", json.dumps(
                                       json.loads(raw) | {"stream": True}).encode())):
                r = c.post(route, content=payload, headers={"Content-Type": "application/json"})
                _assert_clean_answer(r, what)
            _assert_idle(server, what)
        # and still serving the same tokens as before the table
        r = c.post("/v1/completions", json=GOOD)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def _adapter_variant(world: LoRAWorld, root: Path, name: str, edit: dict[str, Any]) -> str:
    path = root / name
    shutil.copytree(world.adapters[0], path)
    cfg_path = path / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(cfg | edit))  # NaN / Infinity written as JSON5-style tokens
    return str(path)


def test_hostile_adapters(server: Server, lora_world: LoRAWorld, tmp_path: Path) -> None:
    variants: list[tuple[str, str]] = [
        (f"cfg{i}", _adapter_variant(lora_world, tmp_path, f"cfg{i}", edit))
        for i, edit in enumerate(CONFIG_EDITS)
    ]
    # files that are not adapters at all
    broken = tmp_path / "broken"
    shutil.copytree(lora_world.adapters[0], broken)
    (broken / "adapter_config.json").write_text("{not json")
    truncated = tmp_path / "truncated"
    shutil.copytree(lora_world.adapters[0], truncated)
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    header_bomb = tmp_path / "header_bomb"
    shutil.copytree(lora_world.adapters[0], header_bomb)
    (header_bomb / "adapter_model.safetensors").write_bytes((2**62).to_bytes(8, "little"))
    variants += [("broken", str(broken)), ("truncated", str(truncated)),
                 ("header_bomb", str(header_bomb)), ("missing", str(tmp_path / "nope")),
                 ("a_file", str(weights)), ("root", "/")]
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        for name, path in variants:
            r = c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            assert 400 <= r.status_code < 500, f"{name}: {r.status_code} {r.text[:300]}"
            _assert_clean_answer(r, name)
            _assert_idle(server, name)
        for name, value in (("lora_name", ""), ("lora_name", "\x00"), ("lora_path", ""),
                            ("lora_name", 5), ("lora_path", ["x"])):
            body = {"lora_name": "x", "lora_path": lora_world.adapters[0]} | {name: value}
            r = c.post("/v1/load_lora_adapter", json=body)
            _assert_clean_answer(r, f"{name}={value!r}")
        # a good adapter still loads and serves after all of it
        r = c.post("/v1/load_lora_adapter",
                   json={"lora_name": "good", "lora_path": lora_world.adapters[0]})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json=GOOD | {"model": "good"})
        assert r.status_code == 200, r.text
        _assert_idle(server, "after the good adapter")
