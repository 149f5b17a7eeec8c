"""Shapes shared by the Triton kernel tests."""

from __future__ import annotations

import torch

from tests.helpers.paged import MIXED_STEP
from tests.helpers.paged import mixed_step as _mixed_step
from workers.attention.reference import AttentionMetadata

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MIXED = MIXED_STEP


def mixed_step(block_size: int, layout=MIXED, seed: int = 0) -> tuple[AttentionMetadata, int]:
    """tests.helpers.paged.mixed_step on the device the kernels run on."""
    return _mixed_step(block_size, layout, seed, DEVICE)
