"""The KV connector's engine side as a holding pen. The requests waiting for remote KV stay in
the scheduler (its connector decides their loads); this pen feeds it the ranks' reports and
the lease messages of other engine cores, and keeps an idle core awake for both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import zmq

from engine_core.kv_connector.engine_side import KVConnectorEngine, attach_connector
from engine_core.pens.base import NOTHING, HoldingPen, Settled, WakeSource
from protocol.kv_connector import KVConnectorReport, KVTransferConfig

if TYPE_CHECKING:
    from engine_core.kv_connector.scheduler_side import KVConnectorScheduler
    from engine_core.sched.scheduler import Scheduler
    from protocol.messages import WorkerHello


class KVConnectorPen(HoldingPen):
    name = "kv_connector"
    reply_types = (KVConnectorReport,)

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], cfg: KVTransferConfig,
                 secret: bytes | None) -> None:
        self.engine = KVConnectorEngine(ctx, cfg, secret)

    def start(self, scheduler: Scheduler, hellos: dict[int, WorkerHello]) -> None:
        attach_connector(self.engine, scheduler, hellos)
        conn = scheduler.kv_connector
        assert conn is not None  # attach_connector just gave it one
        self._scheduler = scheduler
        self._conn: KVConnectorScheduler = conn

    def on_reply(self, msg: msgspec.Struct) -> Settled:
        assert isinstance(msg, KVConnectorReport)
        self._conn.on_report(msg)
        return NOTHING

    def tick(self) -> Settled:
        # lease messages, deadlines, and the lease messages due (the reports came before)
        self.engine.settle(self._scheduler, [])
        return NOTHING

    @property
    def busy(self) -> bool:
        return True  # a rank's report or a lease message may unblock a request at any time

    def wake_sources(self) -> Sequence[WakeSource]:
        return self.engine.sockets

    def census(self) -> dict[str, int]:
        return {"kv_connector.peers": len(self.engine.dealers)}

    def close(self) -> None:
        self.engine.close()
