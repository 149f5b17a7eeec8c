"""Tensor-parallel building blocks, one kind per file: linear, embedding (with the LM head),
norm, activation, rotary, and the kernel-path choice they share. The names are gathered here
so a model imports its layers from one place."""

from workers.model.layers.activation import SiluAndMul, silu_and_mul
from workers.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.model.layers.kernel_path import KernelPath, kernel_path, reselect_kernels
from workers.model.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    linear,
    pad_to_multiple,
    param,
    prepack,
)
from workers.model.layers.module_list import TypedModuleList
from workers.model.layers.norm import RMSNorm
from workers.model.layers.rotary import RotaryEmbedding, rope_inv_freq

__all__ = [
    "ColumnParallelLinear", "KernelPath", "ParallelLMHead", "RMSNorm", "RotaryEmbedding",
    "RowParallelLinear", "SiluAndMul", "TypedModuleList", "VocabParallelEmbedding",
    "kernel_path", "linear", "pad_to_multiple", "param", "prepack", "reselect_kernels",
    "rope_inv_freq", "silu_and_mul",
]
