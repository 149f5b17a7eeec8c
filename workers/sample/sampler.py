"""Token sampling that every TP rank performs identically.

All ranks hold identical logits (the LM head all-gathers them), and every random number is a
hash of where it is used (workers/sample/counter_rng.py): a seeded request's numbers come from
(its seed, its token position), so they do not depend on its batch or on the step it runs in;
an unseeded row's from (the engine seed, the sampler's count of shared draws, its row). Ranks
therefore pick the same tokens without exchanging anything, and the numbers of a whole batch
come from one vectorized launch, however many requests are seeded.

No step sorts the vocabulary: top-k is a partial selection (torch.topk), top-p a cumulative sum
over those candidates, and drawing a token is an inverse-CDF lookup in two levels (a block of
the vocabulary by its total mass, then a token inside it), two uniforms per row.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from workers import cpu_ops
from workers.runner.host_copy import to_device
from workers.sample.counter_rng import SEEDED_ROW, counter_uniforms

# Below this a temperature means greedy (vLLM's convention for "0").
GREEDY_EPS = 1e-5
# A row with top-p but no top-k looks for its nucleus among this many most likely tokens; a
# distribution so flat that they hold less than top_p keeps just them (a nucleus never grows
# past what a sort-free selection of this size costs; 1024 of a 128k vocabulary is < 1%).
TOP_P_CANDIDATES = 1024
# Tokens per block of the two-level inverse-CDF draw (sqrt of a large vocabulary, roughly).
_DRAW_BLOCK = 512
# Lanes of a row's random numbers: the token draw uses lanes 0 and 1.
DRAW_LANES = 2


def _empty_i64() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass
class SamplingMetadata:
    """Per-row sampling options of the rows that sample this step, in logits-row order."""

    temperature: np.ndarray  # [N] float32; <= GREEDY_EPS = greedy
    top_k: np.ndarray  # [N] int32; <= 0 = off
    top_p: np.ndarray  # [N] float32; >= 1 = off
    min_p: np.ndarray  # [N] float32; <= 0 = off
    # per row: sampling_params.seed where seeded[row], and the request's token count before
    # this step (the counter its random numbers are keyed by); empty = nobody is seeded
    seeded: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    seeds: np.ndarray = field(default_factory=_empty_i64)
    positions: np.ndarray = field(default_factory=_empty_i64)
    need_logprobs: bool = False

    def select(self, rows: np.ndarray) -> SamplingMetadata:
        """The metadata of ``rows`` only, in that order.

        need_logprobs is kept: when any request asked, every sampled token gets a logprob.
        """
        any_seeded = len(self.seeded) > 0
        return SamplingMetadata(
            temperature=self.temperature[rows],
            top_k=self.top_k[rows],
            top_p=self.top_p[rows],
            min_p=self.min_p[rows],
            seeded=self.seeded[rows] if any_seeded else self.seeded,
            seeds=self.seeds[rows] if any_seeded else self.seeds,
            positions=self.positions[rows] if any_seeded else self.positions,
            need_logprobs=self.need_logprobs,
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] float32, logprob of each token under processed logits
    # [N] bool: rows whose logits held NaN or +inf (their token is 0, a placeholder; the
    # runner fails their requests); None where the check did not run
    nonfinite: torch.Tensor | None = None


class Sampler:
    """Greedy / temperature / top-k / top-p / min-p sampling, vectorized over the batch."""

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.seed = seed
        # draws made for unseeded rows so far: the counter of the shared stream. Every rank
        # samples the same rows in the same steps, so every rank counts the same.
        self.shared_draws = 0

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        return self.sample(logits, md)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        n = logits.shape[0]
        bad = nonfinite_rows(logits)
        greedy = md.temperature <= GREEDY_EPS
        if greedy.all():
            tokens = torch.where(bad, 0, _argmax(logits))
            lp = gather_logprobs(logits, tokens) if md.need_logprobs else None
            return SamplerOutput(tokens, lp, bad)

        rand_rows = np.flatnonzero(~greedy)
        sub = md.select(rand_rows)
        # every row random (the usual case): no gathered copy of the whole batch's logits
        rand_logits = logits if len(rand_rows) == n else logits[to_device(rand_rows,
                                                                          self.device)]
        x = process_logits(rand_logits, md, rand_rows)
        probs = torch.softmax(x, dim=-1)
        rand_tokens = draw_tokens(probs, self.random(sub, DRAW_LANES))

        if len(rand_rows) == n:
            tokens = rand_tokens
        else:
            # Greedy rows take argmax and consume no randomness.
            tokens = _argmax(logits)
            tokens[to_device(rand_rows, self.device)] = rand_tokens
        # a NaN row's draw ends past the vocabulary (-513); its token must stay in range, for
        # the logprobs' gather and the next step's embedding (the runner fails the request)
        tokens = torch.where(bad, 0, tokens)
        lp = None
        if md.need_logprobs:
            lp = gather_logprobs(logits, tokens)
            idx = to_device(rand_rows, self.device)
            lp[idx] = gather_logprobs(x, tokens[idx])
        return SamplerOutput(tokens, lp, bad)

    def random(self, md: SamplingMetadata, lanes: int) -> torch.Tensor:
        """U[0, 1) [N, lanes] for the rows of ``md``, one launch for the whole batch.

        A seeded row is keyed by (its seed, its position), the rest by (engine seed, shared
        draw count, row); the shared count advances only when an unseeded row drew.
        """
        n = len(md.temperature)
        keys = np.empty((3, n), dtype=np.int64)
        keys[0], keys[1], keys[2] = self.seed, self.shared_draws, np.arange(n)
        seeded = md.seeded if len(md.seeded) else np.zeros(n, dtype=bool)
        if seeded.any():
            keys[0, seeded] = md.seeds[seeded]
            keys[1, seeded] = md.positions[seeded]
            keys[2, seeded] = SEEDED_ROW
        if not seeded.all():
            self.shared_draws += 1
        return counter_uniforms(to_device(keys, self.device), lanes)


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[N] bool: rows holding NaN or +inf, which give no distribution to sample from (a bad
    adapter or weights). One pass over the logits, on the device, no sync: a row's sum is NaN
    or +inf exactly then (-inf, a masked token, keeps the sum finite or -inf; a sum overflowing
    to +inf needs logits near 1e34, no distribution either). Every TP rank holds the same
    logits, so every rank flags the same rows."""
    s = logits.sum(dim=-1)
    return torch.isnan(s) | torch.isposinf(s)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first index of the max): the C++ kernel on CPU is one vectorized pass,
    several times faster than torch's at a 32k vocabulary."""
    if cpu_ops.active(logits) and logits.stride(-1) == 1:
        return cpu_ops.argmax(logits)[1]
    return logits.argmax(dim=-1)


def draw_tokens(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [N, V] (non-negative, any positive total) by inverse CDF:
    u[:, 0] picks a block of _DRAW_BLOCK tokens by its mass, u[:, 1] a token inside it. Reads
    the probabilities about twice; no sort, no [N, V] noise. Tokens of zero mass are never
    drawn (a rounding overshoot falls back to the last block or token with mass)."""
    n, vocab = probs.shape
    nb = -(-vocab // _DRAW_BLOCK)
    pad = nb * _DRAW_BLOCK - vocab
    # a vocabulary of whole blocks is viewed in place (a pad copies every row's probabilities)
    padded = torch.nn.functional.pad(probs, (0, pad)) if pad else probs.contiguous()
    blocks = padded.view(n, nb, _DRAW_BLOCK)
    mass = blocks.sum(dim=-1)
    b = _inverse_cdf(mass, u[:, 0])
    inside = blocks[torch.arange(n, device=probs.device), b]
    return b * _DRAW_BLOCK + _inverse_cdf(inside, u[:, 1])


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative weight exceeds u x the row's total."""
    cum = weights.cumsum(dim=-1)
    target = (u * cum[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cum, target, right=True).squeeze(1)
    cols = torch.arange(weights.shape[1], device=weights.device)
    last = torch.where(weights > 0, cols, -1).amax(dim=-1)
    return torch.minimum(idx, last)


def process_logits(x: torch.Tensor, md: SamplingMetadata, rows: np.ndarray) -> torch.Tensor:
    """Temperature, then top-k / top-p, then min-p: the logits random sampling draws from.

    ``x`` holds the float32 logits of ``rows`` (indices into ``md``); masked tokens are -inf.
    Speculative verification calls this too, so accepted drafts follow the same distribution.
    """
    temps = md.temperature[rows]
    if not (temps == 1.0).all():  # the default temperature divides by one: skip the copy
        x = x / to_device(temps, x.device).unsqueeze(1)
    x = _apply_top_k_top_p(x, md.top_k[rows], md.top_p[rows])
    return _apply_min_p(x, md.min_p[rows])


def gather_logprobs(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)


def _apply_top_k_top_p(x: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude, from one partial selection: the largest C
    logits of every row, C the largest k asked for (TOP_P_CANDIDATES for top-p alone)."""
    vocab = x.shape[1]
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    active = k_on | p_on
    if not active.any():
        return x
    k = np.where(k_on, top_k, np.where(p_on, min(TOP_P_CANDIDATES, vocab), 0)).astype(np.int64)
    c = int(k.max())
    vals, idx = x.topk(c, dim=-1)  # sorted descending
    keep = torch.arange(c, device=x.device).unsqueeze(0) < to_device(k, x.device).unsqueeze(1)
    vals = vals.masked_fill(~keep, float("-inf"))
    if p_on.any():
        # top-p renormalizes after top-k (a row with both: over its k), else over the vocab
        norm = torch.where(to_device(k_on, x.device), vals.logsumexp(dim=-1),
                           x.logsumexp(dim=-1))
        probs = torch.exp(vals - norm.unsqueeze(1))
        # Mass strictly before each token; the top token (0 before it) always survives.
        before = probs.cumsum(dim=-1) - probs
        p = to_device(np.where(p_on, top_p, 2.0).astype(np.float32), x.device).unsqueeze(1)
        vals = vals.masked_fill(before > p, float("-inf"))
    out = torch.full_like(x, float("-inf")).scatter_(1, idx, vals)
    if active.all():
        return out
    return torch.where(to_device(active, x.device).unsqueeze(1), out, x)


def _apply_min_p(x: torch.Tensor, min_p: np.ndarray) -> torch.Tensor:
    if not bool((min_p > 0).any()):
        return x
    probs = torch.softmax(x, dim=-1)
    thresh = probs.amax(dim=-1, keepdim=True) * to_device(
        np.asarray(min_p, dtype=np.float32), x.device).unsqueeze(1)
    return x.masked_fill(probs < thresh, float("-inf"))


def tokens_checksum(token_ids: np.ndarray) -> int:
    """Stable across processes (unlike hash()), so ranks can be compared by the scheduler."""
    return zlib.crc32(np.ascontiguousarray(token_ids, dtype="<i4").tobytes())
