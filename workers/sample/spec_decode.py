"""Speculative decoding on the worker: verify the scheduler's draft tokens.

A request with k drafts d_0..d_{k-1} is scheduled on its last token plus the drafts, and its
last k+1 logits rows are the verification targets: row i predicts the token that belongs at
position num_tokens + i, so row i checks d_i and row k proposes a bonus token. A request
without drafts has the usual single logits row (k = 0).

- greedy rows: accept d_i while it equals the argmax of row i; then emit the argmax of the
  first row that disagreed (the correction), or of row k (the bonus).
- random rows: rejection sampling with a one-hot draft distribution. d_i is accepted with
  probability p_i(d_i); on the first rejection the token is drawn from p_i without d_i's
  mass, renormalized; after k acceptances the bonus is drawn from p_k. Every emitted token
  is then distributed exactly as plain sampling would have drawn it.

Each request emits 1..k+1 tokens. Randomness is the sampler's counter-based numbers (keyed by
the request's seed and position when it is seeded), a fixed amount per request whatever gets
accepted (two lanes for the final draw, then one per draft), so every TP rank, holding the same
logits, picks the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from workers.runner.host_copy import to_device
from workers.sample.sampler import (
    DRAW_LANES,
    GREEDY_EPS,
    Sampler,
    SamplingMetadata,
    draw_tokens,
    gather_logprobs,
    process_logits,
)


def ragged_arange(counts: np.ndarray) -> np.ndarray:
    """[0..counts[0]-1, 0..counts[1]-1, ...] as int64: offsets inside consecutive segments."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


@dataclass(eq=False)
class DraftLayout:
    """Where drafts and logits rows sit for the requests that sample in one step.

    Requests are in sampling order; request j owns num_drafts[j] + 1 consecutive logits rows.
    """

    num_drafts: np.ndarray  # [S] int64, k per request (0 = no drafts)
    draft_ids: np.ndarray  # [K] int64, the drafts flattened in request order
    row_starts: np.ndarray = field(init=False)  # [S] first logits row of each request
    rel: np.ndarray = field(init=False)  # [L] index of each logits row inside its request
    draft_starts: np.ndarray = field(init=False)  # [S] index of each request's first draft
    draft_req: np.ndarray = field(init=False)  # [K] request of each draft
    draft_pos: np.ndarray = field(init=False)  # [K] index of each draft inside its request
    draft_rows: np.ndarray = field(init=False)  # [K] logits row that verifies each draft

    def __post_init__(self) -> None:
        k = self.num_drafts = np.asarray(self.num_drafts, dtype=np.int64)
        self.draft_ids = np.asarray(self.draft_ids, dtype=np.int64)
        if (k < 0).any() or int(k.sum()) != len(self.draft_ids):
            raise ValueError(f"{len(self.draft_ids)} draft ids for draft counts {k.tolist()}")
        n = k + 1
        self.row_starts = np.cumsum(n) - n
        self.rel = ragged_arange(n)
        self.draft_starts = np.cumsum(k) - k
        self.draft_req = np.repeat(np.arange(len(k), dtype=np.int64), k)
        self.draft_pos = ragged_arange(k)
        self.draft_rows = self.row_starts[self.draft_req] + self.draft_pos

    @property
    def num_reqs(self) -> int:
        return len(self.num_drafts)

    @property
    def num_logits(self) -> int:
        return len(self.rel)

    def select(self, reqs: np.ndarray) -> tuple[DraftLayout, np.ndarray]:
        """The layout of ``reqs`` (ascending) alone, and the logits rows they own here."""
        mask = np.zeros(self.num_reqs, dtype=bool)
        mask[reqs] = True
        rows = np.flatnonzero(np.repeat(mask, self.num_drafts + 1))
        sub = DraftLayout(self.num_drafts[reqs], self.draft_ids[mask[self.draft_req]])
        return sub, rows


@dataclass
class SpecOutput:
    """Tokens of one verification step, flattened in request order."""

    token_ids: np.ndarray  # [sum(counts)] int32
    counts: np.ndarray  # [S] int32, 1..k+1 per request
    logprobs: np.ndarray | None  # [sum(counts)] float32, one per token


def verify_greedy(targets: torch.Tensor, layout: DraftLayout) -> SpecOutput:
    """Greedy verification from the argmax token of every logits row ([L] ints)."""
    drafts, draft_rows = _device(layout.draft_ids, targets), _device(layout.draft_rows, targets)
    accepted = _accepted_counts(drafts == targets[draft_rows], layout)
    # Accepted drafts equal their rows' argmax, so the output is just the leading argmaxes.
    return _assemble(layout, targets, accepted, None)


def sample_with_drafts(
    sampler: Sampler, logits: torch.Tensor, layout: DraftLayout, md: SamplingMetadata
) -> SpecOutput:
    """One step's tokens when some requests carry drafts.

    Requests without drafts go through the sampler exactly as in a step without drafts;
    then the requests with drafts are verified. ``md`` has one row per request.
    """
    spec = np.flatnonzero(layout.num_drafts)
    if len(spec) == layout.num_reqs:
        return rejection_sample(sampler, logits, layout, md)
    plain = np.flatnonzero(layout.num_drafts == 0)
    plain_out = sampler(logits[_device(layout.row_starts[plain], logits)], md.select(plain))
    sub, rows = layout.select(spec)
    row_tokens, accepted, row_lp = _verify(sampler, logits[_device(rows, logits)], sub,
                                           md.select(spec))
    # the step's one device-to-host copy: both kinds' results in one buffer
    plain_tokens, plain_lp, row_tokens_np, accepted_np, row_lp_np = _to_host(
        plain_out.token_ids, plain_out.logprobs, row_tokens, accepted, row_lp)
    assert plain_tokens is not None and row_tokens_np is not None and accepted_np is not None
    spec_out = _assemble_host(sub, row_tokens_np, accepted_np, row_lp_np)

    counts = np.ones(layout.num_reqs, dtype=np.int32)
    counts[spec] = spec_out.counts
    out_starts = np.cumsum(counts) - counts
    plain_pos = out_starts[plain]
    spec_pos = np.repeat(out_starts[spec], spec_out.counts) + ragged_arange(spec_out.counts)
    tokens = np.empty(int(counts.sum()), dtype=np.int32)
    tokens[plain_pos] = plain_tokens
    tokens[spec_pos] = spec_out.token_ids
    lp = None
    if plain_lp is not None and spec_out.logprobs is not None:
        lp = np.empty(len(tokens), dtype=np.float32)
        lp[plain_pos] = plain_lp
        lp[spec_pos] = spec_out.logprobs
    return SpecOutput(tokens, counts, lp)


def rejection_sample(
    sampler: Sampler, logits: torch.Tensor, layout: DraftLayout, md: SamplingMetadata
) -> SpecOutput:
    """Verify drafts against ``logits`` ([L, V], laid out by ``layout``).

    Greedy requests (temperature <= GREEDY_EPS) are verified by argmax and draw nothing;
    random ones by rejection sampling with randomness from ``sampler``.
    """
    return _assemble(layout, *_verify(sampler, logits, layout, md))


def _verify(
    sampler: Sampler, logits: torch.Tensor, layout: DraftLayout, md: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """rejection_sample's results still on the device: (row_tokens, accepted, row_logprobs)."""
    logits = logits.float()
    need_lp = md.need_logprobs
    greedy = md.temperature <= GREEDY_EPS
    if greedy.all():
        return _verify_greedy_rows(logits, layout, need_lp)
    if not greedy.any():
        return _verify_random_rows(sampler, logits, layout, md, need_lp)
    # A mix: verify each kind on its own rows, then put the results back in request order.
    row_tokens = torch.empty(layout.num_logits, dtype=torch.long, device=logits.device)
    accepted = torch.empty(layout.num_reqs, dtype=torch.long, device=logits.device)
    row_lp = torch.empty(layout.num_logits, device=logits.device) if need_lp else None
    for reqs in (np.flatnonzero(greedy), np.flatnonzero(~greedy)):
        sub, rows = layout.select(reqs)
        rows_t = _device(rows, logits)
        if greedy[reqs[0]]:
            part = _verify_greedy_rows(logits[rows_t], sub, need_lp)
        else:
            part = _verify_random_rows(sampler, logits[rows_t], sub, md.select(reqs), need_lp)
        row_tokens[rows_t] = part[0]
        accepted[_device(reqs, logits)] = part[1]
        if row_lp is not None and part[2] is not None:
            row_lp[rows_t] = part[2]
    return row_tokens, accepted, row_lp


# Each _verify_*_rows returns (row_tokens [L], accepted [S], row_logprobs [L] or None):
# the token each logits row emits if the request gets that far, and the accepted drafts.


def _verify_greedy_rows(
    logits: torch.Tensor, layout: DraftLayout, need_lp: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    targets = logits.argmax(dim=-1)
    drafts, draft_rows = _device(layout.draft_ids, logits), _device(layout.draft_rows, logits)
    accepted = _accepted_counts(drafts == targets[draft_rows], layout)
    # Greedy tokens report logprobs of the raw logits, as the Sampler does.
    return targets, accepted, gather_logprobs(logits, targets) if need_lp else None


def _verify_random_rows(
    sampler: Sampler,
    logits: torch.Tensor,
    layout: DraftLayout,
    md: SamplingMetadata,
    need_lp: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    req_of_row = np.repeat(np.arange(layout.num_reqs), layout.num_drafts + 1)
    x = process_logits(logits, md, req_of_row)
    probs = torch.softmax(x, dim=-1)
    # A fixed amount of randomness per request, drawn before knowing what gets accepted.
    max_k = int(layout.num_drafts.max()) if layout.num_reqs else 0
    r = sampler.random(md, DRAW_LANES + max_k)

    drafts, draft_rows = _device(layout.draft_ids, logits), _device(layout.draft_rows, logits)
    u = r[_device(layout.draft_req, logits), DRAW_LANES + _device(layout.draft_pos, logits)]
    p_draft = probs[draft_rows, drafts]
    # u < p accepts with probability p; p >= 1 also accepts, in case a device's uniform_
    # ever returns exactly 1 (a rejection would then leave no mass to sample from).
    accepted = _accepted_counts((u < p_draft) | (p_draft >= 1.0), layout)

    k = _device(layout.num_drafts, logits)
    final_rows = _device(layout.row_starts, logits) + accepted
    dist = probs[final_rows]
    if len(layout.draft_ids):
        # Rejected at row a: remove d_a's mass (max(0, p - one_hot(d_a))); the inverse-CDF
        # draw below needs no renormalization. Fully accepted rows keep p_k whole.
        rejected = accepted < k
        at = (_device(layout.draft_starts, logits) + accepted).clamp_(max=len(drafts) - 1)
        keep = (~rejected).to(dist.dtype).unsqueeze(1)
        dist = dist * torch.ones_like(dist).scatter_(1, drafts[at].unsqueeze(1), keep)
    final = draw_tokens(dist, r[:, :DRAW_LANES])

    row_tokens = torch.zeros(layout.num_logits, dtype=torch.long, device=logits.device)
    row_tokens[draft_rows] = drafts
    row_tokens[final_rows] = final
    # Random tokens report logprobs of the processed distribution, as the Sampler does.
    return row_tokens, accepted, gather_logprobs(x, row_tokens) if need_lp else None


def _accepted_counts(accept: torch.Tensor, layout: DraftLayout) -> torch.Tensor:
    """Per request, how many drafts lead before the first rejected one ([S] int64)."""
    k = _device(layout.num_drafts, accept)
    if not len(accept):
        return k.clone()
    req = _device(layout.draft_req, accept)
    first_rejected = torch.where(accept, k[req], _device(layout.draft_pos, accept))
    return k.clone().scatter_reduce_(0, req, first_rejected, "amin")


def _assemble(
    layout: DraftLayout,
    row_tokens: torch.Tensor,
    accepted: torch.Tensor,
    row_lp: torch.Tensor | None,
) -> SpecOutput:
    """Keep each request's rows 0..a (a = accepted drafts): a drafts and one sampled token."""
    tokens, a, lp = _to_host(row_tokens, accepted, row_lp)
    assert tokens is not None and a is not None
    return _assemble_host(layout, tokens, a, lp)


def _assemble_host(layout: DraftLayout, tokens: np.ndarray, a: np.ndarray,
                   lp: np.ndarray | None) -> SpecOutput:
    keep = layout.rel <= np.repeat(a, layout.num_drafts + 1)
    return SpecOutput(tokens[keep], (a + 1).astype(np.int32), lp[keep] if lp is not None else None)


def _to_host(*parts: torch.Tensor | None) -> list[np.ndarray | None]:
    """The step's results in one device-to-host copy (one wait for the stream, as a step without
    drafts has): integer tensors as int32 and float ones as their float32 bits, packed."""
    present = [p for p in parts if p is not None]
    if not present:
        return [None] * len(parts)
    words = [p.float().view(torch.int32) if p.is_floating_point() else p.to(torch.int32)
             for p in present]
    host = torch.cat(words).cpu().numpy()
    out: list[np.ndarray | None] = []
    start = 0
    for p in parts:
        if p is None:
            out.append(None)
            continue
        chunk = host[start : start + p.numel()]
        start += p.numel()
        out.append(chunk.view(np.float32) if p.is_floating_point() else chunk)
    return out


def _device(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A host index array on the logits' device: pinned and non_blocking, no stream wait."""
    return to_device(a, like.device)
