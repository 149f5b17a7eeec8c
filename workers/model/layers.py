"""Tensor-parallel building blocks: vocab-parallel embedding / LM head, column- and row-parallel
linears, RMSNorm and rotary embeddings.

Each layer holds only this rank's shard. Weights are filled by the model's loader (llama.py), which
knows the fused layouts; the layers only compute.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from workers import cpu_ops, triton_ops
from workers.parallel.distributed import tp_all_gather, tp_all_reduce, tp_world_size


def pad_to_multiple(n: int, k: int) -> int:
    return -(-n // k) * k


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a CPU linear weight [out, in], or None where it does not apply.

    Reordered once after loading, so no matmul re-packs the weight: measured 1.1-1.6x faster
    bf16 linears at decode batch sizes on CPU (5.7x for one token through the LM head).
    """
    if not (cpu_ops.ENABLED and weight.device.type == "cpu" and weight.dim() == 2
            and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):  # a torch build without these oneDNN ops
        return None
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    if packed is not None and x.dim() == 2 and x.dtype == weight.dtype:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


KernelPath = Literal["cpu", "triton", "torch"]


def kernel_path(device: torch.device, dtype: torch.dtype) -> KernelPath:
    """The implementation a layer's fused elementwise ops take on this device and dtype,
    chosen when the layer is built: the C++ kernels on CPU, Triton on CUDA, else torch ops."""
    if device.type == "cpu" and cpu_ops.active(torch.empty(0, dtype=dtype)):
        return "cpu"
    if device.type == "cuda" and triton_ops.available():
        return "triton"
    return "torch"


def reselect_kernels(model: nn.Module) -> None:
    """Choose every layer's kernel path again (after cpu_ops.ENABLED changed: tests compare
    the kernels against the torch ops on one model)."""
    for m in model.modules():
        if isinstance(m, (RMSNorm, SiluAndMul)):
            m.select_kernels()


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device),
                                   requires_grad=False)
        self.select_kernels()

    def select_kernels(self) -> None:
        self.path = kernel_path(self.weight.device, self.weight.dtype)
        if self.path == "triton":
            from workers.triton_ops import norm_act

            self._triton_norm = norm_act.rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "cpu" and x.dim() == 2:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        if self.path == "triton" and x.dim() == 2 and x.stride(-1) == 1:
            return self._triton_norm(x, self.weight, self.eps)
        return self.forward_torch(x)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, norm(h + delta)); the kernel paths add in place, one pass for both."""
        if self.path == "cpu" and h.dim() == 2 and h.is_contiguous():
            return h, cpu_ops.rms_norm(h, self.weight, self.eps, residual=delta)
        if (self.path == "triton" and h.dim() == 2 and h.is_contiguous()
                and delta.stride(-1) == 1):
            return h, self._triton_norm(h, self.weight, self.eps, residual=delta)
        h = h + delta
        return h, self.forward_torch(h)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 so bf16/fp16 runs do not lose the small variances.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2 * C] = [gate | up] -> silu(gate) * up in torch ops (the reference)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu(gate) * up as one fused kernel where one applies, chosen when built."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.dtype, self.device = dtype, device
        self.select_kernels()

    def select_kernels(self) -> None:
        self.path = kernel_path(self.device, self.dtype)
        if self.path == "triton":
            from workers.triton_ops import norm_act

            self._triton = norm_act.silu_and_mul

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.path == "cpu" and gate_up.dim() == 2:
            return cpu_ops.silu_and_mul(gate_up)
        if self.path == "triton" and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            return self._triton(gate_up)
        return silu_and_mul(gate_up)


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * V/tp, (rank+1) * V/tp) of the (padded) vocabulary live on this rank."""

    def __init__(self, vocab: int, hidden: int, tp_rank: int, tp_size: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.vocab = vocab
        self.rows = pad_to_multiple(vocab, tp_size) // tp_size
        self.start = tp_rank * self.rows
        self.weight = _param((self.rows, hidden), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows >= self.vocab:  # one shard holds every id: no masking, no reduce
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        # Other ranks own these ids: look up row 0 and zero it, the all-reduce fills them in.
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(out)


class ParallelLMHead(nn.Module):
    """Vocab-parallel output projection; every rank ends with the identical full logits."""

    def __init__(self, embedding: VocabParallelEmbedding | None, vocab: int, hidden: int,
                 tp_rank: int, tp_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.vocab = vocab
        self.rows = pad_to_multiple(vocab, tp_size) // tp_size
        self.start = tp_rank * self.rows
        # Tied embeddings share the embedding's shard (same vocab split), nothing to load.
        self.tied = embedding
        self.weight = None if embedding is not None else _param((self.rows, hidden), dtype, device)
        self.packed: torch.Tensor | None = None
        # bf16 on a CPU with AVX512-BF16: the weight in cpu_ops.bf16_matmul's layout, which
        # also serves greedy decoding with a fused argmax (no logits written).
        self.pairs: torch.Tensor | None = None

    def prepack(self) -> None:
        weight = self.tied.weight if self.tied is not None else self.weight
        if (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                and weight.shape[1] % 2 == 0 and cpu_ops.bf16_matmul_available()):
            self.pairs = cpu_ops.pack_bf16_pairs(weight.detach().contiguous())
        else:
            self.packed = prepack(weight)

    def _pairs_for(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.pairs is not None and hidden.dtype == torch.bfloat16 and hidden.dim() == 2 \
                and cpu_ops.active(hidden):
            return self.pairs
        return None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.tied.weight if self.tied is not None else self.weight
        pairs = self._pairs_for(hidden)
        if pairs is not None:
            y = cpu_ops.bf16_matmul(hidden.contiguous(), pairs, self.rows)[0]
            assert y is not None
            logits = y.float()
        else:
            logits = linear(hidden, weight, self.packed).float()
        return tp_all_gather(logits, dim=-1)[..., : self.vocab]

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax over the full vocabulary without gathering the logits: [N, hidden] -> [N].

        Each rank takes the max of its shard; only (max, index) pairs cross ranks, a few
        bytes per request instead of the whole vocabulary. Ties resolve to the lowest id, as
        torch.argmax over the gathered logits would.
        """
        weight = self.tied.weight if self.tied is not None else self.weight
        pad = max(0, self.start + self.rows - self.vocab)  # padding rows of the last shard
        pairs = self._pairs_for(hidden) if self.rows > pad else None
        if pairs is not None:
            # The argmax runs on each register tile of the matmul: no logits are written.
            _, found, top = cpu_ops.bf16_matmul(hidden.contiguous(), pairs, self.rows,
                                                logits=False, argmax_cols=self.rows - pad)
            assert found is not None and top is not None
            best, idx = top, found
        elif cpu_ops.active(hidden):
            logits = linear(hidden, weight, self.packed)
            # One pass over the model-dtype logits: no float32 copy, no masking pass.
            best, idx = cpu_ops.argmax(logits, cols=max(0, self.rows - pad))
        else:
            # argmax in the model dtype: the float32 copy of [N, vocab] logits would add a
            # full write and read (max and its index are the same either way).
            logits = linear(hidden, weight, self.packed)
            if pad > 0:
                logits[:, self.rows - pad :] = float("-inf")
            best, idx = logits.max(dim=-1)
            best = best.float()
        if tp_world_size() == 1:
            return idx
        # Ids < 2**24 are exact in float32, so (max, id) travel in one small gather.
        pair = torch.stack([best, (idx + self.start).float()], dim=-1)
        every = tp_all_gather(pair, dim=0).view(-1, *pair.shape)  # [tp, N, 2]
        winner = every[..., 0].argmax(dim=0)  # first (lowest) rank holding the max
        return every[..., 1].gather(0, winner.unsqueeze(0)).squeeze(0).long()


class ColumnParallelLinear(nn.Module):
    """y_shard = x @ W_shard^T (+ b_shard): output features split over ranks, no communication."""

    def __init__(self, in_features: int, out_per_rank: int, bias: bool,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _param((out_per_rank, in_features), dtype, device)
        self.bias = _param((out_per_rank,), dtype, device) if bias else None
        self.packed: torch.Tensor | None = None

    def prepack(self) -> None:
        self.packed = prepack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split over ranks; partial products are summed with one all-reduce."""

    def __init__(self, in_per_rank: int, out_features: int, bias: bool, tp_rank: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _param((out_features, in_per_rank), dtype, device)
        # The bias is added once, after the reduce, so it is not counted tp_size times.
        self.bias = _param((out_features,), dtype, device) if bias else None
        self.packed: torch.Tensor | None = None

    def prepack(self) -> None:
        self.packed = prepack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(linear(x, self.weight, self.packed))
        return y + self.bias if self.bias is not None else y


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (float64) for rotary embeddings, with linear or llama3 scaling."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: linear, llama3)")
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    # Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half (GPT-NeoX / HF Llama) layout; cos/sin precomputed once for every position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
        self.register_buffer("cos", angles.cos().float().to(device), persistent=False)
        self.register_buffer("sin", angles.sin().float().to(device), persistent=False)

    def rotate_and_cache_(self, positions: torch.Tensor, qkv: torch.Tensor, q_heads: int,
                          kv_heads: int, head_dim: int, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slots: torch.Tensor) -> bool:
        """Fused [q | k | v] rows qkv [T, ...]: rotate q and k in place and write K/V into the
        cache slots, in one CPU kernel pass; False (nothing done) when the kernel does not
        apply, and the caller rotates and writes the cache itself."""
        if not (cpu_ops.active(qkv) and qkv.stride(-1) == 1 and positions.dtype == torch.int64
                and slots.dtype == torch.int64 and k_cache.dtype == qkv.dtype
                and k_cache.is_contiguous() and v_cache.is_contiguous()):
            return False
        cpu_ops.rotary_kv_(qkv, q_heads, kv_heads, head_dim, positions.contiguous(), self.cos,
                           self.sin, k_cache, v_cache, slots.contiguous())
        return True

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.forward_torch(positions, x)

    def forward_torch(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] -> rotated, same dtype."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, hd/2]
        sin = self.sin[positions].unsqueeze(1)
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
