"""What every route needs: the engine, the metrics, the served names and request plumbing."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from launch.jobs import job_infos
from launch.serve.adapters import ServedAdapters
from launch.serve.body import DEFAULT_MAX_REQUEST_BYTES
from launch.serve.engine import AsyncEngine
from launch.serve.errors import APIError, bad_request, engine_dead
from launch.serve.field_checks import (
    check_logit_bias,
    check_max_tokens,
    check_prompt_chars,
    check_request_id,
    check_stop,
    max_token_chars,
)
from launch.serve.generation import Generation
from launch.serve.kv_params import request_kv_params
from launch.serve.metrics import ServerMetrics
from launch.serve.schemas import SamplingFields
from protocol.lora import LoRARequest
from protocol.messages import SamplingParams
from protocol.multimodal import MMItem

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


@dataclass
class ServerContext:
    engine: AsyncEngine
    served_names: list[str]
    model_path: str
    api_key: str | None = None
    max_n: int = 128
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    created: int = field(default_factory=lambda: int(time.time()))
    # names this server process to a router (GET /get_server_info): new at every start
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # the LoRA adapters clients may name in `model` (launch/serve/lora.py); none by default
    # (its base model's name, when not given, is the first served name: __post_init__)
    adapters: ServedAdapters = field(default_factory=lambda: ServedAdapters([], [], ""))
    metrics: ServerMetrics = field(init=False)
    _prompt_chars: int | None = field(default=None, init=False)
    # launch.structured.FrontendGrammars, built on the first constrained request
    grammars: Any = field(default=None, init=False)

    def __post_init__(self) -> None:
        # one label value (the base model's name), whatever the adapters: label sets stay
        # bounded however many adapters come and go
        self.metrics = ServerMetrics(self.served_names[0])
        if not self.adapters.base:
            self.adapters.base = self.served_names[0]

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def image_inputs(self) -> Any:
        """The served model's launch.multimodal.inputs.ImageInputs (the LLM's own)."""
        return self.engine.llm.image_inputs()

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base model); 404 for an unknown name."""
        if model is None or model in self.served_names:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return lora

    def check_alive(self) -> None:
        if self.engine.dead_reason is not None:
            raise engine_dead(self.engine.dead_reason)

    def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """Token ids of `text`. Blocking (the tokenizer holds the GIL): call it from a worker
        thread (asyncio.to_thread), never on the event loop."""
        tok = self.tokenizer
        if tok is None:
            raise bad_request(
                f"model {self.model_path!r} has no tokenizer: send token ids (a list of ints) "
                "as the prompt, or start the server with --tokenizer",
                param,
            )
        # a text too long to fit is refused before the tokenizer spends time on all of it
        check_prompt_chars(text, self.max_prompt_chars, self.engine.max_model_len, param)
        if add_special_tokens:
            return list(tok.encode(text))
        return list(tok.backend.encode(text, add_special_tokens=False).ids)

    @property
    def max_prompt_chars(self) -> int:
        if self._prompt_chars is None:
            self._prompt_chars = self.engine.max_model_len * max_token_chars(self.tokenizer)
        return self._prompt_chars

    def sampling_params(
        self, req: SamplingFields, max_tokens: int, logprobs: bool,
        max_tokens_param: str = "max_tokens",
    ) -> SamplingParams:
        if not 1 <= req.n <= self.max_n:
            raise bad_request(f"n must be in [1, {self.max_n}], got {req.n}", "n")
        check_max_tokens(max_tokens, self.engine.max_model_len, max_tokens_param)
        check_logit_bias(req.logit_bias, self.engine.vocab_size)
        d = SamplingParams()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_p=d.top_p if req.top_p is None else req.top_p,
            top_k=d.top_k if req.top_k is None else req.top_k,
            min_p=d.min_p if req.min_p is None else req.min_p,
            seed=req.seed,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
        )

    def new_id(self, prefix: str, req: SamplingFields) -> str:
        return req.request_id or f"{prefix}-{uuid.uuid4().hex}"

    def start_generation(self, id_prefix: str, req: SamplingFields, prompts: list[list[int]],
                         max_tokens: int, logprobs: bool,
                         max_tokens_param: str = "max_tokens",
                         mm: list[MMItem] | None = None) -> Generation:
        """A validated Generation of `prompts` with the request's sampling fields (shared by
        /v1/completions and /v1/chat/completions)."""
        check_request_id(req.request_id)
        check_stop(req.stop_list())
        lora = self.check_model(req.model)
        gen = Generation(
            self.engine,
            self.metrics,
            self.new_id(id_prefix, req),
            prompts,
            self.sampling_params(req, max_tokens, logprobs, max_tokens_param),
            req.n,
            req.stop_list(),
            req.include_stop_str_in_output,
            req.skip_special_tokens,
            req.priority,
            job_infos(1, req.job_id, req.is_last_step, req.tool_name),
            kv_transfer_params=request_kv_params(
                req.kv_transfer_params, len(prompts) * req.n,
                -(-self.engine.max_model_len // self.engine.block_size)),
            lora=lora,
            cache_salt=req.cache_salt,
            mm=mm,
        )
        # responses name the adapter that answered (vLLM's), else the base model
        # (the adapters are served under their lora_name, so that is the name req.model gave)
        gen.model_name = lora.lora_name if lora is not None else self.model_name
        gen.validate()
        return gen

    def chunk_head(self, gen: Generation, obj: str) -> dict[str, Any]:
        """The fields every response object and stream chunk of `gen` starts with."""
        return {"id": gen.base_id, "object": obj, "created": int(time.time()),
                "model": gen.model_name}


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, unless the client disconnects first: then cancel it, raise ClientGone.

    The body has been read by then, so the next ASGI message can only be the disconnect.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        raise ClientGone()
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """Server-sent events from an async iterator of str; `on_close` runs however it ends
    (finished, client gone, server shutting down), so engine requests are always released."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
