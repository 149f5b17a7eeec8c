"""Encoder inputs in the token budget's passes (vLLM's _try_schedule_encoder_inputs).

An image's encoder runs in the step whose scheduled tokens first overlap its placeholder span,
unless its output is cached already (then the request only references it). Each step may
encode at most ``budget`` embeddings; an image that does not fit the step's budget or the
cache cuts the request's tokens to end right before the image's span (or to none when the
chunk starts inside it), and the image waits for a later step. An image encoded once is read
by every chunk that crosses its span: the request references the cached output until its
computed tokens pass the span (released after the step's results, never while a step in
flight may still read it).

The passes call ``plan`` (no side effects) before allocating KV and ``commit`` once the
allocation succeeded, so a request that is preempted instead schedules nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_core.multimodal.encoder_cache import EncoderCacheManager
from engine_core.request import Request
from protocol.multimodal import EncoderInput, EncoderStep, RequestPlaceholders

if TYPE_CHECKING:
    from engine_core.sched.step_diff import StepDiff

_NONE: list[int] = []  # never mutated: "no image in this chunk"


class EncoderScheduling:
    """The encoder budget and cache decisions of one scheduler (images on)."""

    encodes = True

    def __init__(self, cache: EncoderCacheManager, budget: int) -> None:
        self.cache = cache
        self.budget = budget
        self.left = budget  # of this step's budget
        self.scheduled: dict[str, EncoderInput] = {}  # this step's encoder runs, by mm_hash
        # request id -> indices of the images it references (in mm_items)
        self.reading: dict[str, list[int]] = {}
        self.num_encoder_runs = 0
        self.num_encoded_embeddings = 0
        self.encoder_seconds = 0.0  # rank 0's time in the encoder
        self.encoder_input_bytes = 0  # pixel bytes sent to the ranks in the step diffs

    def refuse(self, req: Request) -> str | None:
        """An image that could never be scheduled would stall its request forever."""
        for item in req.mm_items:
            ph = item.placeholder
            if ph.offset < 0 or ph.length < 1 or ph.offset + ph.length > req.num_prompt_tokens:
                return (f"image placeholder [{ph.offset}, {ph.offset + ph.length}) lies outside "
                        f"the {req.num_prompt_tokens}-token prompt")
            if ph.length > min(self.budget, self.cache.capacity):
                return (f"an image of {ph.length} embeddings exceeds the encoder budget "
                        f"({self.budget}) or the encoder cache ({self.cache.capacity}); raise "
                        "--max-num-encoder-input-tokens / --encoder-cache-size or send a "
                        "smaller image")
        ends = [i.placeholder.offset for i in req.mm_items[1:]]
        if any(a.placeholder.offset + a.placeholder.length > b
               for a, b in zip(req.mm_items, ends, strict=False)):
            return "image placeholders overlap or are out of prompt order"
        return None

    def begin_step(self) -> None:
        self.left = self.budget
        self.scheduled = {}

    def plan(self, req: Request, computed: int, n: int) -> tuple[int, list[int]]:
        """Tokens [computed, computed + n) as far as their images can be encoded or read
        this step, and the images the chunk needs."""
        cache = self.cache
        left = self.left
        room = 0  # embeddings this plan adds to the cache or keeps from eviction
        needed: list[int] = _NONE
        planned: set[str] = set()
        end = computed + n
        for i, item in enumerate(req.mm_items):
            ph = item.placeholder
            if ph.offset >= end:
                break
            if ph.offset + ph.length <= computed:
                continue  # its span is computed (in KV, or a prefix hit)
            if needed is _NONE:
                needed = []
            h = ph.mm_hash
            if h in planned:
                needed.append(i)  # encoded for this chunk already
                continue
            if h in cache:
                # an unreferenced entry this chunk reads can no longer be evicted for room
                pinned = cache.freeable.get(h, 0)
                if pinned and not cache.can_fit(room + pinned):
                    n = max(0, ph.offset - computed)
                    break
                room += pinned
                planned.add(h)
                needed.append(i)
                continue
            if ph.length > left or not cache.can_fit(room + ph.length):
                # stop before the image; a chunk that starts inside it waits whole
                n = max(0, ph.offset - computed)
                break
            left -= ph.length
            room += ph.length
            planned.add(h)
            needed.append(i)
        if n == 0:
            return 0, _NONE
        return n, needed

    def commit(self, req: Request, needed: list[int]) -> None:
        """The request got its KV for the planned tokens: encode or reference its images."""
        cache = self.cache
        rid = req.request_id
        reading = self.reading.setdefault(rid, [])
        # reads first: an entry this chunk reads must be pinned before a new entry's
        # allocation could evict it (plan() counted it out of the evictable room)
        for i in needed:
            h = req.mm_items[i].placeholder.mm_hash
            if h in cache and not cache.has_ref(rid, h):  # read, not encoded again: a hit
                cache.add_ref(rid, h)
                cache.hits += 1
        for i in needed:
            item = req.mm_items[i]
            ph = item.placeholder
            h = ph.mm_hash
            if h not in cache:
                cache.allocate(rid, h, ph.length)
                cache.misses += 1
                self.left -= ph.length
                self.scheduled[h] = EncoderInput(h, ph.grid_thw, item.pixels)
                self.num_encoder_runs += 1
                self.num_encoded_embeddings += ph.length
                self.encoder_input_bytes += len(item.pixels)
            if i not in reading:
                reading.append(i)

    def release_computed(self, requests: dict[str, Request]) -> None:
        """After a step's results: requests whose computed tokens passed an image's span stop
        referencing its output (it stays cached, evictable)."""
        done: list[str] = []
        for rid, reading in self.reading.items():
            req = requests.get(rid)
            if req is None:
                continue
            computed = req.num_computed_tokens
            keep = []
            for i in reading:
                ph = req.mm_items[i].placeholder
                if ph.offset + ph.length <= computed:
                    self.cache.release(rid, ph.mm_hash)
                else:
                    keep.append(i)
            reading[:] = keep
            if not keep:
                done.append(rid)
        for rid in done:
            del self.reading[rid]

    def release_all(self, req: Request) -> None:
        """Preempted or finished: every reference goes back."""
        reading = self.reading.pop(req.request_id, None)
        if reading:
            for i in reading:
                self.cache.release(req.request_id, req.mm_items[i].placeholder.mm_hash)

    def take_step(self, diff: StepDiff, by_handle: dict[int, Request]) -> EncoderStep | None:
        """The encoder's part of the step diff; None when it has nothing (text-only step)."""
        placeholders = []
        for new in diff.new_reqs:
            req = by_handle[new.handle]
            if req.mm_items:
                placeholders.append(RequestPlaceholders(
                    new.handle, [item.placeholder for item in req.mm_items]))
        freed = self.cache.take_freed()
        if not (placeholders or self.scheduled or freed):
            return None
        return EncoderStep(new_placeholders=placeholders,
                           scheduled_encoder_inputs=list(self.scheduled.values()),
                           free_encoder_mm_hashes=freed)

    def trace_record(self, step: EncoderStep | None) -> dict[str, int]:
        """This step's encoder work (embeddings against the budget) and the cache after it."""
        cache = self.cache
        return {
            "budget": self.budget,
            "embeddings": self.budget - self.left,
            "inputs": 0 if step is None else len(step.scheduled_encoder_inputs),
            "freed": 0 if step is None else len(step.free_encoder_mm_hashes),
            "cache_used": cache.used,
            "cache_capacity": cache.capacity,
        }

    def stats(self) -> dict[str, float]:
        return self.cache.stats() | {
            "encoder_runs": float(self.num_encoder_runs),
            "encoder_embeddings": float(self.num_encoded_embeddings),
            "encoder_seconds": self.encoder_seconds,
            "encoder_input_bytes": float(self.encoder_input_bytes),
        }

    def check(self, running: list[Request]) -> None:
        self.cache.check()
        for rid, reading in self.reading.items():
            for i in reading:
                assert i >= 0
            assert rid in {r.request_id for r in running}, f"{rid} reads encoder outputs"


class NoEncoder:
    """Without images: every chunk runs as planned."""

    encodes = False

    def plan(self, req: Request, computed: int, n: int) -> tuple[int, list[int]]:
        return n, _NONE

    def commit(self, req: Request, needed: list[int]) -> None:
        pass
