"""The sparse MoE block of a decoder layer: router, this rank's slice of every expert, and one
all-reduce.

Tensor parallelism slices every expert's intermediate dimension (no expert parallelism): rank r
holds rows [r * I/tp, (r+1) * I/tp) of each expert's gate and up projections (column-parallel)
and the same columns of its down projection (row-parallel), so each rank computes a partial sum
of every routed expert's output and one all-reduce per layer completes it, as for the dense MLP.
I is padded up to a multiple of tp with zero rows/columns, which add nothing. The router is
replicated and runs in float32 on every rank, so all ranks route every token identically.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers import triton_ops
from workers.model.config import ModelConfig
from workers.model.layers import pad_to_multiple
from workers.model.llama import WeightSource, read_padded
from workers.model.moe.routing import fused_experts_torch, select_experts
from workers.parallel.distributed import tp_all_reduce

# HF names of one expert's (gate, up, down) projections per model family
QWEN3_MOE_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")
MOE_PATHS = ("torch", "triton")


def moe_param_shapes(cfg: ModelConfig, prefix: str, expert_names: tuple[str, str, str]
                     ) -> dict[str, tuple[int, ...]]:
    """HF names and full shapes of one sparse block's tensors under `prefix`."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    gate, up, down = expert_names
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.gate.weight": (cfg.num_experts, h)}
    for e in range(cfg.num_experts):
        p = f"{prefix}.experts.{e}"
        shapes |= {f"{p}.{gate}.weight": (inter, h), f"{p}.{up}.weight": (inter, h),
                   f"{p}.{down}.weight": (h, inter)}
    return shapes


def default_moe_path(device: torch.device) -> str:
    """The fused Triton kernels on CUDA (where triton imports), the torch path elsewhere."""
    return "triton" if device.type == "cuda" and triton_ops.available() else "torch"


def set_moe_paths(model: nn.Module, attention_backend: str) -> None:
    """The MoE path follows the attention backend, chosen once at start-up: the Triton backend
    (the CUDA path's kernels) brings the fused MoE kernels, so a run on Triton (a GPU, or CPU
    tensors under the interpreter in tests) exercises both; the torch and C++ backends use the
    torch path."""
    path = "triton" if attention_backend == "triton" else "torch"
    for m in model.modules():
        if isinstance(m, SparseMoeBlock):
            m.set_path(path)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_rank: int, tp_size: int, dtype: torch.dtype,
                 device: torch.device, hf_name: str, expert_names: tuple[str, str, str]):
        super().__init__()
        self.hf_name, self.expert_names = hf_name, expert_names
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.inter = pad_to_multiple(cfg.moe_intermediate_size, tp_size) // tp_size
        self.inter_start = tp_rank * self.inter
        e, h = cfg.num_experts, cfg.hidden_size
        # gate rows then up rows of each expert, so one GEMM computes both
        self.w13 = nn.Parameter(torch.zeros(e, 2 * self.inter, h, dtype=dtype, device=device),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(e, h, self.inter, dtype=dtype, device=device),
                               requires_grad=False)
        # router logits in float32 whatever the model dtype: a rounding of the logits could
        # change which experts a token gets
        self.gate = nn.Parameter(torch.zeros(e, h, dtype=torch.float32, device=device),
                                 requires_grad=False)
        self.set_path(default_moe_path(device))

    def set_path(self, path: str) -> None:
        """torch | triton; chosen once at start-up, not per call (Triton on CPU tensors only
        under TRITON_INTERPRET=1, for tests)."""
        if path not in MOE_PATHS:
            raise ValueError(f"unknown MoE path {path!r}; expected one of {MOE_PATHS}")
        self.path = path
        self._experts = fused_experts_torch
        if path == "triton":
            from workers.triton_ops.fused_moe import fused_experts

            self._experts = fused_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(F.linear(x.float(), self.gate), self.top_k,
                                      self.renormalize)
        return tp_all_reduce(self._experts(x, self.w13, self.w2, weights, ids))

    def load(self, src: WeightSource, prefix: str) -> None:
        gate, up, down = self.expert_names
        s, end = self.inter_start, self.inter_start + self.inter
        n = self.inter
        for e in range(self.w13.shape[0]):
            p = f"{prefix}.experts.{e}"
            self.w13[e, :n].copy_(read_padded(src, f"{p}.{gate}.weight", 0, s, end))
            self.w13[e, n:].copy_(read_padded(src, f"{p}.{up}.weight", 0, s, end))
            self.w2[e].copy_(read_padded(src, f"{p}.{down}.weight", 1, s, end))
        self.gate.copy_(src.read(f"{prefix}.gate.weight").float())
