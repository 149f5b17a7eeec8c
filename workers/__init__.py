"""Tensor-parallel worker processes: model, paged KV cache, persistent batch, sampler."""
