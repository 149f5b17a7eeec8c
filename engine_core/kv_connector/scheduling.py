"""Where the connector's settled loads meet the scheduler's queues (called at the start of
every schedule()): loaded or recomputing requests go back to the front of the waiting queue,
in the order they settled; requests whose load failed under the "fail" policy finish with an
error."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from engine_core.request import RequestStatus

if TYPE_CHECKING:
    from engine_core.kv_connector.scheduler_side import KVConnectorScheduler
    from engine_core.sched.request_queue import WaitingQueue


def requeue_settled(
    waiting: WaitingQueue,
    finish: Callable[[Iterable[str], RequestStatus], None],
    conn: KVConnectorScheduler,
) -> None:
    for req in reversed(conn.take_ready()):
        waiting.prepend_request(req)
    failed = conn.take_failed()
    if failed:
        finish([r.request_id for r in failed], RequestStatus.FINISHED_ERROR)
