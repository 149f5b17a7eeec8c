"""Stop rules, outputs, speculative rollback and the size of the wire diff."""

from engine_core.request import RequestStatus
from protocol.codec import Encoder, pack, unpack
from protocol.messages import ModelRunnerOutput
from tests.engine_core.fake_worker import FakeWorker, make_request, make_scheduler, next_token


def one_step(s, w):  # type: ignore[no-untyped-def]
    so = s.schedule()
    return so, s.update_from_output(so, w.step(so))


def test_stop_rules() -> None:
    s = make_scheduler(block_size=4, eos_token_id=None)
    w = FakeWorker(4)
    prompt = [1, 2, 3]
    first = next_token(prompt)
    second = next_token(prompt + [first])
    reqs = [
        make_request("eos", prompt, max_tokens=9, eos=first),
        make_request("ignore", prompt, max_tokens=2, eos=first, ignore_eos=True),
        make_request("stopid", prompt, max_tokens=9, stop_token_ids=[second]),
        make_request("min", prompt, max_tokens=9, eos=first, min_tokens=2, stop_token_ids=[second]),
    ]
    for r in reqs:
        s.add_request(r)
    outs = {}
    for _ in range(4):
        for o in one_step(s, w)[1]:
            outs.setdefault(o.request_id, []).append(o)
    assert [o.finish_reason for o in outs["eos"]] == ["stop"]
    assert [o.finish_reason for o in outs["ignore"]] == [None, "length"]
    assert [o.finish_reason for o in outs["stopid"]] == [None, "stop"]
    # min_tokens=2: EOS as the first output is suppressed; the stop id as the 2nd stops it
    assert [o.finish_reason for o in outs["min"]] == [None, "stop"]
    assert outs["stopid"][-1].new_token_ids == [second]  # the stop token is kept
    assert not s.has_unfinished_requests()


def test_outputs_only_for_requests_with_tokens_and_prefix_hit_reported() -> None:
    s = make_scheduler(block_size=4, max_num_batched_tokens=6)
    w = FakeWorker(4)
    a = make_request("a", list(range(10, 20)), max_tokens=3)
    s.add_request(a)
    _, outs = one_step(s, w)
    assert outs == []  # a partial prefill chunk samples nothing
    _, outs = one_step(s, w)
    assert [o.request_id for o in outs] == ["a"]
    b = make_request("b", list(range(10, 20)), max_tokens=3)
    s.add_request(b)
    so, outs = one_step(s, w)
    assert so.new_reqs[0].num_computed_tokens == 8
    assert [o.num_cached_tokens for o in outs if o.request_id == "b"] == [8]


def test_tokens_of_requests_gone_since_planning_are_skipped() -> None:
    s = make_scheduler(block_size=4)
    w = FakeWorker(4)
    r = make_request("r", [1, 2, 3], max_tokens=5)
    s.add_request(r)
    so = s.schedule()
    mo = w.step(so)
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert s.update_from_output(so, mo) == []
    assert [o.finish_reason for o in s.take_outputs()] == ["abort"]
    s.check_invariants()


def test_speculative_rollback() -> None:
    s = make_scheduler(block_size=4)
    w = FakeWorker(4)
    r = make_request("r", [1, 2, 3], max_tokens=50)
    s.add_request(r)
    one_step(s, w)  # r now has 4 tokens, 3 computed
    r.set_spec_token_ids([7, 8, 9])
    so = s.schedule()
    assert unpack(so.sched_override_counts) == [4]
    assert unpack(so.spec_handles) == [r.handle] and unpack(so.spec_token_ids) == [7, 8, 9]
    assert r.num_computed_tokens == 7
    # one draft accepted plus the bonus token: two drafts were computed on wrong tokens
    mo = ModelRunnerOutput(
        step_id=so.step_id,
        rank=0,
        req_handles=pack([r.handle]),
        num_tokens=pack([2]),
        sampled_token_ids=pack([7, 42]),
    )
    (out,) = s.update_from_output(so, mo)
    assert out.new_token_ids == [7, 42]
    assert r.num_tokens == 6 and r.num_computed_tokens == 5
    assert r.spec_token_ids == [] and r.num_tokens_with_spec == 6
    s.check_invariants()


def test_steady_decode_diff_is_tiny_whatever_the_batch() -> None:
    sizes = []
    for n in (4, 64):
        s = make_scheduler(block_size=16, num_blocks=400, max_num_batched_tokens=512)
        w = FakeWorker(16, roundtrip=False)
        for i in range(n):
            s.add_request(make_request(f"r{i}", [i + 1], max_tokens=100))
        one_step(s, w)  # prefill: one block each
        so, _ = one_step(s, w)  # steady decode: nobody needs a block
        assert so.new_reqs == [] and so.cached_reqs.handles == b""
        assert so.sched_override_handles == b"" and so.num_running == n
        sizes.append(len(Encoder().encode(so)))
    assert sizes[0] == sizes[1] and sizes[0] < 40


def test_refusals_and_duplicate_ids() -> None:
    s = make_scheduler(block_size=4, num_blocks=3)
    s.add_request(make_request("empty", []))
    s.add_request(make_request("huge", list(range(1, 20))))  # 5 blocks > 2 usable
    errs = {o.request_id: o.error for o in s.take_outputs()}
    assert "empty" in errs["empty"] and "KV cache blocks" in errs["huge"]
    assert not s.has_unfinished_requests()


def test_finish_order_does_not_depend_on_the_workers_rows() -> None:
    """Requests finishing in one step are freed in handle order whatever the order of the
    output's rows (a worker's persistent batch reorders them): the free queue's LRU order and
    the adapter slots' follow from the scheduler alone, as a trace replay assumes."""
    states = []
    for reverse in (False, True):
        s = make_scheduler(block_size=4, enable_lora=True, max_loras=2)
        w = FakeWorker(4)
        for i, lora in enumerate((1, 2, 0)):
            s.add_request(make_request(f"r{i}", [10 + i] * 9, max_tokens=2, lora=lora))
        for _ in range(2):
            so = s.schedule()
            mo = w.step(so)
            if reverse:
                mo.req_handles = pack(unpack(mo.req_handles)[::-1])
                mo.sampled_token_ids = pack(unpack(mo.sampled_token_ids)[::-1])
            s.update_from_output(so, mo)
        assert not s.running
        pool = s.kv_cache_manager.block_pool
        states.append(([b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
                       list(s.lora._idle)))  # type: ignore[union-attr]
    assert states[0] == states[1]
