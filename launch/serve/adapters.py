"""The LoRA adapters an HTTP server serves: what clients may name in ``model`` and how
/v1/models lists them (routes in launch/serve/lora.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launch.lora_modules import LoRAIds, LoRAModule
from protocol.lora import LoRARequest


@dataclass(frozen=True)
class ServedAdapter:
    lora: LoRARequest
    parent: str  # the model it adapts, as /v1/models names it


class ServedAdapters:
    """The adapters clients may name in ``model``, by name."""

    def __init__(self, modules: list[LoRAModule], loras: list[LoRARequest], base: str) -> None:
        self.base = base  # the base model's (first) served name
        self.by_name = {
            lora.lora_name: ServedAdapter(lora, m.base_model_name or base)
            for m, lora in zip(modules, loras, strict=True)
        }
        self.next_id = LoRAIds(max((x.lora_int_id for x in loras), default=0) + 1)
        self.changing: set[str] = set()  # names with a load or unload in flight

    def get(self, name: str | None) -> LoRARequest | None:
        adapter = self.by_name.get(name) if name is not None else None
        return None if adapter is None else adapter.lora

    def model_cards(self, created: int, max_model_len: int) -> list[dict[str, Any]]:
        return [
            {"id": name, "object": "model", "created": created, "owned_by": "tandem",
             "root": a.lora.lora_path, "parent": a.parent, "max_model_len": max_model_len,
             "permission": []}
            for name, a in self.by_name.items()
        ]
