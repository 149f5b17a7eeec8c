"""The sampler's peak transient device memory, counted from its allocations, for KV sizing.

The profile forward measures the model's activations, but sampling runs after it on the full
logits and allocates several [rows, vocab] float32 tensors; at 256 rows x a 128k vocabulary
each is 128 MiB, so they must be left out of the KV cache explicitly.

The count follows Sampler.sample with every option on (all rows random, top-k, top-p, min-p,
logprobs), at its worst moment, inside min-p's masking, where these are alive at once (F is
one float32 [rows, vocab] tensor):

    logits in the model dtype (the LM head's output, held by the model runner)     L
    logits.float()                                                                 F
    logits[rand_rows] (gathered, held by the call into process_logits)             F
    x after temperature and top-k/top-p (the torch.where of masked and unmasked)   F
    softmax(x) inside min-p                                                        F
    probs < threshold (bool)                                                       F/4
    x.masked_fill(...)                                                             F

The top-k/top-p step peaks lower (float, gathered, x/temperature, the scattered -inf tensor and
the where: 5 F), and drawing (float, x, probs, the padded probs: 4 F) and logprobs (4 F) lower
still. The top-k candidates add [rows, C] values, indices, probabilities and cumulative sums
(C = the largest k, or TOP_P_CANDIDATES for top-p alone). A change to the sampler that holds
more full-vocabulary tensors at once must update FLOAT32_COPIES.
"""

from __future__ import annotations

from workers.sample.sampler import TOP_P_CANDIDATES

FLOAT32_COPIES = 5.25  # F-sized float32 tensors alive at the sampler's peak (see above)
# Bytes per candidate: float32 values + int64 indices + float32 probabilities, cumulative
# sums and mass-before + bool keep mask, with room for the where/masked_fill copies of them.
_CANDIDATE_BYTES = 4 + 8 + 4 * 3 + 1 + 8


def sampler_peak_bytes(rows: int, vocab: int, logits_itemsize: int,
                       max_candidates: int = TOP_P_CANDIDATES) -> int:
    """Peak bytes of sampling `rows` logit rows of `vocab` entries whose logits arrive in a
    dtype of `logits_itemsize` bytes (the model's), the logits included."""
    if rows <= 0:
        return 0
    full = rows * vocab
    candidates = rows * min(max_candidates, vocab) * _CANDIDATE_BYTES
    return int(full * logits_itemsize + FLOAT32_COPIES * 4 * full) + candidates
