"""RMSNorm (with the residual add fused in) and SiLU-and-mul as single Triton passes.

Rounding follows the torch paths (workers/model/layers/) step by step (the residual sum in the
model dtype, the norm in float32 rounded to the model dtype before the weight multiply, silu
rounded before the product), so the two paths differ only by float32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.triton_ops import next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, stride_x, stride_d, stride_o, n_cols,
                     eps, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n_cols
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if RESIDUAL:
        d = tl.load(delta_ptr + row * stride_d + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(dt)
        tl.store(x_ptr + row * stride_x + offs, x, mask=ok)  # the residual stream, in place
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(dt).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(dt), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """norm(x) for x [N, C]; with residual: x += residual in place first, then norm(x)."""
    assert x.dim() == 2 and x.stride(1) == 1
    out = torch.empty_like(x)
    n, c = x.shape
    if n == 0:
        return out
    d = residual if residual is not None else x
    assert d.stride(1) == 1
    _rms_norm_kernel[(n,)](x, d, weight, out, x.stride(0), d.stride(0), out.stride(0), c, eps,
                           BLOCK=next_pow2(c), RESIDUAL=residual is not None)
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_cols
    dt = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(dt), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2 * C] = [gate | up] -> silu(gate) * up [N, C]."""
    assert x.dim() == 2 and x.stride(1) == 1
    n, c = x.shape[0], x.shape[1] // 2
    out = torch.empty(n, c, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block = min(1024, next_pow2(c))
    _silu_and_mul_kernel[(n, triton.cdiv(c, block))](x, out, x.stride(0), out.stride(0), c,
                                                      BLOCK=block)
    return out
