"""ModelRunner: one worker's step = apply diff -> build inputs -> forward -> sample.

Identical on every rank; the worker process loop around it decides who sends the output.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protocol.codec import pack, pack_f32
from protocol.config import GPU_MAX_BATCHED_TOKENS, EngineConfig
from protocol.devices import resolve_dtype
from protocol.kv_transfer import KVLoadResult
from protocol.messages import ModelRunnerOutput, SchedulerOutput
from workers.parallel.distributed import DistEnv, tp_all_reduce_min
from workers.runner.graph_buckets import GraphPlan
from workers.runner.input_batch import InputBatch
from workers.runner.input_staging import InputStaging, unstaged_inputs
from workers.runner.memory_profile import KVCachePlan, plan_for_model
from workers.runner.pending_tokens import fill_input_ids, pending_span, reserve, resolve
from workers.runner.request_guard import fail_nonfinite_rows, failed_fields, take_failed
from workers.runner.request_state import unpack_i32
from workers.runner.step_flight import InFlightStep, PreparedStep
from workers.runner.step_sample import StepTokens, sample_step
from workers.runner.token_copy import TokenCopy
from workers.sample.sampler import Sampler, tokens_checksum

if TYPE_CHECKING:

    from protocol.lora import LoRARequest
    from protocol.structured import StructuredOutputsParams
    from workers.kv_connector.worker_side import KVConnectorWorker
    from workers.kv_offload.host_pool import KVOffloadExecutor
    from workers.lora.manager import LoRAManager
    from workers.model.config import ModelConfig
    from workers.model.llama import LlamaForCausalLM
    from workers.runner.cuda_graphs import CudaGraphRunner
    from workers.sample.structured import StructuredOutputs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def resolve_model_dtype(config: EngineConfig, device: torch.device,
                        model_config: ModelConfig) -> str:
    """The dtype name this rank runs the model in (config.dtype with "auto" resolved)."""
    bf16 = True
    if device.type == "cuda" and config.dtype == "auto":
        bf16 = torch.cuda.get_device_capability(device)[0] >= 8
    return resolve_dtype(config.dtype, device.type, model_config.torch_dtype, bf16)


class ModelRunner:
    def __init__(self, config: EngineConfig, dist: DistEnv) -> None:
        self.config = config
        self.dist = dist
        self.device = torch.device(dist.device)
        # "auto" is resolved in load_model(), once the checkpoint's dtype is known
        self.dtype = torch_dtype(config.dtype) if config.dtype != "auto" else torch.float32
        self.block_size = config.block_size
        self.model: LlamaForCausalLM | None = None
        self.model_config: ModelConfig | None = None
        self.max_model_len = config.max_model_len or 0
        self.num_blocks = 0
        self.sampler = Sampler(config.seed, self.device)
        # the one device-to-host copy of each step's tokens, on its own stream on CUDA
        self.token_copy = TokenCopy(self.device, config.max_num_seqs)
        # the launched step's sampled tensor, until its finish: the input ids of a step
        # prepared meanwhile take its tokens from it (pending_tokens.py)
        self._in_flight_tokens: torch.Tensor | None = None
        # requests preempted by diffs applied since the last finish: their saved tokens may
        # hold a sentinel of the step in flight
        self._parked: list[int] = []
        self._unfinished: InFlightStep | None = None  # launched, not finished
        self.input_batch: InputBatch | None = None
        # CUDA only: pinned staging buffers (CPU tensors from numpy are already zero-copy) and
        # the decode-step graphs.
        self.staging: InputStaging | None = None
        self.graphs: CudaGraphRunner | None = None
        # the KV offload tiers: host pool (+ disk store) and the executor of the
        # copies each step names; None without --kv-offload-memory
        self.kv_offload: KVOffloadExecutor | None = None
        self.num_host_blocks = 0
        self.num_disk_blocks = 0
        self.kv_bytes_per_block = 0
        self._k_caches: list[torch.Tensor] = []
        self._v_caches: list[torch.Tensor] = []
        # grammar matchers of constrained requests; built on the first one (xgrammar loads
        # only then)
        self.structured: StructuredOutputs | None = None
        # disaggregated prefill / decode (workers/kv_connector/); None without
        # --kv-transfer-config
        self.kv_connector: KVConnectorWorker | None = None
        # LoRA adapters' slots and layer wrappers (workers/lora/); None without --enable-lora
        self.lora: LoRAManager | None = None

    def _make_structured(self) -> StructuredOutputs:
        if self.structured is None:
            from workers.sample.structured import StructuredOutputs

            assert self.model_config is not None
            k = self.config.num_speculative_tokens
            self.structured = StructuredOutputs.for_model(
                self.config.tokenizer or self.config.model, self.model_config.vocab_size,
                self.config.max_num_seqs * (1 + k), k, self.device)
        return self.structured

    def prepare_grammar(self, spec: StructuredOutputsParams, grammar_id: int) -> Future[Any]:
        """Start compiling a constraint before its request is scheduled; the request's
        NewRequestData later finds it in the grammar cache (entry ``grammar_id``, kept until
        the engine core drops it)."""
        return self._make_structured().cache.submit(spec, grammar_id)

    def drop_grammars(self, grammar_ids: list[int]) -> None:
        """The engine core's eviction of compiled grammars (DropGrammars)."""
        if self.structured is not None:
            self.structured.cache.drop(grammar_ids)

    def grammar_cache_bytes(self) -> int:
        return self.structured.cache.size_bytes if self.structured is not None else 0

    def _structured_outputs(self, so: SchedulerOutput) -> StructuredOutputs | None:
        if self.structured is None and any(
                nr.sampling_params.structured_outputs is not None for nr in so.new_reqs):
            self._make_structured()
        if self.structured is not None:
            self.structured.apply_diff(so)
        return self.structured

    def load_model(self) -> None:
        from workers.model.loader import load_model, load_model_config

        self.dtype = torch_dtype(resolve_model_dtype(self.config, self.device,
                                                     load_model_config(self.config.model)))
        if self.device.type == "cuda":
            # float32 stays exact unless the user traded precision for TF32's speed
            torch.backends.cuda.matmul.allow_tf32 = self.config.allow_tf32
            torch.backends.cudnn.allow_tf32 = self.config.allow_tf32
        self.model, self.model_config = load_model(
            self.config.model,
            self.dist.rank,
            self.dist.world_size,
            self.dtype,
            self.device,
            seed=self.config.seed,
            load_format=self.config.load_format,
        )
        self.max_model_len = self.config.max_model_len or self.model_config.max_position_embeddings
        # one block table per KV cache group (sliding-window and hybrid models have several)
        self.num_kv_groups = len(self.model.kv_cache_groups)
        self.input_batch = InputBatch(
            self.config.max_num_seqs, self.max_model_len, self.block_size, device=self.device,
            num_groups=self.num_kv_groups,
        )
        self.model.set_attention_backend(self.config.attention_backend)
        if self.config.enable_lora:  # slot buffers allocated before the KV cache is sized
            from workers.lora.manager import LoRAManager

            self.lora = LoRAManager(self.model, self.config, self.input_batch, self.dtype,
                                    self.device)
        if self.device.type == "cuda":
            budget = self.config.max_num_batched_tokens or GPU_MAX_BATCHED_TOKENS
            # A step's tokens fit the budget; drafts may add up to K per request on top.
            spec = self.config.max_num_seqs * (1 + self.config.num_speculative_tokens)
            self.staging = InputStaging(self.device, budget + spec, self.config.max_num_seqs,
                                        self.input_batch.max_blocks_per_req, self.num_kv_groups)

    def graph_plan(self) -> GraphPlan | None:
        """The CUDA graph buckets this rank captures: None on CPU, with --enforce-eager, or
        with an attention backend that cannot be captured."""
        assert self.model is not None
        if (self.device.type != "cuda" or self.config.enforce_eager or self.staging is None
                or not self.model.attn_backend.supports_cuda_graphs):
            return None
        return GraphPlan(self.config.max_num_seqs, 1 + self.config.num_speculative_tokens,
                         self.staging.max_tokens)

    def capture_cuda_graphs(self) -> None:
        """Capture the step graphs (decode and mixed buckets); call once, after
        init_kv_cache()."""
        plan = self.graph_plan()
        if plan is None:
            return
        from workers.runner.cuda_graphs import CudaGraphRunner

        assert self.model is not None and self.staging is not None
        self.graphs = CudaGraphRunner(self.model, self.staging, plan, self.block_size,
                                      self.num_kv_groups)
        self.graphs.capture()

    def plan_kv_cache(self) -> KVCachePlan:
        """This rank's KV cache sizing for the loaded model (what init_kv_cache allocates)."""
        if self.model is None:
            raise RuntimeError("load_model() must run before plan_kv_cache()")
        plan = self.graph_plan()
        shapes = None if plan is None else (len(plan.buckets()), plan.max_tokens())
        lora = self.lora  # the profile forward (CUDA) runs every token through an adapter
        with lora.worst_case() if lora is not None else nullcontext():
            return plan_for_model(self.model, self.config, self.device, self.block_size,
                                  self.max_model_len, self.dist.rank, shapes,
                                  lora_bytes=lora.nbytes if lora is not None else 0)

    def init_kv_cache(self) -> int:
        """Allocate the paged KV cache once; returns num_blocks (block 0 is the null block)."""
        if self.model is None:
            raise RuntimeError("load_model() must run before init_kv_cache()")
        if self.num_blocks:
            raise RuntimeError("the KV cache is allocated once")
        # overrides, the CPU budget, or on CUDA a profile forward and gpu_memory_utilization
        num_blocks = self.plan_kv_cache().num_blocks
        self.model.allocate_kv_cache(num_blocks, self.block_size)
        self.num_blocks = num_blocks
        if self.config.kv_offload_memory > 0:
            self._init_kv_offload()
        if self.config.kv_transfer_config is not None:
            from protocol.transport import secret_from_env
            from workers.kv_connector.worker_side import KVConnectorWorker

            self.kv_connector = KVConnectorWorker(self.config.kv_transfer_config,
                                                  self.dist.rank, self.dist.world_size,
                                                  secret_from_env())
            self.kv_connector.register_kv_caches(self.model)
        return num_blocks

    def _init_kv_offload(self) -> None:
        """This rank's host pool (and disk store) for its shard of every offloaded block;
        slot numbers are the scheduler's, the same on every rank."""
        from workers.kv_offload.disk import DiskKVStore
        from workers.kv_offload.host_pool import HostKVLayout, HostKVPool, KVOffloadExecutor

        assert self.model is not None
        self._k_caches = [k for k, _ in self.model.kv_caches]
        self._v_caches = [v for _, v in self.model.kv_caches]
        layout = HostKVLayout.from_caches(self._k_caches)
        num_host = HostKVPool.blocks_for(self.config.kv_offload_memory, layout)
        # pinned on CUDA, so the copies are DMA that overlaps the forward
        pool = HostKVPool(layout, num_host, pin=self.device.type == "cuda")
        disk = None
        if self.config.kv_offload_disk and self.config.kv_offload_disk_size > 0:
            num_disk = DiskKVStore.slots_for(self.config.kv_offload_disk_size,
                                             layout.nbytes_per_block)
            if num_disk > 0:
                disk = DiskKVStore(self.config.kv_offload_disk, self.dist.rank, num_disk,
                                   layout.describe(), layout.nbytes_per_block)
                self.num_disk_blocks = num_disk
        self.kv_offload = KVOffloadExecutor(pool, disk, self.device)
        self.num_host_blocks = num_host
        self.kv_bytes_per_block = layout.nbytes_per_block
        logger.info("KV offload: %d host blocks (%s), %d disk blocks", num_host,
                    layout.describe(), self.num_disk_blocks)

    def close(self) -> None:
        """Finish the KV offload tiers' copies and disk writes."""
        if self.kv_offload is not None:
            self.kv_offload.close()
            self.kv_offload = None
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None
        if self.structured is not None:
            self.structured.close()

    def prepare_lora(self, lora: LoRARequest, content_hash: str) -> str:
        """PrepareLoRA: the adapter's slice into host memory; why it was refused, or ""."""
        if self.lora is None:
            return "LoRA is not enabled on this worker (--enable-lora)"
        return self.lora.prepare(lora, content_hash)

    def begin_prepare_lora(self, lora: LoRARequest, content_hash: str) -> Future[Any]:
        """PrepareLoRA off the step loop: a future for finish_prepare_lora."""
        fut: Future[Any] = Future()
        if self.lora is None:
            fut.set_exception(RuntimeError("LoRA is not enabled on this worker (--enable-lora)"))
            return fut
        return self.lora.begin_prepare(lora, content_hash)

    def finish_prepare_lora(self, lora: LoRARequest, fut: Future[Any], keep: bool = True) -> str:
        """The answer to PrepareLoRA once ``fut`` is done: the refusal, or ""."""
        if self.lora is None:
            return "LoRA is not enabled on this worker (--enable-lora)"
        return self.lora.finish_prepare(lora, fut, keep)

    def drop_lora(self, lora_int_id: int) -> None:
        if self.lora is not None:
            self.lora.drop(lora_int_id)

    def _settle_kv_loads(self) -> KVLoadResult | None:
        """Disk -> host reads that every rank finished (or any rank failed): the ranks agree
        on each read's state (MIN all-reduce, only in steps with reads in flight), so all of
        them report and act on the same verdicts."""
        assert self.kv_offload is not None
        slots, states = self.kv_offload.load_states()
        if not slots:
            return None
        agreed = tp_all_reduce_min(states, self.device)
        return self.kv_offload.settle(slots, agreed)

    # ------------------------------------------------------------------ one step
    # prepare -> launch -> finish. With worker overlap (workers/overlap.py) the worker calls
    # them as prepare(k+1) [while step k runs], finish(k), launch(k+1); otherwise in order.
    # prepare touches only the batch (and, on CUDA, stages the inputs); everything whose
    # meaning depends on step k's tokens or device work being done waits for launch.

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step in order; returns the sampled tokens (every rank computes the same)."""
        return self.finish(self.launch(self.prepare(so)))

    def prepare(self, so: SchedulerOutput) -> PreparedStep:
        """Apply the step's diff and build its inputs (on CUDA: stage them on the device).

        A step may be in flight meanwhile: its rows hold sentinels for their sampled tokens,
        which the device inputs take from its sampled tensor (pending_tokens.py)."""
        assert self.input_batch is not None
        if self._unfinished is not None and not self._unfinished.overlappable:
            raise RuntimeError("a step that cannot overlap must finish before the next is "
                               "prepared")
        t0 = time.perf_counter()
        batch = self.input_batch
        # new requests failing here belong to this step's output, not the one in flight's
        in_flight_failed, batch.failed = batch.failed, {}
        lora = self.lora
        try:
            if lora is not None and so.lora is not None:
                # before the batch looks up its new rows' slots; a slot's weights are written
                # in stream order, after the step in flight that may still read them
                lora.apply_ops(so.lora.ops)
            batch.apply(so)
            if lora is not None:
                lora.check_rows()
            failed = batch.failed
        finally:
            batch.failed = in_flight_failed
        self._parked.extend(unpack_i32(so.preempted_handles, "preempted_handles").tolist())
        step = PreparedStep(so, failed)
        if so.total_num_scheduled_tokens:
            inputs = step.inputs = batch.prepare_inputs()
            step.logits_indices = inputs.logits_indices
            # graphs are captured without LoRA: a step with adapter rows runs eagerly (the
            # token groups by slot are set here for this step's forward)
            with_lora = lora is not None and lora.begin_step(inputs)
            if self.graphs is not None and not with_lora and self.graphs.can_run(inputs):
                step.bucket, ids, step.logits_indices = self.graphs.stage(inputs)
            else:
                step.eager = (self.staging.stage(inputs) if self.staging is not None
                              else unstaged_inputs(inputs, self.device))
                ids = step.eager[0]
            span = pending_span(inputs)
            if span:
                fill_input_ids(ids, self._in_flight_tokens, span)
        step.prep_us = (time.perf_counter() - t0) * 1e6
        return step

    def launch(self, step: PreparedStep) -> InFlightStep:
        """Queue the step's forward and sampling, and the copy of its tokens to the host.
        The step before must be finished (its tokens on the host)."""
        assert self.input_batch is not None and self.model is not None
        if self._unfinished is not None:
            raise RuntimeError("the step before must finish before the next launches")
        batch = self.input_batch
        so, inputs = step.so, step.inputs
        transfer = self.token_copy.begin()
        batch.failed.update(step.failed)
        structured = self._structured_outputs(so)
        offload = self.kv_offload
        copy_us = 0.0
        if offload is not None and so.kv_transfers is not None:
            # after the step before has run (it may write the blocks a store reads) and before
            # this forward (and before the early return: a step may carry only copies)
            spent = offload.apply_seconds
            offload.apply(so.kv_transfers, self._k_caches, self._v_caches)
            copy_us = (offload.apply_seconds - spent) * 1e6
        if self.kv_connector is not None and so.kv_connector is not None:
            self.kv_connector.start_load_kv(so.kv_connector)  # returns at once
        flight = self._unfinished = InFlightStep(so, step.prep_us, transfer, copy_us=copy_us)
        if inputs is None:
            self.token_copy.start(transfer, None, None)
            return flight
        flight.inputs = inputs
        flight.handles = batch.handles[inputs.sample_rows]
        # constrained requests' masks are filled on a helper thread while the forward runs;
        # they need the step before's tokens accepted, which its finish queued before this
        masks = flight.masks = (structured.plan(flight.handles, inputs.drafts)
                                if structured is not None else None)
        if offload is not None:
            offload.wait_before_forward()  # this step's tier copies land before the forward
        if step.bucket is not None:
            assert self.graphs is not None
            hidden = self.graphs.replay(step.bucket)
        else:
            assert step.eager is not None
            hidden = self.model(*step.eager)
        out = StepTokens()
        if len(inputs.sample_rows):
            assert step.logits_indices is not None
            if self.staging is not None:
                idx = self.staging.logits_index(step.logits_indices)
            else:
                idx = torch.from_numpy(step.logits_indices)
            out = sample_step(self.model, self.sampler, batch, inputs, hidden, idx,
                              structured, masks)
        if out.spec is not None:
            # drafts: the accepted counts decide the rows' tokens, so nothing may follow
            # before they are on the host; the step is finished before the next is prepared
            flight.spec = out.spec
            self.token_copy.ready(transfer, out.spec.token_ids, out.spec.logprobs)
            return flight
        reserve(batch, inputs)
        host_tokens = out.tokens
        if out.nonfinite is not None and out.tokens is not None:
            # the device keeps a valid placeholder (the next step's inputs read it); the host
            # copy marks the row -1 so finish() fails its request, with no extra sync here
            host_tokens = torch.where(out.nonfinite, -1, out.tokens)
        self.token_copy.start(transfer, host_tokens, out.logprobs)
        self._in_flight_tokens = out.tokens
        flight.overlappable = True
        return flight

    def finish(self, flight: InFlightStep) -> ModelRunnerOutput:
        """Wait for the step's tokens, write them into the batch and build its output."""
        assert self.input_batch is not None and flight is self._unfinished
        self._unfinished = None
        batch = self.input_batch
        sampled, lp = flight.transfer.wait()
        t0 = time.perf_counter()
        so, inputs = flight.so, flight.inputs
        counts = None
        if flight.spec is not None:
            sampled, counts, lp = flight.spec.token_ids, flight.spec.counts, flight.spec.logprobs
            assert inputs is not None
            batch.update_after_step(inputs, sampled, counts)
        else:
            assert sampled is not None
            fail_nonfinite_rows(batch, flight.handles, sampled)
            resolve(batch, sampled, self._parked)
        self._parked.clear()
        self._in_flight_tokens = None
        structured = self.structured
        if flight.masks is not None:
            assert structured is not None
            structured.accept(flight.masks, sampled, counts)
        if structured is not None:
            structured.take_failed(batch.failed)
        failed = take_failed(batch.failed)
        checksum = None
        if self.config.enable_checksum:  # failed handles count: ranks must agree on them too
            checksum = tokens_checksum(sampled if failed is None else
                                       np.concatenate([sampled, failed[0]]))
        kv_load = self._settle_kv_loads() if self.kv_offload is not None else None
        t = flight.transfer
        return ModelRunnerOutput(
            step_id=so.step_id,
            rank=self.dist.rank,
            req_handles=pack(flight.handles),
            num_tokens=pack(counts) if counts is not None and (counts != 1).any() else b"",
            sampled_token_ids=pack(sampled),
            logprobs=pack_f32(lp) if lp is not None else b"",
            checksum=checksum,
            timings_us=[flight.prep_us, (t.t_ready - t.t_launch) * 1e6,
                        (time.perf_counter() - t0) * 1e6, flight.hidden_us, flight.exposed_us],
            kv_load=kv_load,
            kv_copy_us=flight.copy_us,
            **failed_fields(failed),
        )
