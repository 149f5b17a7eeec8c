"""LoRA adapters as the frontend names them: ``--lora-modules`` entries (vLLM's two forms), the
int ids the frontend gives them, and the default ``--max-lora-rank`` read from their configs.

Torch-free: the launcher reads only each adapter's adapter_config.json; the ranks read and check
the weights (and refuse what they cannot serve) when the engine core registers the adapter.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.lora import LoRARequest
from protocol.lora_files import missing_file

DEFAULT_MAX_LORA_RANK = 16

# LLM.generate's lora_request: one adapter for every prompt, or one (None: the base model) per
# prompt
LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry: ``name=path`` or
    ``{"name": ..., "path": ..., "base_model_name": ...}``."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """argparse ``type`` of ``--lora-modules``; the error names what is missing."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: invalid JSON {text!r}: {e}") from e
        if not isinstance(obj, dict):
            raise argparse.ArgumentTypeError(f"--lora-modules: not a JSON object: {text!r}")
        unknown = sorted(set(obj) - {"name", "path", "base_model_name"})
        if unknown:
            raise argparse.ArgumentTypeError(
                f"--lora-modules: unknown key(s) {unknown} in {text!r} (expected name, path, "
                "base_model_name)")
        name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
        if not isinstance(name, str) or not name:
            raise argparse.ArgumentTypeError(
                f"--lora-modules: 'name' must be a non-empty string in {text!r}")
        if not isinstance(path, str) or not path:
            raise argparse.ArgumentTypeError(
                f"--lora-modules: 'path' must be a non-empty string in {text!r}")
        if base is not None and not isinstance(base, str):
            raise argparse.ArgumentTypeError(
                f"--lora-modules: 'base_model_name' must be a string in {text!r}")
        return LoRAModule(name, path, base or None)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f"--lora-modules: expected name=path or a JSON object, got {text!r}")
    return LoRAModule(name, path)


def lora_requests(modules: Sequence[LoRAModule], first_id: int = 1) -> list[LoRARequest]:
    """The modules as LoRARequests with frontend-assigned ids first_id, first_id + 1, ..."""
    return [LoRARequest(m.name, first_id + i, m.path) for i, m in enumerate(modules)]


def adapter_rank(path: str) -> int | None:
    """The largest rank an adapter declares (``r`` and every ``rank_pattern`` value of its
    adapter_config.json); None when the file is missing or holds no rank (the engine's
    registration then refuses the adapter with the reason)."""
    try:
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    pattern = cfg.get("rank_pattern")
    values: Iterable[Any] = pattern.values() if isinstance(pattern, dict) else ()
    ranks = [v for v in (cfg.get("r"), *values) if isinstance(v, int) and not isinstance(v, bool)]
    return max(ranks) if ranks else None


def default_max_lora_rank(paths: Iterable[str]) -> int:
    """``--max-lora-rank`` when not given: the largest rank among the start-up adapters, else
    16 (vLLM's default)."""
    ranks = [r for r in (adapter_rank(p) for p in paths) if r is not None]
    return max(ranks) if ranks else DEFAULT_MAX_LORA_RANK


def resolve_lora_options(options: dict[str, Any]) -> dict[str, Any]:
    """Engine options as given (flags or LLM keywords) -> EngineConfig keywords: modules become
    LoRARequests (ids 1, 2, ... when they are LoRAModules) and an unset max_lora_rank gets its
    default. Options without LoRA come back unchanged."""
    out = dict(options)
    modules = list(out.get("lora_modules") or [])
    if modules and all(isinstance(m, LoRAModule) for m in modules):
        modules = lora_requests(modules)
    if "lora_modules" in out:
        out["lora_modules"] = modules
    if out.get("enable_lora") and out.get("max_lora_rank") is None:
        out["max_lora_rank"] = default_max_lora_rank(m.lora_path for m in modules)
    return out


def files_error(loras: Iterable[LoRARequest]) -> str | None:
    """A start-up adapter missing one of its files, named before any process starts (the
    engine core would refuse it the same way, after the ranks loaded the model)."""
    for lora in loras:
        missing = missing_file(lora.lora_path)
        if missing is not None:
            return f"--lora-modules: adapter {lora.lora_name!r}: {missing} not found"
    return None


def per_prompt_loras(lora_request: LoRAArg, n: int, enabled: bool) -> list[LoRARequest | None]:
    """LLM.generate's ``lora_request`` as one entry per prompt (ValueError when it cannot be)."""
    if lora_request is None:
        return [None] * n
    loras: list[LoRARequest | None] = (
        [lora_request] * n if isinstance(lora_request, LoRARequest) else list(lora_request))
    if len(loras) != n:
        raise ValueError(f"{len(loras)} lora requests for {n} prompts")
    bad = [x for x in loras if x is not None and not isinstance(x, LoRARequest)]
    if bad:
        raise ValueError(f"lora_request must be a LoRARequest or None, got {bad[0]!r}")
    if any(x is not None for x in loras) and not enabled:
        raise ValueError("lora_request needs LLM(..., enable_lora=True)")
    return loras


class LoRAIds:
    """Ids for adapters the frontend names (start-up modules, the HTTP load endpoint): never
    reused while the engine runs, so a reloaded name is a new adapter to the engine."""

    def __init__(self, first: int = 1) -> None:
        self._next = itertools.count(first)

    def __call__(self) -> int:
        return next(self._next)
