"""Wire bytes of LoRA adapters, measured on step plans of the real Scheduler.

What crosses per adapter: PrepareLoRA once (engine core -> every rank), a LoRAReady per rank,
a LoRASlotOp in the step diff each time the adapter is loaded into a slot, a DropLoRA when it
is unloaded. Per request: a base-model request costs nothing (its step plan is byte-identical
with LoRA off); an adapter request adds its (handle, adapter id) pair, once, in its first step.
A steady decode step lists nobody, with adapters or without.
"""

from __future__ import annotations

import msgspec

from engine_core.request import Request
from engine_core.sched.scheduler import Scheduler
from protocol.codec import Encoder, pack
from protocol.config import EngineConfig
from protocol.lora import LoRARequest, LoRASlotOp
from protocol.messages import (
    DropLoRA,
    LoRAReady,
    ModelRunnerOutput,
    PrepareLoRA,
    SamplingParams,
    SchedulerOutput,
)
from protocol.request_options import RequestOptions

ENC = Encoder()
# a realistic adapter: a path of a few dozen characters, a sha256 in hex
LORA = LoRARequest("sql-lora", 1, "/models/adapters/llama-3-8b-sql-lora")
HASH = "9f2c" * 16


def frame(msg: msgspec.Struct) -> int:
    return len(ENC.encode(msg))


def _sched(lora: bool, max_loras: int = 4) -> Scheduler:
    cfg = EngineConfig(max_num_seqs=256, prefix_hash="fast", enable_lora=lora,
                       max_loras=max_loras)
    return Scheduler(cfg, 40_000, 8192, 8192, eos_token_id=None)


def _req(rid: str, prompt_len: int, adapter: int = 0) -> Request:
    lora = (LoRARequest(f"lora-{adapter}", adapter, f"/models/adapters/lora-{adapter}")
            if adapter else None)
    r = Request(rid, [7 + (i % 900) for i in range(prompt_len)],
                SamplingParams(max_tokens=100_000, ignore_eos=True), None, 0.0,
                RequestOptions(lora=lora))
    if adapter:
        r.lora_hash = f"{adapter:064x}"
    return r


def _step(s: Scheduler) -> SchedulerOutput:
    so = s.schedule()
    handles = [r.handle for r in s.running if r.num_computed_tokens >= r.num_tokens]
    out = ModelRunnerOutput(step_id=so.step_id, rank=0, req_handles=pack(handles),
                            sampled_token_ids=pack([11] * len(handles)))
    s.update_from_output(so, out)
    s.take_outputs()
    return so


def _first_step(lora: bool, adapters: list[int]) -> SchedulerOutput:
    s = _sched(lora)
    for i, a in enumerate(adapters):
        s.add_request(_req(f"r{i}", 64, a))
    return s.schedule()


def _decode_step(adapters: list[int], lora: bool) -> int:
    """Bytes of a steady decode step of one request per entry of ``adapters``."""
    s = _sched(lora, max_loras=max(1, len(set(adapters) - {0})))
    for i, a in enumerate(adapters):
        s.add_request(_req(f"d{i}", 64 + 7 * i, a))
    while s.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in s.running):
        _step(s)
    _step(s)
    sizes = sorted(frame(_step(s)) for _ in range(16))
    return sizes[len(sizes) // 2]


def wire(batch: int = 64, num_adapters: int = 4) -> dict[str, float]:
    base_off = _first_step(False, [0])
    base_on = _first_step(True, [0])
    one = _first_step(True, [1])  # an adapter request: its slot load and its pair
    two = _first_step(True, [1, 1])  # a second request of the same adapter: a pair only
    two_base = _first_step(True, [0, 0])
    assert one.lora is not None and len(one.lora.ops) == 1
    mixed = [1 + i % num_adapters for i in range(batch)]
    return {
        "prepare_lora_bytes": float(frame(PrepareLoRA(LORA, HASH))),
        "lora_ready_bytes": float(frame(LoRAReady(rank=1, lora_int_id=1))),
        "drop_lora_bytes": float(frame(DropLoRA(1))),
        "slot_op_bytes": float(len(msgspec.msgpack.encode(
            LoRASlotOp(0, LORA.lora_int_id, LORA.lora_name, LORA.lora_path, HASH)))),
        "empty_slot_op_bytes": float(len(msgspec.msgpack.encode(LoRASlotOp(0, 0)))),
        "base_request_bytes_lora_off": float(frame(base_off)),
        "base_request_bytes_lora_on": float(frame(base_on)),
        "base_request_extra_bytes": float(frame(base_on) - frame(base_off)),
        # the first adapter request: LoRAStep (its slot op and its pair) beyond a base request
        "first_adapter_request_extra_bytes": float(frame(one) - frame(base_on)),
        # each further adapter request in a step: its (handle, adapter id) pair
        "adapter_request_extra_bytes": float(
            (frame(two) - frame(two_base)) - (frame(one) - frame(base_on))),
        "decode_step_bytes_base": float(_decode_step([0] * batch, False)),
        "decode_step_bytes_lora_on_base": float(_decode_step([0] * batch, True)),
        "decode_step_bytes_adapters": float(_decode_step(mixed, True)),
        "decode_batch": float(batch),
        "decode_num_adapters": float(num_adapters),
    }
