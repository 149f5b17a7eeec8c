"""LoRA as a rank feature (workers/step_hooks.py): the step's slot ops and per-row adapter
groups for the model runner, PrepareLoRA / DropLoRA for the rank loop.

With ``--enable-lora`` off, ``LoRAOff`` stands in: it only answers PrepareLoRA with a refusal,
so the rank loop needs no case for a rank without LoRA.
"""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from protocol.messages import DropLoRA, LoRAReady, PrepareLoRA
from workers.step_hooks import Handler, Reply, StepHook

if TYPE_CHECKING:
    from protocol.lora import LoRARequest
    from protocol.messages import SchedulerOutput
    from workers.lora.manager import LoRAManager
    from workers.lora.weights import PreparedAdapter
    from workers.runner.batch_inputs import BatchInputs

NOT_ENABLED = "LoRA is not enabled on this worker (--enable-lora)"


def _no_reply(msg: object) -> None:
    raise RuntimeError("a LoRA answer before the rank is connected to the engine core")


class LoRAFeature(StepHook):
    def __init__(self, manager: LoRAManager, rank: int) -> None:
        self.manager = manager
        self.rank = rank
        self.reply: Reply = _no_reply
        # PrepareLoRA reads still in flight on a helper thread (no step waits on them; a
        # hostile or huge file costs that thread, never the step loop): adapter id ->
        # (read, the request, still wanted: False once DropLoRA came meanwhile)
        self.tickets: dict[int, tuple[Future[PreparedAdapter | None], PrepareLoRA, bool]] = {}

    def prepare(self, lora: LoRARequest, content_hash: str) -> str:
        """PrepareLoRA, waited for (tests, benchmarks): the refusal, or ""."""
        return self.manager.prepare(lora, content_hash)

    # ------------------------------------------------------------------ start-up
    def worst_case(self) -> AbstractContextManager[None]:
        # the profile forward (CUDA) runs every token through an adapter
        return self.manager.worst_case()

    def reserved_bytes(self) -> int:
        return self.manager.nbytes

    def connect(self, results_addr: str, reply: Reply) -> None:
        self.reply = reply

    # ------------------------------------------------------------------ the rank loop
    def messages(self) -> dict[type, Handler]:
        return {PrepareLoRA: self.on_prepare, DropLoRA: self.on_drop}

    def on_prepare(self, msg: PrepareLoRA) -> None:
        """Start reading, checking and slicing the adapter on a helper thread; ``poll``
        answers once it is done. A refused adapter is an answer, never a crash."""
        fut = self.manager.begin_prepare(msg.lora, msg.content_hash)
        self.tickets[msg.lora.lora_int_id] = (fut, msg, True)
        self.poll()  # held in host memory already: ready at once

    def poll(self) -> None:
        """Answer every PrepareLoRA whose read is done. A read dropped meanwhile is still
        answered (the core counts that answer as stale) but its adapter is not kept."""
        done = [i for i, (f, _, _) in self.tickets.items() if f.done()]
        for lora_int_id in done:
            fut, msg, wanted = self.tickets.pop(lora_int_id)
            error = self.manager.finish_prepare(msg.lora, fut, keep=wanted)
            self.reply(LoRAReady(rank=self.rank, lora_int_id=lora_int_id, error=error))

    def busy(self) -> bool:
        return bool(self.tickets)

    def on_drop(self, msg: DropLoRA) -> None:
        ticket = self.tickets.get(msg.lora_int_id)
        if ticket is not None:
            self.tickets[msg.lora_int_id] = (ticket[0], ticket[1], False)
        self.manager.drop(msg.lora_int_id)

    # ------------------------------------------------------------------ the step
    def before_diff(self, so: SchedulerOutput) -> None:
        # before the batch looks up its new rows' slots; a slot's weights are written in
        # stream order, after the step in flight that may still read them
        if so.lora is not None:
            self.manager.apply_ops(so.lora.ops)

    def after_diff(self, so: SchedulerOutput) -> None:
        self.manager.check_rows()

    def on_inputs(self, inputs: BatchInputs) -> bool:
        # graphs are captured without LoRA: a step with adapter rows runs eagerly (the token
        # groups by slot are set here for this step's forward)
        return self.manager.begin_step(inputs)


class LoRAOff(StepHook):
    """A rank without ``--enable-lora``: every PrepareLoRA is refused, DropLoRA is a no-op."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.reply: Reply = _no_reply

    def prepare(self, lora: LoRARequest, content_hash: str) -> str:
        return NOT_ENABLED

    def connect(self, results_addr: str, reply: Reply) -> None:
        self.reply = reply

    def messages(self) -> dict[type, Handler]:
        return {PrepareLoRA: self.on_prepare, DropLoRA: self.on_drop}

    def on_prepare(self, msg: PrepareLoRA) -> None:
        self.reply(LoRAReady(rank=self.rank, lora_int_id=msg.lora.lora_int_id,
                             error=NOT_ENABLED))

    def on_drop(self, msg: DropLoRA) -> None:
        pass
