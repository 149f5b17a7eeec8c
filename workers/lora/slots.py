"""The device slots adapters run from, and the host cache they are copied from.

Every LoRA target (a layer's qkv, o, gate_up or down linear) has one A and one B buffer sized
for ``max_loras`` slots of ``max_lora_rank``, allocated once at start-up in the model dtype (on
CUDA before the KV cache is sized, so its memory counts against the KV budget). Which adapter
sits in which slot is the engine core's decision, sent as LoRASlotOp in the step diff; this
file only carries the ops out and keeps the rank's id -> slot map they imply.

The host cache holds prepared adapters (this rank's slice, see weights.py), at most
``max_cpu_loras``, least recently used first out. It is a cache only: an op whose adapter was
dropped from it reads the adapter's files again and checks their content hash, so what runs
never depends on what the cache kept.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from protocol.lora import LoRASlotOp
from workers.lora.weights import LoRATarget, PreparedAdapter, TargetWeights, load_adapter

logger = logging.getLogger(__name__)


class SlotBuffers:
    """One target's slots, in the layout its kernel path reads.

    Triton (``packed``): a [S, NS * R, in_features] (NS rank-R blocks of lora_A per slot, one
    per packed projection) and b [S, out_features, R] (lora_B, the scaling folded in); each
    projection's expand reads its own rows of b.

    torch (otherwise): a_t [S, in_features, NS * R] (the shrink of all packed projections is
    one GEMM per slot) and b_t [S, R, out_features], lora_B transposed: projection j's expand
    multiplies its rank block of the shrink by b_t's columns [offsets[j], offsets[j + 1]).
    """

    def __init__(self, target: LoRATarget, num_slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device, packed: bool) -> None:
        ns = len(target.projections)
        self.num_slices, self.rank, self.packed = ns, rank, packed
        self.offsets = target.offsets
        self.max_slice = max(b - a for a, b in zip(self.offsets, self.offsets[1:], strict=False))
        k, n = target.in_features, target.out_features

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(num_slots, *shape, dtype=dtype, device=device)

        if packed:
            self.a, self.b = zeros(ns * rank, k), zeros(n, rank)
            self.offsets_dev = torch.tensor(self.offsets, dtype=torch.int32, device=device)
        else:
            self.a_t, self.b_t = zeros(k, ns * rank), zeros(rank, n)
        self.grouped_mm_ok = True  # torch's grouped GEMM takes these strides (grouped.py)

    @property
    def nbytes(self) -> int:
        if self.packed:
            return self.a.nbytes + self.b.nbytes + self.offsets_dev.nbytes
        return self.a_t.nbytes + self.b_t.nbytes

    def write(self, slot: int, w: TargetWeights | None) -> None:
        """Copy one adapter's slice into ``slot``, zero-padded to the slot's rank; None: the
        adapter leaves this target alone (zeros)."""
        ns, rank = self.num_slices, self.rank
        if not self.packed:
            a_t, b_t = self.a_t[slot], self.b_t[slot]
            a_t.zero_()
            b_t.zero_()
            if w is None:
                return
            r = w.a.shape[1]
            a_t.view(-1, ns, rank)[:, :, :r].copy_(w.a.permute(2, 0, 1), non_blocking=True)
            b_t[:r].copy_(w.b.T, non_blocking=True)
            return
        a = self.a[slot].view(ns, rank, -1)
        b = self.b[slot]
        if w is None:
            a.zero_()
            b.zero_()
            return
        r = w.a.shape[1]
        a[:, :r].copy_(w.a, non_blocking=True)
        a[:, r:].zero_()
        b[:, :r].copy_(w.b, non_blocking=True)
        b[:, r:].zero_()


class SlotWeights:
    """This rank's side of the adapter slots: every target's slot buffers, the id -> slot map
    that the engine core's LoRASlotOps imply, and the host cache the slots are filled from.
    (The engine core's LoRASlots decides the assignment; this only holds the weights.)"""

    def __init__(self, targets: list[LoRATarget], num_slots: int, rank: int,
                 max_cpu_loras: int, dtype: torch.dtype, device: torch.device,
                 packed: bool) -> None:
        """packed: the Triton kernels' layout (SlotBuffers), else the torch paths'."""
        self.targets = targets
        self.num_slots, self.rank, self.dtype, self.device = num_slots, rank, dtype, device
        self.buffers = {(t.layer, t.kind): SlotBuffers(t, num_slots, rank, dtype, device, packed)
                        for t in targets}
        self.slot_ids = [0] * num_slots  # adapter id in each slot (0: empty)
        self.id_to_slot: dict[int, int] = {}
        self.host: OrderedDict[int, PreparedAdapter] = OrderedDict()
        self.max_cpu_loras = max(1, max_cpu_loras)
        # pinned host copies on CUDA: a swap is a DMA, not a pageable staging copy
        self.pin = device.type == "cuda"

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def load(self, lora_int_id: int, path: str, content_hash: str) -> PreparedAdapter:
        """Read, check and slice an adapter into the host cache (LoRAAdapterError if refused)."""
        return self.keep(self.read(lora_int_id, path, content_hash))

    def read(self, lora_int_id: int, path: str, content_hash: str) -> PreparedAdapter:
        """Read, check and slice an adapter without touching this object's state: safe on a
        helper thread beside the step loop (LoRAAdapterError if refused)."""
        ad = load_adapter(lora_int_id, path, self.targets, self.rank, self.dtype, content_hash)
        if self.pin:
            for w in ad.weights.values():
                w.a, w.b = w.a.pin_memory(), w.b.pin_memory()
        return ad

    def keep(self, ad: PreparedAdapter) -> PreparedAdapter:
        """Put a read adapter into the host cache (on the step loop)."""
        lora_int_id = ad.lora_int_id
        self.host[lora_int_id] = ad
        self.host.move_to_end(lora_int_id)
        while len(self.host) > self.max_cpu_loras:
            dropped, _ = self.host.popitem(last=False)
            logger.debug("LoRA %d dropped from the host cache", dropped)
        return ad

    def drop(self, lora_int_id: int) -> None:
        """Forget an adapter: its host copy and, should it still sit in one, its slot."""
        self.host.pop(lora_int_id, None)
        slot = self.id_to_slot.pop(lora_int_id, None)
        if slot is not None:
            self.slot_ids[slot] = 0

    def apply(self, op: LoRASlotOp) -> None:
        """Carry out one slot op (its slot in range). On LoRAAdapterError (the files vanished
        or changed since the adapter was registered) the slot is left empty and the error
        raised."""
        old = self.slot_ids[op.slot]
        if old:
            self.id_to_slot.pop(old, None)
            self.slot_ids[op.slot] = 0
        if op.lora_int_id == 0:
            return  # emptied: nothing reads an empty slot, its contents may stay
        moved = self.id_to_slot.pop(op.lora_int_id, None)
        if moved is not None:
            self.slot_ids[moved] = 0
        ad = self.host.get(op.lora_int_id)
        if ad is None or (op.content_hash and ad.content_hash != op.content_hash):
            ad = self.load(op.lora_int_id, op.lora_path, op.content_hash)
        else:
            self.host.move_to_end(op.lora_int_id)
        for key, bufs in self.buffers.items():
            bufs.write(op.slot, ad.weights.get(key))
        self.slot_ids[op.slot] = op.lora_int_id
        self.id_to_slot[op.lora_int_id] = op.slot
