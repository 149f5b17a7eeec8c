"""The Triton LoRA shrink/expand kernels against a float64 reference: base-model tokens, an
empty slot, mixed slots, rank below the reduction tile, 1 to 512 tokens (small and tall tiles),
and the fixed grid of a captured step (a token bound above the real groups). On CPU they run
under the Triton interpreter, so the shapes stay small."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.lora import lora_case, lora_reference
from tests.workers.triton.common import DEVICE
from workers.lora.grouped import add_triton, group_tokens
from workers.triton_ops.lora import lora_add

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("num_tokens,dtype", [(1, torch.float32), (37, torch.float32),
                                              (37, torch.bfloat16), (512, torch.float32)])
def test_matches_reference(num_tokens, dtype):
    bufs, weights, x, y, slots = lora_case(num_tokens, dtype, DEVICE, True, seed=num_tokens)
    slots[0] = 1  # at least one adapter token
    want = lora_reference(weights, bufs.offsets, x, y, slots)
    g = group_tokens(slots, bufs.a.shape[0], DEVICE)
    assert g is not None
    add_triton(x, y, bufs, g)
    assert (y.cpu().double() - want).abs().max().item() <= TOL[dtype] * want.abs().max().item()


def test_rank_8_and_one_packed_projection():
    bufs, weights, x, y, slots = lora_case(20, torch.float32, DEVICE, True, rank=8,
                                           offsets=(0, 40))
    want = lora_reference(weights, bufs.offsets, x, y, slots)
    g = group_tokens(slots, bufs.a.shape[0], DEVICE)
    add_triton(x, y, bufs, g)
    assert (y.cpu().double() - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_fixed_grid_leaves_base_tokens_alone():
    """A grid sized for every token (as a CUDA graph would capture it): programs past each
    slot's tokens exit, base-model tokens and empty slots are untouched."""
    bufs, weights, x, y, slots = lora_case(24, torch.float32, DEVICE, True, seed=3)
    slots[:] = -1
    slots[[3, 9, 10]] = [0, 3, 0]
    want = lora_reference(weights, bufs.offsets, x, y, slots)
    g = group_tokens(slots, bufs.a.shape[0], DEVICE)
    before = y.clone()
    lora_add(x, y, bufs.a, bufs.b, bufs.offsets_dev, bufs.max_slice, g.tokens32, g.starts,
             g.counts, max_count=len(slots))
    base = torch.from_numpy(slots < 0).to(DEVICE)
    assert torch.equal(y[base], before[base])
    assert (y.cpu().double() - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    assert np.count_nonzero(slots >= 0) == 3


def test_runner_with_triton_kernels_equals_peft(lora_world, monkeypatch):
    """The whole runner on the Triton path (packed slot layout, the kernels in every linear)
    against peft, base rows and three adapters in one batch."""
    from tests.helpers.lora import lora_config, run_spec
    from workers.lora import manager
    from workers.parallel.distributed import DistEnv
    from workers.runner.model_runner import ModelRunner

    prompts = [[(7 * i + 3 * j + 1) % 256 for j in range(5 + 2 * i)] for i in range(4)]
    loras = [1, 0, 2, 3]
    want = lora_world.expected(prompts, loras, 4)
    monkeypatch.setattr(manager, "select_path", lambda device: "triton")
    runner = ModelRunner(lora_config(lora_world.base), DistEnv(0, 1, 0, DEVICE, "gloo"))
    runner.load_model()
    runner.init_kv_cache()
    assert runner.lora.state.path_name == "triton"
    wave = dict(prompts=prompts, loras=loras, ops=[[0, 1], [1, 2], [2, 3]])
    (got,) = run_spec(runner, dict(adapters=lora_world.adapters, waves=[wave], max_new=4))
    assert got == want
