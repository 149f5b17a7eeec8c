"""The worker loop's overlap order gives exactly the tokens of the plain order.

A real Scheduler with async scheduling plans the steps, as the engine core does (step k+1 is
sent before step k's tokens are waited for), and a real ModelRunner (dummy:micro, this process)
runs them: in the plain order (prepare, launch, finish each step) and in the overlap order
(prepare step k+1 while step k is in flight, then finish k, launch k+1). The workload has the
tricky cases between the two: preemption of a request whose token is still in flight, requests
that stop or are aborted while their next token is in flight, resumed and newly arriving
requests, chunked prefill, greedy, seeded and unseeded sampling with logprobs, a second wave
of the same prompts whose prefixes come back from the KV offload host tier, and grammar
constrained requests. Tokens and logprobs must be identical.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest

from engine_core.kv_offload.scheduling import make_offload_manager
from engine_core.request import Request, RequestStatus
from engine_core.sched.scheduler import Scheduler
from protocol.codec import Decoder, Encoder, unpack
from protocol.config import EngineConfig
from protocol.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from protocol.structured import StructuredOutputsParams
from tests.engine_core.fake_worker import make_request
from tests.helpers.runner import BS, make_runner
from workers.runner.model_runner import ModelRunner
from workers.runner.step_flight import InFlightStep

VOCAB = 512  # dummy:micro
EOS = 2
STOPS = list(range(3, VOCAB, 11))  # ~9% of the tokens stop a request that lists them


class RunnerWorker:
    """A rank's loop without sockets: diffs arrive in a queue, outputs are taken in order."""

    def __init__(self, runner: ModelRunner, overlap: bool) -> None:
        self.runner = runner
        self.overlap = overlap
        self.inbox: deque[SchedulerOutput] = deque()
        self.flight: InFlightStep | None = None
        self.outputs: dict[int, ModelRunnerOutput] = {}
        self._enc, self._dec = Encoder(), Decoder(SchedulerOutput)
        # steps prepared while the step before was in flight, and what they changed under it
        self.overlapped = 0
        self.preempted_in_flight = 0
        self.finished_in_flight = 0
        self.resumed_in_flight = 0

    def publish(self, so: SchedulerOutput) -> None:
        self.inbox.append(self._dec.decode(self._enc.encode(so)))

    def _finish(self) -> None:
        assert self.flight is not None
        out = self.runner.finish(self.flight)
        self.outputs[out.step_id] = out
        self.flight = None

    def output(self, step_id: int) -> ModelRunnerOutput:
        """The worker loop's order: a diff that is there while a step is in flight is
        prepared before that step finishes; with none there the step finishes."""
        while step_id not in self.outputs:
            if not self.inbox:
                self._finish()
                continue
            so = self.inbox.popleft()
            step = self.runner.prepare(so)
            if self.flight is not None:
                in_flight = set(self.flight.handles.tolist())
                self.overlapped += 1
                self.preempted_in_flight += len(in_flight & set(unpack(so.preempted_handles)))
                self.finished_in_flight += len(in_flight & set(unpack(so.finished_handles)))
                self.resumed_in_flight += len(so.resumed_reqs)
                self._finish()
            self.flight = self.runner.launch(step)
            if not (self.overlap and self.flight.overlappable):
                self._finish()
        return self.outputs.pop(step_id)


def _params(i: int) -> dict[str, Any]:
    kinds: list[dict[str, Any]] = [
        dict(temperature=0.0),
        dict(temperature=1.0, top_k=40, seed=100 + i, logprobs=True),
        dict(temperature=0.8, top_p=0.9),  # unseeded: the shared stream, same schedule
        dict(temperature=0.0, stop_token_ids=STOPS, logprobs=True),
        dict(temperature=1.0, seed=7 * i, stop_token_ids=STOPS),
    ]
    return kinds[i % len(kinds)]


def _constraint(i: int) -> StructuredOutputsParams | None:
    if i % 3 == 0:
        return StructuredOutputsParams(regex=r"[a-z]{2,6}( [a-z]{1,4}){0,3}")
    if i % 3 == 1:
        return StructuredOutputsParams(choice=["the quick fox", "lazy dog", "hello world"])
    return None


def run(overlap: bool, structured: bool, tok_dir: str | None) -> tuple[dict, RunnerWorker,
                                                                      dict[str, float]]:
    extra = {"tokenizer": tok_dir} if structured else {}
    runner = make_runner(max_model_len=128, kv_offload_memory=1 << 20, **extra)
    # a small KV pool and token budget: preemption and chunked prefill; a host tier behind it
    config = EngineConfig(block_size=BS, max_num_seqs=4, async_scheduling=True,
                          kv_offload_memory=1 << 20, debug_invariants=True)
    offload = make_offload_manager(runner.num_host_blocks, 0, runner.kv_bytes_per_block, 1)
    sched = Scheduler(config, 18, 128, 20, EOS, offload=offload)
    rng = random.Random(5)
    waves: list[list[Request]] = [[], []]
    for i in range(10):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 30))]
        sp = _params(i)
        if structured:
            sp = dict(temperature=sp["temperature"], seed=sp.get("seed"),
                      structured_outputs=_constraint(i))
        max_tokens = rng.randrange(4, 14)
        # the second wave repeats the prompts: their prefixes come back from the host tier
        for w, wave in enumerate(waves):
            wave.append(make_request(f"w{w}r{i}", prompt, max_tokens, eos=EOS, **sp))
    for r in waves[0][:7]:
        sched.add_request(r)
    worker = RunnerWorker(runner, overlap)
    outs: dict[str, tuple[list[int], list[float]]] = {}

    def collect(items: list[EngineCoreOutput]) -> None:
        for o in items:
            toks, lps = outs.setdefault(o.request_id, ([], []))
            toks.extend(o.new_token_ids)
            lps.extend(o.new_logprobs or [])

    in_flight: deque[SchedulerOutput] = deque()
    for k in range(2000):
        if not sched.has_unfinished_requests() and not in_flight:
            if waves[1][0].request_id in outs:
                break
            for r in waves[1]:
                sched.add_request(r)
        if k == 6:  # arrivals while steps are in flight
            for r in waves[0][7:]:
                sched.add_request(r)
        if k == 9:  # an abort while the request's next token is in flight
            sched.finish_requests(["w0r1"], RequestStatus.FINISHED_ABORTED)
        if sched.has_unfinished_requests():
            so = sched.schedule()
            worker.publish(so)
            in_flight.append(so)
            if len(in_flight) < 2 and sched.has_unfinished_requests():
                continue
        so = in_flight.popleft()
        out = worker.output(so.step_id)
        assert not out.failed_handles, out.failed_reasons
        collect(sched.update_from_output(so, out) + sched.take_outputs())
        sched.check_invariants()
    else:
        raise AssertionError("requests did not finish")
    runner.close()
    return outs, worker, sched.get_stats()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.serve.serve_helpers import make_tokenizer_dir

    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("structured", [False, True], ids=["sampling", "structured"])
def test_overlap_order_gives_the_plain_order_tokens(structured: bool, tok_dir: str) -> None:
    if structured:
        pytest.importorskip("xgrammar")
    plain, _, stats = run(False, structured, tok_dir)
    overlapped, worker, _ = run(True, structured, tok_dir)
    assert overlapped == plain
    assert len(plain) == 20 and all(len(t) for t, _ in plain.values())
    assert stats["num_preemptions"] > 0 and stats["kv_offload_bytes_host_to_device"] > 0
    assert worker.overlapped > 10 and worker.finished_in_flight > 0
    if not structured:
        assert worker.preempted_in_flight > 0 and worker.resumed_in_flight > 0
        assert sum(len(lp) for _, lp in plain.values()) > 0  # logprobs compared too
