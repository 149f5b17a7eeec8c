"""The scheduler with images: encoder budget, encoder cache, image-aware prefix hashing.

A fake rank (driven only by the wire diffs) keeps the encoder outputs the steps tell it to
compute and drop, and fails any step that computes a token of an image whose output it does
not hold. Its KV fingerprints and tokens depend on the images, so KV shared across different
images shows up as stale KV, as it would in a real model.
"""

from __future__ import annotations

import hashlib

import pytest

from engine_core.request import Request
from engine_core.sched.scheduler import Scheduler
from protocol.codec import Decoder, Encoder
from protocol.config import EngineConfig
from protocol.messages import (
    EncoderSchedulerOutput,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from protocol.multimodal import MMItem, MMPlaceholder
from protocol.request_options import RequestOptions
from tests.engine_core.fake_worker import (
    FakeWorker,
    run_async_to_completion,
    run_to_completion,
    tokens_of,
)

PAD = 5  # the image placeholder token


class ImageWorker(FakeWorker):
    def __init__(self, block_size: int, capacity: int, budget: int) -> None:
        super().__init__(block_size, roundtrip=False)
        self.capacity = capacity
        self.budget = budget
        self.images: dict[int, list[MMPlaceholder]] = {}  # handle -> placeholders
        self.outputs: dict[str, int] = {}  # mm_hash -> embeddings held
        self.encoded: list[str] = []  # every encoder run, in order
        self._wire = Encoder()
        self._union: Decoder[SchedulerOutput | EncoderSchedulerOutput] = Decoder(
            SchedulerOutput | EncoderSchedulerOutput)

    def _spans(self, handle: int, upto: int) -> tuple:
        return tuple((p.mm_hash, p.offset) for p in self.images.get(handle, ())
                     if p.offset < upto)

    def _fp(self, handle: int, seq: list[int]) -> int:
        return hash((super()._fp(handle, seq), self._spans(handle, len(seq))))

    def _token(self, handle: int, tokens: list[int]) -> int:
        base = super()._token(handle, tokens)
        return 10 + (base + hash(self._spans(handle, len(tokens)))) % 997

    def step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        so = self._union.decode(self._wire.encode(so))
        if isinstance(so, EncoderSchedulerOutput):
            enc = so.encoder
            for h in enc.free_encoder_mm_hashes:
                assert h in self.outputs, f"free of {h}, which this rank does not hold"
                del self.outputs[h]
            for rp in enc.new_placeholders:
                self.images[rp.handle] = rp.placeholders
            spent = 0
            for inp in enc.scheduled_encoder_inputs:
                assert inp.mm_hash not in self.outputs, "encoded twice while cached"
                assert inp.pixels == pixels_of(inp.mm_hash)
                size = next(p.length for ps in self.images.values() for p in ps
                            if p.mm_hash == inp.mm_hash)
                self.outputs[inp.mm_hash] = size
                self.encoded.append(inp.mm_hash)
                spent += size
            assert spent <= self.budget, f"{spent} embeddings encoded, budget {self.budget}"
            assert sum(self.outputs.values()) <= self.capacity
        for h in self._finished(so):
            self.images.pop(h, None)
        out = super().step(so)
        for h, n in self.last_num_scheduled.items():
            st = self.reqs[h]
            start = st.num_computed - n
            for p in self.images.get(h, ()):
                if p.offset < start + n and start < p.offset + p.length:
                    assert p.mm_hash in self.outputs, (
                        f"request {h} computes image {p.mm_hash} at [{start}, {start + n}) "
                        "without its encoder output")
        return out

    @staticmethod
    def _finished(so: SchedulerOutput) -> list[int]:
        from protocol.codec import unpack
        return unpack(so.finished_handles)


def pixels_of(mm_hash: str) -> bytes:
    return mm_hash.encode() * 3


def image(name: str, offset: int, length: int) -> MMItem:
    h = hashlib.sha256(name.encode()).hexdigest()
    return MMItem(MMPlaceholder(h, offset, length, (1, 2, 2 * length)), pixels_of(h))


def request(rid: str, prefix: list[int], images: list[tuple[str, int]], suffix: list[int],
            max_tokens: int = 4) -> Request:
    """prefix, then each image's pad tokens followed by one text token, then suffix."""
    tokens = list(prefix)
    items = []
    for name, length in images:
        items.append(image(name, len(tokens), length))
        tokens += [PAD] * length + [7]
    tokens += suffix
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0), None,
                   0.0, RequestOptions(mm=items))


def scheduler(budget: int = 64, enc_budget: int | None = None, cache: int | None = None,
              num_blocks: int = 64, **cfg: object) -> Scheduler:
    config = EngineConfig(debug_invariants=True, max_num_encoder_input_tokens=enc_budget,
                          encoder_cache_size=cache, **cfg)  # type: ignore[arg-type]
    return Scheduler(config, num_blocks, 512, budget, None, images=True)


def worker(sched: Scheduler) -> ImageWorker:
    enc = sched.encoder
    assert enc is not None
    return ImageWorker(sched.block_size, enc.cache.capacity, enc.budget)


def test_different_images_never_share_kv_and_the_same_image_hits() -> None:
    sched = scheduler()
    w = worker(sched)
    text = list(range(20, 40))
    a = request("a", text, [("cat", 24)], [50, 51])
    b = request("b", text, [("dog", 24)], [50, 51])
    sched.add_request(a)
    outs = run_to_completion(sched, w)
    sched.add_request(b)
    outs |= run_to_completion(sched, w)
    # the text before the image is shared (one full block of 16), nothing after it
    assert b.num_cached_tokens == 16
    assert tokens_of(outs["a"]) != tokens_of(outs["b"])
    again = request("a2", text, [("cat", 24)], [50, 51])
    sched.add_request(again)
    outs |= run_to_completion(sched, w)
    assert again.num_cached_tokens >= 16 * 2  # blocks over the same image hit
    assert tokens_of(outs["a2"]) == tokens_of(outs["a"])


def test_an_image_read_by_eight_requests_is_encoded_once() -> None:
    sched = scheduler(budget=32)
    w = worker(sched)
    for i in range(8):  # different text after the image: no full prefix hit
        sched.add_request(request(f"r{i}", [30 + i, 31], [("same", 20)], [60 + i] * 5))
    outs = run_to_completion(sched, w)
    assert len(outs) == 8 and all(o[-1].finish_reason == "length" for o in outs.values())
    assert len(w.encoded) == 1
    enc = sched.encoder
    assert enc is not None and enc.num_encoder_runs == 1 and enc.cache.hits == 7


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunks_cross_images_under_a_small_budget(async_scheduling: bool) -> None:
    """Chunks of 8 tokens end inside 20-token images; each image is encoded once, and the
    encoder budget (24 embeddings) holds every step."""
    sched = scheduler(budget=8, enc_budget=24, async_scheduling=async_scheduling)
    w = worker(sched)
    reqs = [request(f"r{i}", [40 + i] * 3, [(f"img{i}a", 20), (f"img{i}b", 12)], [9])
            for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run = run_async_to_completion if async_scheduling else run_to_completion
    outs = run(sched, w)
    assert sorted(w.encoded) == sorted({i.placeholder.mm_hash for r in reqs
                                        for i in r.mm_items})
    assert all(o[-1].finish_reason == "length" for o in outs.values())


def test_a_full_encoder_cache_under_kv_pressure_finishes_everyone() -> None:
    """A cache for one image at a time, KV for two requests: preemptions and evictions give
    every reservation back, and nobody waits forever."""
    sched = scheduler(budget=32, cache=24, num_blocks=9)
    w = worker(sched)
    for i in range(6):
        sched.add_request(request(f"r{i}", [70 + i] * 4, [(f"p{i}", 24), (f"q{i % 2}", 20)],
                                  [8], max_tokens=12))
    outs = run_to_completion(sched, w)
    assert len(outs) == 6
    assert all(o[-1].finish_reason == "length" for o in outs.values())
    enc = sched.encoder
    assert enc is not None and enc.cache.evictions > 0
    assert sched.num_preemptions > 0


def test_refusals_name_the_reason() -> None:
    sched = scheduler(enc_budget=16)
    sched.add_request(request("big", [1, 2], [("huge", 40)], [3]))
    (out,) = sched.take_outputs()
    assert out.finish_reason == "error" and "encoder budget" in (out.error or "")
    text_only = Scheduler(EngineConfig(), 64, 512, 64, None)
    text_only.add_request(request("img", [1, 2], [("x", 4)], [3]))
    (out,) = text_only.take_outputs()
    assert "does not accept images" in (out.error or "")


def test_a_text_only_step_is_a_plain_scheduler_output_byte_for_byte() -> None:
    enc = Encoder()
    frames = []
    for images in (False, True):
        sched = Scheduler(EngineConfig(), 64, 512, 64, None, images=images)
        sched.add_request(Request("t", list(range(30)), SamplingParams(max_tokens=2), None, 0.0))
        frames.append([enc.encode(sched.schedule()) for _ in range(1)])
    assert frames[0] == frames[1]
    sched = scheduler()
    sched.add_request(request("i", [1, 2], [("x", 4)], [3]))
    assert isinstance(sched.schedule(), EncoderSchedulerOutput)


def test_the_encoder_budget_holds_in_the_scheduler_trace(tmp_path) -> None:
    import json

    trace = tmp_path / "trace.jsonl"
    sched = scheduler(budget=16, enc_budget=24, scheduler_trace=str(trace))
    w = worker(sched)
    for i in range(4):
        sched.add_request(request(f"r{i}", [40 + i] * 3, [(f"t{i}a", 20), (f"t{i}b", 12)], [9]))
    run_to_completion(sched, w)
    sched.close()
    steps = [r for r in map(json.loads, trace.read_text().splitlines()) if r["type"] == "step"]
    used = [s["encoder"]["embeddings"] for s in steps]
    assert max(used) <= 24 and sum(used) == 4 * 32
    assert all(s["encoder"]["cache_used"] <= s["encoder"]["cache_capacity"] for s in steps)


def test_reading_a_cached_image_keeps_it_out_of_the_room_for_a_new_one() -> None:
    """The cache holds only image A (unreferenced); a chunk that reads A and needs a new image
    B must not count A's space as evictable for B."""
    sched = scheduler(budget=64, cache=24)
    w = worker(sched)
    sched.add_request(request("first", [1, 2], [("A", 20)], [3]))
    run_to_completion(sched, w)
    sched.add_request(request("both", [4, 5], [("A", 20), ("B", 20)], [6]))
    outs = run_to_completion(sched, w)
    assert outs["both"][-1].finish_reason == "length"


def test_a_new_image_before_a_cached_one_never_evicts_the_cached_one() -> None:
    sched = scheduler(budget=64, cache=44)
    w = worker(sched)
    sched.add_request(request("first", [1, 2], [("A", 20)], [3]))
    run_to_completion(sched, w)
    sched.add_request(request("both", [4, 5], [("B", 20), ("A", 20)], [6]))
    outs = run_to_completion(sched, w)
    assert outs["both"][-1].finish_reason == "length"
    assert w.encoded.count(image("A", 0, 20).placeholder.mm_hash) == 1


@pytest.mark.parametrize("seed", range(40))
def test_random_images_budgets_and_pressure_finish_with_a_consistent_cache(seed: int) -> None:
    """Random image pools, encoder budgets, cache sizes, KV pressure and async scheduling:
    every request finishes, the cache account never overflows, and the fake rank never
    computes an image it does not hold."""
    import random

    rng = random.Random(seed)
    sizes = {f"i{k}": rng.choice([4, 8, 12, 20]) for k in range(6)}
    asy = rng.random() < 0.5
    sched = scheduler(budget=rng.choice([8, 16, 32, 64]),
                      cache=max(sizes.values()) + rng.choice([0, 4, 16, 40]),
                      enc_budget=rng.choice([20, 24, 48]), num_blocks=rng.choice([12, 20, 64]),
                      async_scheduling=asy)
    w = worker(sched)
    n = rng.randint(2, 8)
    for r in range(n):
        imgs = [(name, sizes[name]) for name in rng.choices(list(sizes), k=rng.randint(1, 4))]
        sched.add_request(request(f"r{r}", [30 + r] * rng.randint(1, 6), imgs, [9],
                                  max_tokens=rng.randint(1, 6)))
    outs = (run_async_to_completion if asy else run_to_completion)(sched, w)
    assert len(outs) == n
