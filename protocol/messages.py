"""Every message that crosses a process boundary, as msgspec Structs.

Wire rules (see DESIGN.md):
- structs are encoded as msgpack arrays (``array_like``) with a small integer tag, so a
  frame carries no field names;
- integer sequences (token ids, block ids, handles) are *packed*: little-endian int32 bytes
  (see ``pack`` / ``unpack`` in protocol.codec), one msgpack bin each;
- requests are named on the worker wire by an integer ``handle`` assigned by the scheduler;
  string request ids only cross the frontend <-> engine core boundary.

The step plan (``SchedulerOutput``) is a *diff* against what every worker already holds:
- a worker keeps a *running set*: every handle it received in ``new_reqs`` or as a resumed
  request, minus those later listed in ``finished_handles`` or ``preempted_handles``;
- by default every handle in the running set is scheduled for exactly ONE token this step;
  ``sched_override_handles`` / ``sched_override_counts`` list the exceptions (0 = not
  scheduled this step, >1 = a prefill chunk or a token plus speculative drafts);
- new and resumed requests carry their own ``num_scheduled_tokens``;
- workers advance ``num_computed_tokens`` themselves by what was scheduled (minus rejected
  drafts, which they know because they sampled), and append their own sampled tokens.
So a steady decode step (everyone gets one token, nobody arrives or leaves, no new block)
is a handful of bytes whatever the batch size.

KV cache groups (protocol.kv_cache_spec): a model with G > 1 groups (sliding-window or hybrid
layers) has one block table per group and request, and every group's table of a request has
the same length (each covers the same tokens; a sliding-window group holds the null block 0
where its blocks fell out of the window). So the block-id fields below carry G runs of equal
length, group 0's first: ``block_ids`` is G * n ids for an n-block table, and in
``CachedRequestData`` a count c of ``new_block_counts`` stands for G * c ids in
``new_block_ids``. With one group nothing changes, not a byte. Blocks a window group frees are
not announced: the workers never read keys outside a layer's window.
"""

from __future__ import annotations

import msgspec

from protocol.kv_connector import KVConnectorMetadata, KVConnectorReport, KVTransferParams
from protocol.kv_transfer import KVLoadResult, KVTransfers
from protocol.lora import LoRARequest, LoRAStep
from protocol.multimodal import EncoderStep
from protocol.request_options import NO_OPTIONS, RequestOptions
from protocol.structured import StructuredOutputsParams

# 2: KV offload tiers (kv_transfers, kv_load, the hello's tier sizes)
# 3: grammars compiled before admission (PrepareGrammar / GrammarReady)
# 4: LoRA adapters (protocol/lora.py: LoRARequest on AddRequest, LoadLoRA / UnloadLoRA /
#    LoRAResult, PrepareLoRA / DropLoRA / LoRAReady, LoRAStep in the step diff); the ranks'
#    grammar caches bounded by the engine core (grammar ids, DropGrammars, sizes)
# 5: disaggregated prefill / decode (protocol/kv_connector.py: kv_transfer_params on AddRequest
#    and EngineCoreOutput, the connector's ops in the step diff, KVConnectorReport, the ranks'
#    block-server ports in the hello)
# 7: images (protocol/multimodal.py: MMItem in AddRequest's options, EncoderSchedulerOutput)
PROTOCOL_VERSION = 7


class SamplingParams(msgspec.Struct, array_like=True, kw_only=True, omit_defaults=True):
    """Per-request sampling options (vLLM's names and defaults)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False
    # a grammar the output must follow (JSON schema, regex, choice, EBNF); None costs no bytes
    structured_outputs: StructuredOutputsParams | None = None


# --------------------------------------------------------------------------------------------
# frontend -> engine core


class AddRequest(msgspec.Struct, array_like=True, tag=1, kw_only=True):
    request_id: str
    prompt_token_ids: bytes  # packed int32
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    # priority, cache salt, job, P/D parameters, adapter: one value (protocol/request_options.py)
    options: RequestOptions = NO_OPTIONS


class AbortRequests(msgspec.Struct, array_like=True, tag=2):
    request_ids: list[str]


class LoadLoRA(msgspec.Struct, array_like=True, tag=7):
    """Register an adapter now (start-up ``--lora-modules``, the HTTP load endpoint); the
    engine answers LoRAResult once every rank has read and checked it. ``call_id``: the
    frontend's name for this call, echoed in the answer (a caller that gave up on its answer
    must not receive the next caller's)."""

    lora: LoRARequest
    call_id: int = 0


class UnloadLoRA(msgspec.Struct, array_like=True, tag=8):
    """Forget an adapter by name; refused (LoRAResult.in_use) while requests use it."""

    lora_name: str
    call_id: int = 0


class HealthRequest(msgspec.Struct, array_like=True, tag=3):
    """Frontend asks the engine core for liveness of every rank and forward progress."""

    nonce: int


class ShutdownEngine(msgspec.Struct, array_like=True, tag=4):
    pass


class ProfileRequest(msgspec.Struct, array_like=True, tag=5):
    """Turn the engine step timeline, and optionally torch.profiler on the workers, on or off."""

    enable: bool
    trace_dir: str = ""
    torch_profiler: bool = True  # False: only the (cheap) step timeline, e.g. for --breakdown


FrontendMessage = (
    AddRequest | AbortRequests | HealthRequest | ShutdownEngine | ProfileRequest | LoadLoRA
    | UnloadLoRA
)


# --------------------------------------------------------------------------------------------
# engine core -> frontend


class EngineCoreOutput(msgspec.Struct, array_like=True, tag=10, kw_only=True, omit_defaults=True):
    """New tokens of one request since its last EngineCoreOutput."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None  # set when finish_reason == "error" (also for rejected input)
    new_logprobs: list[float] | None = None
    # prompt tokens this engine did not compute: prefix-cache hits and KV pulled from a
    # prefill engine
    num_cached_tokens: int = 0
    # a prefill request's last output: where its KV waits for the decode engine
    kv_transfer_params: KVTransferParams | None = None


class EngineOutputs(msgspec.Struct, array_like=True, tag=11):
    outputs: list[EngineCoreOutput]
    timestamp: float  # engine core's time.time() when the step's tokens were known
    # the core's queue as of this message, for the frontend's --max-queued-requests bound
    # (launch/admission.py): frames read from the frontend so far, and requests waiting
    # (in the scheduler's waiting queue or held for their grammar). Trailing fields with
    # defaults: an older peer ignores or defaults them.
    frames_seen: int = 0
    num_waiting: int = 0


class HealthReport(msgspec.Struct, array_like=True, tag=12, kw_only=True):
    nonce: int
    alive: list[bool]  # per rank
    last_seen_s: list[float]  # seconds since each rank was last heard from
    steps: int  # engine steps completed
    num_running: int
    num_waiting: int
    kv_usage: float
    # the scheduler's counters (prefix cache, preemptions, speculative acceptance, ...)
    stats: dict[str, float] = {}
    # sizes of the per-request maps and bounded caches of the core and of every rank
    # ("rank0.input_batch.states", ...): engine_core/census.py, workers/census.py
    census: dict[str, int] = {}


class EngineDead(msgspec.Struct, array_like=True, tag=13):
    """The engine is going down; every in-flight request has been failed with this reason."""

    reason: str


class EngineReady(msgspec.Struct, array_like=True, tag=14, kw_only=True):
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    device: str
    dtype: str = ""  # the model dtype the ranks run in ("auto" resolved); "" from old engines


class EngineStats(msgspec.Struct, array_like=True, tag=15, kw_only=True):
    """Step timeline / counters; sent when asked or at shutdown."""

    stats: dict[str, float]
    step_timeline: list[list[float]] = []


class LoRAResult(msgspec.Struct, array_like=True, tag=16, kw_only=True):
    """The answer to LoadLoRA / UnloadLoRA: error empty on success; ``in_use`` when an unload
    was refused because requests still run with the adapter (HTTP 409, else 400/404)."""

    lora_name: str
    error: str = ""
    in_use: bool = False
    not_found: bool = False
    call_id: int = 0  # the LoadLoRA / UnloadLoRA's


EngineMessage = (
    EngineOutputs | HealthReport | EngineDead | EngineReady | EngineStats | LoRAResult
)


# --------------------------------------------------------------------------------------------
# engine core -> workers (broadcast; encoded once)


class NewRequestData(msgspec.Struct, array_like=True, kw_only=True):
    """A request a worker has never seen: its full data, once."""

    handle: int
    prompt_token_ids: bytes  # packed int32
    sampling_params: SamplingParams
    block_ids: bytes  # packed int32: the request's whole block table (per group, see above)
    num_computed_tokens: int  # > 0 on a prefix-cache hit
    num_scheduled_tokens: int


class ResumedRequestData(msgspec.Struct, array_like=True, kw_only=True):
    """A request that was preempted (worker kept its tokens) and is scheduled again.

    The worker *replaces* its block table and num_computed_tokens (recompute, maybe with a
    prefix-cache hit), and puts the handle back into its running set.
    """

    handle: int
    block_ids: bytes  # packed int32: the whole new block table (per group, see above)
    num_computed_tokens: int
    num_scheduled_tokens: int


class CachedRequestData(msgspec.Struct, array_like=True):
    """Block-table growth of running requests: only the requests that got new blocks.

    ``new_block_counts[i]`` blocks from the flat ``new_block_ids`` are appended to the block
    table of ``handles[i]`` (to each of its G groups' tables: G * count ids, group 0's first).
    """

    handles: bytes = b""  # packed int32
    new_block_counts: bytes = b""  # packed int32
    new_block_ids: bytes = b""  # packed int32, flattened in handle order


class SchedulerOutput(msgspec.Struct, array_like=True, tag=20, kw_only=True):
    step_id: int  # sequence number: 0, 1, 2, ...; a worker that sees a gap stops
    new_reqs: list[NewRequestData] = []
    resumed_reqs: list[ResumedRequestData] = []
    cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    # removed from the running set *before* this step's scheduling is applied
    finished_handles: bytes = b""  # packed int32: finished/aborted: forget the request
    preempted_handles: bytes = b""  # packed int32: keep tokens, drop block table, not running
    # exceptions to "one token for every running request" (see module docstring)
    sched_override_handles: bytes = b""  # packed int32
    sched_override_counts: bytes = b""  # packed int32
    # speculative drafts to verify: handles and flattened draft tokens (counts from overrides)
    spec_handles: bytes = b""
    spec_token_counts: bytes = b""
    spec_token_ids: bytes = b""
    # consistency checks a worker verifies before computing anything
    num_running: int = 0  # size of the running set after applying this diff
    total_num_scheduled_tokens: int = 0
    # the KV offload tiers' copies of this step (protocol/kv_transfer.py), run before the
    # forward; None in a step without copies (and always without --kv-offload-memory)
    kv_transfers: KVTransfers | None = None
    # LoRA slot operations and the adapters of this step's new requests (protocol/lora.py);
    # None in a step with neither (and always without --enable-lora)
    lora: LoRAStep | None = None
    # the KV connector's loads, cancels and served leases of this step (P/D); None in a step
    # without any (and always without --kv-transfer-config)
    kv_connector: KVConnectorMetadata | None = None


class EncoderSchedulerOutput(SchedulerOutput, tag=29, kw_only=True):
    """A step with encoder work (images): a SchedulerOutput and its encoder part. Its own tag
    keeps a text-only step's bytes those of a plain SchedulerOutput (protocol/multimodal.py)."""

    encoder: EncoderStep


class Shutdown(msgspec.Struct, array_like=True, tag=21):
    reason: str = ""


class HealthPing(msgspec.Struct, array_like=True, tag=22):
    nonce: int


class ProfileControl(msgspec.Struct, array_like=True, tag=23):
    enable: bool
    trace_dir: str = ""


class ResetPrefixCache(msgspec.Struct, array_like=True, tag=24):
    pass


class PrepareGrammar(msgspec.Struct, array_like=True, tag=25):
    """Compile a constrained request's grammar now, before the scheduler may admit it.

    Sent once per constrained request when it arrives; ``ticket`` names it until every rank
    answered (the request has no handle yet). Unconstrained requests never cause one.
    ``grammar_id`` is the engine core's name for the constraint's cache entry on every rank
    (one id per key while the entry lives); DropGrammars names entries by it.
    """

    ticket: int
    spec: StructuredOutputsParams
    grammar_id: int


class DropGrammars(msgspec.Struct, array_like=True, tag=28):
    """Forget these compiled grammars (PrepareGrammar.grammar_id): the engine core's eviction.

    The core alone decides which grammars each rank keeps (its byte budget, least recently
    used first, never one a live request holds) and every rank applies the decision at the
    same point of the broadcast stream, so all ranks hold the same grammars. A compile still
    queued is cancelled; one already running finishes and its result is not kept.
    """

    grammar_ids: list[int]


class PrepareLoRA(msgspec.Struct, array_like=True, tag=26):
    """Read and check an adapter now and keep this rank's slice in host memory, before any
    request using it is admitted; every rank answers LoRAReady."""

    lora: LoRARequest
    content_hash: str


class DropLoRA(msgspec.Struct, array_like=True, tag=27):
    """The adapter was unloaded: forget its host copy (its slot was emptied by a LoRASlotOp)."""

    lora_int_id: int


WorkerBroadcast = (
    SchedulerOutput | EncoderSchedulerOutput | Shutdown | HealthPing | ProfileControl
    | ResetPrefixCache | PrepareGrammar | DropGrammars | PrepareLoRA | DropLoRA
)


# --------------------------------------------------------------------------------------------
# workers -> engine core


class WorkerHello(msgspec.Struct, array_like=True, tag=30, kw_only=True):
    """Start-up handshake: a rank is connected and its KV cache is allocated."""

    rank: int
    world_size: int
    pid: int
    hostname: str
    device: str
    num_blocks: int  # KV capacity of this rank; the scheduler uses the minimum over ranks
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None
    protocol_version: int = PROTOCOL_VERSION
    auth: bytes = b""  # HMAC of the handshake under the shared secret (tcp only)
    # the KV spec of every layer: its sliding window in tokens, 0 = full attention; the core
    # derives the KV cache groups from it (protocol.kv_cache_spec.kv_cache_groups)
    layer_windows: list[int] = []
    # KV offload tiers of this rank (0 = off); the core uses the minimum over ranks, since
    # every rank holds its own shard of the same slots
    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    kv_bytes_per_block: int = 0  # this rank's bytes of one block in the host tier
    dtype: str = ""  # the model dtype this rank runs in (EngineConfig.dtype "auto" resolved)
    kv_connector_port: int = 0  # this rank's KV block server (P/D), 0 = none
    accepts_images: bool = False  # the model has a vision encoder (protocol/multimodal.py)


class ModelRunnerOutput(msgspec.Struct, array_like=True, tag=31, kw_only=True):
    """Sampled tokens of one step (sent by rank 0; by every rank when checksums are on)."""

    step_id: int
    rank: int
    req_handles: bytes  # packed int32: requests that produced tokens this step
    num_tokens: bytes = b""  # packed int32 per handle; empty = exactly one each
    sampled_token_ids: bytes = b""  # packed int32, flattened
    logprobs: bytes = b""  # packed float32 (one per sampled token) when any request asked
    checksum: int | None = None  # hash of this rank's sampled tokens
    # worker-side timings of this step in microseconds, for the host-overhead breakdown:
    # prepare (apply the diff, build and stage the inputs), forward (launch to tokens ready
    # on the device), sample (the host's work on the tokens), then the host time before the
    # launch hidden behind the step before on the device and not hidden
    # (engine_core/step_timeline.py); empty when not collected
    timings_us: list[float] = []
    # disk -> host reads of the KV offload tiers settled this step (agreed by every rank)
    kv_load: KVLoadResult | None = None
    # this rank's time in the tiers' copies this step (on CUDA: issuing them), microseconds
    kv_copy_us: float = 0.0
    # new requests this step whose state the workers could not build (packed int32), and why;
    # the engine core finishes them with "error" and drops their tokens
    failed_handles: bytes = b""
    failed_reasons: list[str] = []
    # this rank's time in the vision encoder this step (images), microseconds
    encoder_us: float = 0.0


class WorkerError(msgspec.Struct, array_like=True, tag=32, kw_only=True):
    rank: int
    message: str
    traceback: str = ""
    step_id: int = -1


class HealthPong(msgspec.Struct, array_like=True, tag=33, kw_only=True):
    rank: int
    nonce: int
    last_step_id: int
    # this rank's map sizes (workers/census.py), so the core's census covers every process
    census: dict[str, int] = {}


class WorkerReady(msgspec.Struct, array_like=True, tag=34, kw_only=True):
    """Sent once a rank's SUB socket has received a sync ping (no slow-joiner loss)."""

    rank: int
    nonce: int


class GrammarReady(msgspec.Struct, array_like=True, tag=35, kw_only=True):
    """A rank's answer to PrepareGrammar: compiled (error empty), or why it failed.

    ``size_bytes``: what the compiled grammar costs this rank's cache (the core's budget counts
    it); ``cache_bytes``: this rank's whole grammar cache when it answered (a health figure).
    """

    rank: int
    ticket: int
    error: str = ""
    size_bytes: int = 0
    cache_bytes: int = 0


class LoRAReady(msgspec.Struct, array_like=True, tag=36, kw_only=True):
    """A rank's answer to PrepareLoRA: read and checked (error empty), or why it was refused
    (the message names the PEFT field or file)."""

    rank: int
    lora_int_id: int
    error: str = ""


WorkerMessage = (
    WorkerHello | ModelRunnerOutput | WorkerError | HealthPong | WorkerReady | GrammarReady
    | LoRAReady | KVConnectorReport
)
