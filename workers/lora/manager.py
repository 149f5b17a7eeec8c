"""The model runner's LoRA side: built once at start-up with ``--enable-lora``, it wraps the
model's linears, owns the slots and the host cache, and turns each step's diff and batch into
the token groups the wrappers read.

Per step, in the runner's order:
1. ``apply_ops``: the step's LoRASlotOps, before the batch takes its new requests; every rank
   then agrees (MIN all-reduce, only in steps with ops) on which ops succeeded, so an adapter
   whose files vanished or changed fails its requests on every rank alike;
2. the input batch looks each (re)added row's slot up through ``slot_of``;
3. ``check_rows``: no running row reads a slot that this step's ops gave to another adapter;
4. ``begin_step``: the token groups, or None when no row runs an adapter (a cheap check on the
   batch's slot column), and then the step runs no LoRA op at all.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

from protocol.config import EngineConfig, default_max_batched_tokens
from protocol.lora import LoRARequest, LoRASlotOp
from workers.lora.grouped import group_tokens, select_path
from workers.lora.layers import LoRAState, install
from workers.lora.peft_config import LoRAAdapterError, max_rank
from workers.lora.slots import SlotWeights
from workers.lora.weights import lora_targets
from workers.parallel.distributed import tp_all_reduce_min
from workers.runner.block_table import StateMismatchError

if TYPE_CHECKING:
    from workers.lora.weights import PreparedAdapter
    from workers.model.llama import LlamaForCausalLM
    from workers.runner.input_batch import BatchInputs, CachedRequestState, InputBatch

logger = logging.getLogger(__name__)

DEFAULT_MAX_LORA_RANK = 16  # max_lora_rank None (no --max-lora-rank and no start-up adapters)
# TEST-ONLY: a path; an adapter read waits (at most LOAD_GATE_TIMEOUT_S) until it exists, so
# the suite can hold a load in flight and count the steps that run meanwhile. Unset in real use.
LOAD_GATE_ENV = "TANDEM_FAULT_LORA_LOAD_GATE"
LOAD_GATE_TIMEOUT_S = 60.0


def slot_rank(config: EngineConfig) -> int:
    """The rank of every slot: max_lora_rank, else (None) the largest rank among the start-up
    adapters (--lora-modules) this rank can read, else 16. An unreadable start-up adapter is
    left to its PrepareLoRA, which answers why."""
    if config.max_lora_rank is not None:
        return config.max_lora_rank
    ranks = []
    for m in config.lora_modules:
        try:
            ranks.append(max_rank(m.lora_path))
        except (LoRAAdapterError, OSError):
            pass
    return max(ranks, default=DEFAULT_MAX_LORA_RANK)


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, batch: InputBatch,
                 dtype: torch.dtype, device: torch.device, path: str | None = None) -> None:
        """``path``: the kernel path (grouped.PATHS), None to choose it for the device."""
        self.rank = slot_rank(config)
        targets = lora_targets(model)
        if not targets:
            raise ValueError("--enable-lora: this model has no linear layer LoRA can adapt")
        max_cpu = config.max_cpu_loras if config.max_cpu_loras is not None else config.max_loras
        path = path or select_path(device)
        self.slots = SlotWeights(targets, config.max_loras, self.rank, max_cpu, dtype, device,
                               packed=path == "triton")
        self.state = LoRAState(path)
        install(model, targets, self.slots.buffers, self.state)
        self.device = device
        self.batch = batch
        self.profile_tokens = (config.max_num_batched_tokens
                               or default_max_batched_tokens(device.type))
        batch.lora_slot_of = self.slot_of
        # one adapter read at a time, off the step loop (a hostile file costs that thread)
        self._read_lock = threading.Lock()
        # adapter id -> why its latest slot op failed on some rank (its requests fail)
        self.failed: dict[int, str] = {}
        self._changed: set[int] = set()  # slots this step's ops touched
        logger.info("LoRA: %d slots of rank %d, %.1f MiB of slot buffers, %s kernels",
                    config.max_loras, self.rank, self.slots.nbytes / 2**20, self.state.path_name)

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes

    # ------------------------------------------------------------------ adapters

    def prepare(self, lora: LoRARequest, content_hash: str) -> str:
        """PrepareLoRA, waited for: read, check and slice into the host cache; the refusal,
        or ""."""
        return self.finish_prepare(lora, self.begin_prepare(lora, content_hash))

    def begin_prepare(self, lora: LoRARequest, content_hash: str) -> Future[PreparedAdapter | None]:
        """PrepareLoRA: read, check and slice the adapter on a helper thread (the step loop
        goes on; it polls the future and hands it to finish_prepare). The result is None when
        this very content is in host memory already."""
        fut: Future[PreparedAdapter | None] = Future()
        held = self.slots.host.get(lora.lora_int_id)
        if held is not None and content_hash and held.content_hash == content_hash:
            fut.set_result(None)
            return fut
        _run_daemon(fut, lambda: self._read(lora, content_hash))
        return fut

    def _read(self, lora: LoRARequest, content_hash: str) -> PreparedAdapter:
        with self._read_lock:
            _wait_for_gate()
            return self.slots.read(lora.lora_int_id, lora.lora_path, content_hash)

    def finish_prepare(self, lora: LoRARequest, fut: Future[PreparedAdapter | None],
                       keep: bool = True) -> str:
        """On the step loop, once ``fut`` is done: keep the adapter in host memory (unless
        ``keep`` is False: it was dropped meanwhile) and say why it was refused, or ""."""
        try:
            ad = fut.result()
        except LoRAAdapterError as e:
            return f"LoRA adapter {lora.lora_name!r}: {e}"
        except Exception as e:  # noqa: BLE001 - a bad adapter fails itself, never the rank
            logger.error("preparing LoRA adapter %r failed: %s: %s", lora.lora_name,
                         type(e).__name__, e)
            return f"LoRA adapter {lora.lora_name!r}: {type(e).__name__}: {e}"
        if ad is not None and keep:
            self.slots.keep(ad)
        return ""

    def drop(self, lora_int_id: int) -> None:
        """DropLoRA: forget the host copy and any slot mapping."""
        self.slots.drop(lora_int_id)
        self.failed.pop(lora_int_id, None)

    # ------------------------------------------------------------------ per step

    def apply_ops(self, ops: list[LoRASlotOp]) -> None:
        if not ops:
            return
        errors = []
        for op in ops:
            if not 0 <= op.slot < self.slots.num_slots or op.lora_int_id < 0:
                raise StateMismatchError(f"LoRA slot op {op}: slot or id out of range "
                                         f"(max_loras={self.slots.num_slots})")
            self._changed.add(op.slot)
            moved = self.slots.id_to_slot.get(op.lora_int_id)
            if moved is not None:  # the adapter leaves its old slot: check that one too
                self._changed.add(moved)
            try:
                self.slots.apply(op)
                errors.append("")
            except Exception as e:  # noqa: BLE001 - the adapter's requests fail, not the rank
                errors.append(str(e) if isinstance(e, LoRAAdapterError)
                              else f"{type(e).__name__}: {e}")
        agreed = tp_all_reduce_min([0 if e else 1 for e in errors], self.device)
        for op, err, ok in zip(ops, errors, agreed, strict=True):
            if op.lora_int_id == 0:
                continue
            if ok:
                self.failed.pop(op.lora_int_id, None)
                continue
            reason = err or "another tensor-parallel rank could not load it"
            self.failed[op.lora_int_id] = (f"LoRA adapter {op.lora_name!r} could not be put "
                                           f"into slot {op.slot}: {reason}")
            logger.error("%s", self.failed[op.lora_int_id])
            if self.slots.id_to_slot.get(op.lora_int_id) == op.slot:
                # loaded here but not on every rank: no rank may run it
                self.slots.apply(LoRASlotOp(slot=op.slot, lora_int_id=0))

    def slot_of(self, st: CachedRequestState) -> int:
        """The slot a (new or resumed) request's row reads; -1, with the request failed, when
        its adapter's slot op failed."""
        slot = self.slots.id_to_slot.get(st.lora_int_id)
        if slot is not None:
            return slot
        reason = self.failed.get(st.lora_int_id)
        if reason is None:
            raise StateMismatchError(f"request {st.handle} runs LoRA adapter {st.lora_int_id}, "
                                     "which sits in no slot")
        self.batch.failed[st.handle] = reason
        return -1

    def check_rows(self) -> None:
        """After the batch applied the diff: the rows reading a slot this step's ops touched
        run the adapter now in it (the scheduler never replaces a running request's
        adapter)."""
        if not self._changed:
            return
        b = self.batch
        slots = b.lora_slot[: b.num_rows]
        for slot in sorted(self._changed):
            for row in np.flatnonzero(slots == slot).tolist():
                st = b.states[int(b.handles[row])]
                if self.slots.slot_ids[slot] != st.lora_int_id:
                    raise StateMismatchError(
                        f"request {st.handle} runs LoRA adapter {st.lora_int_id} from slot "
                        f"{slot}, which this step's ops gave to {self.slots.slot_ids[slot]}")
        self._changed.clear()

    def begin_step(self, inputs: BatchInputs) -> bool:
        """Group this step's tokens by slot for the wrappers; False (and no LoRA op in the
        forward) when no row runs an adapter."""
        b = self.batch
        n = b.num_rows
        if not n or b.lora_slot[:n].max() < 0:
            self.state.groups = None
            return False
        per_row = b.lora_slot[inputs.rows]
        tokens = (per_row if len(per_row) == len(inputs.input_ids)
                  else np.repeat(per_row, inputs.num_scheduled))
        self.state.groups = group_tokens(tokens, self.slots.num_slots, self.device)
        return self.state.groups is not None

    @contextmanager
    def worst_case(self) -> Iterator[None]:
        """Every token runs an adapter (the slots in turn) while the KV cache's memory profile
        forward runs, so its peak includes the LoRA buffers of the forward."""
        slots = (np.arange(self.profile_tokens) % self.slots.num_slots).astype(np.int32)
        self.state.groups = group_tokens(slots, self.slots.num_slots, self.device)
        try:
            yield
        finally:
            self.state.groups = None


def _run_daemon(fut: Future, fn: Callable[[], object]) -> None:
    """Run ``fn`` on a daemon thread into ``fut``: a read stuck on a bad file system must not
    keep a rank's process from exiting (a pool's threads are joined at exit)."""
    def work() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the step loop via the future
            fut.set_exception(e)

    threading.Thread(target=work, name="lora-read", daemon=True).start()


def _wait_for_gate() -> None:
    gate = os.environ.get(LOAD_GATE_ENV)
    if not gate:
        return
    deadline = time.monotonic() + LOAD_GATE_TIMEOUT_S
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
