"""Router top-k and the torch expert computation: the portable path (CPU) and the oracle the
fused Triton kernels are tested against.

Rounding contract shared with the Triton path: gate|up and down products are rounded to the
model dtype (as torch linears are), silu is rounded before the product with up, each pair's
down output times its router weight is rounded to the model dtype, and the top-k reduction sums
in float32 and rounds once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64).

    softmax in float32, then torch.topk, then optional renormalisation over the k: the order
    transformers uses for Qwen3-MoE and Mixtral, so ties fall to the same experts (topk keeps
    the lower index among equal values)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def reduce_topk(weighted: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """[T * k, H] pair outputs (pair = token * k + slot) -> [T, H], summed in float32."""
    h = weighted.shape[-1]
    return weighted.view(num_tokens, top_k, h).sum(dim=1, dtype=torch.float32).to(weighted.dtype)


# Batched GEMMs over every expert (padded to the busiest expert's rows) while that pads the
# pairs by at most this factor; past it (many experts, few tokens: a decode step of a 128-expert
# model) the per-expert loop reads only the routed experts' weights.
_BATCHED_MAX_PADDING = 4


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2 * I, H] (gate rows, then up rows); w2 [E, H, I] -> [T, H].

    Pairs (token, slot) are sorted by expert with one stable sort. When the experts are evenly
    loaded, each GEMM is one batched matmul over all experts (pairs laid out [E, busiest, H],
    zero rows where an expert has fewer): a few large ops instead of two per expert, which
    matters on CPU, where every op is a parallel region whose barrier waits for every thread.
    Otherwise each expert with tokens runs its two GEMMs into its rows of shared buffers.
    Either way SiLU-and-mul, the router weights, the unsort and the top-k sum are one op each.
    The counts go to the host, which is fine on CPU (the CUDA path is the fused kernel)."""
    t, k = topk_ids.shape
    e_count, h, inter = w2.shape
    n = t * k
    if t == 0:
        return torch.zeros(0, h, dtype=x.dtype, device=x.device)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts_t = torch.bincount(flat, minlength=e_count)
    counts = counts_t.tolist()
    rows = x[order // k]
    busiest = max(counts)
    if e_count * busiest <= _BATCHED_MAX_PADDING * n:
        experts = flat[order]
        slot = torch.arange(n, device=x.device) - (counts_t.cumsum(0) - counts_t)[experts]
        grouped = x.new_zeros(e_count, busiest, h)
        grouped[experts, slot] = rows
        act = silu_mul(torch.bmm(grouped, w13.transpose(1, 2)))
        down = torch.bmm(act, w2.transpose(1, 2))[experts, slot]
    else:
        gate_up = torch.empty(n, 2 * inter, dtype=x.dtype, device=x.device)
        spans = []
        start = 0
        for e, c in enumerate(counts):
            if c:
                spans.append((e, start, start + c))
                torch.mm(rows[start : start + c], w13[e].t(), out=gate_up[start : start + c])
            start += c
        act = silu_mul(gate_up)
        down = torch.empty(n, h, dtype=x.dtype, device=x.device)
        for e, s, end in spans:
            torch.mm(act[s:end], w2[e].t(), out=down[s:end])
    weighted = (down.float() * topk_weights.reshape(-1)[order, None]).to(x.dtype)
    out = torch.empty_like(weighted)
    out[order] = weighted
    return reduce_topk(out, t, k)
