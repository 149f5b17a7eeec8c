"""ModelRunner on dummy:micro (CPU, fp32): hand-built step plans must not change greedy tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from protocol.codec import pack, unpack, unpack_f32
from protocol.messages import (
    CachedRequestData,
    NewRequestData,
    ResumedRequestData,
    SamplingParams,
    SchedulerOutput,
)
from tests.helpers.runner import BS, make_runner
from workers.runner.input_batch import StateMismatchError
from workers.runner.model_runner import ModelRunner

PROMPT = [(7 * i + 3) % 500 for i in range(19)]
PROMPT2 = [(11 * i + 5) % 500 for i in range(10)]


@dataclass
class Req:
    prompt: list[int]
    sp: SamplingParams
    outputs: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    running: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)


class Driver:
    """A tiny hand-driven scheduler: the caller says how many tokens each request gets."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.reqs: dict[int, Req] = {}
        self.step_id = 0
        self.next_block = 1

    def alloc(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def step(
        self,
        plan: dict[int, int],
        new: dict[int, tuple[list[int], SamplingParams]] | None = None,
        prefix: dict[int, tuple[int, list[int]]] | None = None,  # handle -> (computed, blocks)
        preempt: tuple[int, ...] = (),
        resume: tuple[int, ...] = (),
        finish: tuple[int, ...] = (),
    ):
        new, prefix = new or {}, prefix or {}
        for h in finish:
            del self.reqs[h]
        for h in preempt:
            self.reqs[h].running, self.reqs[h].blocks, self.reqs[h].computed = False, [], 0
        new_reqs, resumed, ov_h, ov_c, cr_h, cr_c, cr_ids = [], [], [], [], [], [], []
        for h, (prompt, sp) in new.items():
            computed, shared = prefix.get(h, (0, []))
            r = Req(prompt, sp, computed=computed, running=True)
            n = plan[h]
            r.blocks = shared + self.alloc(-(-(computed + n) // BS) - len(shared))
            self.reqs[h] = r
            new_reqs.append(
                NewRequestData(
                    handle=h,
                    prompt_token_ids=pack(prompt),
                    sampling_params=sp,
                    block_ids=pack(r.blocks),
                    num_computed_tokens=computed,
                    num_scheduled_tokens=n,
                )
            )
        for h in resume:
            r = self.reqs[h]
            r.running = True
            r.blocks = self.alloc(-(-(plan[h]) // BS))
            resumed.append(
                ResumedRequestData(
                    handle=h,
                    block_ids=pack(r.blocks),
                    num_computed_tokens=0,
                    num_scheduled_tokens=plan[h],
                )  # fmt: skip
            )
        for h, r in self.reqs.items():
            if not r.running or h in new or h in resume:
                continue
            n = plan.get(h, 0)
            if n != 1:
                ov_h.append(h)
                ov_c.append(n)
            need = -(-(r.computed + n) // BS) - len(r.blocks)
            if need > 0:
                ids = self.alloc(need)
                r.blocks += ids
                cr_h.append(h)
                cr_c.append(need)
                cr_ids += ids
        running = [h for h, r in self.reqs.items() if r.running]
        so = SchedulerOutput(
            step_id=self.step_id,
            new_reqs=new_reqs,
            resumed_reqs=resumed,
            cached_reqs=CachedRequestData(pack(cr_h), pack(cr_c), pack(cr_ids)),
            finished_handles=pack(list(finish)),
            preempted_handles=pack(list(preempt)),
            sched_override_handles=pack(ov_h),
            sched_override_counts=pack(ov_c),
            num_running=len(running),
            total_num_scheduled_tokens=sum(plan.get(h, 0) for h in running),
        )
        self.step_id += 1
        out = self.runner.execute(so)
        for h in running:
            self.reqs[h].computed += plan.get(h, 0)
        lps = unpack_f32(out.logprobs) if out.logprobs else []
        for h, t in zip(unpack(out.req_handles), unpack(out.sampled_token_ids), strict=True):
            r = self.reqs[h]
            assert r.computed == r.num_tokens
            r.outputs.append(t)
        return out, lps

    def decode(self, handles: list[int], steps: int) -> None:
        for _ in range(steps):
            self.step({h: 1 for h in handles})


GREEDY = SamplingParams(temperature=0.0)
N_DECODE = 8


def solo(prompt: list[int], chunks: list[int], sp: SamplingParams = GREEDY) -> list[int]:
    d = Driver(make_runner())
    d.step({0: chunks[0]}, new={0: (prompt, sp)})
    for c in chunks[1:]:
        d.step({0: c})
    d.decode([0], N_DECODE)
    return d.reqs[0].outputs


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return solo(PROMPT, [len(PROMPT)])


def test_greedy_tokens_depend_on_context(reference: list[int]) -> None:
    assert len(reference) == N_DECODE + 1
    assert len(set(reference)) > 1  # a model emitting one token would hide broken attention


@pytest.mark.parametrize("chunks", [[12, 7], [5, 5, 9], [1] * 19])
def test_chunked_prefill_matches_one_chunk(reference: list[int], chunks: list[int]) -> None:
    assert solo(PROMPT, chunks) == reference


def test_mixed_batch_matches_solo_runs(reference: list[int]) -> None:
    ref2 = solo(PROMPT2, [len(PROMPT2)])
    d = Driver(make_runner())
    d.step({0: 6}, new={0: (PROMPT, GREEDY)})
    d.step({0: 13, 1: 4}, new={1: (PROMPT2, GREEDY)})  # request 0 samples, 1 is a chunk
    d.step({0: 1, 1: 0})  # request 1 skips a step
    d.step({0: 1, 1: 6})
    d.decode([0, 1], N_DECODE)
    assert d.reqs[0].outputs[: N_DECODE + 1] == reference
    assert d.reqs[1].outputs[: N_DECODE + 1] == ref2


def test_prefix_cache_hit_matches(reference: list[int]) -> None:
    d = Driver(make_runner())
    d.step({0: len(PROMPT)}, new={0: (PROMPT, GREEDY)})
    shared = d.reqs[0].blocks[:3]  # 12 tokens of identical prefix already in the KV cache
    d.step({0: 1, 1: len(PROMPT) - 12}, new={1: (PROMPT, GREEDY)}, prefix={1: (12, shared)})
    d.decode([0, 1], N_DECODE - 1)
    assert d.reqs[1].outputs == reference[:N_DECODE]
    assert d.reqs[0].outputs == reference


def test_preempt_and_resume_by_recompute(reference: list[int]) -> None:
    d = Driver(make_runner())
    d.step({0: len(PROMPT)}, new={0: (PROMPT, GREEDY)})
    d.decode([0], 3)
    d.step({}, preempt=(0,))  # nothing scheduled: the runner only applies the diff
    n = d.reqs[0].num_tokens
    d.step({0: n}, resume=(0,))
    d.decode([0], N_DECODE - 4)
    assert d.reqs[0].outputs == reference


def test_seeded_sampling_reproducible_with_logprobs_and_checksum() -> None:
    sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=42, logprobs=True)

    def run() -> tuple[list[int], list[float], list[int | None]]:
        d = Driver(make_runner(enable_checksum=True))
        out, lps = d.step({0: len(PROMPT)}, new={0: (PROMPT, sp)})
        sums = [out.checksum]
        all_lps = list(lps)
        for _ in range(5):
            out, lps = d.step({0: 1})
            sums.append(out.checksum)
            all_lps += lps
        return d.reqs[0].outputs, all_lps, sums

    a, b = run(), run()
    assert a == b
    assert all(lp <= 0.0 for lp in a[1]) and len(a[1]) == 6
    assert all(isinstance(c, int) for c in a[2])


def test_timings_and_step_gap() -> None:
    d = Driver(make_runner())
    out, _ = d.step({0: len(PROMPT)}, new={0: (PROMPT, GREEDY)})
    assert len(out.timings_us) == 5 and out.rank == 0
    with pytest.raises(StateMismatchError, match="step gap"):
        d.runner.execute(SchedulerOutput(step_id=5, num_running=1, total_num_scheduled_tokens=1))
