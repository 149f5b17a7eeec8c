"""The adapter registry as a holding pen: a request for an adapter waits here until every rank
has read it; LoadLoRA / UnloadLoRA from the frontend are answered here too."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec

from engine_core.lora.registry import LoRARegistry, control
from engine_core.pens.base import NOTHING, HoldingPen, Settled, WakeSource
from protocol.messages import EngineCoreOutput, LoadLoRA, LoRAReady, UnloadLoRA

if TYPE_CHECKING:
    from engine_core.lora.slots import LoRASlots
    from engine_core.request import Request
    from engine_core.sched.scheduler import Scheduler
    from protocol.messages import WorkerHello


class LoRAPen(HoldingPen):
    name = "lora"
    reply_types = (LoRAReady,)
    control_types = (LoadLoRA, UnloadLoRA)

    def __init__(self, world_size: int, publish: Callable[[msgspec.Struct], None],
                 users: Callable[[HoldingPen], Iterable[Request]]) -> None:
        self.registry = LoRARegistry(world_size, publish)
        # the requests outside this pen that may use an adapter (other pens', the scheduler's)
        self._users = users
        self._slots: LoRASlots | None = None

    def start(self, scheduler: Scheduler, hellos: dict[int, WorkerHello]) -> None:
        self._slots = scheduler.lora

    def hold(self, request: Request) -> bool | str:
        if request.lora is None:
            return False
        routed = self.registry.route(request)  # the request itself once its adapter is ready
        return routed if isinstance(routed, str) else routed is None

    def on_reply(self, msg: msgspec.Struct) -> Settled:
        assert isinstance(msg, LoRAReady)
        go, failed = self.registry.answer(msg)
        return Settled(admit=go, outputs=failed) if go or failed else NOTHING

    def on_control(self, msg: msgspec.Struct) -> msgspec.Struct | None:
        assert isinstance(msg, (LoadLoRA, UnloadLoRA))
        return control(self.registry, msg, lambda: self._users(self), self._slots)

    def tick(self) -> Settled:
        # hashes done (PrepareLoRA goes out), and the loads' answers owed to the frontend
        go, failed = self.registry.settle([])
        results = self.registry.take_results()
        if go or failed or results:
            return Settled(admit=go, outputs=failed, notices=results)
        return NOTHING

    def after_publish(self) -> None:
        self.registry.after_publish()  # DropLoRA after the step that empties its slot

    def abort(self, request_ids: Sequence[str]) -> list[EngineCoreOutput]:
        return self.registry.abort(request_ids)

    @property
    def num_held(self) -> int:
        return self.registry.num_held

    def requests(self) -> Iterable[Request]:
        return self.registry.held_requests()

    @property
    def busy(self) -> bool:
        return self.registry.busy

    def wake_sources(self) -> Sequence[WakeSource]:
        return (self.registry.wakeup_fd,)  # an adapter's hash is done

    def census(self) -> dict[str, int]:
        return {"lora.adapters": len(self.registry), "lora.held": self.registry.num_held}

    def close(self) -> None:
        self.registry.close()


def refuse_disabled(msg: msgspec.Struct) -> msgspec.Struct | None:
    """LoadLoRA / UnloadLoRA on an engine started without --enable-lora."""
    assert isinstance(msg, (LoadLoRA, UnloadLoRA))
    return control(None, msg, lambda: (), None)
