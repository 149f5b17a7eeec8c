"""Every per-request option reaches the engine the same way from generate() and
generate_stream() (both pass them by name as one value), a frame the engine core cannot decode
is answered to its caller, and kv_transfer_config takes the same forms as on the command line.

One real engine: the tiny LoRA world's base model with an adapter, the KV connector (kv_both,
given as the flag's JSON string) and the priority policy, so every option is live."""

from __future__ import annotations

import queue

import msgspec
import pytest

from launch import LLM, LoRARequest, SamplingParams
from launch.client import Tracked
from launch.llm import _engine_config
from protocol.codec import HEADER
from protocol.kv_connector import KVTransferConfig, KVTransferParams
from tests.helpers.lora import LoRAWorld
from tests.helpers.procs import wait_no_descendants

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [[5, 9, 2, 7, 11], [3, 1, 4, 1, 5, 9, 2, 6], [8, 8, 8]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(lora_world: LoRAWorld):
    try:
        with LLM(lora_world.base, enable_lora=True, dtype="float32", max_lora_rank=32,
                 load_tokenizer=False, startup_timeout_s=120, scheduling_policy="priority",
                 kv_transfer_config='{"kv_role": "kv_both"}') as llm:
            yield llm
    finally:
        assert wait_no_descendants(10) == []


def test_stream_equals_generate_with_every_option(llm: LLM, lora_world: LoRAWorld) -> None:
    adapter = LoRARequest("a1", 1, lora_world.adapters[0])
    options = dict(
        priority=[2, 0, 1],
        cache_salt="tenant-a",
        job_id=["job-1", None, "job-2"],
        is_last_step=[False, False, True],
        tool_name="search",
        # a prefill for a remote decode: its answer carries the lease it holds
        kv_transfer_params=[KVTransferParams(do_remote_decode=True), None, None],
        lora_request=[adapter, None, adapter],
    )
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, timeout_s=120, **options)
    for o in outs:
        assert o.finish_reason == "length", o.error
    assert outs[0].kv_transfer_params is not None and outs[1].kv_transfer_params is None
    streamed: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    reasons: dict[int, str | None] = {}
    for ev in llm.generate_stream(PROMPTS, GREEDY, timeout_s=120, **options):
        streamed[ev.index] += ev.new_token_ids
        if ev.finish_reason is not None:
            reasons[ev.index] = ev.finish_reason
    assert [streamed[i] for i in range(len(PROMPTS))] == [o.token_ids for o in outs]
    assert reasons == {i: "length" for i in range(len(PROMPTS))}
    # the adapter was used: its tokens differ from the base model's on the same prompt
    base = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, timeout_s=120)[0]
    assert base.token_ids != outs[0].token_ids


def test_an_undecodable_request_is_answered(llm: LLM) -> None:
    """An AddRequest whose body the engine core cannot decode fails that request (its caller
    hears why) instead of being dropped while the caller waits."""
    client = llm.client
    assert client is not None
    sink: queue.Queue = queue.Queue()
    rid = "garbled-1"
    with client.tracked_lock:
        client.tracked[rid] = Tracked(rid, 0, sink, 0.0)
    # the AddRequest tag and an id, then a prompt and sampling params of the wrong types
    frame = HEADER + msgspec.msgpack.encode([1, rid, "not bytes", {"temperature": "hot"}])
    with client.send_lock:
        client.push.send(frame)
    delivery = sink.get(timeout=30)
    (_, out, _), = delivery
    assert out.request_id == rid and out.finish_reason == "error"
    assert "could not decode" in (out.error or "")
    # the engine goes on serving
    assert llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False, timeout_s=60)[0].finish_reason \
        == "length"


@pytest.mark.parametrize("form", [
    '{"kv_role": "kv_consumer", "kv_lease_s": 50}',
    {"kv_role": "kv_consumer", "kv_lease_s": 50},
    KVTransferConfig(kv_role="kv_consumer", kv_lease_s=50),
])
def test_kv_transfer_config_forms(form: object) -> None:
    cfg = _engine_config("dummy:tiny", 1, {"kv_transfer_config": form}).kv_transfer_config
    assert cfg is not None and cfg.kv_role == "kv_consumer" and cfg.kv_lease_s == 50


@pytest.mark.parametrize("form, needle", [
    ('{"kv_role": "kv_both", "kv_lease_s": "long"}', "kv_lease_s"),
    ('{"kv_role": ', "kv_transfer_config"),
    ({"kv_role": "sideways"}, "kv_role"),
    (42, "kv_transfer_config"),
])
def test_kv_transfer_config_refusals_name_the_problem(form: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        _engine_config("dummy:tiny", 1, {"kv_transfer_config": form})
