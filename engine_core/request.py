"""One generation request as the scheduler sees it (vLLM v1 naming).

There is no prefill or decode phase: a request only has ``num_computed_tokens`` and
``num_tokens_with_spec``; the scheduler closes the gap between the two under a token budget.
Hot fields are plain attributes (kept up to date on append) rather than properties, because
the scheduler reads them for every running request on every step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from protocol.codec import pack
from protocol.messages import SamplingParams
from protocol.request_options import NO_OPTIONS, RequestOptions

# Hash of one full block; bytes (sha256) or int (fast), see kv_cache_hashing.
BlockHash = Any


class RequestStatus(enum.IntEnum):
    WAITING = 0
    # its KV is being pulled from a prefill engine: set aside by the KV connector
    # (engine_core/kv_connector/), out of the waiting queue, holding its blocks
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    # everything from here on is finished
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_IGNORED = 7
    FINISHED_ERROR = 8

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED


# EngineCoreOutput.finish_reason for each finished status
FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "error",
    RequestStatus.FINISHED_ERROR: "error",
}

_NEVER = 1 << 62  # "no block boundary to hash at" when prefix caching is off


class Request:
    __slots__ = (
        "request_id",
        "options",
        "prompt_token_ids",
        "packed_prompt",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "priority",
        "cache_salt",
        "all_token_ids",
        "output_token_ids",
        "num_prompt_tokens",
        "num_tokens",
        "num_tokens_with_spec",
        "spec_token_ids",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_cached_tokens",
        "num_preemptions",
        "status",
        "handle",
        "max_tokens",
        "min_tokens",
        "stop_ids",
        "error",
        "block_hashes",
        "_block_hasher",
        "_next_hash_at",
        "_hash_block_size",
        "kv_fast_limit",
        "length_limit",
        "ngram_index",
        "job_id",
        "is_last_step",
        "tool_name",
        "kv_transfer_params",
        "num_external_computed_tokens",
        "lora",
        "lora_int_id",
        "lora_hash",
        "lora_skips",
        "mm_items",
        "mm_end",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float,
        options: RequestOptions = NO_OPTIONS,
    ) -> None:
        self.request_id = request_id
        # everything the client chose besides the prompt and sampling, as it arrived; the
        # fields the scheduler reads on every step are copied to plain attributes below
        self.options = options
        kv_transfer_params = options.kv_transfer_params
        lora = options.lora
        job = options.job
        # P/D (engine_core/kv_connector/): a prefill to hand over, or KV to pull; None: neither
        self.kv_transfer_params = kv_transfer_params
        # prompt tokens whose KV a prefill engine sent and this request's blocks now hold
        # (local prefix hit included): admission counts them as computed, then resets it
        self.num_external_computed_tokens = 0
        # the LoRA adapter it runs with (None: the base model); lora_int_id is 0 for the base
        # model; lora_hash, the adapter's content hash, is set by the adapter registry before
        # the request reaches the scheduler (it enters the prefix-cache block hashes)
        self.lora = lora
        self.lora_int_id = 0 if lora is None else lora.lora_int_id
        self.lora_hash = ""
        # admission passes that skipped it for want of an adapter slot (engine_core/lora/)
        self.lora_skips = 0
        # the agent program this request is a turn of (continuum policy); None: no job
        self.job_id = None if job is None else job.job_id
        self.is_last_step = False if job is None else job.is_last_step
        self.tool_name = None if job is None else job.tool_name
        # images (protocol/multimodal.py), in prompt order; mm_end: the end of the last
        # placeholder span (0 without images), so a step past it skips the encoder's checks
        self.mm_items = options.mm
        self.mm_end = max((i.placeholder.offset + i.placeholder.length for i in options.mm),
                          default=0)
        self.prompt_token_ids = list(prompt_token_ids)
        # packed once here so admission (a hot path) never re-packs the prompt
        self.packed_prompt = pack(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = options.priority
        self.cache_salt = options.cache_salt
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_tokens = self.num_prompt_tokens
        self.num_tokens_with_spec = self.num_tokens
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # tokens being sampled by an in-flight step but not yet appended (async scheduling)
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first admission; -1 = not yet admitted
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.handle: int | None = None  # integer name on the worker wire, set on first schedule
        self.max_tokens = sampling_params.max_tokens
        self.min_tokens = sampling_params.min_tokens
        self.error: str | None = None
        self.block_hashes: list[BlockHash] = []
        self._block_hasher: Callable[[Request], None] | None = None
        self._next_hash_at = _NEVER
        self._hash_block_size = 0
        # set by KVCacheManager: while num_computed_tokens + new tokens stays at or below this,
        # allocate_slots would change nothing (no new block, no block to cache), so the
        # scheduler may skip the call: the hot decode path
        self.kv_fast_limit = 0
        # num_tokens at which the request is length-capped; the scheduler lowers it to
        # max_model_len, so one compare per sampled token covers both limits
        self.length_limit = self.num_prompt_tokens + self.max_tokens
        # the n-gram proposer's incremental index (engine_core/spec_decode/), made on demand
        self.ngram_index: Any = None
        self._set_stop_ids()

    def _set_stop_ids(self) -> None:
        # one set lookup per sampled token instead of separate EOS / stop-id checks
        ids = set(self.sampling_params.stop_token_ids)
        if self.eos_token_id is not None and not self.sampling_params.ignore_eos:
            ids.add(self.eos_token_id)
        self.stop_ids = frozenset(ids)

    def set_eos_token_id(self, eos_token_id: int | None) -> None:
        self.eos_token_id = eos_token_id
        self._set_stop_ids()

    def set_block_hasher(self, hasher: Callable[[Request], None], block_size: int) -> None:
        """Attach the prefix-cache hasher and hash every full block of the prompt."""
        self._block_hasher = hasher
        self._hash_block_size = block_size
        hasher(self)
        self._next_hash_at = (len(self.block_hashes) + 1) * block_size

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        n = self.num_tokens + 1
        self.num_tokens = n
        self.num_tokens_with_spec = n + len(self.spec_token_ids)
        if n >= self._next_hash_at:  # a block just became full: extend the hash chain
            hasher = self._block_hasher
            assert hasher is not None
            hasher(self)
            self._next_hash_at = (len(self.block_hashes) + 1) * self._hash_block_size

    def set_spec_token_ids(self, token_ids: list[int]) -> None:
        self.spec_token_ids = list(token_ids)
        self.num_tokens_with_spec = self.num_tokens + len(self.spec_token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, handle={self.handle}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
