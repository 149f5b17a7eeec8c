"""Async scheduling and n-gram speculative decoding give exactly the synchronous,
non-speculative outputs, with chunked prefill, prefix hits, preemption, early stops and aborts
in play, and leave the block pool clean.

The FakeWorker is driven only by the wire diffs and checks that no request ever reads KV it
did not write (so drafts in the prefix cache, or a block freed too early, would fail here).
"""

from __future__ import annotations

import random

import pytest

from engine_core.request import RequestStatus
from engine_core.sched import update
from engine_core.sched.scheduler import Scheduler
from engine_core.spec_decode.ngram_proposer import NgramIndex, NgramProposer
from protocol.config import EngineConfig, config_error
from protocol.messages import EngineCoreOutput
from tests.engine_core.fake_worker import (
    FakeWorker,
    make_request,
    make_scheduler,
    next_token,
    run_async_to_completion,
    run_to_completion,
    tokens_of,
)

BLOCK = 4
STOP_IDS = list(range(10, 120))  # ~11% of the fake model's tokens: some requests stop early


def repetitive_model(tokens: list[int]) -> int:
    """Mostly repeats the token 5 back (n-gram drafts often right), sometimes breaks the
    pattern (drafts get rejected)."""
    if len(tokens) < 5 or sum(tokens[-3:]) % 5 == 0:
        return next_token(tokens)
    return tokens[-5]


def workload(seed: int, n: int = 14) -> list[tuple[str, list[int], int, bool]]:
    """(id, prompt, max_tokens, stops early?) with shared prefixes for prefix-cache hits."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 900) for _ in range(3 * BLOCK)]
    reqs = []
    for i in range(n):
        own = [rng.randrange(100, 900) for _ in range(rng.randrange(1, 30))]
        prompt = (shared + own) if i % 2 else own
        reqs.append((f"r{i}", prompt, rng.randrange(1, 30), i % 3 == 0))
    return reqs


def run(
    seed: int,
    model=next_token,  # type: ignore[no-untyped-def]
    async_mode: bool = False,
    num_blocks: int = 40,
    budget: int = 24,
    on_step=None,  # type: ignore[no-untyped-def]
    **cfg: object,
) -> tuple[dict[str, list[EngineCoreOutput]], Scheduler]:
    sched = make_scheduler(
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        block_size=BLOCK,
        async_scheduling=async_mode,
        **cfg,
    )
    for rid, prompt, max_tokens, stops in workload(seed):
        stop = STOP_IDS if stops else []
        sched.add_request(make_request(rid, prompt, max_tokens, stop_token_ids=stop))
    worker = FakeWorker(BLOCK, model=model)
    if async_mode:
        outs = run_async_to_completion(sched, worker, on_step=on_step)
    else:
        assert on_step is None
        outs = run_to_completion(sched, worker)
    assert_clean(sched, num_blocks)
    return outs, sched


def assert_clean(sched: Scheduler, num_blocks: int) -> None:
    kvm = sched.kv_cache_manager
    assert not sched.requests and not sched.running and not sched.waiting
    assert not kvm.req_to_blocks, "blocks still held by finished requests"
    assert kvm.num_free_blocks == num_blocks - 1  # everything but the null block
    sched.check_invariants()


def summary(outs: dict[str, list[EngineCoreOutput]]) -> dict[str, tuple[list[int], str | None]]:
    return {rid: (tokens_of(o), o[-1].finish_reason) for rid, o in outs.items()}


# ---------------------------------------------------------------------------- async scheduling


@pytest.mark.parametrize("seed", range(6))
def test_async_equals_sync(seed: int) -> None:
    ref, ref_sched = run(seed)
    got, sched = run(seed, async_mode=True)
    assert summary(got) == summary(ref)
    assert any(reason == "stop" for _, reason in summary(ref).values())
    stats = sched.get_stats()
    assert stats["num_preemptions"] > 0, "the workload must preempt"
    assert stats["prefix_cache_hits"] > 0, "the workload must hit the prefix cache"


def test_async_without_pressure_is_fewer_steps_per_token() -> None:
    """Sanity of the overlap: with room for everyone, async needs no extra steps beyond the
    one it plans speculatively at the end (the placeholder step that gets discarded)."""
    ref, ref_sched = run(1, num_blocks=400, budget=2048)
    got, sched = run(1, async_mode=True, num_blocks=400, budget=2048)
    assert summary(got) == summary(ref)
    assert sched.num_steps <= ref_sched.num_steps + 1


def test_async_abort_in_flight_and_resubmit_same_id() -> None:
    """Aborting while steps are in flight, and resubmitting the same id at once: the old
    handle's late tokens are dropped, the new request runs from scratch, counts stay >= 0."""
    ref, _ = run(2, num_blocks=400)
    prompts = {rid: prompt for rid, prompt, _, _ in workload(2)}
    max_tokens = {rid: m for rid, _, m, _ in workload(2)}

    def on_step(k: int, sched: Scheduler) -> None:
        if k == 3:  # r1 has been prefilled and is decoding with a step in flight
            sched.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
            sched.add_request(make_request("r1", prompts["r1"], max_tokens["r1"]))
        if k == 5:
            sched.finish_requests(["r4", "r5"], RequestStatus.FINISHED_ABORTED)

    got, _ = run(2, async_mode=True, num_blocks=400, on_step=on_step)
    r1 = got["r1"]
    cut = next(i for i, o in enumerate(r1) if o.finish_reason == "abort")
    assert tokens_of(r1[cut + 1 :]) == tokens_of(ref["r1"])
    assert r1[-1].finish_reason == ref["r1"][-1].finish_reason
    for rid in ("r4", "r5"):
        toks = tokens_of(got[rid])
        assert got[rid][-1].finish_reason == "abort"
        assert toks == tokens_of(ref[rid])[: len(toks)]  # a prefix of the full output
    for rid in set(ref) - {"r1", "r4", "r5"}:
        assert summary(got)[rid] == summary(ref)[rid]


def test_async_stop_found_one_step_late_frees_everything() -> None:
    """Every request stops on its first sampled token, which the scheduler learns after it
    already planned (and the worker ran) one more step for it: that token is discarded."""
    sched = make_scheduler(num_blocks=40, block_size=BLOCK, async_scheduling=True)
    worker = FakeWorker(BLOCK)
    prompts = [[100 + i, 200 + i, 300 + i] for i in range(5)]
    for i, p in enumerate(prompts):
        first = next_token(p)
        sched.add_request(make_request(f"s{i}", p, 10, stop_token_ids=[first]))
    outs = run_async_to_completion(sched, worker)
    for i, p in enumerate(prompts):
        assert tokens_of(outs[f"s{i}"]) == [next_token(p)]
        assert outs[f"s{i}"][-1].finish_reason == "stop"
    assert_clean(sched, 40)


# ---------------------------------------------------------------------------- speculation


def spec_cfg(n: int = 3, k: int = 4) -> dict[str, object]:
    return {"speculative_ngram": n, "num_speculative_tokens": k}


@pytest.mark.parametrize("seed", range(6))
def test_spec_equals_non_spec(seed: int) -> None:
    ref, _ = run(seed, model=repetitive_model, num_blocks=30)
    got, sched = run(seed, model=repetitive_model, num_blocks=30, **spec_cfg())
    assert summary(got) == summary(ref)
    stats = sched.get_stats()
    assert stats["spec_num_accepted_tokens"] > 0
    assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], "no rejections"
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0


def test_spec_saves_steps_on_repetitive_text() -> None:
    ref, ref_sched = run(0, model=repetitive_model, num_blocks=400, budget=2048)
    got, sched = run(0, model=repetitive_model, num_blocks=400, budget=2048, **spec_cfg(3, 5))
    assert summary(got) == summary(ref)
    assert sched.num_steps < ref_sched.num_steps
    stats = sched.get_stats()
    assert 0 < stats["spec_acceptance_rate"] <= 1
    assert stats["spec_mean_accepted_len"] > 1


def test_spec_never_exceeds_max_tokens_or_model_len() -> None:
    sched = make_scheduler(num_blocks=100, block_size=BLOCK, max_model_len=24, **spec_cfg(2, 8))
    worker = FakeWorker(BLOCK, model=lambda toks: toks[-2])  # period 2: drafts always right
    sched.add_request(make_request("a", [101, 202, 101, 202], max_tokens=7))
    sched.add_request(make_request("b", [303, 404] * 3, max_tokens=100))  # capped by 24
    outs = run_to_completion(sched, worker)
    assert tokens_of(outs["a"]) == [101, 202] * 3 + [101]
    assert len(tokens_of(outs["b"])) == 24 - 6
    assert outs["b"][-1].finish_reason == "length"
    assert_clean(sched, 100)


def test_spec_aborts_and_early_stops() -> None:
    ref, _ = run(3, model=repetitive_model, num_blocks=400)
    sched = make_scheduler(
        num_blocks=400, block_size=BLOCK, max_num_batched_tokens=24, **spec_cfg()
    )
    for rid, prompt, max_tokens, stops in workload(3):
        stop = STOP_IDS if stops else []
        sched.add_request(make_request(rid, prompt, max_tokens, stop_token_ids=stop))
    worker = FakeWorker(BLOCK, model=repetitive_model)
    outs: dict[str, list[EngineCoreOutput]] = {}
    for k in range(1000):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        for o in sched.update_from_output(so, worker.step(so)) + sched.take_outputs():
            outs.setdefault(o.request_id, []).append(o)
        if k == 4:
            sched.finish_requests(["r2", "r7"], RequestStatus.FINISHED_ABORTED)
            for o in sched.take_outputs():
                outs.setdefault(o.request_id, []).append(o)
        sched.check_invariants()
    assert_clean(sched, 400)
    for rid in ref:
        toks = tokens_of(outs[rid])
        if rid in ("r2", "r7") and outs[rid][-1].finish_reason == "abort":
            assert toks == tokens_of(ref[rid])[: len(toks)]
        else:
            assert summary(outs)[rid] == summary(ref)[rid]


# ---------------------------------------------------------------------------- the proposer


def test_ngram_index_finds_latest_earlier_match() -> None:
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    idx = NgramIndex(3)
    idx.extend(toks)
    # "1 2 3" last occurred (before the suffix) ending at index 6, followed by 7 5 1
    assert idx.lookup(toks, 1, 3) == [7, 5, 1]
    assert idx.lookup(toks, 1, 10) == [7, 5, 1, 2, 3]  # never past the known tokens
    assert idx.lookup([4, 5, 6], 1, 3) == []  # no earlier occurrence
    # incremental: extending later equals indexing at once
    inc = NgramIndex(3)
    inc.extend(toks[:5])
    inc.extend(toks)
    assert inc.ends == idx.ends


def test_ngram_min_n_and_limits() -> None:
    p = NgramProposer(max_n=3, num_speculative_tokens=2, min_n=2)
    req = make_request("x", [5, 6, 8, 1, 6], max_tokens=4)
    assert p.propose(req, 10) == []  # only "6" (n=1) matches; min_n=2 refuses it
    req = make_request("y", [5, 6, 8, 1, 5, 6], max_tokens=4)
    assert p.propose(req, 10) == [8, 1]
    assert p.propose(req, 1) == [8]
    assert p.propose(req, 0) == []


def test_config_errors() -> None:
    assert config_error(EngineConfig()) is None
    assert config_error(EngineConfig(**spec_cfg())) is None  # type: ignore[arg-type]
    assert "num_speculative_tokens" in (config_error(EngineConfig(speculative_ngram=3)) or "")
    assert "speculative_ngram" in (config_error(EngineConfig(num_speculative_tokens=3)) or "")
    both = EngineConfig(async_scheduling=True, **spec_cfg())  # type: ignore[arg-type]
    assert "cannot be combined" in (config_error(both) or "")
    bad_min = EngineConfig(speculative_ngram_min=4, **spec_cfg(3, 2))  # type: ignore[arg-type]
    assert "speculative_ngram_min" in (config_error(bad_min) or "")


@pytest.mark.parametrize("seed", [3, 6])
def test_async_preempted_request_stops_on_its_in_flight_token(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request preempted while its step was in flight takes that step's token; when the
    token is a stop token it finishes from the waiting queue, exactly as in sync mode."""
    finished_while_preempted = []
    original = update._update_preempted

    def spy(s, req, new, outputs, lps=None) -> None:  # type: ignore[no-untyped-def]
        original(s, req, new, outputs, lps)
        if req.is_finished:
            finished_while_preempted.append(req.request_id)

    monkeypatch.setattr(update, "_update_preempted", spy)
    monkeypatch.setattr(f"{__name__}.STOP_IDS", list(range(10, 400)))  # stops are common
    ref, _ = run(seed, num_blocks=20)
    got, _ = run(seed, async_mode=True, num_blocks=20)
    assert summary(got) == summary(ref)
    assert finished_while_preempted, "the workload must stop a request while it is preempted"
