"""A fake worker for scheduler tests, driven only by the wire diffs.

It keeps its own running set, token lists, block tables and a simulated KV cache (each slot
holds a fingerprint of the prefix ending at that position), so a test catches a scheduler
that sends an inconsistent diff or points a request at a block holding someone else's KV.
Tokens are a deterministic function of a request's own tokens (and its LoRA adapter's content
hash), so runs with and without KV pressure must produce the same outputs.

LoRA: it applies the step's slot ops as a rank would, checks that every request it computes has
its adapter in a slot, and makes the KV fingerprints and tokens depend on the adapter's content,
so a block shared across adapters (or with the base model) shows up as stale KV.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine_core.request import Request
from engine_core.sched.scheduler import Scheduler
from protocol.codec import Decoder, Encoder, pack, unpack
from protocol.config import EngineConfig
from protocol.lora import LoRARequest
from protocol.messages import EngineCoreOutput, ModelRunnerOutput, SamplingParams, SchedulerOutput
from protocol.request_options import RequestOptions


def next_token(tokens: list[int]) -> int:
    """Deterministic 'model': depends on the whole context, never returns 0..9."""
    return 10 + (sum(t * (i + 1) for i, t in enumerate(tokens)) * 7919 + len(tokens)) % 997


def lora_token(base: int, content_hash: str) -> int:
    """The 'model' with an adapter: the base token moved by the adapter's content."""
    if not content_hash:
        return base
    return 10 + (base - 10 + 1 + int(content_hash[:6], 16)) % 997


@dataclass
class _State:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int


class FakeWorker:
    def __init__(
        self,
        block_size: int,
        roundtrip: bool = True,
        model: Callable[[list[int]], int] = next_token,
    ) -> None:
        self.block_size = block_size
        self.model = model  # context -> next token (deterministic)
        self.reqs: dict[int, _State] = {}
        self.running: set[int] = set()
        self.kv: dict[tuple[int, int], int] = {}  # (block_id, slot) -> prefix fingerprint
        self.next_step = 0
        self.roundtrip = roundtrip  # encode/decode every diff, as the real wire does
        self._enc = Encoder()
        self._dec: Decoder[SchedulerOutput] = Decoder(SchedulerOutput)
        self.last_num_scheduled: dict[int, int] = {}
        # LoRA, as a rank keeps it: the adapter in each slot (with its content hash), each
        # request's adapter; every slot op seen, in order
        self.slots: dict[int, tuple[int, str]] = {}
        self.adapter_of: dict[int, int] = {}
        self.lora_ops: list = []

    def _slot(self, st: _State, pos: int) -> tuple[int, int]:
        bs = self.block_size
        assert pos // bs < len(st.block_ids), f"position {pos} beyond the block table"
        return st.block_ids[pos // bs], pos % bs

    def _adapter_hash(self, handle: int) -> str:
        """The content hash of the adapter ``handle`` runs with ("" = the base model); its
        adapter must sit in a slot."""
        lid = self.adapter_of.get(handle, 0)
        if not lid:
            return ""
        for slot_lid, content in self.slots.values():
            if slot_lid == lid:
                return content
        raise AssertionError(f"request {handle} runs with adapter {lid}, which is in no slot")

    def _token(self, handle: int, tokens: list[int]) -> int:
        return lora_token(self.model(tokens), self._adapter_hash(handle))

    def _fp(self, handle: int, seq: list[int]) -> int:
        return hash((self._adapter_hash(handle), tuple(seq)))

    def _check_prefix(self, handle: int, st: _State, upto: int) -> None:
        for p in range(upto):
            fp = self._fp(handle, st.tokens[: p + 1])
            assert self.kv.get(self._slot(st, p)) == fp, f"stale KV at position {p}"

    def _apply_lora(self, so: SchedulerOutput) -> None:
        lora = so.lora
        if lora is None:
            return
        assert lora.ops or lora.handles, "an empty LoRAStep must be None"
        for op in lora.ops:
            self.lora_ops.append(op)
            if op.lora_int_id:
                self.slots[op.slot] = (op.lora_int_id, op.content_hash)
            else:
                self.slots.pop(op.slot, None)
        new = {nr.handle for nr in so.new_reqs}
        for h, lid in zip(unpack(lora.handles), unpack(lora.lora_int_ids), strict=True):
            assert h in new, f"adapter id for handle {h}, which is not new in this step"
            assert lid >= 1
            self.adapter_of[h] = lid

    def step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.roundtrip:
            so = self._dec.decode(self._enc.encode(so))
        assert so.step_id == self.next_step, f"step gap: {so.step_id} != {self.next_step}"
        self.next_step += 1
        for h in unpack(so.finished_handles):
            assert h in self.reqs, f"finished unknown handle {h}"
            del self.reqs[h]
            self.adapter_of.pop(h, None)
            self.running.discard(h)
        for h in unpack(so.preempted_handles):
            assert h in self.running, f"preempted handle {h} is not running"
            self.running.remove(h)
            self.reqs[h].block_ids = []
        self._apply_lora(so)
        sched: dict[int, int] = {h: 1 for h in self.running}
        # prefix-cache hits, checked once this step's KV is written
        to_check: list[tuple[int, _State]] = []
        for nr in so.new_reqs:
            assert nr.handle not in self.reqs, f"new handle {nr.handle} already known"
            st = _State(unpack(nr.prompt_token_ids), unpack(nr.block_ids), nr.num_computed_tokens)
            self.reqs[nr.handle] = st
            to_check.append((nr.handle, st))
            self.running.add(nr.handle)
            sched[nr.handle] = nr.num_scheduled_tokens
        for rr in so.resumed_reqs:
            assert rr.handle in self.reqs and rr.handle not in self.running
            st = self.reqs[rr.handle]
            st.block_ids = unpack(rr.block_ids)
            st.num_computed = rr.num_computed_tokens
            to_check.append((rr.handle, st))
            self.running.add(rr.handle)
            sched[rr.handle] = rr.num_scheduled_tokens
        cr = so.cached_reqs
        flat = unpack(cr.new_block_ids)
        pos = 0
        for h, c in zip(unpack(cr.handles), unpack(cr.new_block_counts), strict=True):
            assert h in self.running
            self.reqs[h].block_ids.extend(flat[pos : pos + c])
            pos += c
        assert pos == len(flat)
        for h, c in zip(
            unpack(so.sched_override_handles), unpack(so.sched_override_counts), strict=True
        ):
            assert h in self.running
            sched[h] = c
        assert len(self.running) == so.num_running, (len(self.running), so.num_running)
        assert sum(sched.values()) == so.total_num_scheduled_tokens
        self.last_num_scheduled = {h: n for h, n in sched.items() if n}
        drafts: dict[int, list[int]] = {}
        flat = unpack(so.spec_token_ids)
        pos = 0
        for h, c in zip(unpack(so.spec_handles), unpack(so.spec_token_counts), strict=True):
            assert h in self.running and h not in drafts and c >= 1
            drafts[h] = flat[pos : pos + c]
            pos += c
        assert pos == len(flat)
        # like paged attention: every token's KV is written before anyone reads (a request
        # may hit blocks another request fills in this same step); drafts get KV too
        for h, n in sched.items():
            st = self.reqs[h]
            seq = st.tokens + drafts.get(h, [])
            if h in drafts:
                assert st.num_computed + n == len(seq), "drafts must end the scheduled range"
            assert st.num_computed + n <= len(seq), "scheduled past the known tokens"
            for p in range(st.num_computed, st.num_computed + n):
                self.kv[self._slot(st, p)] = self._fp(h, seq[: p + 1])
        for h, st in to_check:
            self._check_prefix(h, st, st.num_computed)
        handles, toks, counts = [], [], []
        for h, n in sched.items():
            if n == 0:
                continue
            st = self.reqs[h]
            st.num_computed += n
            d = drafts.get(h, [])
            if st.num_computed == len(st.tokens) + len(d):
                # greedy verification: drafts count while they equal the model's own token
                accepted = 0
                while accepted < len(d) and d[accepted] == self._token(h, st.tokens + d[:accepted]):
                    accepted += 1
                new = d[:accepted] + [self._token(h, st.tokens + d[:accepted])]
                st.num_computed -= len(d) - accepted  # rejected drafts' KV is recomputed
                st.tokens.extend(new)
                handles.append(h)
                toks.extend(new)
                counts.append(len(new))
        return ModelRunnerOutput(
            step_id=so.step_id,
            rank=0,
            req_handles=pack(handles),
            num_tokens=pack(counts) if any(c != 1 for c in counts) else b"",
            sampled_token_ids=pack(toks),
        )


def make_scheduler(
    num_blocks: int = 64,
    max_model_len: int = 256,
    max_num_batched_tokens: int = 64,
    eos_token_id: int | None = None,
    **cfg: object,
) -> Scheduler:
    config = EngineConfig(debug_invariants=True, **cfg)  # type: ignore[arg-type]
    return Scheduler(config, num_blocks, max_model_len, max_num_batched_tokens, eos_token_id)


def make_request(
    rid: str,
    prompt: list[int],
    max_tokens: int = 8,
    priority: int = 0,
    arrival: float = 0.0,
    eos: int | None = None,
    lora: int = 0,
    lora_hash: str = "",
    **sp: object,
) -> Request:
    """``lora`` >= 1: run with adapter ``a<lora>`` (content hash ``lora_hash``, default one
    derived from the id), as the engine core's adapter registry hands it to the scheduler."""
    req = Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, **sp),  # type: ignore[arg-type]
        eos,
        arrival,
        RequestOptions(
            priority=priority,
            lora=LoRARequest(f"a{lora}", lora, f"/adapters/a{lora}") if lora else None),
    )
    if lora:
        req.lora_hash = lora_hash or f"{lora * 7919:06x}"
    return req


def run_to_completion(
    sched: Scheduler, worker: FakeWorker, max_steps: int = 10_000
) -> dict[str, list[EngineCoreOutput]]:
    """Step until nothing is left; returns every output per request id."""
    outs: dict[str, list[EngineCoreOutput]] = {}
    for o in sched.take_outputs():
        outs.setdefault(o.request_id, []).append(o)
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        so = sched.schedule()
        for o in sched.update_from_output(so, worker.step(so)) + sched.take_outputs():
            outs.setdefault(o.request_id, []).append(o)
        sched.check_invariants()
    raise AssertionError("requests did not finish")


def run_async_to_completion(
    sched: Scheduler,
    worker: FakeWorker,
    max_steps: int = 10_000,
    on_step: Callable[[int, Scheduler], None] | None = None,
) -> dict[str, list[EngineCoreOutput]]:
    """Like run_to_completion, with the async engine core's order: step k+1 is scheduled
    (and executed by the worker, which runs steps in order) before step k's tokens reach the
    scheduler. on_step(k, sched) runs after step k is scheduled, e.g. to abort or add."""
    outs: dict[str, list[EngineCoreOutput]] = {}

    def collect(items: list[EngineCoreOutput]) -> None:
        for o in items:
            outs.setdefault(o.request_id, []).append(o)

    collect(sched.take_outputs())
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    for k in range(max_steps):
        if not sched.has_unfinished_requests() and not in_flight:
            return outs
        if sched.has_unfinished_requests():
            so = sched.schedule()
            in_flight.append((so, worker.step(so)))
            if on_step is not None:
                on_step(k, sched)
                collect(sched.take_outputs())
            if len(in_flight) < 2 and sched.has_unfinished_requests():
                continue
        so, out = in_flight.popleft()
        collect(sched.update_from_output(so, out) + sched.take_outputs())
        sched.check_invariants()
        for r in sched.running:
            assert r.num_output_placeholders >= 0 and r.num_computed_tokens >= 0, r
    raise AssertionError("requests did not finish")


def tokens_of(outs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]
