"""Persistent batch and request-state cache of one worker.

Every rank keeps the same state: it applies the step diff (protocol.messages.SchedulerOutput)
to preallocated numpy arrays whose active rows stay contiguous, builds the model inputs
with vectorized ops, and appends its own sampled tokens. A steady decode step touches no
per-request Python object; only requests that changed cost Python work.

Building a step's model inputs from the rows lives in batch_inputs.py (InputBuilder, a mixin
of InputBatch); a request's own state in request_state.py. The rows' block ids live in a
BlockTable (workers/runner/block_table.py), one table per KV cache group; each group gets its
own slot mapping and block table per step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from protocol.messages import SchedulerOutput
from workers.runner.batch_inputs import BatchInputs, InputBuilder
from workers.runner.block_table import BlockTable, StateMismatchError
from workers.runner.request_guard import admit_sampling
from workers.runner.request_state import CachedRequestState, new_request_loras, unpack_i32
from workers.sample.spec_decode import ragged_arange

__all__ = ["BatchInputs", "CachedRequestState", "InputBatch", "StateMismatchError"]


class InputBatch(InputBuilder):
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        max_blocks_per_req: int | None = None,
        device: torch.device | str = "cpu",
        num_groups: int = 1,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_req = max_blocks_per_req or -(-max_model_len // block_size) + 1
        self.device = torch.device(device)
        m = max_num_reqs
        # +1 column: the token sampled at position max_model_len - 1 still has a slot.
        self.token_ids = np.zeros((m, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(m, dtype=np.int32)
        self.num_computed_tokens = np.zeros(m, dtype=np.int32)
        self.num_groups = num_groups
        self.blocks = BlockTable(num_groups, m, self.max_blocks_per_req)
        self.block_table = self.blocks.tables[0]  # group 0's, what most models have
        self.num_scheduled = np.zeros(m, dtype=np.int32)
        self.handles = np.full(m, -1, dtype=np.int32)
        self.temperature = np.ones(m, dtype=np.float32)
        self.top_k = np.zeros(m, dtype=np.int32)
        self.top_p = np.ones(m, dtype=np.float32)
        self.min_p = np.zeros(m, dtype=np.float32)
        self.want_logprobs = np.zeros(m, dtype=bool)
        self.seeded = np.zeros(m, dtype=bool)
        self.seeds = np.zeros(m, dtype=np.int64)  # sampling_params.seed where seeded
        # Drafts under verification this step sit in token_ids right after num_tokens; they
        # are not the request's tokens until accepted, so num_tokens never counts them.
        self.num_drafts = np.zeros(m, dtype=np.int32)
        self._draft_rows: np.ndarray | None = None  # rows with drafts this step
        self.num_seeded = 0  # rows with a per-request seed
        # the device slot of the row's LoRA adapter, -1 = the base model; looked up when the
        # row is (re)added, from the slots the engine core's ops filled (workers/lora/)
        self.lora_slot = np.full(m, -1, dtype=np.int32)
        self.lora_slot_of: Callable[[CachedRequestState], int] = _no_lora
        self._arrays = (
            self.num_tokens, self.num_computed_tokens, self.num_scheduled,
            self.handles, self.temperature, self.top_k, self.top_p, self.min_p,
            self.want_logprobs, self.seeded, self.seeds, self.lora_slot,
        )  # fmt: skip
        self.states: dict[int, CachedRequestState] = {}
        self.num_rows = 0  # rows in use, holes included; == num_reqs once condensed
        self._holes: list[int] = []
        self.last_step_id = -1
        # handles whose sampling state could not be built this step -> reason (request_guard)
        self.failed: dict[int, str] = {}
        self._arange = np.arange(m + 1, dtype=np.int64)
        self._flat_tokens = self.token_ids.reshape(-1)  # a view, for np.take

    # ---------------------------------------------------------------- rows

    @property
    def num_reqs(self) -> int:
        return self.num_rows - len(self._holes)

    def add_request(self, st: CachedRequestState, block_ids: np.ndarray, num_computed: int) -> int:
        """Put a (new or resumed) request into a free row; returns the row."""
        if self._holes:
            row = self._holes.pop(0)  # holes are few; lowest first keeps rows compact
        elif self.num_rows < self.max_num_reqs:
            row = self.num_rows
            self.num_rows += 1
        else:
            raise StateMismatchError(f"more than max_num_reqs={self.max_num_reqs} running")
        n_prompt = len(st.prompt_token_ids)
        n_tok = n_prompt + len(st.output_token_ids)
        if n_tok > self.max_model_len or not 0 <= num_computed <= n_tok:
            raise StateMismatchError(
                f"request {st.handle}: {n_tok} tokens (max_model_len={self.max_model_len}), "
                f"num_computed_tokens={num_computed}"
            )
        self.token_ids[row, :n_prompt] = st.prompt_token_ids
        self.token_ids[row, n_prompt:n_tok] = st.output_token_ids
        self.num_tokens[row] = n_tok
        self.num_computed_tokens[row] = num_computed
        self.blocks.set_row(row, block_ids, st.handle)
        sp = st.sampling_params
        self.temperature[row] = sp.temperature
        self.top_k[row] = sp.top_k
        self.top_p[row] = sp.top_p
        self.min_p[row] = sp.min_p
        self.want_logprobs[row] = sp.logprobs
        self.seeded[row] = sp.seed is not None
        # a uint64 seed above 2**63 - 1 is kept as the int64 with the same 64 bits
        seed = sp.seed or 0
        self.seeds[row] = seed - 2**64 if seed >= 2**63 else seed
        self.num_seeded += sp.seed is not None
        self.lora_slot[row] = self.lora_slot_of(st) if st.lora_int_id else -1
        self.handles[row] = st.handle
        st.row = row
        return row

    def remove_request(self, st: CachedRequestState, keep_tokens: bool) -> None:
        """Take a request's row out of the batch (a hole until condense)."""
        row = st.row
        if keep_tokens:  # preempted: the row is about to be reused, save the outputs
            n_prompt = len(st.prompt_token_ids)
            st.output_token_ids = self.token_ids[row, n_prompt : self.num_tokens[row]].tolist()
        self.handles[row] = -1
        self.num_seeded -= bool(self.seeded[row])
        self.seeded[row] = False
        st.row = -1
        self._holes.append(row)
        self._holes.sort()

    def condense(self) -> None:
        """Move the last active rows into the holes so rows [0, num_reqs) are active."""
        holes = self._holes
        while holes:
            last = self.num_rows - 1
            if holes[-1] == last:  # trailing hole: just shrink
                holes.pop()
                self.num_rows -= 1
                continue
            dst = holes.pop(0)
            self._move_row(last, dst)
            self.num_rows -= 1

    def _move_row(self, src: int, dst: int) -> None:
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        self.blocks.move_row(src, dst)
        for a in self._arrays:
            a[dst] = a[src]
        self.states[int(self.handles[dst])].row = dst
        self.handles[src] = -1
        self.seeded[src] = False

    def token_ids_of(self, handle: int) -> list[int]:
        """All tokens (prompt + outputs) the worker holds for a request."""
        st = self._state(handle)
        if st.row < 0:
            return st.prompt_token_ids.tolist() + st.output_token_ids
        return self.token_ids[st.row, : self.num_tokens[st.row]].tolist()

    def _state(self, handle: int) -> CachedRequestState:
        st = self.states.get(handle)
        if st is None:
            raise StateMismatchError(f"unknown request handle {handle}")
        return st

    # ---------------------------------------------------------------- the diff

    def apply(self, so: SchedulerOutput) -> None:
        """Apply one step's diff in the protocol's order; raises StateMismatchError."""
        if so.step_id != self.last_step_id + 1:
            raise StateMismatchError(
                f"step gap: expected step {self.last_step_id + 1}, got {so.step_id}"
            )
        if self._draft_rows is not None:  # the previous step never finished: drop its drafts
            self.num_drafts[:] = 0
            self._draft_rows = None
        for h in unpack_i32(so.finished_handles, "finished_handles").tolist():
            st = self.states.pop(h, None)
            if st is None:
                raise StateMismatchError(f"finished handle {h} is unknown")
            if st.row >= 0:
                self.remove_request(st, keep_tokens=False)
        for h in unpack_i32(so.preempted_handles, "preempted_handles").tolist():
            st = self._state(h)
            if st.row < 0:
                raise StateMismatchError(f"preempted handle {h} is not running")
            self.remove_request(st, keep_tokens=True)
        fresh: list[tuple[CachedRequestState, int]] = []
        loras = new_request_loras(so.lora)  # handle -> adapter id, new requests with one
        for r in so.resumed_reqs:
            st = self._state(r.handle)
            if st.row >= 0:
                raise StateMismatchError(f"resumed handle {r.handle} is already running")
            self.add_request(st, unpack_i32(r.block_ids, "block_ids"), r.num_computed_tokens)
            fresh.append((st, r.num_scheduled_tokens))
        for nr in so.new_reqs:
            if nr.handle in self.states:
                raise StateMismatchError(f"new handle {nr.handle} is already known")
            sp, err = admit_sampling(nr.sampling_params)
            if err is not None:
                self.failed[nr.handle] = err
            prompt = unpack_i32(nr.prompt_token_ids, "prompt_token_ids").astype(np.int32)
            st = CachedRequestState(nr.handle, prompt, sp, lora_int_id=loras.pop(nr.handle, 0))
            self.states[nr.handle] = st
            self.add_request(st, unpack_i32(nr.block_ids, "block_ids"), nr.num_computed_tokens)
            fresh.append((st, nr.num_scheduled_tokens))
        if loras:
            raise StateMismatchError(f"lora: handles {sorted(loras)} are not new requests")
        self.condense()
        self._append_blocks(so)
        self._set_schedule(so, fresh)
        n = self.num_rows
        if so.num_running != n:
            raise StateMismatchError(
                f"num_running: scheduler says {so.num_running}, worker has {n}"
            )
        total = int(self.num_scheduled[:n].sum())
        if so.total_num_scheduled_tokens != total:
            raise StateMismatchError(
                f"total_num_scheduled_tokens: scheduler says {so.total_num_scheduled_tokens}, "
                f"worker counts {total}"
            )
        if so.spec_handles or so.spec_token_counts or so.spec_token_ids:
            self._set_drafts(so, fresh)
        self.last_step_id = so.step_id

    def _append_blocks(self, so: SchedulerOutput) -> None:
        cr = so.cached_reqs
        if not cr.handles:
            return
        handles = unpack_i32(cr.handles, "cached handles").tolist()
        counts = unpack_i32(cr.new_block_counts, "new_block_counts")
        ids = unpack_i32(cr.new_block_ids, "new_block_ids")
        g = self.num_groups
        if (len(counts) != len(handles) or int(counts.sum()) * g != len(ids)
                or (counts < 0).any()):
            raise StateMismatchError("cached_reqs: handles, counts and block ids disagree")
        row_list = [self._running_row(h, "cached_reqs") for h in handles]
        if len(set(row_list)) != len(row_list):
            raise StateMismatchError("cached_reqs lists a handle twice")
        self.blocks.append(np.array(row_list, dtype=np.int64), counts, ids)

    def _set_schedule(self, so: SchedulerOutput, fresh: list[tuple[CachedRequestState, int]]):
        self.num_scheduled[: self.num_rows] = 1  # default: one token for every running request
        if so.sched_override_handles or so.sched_override_counts:
            handles = unpack_i32(so.sched_override_handles, "sched_override_handles").tolist()
            counts = unpack_i32(so.sched_override_counts, "sched_override_counts")
            if len(counts) != len(handles) or (counts < 0).any():
                raise StateMismatchError("sched_override handles and counts disagree")
            fresh_handles = {st.handle for st, _ in fresh}
            for h, c in zip(handles, counts.tolist(), strict=True):
                if h in fresh_handles:
                    raise StateMismatchError(f"override for new/resumed handle {h}")
                self.num_scheduled[self._running_row(h, "sched_override")] = c
        for st, c in fresh:
            if c < 0:
                raise StateMismatchError(f"negative num_scheduled_tokens for {st.handle}")
            self.num_scheduled[st.row] = c

    def _set_drafts(self, so: SchedulerOutput, fresh: list[tuple[CachedRequestState, int]]):
        """Check the drafts against the schedule and write them after each row's tokens."""
        handles = unpack_i32(so.spec_handles, "spec_handles").tolist()
        counts = unpack_i32(so.spec_token_counts, "spec_token_counts")
        ids = unpack_i32(so.spec_token_ids, "spec_token_ids")
        if len(counts) != len(handles) or int(counts.sum()) != len(ids):
            raise StateMismatchError(
                f"spec diff: {len(handles)} handles, {len(counts)} draft counts summing to "
                f"{int(counts.sum())}, {len(ids)} draft token ids"
            )
        if (counts < 1).any() or (ids < 0).any():
            raise StateMismatchError("spec diff: a draft count < 1 or a negative draft token id")
        fresh_handles = {st.handle for st, _ in fresh}
        row_list = []
        for h in handles:
            if h in fresh_handles:
                raise StateMismatchError(f"spec drafts for new/resumed handle {h}")
            row_list.append(self._running_row(h, "spec_handles"))
        if len(set(row_list)) != len(row_list):
            raise StateMismatchError("spec_handles lists a handle twice")
        rows = np.array(row_list, dtype=np.int64)
        num_tokens = self.num_tokens[rows]
        computed = self.num_computed_tokens[rows]
        scheduled = self.num_scheduled[rows]
        # The scheduler computes the last token plus every draft, nothing more or less.
        bad = computed + scheduled != num_tokens + counts
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise StateMismatchError(
                f"request {handles[i]}: {int(counts[i])} drafts need num_computed_tokens + "
                f"num_scheduled == num_tokens + drafts; worker has {int(computed[i])} + "
                f"{int(scheduled[i])} != {int(num_tokens[i])} + {int(counts[i])}"
            )
        over = num_tokens + counts > self.max_model_len
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise StateMismatchError(
                f"request {handles[i]}: {int(num_tokens[i])} tokens + {int(counts[i])} drafts "
                f"> max_model_len={self.max_model_len}"
            )
        cols = np.repeat(num_tokens, counts) + ragged_arange(counts)
        self._flat_tokens[np.repeat(rows, counts) * self.token_ids.shape[1] + cols] = ids
        self.num_drafts[rows] = counts
        self._draft_rows = rows

    def _running_row(self, handle: int, what: str) -> int:
        st = self.states.get(handle)
        if st is None or st.row < 0:
            raise StateMismatchError(f"{what}: handle {handle} is not running")
        return st.row

    def update_after_step(
        self, inputs: BatchInputs, sampled: np.ndarray, counts: np.ndarray | None = None
    ) -> None:
        """Advance num_computed_tokens by what was scheduled; append the sampled tokens.

        ``counts`` (tokens per sampling row, flattened in ``sampled``) is required when the
        step verified drafts; None means one token per sampling row.
        """
        self.num_computed_tokens[inputs.rows] += inputs.num_scheduled
        rows = inputs.sample_rows
        if inputs.drafts is None:
            if len(rows):
                self.token_ids[rows, self.num_tokens[rows]] = sampled
                self.num_tokens[rows] += 1
            return
        if counts is None or len(counts) != len(rows) or int(counts.sum()) != len(sampled):
            raise ValueError("a step with drafts needs the token count of every sampling row")
        k = self.num_drafts[rows]
        # Rejected drafts' KV was computed on wrong tokens: roll back so they get recomputed
        # (the scheduler applies the same rollback to its own count).
        self.num_computed_tokens[rows] -= k - (counts - 1)
        num_tokens = self.num_tokens[rows]
        start = rows * self.token_ids.shape[1] + num_tokens
        self._flat_tokens[np.repeat(start, counts) + ragged_arange(counts)] = sampled
        self.num_tokens[rows] = num_tokens + counts
        assert self._draft_rows is not None
        self.num_drafts[self._draft_rows] = 0
        self._draft_rows = None


def _no_lora(st: CachedRequestState) -> int:
    raise StateMismatchError(f"request {st.handle} runs LoRA adapter {st.lora_int_id}, but "
                             "LoRA is not enabled on this worker")
