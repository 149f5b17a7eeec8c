"""The sampler's counted peak (workers/sample/peak_memory.py, which the KV cache sizing leaves
free) against what the sampler really holds: every tensor its ops return is tracked from birth
to its last reference on CPU, and the most bytes alive at once must stay within the count."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from workers.sample.peak_memory import sampler_peak_bytes
from workers.sample.sampler import Sampler, SamplingMetadata


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that the ops run under it return, while any tensor of theirs is
    referenced; `peak` is the most alive at once. Views share their base's storage."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [bytes, live tensors]
        self.live = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.storages[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.storages:
                    self.storages[key] = [storage.nbytes(), 0]
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                self.storages[key][1] += 1
                weakref.finalize(t, self._release, key)
        return out


def _metadata(rows: int, top_k: int, need_logprobs: bool) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=np.full(rows, 0.8, np.float32), top_k=np.full(rows, top_k, np.int32),
        top_p=np.full(rows, 0.9, np.float32), min_p=np.full(rows, 0.05, np.float32),
        seeded=np.arange(rows) % 2 == 0, seeds=np.arange(rows, dtype=np.int64),
        positions=np.full(rows, 7, np.int64), need_logprobs=need_logprobs)


@pytest.mark.parametrize("top_k, need_logprobs", [(50, True), (0, False), (2000, True)])
def test_counted_peak_bounds_what_the_sampler_holds(top_k: int, need_logprobs: bool) -> None:
    rows, vocab = 32, 16_384
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    logits = logits.to(torch.bfloat16)  # the model dtype's logits, held by the caller
    sampler = Sampler(seed=0)
    with LiveBytes() as tracked:
        out = sampler.sample(logits, _metadata(rows, top_k, need_logprobs))
    assert out.token_ids.shape == (rows,)
    held = tracked.peak + logits.nbytes
    candidates = max(top_k, 1024)
    # at least the float32 copy and the gathered rows were alive besides the logits: the
    # tracker sees the sampler's tensors at all
    assert held >= logits.nbytes + 2 * rows * vocab * 4
    assert held <= sampler_peak_bytes(rows, vocab, logits.element_size(), candidates)
