"""Token sampling that every TP rank performs identically.

All ranks hold identical logits (the LM head all-gathers them) and identically seeded
generators, and they consume randomness in the same order, so they pick the same tokens
without exchanging anything. Sampling is an exponential race: argmax(p / q) with q ~ Exp(1)
is a draw from p, and it lets the noise come from any generator row by row while the rest
stays one vectorized op over the batch.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from workers.runner.host_copy import to_device

# Below this a temperature means greedy (vLLM's convention for "0").
GREEDY_EPS = 1e-5
# Exponential noise of exactly 0 would turn p / q into inf or nan (0 / 0 for masked tokens).
_MIN_NOISE = 1e-20


@dataclass
class SamplingMetadata:
    """Per-row sampling options of the rows that sample this step, in logits-row order."""

    temperature: np.ndarray  # [N] float32; <= GREEDY_EPS = greedy
    top_k: np.ndarray  # [N] int32; <= 0 = off
    top_p: np.ndarray  # [N] float32; >= 1 = off
    min_p: np.ndarray  # [N] float32; <= 0 = off
    # logits row -> its request's generator (sampling_params.seed); rows not listed draw
    # from the shared engine-seeded generator. Only seeded rows cost Python work.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    need_logprobs: bool = False

    def select(self, rows: np.ndarray) -> SamplingMetadata:
        """The metadata of ``rows`` only, generators renumbered to the new row order.

        need_logprobs is kept: when any request asked, every sampled token gets a logprob.
        """
        gens = self.generators
        if gens:
            picked = ((i, gens.get(int(r))) for i, r in enumerate(rows.tolist()))
            gens = {i: g for i, g in picked if g is not None}
        return SamplingMetadata(
            temperature=self.temperature[rows],
            top_k=self.top_k[rows],
            top_p=self.top_p[rows],
            min_p=self.min_p[rows],
            generators=gens,
            need_logprobs=self.need_logprobs,
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] float32, logprob of each token under processed logits


class Sampler:
    """Greedy / temperature / top-k / top-p / min-p sampling, vectorized over the batch."""

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        # Unseeded requests draw from this one; same seed on every rank -> same stream.
        self.shared_generator = torch.Generator(device=self.device)
        self.shared_generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        return self.sample(logits, md)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        n = logits.shape[0]
        greedy = md.temperature <= GREEDY_EPS
        if greedy.all():
            tokens = logits.argmax(dim=-1)
            lp = gather_logprobs(logits, tokens) if md.need_logprobs else None
            return SamplerOutput(tokens, lp)

        rand_rows = np.flatnonzero(~greedy)
        x = process_logits(logits[to_device(rand_rows, self.device)], md, rand_rows)
        probs = torch.softmax(x, dim=-1)
        gens = md.generators
        noise = self.noise([gens.get(i) for i in rand_rows.tolist()], x.shape[1])
        rand_tokens = (probs / noise).argmax(dim=-1)

        if len(rand_rows) == n:
            tokens = rand_tokens
        else:
            # Greedy rows take argmax and consume no randomness.
            tokens = logits.argmax(dim=-1)
            tokens[to_device(rand_rows, self.device)] = rand_tokens
        lp = None
        if md.need_logprobs:
            lp = gather_logprobs(logits, tokens)
            idx = to_device(rand_rows, self.device)
            lp[idx] = gather_logprobs(x, rand_tokens)
        return SamplerOutput(tokens, lp)

    def noise(self, gens: list[torch.Generator | None], vocab: int) -> torch.Tensor:
        """Exp(1) noise, shared-generator rows in one draw, seeded rows from their own."""
        q = torch.empty((len(gens), vocab), dtype=torch.float32, device=self.device)
        shared = [i for i, g in enumerate(gens) if g is None]
        if len(shared) == len(gens):
            q.exponential_(generator=self.shared_generator)
        else:
            if shared:
                block = torch.empty((len(shared), vocab), dtype=torch.float32, device=self.device)
                block.exponential_(generator=self.shared_generator)
                q[to_device(np.array(shared), self.device)] = block
            for i, g in enumerate(gens):
                if g is not None:
                    q[i].exponential_(generator=g)
        return q.clamp_min_(_MIN_NOISE)

    def uniforms(self, gens: list[torch.Generator | None], counts: np.ndarray) -> torch.Tensor:
        """U[0, 1) draws, ``counts[i]`` for row i, flattened in row order.

        Same discipline as ``noise``: shared-generator rows in one draw, then each seeded row
        from its own generator, so a seeded request's numbers do not depend on its batch.
        """
        u = torch.empty(int(counts.sum()), dtype=torch.float32, device=self.device)
        shared = [g is None for g in gens]
        if all(shared):
            return u.uniform_(generator=self.shared_generator)
        if any(shared):
            idx = np.flatnonzero(np.repeat(np.array(shared), counts))
            block = torch.empty(len(idx), dtype=torch.float32, device=self.device)
            block.uniform_(generator=self.shared_generator)
            u[to_device(idx, self.device)] = block
        start = 0
        for g, c in zip(gens, counts.tolist(), strict=True):
            if g is not None and c:
                u[start : start + c].uniform_(generator=g)
            start += c
        return u


def process_logits(x: torch.Tensor, md: SamplingMetadata, rows: np.ndarray) -> torch.Tensor:
    """Temperature, then top-k / top-p, then min-p: the logits random sampling draws from.

    ``x`` holds the float32 logits of ``rows`` (indices into ``md``); masked tokens are -inf.
    Speculative verification calls this too, so accepted drafts follow the same distribution.
    """
    temp = to_device(md.temperature[rows], x.device)
    x = x / temp.unsqueeze(1)
    x = _apply_top_k_top_p(x, md.top_k[rows], md.top_p[rows])
    return _apply_min_p(x, md.min_p[rows])


def gather_logprobs(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)


def _apply_top_k_top_p(x: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude; one sort serves both."""
    vocab = x.shape[1]
    use_k = bool(((top_k > 0) & (top_k < vocab)).any())
    use_p = bool((top_p < 1.0).any())
    if not (use_k or use_p):
        return x
    sorted_x, order = x.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=x.device).unsqueeze(0)
    drop = torch.zeros_like(sorted_x, dtype=torch.bool)
    if use_k:
        k = np.where(top_k > 0, np.minimum(top_k, vocab), vocab).astype(np.int64)
        drop |= ranks >= to_device(k, x.device).unsqueeze(1)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    if use_p:
        p = to_device(np.asarray(top_p, dtype=np.float32), x.device).unsqueeze(1)
        probs = torch.softmax(sorted_x, dim=-1)
        # Mass strictly before each token; the top token (0 before it) always survives.
        before = probs.cumsum(dim=-1) - probs
        drop |= before > p
    drop_orig = torch.zeros_like(drop).scatter_(1, order, drop)
    return x.masked_fill(drop_orig, float("-inf"))


def _apply_min_p(x: torch.Tensor, min_p: np.ndarray) -> torch.Tensor:
    if not bool((min_p > 0).any()):
        return x
    probs = torch.softmax(x, dim=-1)
    thresh = probs.amax(dim=-1, keepdim=True) * to_device(
        np.asarray(min_p, dtype=np.float32), x.device).unsqueeze(1)
    return x.masked_fill(probs < thresh, float("-inf"))


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(seed)
    return g


def tokens_checksum(token_ids: np.ndarray) -> int:
    """Stable across processes (unlike hash()), so ranks can be compared by the scheduler."""
    return zlib.crc32(np.ascontiguousarray(token_ids, dtype="<i4").tobytes())
