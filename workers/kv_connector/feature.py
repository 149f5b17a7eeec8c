"""The KV connector's worker side as a rank feature (workers/step_hooks.py): each step's
exposes, unexposes, cancels and remote loads, and the loads' reports to the engine core."""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.kv_connector.worker_side import KVConnectorWorker
from workers.step_hooks import Reply, StepHook

if TYPE_CHECKING:
    from protocol.messages import SchedulerOutput


class KVConnectorFeature(StepHook):
    def __init__(self, connector: KVConnectorWorker) -> None:
        self.connector = connector

    def connect(self, results_addr: str, reply: Reply) -> None:
        self.connector.connect_reports(results_addr)  # its loads report to the core directly

    def on_launch(self, so: SchedulerOutput) -> None:
        if so.kv_connector is not None:
            self.connector.start_load_kv(so.kv_connector)  # returns at once

    def census(self, out: dict[str, int]) -> None:
        puller = self.connector.puller
        if puller is not None:
            out["kv_connector.peers"] = puller.num_peers
            out["kv_connector.loads"] = puller.num_loads

    def close(self) -> None:
        self.connector.close()
