"""One HTTP request's generation: its engine requests (prompts x n choices), their text, stop
strings and timings, and how its first failure maps to an HTTP status.

Completions and chat differ only in how they shape what this yields (see completions.py and
chat.py).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine_core.frontend.validation import (
    derived_seed,
    sampling_error,
    validate_cache_salt,
    validate_job,
    validate_priority,
    validate_prompt,
)
from launch.admission import QueueFullError, Ticket
from launch.client import EngineDeadError
from launch.detokenizer import IncrementalDetokenizer
from launch.request_options import RequestOptions
from launch.serve.engine import AsyncEngine, Event
from launch.serve.errors import (
    APIError,
    bad_request,
    engine_dead,
    logger,
    overloaded,
    public_detail,
)
from launch.serve.metrics import ServerMetrics
from launch.serve.stop import StopChecker
from protocol.codec import pack
from protocol.kv_connector import KVTransferParams, params_to_json
from protocol.lora import LoRARequest
from protocol.messages import SamplingParams
from protocol.multimodal import MMItem
from protocol.request_options import JobInfo

# An engine refusal and an engine death both arrive as an "error" output with no tokens; the
# death is announced right after (EngineDead, or the process watcher). Wait this long for it
# before calling the error a bad request; generous because a loaded box delays the announcement,
# and only requests the engine itself refused (past the checks here) ever wait.
DEAD_GRACE_S = 1.0

# every Generation not yet garbage: its detokenizers, stop-string state and stream buffer are
# freed with it (the census counts them, launch/serve/census.py)
LIVE: weakref.WeakSet[Generation] = weakref.WeakSet()


@dataclass
class Choice:
    """One engine request: one prompt, one of its n samples."""

    index: int
    request_id: str
    prompt_ids: list[int]
    detok: IncrementalDetokenizer | None
    stop: StopChecker
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    error: str | None = None
    arrival: float = 0.0
    submitted: bool = False
    last_token_ts: float | None = None
    num_cached_tokens: int = 0  # prompt tokens the engine did not compute
    kv_transfer_params: KVTransferParams | None = None  # a prefill's answer (P/D)


@dataclass
class Delta:
    """What one engine output added to one choice."""

    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


class Generation:
    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        base_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int,
        stops: list[str],
        include_stop_str: bool,
        skip_special_tokens: bool,
        priority: int = 0,
        jobs: list[JobInfo | None] | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        lora: LoRARequest | None = None,
        cache_salt: str | None = None,
        mm: list[MMItem] | None = None,
    ) -> None:
        self.engine = engine
        self.kv_transfer_params = kv_transfer_params  # one prompt, n = 1 (kv_params.py)
        self.lora = lora  # the adapter every choice runs with (None: the base model)
        self.model_name = ""  # what responses report in `model`
        self.job = jobs[0] if jobs else None  # every choice is a turn of the same job
        self.metrics = metrics
        self.base_id = base_id
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.params = params
        self.priority = priority
        self.choices: list[Choice] = []
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.skip_special_tokens = skip_special_tokens
        for p_idx, ids in enumerate(prompts):
            for j in range(n):
                i = p_idx * n + j
                rid = base_id if len(prompts) * n == 1 else f"{base_id}-{i}"
                self.choices.append(Choice(i, rid, ids, None, StopChecker(stops, include_stop_str)))
        self.n = n
        self.options = RequestOptions(priority=priority, cache_salt=cache_salt, job=self.job,
                                      kv_transfer_params=kv_transfer_params, lora=lora,
                                      mm=mm or [])
        self._unfinished = len(self.choices)
        self.answered = False  # set once the whole response (or its error) is written
        self._got_token = False
        LIVE.add(self)

    # ------------------------------------------------------------------ start

    def validate(self) -> None:
        """The engine's own checks, run here first so a bad request is a 400 at once."""
        field_err = sampling_error(self.params)
        if field_err is not None:
            raise bad_request(field_err[1], field_err[0])
        reason = validate_priority(self.priority)
        if reason is not None:
            raise bad_request(reason, "priority")
        reason = validate_job(self.job)
        if reason is not None:
            raise bad_request(reason, "job_id")
        reason = validate_cache_salt(self.options.cache_salt)
        if reason is not None:
            raise bad_request(reason, "cache_salt")
        seen: set[int] = set()
        for c in self.choices:
            if id(c.prompt_ids) in seen:
                continue
            seen.add(id(c.prompt_ids))
            try:
                pack(c.prompt_ids)
            except (OverflowError, TypeError) as e:
                raise bad_request(f"prompt token ids are not int32 values: {e}", "prompt") from e
            err = validate_prompt(c.prompt_ids, self.engine.vocab_size)
            if err is None and len(c.prompt_ids) > self.engine.max_model_len:
                err = (
                    f"prompt has {len(c.prompt_ids)} tokens, more than max_model_len "
                    f"{self.engine.max_model_len}"
                )
            if err is not None:
                raise bad_request(err, "prompt")

    def submit(self, ticket: Ticket | None = None) -> None:
        """Send every choice. `ticket`: the slot the route took under the queue bound before
        reading the body; it grows to one slot per choice here (503 when they do not fit)."""
        if self.engine.dead_reason is not None:
            raise engine_dead(self.engine.dead_reason)
        if ticket is not None:
            try:
                ticket.grow_to(len(self.choices))
            except QueueFullError as e:
                raise overloaded(str(e)) from None
        tok = self.engine.tokenizer
        for c in self.choices:
            if tok is not None:  # after validate(): the prompt's ids are known to be tokens
                c.detok = IncrementalDetokenizer(tok, c.prompt_ids, self.skip_special_tokens)
            params = self.params
            if c.index % self.n and params.seed is not None:
                # n samples of one seeded request differ from each other but reproduce
                params = _with_seed(params, derived_seed(params.seed, c.index % self.n))
            try:
                c.arrival = self.engine.submit(c.request_id, c.prompt_ids, params, self.queue,
                                               c.index, self.options, ticket)
                c.submitted = True
            except QueueFullError as e:
                self.abort()
                raise overloaded(str(e)) from None
            except EngineDeadError as e:
                self.abort()
                raise engine_dead(self.engine.dead_reason or str(e)) from None
            except ValueError as e:
                self.abort()
                raise bad_request(str(e), "request_id") from e
            except BaseException:
                # whatever failed, no choice sent before it may run on without a client
                self.abort()
                raise

    def abort(self, client_gone: bool = False) -> None:
        """Abort every choice still running (client gone, or the response is done)."""
        # only what this generation sent: a refused duplicate id belongs to someone else
        running = [c.request_id for c in self.choices if c.submitted and c.finish_reason is None]
        if running:
            self.engine.abort(running)
            for c in self.choices:
                if c.submitted and c.finish_reason is None:
                    c.finish_reason = "abort"
                    self._unfinished -= 1
            if client_gone:
                self.metrics.on_client_gone(len(running))

    def close(self) -> None:
        """The response is over, however it ended: abort what is left, counted as the client
        leaving unless the response was sent to its end."""
        self.abort(client_gone=not self.answered)

    # ------------------------------------------------------------------ outputs

    async def first(self) -> list[Delta]:
        """Wait for the first output; raise APIError when the request failed before any token.

        Run before a response is started, so a refusal by the engine is an HTTP status, not
        a stream that ends in an error.
        """
        deltas: list[Delta] = []
        while not deltas:  # an output with neither tokens nor a finish decides nothing
            deltas = await self._next()
        for d in deltas:
            c = d.choice
            if c.finish_reason == "error" and not c.token_ids:
                await self._raise_for(c.error or "request failed")
        return deltas

    async def _raise_for(self, error: str) -> None:
        self.abort()
        if await self._engine_died():
            raise engine_dead(self.engine.dead_reason)
        raise bad_request(self._public(error))

    async def _engine_died(self) -> bool:
        deadline = time.monotonic() + DEAD_GRACE_S
        while self.engine.dead_reason is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.engine.dead_reason is not None

    async def failure(self) -> APIError | None:
        """After the end: the error of a choice that failed after its first token, if any
        (503 when the engine died, else 500)."""
        for c in self.choices:
            if c.finish_reason == "error":
                if await self._engine_died():
                    return engine_dead(self.engine.dead_reason)
                return APIError(500, self._public(c.error or "request failed"))
        return None

    def _public(self, error: str) -> str:
        """An engine's error for one request as the client reads it. The engine's own refusals
        ("prompt is empty ...") pass unchanged; a worker's failure may carry its traceback,
        which is logged here and cut from the answer."""
        shown = public_detail(error)
        if shown != error:
            logger.error("request %s failed: %s", self.base_id, error)
        return shown

    async def stream(self, first: list[Delta]) -> AsyncIterator[list[Delta]]:
        """Batches of deltas until every choice has finished (`first` comes first)."""
        if first:
            yield first
        while self._unfinished:
            deltas = await self._next()
            if deltas:
                yield deltas

    async def collect(self) -> None:
        """Run to the end (non-streaming)."""
        first = await self.first()
        del first
        async for _ in self.stream([]):
            pass

    async def _next(self) -> list[Delta]:
        """Every output queued now (at least one), applied to its choice."""
        events = [await self.queue.get()]
        while not self.queue.empty():
            events.append(self.queue.get_nowait())
        out = []
        for idx, wire, ts in events:
            if wire.num_cached_tokens:
                self.choices[idx].num_cached_tokens = wire.num_cached_tokens
            if wire.kv_transfer_params is not None:
                self.choices[idx].kv_transfer_params = wire.kv_transfer_params
            d = self._apply(self.choices[idx], wire.new_token_ids, wire.new_logprobs, ts,
                            wire.finish_reason, wire.error)
            if d is not None:
                out.append(d)
        return out

    def _apply(
        self,
        c: Choice,
        new_ids: list[int],
        new_logprobs: list[float] | None,
        ts: float,
        finish_reason: str | None,
        error: str | None,
    ) -> Delta | None:
        if c.finish_reason is not None:
            return None  # ended here already (a stop string) and aborted in the engine
        text = ""
        if new_ids:
            self.metrics.on_tokens(len(new_ids), ts, c.arrival, c.last_token_ts)
            c.last_token_ts = ts
            c.token_ids.extend(new_ids)
            if new_logprobs:
                c.logprobs.extend(new_logprobs)
            if c.detok is not None:
                text = c.detok.add(new_ids)
        if finish_reason is not None and c.detok is not None:
            text += c.detok.finish()
        matched = None
        if c.detok is not None:
            text, matched = c.stop.add(text, final=finish_reason is not None)
        if matched is not None:
            c.finish_reason, c.stop_reason = "stop", matched
            self.engine.abort([c.request_id])
        elif finish_reason is not None:
            c.finish_reason, c.error = finish_reason, error
        if c.finish_reason is not None:
            self._unfinished -= 1
            # a prompt's tokens are counted once, however many samples it has
            prompt_tokens = len(c.prompt_ids) if c.index % self.n == 0 else 0
            self.metrics.on_finish(ts, c.arrival, prompt_tokens, c.finish_reason)
        if text:
            c.text.append(text)
        if not new_ids and c.finish_reason is None:
            return None
        lps = list(new_logprobs) if new_logprobs else []
        return Delta(c, text, list(new_ids), lps, c.finish_reason)

    # ------------------------------------------------------------------ totals

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def usage(self) -> dict[str, Any]:
        # a prompt is counted once however many choices sample it (as vLLM counts); so are its
        # cached tokens (prefix-cache hits and KV pulled from a prefill engine)
        prompt = self.prompt_tokens
        done = self.completion_tokens
        cached = sum(c.num_cached_tokens for c in self.choices if c.index % self.n == 0)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def kv_transfer_fields(self) -> dict[str, Any]:
        """A prefill's answer, at the top level of the response body as vLLM puts it."""
        for c in self.choices:
            if c.kv_transfer_params is not None:
                return {"kv_transfer_params": params_to_json(c.kv_transfer_params)}
        return {}


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, seed=seed)


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token as logprobs show it: its text, or vLLM's `token_id:N` without a tokenizer."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


def pad_logprobs(lps: list[float], n: int) -> list[float | None]:
    """One entry per token: None where the engine sent no logprob for it."""
    out: list[float | None] = list(lps[:n])
    return out + [None] * (n - len(out))
