"""The device's adapter slots, owned by the scheduler as it owns KV blocks.

Every rank has ``max_loras`` slots of LoRA weights on its device. The scheduler decides which
adapter sits in which slot and tells every rank with a LoRASlotOp in the step's diff (once per
load), so no rank ever runs its own eviction.

- A running request's adapter is in a slot, pinned: a slot is evictable only when no running
  request uses its adapter, and among those the least recently used one goes first (an empty
  slot before any). So the adapters of one step's running requests are at most ``max_loras``:
  the per-step adapter budget holds by construction.
- Admission (sched/admission.py) asks ``skip`` before it admits an adapter request: one whose
  adapter would be a new kind while every slot is pinned is skipped and the scan goes on
  (vLLM's rule); skipped requests go back to the front of the waiting queue, in order.
- Aging guard: skipping alone can starve an adapter, because the running adapters keep their
  slots as long as requests of theirs keep being admitted. Once a request has been skipped more
  than ``starvation_passes`` admission passes, it is *starving*: from it onwards in the scan
  (the same pass) no adapter request is admitted unless it uses the starving request's adapter.
  Requests ahead of it in the queue and base-model requests are unaffected (they take no
  slot). The pinned adapters then drain, a slot frees, and the starving adapter takes it,
  since nothing behind it may claim a slot first. Requests of already running adapters behind
  it are held too: admitting them would keep their adapter's slot pinned forever.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from engine_core.request import Request
from protocol.lora import LoRASlotOp

# Admission passes a request may be skipped for want of a slot before the aging guard holds
# other adapters back for it. A pass is one step's admission scan (tens of milliseconds on a
# GPU): skipping is the throughput-friendly choice (a batch keeps filling with adapters that
# are resident), so it is allowed a few dozen steps before fairness wins over it.
STARVATION_PASSES = 16


class LoRASlots:
    def __init__(self, max_loras: int, starvation_passes: int = STARVATION_PASSES) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self.starvation_passes = starvation_passes
        self.slot_ids = [0] * max_loras  # adapter id in each slot; 0: empty
        self.slot_of: dict[int, int] = {}  # adapter id -> its slot
        self.pins: dict[int, int] = {}  # adapter id -> running requests using it (> 0)
        # slots whose adapter no running request uses, least recently used first
        self._idle: OrderedDict[int, None] = OrderedDict()
        self.ops: list[LoRASlotOp] = []  # for the next step's diff, in order
        self._starving = 0  # this pass's starving adapter (0: none)
        self.num_loads = 0
        self.num_evictions = 0
        self.num_skips = 0

    # ------------------------------------------------------------------ admission

    def begin_pass(self) -> None:
        self._starving = 0

    def skip(self, req: Request) -> bool:
        """Whether admission must pass over ``req`` (an adapter request) in this pass."""
        lid = req.lora_int_id
        starving = self._starving
        if starving and lid != starving:
            blocked = True  # the aging guard: behind a starving request, only its adapter
        else:
            blocked = lid not in self.pins and len(self.pins) >= self.max_loras
        if blocked:
            req.lora_skips += 1
            self.num_skips += 1
            if not starving and req.lora_skips > self.starvation_passes:
                self._starving = lid
        return blocked

    def acquire(self, req: Request) -> None:
        """``req`` (an adapter request) joins the running set: pin its adapter's slot, loading
        the adapter into one (and telling the ranks) when it is in none."""
        lid = req.lora_int_id
        n = self.pins.get(lid, 0)
        self.pins[lid] = n + 1
        if n:
            return
        slot = self.slot_of.get(lid)
        if slot is not None:
            del self._idle[slot]
            return
        slot = self._take_slot()
        self.slot_ids[slot] = lid
        self.slot_of[lid] = slot
        lora = req.lora
        assert lora is not None
        self.ops.append(
            LoRASlotOp(slot, lid, lora.lora_name, lora.lora_path, req.lora_hash)
        )
        self.num_loads += 1

    def _take_slot(self) -> int:
        """An empty slot (the lowest), else the least recently used idle one (evicted)."""
        for slot, lid in enumerate(self.slot_ids):
            if lid == 0:
                return slot
        if not self._idle:
            raise AssertionError("no adapter slot is free or evictable: admission let too "
                                 "many adapters in")
        slot, _ = self._idle.popitem(last=False)
        del self.slot_of[self.slot_ids[slot]]
        self.num_evictions += 1
        return slot

    def release(self, req: Request) -> None:
        """``req`` left the running set (finished or preempted)."""
        lid = req.lora_int_id
        n = self.pins[lid] - 1
        if n:
            self.pins[lid] = n
            return
        del self.pins[lid]
        self._idle[self.slot_of[lid]] = None  # the most recently used idle slot

    # ------------------------------------------------------------------ unload

    def forget(self, lora_int_id: int) -> bool:
        """The adapter was unloaded (no request uses it): empty its slot. True when it was in
        one: then the next step carries the op that empties it."""
        assert lora_int_id not in self.pins, f"adapter {lora_int_id} is still running"
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is None:
            return False
        del self._idle[slot]
        self.slot_ids[slot] = 0
        self.ops.append(LoRASlotOp(slot, 0))
        return True

    def take_ops(self) -> list[LoRASlotOp]:
        ops, self.ops = self.ops, []
        return ops

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict[str, float]:
        return {
            "lora_max_loras": float(self.max_loras),
            "lora_slots_used": float(len(self.slot_of)),
            "lora_running_adapters": float(len(self.pins)),
            "lora_loads": float(self.num_loads),
            "lora_evictions": float(self.num_evictions),
            "lora_skips": float(self.num_skips),
        }

    def check(self, running: Iterable[Request]) -> None:
        """Debug invariants: every running adapter request's adapter is in a slot and pinned
        once per such request; at most max_loras adapters run; the maps agree."""
        want: dict[int, int] = {}
        for r in running:
            if r.lora is not None:
                want[r.lora_int_id] = want.get(r.lora_int_id, 0) + 1
                assert r.lora_int_id in self.slot_of, f"{r}: its adapter is in no slot"
        assert want == self.pins, f"adapter pins {self.pins} != running requests' {want}"
        assert len(want) <= self.max_loras, f"{len(want)} adapters run, max_loras {self.max_loras}"
        assert {lid: s for s, lid in enumerate(self.slot_ids) if lid} == self.slot_of
        idle = {s for lid, s in self.slot_of.items() if lid not in self.pins}
        assert idle == set(self._idle), f"idle slots {set(self._idle)} != {idle}"
