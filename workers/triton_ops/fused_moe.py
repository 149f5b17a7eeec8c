"""Fused mixture-of-experts in Triton: a grouped GEMM over expert-sorted, block-aligned tokens.

One call (after the router's top-k, which stays in torch):

1. align_by_expert: the T * k (token, slot) pairs sorted by expert with a stable sort, each
   expert's run padded to a multiple of BLOCK_M with a sentinel, so every BLOCK_M rows of the
   sorted order belong to one expert. All torch device ops with sizes fixed by (T, k, E, BLOCK_M)
   alone: no host synchronisation, so a decode step can be captured in a CUDA graph (the grid
   covers the worst-case padding; blocks past the real end exit at once).
2. One launch of the grouped GEMM for gate and up together (both accumulators per tile), SiLU
   and the product fused into its epilogue -> [T * k, I].
3. One launch for down, the pair's router weight applied in its epilogue -> [T * k, H].
4. The reduction over the k slots of each token (torch, summing in float32).

Rounding follows workers/model/moe/routing.py (the torch oracle) step by step, so the two paths
differ only by float32 summation order. No Python loop over experts anywhere.

Block configs live in CONFIGS (one place, also what an ahead-of-time compile check enumerates):
`pick_config` chooses by the number of pairs, a shape known when a graph is captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from workers.triton_ops import interpreting


@dataclass(frozen=True)
class MoEConfig:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


# decode batches route a few pairs to each expert: short M tiles waste less padding; prefill
# tiles are taller for reuse of each expert's weight tile across tokens. Sized so that neither
# GEMM spills registers on sm_80 or sm_90, also when compiled at the default 4 warps (taller or
# wider tiles spilled: the gated GEMM holds two accumulators and two weight tiles); the
# gathered A rows defeat software pipelining, so num_stages changes nothing here. Not yet tuned
# on a GPU.
CONFIGS: dict[str, MoEConfig] = {
    "small": MoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2),
    "large": MoEConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=16, num_warps=4, num_stages=2),
}
# pairs per expert (on average) from which the large tiles pay off
_LARGE_FROM_PAIRS_PER_EXPERT = 32


def pick_config(num_pairs: int, num_experts: int) -> MoEConfig:
    if num_pairs >= _LARGE_FROM_PAIRS_PER_EXPERT * num_experts:
        return CONFIGS["large"]
    return CONFIGS["small"]


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_pair_ids [P], block_experts [P // block_m], num_padded [1]).

    sorted_pair_ids lists pair indices (token * k + slot) grouped by expert, each group padded
    to a multiple of block_m with the sentinel T * k; block_experts[b] is the expert of rows
    [b * block_m, (b+1) * block_m); num_padded is the used length. P is the worst case,
    T * k + min(E, T * k) * (block_m - 1) rounded to block_m, fixed by the shapes."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    dev = flat.device
    worst = n + min(num_experts, n) * (block_m - 1)
    size = triton.cdiv(worst, block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    count_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    dest = (padded_end - padded)[experts] + torch.arange(n, device=dev) - count_start[experts]
    sorted_ids = torch.full((size,), n, dtype=torch.int64, device=dev)
    sorted_ids.scatter_(0, dest, order)
    starts = torch.arange(0, size, block_m, device=dev)
    block_experts = torch.searchsorted(padded_end, starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_experts, padded_end[-1:]


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weight_ptr, sorted_ptr, block_expert_ptr,
                         num_padded_ptr, N, K, num_pairs, stride_am, stride_be, stride_bn,
                         stride_bk, stride_cm, A_ROWS_PER_PAIR_DIV: tl.constexpr,
                         GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                         UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """C[pair, n] = A[pair // DIV] @ B[expert]^T for one BLOCK_M x BLOCK_N tile of sorted pairs.

    GATED: B holds [gate rows | up rows] (N each); the tile computes both and stores
    silu(gate) * up. MUL_WEIGHT: the result is scaled by the pair's router weight. IEEE: exact
    float32 products (float32 models; tf32 would drift from the oracle). UPCAST: the operands in
    float32 (the interpreter cannot multiply bf16: numpy has no such type)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the last expert's padded run (the grid covers the worst case)
    dt = c_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    real = pair < num_pairs  # padding rows carry the sentinel num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    a_rows = (pair // A_ROWS_PER_PAIR_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # Row bases and 32-bit tile offsets, not 64-bit pointer tiles: a [BLOCK_K, BLOCK_N] tile of
    # pointers (two of them when GATED) costs registers the accumulators need (it spilled).
    a_rows_ptr = a_ptr + a_rows[:, None] * stride_am
    b_base = b_ptr + expert * stride_be
    b_off = offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        a = tl.load(a_rows_ptr + (k0 + offs_k)[None, :], mask=real[:, None] & k_ok[None, :],
                    other=0.0)
        b_k = b_base + k0 * stride_bk
        b = tl.load(b_k + b_off, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if GATED:
            b_up = tl.load(b_k + N * stride_bn + b_off, mask=k_ok[:, None] & n_ok[None, :],
                           other=0.0)
            if UPCAST:
                b_up = b_up.to(tl.float32)
            if IEEE:
                acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, b_up, acc_up)
    out = acc.to(dt).to(tl.float32)
    if GATED:
        act = (out / (1.0 + tl.exp(-out))).to(dt).to(tl.float32)
        out = act * acc_up.to(dt).to(tl.float32)
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + pair, mask=real, other=0.0).to(tl.float32)
        out = out * w[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(dt), mask=real[:, None] & n_ok[None, :])


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor,
            sorted_ids: torch.Tensor, block_experts: torch.Tensor, num_padded: torch.Tensor,
            n: int, top_k_div: int, gated: bool, mul_weight: bool, cfg: MoEConfig) -> None:
    assert a.stride(1) == 1 and b.is_contiguous() and c.stride(1) == 1
    grid = (block_experts.numel(), triton.cdiv(n, cfg.BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, block_experts, num_padded, n, a.shape[1], c.shape[0],
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
        A_ROWS_PER_PAIR_DIV=top_k_div, GATED=gated, MUL_WEIGHT=mul_weight,
        IEEE=a.dtype == torch.float32, UPCAST=interpreting() and a.dtype != torch.float32,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  cfg: MoEConfig | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2 * I, H] (gate rows, then up rows); w2 [E, H, I]; router top-k
    weights (float32) and ids [T, k] -> [T, H] in x's dtype."""
    t, k = topk_ids.shape
    e, h, inter = w2.shape
    if t == 0:
        return torch.zeros(0, h, dtype=x.dtype, device=x.device)
    cfg = cfg or pick_config(t * k, e)
    x = x.contiguous()
    sorted_ids, block_experts, num_padded = align_by_expert(topk_ids, e, cfg.BLOCK_M)
    weights = topk_weights.reshape(-1).float().contiguous()
    act = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    _launch(x, w13, act, weights, sorted_ids, block_experts, num_padded, inter, k, True, False,
            cfg)
    pair_out = torch.empty(t * k, h, dtype=x.dtype, device=x.device)
    _launch(act, w2, pair_out, weights, sorted_ids, block_experts, num_padded, h, 1, False, True,
            cfg)
    return pair_out.view(t, k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)


# Ahead-of-time compile check (a GPU-less machine can compile for sm_80/sm_90): the argument
# types of _grouped_gemm_kernel and every constexpr combination fused_experts launches.
_SIGNATURE = {"a_ptr": "*{dt}", "b_ptr": "*{dt}", "c_ptr": "*{dt}", "weight_ptr": "*fp32",
              "sorted_ptr": "*i64", "block_expert_ptr": "*i64", "num_padded_ptr": "*i64",
              "N": "i32", "K": "i32", "num_pairs": "i32", "stride_am": "i32",
              "stride_be": "i32", "stride_bn": "i32", "stride_bk": "i32", "stride_cm": "i32"}


def compile_variants(dtypes: tuple[str, ...] = ("bf16", "fp16", "fp32"), top_k: int = 8
                     ) -> list[tuple[object, dict[str, str], dict[str, object], dict[str, int]]]:
    """(kernel, signature, constexprs, options) for triton.compile(ASTSource(kernel, signature,
    constexprs), target=GPUTarget("cuda", 90, 32), options=options): both GEMMs (gate+up with
    SiLU-mul, down with router weights) x every CONFIGS entry x dtype."""
    out = []
    for dt in dtypes:
        for cfg in CONFIGS.values():
            for gated in (True, False):
                const: dict[str, object] = dict(
                    A_ROWS_PER_PAIR_DIV=top_k if gated else 1, GATED=gated,
                    MUL_WEIGHT=not gated, IEEE=dt == "fp32", UPCAST=False,
                    BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K)
                sig = {k: v.format(dt=dt) for k, v in _SIGNATURE.items()}
                sig |= {k: "constexpr" for k in const}
                out.append((_grouped_gemm_kernel, sig, const,
                            dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)))
    return out
