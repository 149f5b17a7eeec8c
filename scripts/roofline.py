"""Roofline floor of a benchmark workload: the least time the hardware needs for it.

From the model's shape alone:
- prefill: every prompt token passes through every linear layer (2 FLOPs per weight), attends to
  the tokens before it (QK^T and PV: 4 * head_dim FLOPs per query head per key), and the last
  token of each prompt goes through the LM head; time >= FLOPs / peak FLOP/s;
- decode step: reads every weight once (whatever the batch) plus each running request's K/V
  context; time >= max(bytes / memory bandwidth, FLOPs / peak FLOP/s). Mixture-of-experts
  models count a token's FLOPs through its top-k experts only, and a step's bytes through the
  experts its tokens are expected to route to (uniform routing), not all of them.
Requests decode in waves of max_num_seqs, the best case a scheduler can reach. Tensor-parallel
ranks on GPUs split the work over that many devices; CPU ranks share one machine, whose peaks
are measured as a whole. The floor ignores communication, so it is a lower bound, and
roofline_fraction = floor / measured time says how close a run gets to the hardware (1.0 = at
the limit).

Peaks come from a short measurement on the engine's device (a large matmul in the model's dtype,
a large device copy) or from --peak-tflops / --peak-bandwidth-gbs; `peak_source` says which.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    # mixture of experts: moe_layers of the num_layers route each token to top_k of num_experts
    # experts of moe_intermediate; the other layers keep a dense MLP of intermediate
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    moe_layers: int = 0

    @classmethod
    def from_config(cls, cfg: Any) -> ModelShape:
        """From a workers.model.config.ModelConfig (or anything with its field names)."""
        experts = getattr(cfg, "num_experts", 0)
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) \
            if experts else 0
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size,
                   experts, getattr(cfg, "num_experts_per_tok", 0),
                   getattr(cfg, "moe_intermediate_size", 0), moe_layers)

    @property
    def attn_params(self) -> int:
        """q, k, v, o weights of one layer."""
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    @property
    def layer_linear_params(self) -> int:
        """q, k, v, o, gate, up, down weights of one dense layer."""
        return self.attn_params + 3 * self.hidden * self.intermediate

    @property
    def linear_params(self) -> int:
        """Linear weights one token passes through (for MoE layers: its top_k experts and the
        router), so 2 * linear_params is a token's FLOPs outside attention."""
        dense = self.num_layers - self.moe_layers
        moe = self.attn_params + self.top_k * self.expert_params + self.num_experts * self.hidden
        return dense * self.layer_linear_params + self.moe_layers * moe

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def norm_params(self) -> int:
        return (2 * self.num_layers + 1) * self.hidden

    def experts_read(self, num_tokens: int) -> float:
        """Expected distinct experts a layer reads for num_tokens tokens under uniform random
        routing: an expert is missed by one token's top_k with probability 1 - top_k / E."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** num_tokens)

    def weight_bytes_per_step(self, dtype_bytes: int, num_tokens: int | None = None) -> int:
        """Weights a forward of num_tokens tokens reads (the embedding table only by row: left
        out). Dense weights are read in full; of the experts only those the step routes to
        (an expected value; None = every expert), so MoE roofline fractions stay honest."""
        dense_layers = self.num_layers - self.moe_layers
        always = (dense_layers * self.layer_linear_params
                  + self.moe_layers * (self.attn_params + self.num_experts * self.hidden)
                  + self.lm_head_params + self.norm_params)
        experts = self.num_experts if num_tokens is None else self.experts_read(num_tokens)
        return int((always + self.moe_layers * experts * self.expert_params) * dtype_bytes)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * dtype_bytes

    @property
    def attn_flops_per_key(self) -> int:
        """QK^T and PV for one query token against one key, all layers and query heads."""
        return 4 * self.num_layers * self.q_heads * self.head_dim


def prefill_flops(shape: ModelShape, prompt_len: int) -> int:
    """One prompt: linear layers for every token, causal attention, LM head for the last."""
    attn_keys = prompt_len * (prompt_len + 1) // 2  # token i attends to i + 1 keys
    return (2 * shape.linear_params * prompt_len + shape.attn_flops_per_key * attn_keys
            + 2 * shape.lm_head_params)


@dataclass
class Floor:
    prefill_flops: int
    decode_flops: int
    decode_bytes: int
    prefill_s: float
    decode_s: float

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


def workload_floor(shape: ModelShape, prompt_lens: Sequence[int], output_lens: Sequence[int],
                   *, max_batch: int, dtype_bytes: int, peak_flops: float,
                   peak_bytes_per_s: float, num_devices: int = 1) -> Floor:
    """Floor for requests (prompt_lens[i] tokens in, output_lens[i] tokens out), batched in
    order in waves of max_batch. The first output token comes from the prefill; each further
    one is a decode step in which request i's new token attends to prompt + j keys."""
    flops_rate = peak_flops * num_devices
    byte_rate = peak_bytes_per_s * num_devices
    p_flops = sum(prefill_flops(shape, n) for n in prompt_lens)
    kv_token = shape.kv_bytes_per_token(dtype_bytes)
    step_flops_fixed = 2 * (shape.linear_params + shape.lm_head_params)
    d_flops = d_bytes = 0
    decode_s = 0.0
    for w in range(0, len(prompt_lens), max(1, max_batch)):
        wave = list(zip(prompt_lens[w:w + max_batch], output_lens[w:w + max_batch], strict=True))
        for j in range(1, max((o for _, o in wave), default=0)):
            live = [p + j for p, o in wave if o > j]
            ctx = sum(live)
            flops = step_flops_fixed * len(live) + shape.attn_flops_per_key * ctx
            nbytes = shape.weight_bytes_per_step(dtype_bytes, len(live)) + kv_token * ctx
            d_flops += flops
            d_bytes += nbytes
            decode_s += max(nbytes / byte_rate, flops / flops_rate)
    return Floor(p_flops, d_flops, d_bytes, p_flops / flops_rate, decode_s)


# ----------------------------------------------------------------------------- peaks


def measure_peaks(device: str, dtype: str, seconds: float = 0.3) -> tuple[float, float]:
    """(FLOP/s of a large matmul in dtype, bytes/s of a large copy) on device."""
    import torch

    dev = torch.device(device)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def rate(fn: Any, work: float) -> float:
        fn()  # warm-up (kernel choice, page faults)
        sync()
        best, spent = 0.0, 0.0
        while spent < seconds:
            t0 = time.perf_counter()
            fn()
            sync()
            dt = time.perf_counter() - t0
            spent += dt
            best = max(best, work / dt)
        return best

    n = 8192 if cuda else 2048
    a = torch.randn(n, n, device=dev).to(tdt)
    b = torch.randn(n, n, device=dev).to(tdt)
    flops = rate(lambda: torch.mm(a, b), 2.0 * n**3)
    numel = (1 << 30 if cuda else 1 << 28) // 4
    src = torch.ones(numel, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    bandwidth = rate(lambda: dst.copy_(src), 2.0 * numel * 4)  # read + write
    return flops, bandwidth


def add_roofline_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("roofline")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="peak FLOP/s of one device in the model's dtype, in TFLOP/s "
                   "(default: measured with a large matmul)")
    g.add_argument("--peak-bandwidth-gbs", type=float, default=None,
                   help="memory bandwidth of one device in GB/s (default: measured with a copy)")


def peaks(args: argparse.Namespace, device: str) -> tuple[float, float, str]:
    """(FLOP/s, bytes/s, peak_source): flags where given, the rest measured on device."""
    flops = args.peak_tflops * 1e12 if args.peak_tflops else None
    bw = args.peak_bandwidth_gbs * 1e9 if args.peak_bandwidth_gbs else None
    if flops is not None and bw is not None:
        return flops, bw, "flags"
    m_flops, m_bw = measure_peaks(device, args.dtype)
    source = "measured" if flops is None and bw is None else "flags+measured"
    return flops or m_flops, bw or m_bw, source


def roofline_report(args: argparse.Namespace, device: str, prompt_lens: Sequence[int],
                    output_lens: Sequence[int], max_batch: int, measured_s: float) -> dict:
    """The roofline keys of a benchmark's JSON for this workload and its measured time."""
    from workers.model.loader import load_model_config

    shape = ModelShape.from_config(load_model_config(args.model))
    flops, bw, source = peaks(args, device)
    devices = args.tensor_parallel_size if device.startswith("cuda") else 1
    floor = workload_floor(shape, prompt_lens, output_lens, max_batch=max_batch,
                           dtype_bytes=DTYPE_BYTES[args.dtype], peak_flops=flops,
                           peak_bytes_per_s=bw, num_devices=devices)
    return {
        "peak_tflops": flops / 1e12,
        "peak_bandwidth_gbs": bw / 1e9,
        "peak_source": source,
        "roofline_device": device,
        "roofline_devices": devices,
        "prefill_flops": floor.prefill_flops,
        "decode_flops": floor.decode_flops,
        "decode_bytes": floor.decode_bytes,
        "roofline_prefill_floor_s": floor.prefill_s,
        "roofline_decode_floor_s": floor.decode_s,
        "roofline_floor_s": floor.total_s,
        "roofline_fraction": floor.total_s / measured_s if measured_s > 0 else float("nan"),
    }


def print_roofline(res: dict) -> None:
    print(
        f"roofline: floor {res['roofline_floor_s']:.4f} s (prefill "
        f"{res['roofline_prefill_floor_s']:.4f} s, decode {res['roofline_decode_floor_s']:.4f} s) "
        f"at {res['peak_tflops']:.2f} TFLOP/s and {res['peak_bandwidth_gbs']:.1f} GB/s per "
        f"device x {res['roofline_devices']} ({res['peak_source']}): "
        f"{res['roofline_fraction']:.3f} of the hardware limit"
    )
