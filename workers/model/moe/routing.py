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


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2 * I, H] (gate rows, then up rows); w2 [E, H, I] -> [T, H].

    Pairs (token, slot) are sorted by expert with one stable sort; each expert with tokens
    then runs one GEMM into its rows of a shared buffer (gate|up), SiLU-and-mul runs once over
    all rows, and a second loop runs the down GEMMs; the weights, the unsort and the top-k sum
    are one op each. The loop needs the counts on the host, which is fine on CPU (the CUDA path
    is the fused kernel, which needs neither)."""
    t, k = topk_ids.shape
    e_count, h, inter = w2.shape
    if t == 0:
        return torch.zeros(0, h, dtype=x.dtype, device=x.device)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e_count).tolist()
    rows = x[order // k]
    gate_up = torch.empty(t * k, 2 * inter, dtype=x.dtype, device=x.device)
    spans = []
    start = 0
    for e, n in enumerate(counts):
        if n:
            spans.append((e, start, start + n))
            torch.mm(rows[start : start + n], w13[e].t(), out=gate_up[start : start + n])
        start += n
    act = silu_mul(gate_up)
    down = torch.empty(t * k, h, dtype=x.dtype, device=x.device)
    for e, s, end in spans:
        torch.mm(act[s:end], w2[e].t(), out=down[s:end])
    weighted = (down.float() * topk_weights.reshape(-1)[order, None]).to(x.dtype)
    out = torch.empty_like(weighted)
    out[order] = weighted
    return reduce_topk(out, t, k)
