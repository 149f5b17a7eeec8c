"""Images on a rank: the encoder-output cache, M-RoPE positions and the embedding merge.

A step hook (workers/step_hooks.py), plugged in for models with a vision encoder:
- before the diff: drop the outputs the engine core freed, note new requests' placeholder spans
  (their M-RoPE positions are computed once, here) and the items to encode this step;
- inputs built: a request with images gets its M-RoPE positions; tokens past its prompt get
  p + delta (still 1-D, so decode steps keep their CUDA graphs), tokens of an image span get
  their three rows and make the step eager;
- before the forward: encode this step's items (on every rank, in the same order: the tower is
  tensor-parallel), cache their outputs by mm_hash, and hand the model the rows of the cached
  outputs that this step's image tokens take (a chunk may start or end inside a span).

The cache holds exactly what the engine core's account says (engine_core/multimodal/): an
output is dropped only when a step's ``free_encoder_mm_hashes`` names it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protocol.messages import EncoderSchedulerOutput, SchedulerOutput
from protocol.multimodal import EncoderInput, ImageSettings, MMPlaceholder
from workers.model.mrope import MMStep, mrope_positions
from workers.multimodal.pixels import patches
from workers.runner.request_state import unpack_i32
from workers.step_hooks import StepHook

if TYPE_CHECKING:
    from workers.model.qwen2_vl import Qwen2VLForConditionalGeneration
    from workers.runner.batch_inputs import BatchInputs
    from workers.runner.input_batch import InputBatch

logger = logging.getLogger(__name__)


@dataclass
class _Images:
    """A request's placeholder spans and its prompt's M-RoPE positions."""

    placeholders: list[MMPlaceholder]
    positions: np.ndarray  # [3, prompt_len] int64
    delta: int  # a token at 1-D position p >= prompt_len sits at p + delta


@dataclass
class _Plan:
    """This step's image tokens: which cached rows go where, and the 3-D positions."""

    sources: list[tuple[str, int, int]]  # (mm_hash, first row, end row) per run of tokens
    index: np.ndarray  # [K] int64: their rows in the step's flat tokens
    positions3: np.ndarray  # [3, T] int64


class EncoderOutputs(StepHook):
    def __init__(self, model: Qwen2VLForConditionalGeneration, batch: InputBatch,
                 settings: ImageSettings, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.batch = batch
        self.settings = settings
        self.device = device
        self.dtype = dtype
        vision = model.cfg.vision
        assert vision is not None
        self.merge_size = vision.spatial_merge_size
        self.images: dict[int, _Images] = {}  # handle -> its images, while the rank knows it
        self.outputs: dict[str, torch.Tensor] = {}  # mm_hash -> [length, hidden]
        self.pending: list[EncoderInput] = []  # to encode before this step's forward
        self.plan: _Plan | None = None
        self.encoder_us = 0.0  # this step's encoder time (step_end reports it)
        self.num_encoded = 0

    # ------------------------------------------------------------------ prepare
    def before_diff(self, so: SchedulerOutput) -> None:
        images = self.images
        if images and so.finished_handles:
            for h in unpack_i32(so.finished_handles, "finished_handles").tolist():
                images.pop(h, None)
        if not isinstance(so, EncoderSchedulerOutput):
            return
        enc = so.encoder
        for mm_hash in enc.free_encoder_mm_hashes:
            self.outputs.pop(mm_hash, None)
        for rp in enc.new_placeholders:
            try:
                pos, delta = mrope_positions(
                    len_of_prompt(so, rp.handle),
                    [(p.offset, p.grid_thw) for p in rp.placeholders], self.merge_size)
            except ValueError as e:  # the request fails; the others run
                self.batch.failed[rp.handle] = f"bad image placeholders: {e}"
                continue
            for p in rp.placeholders:
                t, h, w = p.grid_thw
                if t * h * w != p.length * self.merge_size**2:
                    self.batch.failed[rp.handle] = (
                        f"image placeholder of {p.length} tokens for a {t}x{h}x{w} patch grid")
            images[rp.handle] = _Images(list(rp.placeholders), pos, delta)
        self.pending = list(enc.scheduled_encoder_inputs)

    def on_inputs(self, inputs: BatchInputs) -> bool:
        """M-RoPE positions of the rows with images; True when image tokens run this step."""
        self.plan = None
        images = self.images
        if not images:
            return False
        handles = self.batch.handles[inputs.rows]
        positions = inputs.positions
        qsl = inputs.query_start_loc
        sources: list[tuple[str, int, int]] = []
        index: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        for j in np.flatnonzero(np.isin(handles, np.fromiter(images, np.int64, len(images)))):
            img = images[int(handles[j])]
            a, b = int(qsl[j]), int(qsl[j + 1])
            start = int(positions[a])  # the row's first position (its computed tokens)
            n = b - a
            prompt_len = img.positions.shape[1]
            in_prompt = min(n, max(0, prompt_len - start))
            if in_prompt:
                table = img.positions[:, start : start + in_prompt]
                positions[a : a + in_prompt] = table[0]  # text: the three rows are equal
                for p in img.placeholders:
                    lo, hi = max(start, p.offset), min(start + in_prompt, p.offset + p.length)
                    if lo < hi:
                        sources.append((p.mm_hash, lo - p.offset, hi - p.offset))
                        rows = np.arange(a + lo - start, a + hi - start, dtype=np.int64)
                        index.append(rows)
                        cols.append(rows)
                        vals.append(table[:, lo - start : hi - start])
            if in_prompt < n:
                positions[a + in_prompt : b] += img.delta
        if not sources:
            return False
        pos3 = np.tile(positions, (3, 1))
        flat = np.concatenate(cols)
        pos3[:, flat] = np.concatenate(vals, axis=1)
        self.plan = _Plan(sources, np.concatenate(index), pos3)
        return True  # embeddings and 3-D positions: an eager step

    # ------------------------------------------------------------------ launch
    def on_launch(self, so: SchedulerOutput) -> None:
        self.model.mm_step = None  # the step before's, if any
        self.encoder_us = 0.0

    def before_forward(self, handles: np.ndarray, inputs: BatchInputs) -> None:
        if self.pending:
            self._encode(self.pending)
            self.pending = []
        plan, self.plan = self.plan, None
        if plan is None:
            return
        parts = []
        for mm_hash, lo, hi in plan.sources:
            out = self.outputs.get(mm_hash)
            if out is None or hi > out.shape[0]:
                # the core's account and this cache disagree: nothing sane to compute
                raise RuntimeError(f"encoder output {mm_hash[:12]} is not cached on this rank")
            parts.append(out[lo:hi])  # a chunk may start or end inside a span
        self.model.mm_step = MMStep(
            embeds=torch.cat(parts),
            index=torch.from_numpy(plan.index).to(self.device),
            positions3=torch.from_numpy(plan.positions3).to(self.device))

    def _encode(self, items: list[EncoderInput]) -> None:
        t0 = time.perf_counter()
        pixel_rows = []
        grids = []
        bad: list[EncoderInput] = []
        for item in items:
            try:
                pixels = np.frombuffer(item.pixels, dtype=np.uint8)
                p = self.settings.patch_size
                _, h, w = item.grid_thw
                if pixels.size != h * p * w * p * 3:
                    raise ValueError(f"{pixels.size} pixel bytes for a {h}x{w} patch grid")
                pixel_rows.append(patches(pixels.reshape(h * p, w * p, 3), item.grid_thw,
                                          self.settings))
                grids.append(item.grid_thw)
            except ValueError as e:  # its requests fail; everyone else's step runs
                self._fail_readers(item, f"image could not be encoded: {e}")
                bad.append(item)
        if grids:
            pixels_t = torch.from_numpy(np.concatenate(pixel_rows)).to(self.device, self.dtype)
            good = [i for i in items if i not in bad]
            for item, out in zip(good, self.model.encode_images(pixels_t, grids), strict=True):
                self.outputs[item.mm_hash] = out
        for item in bad:  # rows its failed readers compute on this step, never sampled from
            size = item.grid_thw[0] * item.grid_thw[1] * item.grid_thw[2] // self.merge_size**2
            self.outputs[item.mm_hash] = torch.zeros(
                max(1, size), self.model.cfg.hidden_size, dtype=self.dtype, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the time is the encoder's, not the next op's
        self.num_encoded += len(items)
        self.encoder_us += (time.perf_counter() - t0) * 1e6

    def _fail_readers(self, item: EncoderInput, reason: str) -> None:
        for handle, img in self.images.items():
            if any(p.mm_hash == item.mm_hash for p in img.placeholders):
                self.batch.failed[handle] = reason

    # ------------------------------------------------------------------ finish
    def step_end(self, fields: dict[str, Any]) -> None:
        if self.encoder_us:
            fields["encoder_us"] = self.encoder_us

    def census(self, out: dict[str, int]) -> None:
        out["encoder.requests"] = len(self.images)
        out["encoder.outputs"] = len(self.outputs)


def len_of_prompt(so: SchedulerOutput, handle: int) -> int:
    for nr in so.new_reqs:
        if nr.handle == handle:
            return len(unpack_i32(nr.prompt_token_ids, "prompt_token_ids"))
    raise RuntimeError(f"placeholders for handle {handle}, which is not new in this step")
