"""Batched LoRA in Triton: many adapters in one step, tokens grouped by the slot they use.

One call adds ``x @ A[s]^T @ B[s]^T`` to ``y`` for every token whose request runs the adapter
in slot s, in two launches:

1. shrink: ``buf[t] = x[t] @ A[s]^T`` for the NS projections packed in the layer at once (A[s]
   holds NS blocks of R rows: [S, NS * R, K]) into a float32 buffer [T, NS * R];
2. expand: ``y[t, cols_j] += buf[t, j*R:(j+1)*R] @ B[s, cols_j]^T`` for each packed projection j
   (q, k, v of qkv_proj; gate, up of gate_up_proj), whose output columns are
   [offsets[j], offsets[j + 1]).

Tokens reach the kernels through ``tokens`` (token indices sorted by slot), ``starts`` and
``counts`` per slot, all device tensors: the grid is (slots, token blocks, column blocks) and
fixed by the shapes alone, a program past its slot's count returns at once (an empty slot costs
one load per program, a base-model token nothing), so a step can be captured in a CUDA graph
with the worst-case token count.

Tile configs live in SHRINK / EXPAND (also what the ahead-of-time compile check enumerates):
``pick`` chooses by the largest group, small tiles for decode, taller ones for prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from workers.triton_ops import interpreting


@dataclass(frozen=True)
class LoRATiles:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int  # the reduction tile: hidden features (shrink) or rank (expand)
    num_warps: int
    num_stages: int


# shrink: N is NS * rank (48 at rank 16 for qkv), K the hidden size: long K tiles stream A[s];
# expand: K is the rank (16..), N the layer's output columns. Not yet tuned on a GPU.
SHRINK: dict[str, LoRATiles] = {
    "small": LoRATiles(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=2),
    "large": LoRATiles(BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2),
}
EXPAND: dict[str, LoRATiles] = {
    "small": LoRATiles(BLOCK_M=16, BLOCK_N=64, BLOCK_K=16, num_warps=4, num_stages=2),
    "large": LoRATiles(BLOCK_M=64, BLOCK_N=64, BLOCK_K=16, num_warps=4, num_stages=2),
}
_LARGE_FROM_TOKENS = 64  # tokens of the largest group from which the tall tiles pay off


def pick(max_tokens_per_slot: int) -> str:
    return "large" if max_tokens_per_slot >= _LARGE_FROM_TOKENS else "small"


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, buf_ptr, tok_ptr, start_ptr, count_ptr, N, K,
                        stride_xm, stride_as, stride_an, stride_bm, IEEE: tl.constexpr,
                        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """buf[tok, n] = sum_k x[tok, k] * A[slot, n, k] for one tile of one slot's tokens.

    IEEE: exact float32 products (float32 models). UPCAST: float32 operands (the interpreter
    cannot multiply bf16)."""
    slot = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    count = tl.load(count_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return  # an empty slot, or past this slot's tokens (the grid covers the worst case)
    start = tl.load(start_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    tok = tl.load(tok_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # Row bases and 32-bit tile offsets, not 64-bit pointer tiles (those cost the registers
    # the accumulator needs; the tall tiles spilled)
    x_rows = x_ptr + tok[:, None] * stride_xm
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    a_off = offs_n[None, :] * stride_an + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        xa = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :],
                     other=0.0)
        w = tl.load(a_base + k0 + a_off, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            xa = xa.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc = tl.dot(xa, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(xa, w, acc)
    tl.store(buf_ptr + tok[:, None] * stride_bm + offs_n[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _lora_expand_kernel(buf_ptr, b_ptr, y_ptr, tok_ptr, start_ptr, count_ptr, off_ptr, R,
                        blocks_per_slice, stride_bm, stride_bs, stride_bn, stride_ym,
                        IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[tok, n] += sum_r buf[tok, j*R + r] * B[slot, n, r] for the columns n of packed
    projection j = pid_n // blocks_per_slice, one tile of one slot's tokens."""
    slot = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    count = tl.load(count_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    j = pid_n // blocks_per_slice
    n0 = tl.load(off_ptr + j) + (pid_n % blocks_per_slice) * BLOCK_N
    n_end = tl.load(off_ptr + j + 1)
    if n0 >= n_end:
        return  # a narrower projection than the widest one (k/v next to q)
    start = tl.load(start_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    tok = tl.load(tok_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_end
    offs_r = tl.arange(0, BLOCK_K)
    t_rows = buf_ptr + tok[:, None] * stride_bm + j * R
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    b_off = offs_n[None, :] * stride_bn + offs_r[:, None]
    dt = y_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_K):
        r_ok = offs_r + r0 < R
        t = tl.load(t_rows + (r0 + offs_r)[None, :], mask=m_ok[:, None] & r_ok[None, :],
                    other=0.0)
        w = tl.load(b_base + r0 + b_off, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            w = w.to(tl.float32)
        elif not IEEE:
            t = t.to(dt)  # the half-precision model's own rounding of lora_A's output
        if IEEE:
            acc = tl.dot(t, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(t, w, acc)
    y_ptrs = y_ptr + tok[:, None] * stride_ym + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(dt), mask=mask)


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             offsets: torch.Tensor, max_slice: int, tokens: torch.Tensor, starts: torch.Tensor,
             counts: torch.Tensor, max_count: int) -> None:
    """y += LoRA(x) in place for the grouped tokens.

    x [T, K]; y [T, N]; a [S, NS * R, K]; b [S, N, R] (both contiguous); offsets [NS + 1]
    int32, the packed projections' column ranges in y, the widest ``max_slice`` columns;
    tokens [>= sum(counts)] int32 sorted by slot, slot s's at [starts[s], starts[s] +
    counts[s]); max_count: a bound on counts (the token count when captured in a graph)."""
    if max_count == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    assert y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    num_slots, n_shrink, k = a.shape
    rank = b.shape[2]
    num_slices = offsets.numel() - 1
    buf = torch.empty(x.shape[0], n_shrink, dtype=torch.float32, device=x.device)
    ieee = x.dtype == torch.float32
    upcast = interpreting() and x.dtype != torch.float32
    size = pick(max_count)
    cfg = SHRINK[size]
    grid = (num_slots, triton.cdiv(max_count, cfg.BLOCK_M), triton.cdiv(n_shrink, cfg.BLOCK_N))
    _lora_shrink_kernel[grid](
        x, a, buf, tokens, starts, counts, n_shrink, k, x.stride(0), a.stride(0), a.stride(1),
        buf.stride(0), IEEE=ieee, UPCAST=upcast, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
        BLOCK_K=cfg.BLOCK_K, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    cfg = EXPAND[size]
    per_slice = triton.cdiv(max_slice, cfg.BLOCK_N)
    grid = (num_slots, triton.cdiv(max_count, cfg.BLOCK_M), num_slices * per_slice)
    _lora_expand_kernel[grid](
        buf, b, y, tokens, starts, counts, offsets, rank, per_slice, buf.stride(0),
        b.stride(0), b.stride(1), y.stride(0), IEEE=ieee, UPCAST=upcast, BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)


# Ahead-of-time compile check (scripts/compile_check.py): the argument types of both kernels
# and every tile config lora_add launches.
_SHRINK_SIG = {"x_ptr": "*{dt}", "a_ptr": "*{dt}", "buf_ptr": "*fp32", "tok_ptr": "*i32",
               "start_ptr": "*i32", "count_ptr": "*i32", "N": "i32", "K": "i32",
               "stride_xm": "i32", "stride_as": "i32", "stride_an": "i32", "stride_bm": "i32"}
_EXPAND_SIG = {"buf_ptr": "*fp32", "b_ptr": "*{dt}", "y_ptr": "*{dt}", "tok_ptr": "*i32",
               "start_ptr": "*i32", "count_ptr": "*i32", "off_ptr": "*i32", "R": "i32",
               "blocks_per_slice": "i32", "stride_bm": "i32", "stride_bs": "i32",
               "stride_bn": "i32", "stride_ym": "i32"}


def compile_variants(dtypes: tuple[str, ...] = ("bf16", "fp16")
                     ) -> list[tuple[str, object, dict[str, str], dict[str, object],
                                     dict[str, int]]]:
    """(name, kernel, signature, constexprs, options) of every launch lora_add makes, for
    triton.compile(ASTSource(kernel, signature, constexprs), options=options)."""
    out: list[tuple[str, object, dict[str, str], dict[str, object], dict[str, int]]] = []
    for dt in dtypes:
        for kind, fn, sig_t, tiles in (("lora_shrink", _lora_shrink_kernel, _SHRINK_SIG, SHRINK),
                                       ("lora_expand", _lora_expand_kernel, _EXPAND_SIG, EXPAND)):
            for size, cfg in tiles.items():
                const: dict[str, object] = dict(
                    IEEE=dt == "fp32", UPCAST=False, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                    BLOCK_K=cfg.BLOCK_K)
                sig = {k: v.format(dt=dt) for k, v in sig_t.items()}
                sig |= {k: "constexpr" for k in const}
                out.append((f"{kind} {size}", fn, sig, const,
                            dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)))
    return out
