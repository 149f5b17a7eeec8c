"""A rank's side of multi-LoRA serving: reading and checking PEFT adapters (peft_config.py,
torch-free so the frontend can use it; the content hash both sides compute is
protocol/lora_files.py), this rank's
tensor-parallel slice of an adapter (weights.py), the device slots and the host cache
(slots.py), the wrappers on the model's linears (layers.py), the torch kernel path
(grouped.py; the Triton one is workers/triton_ops/lora.py) and the runner's entry points
(manager.py).

This package's __init__ imports nothing, so the torch-free modules stay torch-free.
"""
