"""The Qwen2-VL / Qwen2.5-VL vision tower, one concept per file: its hyper-parameters (config),
how its linears are split over ranks (parallel), patch embedding, the 2-D rotary, block-diagonal
attention, the MLPs, the blocks, Qwen2.5-VL's attention windows, the patch merger, and the tower
that chains them (tower). Nothing is imported here, so reading the config stays torch-free."""
