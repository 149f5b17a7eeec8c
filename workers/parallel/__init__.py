"""Tensor-parallel process groups and collectives (torch.distributed, shared memory on one host)."""
