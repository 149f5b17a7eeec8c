"""Which holding pens an engine core has, decided once at start-up from its config, and the
tables that route messages to them. The only place that names every feature."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec
import zmq

from engine_core.grammar.pen import GrammarPen
from engine_core.kv_connector.pen import KVConnectorPen
from engine_core.lora.pen import LoRAPen, refuse_disabled
from engine_core.pens.base import HoldingPen, route_table
from engine_core.request import Request
from protocol.config import EngineConfig
from protocol.messages import LoadLoRA, UnloadLoRA

Publish = Callable[[msgspec.Struct], None]
ControlHandler = Callable[[msgspec.Struct], "msgspec.Struct | None"]


def build_pens(config: EngineConfig, world_size: int, publish: Publish,
               ctx: zmq.Context[zmq.Socket[bytes]], secret: bytes | None,
               users: Callable[[HoldingPen], Iterable[Request]]) -> list[HoldingPen]:
    """The enabled features' pens, in the order a new request passes them: its adapter first
    (a grammar is compiled only for a request that will run), then its grammar. Structured
    outputs have no switch, so the grammar pen is always there. ``publish`` broadcasts to every
    rank; ``users(pen)`` lists the requests outside ``pen`` (other pens', the scheduler's)."""
    pens: list[HoldingPen] = []
    if config.enable_lora:
        pens.append(LoRAPen(world_size, publish, users))
    pens.append(GrammarPen(world_size, config, publish))
    if config.kv_transfer_config is not None:
        pens.append(KVConnectorPen(ctx, config.kv_transfer_config, secret))
    return pens


def reply_routes(pens: list[HoldingPen]) -> dict[type[msgspec.Struct], HoldingPen]:
    """{rank message type: its pen}."""
    return route_table(pens, lambda p: p.reply_types)


def control_routes(pens: list[HoldingPen]) -> dict[type[msgspec.Struct], ControlHandler]:
    """{frontend control message type: its handler}; a disabled feature's messages still get
    an answer that says how to enable it."""
    table: dict[type[msgspec.Struct], ControlHandler] = {
        LoadLoRA: refuse_disabled, UnloadLoRA: refuse_disabled}
    for t, pen in route_table(pens, lambda p: p.control_types).items():
        table[t] = pen.on_control
    return table
