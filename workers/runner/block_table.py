"""A worker's block tables: for each KV cache group, each batch row's block ids.

A model with several KV cache groups (sliding-window / hybrid) keeps one table per group; every
group's table of a request has the same length, so one num_blocks count per row serves all of
them. Rows follow the persistent batch (workers/runner/input_batch.py), which moves them when
it condenses; unused columns hold 0, the null block.
"""

from __future__ import annotations

import numpy as np


class StateMismatchError(RuntimeError):
    """The diff does not fit this worker's state: computing on would be silently wrong."""


class BlockTable:
    def __init__(self, num_groups: int, max_num_reqs: int, max_blocks_per_req: int) -> None:
        self.num_groups = num_groups
        self.max_blocks_per_req = max_blocks_per_req
        self.tables = np.zeros((num_groups, max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self._flat = self.tables.reshape(-1)  # a view, for np.take and one-scatter appends
        self._group_stride = max_num_reqs * max_blocks_per_req  # group g starts at g * this

    def set_row(self, row: int, block_ids: np.ndarray, handle: int) -> None:
        """A (new or resumed) request's whole table: ``block_ids`` holds every group's ids,
        group 0's first, the same number per group."""
        g = self.num_groups
        if len(block_ids) % g:
            raise StateMismatchError(
                f"request {handle}: {len(block_ids)} block ids for {g} KV cache groups"
            )
        nb = len(block_ids) // g
        if nb > self.max_blocks_per_req:
            raise StateMismatchError(
                f"request {handle}: {nb} blocks > max_blocks_per_req={self.max_blocks_per_req}"
            )
        self.tables[:, row, :nb] = block_ids.reshape(g, nb)
        self.tables[:, row, nb:] = 0
        self.num_blocks[row] = nb

    def append(self, rows: np.ndarray, counts: np.ndarray, ids: np.ndarray) -> None:
        """Append ``counts[i]`` new blocks per group to row ``rows[i]`` (distinct rows); ``ids``
        holds, per row in order, g runs of counts[i] ids (group 0's first)."""
        g = self.num_groups
        nb = self.num_blocks[rows]
        if (nb + counts > self.max_blocks_per_req).any():
            raise StateMismatchError("cached_reqs: block table overflow")
        width = self.max_blocks_per_req
        # One scatter for all appended ids: row r's new ids go to columns nb[r], nb[r] + 1, ...
        if g > 1:
            per = counts * g
            seg = np.repeat(np.arange(len(rows)), per)
            k = np.arange(len(ids)) - np.repeat(np.cumsum(per) - per, per)
            c = counts[seg]
            flat = (k // c) * self._group_stride + rows[seg] * width + nb[seg] + k % c
        elif (counts == 1).all():  # decode steady state: one new block each
            flat = rows * width + nb
        else:
            cu = np.cumsum(counts, dtype=np.int64)
            col = np.repeat(nb, counts) + np.arange(len(ids)) - np.repeat(cu - counts, counts)
            flat = np.repeat(rows, counts) * width + col
        self._flat[flat] = ids
        self.num_blocks[rows] = nb + counts

    def move_row(self, src: int, dst: int) -> None:
        self.tables[:, dst] = self.tables[:, src]
        self.num_blocks[dst] = self.num_blocks[src]

    def block_index(self, rows: np.ndarray, positions: np.ndarray, block_size: int
                    ) -> np.ndarray:
        """Flat index into group 0's table of the block holding each (row, position)."""
        return rows * self.max_blocks_per_req + positions // block_size

    def block_ids(self, group: int, block_index: np.ndarray) -> np.ndarray:
        """Group ``group``'s block ids at indices from block_index (np.take on 1-D beats 2-D
        fancy indexing)."""
        return self._flat.take(block_index + group * self._group_stride)
