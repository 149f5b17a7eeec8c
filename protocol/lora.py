"""LoRA adapters on the wire: what names an adapter, and what crosses per adapter and per step.

Who decides what (see DESIGN.md, "state every rank must agree on"):
- The frontend names an adapter with a LoRARequest (vLLM's fields). It reaches the engine core
  inside an AddRequest (the first time a request uses it) or a LoadLoRA (the HTTP load
  endpoint, ``--lora-modules`` at start-up).
- The engine core registers it once: it hashes the adapter's files (``content_hash``) and
  broadcasts PrepareLoRA; every rank reads and checks the PEFT directory, keeps its own
  tensor-parallel slice in host memory and answers LoRAReady. A request using the adapter
  waits outside the scheduler until every rank is ready (as constrained requests wait for
  their grammar), so no step waits on a disk read and a refused adapter fails only its
  requests.
- The scheduler owns the ``max_loras`` device slots, as it owns KV blocks: it puts adapters
  into slots (LRU over slots no running request uses) and sends the same LoRASlotOp to every
  rank in the step's SchedulerOutput (LoRAStep), once per load. A new request's adapter id
  travels once, in the same LoRAStep (a base-model request appears nowhere: it costs no
  byte); each rank finds the slot from the ops it applied, so no two ranks can disagree about
  which adapter a row uses.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    """An adapter as the user names it (vLLM's LoRARequest): ``lora_int_id`` >= 1 is the
    engine's key for it; ``lora_path`` a PEFT directory (adapter_config.json +
    adapter_model.safetensors) every rank can read."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class LoRASlotOp(msgspec.Struct, array_like=True, frozen=True):
    """Put adapter ``lora_int_id`` into device slot ``slot`` (0 <= slot < max_loras) before
    this step runs; ``lora_int_id`` 0 empties the slot. Name, path and content hash travel
    with the op so a rank that dropped the adapter from host memory can read it again and
    check it is the same one."""

    slot: int
    lora_int_id: int
    lora_name: str = ""
    lora_path: str = ""
    content_hash: str = ""


class LoRAStep(msgspec.Struct, array_like=True, kw_only=True):
    """The LoRA part of one step's diff. ``ops`` run first, then new requests are added:
    ``handles`` (packed int32) are the step's new requests that run with an adapter and
    ``lora_int_ids`` (packed int32) their adapters', in the same order."""

    ops: list[LoRASlotOp] = []
    handles: bytes = b""
    lora_int_ids: bytes = b""
