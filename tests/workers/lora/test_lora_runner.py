"""LoRA at the runner level against peft: greedy tokens of three PEFT adapters (ranks 8/16/32,
rsLoRA, q/v only, rank and alpha patterns) and the base model, all mixed in one batch, equal
`PeftModel` generate (unmerged, float32), at TP=1 and TP=2 (padded heads), also after slot
swaps and host-cache evictions."""

from __future__ import annotations

import json
import os

import pytest
import torch

from protocol.codec import pack, unpack
from protocol.lora import LoRARequest, LoRASlotOp, LoRAStep
from protocol.messages import NewRequestData, ResumedRequestData, SamplingParams
from protocol.messages import SchedulerOutput as SO
from tests.helpers.lora import LoRADriver, lora_config, run_spec, slot_op
from tests.helpers.multiproc import run_ranks
from tests.helpers.runner import make_runner
from workers.parallel.distributed import DistEnv
from workers.runner.input_batch import StateMismatchError
from workers.runner.model_runner import ModelRunner

pytest.importorskip("peft")

MAX_NEW = 8
PROMPTS = [[(7 * i + 3 * j + 1) % 256 for j in range(5 + 2 * i)] for i in range(8)]
WAVE1 = dict(prompts=PROMPTS, loras=[0, 1, 2, 3, 1, 2, 3, 0], ops=[[0, 1], [1, 2], [2, 3]])
# two waves: slot 0 goes from adapter 1 to adapter 3 between them (after WAVE1 in the same
# runner, adapter 3 moves there from slot 2)
SWAPS = [
    dict(prompts=PROMPTS[:4], loras=[1, 2, 0, 2], ops=[[0, 1], [1, 2]]),
    dict(prompts=PROMPTS[4:], loras=[3, 2, 3, 0], ops=[[0, 3]]),
]


def _expected(world, wave: dict) -> list[list[int]]:
    return world.expected(wave["prompts"], wave["loras"], MAX_NEW)


def _runner(base: str, **kw: object) -> ModelRunner:
    r = ModelRunner(lora_config(base, **kw), DistEnv(0, 1, 0, torch.device("cpu"), "gloo"))
    r.load_model()
    r.init_kv_cache()
    return r


def test_mixed_batch_equals_peft(lora_world):
    w = lora_world
    runner = _runner(w.base)
    (got,) = run_spec(runner, dict(adapters=w.adapters, waves=[WAVE1], max_new=MAX_NEW,
                                   prepare=[1, 2, 3]))
    assert got == _expected(w, WAVE1)
    # the slot buffers: 3 slots x rank 32 of every projection, reported by the KV sizing
    plan = runner.plan_kv_cache()
    assert plan.lora_bytes == runner.lora.nbytes > 3 * 32 * 4 * (96 + 129) * 7
    assert "LoRA slots" in plan.log_line(0, "cpu")


def test_swaps_and_host_cache_evictions_equal_peft(lora_world):
    """Two slots for three adapters, two host copies (adapter 1 is re-read for its slot op,
    its hash checked): slot 0 changes hands between the waves."""
    w = lora_world
    waves = run_spec(_runner(w.base, max_loras=2, max_cpu_loras=2),
                     dict(adapters=w.adapters, waves=SWAPS, max_new=MAX_NEW, prepare=[1, 2, 3]))
    assert waves == [_expected(w, wave) for wave in SWAPS]


def test_long_prefills_equal_peft(lora_world):
    """Prompts of 40+ tokens: their prefill takes the in-place path of consecutive groups."""
    w = lora_world
    prompts = [[(3 * j + 7 * i) % 251 + 1 for j in range(40 + 3 * i)] for i in range(3)]
    wave = dict(prompts=prompts, loras=[2, 0, 3], ops=[[0, 2], [1, 3]])
    (got,) = run_spec(_runner(w.base), dict(adapters=w.adapters, waves=[wave], max_new=4))
    assert got == w.expected(prompts, wave["loras"], 4)


@pytest.mark.slow
def test_tp2_equals_peft(lora_world, tmp_path):
    w = lora_world
    out = str(tmp_path / "out")
    spec = dict(base=w.base, adapters=w.adapters, waves=[WAVE1] + SWAPS, max_new=MAX_NEW,
                prepare=[1, 2, 3], out=out)
    path = str(tmp_path / "spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run_ranks(os.path.join(here, "helpers", "lora_tp_run.py"), [path], 2, timeout_s=240)
    want = [_expected(w, wave) for wave in [WAVE1] + SWAPS]
    for rank in range(2):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            assert json.load(f) == want


def test_changed_files_fail_only_that_adapters_requests(lora_world):
    """A slot op whose adapter is no longer in host memory and whose files no longer match the
    registered hash: its requests fail (failed_handles), the others run on."""
    w = lora_world
    runner = _runner(w.base, max_loras=1, max_cpu_loras=1)
    bad = LoRASlotOp(slot=0, lora_int_id=2, lora_name="a2", lora_path=w.adapters[1],
                     content_hash="0" * 64)
    driver = LoRADriver(runner)
    so_out = []
    orig = runner.execute

    def spy(so):
        out = orig(so)
        so_out.append(out)
        return out

    runner.execute = spy  # type: ignore[method-assign]
    got = driver.wave(PROMPTS[:2], [2, 0], [bad], MAX_NEW)
    assert unpack(so_out[0].failed_handles) == [0]
    assert "changed on disk" in so_out[0].failed_reasons[0]
    assert got[1] == w.expected(PROMPTS[1:2], [0], MAX_NEW)[0]


def test_replacing_a_running_requests_adapter_is_a_state_mismatch(lora_world):
    w = lora_world
    driver = LoRADriver(_runner(w.base))
    driver.wave(PROMPTS[:1], [1], [slot_op(0, 1, w.adapters[0])], 1)
    # the request still runs (not finished) when its slot gets another adapter
    so = SO(step_id=driver.step_id, num_running=1, total_num_scheduled_tokens=1,
                         lora=LoRAStep(ops=[slot_op(0, 2, w.adapters[1])]))
    with pytest.raises(StateMismatchError, match="slot 0"):
        driver.runner.execute(so)


def test_refused_adapters_are_answers_not_crashes(lora_world, tmp_path):

    w = lora_world
    runner = _runner(w.base, max_lora_rank=16)
    err = runner.prepare_lora(LoRARequest("big", 3, w.adapters[2]), "")
    assert "rank 32" in err and "max_lora_rank 16" in err and "'big'" in err
    err = runner.prepare_lora(LoRARequest("gone", 4, str(tmp_path / "nowhere")), "")
    assert "not a directory" in err
    assert runner.prepare_lora(LoRARequest("ok", 1, w.adapters[0]), "") == ""
    # max_lora_rank None: the largest rank among the start-up adapters (32), else 16
    assert _runner(w.base, max_lora_rank=None, lora_modules=[
        LoRARequest("a", 1, w.adapters[0]), LoRARequest("c", 3, w.adapters[2]),
        LoRARequest("gone", 4, str(tmp_path / "nowhere"))]).lora.rank == 32
    assert _runner(w.base, max_lora_rank=None).lora.rank == 16
    other = make_runner()  # LoRA not enabled
    assert "LoRA is not enabled" in other.prepare_lora(LoRARequest("ok", 1, w.adapters[0]), "")


def test_resumed_request_finds_its_adapter_in_a_new_slot(lora_world):
    """Preempted, its slot given to another adapter, resumed with its adapter in another slot:
    the row looks its slot up again, and the tokens still equal peft's."""
    w = lora_world
    runner = _runner(w.base)
    p0, p1 = PROMPTS[3], PROMPTS[5]
    sp = SamplingParams(temperature=0.0)
    out: dict[int, list[int]] = {0: [], 1: []}

    def run(so: SO) -> None:
        res = runner.execute(so)
        for h, t in zip(unpack(res.req_handles), unpack(res.sampled_token_ids), strict=True):
            out[h].append(t)

    def new(h: int, p: list[int], blocks: range) -> NewRequestData:
        return NewRequestData(handle=h, prompt_token_ids=pack(p), sampling_params=sp,
                              block_ids=pack(list(blocks)), num_computed_tokens=0,
                              num_scheduled_tokens=len(p))

    run(SO(step_id=0, new_reqs=[new(0, p0, range(1, 11)), new(1, p1, range(11, 21))],
           num_running=2, total_num_scheduled_tokens=len(p0) + len(p1),
           lora=LoRAStep(ops=[slot_op(0, 1, w.adapters[0]), slot_op(1, 2, w.adapters[1])],
                         handles=pack([0, 1]), lora_int_ids=pack([1, 2]))))
    run(SO(step_id=1, num_running=2, total_num_scheduled_tokens=2))
    run(SO(step_id=2, preempted_handles=pack([0]), num_running=1, total_num_scheduled_tokens=1,
           lora=LoRAStep(ops=[slot_op(0, 3, w.adapters[2])])))
    n0 = len(p0) + len(out[0])
    run(SO(step_id=3, resumed_reqs=[ResumedRequestData(handle=0, block_ids=pack(range(21, 31)),
                                                       num_computed_tokens=0,
                                                       num_scheduled_tokens=n0)],
           num_running=2, total_num_scheduled_tokens=n0 + 1,
           lora=LoRAStep(ops=[slot_op(2, 1, w.adapters[0])])))
    assert runner.input_batch.lora_slot[runner.input_batch.states[0].row] == 2
    for step in range(4, 4 + MAX_NEW):
        run(SO(step_id=step, num_running=2, total_num_scheduled_tokens=2))
    want = w.expected([p0, p1], [1, 2], MAX_NEW)
    assert [out[0][:MAX_NEW], out[1][:MAX_NEW]] == want
