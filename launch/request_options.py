"""The Python API's request keywords made into one RequestOptions per prompt (the value itself,
carried whole to the engine core, is protocol/request_options.py)."""

from __future__ import annotations

from collections.abc import Sequence

from launch.jobs import job_infos
from launch.lora_modules import LoRAArg, per_prompt_loras
from protocol.kv_connector import KVTransferParams
from protocol.request_options import NO_OPTIONS, RequestOptions

__all__ = ["NO_OPTIONS", "RequestOptions", "per_prompt_options"]


def per_prompt_options(
    n: int,
    *,
    lora_enabled: bool,
    priority: Sequence[int] | None = None,
    cache_salt: str | None = None,
    job_id: str | Sequence[str | None] | None = None,
    is_last_step: bool | Sequence[bool] = False,
    tool_name: str | Sequence[str | None] | None = None,
    kv_transfer_params: KVTransferParams | Sequence[KVTransferParams | None] | None = None,
    lora_request: LoRAArg = None,
) -> list[RequestOptions]:
    """The Python API's keywords (one value, or one per prompt) as one RequestOptions per
    prompt; ValueError when a per-prompt list has the wrong length. Values are checked where
    they enter the engine (EngineClient.add_request), not here."""
    jobs = job_infos(n, job_id, is_last_step, tool_name) or [None] * n
    loras = per_prompt_loras(lora_request, n, lora_enabled)
    if priority is not None and len(priority) != n:
        raise ValueError(f"{len(priority)} priorities for {n} prompts")
    if kv_transfer_params is None or isinstance(kv_transfer_params, KVTransferParams):
        kv: list[KVTransferParams | None] = [kv_transfer_params] * n
    else:
        kv = list(kv_transfer_params)
        if len(kv) != n:
            raise ValueError(f"{len(kv)} kv_transfer_params for {n} prompts")
    return [
        RequestOptions(priority=priority[i] if priority is not None else 0,
                       cache_salt=cache_salt, job=jobs[i], kv_transfer_params=kv[i],
                       lora=loras[i])
        for i in range(n)
    ]
