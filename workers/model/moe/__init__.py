"""Mixture-of-experts layers: routing and the portable expert computation (torch, the oracle),
and the sparse MoE block that holds this rank's slice of every expert. The fused Triton path is
workers/triton_ops/fused_moe.py."""
