"""Command-line flags shared by the launcher and the benchmark scripts.

Engine options map 1:1 onto EngineConfig fields (`--block-size` -> block_size); torchrun's
flags keep torchrun's names.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from launch.lora_modules import parse_lora_module, resolve_lora_options
from protocol.config import EngineConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """'268435456', '256M', '1.5GiB' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512M, 2G, 1073741824)")
    unit = (m.group(2) or "").lower()[:1]
    return int(float(m.group(1)) * _UNITS[unit])


def add_torchrun_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("torchrun-style process options")
    g.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    g.add_argument("--nnodes", type=int, default=1)
    g.add_argument("--node-rank", "--node_rank", type=int, default=0)
    g.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    g.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        help="rendezvous port (the engine's tcp sockets use the next four); "
        "default: a free port on one node, 29500 with --nnodes > 1",
    )


def add_engine_args(p: argparse.ArgumentParser, default_model: str = "smollm2") -> None:
    d = EngineConfig()
    g = p.add_argument_group("engine options")
    g.add_argument(
        "--model",
        default=default_model,
        help="dummy:tiny, dummy:llama-1b, dummy:llama-8b, dummy:qwen2-0.5b (real shapes, random "
        "weights), smollm2, a Hugging Face directory or a .gguf file",
    )
    g.add_argument("--dtype", default=d.dtype,
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: the checkpoint's dtype on CUDA (bfloat16 for the dummy "
                   "real-shape presets), float32 on CPU")
    g.add_argument("--allow-tf32", action="store_true",
                   help="float32 on CUDA: let matmuls use TF32 tensor cores (faster, "
                   "~1e-3 relative error)")
    g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    g.add_argument("--attention-backend", default=d.attention_backend,
                   choices=["auto", "torch", "cpu", "triton"],
                   help="attention kernels, chosen once per worker (auto: triton on CUDA, "
                   "the C++ kernels on CPU)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly: no CUDA graphs for decode steps")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=d.kv_cache_memory,
                   help="KV cache bytes per rank, e.g. 512M (default: 256M on CPU; on CUDA "
                   "sized by --gpu-memory-utilization)")
    g.add_argument("--kv-offload-memory", type=parse_bytes, default=d.kv_offload_memory,
                   metavar="SIZE",
                   help="host memory per rank for KV blocks evicted from the device pool, "
                   "e.g. 16G: prefix hits there are restored instead of recomputed (0 = off)")
    g.add_argument("--kv-offload-disk", default=d.kv_offload_disk, metavar="DIR",
                   help="a disk tier behind --kv-offload-memory, in DIR/rank<R>/ "
                   "(needs --kv-offload-disk-size)")
    g.add_argument("--kv-offload-disk-size", type=parse_bytes, default=d.kv_offload_disk_size,
                   metavar="SIZE", help="bytes of the disk tier per rank, e.g. 64G")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="share of each GPU the engine may use: the KV cache gets what is left "
                   "after the weights and a profile forward (default 0.9)")
    g.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"],
                   help="dummy: random weights of the model's shape (a Hugging Face directory "
                   "needs only config.json)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--scheduling-policy", default="fcfs",
                   choices=["fcfs", "priority", "continuum"])
    g.add_argument("--prefix-hash", default=d.prefix_hash, choices=["sha256", "fast"])
    g.add_argument(
        "--async-scheduling",
        action="store_true",
        help="schedule step k+1 while the workers run step k",
    )
    g.add_argument(
        "--worker-overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --async-scheduling: each rank prepares step k+1 while its device runs "
        "step k (default: on with CUDA, off on CPU, where the ops are synchronous)",
    )
    g.add_argument(
        "--speculative-ngram",
        type=int,
        default=0,
        metavar="N",
        help="n-gram speculative decoding: longest n-gram to look up (0 = off)",
    )
    g.add_argument("--speculative-ngram-min", type=int, default=1, metavar="N")
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        metavar="K",
        help="drafts proposed per request per step",
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--debug-invariants", action="store_true")
    g.add_argument(
        "--scheduler-reserve-full-isl",
        action="store_true",
        help="admit a request only if the KV cache can hold its whole sequence "
        "(prompt + max_tokens), not just its first chunk",
    )
    g.add_argument(
        "--scheduler-trace",
        default=None,
        metavar="PATH",
        help="write one JSON line per scheduler step to PATH (see README: scheduler trace)",
    )
    g.add_argument("--enable-checksum", action="store_true")
    g.add_argument("--worker-timeout-s", type=float, default=d.worker_timeout_s)
    g.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                   help="refuse new requests (HTTP 503 with Retry-After) while N are admitted "
                   "but not yet running (default: unbounded)")
    g.add_argument("--structured-outputs-cache-mb", type=int,
                   default=d.structured_outputs_cache_mb, metavar="MIB",
                   help="compiled grammars kept for reuse, in the frontend and on each rank "
                   "(least recently used unheld ones leave first)")
    g.add_argument("--structured-outputs-compile-timeout", type=float,
                   default=d.structured_outputs_compile_timeout, metavar="SECONDS",
                   help="a constraint that takes longer to compile (queueing included) fails "
                   "its request with a 400")
    g.add_argument("--continuum-ttl", type=float, default=None, metavar="SECONDS",
                   help="continuum policy: pin every finished turn for this long instead of "
                   "the TTL learned from tool-call gaps (an experiment knob)")
    g.add_argument("--continuum-max-ttl", type=float, default=d.continuum_max_ttl,
                   metavar="SECONDS", help="continuum policy: cap on any pin's TTL")
    g.add_argument("--kv-transfer-config", type=_kv_transfer_config, default=None,
                   metavar="JSON",
                   help='disaggregated prefill/decode, vLLM\'s JSON: {"kv_role": "kv_both"} '
                   '(+ "kv_connector": auto|nixl|tcp|shm, "kv_load_failure_policy": '
                   'recompute|fail, "kv_ip", "kv_port", "kv_lease_s", ...; see README)')
    g.add_argument("--max-num-encoder-input-tokens", type=int, default=None, metavar="N",
                   help="images: embeddings the vision encoder may compute in one step "
                   "(default: --max-num-batched-tokens)")
    g.add_argument("--encoder-cache-size", type=int, default=None, metavar="N",
                   help="images: encoder outputs the engine keeps for reuse, in embeddings "
                   "(default: --max-num-encoder-input-tokens)")
    g.add_argument("--kv-events-config", type=_kv_events_config, default=None, metavar="JSON",
                   help='KV cache events for a router, vLLM\'s JSON: {"enable_kv_cache_events": '
                   'true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"} (+ '
                   '"replay_endpoint", "topic", "buffer_steps", "hwm")')
    add_lora_args(p)


def _kv_transfer_config(text: str) -> Any:
    from protocol.kv_connector import parse_kv_transfer_config

    try:
        return parse_kv_transfer_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_events_config(text: str) -> Any:
    from protocol.kv_events import parse_kv_events_config

    try:
        return parse_kv_events_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_lora_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("LoRA adapters (vLLM's flags)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT directories) over the base model, mixed in "
                   "one batch")
    g.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=[],
                   metavar="NAME=PATH",
                   help="adapters registered at start-up: name=path or "
                   '\'{"name": ..., "path": ..., "base_model_name": ...}\'; they get ids 1, '
                   "2, ... (an adapter the ranks refuse stops the start-up)")
    g.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="adapters in one step (device slots)")
    g.add_argument("--max-lora-rank", type=int, default=None,
                   help="largest adapter rank (slot width); default: the largest rank among "
                   "--lora-modules, else 16")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters each rank keeps in host memory (>= --max-loras; default: "
                   "--max-loras)")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig keyword arguments (minus model and TP size) found in parsed args."""
    fields = set(EngineConfig.__struct_fields__) - {"model", "tensor_parallel_size"}
    return resolve_lora_options({k: v for k, v in vars(args).items() if k in fields})
