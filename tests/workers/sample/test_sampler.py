"""Sampler: greedy, seeded reproducibility, masking, rank agreement, logprobs.

Seeded requests are keyed by (seed, token position) in a counter-based generator; these tests
hold what the earlier per-request torch.Generator streams guaranteed (same tokens across runs,
ranks and batch compositions, greedy rows drawing nothing), not those streams' exact values."""

from __future__ import annotations

import numpy as np
import torch

from workers.sample.sampler import Sampler, SamplingMetadata, tokens_checksum

V = 50


def seeded(n: int, seeds: dict[int, int], position: int = 0) -> dict[str, np.ndarray]:
    """md(...) keyword arguments: rows i -> seeds[i], all at token position `position`."""
    flags = np.zeros(n, dtype=bool)
    values = np.zeros(n, dtype=np.int64)
    for i, sd in seeds.items():
        flags[i], values[i] = True, sd
    return dict(seeded=flags, seeds=values, positions=np.full(n, position, dtype=np.int64))


def md(n: int, temp: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, **kw):
    return SamplingMetadata(
        temperature=np.full(n, temp, dtype=np.float32),
        top_k=np.full(n, top_k, dtype=np.int32),
        top_p=np.full(n, top_p, dtype=np.float32),
        min_p=np.full(n, min_p, dtype=np.float32),
        **kw,
    )


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax_and_consumes_no_randomness() -> None:
    x = logits(6)
    s = Sampler(seed=3)
    out = s(x, md(6, temp=0.0, need_logprobs=True))
    assert torch.equal(out.token_ids, x.argmax(-1))
    assert s.shared_draws == 0
    assert out.logprobs is not None
    expect = torch.log_softmax(x, -1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expect)


def test_mixed_batch_greedy_rows_are_argmax() -> None:
    x = logits(8)
    m = md(8)
    m.temperature[::2] = 0.0
    out = Sampler(seed=0)(x, m)
    assert torch.equal(out.token_ids[::2], x[::2].argmax(-1))


def test_seeded_sampling_is_reproducible_and_independent_of_batch() -> None:
    x = logits(4)

    def run(rows: list[int]) -> list[int]:
        m = md(len(rows), **seeded(len(rows), {i: 1234 + r for i, r in enumerate(rows)}))
        return Sampler(seed=0)(x[rows], m).token_ids.tolist()

    full = run([0, 1, 2, 3])
    assert full == run([0, 1, 2, 3])
    # a seeded request's tokens do not depend on who else is in the batch
    assert run([2]) == [full[2]]
    assert run([3, 1]) == [full[3], full[1]]


def test_two_instances_same_seed_agree() -> None:
    """Stand-in for two TP ranks holding identical logits and seeds."""
    a, b = Sampler(seed=7), Sampler(seed=7)
    for step in range(20):
        x = logits(16, seed=step)
        ka = dict(top_k=10, top_p=0.9, min_p=0.01)
        ta = a(x, md(16, temp=0.8, **seeded(16, {0: 5, 3: 6}, step), **ka))
        tb = b(x.clone(), md(16, temp=0.8, **seeded(16, {0: 5, 3: 6}, step), **ka))
        assert torch.equal(ta.token_ids, tb.token_ids)
        assert tokens_checksum(ta.token_ids.numpy()) == tokens_checksum(tb.token_ids.numpy())


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.7, 0.2, 0.1] + [0.0] * (V - 3))
    x = torch.log(probs.clamp_min(1e-30)).repeat(4000, 1)
    toks = Sampler(seed=1)(x, md(4000)).token_ids
    freq = torch.bincount(toks, minlength=V).float() / 4000
    assert abs(freq[0] - 0.7) < 0.05 and abs(freq[1] - 0.2) < 0.05
    assert freq[3:].sum() == 0


def test_top_k_never_picks_masked() -> None:
    x = logits(64, seed=1)
    allowed = x.topk(5, dim=-1).indices
    toks = Sampler(seed=2)(x, md(64, temp=5.0, top_k=5)).token_ids
    assert all(t in allowed[i] for i, t in enumerate(toks.tolist()))


def test_top_p_never_picks_masked() -> None:
    x = logits(64, seed=2)
    p = 0.5
    probs = torch.softmax(x, -1)
    sp, order = probs.sort(-1, descending=True)
    before = sp.cumsum(-1) - sp
    s = Sampler(seed=3)
    for _ in range(5):
        toks = s(x, md(64, top_p=p)).token_ids
        for i, t in enumerate(toks.tolist()):
            kept = order[i][before[i] <= p].tolist()
            assert t in kept


def test_min_p_never_picks_masked() -> None:
    x = logits(64, seed=3)
    probs = torch.softmax(x, -1)
    ok = probs >= 0.3 * probs.max(-1, keepdim=True).values
    s = Sampler(seed=4)
    for _ in range(5):
        toks = s(x, md(64, temp=1.0, min_p=0.3)).token_ids
        assert ok[torch.arange(64), toks].all()


def test_per_row_options_and_logprobs_of_processed_logits() -> None:
    x = logits(3, seed=4)
    m = md(3, temp=0.5, need_logprobs=True)
    m.top_k[:] = [1, 0, 0]  # top-k 1 on row 0 = greedy
    out = Sampler(seed=0)(x, m)
    assert out.token_ids[0] == x[0].argmax()
    assert out.logprobs is not None
    assert abs(out.logprobs[0].item()) < 1e-6  # only one token survives: logprob 0
    lp1 = torch.log_softmax(x[1] / 0.5, -1)[out.token_ids[1]]
    torch.testing.assert_close(out.logprobs[1], lp1)


def test_draw_across_vocab_blocks_follows_the_distribution() -> None:
    """The two-level inverse CDF: mass spread over several blocks, zero-mass tokens never."""
    from workers.sample.sampler import draw_tokens

    vocab = 3000  # six blocks, the last one partial
    probs = torch.zeros(vocab)
    probs[[3, 700, 1999, 2999]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 8000
    u = torch.rand(n, 2, generator=torch.Generator().manual_seed(0))
    toks = draw_tokens(probs.repeat(n, 1), u)
    freq = torch.bincount(toks, minlength=vocab).float() / n
    assert freq[[3, 700, 1999, 2999]].sub(torch.tensor([0.1, 0.2, 0.3, 0.4])).abs().max() < 0.02
    assert freq.sum() == 1 and (freq[probs == 0] == 0).all()


def test_top_k_top_p_masks_equal_a_full_sort() -> None:
    """The partial selection keeps exactly what sorting the vocabulary would (nucleus inside
    the candidates), top-k and top-p alone and together, rows with neither untouched."""
    from workers.sample.sampler import _apply_top_k_top_p

    x = torch.randn(4, 5000, generator=torch.Generator().manual_seed(9)) * 4
    top_k = np.array([0, 40, 40, 0], dtype=np.int32)
    top_p = np.array([0.8, 1.0, 0.5, 1.0], dtype=np.float32)
    got = torch.isfinite(_apply_top_k_top_p(x, top_k, top_p))
    for i in range(3):  # row 3 has neither (a float cumsum may pass 1.0 there)
        sx, order = x[i].sort(descending=True)
        k = top_k[i] or 5000
        sx[k:] = float("-inf")
        pr = torch.softmax(sx, -1)
        keep = ((pr.cumsum(-1) - pr) <= top_p[i]) & torch.isfinite(sx)
        want = torch.zeros(5000, dtype=torch.bool)
        want[order[keep]] = True
        assert torch.equal(got[i], want), i
    assert got[3].all()
