"""Worker-side speculative decoding: draft verification on a real ModelRunner (dummy:micro,
CPU, fp32) and the rejection sampler's output distribution."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
import torch

from protocol.codec import pack, unpack, unpack_f32
from protocol.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from tests.helpers.runner import BS, make_runner
from workers.runner.input_batch import StateMismatchError
from workers.runner.model_runner import ModelRunner
from workers.sample.sampler import Sampler, SamplingMetadata
from workers.sample.spec_decode import DraftLayout, SpecOutput, rejection_sample

VOCAB = 512  # dummy:micro
PROMPT = [(7 * i + 3) % 500 for i in range(19)]
PROMPT2 = [(11 * i + 5) % 500 for i in range(10)]
PROMPT3 = [(13 * i + 1) % 500 for i in range(9)]
GREEDY = SamplingParams(temperature=0.0)
# Random sampling whose processed distribution is one-hot on the argmax: the rejection path
# runs (draws numbers, applies top-k) yet must reproduce greedy tokens exactly.
ONE_HOT_RANDOM = SamplingParams(temperature=1.0, top_k=1, logprobs=True)
N_REF = 24


@dataclass
class Req:
    prompt: list[int]
    sp: SamplingParams
    outputs: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    running: bool = True

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)


class SpecDriver:
    """A hand-driven scheduler that also proposes drafts and applies the rollback rule.

    ``plan`` gives the token count of requests without drafts (missing = not scheduled); a
    request with drafts is scheduled on its last token plus every draft, as the real
    scheduler does. After each step the worker's state is checked against this one.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.reqs: dict[int, Req] = {}
        self.step_id = 0
        self.next_block = 1
        self.last_counts: dict[int, int] = {}

    def _alloc(self, n: int) -> list[int]:
        # n < 0 after rejected drafts shrank `computed`: nothing to allocate (a negative n
        # used to move next_block back and hand one block to two requests)
        n = max(n, 0)
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def schedule(
        self,
        plan: dict[int, int] | None = None,
        drafts: dict[int, list[int]] | None = None,
        new: dict[int, tuple[list[int], SamplingParams]] | None = None,
    ) -> tuple[SchedulerOutput, dict[int, int]]:
        """The step's SchedulerOutput and {handle: scheduled tokens}; no state is changed."""
        plan, drafts, new = dict(plan or {}), drafts or {}, new or {}
        for h, d in drafts.items():
            r = self.reqs[h]
            plan[h] = r.num_tokens + len(d) - r.computed
        new_reqs, ov_h, ov_c, cr_h, cr_c, cr_ids = [], [], [], [], [], []
        next_block = self.next_block
        for h, (prompt, sp) in new.items():
            n_blocks = -(-plan[h] // BS)
            new_reqs.append(
                NewRequestData(
                    handle=h,
                    prompt_token_ids=pack(prompt),
                    sampling_params=sp,
                    block_ids=pack(list(range(next_block, next_block + n_blocks))),
                    num_computed_tokens=0,
                    num_scheduled_tokens=plan[h],
                )
            )
            next_block += n_blocks
        for h, r in self.reqs.items():
            n = plan.get(h, 0)
            if n != 1:
                ov_h.append(h)
                ov_c.append(n)
            need = -(-(r.computed + n) // BS) - len(r.blocks)
            if need > 0:
                cr_h.append(h)
                cr_c.append(need)
                cr_ids += list(range(next_block, next_block + need))
                next_block += need
        so = SchedulerOutput(
            step_id=self.step_id,
            new_reqs=new_reqs,
            cached_reqs=CachedRequestData(pack(cr_h), pack(cr_c), pack(cr_ids)),
            sched_override_handles=pack(ov_h),
            sched_override_counts=pack(ov_c),
            spec_handles=pack(list(drafts)),
            spec_token_counts=pack([len(d) for d in drafts.values()]),
            spec_token_ids=pack([t for d in drafts.values() for t in d]),
            num_running=len(self.reqs) + len(new),
            total_num_scheduled_tokens=sum(plan.values()),
        )
        return so, plan

    def step(
        self,
        plan: dict[int, int] | None = None,
        drafts: dict[int, list[int]] | None = None,
        new: dict[int, tuple[list[int], SamplingParams]] | None = None,
    ) -> ModelRunnerOutput:
        drafts, new = drafts or {}, new or {}
        so, sched = self.schedule(plan, drafts, new)
        out = self.runner.execute(so)
        self.step_id += 1
        for h, (prompt, sp) in new.items():
            self.reqs[h] = Req(prompt, sp)
        for h, r in self.reqs.items():
            r.blocks += self._alloc(-(-(r.computed + sched.get(h, 0)) // BS) - len(r.blocks))
            r.computed += sched.get(h, 0)
        handles = unpack(out.req_handles)
        tokens = unpack(out.sampled_token_ids)
        counts = unpack(out.num_tokens) if out.num_tokens else [1] * len(handles)
        lps = unpack_f32(out.logprobs) if out.logprobs else []
        assert sum(counts) == len(tokens) and len(lps) in (0, len(tokens))
        self.last_counts = dict(zip(handles, counts, strict=True))
        pos = 0
        for h, c in zip(handles, counts, strict=True):
            r = self.reqs[h]
            if h in drafts:  # the scheduler's rollback: rejected drafts get recomputed
                r.computed -= len(drafts[h]) - (c - 1)
            else:
                assert c == 1
            r.outputs += tokens[pos : pos + c]
            r.logprobs += lps[pos : pos + c]
            pos += c
            assert r.computed == r.num_tokens - 1
        self.check_worker_state()
        return out

    def check_worker_state(self) -> None:
        b = self.runner.input_batch
        assert b is not None
        for h, r in self.reqs.items():
            row = b.states[h].row
            assert b.num_tokens[row] == r.num_tokens
            assert b.num_computed_tokens[row] == r.computed
            assert b.num_drafts[row] == 0  # drafts never outlive their step
            assert b.token_ids_of(h) == r.prompt + r.outputs


def solo(prompt: list[int], sp: SamplingParams = GREEDY, n: int = N_REF) -> list[int]:
    """Plain step-by-step decoding, no drafts."""
    d = SpecDriver(make_runner())
    d.step({0: len(prompt)}, new={0: (prompt, sp)})
    while len(d.reqs[0].outputs) < n:
        d.step({0: 1})
    return d.reqs[0].outputs


def drafts_for(ref: list[int], done: int, pattern: str) -> tuple[list[int], int]:
    """Drafts after ``done`` reference tokens: 'R' = the right token, 'W' = a wrong one.

    Returns the drafts and the number of tokens verification must emit.
    """
    d = [ref[done + i] if c == "R" else (ref[done + i] + 1) % VOCAB for i, c in enumerate(pattern)]
    return d, len(pattern.split("W")[0]) + 1


@pytest.fixture(scope="module")
def refs() -> dict[str, list[int]]:
    return {"p1": solo(PROMPT), "p2": solo(PROMPT2), "p3": solo(PROMPT3)}


# ------------------------------------------------------------------ greedy equality


@pytest.mark.parametrize(
    "sp",
    [GREEDY, SamplingParams(temperature=0.0, logprobs=True), ONE_HOT_RANDOM],
    ids=["fast-path", "greedy-logprobs", "one-hot-random"],
)
def test_drafts_reproduce_plain_greedy_decoding(
    refs: dict[str, list[int]], sp: SamplingParams
) -> None:
    ref = refs["p1"]
    assert len(set(ref)) > 1  # a constant model would accept any repeated draft
    d = SpecDriver(make_runner())
    d.step({0: len(PROMPT)}, new={0: (PROMPT, sp)})
    for pattern in ["RRR", "WR", "RWR", "R", "W", "RRRRW", "RR"]:
        done = len(d.reqs[0].outputs)
        drafts, expect = drafts_for(ref, done, pattern)
        d.step(drafts={0: drafts})
        assert d.last_counts[0] == expect, pattern
        assert d.reqs[0].outputs == ref[: done + expect]
    d.step({0: 1})  # a plain step after verification continues the same sequence
    assert d.reqs[0].outputs == ref[: len(d.reqs[0].outputs)]
    if sp.logprobs:
        lps = d.reqs[0].logprobs
        assert len(lps) == len(d.reqs[0].outputs) and all(lp <= 0.0 for lp in lps)
        if sp is ONE_HOT_RANDOM:  # top_k=1 leaves all the mass on one token
            assert all(abs(lp) < 1e-6 for lp in lps)


@pytest.mark.parametrize(
    "sp2",
    [GREEDY, SamplingParams(temperature=0.8, seed=7)],
    ids=["all-greedy", "seeded-random-neighbour"],
)
def test_mixed_batch_spec_decode_and_prefill_chunk(
    refs: dict[str, list[int]], sp2: SamplingParams
) -> None:
    """Spec rows next to plain decode rows and a prefill chunk; each matches its solo run."""
    ref1, ref3 = refs["p1"], refs["p3"]
    ref2 = refs["p2"] if sp2 is GREEDY else solo(PROMPT2, sp2)
    d = SpecDriver(make_runner())
    d.step({0: len(PROMPT)}, new={0: (PROMPT, GREEDY)})
    d.step({0: 1, 1: len(PROMPT2)}, new={1: (PROMPT2, sp2)})
    steps = [
        ("RR", {1: 1, 2: 5}),
        ("W", {1: 1, 2: 4}),
        ("RRW", {1: 1, 2: 1}),
        ("RRRR", {1: 1, 2: 1}),
    ]
    for i, (pattern, plan) in enumerate(steps):
        new = {2: (PROMPT3, GREEDY)} if i == 0 else None  # arrives as a chunk beside drafts
        done = len(d.reqs[0].outputs)
        drafts, expect = drafts_for(ref1, done, pattern)
        d.step(plan, drafts={0: drafts}, new=new)
        assert d.last_counts[0] == expect
        assert 2 not in d.last_counts if i == 0 else d.last_counts[2] == 1
    for _ in range(2):  # now request 2 verifies drafts and request 0 decodes plainly
        done = len(d.reqs[2].outputs)
        d.step({0: 1, 1: 1}, drafts={2: drafts_for(ref3, done, "RW")[0]})
        assert d.last_counts[2] == 2
    assert d.reqs[0].outputs == ref1[: len(d.reqs[0].outputs)]
    assert d.reqs[1].outputs == ref2[: len(d.reqs[1].outputs)]
    assert d.reqs[2].outputs == ref3[: len(d.reqs[2].outputs)]
    assert len(d.reqs[0].outputs) > 10 and len(d.reqs[1].outputs) == 7


# ------------------------------------------------------------------ worker state


def test_state_after_partial_rejection_and_next_step(refs: dict[str, list[int]]) -> None:
    ref = refs["p1"]
    d = SpecDriver(make_runner())
    d.step({0: len(PROMPT)}, new={0: (PROMPT, GREEDY)})
    b = d.runner.input_batch
    assert b is not None
    row = b.states[0].row
    n_tok = int(b.num_tokens[row])
    drafts, _ = drafts_for(ref, 1, "RWR")
    out = d.step(drafts={0: drafts})
    # one draft accepted + the correction; the two drafts after it are dropped
    assert unpack(out.num_tokens) == [2] and unpack(out.sampled_token_ids) == ref[1:3]
    assert b.num_tokens[row] == n_tok + 2
    assert b.num_computed_tokens[row] == (n_tok - 1) + 4 - (3 - 1)
    assert b.token_ids_of(0) == PROMPT + ref[:3]
    # the next step computes the correction, overwriting the rejected draft's KV slot
    out = d.step({0: 1})
    assert out.num_tokens == b"" and d.reqs[0].outputs == ref[:4]


def test_all_drafts_accepted_up_to_max_model_len(refs: dict[str, list[int]]) -> None:
    """The bonus token of drafts ending at max_model_len lands in the spare last column."""
    ref = refs["p1"]
    max_len = len(PROMPT) + 5
    d = SpecDriver(make_runner(max_model_len=max_len))
    d.step({0: len(PROMPT)}, new={0: (PROMPT, GREEDY)})
    d.step(drafts={0: ref[1:5]})  # positions up to max_len - 1 scheduled, 5 tokens out
    assert d.last_counts[0] == 5 and d.reqs[0].num_tokens == max_len + 1
    assert d.reqs[0].outputs == ref[:6]


# ------------------------------------------------------------------ bad diffs


def _two_running() -> SpecDriver:
    d = SpecDriver(make_runner())
    d.step({0: len(PROMPT), 1: len(PROMPT2)}, new={0: (PROMPT, GREEDY), 1: (PROMPT2, GREEDY)})
    return d


def _bad_count_length(d: SpecDriver) -> SchedulerOutput:
    so, _ = d.schedule({1: 1}, drafts={0: [5, 6]})
    return msgspec.structs.replace(so, spec_token_counts=pack([2, 1]))


def _bad_id_length(d: SpecDriver) -> SchedulerOutput:
    so, _ = d.schedule({1: 1}, drafts={0: [5, 6]})
    return msgspec.structs.replace(so, spec_token_ids=pack([5]))


def _zero_count(d: SpecDriver) -> SchedulerOutput:
    so, _ = d.schedule({1: 1}, drafts={0: [5]})
    return msgspec.structs.replace(so, spec_token_counts=pack([0]), spec_token_ids=b"")


def _unknown_handle(d: SpecDriver) -> SchedulerOutput:
    so, _ = d.schedule({0: 1, 1: 1})
    return msgspec.structs.replace(
        so, spec_handles=pack([9]), spec_token_counts=pack([1]), spec_token_ids=pack([5])
    )


def _twice(d: SpecDriver) -> SchedulerOutput:
    so, _ = d.schedule({1: 1}, drafts={0: [5]})
    return msgspec.structs.replace(
        so, spec_handles=pack([0, 0]), spec_token_counts=pack([1, 1]), spec_token_ids=pack([5, 5])
    )


def _equality_violated(d: SpecDriver) -> SchedulerOutput:
    so, _ = d.schedule({1: 1}, drafts={0: [5]})  # scheduled for one draft, claims two
    return msgspec.structs.replace(so, spec_token_counts=pack([2]), spec_token_ids=pack([5, 6]))


def _preempted(d: SpecDriver) -> SchedulerOutput:
    so, _ = d.schedule({0: 1}, drafts={1: [5]})
    return msgspec.structs.replace(
        so,
        preempted_handles=pack([1]),
        sched_override_handles=b"",
        sched_override_counts=b"",
        num_running=1,
        total_num_scheduled_tokens=1,
    )


def _new_handle(d: SpecDriver) -> SchedulerOutput:
    so, _ = d.schedule({0: 1, 1: 1, 2: 4}, new={2: (PROMPT3, GREEDY)})
    return msgspec.structs.replace(
        so, spec_handles=pack([2]), spec_token_counts=pack([1]), spec_token_ids=pack([5])
    )


def _past_max_model_len(d: SpecDriver) -> SchedulerOutput:
    k = 128 - len(PROMPT)  # num_tokens + k == max_model_len + 1
    so, _ = d.schedule({1: 1}, drafts={0: [5] * k})
    return so


@pytest.mark.parametrize(
    ("make_so", "message"),
    [
        (_bad_count_length, "spec diff: 1 handles, 2 draft counts"),
        (_bad_id_length, "summing to 2, 1 draft token ids"),
        (_zero_count, "draft count < 1"),
        (_unknown_handle, "spec_handles: handle 9 is not running"),
        (_twice, "lists a handle twice"),
        (_equality_violated, r"request 0: 2 drafts need .* 19 \+ 2 != 20 \+ 2"),
        (_preempted, "spec_handles: handle 1 is not running"),
        (_new_handle, "spec drafts for new/resumed handle 2"),
        (_past_max_model_len, "> max_model_len=128"),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else "",
)
def test_bad_spec_diff_raises(
    make_so: Callable[[SpecDriver], SchedulerOutput], message: str
) -> None:
    d = _two_running()
    with pytest.raises(StateMismatchError, match=message):
        d.runner.execute(make_so(d))


# ------------------------------------------------------------------ random rows


def test_seeded_random_spec_decoding_is_reproducible() -> None:
    """Two runners, same seeds: same tokens, counts, logprobs and checksums with drafts."""
    seeded = SamplingParams(temperature=0.5, top_k=50, top_p=0.95, seed=42, logprobs=True)
    unseeded = SamplingParams(temperature=1.0, min_p=0.05)  # the shared generator

    def run() -> tuple[list[int], list[int], list[float], list[int | None], list[int]]:
        d = SpecDriver(make_runner(enable_checksum=True))
        d.step({0: len(PROMPT), 1: len(PROMPT2)}, new={0: (PROMPT, seeded), 1: (PROMPT2, unseeded)})
        sums, counts = [], []
        for i in range(6):
            # request 0: the greedy continuation, which low temperature often accepts;
            # request 1: its own recent tokens (n-gram-like), mostly rejected
            drafts = {0: solo(d.reqs[0].prompt + d.reqs[0].outputs, n=2)}
            if i % 2:
                drafts[1] = d.reqs[1].outputs[-3:]
            out = d.step({1: 1}, drafts=drafts)
            sums.append(out.checksum)
            counts.append(d.last_counts[0])
        return d.reqs[0].outputs, d.reqs[1].outputs, d.reqs[0].logprobs, sums, counts

    a, b = run(), run()
    assert a == b
    assert 1 in a[4] and any(c > 1 for c in a[4])  # both rejections and acceptances ran
    assert len(a[2]) == len(a[0]) and all(lp <= 0.0 for lp in a[2])
    assert all(isinstance(c, int) for c in a[3])


P = [0.5, 0.25, 0.15, 0.07, 0.03]
Q = [0.05, 0.1, 0.15, 0.3, 0.4]
R = [0.2, 0.2, 0.2, 0.2, 0.2]
N = 20000


def _md(n: int, temp: float = 1.0, top_k: int = 0, **kw: object) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=np.full(n, temp, dtype=np.float32),
        top_k=np.full(n, top_k, dtype=np.int32),
        top_p=np.ones(n, dtype=np.float32),
        min_p=np.zeros(n, dtype=np.float32),
        **kw,
    )


def _freq(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=5) / max(len(tokens), 1)


def _spec_batch(
    dists: list[list[float]], drafts: list[int], n: int = N
) -> tuple[torch.Tensor, DraftLayout]:
    """n identical requests, each verifying ``drafts`` against rows ``dists``."""
    logits = torch.log(torch.tensor(dists)).repeat(n, 1)
    layout = DraftLayout(np.full(n, len(drafts)), np.tile(drafts, n))
    return logits, layout


def _by_step(out: SpecOutput) -> list[np.ndarray]:
    """Tokens at output step i of every request that got that far."""
    starts = np.cumsum(out.counts) - out.counts
    return [out.token_ids[starts[out.counts > i] + i] for i in range(out.counts.max())]


@pytest.mark.parametrize("draft", [0, 4], ids=["likely-draft", "unlikely-draft"])
def test_rejection_sampling_keeps_the_target_distribution(draft: int) -> None:
    logits, layout = _spec_batch([P, Q], [draft])
    out = rejection_sample(Sampler(seed=1), logits, layout, _md(N))
    first, *rest = _by_step(out)
    assert np.abs(_freq(first) - P).max() < 0.015
    assert abs((out.counts == 2).mean() - P[draft]) < 0.015  # accepted with p(draft)
    assert ((out.counts == 2) == (first == draft)).all()  # a rejection never re-emits it
    if draft == 0:  # ~10,000 accepted: the bonus token follows the next row's distribution
        assert np.abs(_freq(rest[0]) - Q).max() < 0.02


def test_rejection_sampling_two_drafts_chain() -> None:
    logits, layout = _spec_batch([P, Q, R], [0, 3])
    out = rejection_sample(Sampler(seed=2), logits, layout, _md(N))
    first, second, third = _by_step(out)
    assert np.abs(_freq(first) - P).max() < 0.015
    assert np.abs(_freq(second) - Q).max() < 0.02  # given draft 0 accepted
    assert abs((out.counts == 3).mean() - P[0] * Q[3]) < 0.015
    assert np.abs(_freq(third) - R).max() < 0.03  # the bonus after both


def test_rejection_sampling_uses_processed_distribution() -> None:
    """Temperature and top-k apply before verification: a masked draft is never accepted."""
    logits, layout = _spec_batch([P, Q], [3])
    out = rejection_sample(Sampler(seed=3), logits, layout, _md(N, temp=2.0, top_k=3))
    p = np.sqrt(P[:3]) / np.sqrt(P[:3]).sum()  # temperature 2 = square root of p, top 3
    assert (out.counts == 1).all()
    assert np.abs(_freq(out.token_ids) - [*p, 0, 0]).max() < 0.015


def test_rejection_sampling_greedy_rows_and_generators() -> None:
    """Greedy rows verify by argmax and draw nothing; seeded rows ignore their neighbours."""
    x = torch.randn(4 * 3, 50, generator=torch.Generator().manual_seed(0)) * 3
    t = x.argmax(-1).view(4, 3).tolist()  # 4 requests with 2 drafts each: 3 rows each
    ids = [t[0][0], t[0][1], t[1][0], (t[1][1] + 1) % 50, 5, 6, 7, 8]
    layout = DraftLayout(np.full(4, 2), np.array(ids))

    def run(temps: list[float], seeds: dict[int, int]) -> tuple[list[list[int]], bool]:
        flags = np.isin(np.arange(4), list(seeds))
        values = np.array([seeds.get(i, 0) for i in range(4)], dtype=np.int64)
        md = _md(4, seeded=flags, seeds=values, positions=np.full(4, 7, dtype=np.int64))
        md.temperature[:] = temps
        s = Sampler(seed=5)
        out = rejection_sample(s, x, layout, md)
        per_req = np.split(out.token_ids, np.cumsum(out.counts)[:-1])
        return [r.tolist() for r in per_req], s.shared_draws == 0

    greedy, untouched = run([0.0] * 4, {})
    assert untouched
    assert greedy[0] == t[0]  # both drafts right: 2 drafts + the bonus
    assert greedy[1] == t[1][:2]  # second draft wrong: 1 draft + the correction
    mixed, untouched = run([0.0, 1.0, 0.0, 1.0], {1: 11, 3: 12})
    assert untouched  # greedy and seeded rows leave the shared generator alone
    assert mixed[0] == greedy[0] and mixed[2] == greedy[2]
    # request 3 (seeded) draws the same numbers whatever sits beside it
    alone, _ = run([0.0, 0.0, 0.0, 1.0], {3: 12})
    assert alone[3] == mixed[3]
