"""The grammar gate as a holding pen: a constrained request waits here until every rank compiled
its grammar (the gate's PrepareGrammar goes out when it is held); unconstrained ones pass."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import msgspec

from engine_core.grammar.gate import GrammarGate
from engine_core.pens.base import NOTHING, HoldingPen, Settled
from engine_core.request import Request
from protocol.config import EngineConfig
from protocol.messages import EngineCoreOutput, GrammarReady


class GrammarPen(HoldingPen):
    name = "grammar"
    reply_types = (GrammarReady,)

    def __init__(self, world_size: int, config: EngineConfig,
                 publish: Callable[[msgspec.Struct], None]) -> None:
        self._publish = publish
        self.gate = GrammarGate(world_size, config, publish=publish)

    def hold(self, request: Request) -> bool | str:
        if request.sampling_params.structured_outputs is None:
            return False
        # held until every rank compiled its grammar, so no step ever waits for one
        self._publish(self.gate.hold(request))
        return True

    def on_reply(self, msg: msgspec.Struct) -> Settled:
        assert isinstance(msg, GrammarReady)
        settled = self.gate.answer(msg)
        if isinstance(settled, Request):
            return Settled(admit=(settled,))
        if settled is not None:
            return Settled(outputs=(settled,))
        return NOTHING

    def tick(self) -> Settled:
        if not self.gate:  # nothing held: no deadline to look at
            return NOTHING
        failed = self.gate.expire()
        return Settled(outputs=failed) if failed else NOTHING

    def abort(self, request_ids: Sequence[str]) -> list[EngineCoreOutput]:
        return self.gate.abort(request_ids)

    @property
    def num_held(self) -> int:
        return len(self.gate)

    def requests(self) -> Iterable[Request]:
        return self.gate.requests()

    @property
    def busy(self) -> bool:
        return bool(self.gate)  # a rank's GrammarReady admits a held request

    def census(self) -> dict[str, int]:
        return {
            "grammar_gate.held": len(self.gate),
            # the grammars the ranks keep, as this gate decides them (bounded in bytes)
            "grammar_gate.grammars": int(self.gate.stats()["grammar_cache_grammars"]),
        }

    def stats(self) -> dict[str, float]:
        return self.gate.stats()
