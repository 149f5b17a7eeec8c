"""What the scheduler's companions may read of it: a structural interface, so the trace (and
the update half) depend on these names rather than on the Scheduler class and its private
fields. Scheduler satisfies it without inheriting from it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine_core.kv_cache.manager import KVCacheManager
    from engine_core.kv_offload.scheduling import OffloadScheduling
    from engine_core.request import Request
    from engine_core.sched.request_queue import WaitingQueue
    from protocol.config import EngineConfig


class SchedulerView(Protocol):
    """The scheduler's configuration and live state, read-only by convention."""

    config: EngineConfig
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    eos_token_id: int | None
    @property
    def running(self) -> list[Request]: ...

    waiting: WaitingQueue
    # the requests the workers know, by their wire handle
    by_handle: dict[int, Request]
    kv_cache_manager: KVCacheManager

    @property
    def kv_offload(self) -> OffloadScheduling | None: ...
