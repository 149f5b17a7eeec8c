"""LoRA adapters over HTTP, vLLM's way: the ``model`` field of a request names an adapter (or the
base model), /v1/models lists each adapter with its parent, and with
TANDEM_ALLOW_RUNTIME_LORA_UPDATING=1 ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` add and remove adapters while the server runs (without it the
two routes do not exist: 404).

Status codes: a load the engine refuses (missing file, a rank's check) is a 400, as is a name
already served; an unload of an adapter requests still use is a 409; of an unknown one a 404.
The frontend gives every adapter it names an int id (1, 2, ... for --lora-modules, then the next
ones for runtime loads), never reused, so a name loaded again is a new adapter to the engine.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from launch.client import EngineDeadError
from launch.serve.adapters import ServedAdapter
from launch.serve.errors import APIError, bad_request, engine_unavailable, public_detail
from protocol.lora import LoRARequest

if TYPE_CHECKING:
    from launch.serve.context import ServerContext

RUNTIME_UPDATING_ENV = "TANDEM_ALLOW_RUNTIME_LORA_UPDATING"


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def runtime_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


Parse = Callable[[Request, type[BaseModel]], Coroutine[Any, Any, Any]]


def install_lora_routes(app: FastAPI, ctx: ServerContext, parse: Parse,
                        dependencies: list[Any]) -> None:
    """The load / unload routes, only when runtime updating is allowed."""
    if not runtime_updating_allowed():
        return

    @app.post("/v1/load_lora_adapter", dependencies=dependencies)
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        req = await parse(request, LoadLoRAAdapterRequest)
        await load(ctx, req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=dependencies)
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        req = await parse(request, UnloadLoRAAdapterRequest)
        await unload(ctx, req.lora_name, req.lora_int_id)
        return PlainTextResponse(
            f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def load(ctx: ServerContext, name: str, path: str) -> None:
    adapters = ctx.adapters
    if not name or not path:
        raise bad_request("lora_name and lora_path must not be empty",
                          "lora_path" if name else "lora_name")
    if name in adapters.by_name or name in ctx.served_names:
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    if name in adapters.changing:
        raise bad_request(f"The lora adapter '{name}' is being loaded or unloaded.", "lora_name")
    ctx.check_alive()
    lora = LoRARequest(name, adapters.next_id(), path)
    adapters.changing.add(name)
    try:
        result = await asyncio.to_thread(ctx.engine.client.load_lora, lora)
    except (EngineDeadError, TimeoutError) as e:
        raise engine_unavailable("loading an adapter", e, ctx.engine.dead_reason) from None
    finally:
        adapters.changing.discard(name)
    if result.error:
        raise bad_request(public_detail(result.error), "lora_path")
    adapters.by_name[name] = ServedAdapter(lora, adapters.base)


async def unload(ctx: ServerContext, name: str, lora_int_id: int | None) -> None:
    adapters = ctx.adapters
    served = adapters.by_name.get(name)
    if served is None or (lora_int_id is not None and lora_int_id != served.lora.lora_int_id):
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
    ctx.check_alive()
    # no new request may name it while the engine decides; it comes back if refused
    del adapters.by_name[name]
    adapters.changing.add(name)
    try:
        result = await asyncio.to_thread(ctx.engine.client.unload_lora, name)
    except (EngineDeadError, TimeoutError) as e:
        adapters.by_name[name] = served
        raise engine_unavailable("unloading an adapter", e, ctx.engine.dead_reason) from None
    except BaseException:
        adapters.by_name[name] = served
        raise
    finally:
        adapters.changing.discard(name)
    if result.error and not result.not_found:
        adapters.by_name[name] = served
        raise APIError(409 if result.in_use else 400, public_detail(result.error), "lora_name")
    if result.not_found:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
