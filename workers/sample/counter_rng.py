"""Counter-based random numbers: a pure function of (key, counter, row, lane).

A stateful generator per seeded request costs one kernel launch per request and per draw; a
hash of the draw's coordinates costs one vectorized launch for the whole batch, and it is the
same on every TP rank and every device, since it is integer arithmetic only. The hash works on
32-bit words held in int64 tensors, and every multiplier is below 2**31, so no product leaves
int64's range (no reliance on wrap-around, which differs between backends in principle).
"""

from __future__ import annotations

import torch

_MASK = 0xFFFFFFFF
# odd multipliers < 2**31 (MurmurHash3's c2, lowbias32's first, MurmurHash2's m)
_MULTIPLIERS = (0x1B873593, 0x7FEB352D, 0x5BD1E995)
# a row word no real batch row takes: marks "keyed by a request's own seed"
SEEDED_ROW = _MASK


def _mix(x: torch.Tensor) -> torch.Tensor:
    """An avalanche of a 32-bit word (xor-shift / multiply rounds); x in [0, 2**32)."""
    for m in _MULTIPLIERS:
        x = x ^ (x >> 16)
        x = (x * m) & _MASK
    return x ^ (x >> 15)


def counter_uniforms(keys: torch.Tensor, lanes: int) -> torch.Tensor:
    """U[0, 1) float32 of shape [N, lanes] from keys [3, N] int64 = (seed, counter, row).

    Each of the 24 mantissa bits is a hash bit, so the values are exact multiples of 2**-24.
    """
    seed, counter, row = keys[0], keys[1], keys[2]
    h = _mix(seed & _MASK)
    h = _mix(h ^ ((seed >> 32) & _MASK))
    h = _mix(h ^ (counter & _MASK))
    h = _mix(h ^ ((counter >> 32) & _MASK))
    h = _mix(h ^ (row & _MASK))
    lane = torch.arange(lanes, dtype=torch.int64, device=keys.device)
    h = _mix(h.unsqueeze(1) ^ (lane.unsqueeze(0) * 0x9E3779B1 & _MASK))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))
