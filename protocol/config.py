"""Engine options shared by every process (frontend, engine core, workers)."""

from __future__ import annotations

import msgspec

from protocol.kv_connector import KVTransferConfig, kv_transfer_config_error
from protocol.kv_events import KVEventsConfig, kv_events_config_error
from protocol.lora import LoRARequest

# The KV budget per rank on CPU when kv_cache_memory is not given (on CUDA it is sized from the
# device's memory, see workers/runner/memory_profile.py).
CPU_KV_CACHE_MEMORY = 256 * 1024 * 1024

# The token budget per step when max_num_batched_tokens is not given: the scheduler plans
# steps up to it, and the workers' memory profile runs a step of that size.
CPU_MAX_BATCHED_TOKENS = 2048
GPU_MAX_BATCHED_TOKENS = 8192


def default_max_batched_tokens(device_type: str) -> int:
    return GPU_MAX_BATCHED_TOKENS if device_type == "cuda" else CPU_MAX_BATCHED_TOKENS


class EngineConfig(msgspec.Struct, kw_only=True):
    """All engine options; the launcher flags and LLM(...) keyword arguments map 1:1 onto these."""

    model: str = "dummy:tiny"
    # auto | float32 | bfloat16 | float16; auto: the checkpoint's dtype on CUDA; on CPU float32,
    # or bfloat16 for a bf16 checkpoint where the CPU has native bf16 and measures it faster
    # (protocol/devices.resolve_dtype, workers/cpu_dtype.py)
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    block_size: int = 16
    max_num_seqs: int = 256
    # None means "pick the device default": 2048 on CPU, 8192 on GPU.
    max_num_batched_tokens: int | None = None
    # None means "the model's max_position_embeddings".
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"  # fcfs | priority | continuum
    prefix_hash: str = "sha256"  # sha256 (collision safe) | fast (Python hash of tuples)
    # bytes of K+V per rank; None means "the device default": 256 MiB on CPU, and on CUDA what
    # gpu_memory_utilization leaves after the weights and a profile forward
    kv_cache_memory: int | None = None
    # tiered KV cache: host bytes per rank for blocks evicted from the device pool
    # (0 = off), and an optional disk tier (a directory; bytes per rank) behind it
    kv_offload_memory: int = 0
    kv_offload_disk: str | None = None
    kv_offload_disk_size: int = 0
    # share of each GPU's memory the engine may use (vLLM's --gpu-memory-utilization)
    gpu_memory_utilization: float = 0.9
    # auto: weights from the model's files; dummy: random weights of the model's shape
    # (config.json alone suffices), drawn on the device (vLLM's --load-format dummy)
    load_format: str = "auto"
    num_gpu_blocks_override: int | None = None  # force a KV capacity (tests of KV pressure)
    # plan step k+1 while the workers run step k (the in-flight token is a placeholder)
    async_scheduling: bool = False
    # with async scheduling, a rank receives, applies and stages step k+1 while step k runs
    # on its device, and step k's sampled tokens feed step k+1's input ids on the device
    # (workers/overlap.py); None = on where it pays: async scheduling on a CUDA device
    worker_overlap: bool | None = None
    # n-gram (prompt-lookup) speculative decoding: match the last n tokens, n from
    # speculative_ngram down to speculative_ngram_min, and propose the tokens that followed
    # the latest earlier match; 0 = off
    speculative_ngram: int = 0
    speculative_ngram_min: int = 1
    num_speculative_tokens: int = 0  # drafts per request per step (K)
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    # auto | torch | cpu | triton: the attention backend every worker picks once at start-up
    # (auto: triton on CUDA, the C++ kernels on CPU where they build, else torch)
    attention_backend: str = "auto"
    # no CUDA graphs: decode steps run eagerly too (vLLM's --enforce-eager)
    enforce_eager: bool = False
    # float32 on CUDA: let cuBLAS round matmul inputs to TF32 (about 8x the FP32 rate on
    # Ampere/Hopper, ~1e-3 relative error); off unless asked, so float32 stays an oracle
    allow_tf32: bool = False
    debug_invariants: bool = False  # check block-pool invariants after every step
    # admit a waiting request only if the KV cache can hold its whole sequence (prompt +
    # max_tokens, capped at max_model_len) next to what the running requests still need
    # (vLLM's --scheduler-reserve-full-isl), so admitted requests never preempt each other
    scheduler_reserve_full_isl: bool = False
    # write one JSON line per scheduler step (and per arrival / abort / finish) to this path
    # (engine_core/sched/trace.py); None = off
    scheduler_trace: str | None = None
    enable_checksum: bool = False  # every rank returns a checksum of its sampled tokens
    worker_timeout_s: float = 30.0  # a rank silent for this long is declared hung
    # requests admitted but not yet running (waiting in the core, held for a grammar, or on
    # their way there) beyond which the frontend refuses new ones at once: HTTP 503 with
    # Retry-After, QueueFullError in the Python API (launch/admission.py); None = unbounded
    max_queued_requests: int | None = None
    max_frame_bytes: int = 64 * 1024 * 1024
    # where the vocabulary comes from when the model has none of its own (dummy:* presets): a
    # tokenizer directory or .gguf file. The frontend tokenizes with it and every worker builds
    # its grammar engine's token table from it; None = the model's own tokenizer.
    tokenizer: str | None = None
    # compiled grammars (structured outputs) kept for reuse, in MiB, in the frontend and on
    # each rank (vLLM bounds the same cache); a grammar a live request holds is never evicted
    structured_outputs_cache_mb: int = 256
    # seconds a constraint may take to compile (queueing included) before its request fails
    structured_outputs_compile_timeout: float = 10.0
    # continuum policy: a fixed pin TTL in seconds (None = learned from observed tool-call
    # gaps), and the cap on any TTL
    continuum_ttl: float | None = None
    continuum_max_ttl: float = 30.0
    # LoRA adapters (protocol/lora.py): off unless enabled. max_loras device slots (adapters in
    # one step), each max_lora_rank wide (None: the largest rank among lora_modules, else 16);
    # max_cpu_loras adapters kept in host memory on each rank (None: max_loras);
    # lora_modules registered at start-up (--lora-modules name=path)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    lora_modules: list[LoRARequest] = []
    # disaggregated prefill / decode (protocol/kv_connector.py, --kv-transfer-config); None = off
    kv_transfer_config: KVTransferConfig | None = None
    # KV cache events for a router's prefix index (protocol/kv_events.py, --kv-events-config);
    # None = off
    kv_events_config: KVEventsConfig | None = None
    # images (multimodal models, protocol/multimodal.py): the embeddings the encoder may
    # compute in one step (vLLM's max_num_encoder_input_tokens) and the engine core's encoder
    # cache bound, in embeddings (vLLM's encoder_cache_size); None = max_num_batched_tokens
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None


def worker_overlap_on(config: EngineConfig, device_type: str) -> bool:
    """Whether a rank on a device of this type overlaps its host work with the device's."""
    if config.worker_overlap is not None:
        return config.worker_overlap and config.async_scheduling
    return config.async_scheduling and device_type == "cuda"


def config_error(config: EngineConfig) -> str | None:
    """Why these options cannot work together, or None; checked before anything starts."""
    if config.attention_backend not in ("auto", "torch", "cpu", "triton"):
        return (f"unknown attention_backend {config.attention_backend!r}; "
                "expected auto, torch, cpu or triton")
    if config.load_format not in ("auto", "dummy"):
        return f"unknown load_format {config.load_format!r}; expected auto or dummy"
    for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
        value = getattr(config, name)
        if value is not None and value < 1:
            return f"{name} must be >= 1, got {value}"
    if not 0.0 < config.gpu_memory_utilization <= 1.0:
        return f"gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization}"
    if config.kv_cache_memory is not None and config.kv_cache_memory <= 0:
        return f"kv_cache_memory must be > 0 bytes, got {config.kv_cache_memory}"
    offload_error = _kv_offload_error(config)
    if offload_error is not None:
        return offload_error
    if config.device not in ("auto", "cpu", "cuda"):
        return f"unknown device {config.device!r}; expected auto, cpu or cuda"
    if config.speculative_ngram < 0 or config.num_speculative_tokens < 0:
        return "speculative_ngram and num_speculative_tokens must be >= 0"
    if config.speculative_ngram and not config.num_speculative_tokens:
        return "speculative_ngram needs num_speculative_tokens >= 1 (--num-speculative-tokens)"
    if config.num_speculative_tokens and not config.speculative_ngram:
        return "num_speculative_tokens needs speculative_ngram (--speculative-ngram)"
    max_n = config.speculative_ngram
    if max_n and not 1 <= config.speculative_ngram_min <= max_n:
        return (
            f"speculative_ngram_min must be in [1, speculative_ngram={max_n}], "
            f"got {config.speculative_ngram_min}"
        )
    if config.speculative_ngram and config.async_scheduling:
        # The proposer needs the newest token, which async scheduling has not seen yet.
        return "async_scheduling and speculative decoding cannot be combined yet"
    if config.worker_overlap and not config.async_scheduling:
        # without it the core waits for step k's tokens before it sends step k+1
        return "worker_overlap needs async_scheduling (--async-scheduling)"
    if config.structured_outputs_cache_mb < 0:
        return (f"structured_outputs_cache_mb must be >= 0, "
                f"got {config.structured_outputs_cache_mb}")
    if not config.structured_outputs_compile_timeout > 0:
        return (f"structured_outputs_compile_timeout must be > 0 seconds, "
                f"got {config.structured_outputs_compile_timeout}")
    if not config.continuum_max_ttl > 0 or not (config.continuum_ttl or 0.0) >= 0:
        return "continuum_max_ttl must be > 0 and continuum_ttl >= 0 seconds"
    if config.kv_transfer_config is not None:
        err = kv_transfer_config_error(config.kv_transfer_config)
        if err is not None:
            return err
    if config.kv_events_config is not None:
        err = kv_events_config_error(config.kv_events_config)
        if err is not None:
            return err
    if config.max_queued_requests is not None and config.max_queued_requests < 1:
        return f"max_queued_requests must be >= 1, got {config.max_queued_requests}"
    return _lora_error(config)


def _lora_error(config: EngineConfig) -> str | None:
    """The LoRA options (the adapters themselves are checked when every rank reads them)."""
    if not config.enable_lora:
        if config.lora_modules:
            return "lora_modules needs enable_lora (--enable-lora)"
        return None
    if config.max_loras < 1:
        return f"max_loras must be >= 1, got {config.max_loras}"
    if config.max_lora_rank is not None and config.max_lora_rank < 1:
        return f"max_lora_rank must be >= 1, got {config.max_lora_rank}"
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        return (f"max_cpu_loras ({config.max_cpu_loras}) must be >= max_loras "
                f"({config.max_loras})")
    names = [m.lora_name for m in config.lora_modules]
    if len(set(names)) != len(names):
        return f"lora_modules names an adapter twice: {sorted(names)}"
    return None


def _kv_offload_error(config: EngineConfig) -> str | None:
    """The offload tiers' options."""
    if config.kv_offload_memory < 0:
        return f"kv_offload_memory must be >= 0 bytes, got {config.kv_offload_memory}"
    if config.kv_offload_disk_size < 0:
        return f"kv_offload_disk_size must be >= 0 bytes, got {config.kv_offload_disk_size}"
    if config.kv_offload_disk_size and not config.kv_offload_disk:
        return "kv_offload_disk_size needs a directory (--kv-offload-disk DIR)"
    if config.kv_offload_disk is not None and not config.kv_offload_disk:
        return "kv_offload_disk is an empty path"
    if config.kv_offload_disk and not config.kv_offload_disk_size:
        return "kv_offload_disk needs a size (--kv-offload-disk-size, e.g. 64G)"
    if config.kv_offload_disk and not config.kv_offload_memory:
        # the disk tier takes what the host tier evicts, and restores go through host memory
        return "kv_offload_disk needs a host tier (--kv-offload-memory, e.g. 16G)"
    if config.kv_offload_memory and not config.enable_prefix_caching:
        # tier entries are keyed by the prefix cache's block hashes
        return "kv_offload_memory needs prefix caching (--enable-prefix-caching)"
    return None
