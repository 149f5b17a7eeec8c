"""Turns one step's scheduling decisions into the wire diff (protocol.messages.SchedulerOutput).

The scheduler records only what changed while it schedules (overrides, grown block tables,
new / resumed requests, preemptions), so building the diff never walks the whole batch: a
steady decode step is a few dozen bytes whatever the batch size.
"""

from __future__ import annotations

import msgspec

from engine_core.kv_cache.block import KVCacheBlock
from protocol.codec import pack
from protocol.lora import LoRASlotOp, LoRAStep
from protocol.messages import (
    CachedRequestData,
    EncoderSchedulerOutput,
    NewRequestData,
    ResumedRequestData,
    SchedulerOutput,
)
from protocol.multimodal import EncoderStep


class StepDiff:
    """What one schedule() call changed, keyed by handle."""

    __slots__ = (
        "new_reqs",
        "resumed_reqs",
        "grown",
        "overrides",
        "preempted",
        "spec",
        "total",
        "lora_handles",
        "lora_ids",
        "encoder",
    )

    def __init__(self) -> None:
        self.new_reqs: list[NewRequestData] = []
        self.resumed_reqs: list[ResumedRequestData] = []
        # running-set requests that got new blocks this step
        self.grown: dict[int, list[KVCacheBlock]] = {}
        # running-set requests scheduled for != 1 token (0 = not scheduled)
        self.overrides: dict[int, int] = {}
        self.preempted: list[int] = []
        # handle -> speculative draft tokens scheduled for verification
        self.spec: dict[int, list[int]] = {}
        self.total = 0
        # new requests that run with a LoRA adapter, and their adapters' ids (base-model
        # requests appear in neither)
        self.lora_handles: list[int] = []
        self.lora_ids: list[int] = []
        # the encoder's part (images); None: a text-only step, sent as a plain SchedulerOutput
        self.encoder: EncoderStep | None = None

    def forget(self, handle: int) -> int:
        """Drop a running request's entries (it was preempted after being scheduled) and
        return how many tokens it had been given."""
        self.grown.pop(handle, None)
        self.spec.pop(handle, None)
        return self.overrides.pop(handle, 1)

    def build(
        self,
        step_id: int,
        finished: list[int],
        num_running: int,
        num_groups: int = 1,
        lora_ops: list[LoRASlotOp] | None = None,
    ) -> SchedulerOutput:
        grown = self.grown
        if grown:
            # every group grew by the same count; the ids list group 0's first (the wire rule)
            cached = CachedRequestData(
                pack(list(grown)),
                pack([len(blocks) // num_groups for blocks in grown.values()]),
                pack([b.block_id for blocks in grown.values() for b in blocks]),
            )
        else:
            cached = CachedRequestData()
        overrides = self.overrides
        spec = self.spec
        so = SchedulerOutput(
            step_id=step_id,
            new_reqs=self.new_reqs,
            resumed_reqs=self.resumed_reqs,
            cached_reqs=cached,
            finished_handles=pack(finished) if finished else b"",
            preempted_handles=pack(self.preempted) if self.preempted else b"",
            sched_override_handles=pack(list(overrides)) if overrides else b"",
            sched_override_counts=pack(list(overrides.values())) if overrides else b"",
            spec_handles=pack(list(spec)) if spec else b"",
            spec_token_counts=pack([len(t) for t in spec.values()]) if spec else b"",
            spec_token_ids=pack([t for ts in spec.values() for t in ts]) if spec else b"",
            num_running=num_running,
            total_num_scheduled_tokens=self.total,
            lora=self._lora(lora_ops),
        )
        if self.encoder is None:
            return so
        return EncoderSchedulerOutput(**msgspec.structs.asdict(so), encoder=self.encoder)

    def _lora(self, ops: list[LoRASlotOp] | None) -> LoRAStep | None:
        """The step's LoRA part: None (one nil byte) unless it loads or empties a slot or
        admits an adapter request."""
        handles = self.lora_handles
        if not ops and not handles:
            return None
        return LoRAStep(
            ops=ops or [],
            handles=pack(handles) if handles else b"",
            lora_int_ids=pack(self.lora_ids) if handles else b"",
        )
