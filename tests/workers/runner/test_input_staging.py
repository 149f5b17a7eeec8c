"""Staging copies only the live block-table columns, packed; graph steps get the whole-width
persistent table with the same values."""

from __future__ import annotations

import numpy as np
import torch

from workers.runner.input_staging import _StagedTable


def test_only_live_columns_are_packed_and_graph_view_keeps_the_stride() -> None:
    staged = _StagedTable(max_reqs=8, max_cols=100, device=torch.device("cpu"))
    table = np.arange(3 * 5, dtype=np.int32).reshape(3, 5)
    eager = staged.put(table, num_reqs=3, for_graph=False)
    assert eager.shape == (3, 5) and eager.is_contiguous()
    assert eager.data_ptr() == staged.packed.data_ptr()  # 15 entries crossed, not 300
    assert np.array_equal(eager.numpy(), table)
    staged.fixed.fill_(-7)
    graph = staged.put(table + 1, num_reqs=4, for_graph=True)  # padded to 4 requests
    assert graph.shape == (4, 5) and graph.stride() == (100, 1)
    assert graph.data_ptr() == staged.fixed.data_ptr()
    assert np.array_equal(graph[:3].numpy(), table + 1)
