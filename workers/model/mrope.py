"""M-RoPE (Qwen2-VL's multimodal rotary): positions with three rows (time, height, width).

Text tokens have three equal rows; an image's tokens take (frame, row, column) of the merged grid,
offset by the position its first token would have had as text; text after an image continues
from the largest position so far + 1. Each rotary half-dim reads one of the three rows:
mrope_section [16, 24, 24] gives the first 16 of head_dim / 2 frequencies the time row, the next
24 the height row, the last 24 the width row.

The attention backends take a 1-D `positions` and a rope object whose .cos/.sin tables they
index by it, for rotary and nothing else (the KV slots and causal masks come from the attention
metadata). So a step with 3-D positions gets tables with one row per step token, each that
token's mixed cos/sin, and positions arange(T): every backend rotates correctly unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workers.model.layers import RotaryEmbedding, rope_inv_freq


@dataclass
class MMStep:
    """What a multimodal forward step adds to its token ids; the caller sets the model's
    mm_step before the forward and clears it after."""

    embeds: torch.Tensor  # [K, hidden] encoder outputs, in the model dtype, on its device
    index: torch.Tensor  # [K] int64: the rows of the step's flat token list they replace
    # [3, T] int64 M-RoPE positions of the step's T tokens; None: each token's three rows equal
    # the forward's 1-D positions (then the caller passes p + delta for tokens after a prompt
    # with images, see mrope_positions)
    positions3: torch.Tensor | None = None


def mrope_positions(prompt_len: int, spans: list[tuple[int, tuple[int, int, int]]],
                    merge_size: int = 2) -> tuple[np.ndarray, int]:
    """[3, prompt_len] int64 M-RoPE positions of a prompt and its delta.

    spans: (offset of the first placeholder token in the prompt, grid (t, h, w) in patches)
    per image, in prompt order; an image covers t * h * w / merge_size**2 tokens. A token at
    1-D position p >= prompt_len (generated text) has M-RoPE position p + delta in all rows.
    """
    pos = np.empty((3, prompt_len), dtype=np.int64)
    nxt = 0  # the position the next text token takes
    done = 0  # prompt tokens placed so far
    for offset, (t, h, w) in spans:
        if offset < done:
            raise ValueError(f"image span at {offset} overlaps the previous one (ends {done})")
        pos[:, done:offset] = nxt + np.arange(offset - done)
        nxt += offset - done
        gh, gw = h // merge_size, w // merge_size
        n = t * gh * gw
        if offset + n > prompt_len:
            raise ValueError(f"image span at {offset} of {n} tokens passes the prompt's end "
                             f"({prompt_len})")
        ft, fh, fw = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pos[:, offset : offset + n] = np.stack([ft, fh, fw]).reshape(3, n) + nxt
        nxt = int(pos[:, offset : offset + n].max()) + 1 if n else nxt
        done = offset + n
    pos[:, done:] = nxt + np.arange(prompt_len - done)
    delta = nxt + (prompt_len - done) - prompt_len
    return pos, delta


class MRotaryEmbedding(RotaryEmbedding):
    """The LM's rotary: the usual 1-D tables, and per-step M-RoPE tables swapped in for one
    forward (every layer shares this one object, so one swap reaches them all)."""

    inv: torch.Tensor
    axis: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 mrope_section: list[int], device: torch.device):
        super().__init__(head_dim, max_positions, theta, None, device)
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim / 2")
        self.register_buffer("inv", rope_inv_freq(head_dim, theta, None).to(device),
                             persistent=False)  # float64, as the 1-D tables are built
        # which position row (0 t, 1 h, 2 w) each rotary half-dim reads
        axis = torch.repeat_interleave(torch.arange(len(mrope_section)) % 3,
                                       torch.tensor(mrope_section))
        self.register_buffer("axis", axis.to(device), persistent=False)
        self._saved: tuple[torch.Tensor, torch.Tensor] | None = None

    def step_tables(self, positions3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[3, T] positions -> cos, sin [T, head_dim / 2] float32, row i = token i's M-RoPE
        (float64 angles like the 1-D tables, so three equal rows give the 1-D values)."""
        pos = positions3.to(self.inv.device)[self.axis].T.double()  # [T, hd/2]
        angles = pos * self.inv
        return angles.cos().float().contiguous(), angles.sin().float().contiguous()

    def use(self, tables: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Swap per-step tables in, or (None) the 1-D tables back."""
        if tables is not None:
            if self._saved is None:
                self._saved = (self.cos, self.sin)
            self.cos, self.sin = tables
        elif self._saved is not None:
            self.cos, self.sin = self._saved
            self._saved = None
