"""LoRA wrappers on the model's tensor-parallel linears (Llama, Mistral, Qwen2, Qwen3 dense,
and the attention of the MoE families).

A wrapper replaces a decoder layer's qkv_proj, o_proj, gate_up_proj or down_proj and keeps the
base linear inside it. All wrappers share one LoRAState: the step's token groups (set by the
runner before the forward) and the kernel path (chosen once at start-up). A step whose batch
has no adapter row leaves the groups at None, and the wrappers then run the base linear and
nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from workers.lora.grouped import TokenGroups, path_for
from workers.model.layers.linear import ColumnParallelLinear, RowParallelLinear, linear
from workers.parallel.distributed import tp_all_reduce

if TYPE_CHECKING:
    from workers.lora.slots import SlotBuffers
    from workers.lora.weights import LoRATarget
    from workers.model.llama import LlamaForCausalLM


class LoRAState:
    """What every LoRA wrapper of a model reads: the step's token groups (None: no adapter in
    this step), set by the runner before each forward."""

    def __init__(self, path: str) -> None:
        self.path_name = path  # the kernel path (grouped.PATHS) the wrappers were built with
        self.groups: TokenGroups | None = None


class LoRAColumnParallelLinear(nn.Module):
    """Column-parallel: y = base(x) (this rank's output rows, ColumnParallelLinear.forward),
    then y += x A^T B_rank^T."""

    def __init__(self, base: ColumnParallelLinear, bufs: SlotBuffers, state: LoRAState) -> None:
        super().__init__()
        self.base, self.bufs, self.state = base, bufs, state
        self.add = path_for(state.path_name, bufs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base  # its forward, without a second module call per linear
        y = linear(x, base.weight, base.packed, base.bias)
        g = self.state.groups
        if g is not None:
            self.add(x, y, self.bufs, g)
        return y


class LoRARowParallelLinear(nn.Module):
    """Row-parallel: this rank's partial product plus its partial LoRA product x_r A_r^T B^T,
    then the base layer's one all-reduce and its bias (RowParallelLinear.forward with the LoRA
    term added before the reduce)."""

    def __init__(self, base: RowParallelLinear, bufs: SlotBuffers, state: LoRAState) -> None:
        super().__init__()
        self.base, self.bufs, self.state = base, bufs, state
        self.add = path_for(state.path_name, bufs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        y = linear(x, base.weight, base.packed)
        g = self.state.groups
        if g is not None:
            self.add(x, y, self.bufs, g)
        y = tp_all_reduce(y)
        return y + base.bias if base.bias is not None else y


def install(model: LlamaForCausalLM, targets: list[LoRATarget],
            buffers: dict[tuple[int, str], SlotBuffers], state: LoRAState) -> None:
    """Wrap every target's base linear (once, after the weights are loaded and prepacked)."""
    for t in targets:
        layer = model.layers[t.layer]
        block = layer.self_attn if t.block == "self_attn" else layer.mlp
        base = getattr(block, t.linear_name)
        if isinstance(base, LoRAColumnParallelLinear | LoRARowParallelLinear):
            raise RuntimeError(f"layer {t.layer} {t.linear_name} already has LoRA")
        cls = LoRARowParallelLinear if t.row_parallel else LoRAColumnParallelLinear
        setattr(block, t.linear_name, cls(base, buffers[(t.layer, t.kind)], state))
