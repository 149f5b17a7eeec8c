"""InputBatch against a plain-Python reference driven by a random (but valid) scheduler."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec import pack
from protocol.messages import (
    CachedRequestData,
    NewRequestData,
    ResumedRequestData,
    SamplingParams,
    SchedulerOutput,
)
from workers.runner.input_batch import InputBatch, StateMismatchError

BS = 4
MAX_LEN = 64
MAX_REQS = 8


@dataclass
class RefReq:
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    running: bool = True


class FakeScheduler:
    """Emits random valid diffs and keeps the reference state the worker should reach."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.reqs: dict[int, RefReq] = {}
        self.next_handle = 0
        self.next_block = 1
        self.step = 0
        self.sched: dict[int, int] = {}

    def _blocks(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def make_step(self) -> SchedulerOutput:
        rng, reqs = self.rng, self.reqs
        # like the real scheduler, finish requests that reached max_model_len
        finished = [h for h, r in reqs.items() if rng.random() < 0.1 or len(r.tokens) >= MAX_LEN]
        for h in finished:
            del reqs[h]
        running = [h for h, r in reqs.items() if r.running]
        preempted = [h for h in running if rng.random() < 0.1]
        for h in preempted:
            reqs[h].running = False
            reqs[h].blocks = []
        resumed, new = [], []
        sched: dict[int, int] = {}
        n_running = sum(r.running for r in reqs.values())
        for h, r in reqs.items():
            if n_running >= MAX_REQS:
                break
            if not r.running and h not in preempted and rng.random() < 0.4:
                n_running += 1
                r.running = True
                r.num_computed = rng.randrange(0, len(r.tokens))
                n = rng.randint(1, len(r.tokens) - r.num_computed)
                r.blocks = self._blocks(-(-(r.num_computed + n) // BS))
                sched[h] = n
                resumed.append(
                    ResumedRequestData(
                        handle=h,
                        block_ids=pack(r.blocks),
                        num_computed_tokens=r.num_computed,
                        num_scheduled_tokens=n,
                    )
                )
        for _ in range(rng.randint(0, 2)):
            if n_running >= MAX_REQS:
                break
            h = self.next_handle
            self.next_handle += 1
            prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
            r = RefReq(prompt, num_computed=rng.randrange(0, len(prompt)))
            n = rng.randint(1, len(prompt) - r.num_computed)
            r.blocks = self._blocks(-(-(r.num_computed + n) // BS))
            reqs[h] = r
            sched[h] = n
            n_running += 1
            new.append(
                NewRequestData(
                    handle=h,
                    prompt_token_ids=pack(prompt),
                    sampling_params=SamplingParams(temperature=0.0),
                    block_ids=pack(r.blocks),
                    num_computed_tokens=r.num_computed,
                    num_scheduled_tokens=n,
                )
            )
        ov_h, ov_c, cr_h, cr_c, cr_ids = [], [], [], [], []
        fresh = {d.handle for d in new} | {d.handle for d in resumed}
        for h, r in reqs.items():
            if not r.running or h in fresh:
                continue
            left = len(r.tokens) - r.num_computed
            n = 0 if rng.random() < 0.15 else rng.randint(1, left)
            sched[h] = n
            if n != 1:
                ov_h.append(h)
                ov_c.append(n)
            need = -(-(r.num_computed + n) // BS) - len(r.blocks)
            if need > 0:
                ids = self._blocks(need)
                r.blocks += ids
                cr_h.append(h)
                cr_c.append(need)
                cr_ids += ids
        self.sched = sched
        so = SchedulerOutput(
            step_id=self.step,
            new_reqs=new,
            resumed_reqs=resumed,
            cached_reqs=CachedRequestData(pack(cr_h), pack(cr_c), pack(cr_ids)),
            finished_handles=pack(finished),
            preempted_handles=pack(preempted),
            sched_override_handles=pack(ov_h),
            sched_override_counts=pack(ov_c),
            num_running=n_running,
            total_num_scheduled_tokens=sum(sched.values()),
        )
        self.step += 1
        return so


def check_inputs(batch: InputBatch, sched: FakeScheduler) -> None:
    inp = batch.prepare_inputs()
    qsl = inp.query_start_loc
    sampled = np.zeros(len(inp.sample_rows), dtype=np.int32)
    seen = set()
    for i, row in enumerate(inp.rows.tolist()):
        h = int(batch.handles[row])
        r = sched.reqs[h]
        n = sched.sched[h]
        seen.add(h)
        lo, hi = int(qsl[i]), int(qsl[i + 1])
        assert hi - lo == n > 0
        pos = list(range(r.num_computed, r.num_computed + n))
        assert inp.positions[lo:hi].tolist() == pos
        assert inp.input_ids[lo:hi].tolist() == r.tokens[r.num_computed : r.num_computed + n]
        slots = [r.blocks[p // BS] * BS + p % BS for p in pos]
        assert inp.slot_mapping[lo:hi].tolist() == slots
        assert inp.seq_lens[i] == r.num_computed + n
        w = inp.block_table.shape[1]
        assert inp.block_table[i].tolist() == (r.blocks + [0] * w)[:w]
        samples = r.num_computed + n >= len(r.tokens)
        assert (row in inp.sample_rows.tolist()) == samples
        if samples:
            j = inp.sample_rows.tolist().index(row)
            assert inp.logits_indices[j] == hi - 1
            sampled[j] = 7000 + h
    assert seen == {h for h, n in sched.sched.items() if n > 0}
    batch.update_after_step(inp, sampled)
    for row in inp.rows.tolist():
        h = int(batch.handles[row])
        r = sched.reqs[h]
        r.num_computed += sched.sched[h]
        if r.num_computed >= len(r.tokens):
            r.tokens.append(7000 + h)


def check_state(batch: InputBatch, sched: FakeScheduler) -> None:
    running = {h for h, r in sched.reqs.items() if r.running}
    assert batch.num_reqs == batch.num_rows == len(running)
    assert set(batch.handles[: batch.num_rows].tolist()) == running
    assert set(batch.states) == set(sched.reqs)
    for h, r in sched.reqs.items():
        assert batch.token_ids_of(h) == r.tokens
        if r.running:
            row = batch.states[h].row
            assert batch.num_computed_tokens[row] == r.num_computed
            assert batch.block_table[row, : len(r.blocks)].tolist() == r.blocks
            assert not batch.block_table[row, len(r.blocks) :].any()


def run_random(seed: int, steps: int) -> None:
    sched = FakeScheduler(random.Random(seed))
    batch = InputBatch(MAX_REQS, MAX_LEN, BS, max_blocks_per_req=MAX_LEN // BS + 1)
    for _ in range(steps):
        batch.apply(sched.make_step())
        check_state(batch, sched)
        check_inputs(batch, sched)
        check_state(batch, sched)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_diffs_match_reference(seed: int) -> None:
    run_random(seed, 30)


def test_long_random_run() -> None:
    run_random(12345, 300)


def _new(h: int, prompt: list[int], n: int, blocks: list[int], computed: int = 0):
    return NewRequestData(
        handle=h,
        prompt_token_ids=pack(prompt),
        sampling_params=SamplingParams(),
        block_ids=pack(blocks),
        num_computed_tokens=computed,
        num_scheduled_tokens=n,
    )


def _batch_with_two() -> InputBatch:
    b = InputBatch(4, 32, BS)
    b.apply(
        SchedulerOutput(
            step_id=0,
            new_reqs=[_new(1, [5, 6, 7], 3, [1]), _new(2, [8, 9], 2, [2])],
            num_running=2,
            total_num_scheduled_tokens=5,
        )
    )
    return b


def test_condense_keeps_rows_contiguous() -> None:
    b = InputBatch(4, 32, BS)
    b.apply(
        SchedulerOutput(
            step_id=0,
            new_reqs=[_new(h, [h], 1, [h]) for h in range(4)],
            num_running=4,
            total_num_scheduled_tokens=4,
        )
    )
    assert b.handles.tolist() == [0, 1, 2, 3]
    b.apply(
        SchedulerOutput(
            step_id=1, finished_handles=pack([0, 2]), num_running=2, total_num_scheduled_tokens=2
        )
    )
    assert b.num_rows == 2 and sorted(b.handles[:2].tolist()) == [1, 3]
    for h in (1, 3):
        row = b.states[h].row
        assert b.token_ids_of(h) == [h] and b.block_table[row, 0] == h
    assert b.handles[2:].tolist() == [-1, -1]


def test_step_gap_raises() -> None:
    b = _batch_with_two()
    with pytest.raises(StateMismatchError, match="step gap"):
        b.apply(SchedulerOutput(step_id=2, num_running=2, total_num_scheduled_tokens=2))


@pytest.mark.parametrize(
    "so",
    [
        SchedulerOutput(step_id=1, finished_handles=pack([9]), num_running=2),
        SchedulerOutput(step_id=1, preempted_handles=pack([9]), num_running=2),
        SchedulerOutput(
            step_id=1,
            cached_reqs=CachedRequestData(pack([9]), pack([1]), pack([5])),
            num_running=2,
            total_num_scheduled_tokens=2,
        ),
        SchedulerOutput(
            step_id=1,
            sched_override_handles=pack([9]),
            sched_override_counts=pack([0]),
            num_running=2,
            total_num_scheduled_tokens=2,
        ),
        SchedulerOutput(
            step_id=1,
            resumed_reqs=[
                ResumedRequestData(
                    handle=1, block_ids=pack([1]), num_computed_tokens=0, num_scheduled_tokens=1
                )
            ],
            num_running=2,
            total_num_scheduled_tokens=2,
        ),
    ],
    ids=["finished", "preempted", "cached", "override", "resume-running"],
)
def test_unknown_or_wrong_handle_raises(so: SchedulerOutput) -> None:
    with pytest.raises(StateMismatchError):
        _batch_with_two().apply(so)


def test_wrong_counts_raise() -> None:
    with pytest.raises(StateMismatchError, match="num_running"):
        _batch_with_two().apply(
            SchedulerOutput(step_id=1, num_running=3, total_num_scheduled_tokens=2)
        )
    with pytest.raises(StateMismatchError, match="total_num_scheduled_tokens"):
        _batch_with_two().apply(
            SchedulerOutput(step_id=1, num_running=2, total_num_scheduled_tokens=3)
        )


def test_scheduling_unknown_tokens_raises() -> None:
    b = _batch_with_two()
    b.update_after_step(b.prepare_inputs(), np.array([100, 200], dtype=np.int32))
    b.apply(
        SchedulerOutput(
            step_id=1,
            sched_override_handles=pack([1]),
            sched_override_counts=pack([2]),
            num_running=2,
            total_num_scheduled_tokens=3,
        )
    )
    with pytest.raises(StateMismatchError, match="scheduled up to"):
        b.prepare_inputs()


def test_preempt_keeps_tokens_and_resume_replaces_blocks() -> None:
    b = _batch_with_two()
    inp = b.prepare_inputs()
    b.update_after_step(inp, np.array([100, 200], dtype=np.int32)[: len(inp.sample_rows)])
    b.apply(
        SchedulerOutput(
            step_id=1, preempted_handles=pack([1]), num_running=1, total_num_scheduled_tokens=1
        )
    )
    assert b.states[1].row == -1 and b.token_ids_of(1) == [5, 6, 7, 100]
    b.apply(
        SchedulerOutput(
            step_id=2,
            resumed_reqs=[
                ResumedRequestData(
                    handle=1, block_ids=pack([7, 8]), num_computed_tokens=0, num_scheduled_tokens=4
                )
            ],
            num_running=2,
            total_num_scheduled_tokens=5,
        )
    )
    row = b.states[1].row
    assert b.block_table[row, :3].tolist() == [7, 8, 0] and b.num_computed_tokens[row] == 0
    assert b.token_ids_of(1) == [5, 6, 7, 100]


def test_seeds_follow_their_rows_through_condense() -> None:
    b = InputBatch(4, 32, BS)
    news = [_new(h, [h + 1], 1, [h + 1]) for h in range(4)]
    for h in (0, 2, 3):
        news[h].sampling_params = SamplingParams(seed=100 + h, temperature=1.0)
    b.apply(SchedulerOutput(step_id=0, new_reqs=news, num_running=4, total_num_scheduled_tokens=4))
    inp = b.prepare_inputs()
    b.update_after_step(inp, np.array([9, 9, 9, 9], dtype=np.int32))
    b.apply(
        SchedulerOutput(
            step_id=1, finished_handles=pack([0]), num_running=3, total_num_scheduled_tokens=3
        )
    )
    inp = b.prepare_inputs()
    md = b.sampling_metadata(inp.sample_rows)
    assert b.num_seeded == 2 and int(md.seeded.sum()) == 2
    for i, row in enumerate(inp.sample_rows.tolist()):
        st = b.states[int(b.handles[row])]
        assert bool(md.seeded[i]) == (st.sampling_params.seed is not None) == (st.handle != 1)
        if md.seeded[i]:
            assert md.seeds[i] == st.sampling_params.seed
            assert md.positions[i] == b.num_tokens[row] == 2  # keyed by the token position
