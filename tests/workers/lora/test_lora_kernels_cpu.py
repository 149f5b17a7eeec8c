"""The torch LoRA paths (torch's grouped GEMM, and the per-slot loop) against a float64
reference: base-model tokens, an empty slot, mixed slots, a rank below the slot's, 1 to 512
tokens, and one run of consecutive tokens (read and added in place)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.lora import lora_case, lora_reference
from workers.lora.grouped import add_grouped, add_loop, group_tokens, path_for

CPU = torch.device("cpu")
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
OFFSETS = (0, 64, 80, 96)


def _check(add, bufs, weights, x, y, slots, dtype):
    want = lora_reference(weights, OFFSETS, x, y, slots)
    g = group_tokens(slots, 4, CPU)
    if g is None:  # only base-model tokens: nothing to add, and nothing is run
        assert (slots < 0).all()
        return
    add(x, y, bufs, g)
    assert (y.double() - want).abs().max().item() <= TOL[dtype] * want.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 512])
@pytest.mark.parametrize("add", [add_grouped, add_loop], ids=["grouped", "loop"])
def test_paths_equal_reference(add, num_tokens, dtype):
    _check(add, *lora_case(num_tokens, dtype, CPU, packed=False, seed=num_tokens), dtype)


@pytest.mark.parametrize("add", [add_grouped, add_loop], ids=["grouped", "loop"])
def test_uneven_groups_take_grouped_gemms(add):
    bufs, weights, x, y, slots = lora_case(60, torch.float32, CPU, packed=False)
    slots[:] = 3
    slots[[7, 20]] = [0, -1]  # 58 tokens of slot 3, one of slot 0: padding would be 4x
    assert group_tokens(slots, 4, CPU).pad_tokens is None
    _check(add, bufs, weights, x, y, slots, torch.float32)


@pytest.mark.parametrize("add", [add_grouped, add_loop], ids=["grouped", "loop"])
def test_consecutive_groups_run_in_place(add):
    """Prefill-like: each slot's tokens consecutive (not in slot order), groups >= 32."""
    bufs, weights, x, y, slots = lora_case(200, torch.float32, CPU, packed=False)
    slots[:] = -1
    slots[10:74], slots[80:112], slots[120:184] = 3, 1, 0
    assert group_tokens(slots, 4, CPU).runs == [(0, 120, 184), (1, 80, 112), (3, 10, 74)]
    _check(add, bufs, weights, x, y, slots, torch.float32)
    slots[150] = 3  # slot 3's tokens are no longer consecutive
    assert group_tokens(slots, 4, CPU).runs is None


def test_groups_are_sorted_by_slot_and_stable():
    assert group_tokens(np.full(9, -1, dtype=np.int32), 4, CPU) is None
    g = group_tokens(np.array([3, -1, 0, 3, 0, -1, 1], dtype=np.int32), 4, CPU)
    assert g is not None and g.runs is None
    assert g.tokens.tolist() == [2, 4, 6, 0, 3]
    assert g.counts.tolist() == [2, 1, 0, 2] and g.ends.tolist() == [2, 3, 3, 5]
    assert g.spans == [(0, 0, 2), (1, 2, 3), (3, 3, 5)] and g.max_count == 2
    assert (g.slot_lo, g.slot_hi) == (0, 4)
    # 4 slots x 2 rows = 8 <= 2 x 5 tokens: padded groups, slot 2's two rows and slot 1's
    # second are padding
    assert g.pad_tokens is not None and g.valid.tolist() == [0, 1, 2, 6, 7]
    assert g.pad_tokens[g.valid].tolist() == g.tokens.tolist()
    # one slot with 6 tokens, one with 1, far apart: padding would triple the rows
    g = group_tokens(np.array([5] * 6 + [1], dtype=np.int32), 8, CPU)
    assert g is not None and g.pad_tokens is None and (g.slot_lo, g.slot_hi) == (1, 6)


@pytest.mark.parametrize("uneven", [False, True])
def test_unaligned_targets_still_add(uneven):
    """torch's grouped GEMM wants 16-byte strides, which 129 float32 features do not have: the
    padded (batched GEMM) steps run as usual, the others through the loop."""
    bufs, weights, x, y, slots = lora_case(40, torch.float32, CPU, packed=False,
                                           in_features=129, offsets=(0, 64, 80, 97))
    assert path_for("grouped", bufs) is add_grouped and not bufs.grouped_mm_ok
    if uneven:
        slots[:] = 3
        slots[0] = 0
    assert (group_tokens(slots, 4, CPU).pad_tokens is None) == uneven
    want = lora_reference(weights, (0, 64, 80, 97), x, y, slots)
    add_grouped(x, y, bufs, group_tokens(slots, 4, CPU))
    assert (y.double() - want).abs().max().item() <= 1e-4 * want.abs().max().item()
