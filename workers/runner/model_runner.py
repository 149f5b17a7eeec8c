"""ModelRunner: one worker's step = apply diff -> build inputs -> forward -> sample.

Identical on every rank; the worker process loop around it decides who sends the output.
Optional features (LoRA, the KV connector, the KV offload tiers, grammars) plug in as step
hooks (workers/step_hooks.py): the step calls the hooks of the features that are on and never
asks which ones those are.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protocol.codec import pack, pack_f32
from protocol.config import GPU_MAX_BATCHED_TOKENS, EngineConfig
from protocol.devices import resolve_dtype
from protocol.messages import ModelRunnerOutput, SchedulerOutput
from workers.lora.feature import LoRAFeature, LoRAOff
from workers.parallel.distributed import DistEnv
from workers.runner.graph_buckets import GraphPlan
from workers.runner.input_batch import InputBatch
from workers.runner.input_staging import InputStaging, unstaged_inputs
from workers.runner.memory_profile import KVCachePlan, plan_for_model
from workers.runner.pending_tokens import fill_input_ids, pending_span
from workers.runner.request_guard import failed_fields, take_failed
from workers.runner.request_state import unpack_i32
from workers.runner.step_flight import InFlightStep, PreparedStep
from workers.runner.step_sample import DraftTokens, StepTokens, sample_step
from workers.runner.token_copy import TokenCopy
from workers.sample.grammar_feature import GrammarFeature
from workers.sample.sampler import Sampler, tokens_checksum
from workers.step_hooks import StepHook, StepHooks

if TYPE_CHECKING:

    from protocol.lora import LoRARequest
    from workers.lora.manager import LoRAManager
    from workers.model.config import ModelConfig
    from workers.model.llama import LlamaForCausalLM
    from workers.runner.cuda_graphs import CudaGraphRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def resolve_model_dtype(config: EngineConfig, device: torch.device,
                        model_config: ModelConfig, rank: int = 0) -> str:
    """The dtype name this rank runs the model in (config.dtype with "auto" resolved)."""
    if device.type == "cpu" and config.dtype == "auto":
        from workers.cpu_dtype import choose_cpu_dtype
        from workers.parallel.distributed import tp_all_reduce_min

        dtype, why = choose_cpu_dtype(model_config.torch_dtype, model_config.hidden_size)
        # every rank runs what the slowest rank measured (a probe may differ near its margin)
        if tp_all_reduce_min([int(dtype == "bfloat16")], device)[0] == 0 and dtype != "float32":
            dtype, why = "float32", "another rank measured bf16 slower"
        if rank == 0:
            logger.info("--dtype auto on CPU: %s (%s)", dtype, why)
        return dtype
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
        # the KV offload tiers' sizes, for the hello (0 without --kv-offload-memory)
        self.num_host_blocks = 0
        self.num_disk_blocks = 0
        self.kv_bytes_per_block = 0
        self.kv_connector_port = 0  # this rank's KV block server (P/D), 0 = none
        # LoRA adapters' slots and layer wrappers (workers/lora/); None without --enable-lora.
        # The step reaches it only through its feature.
        self.lora: LoRAManager | None = None
        # the optional features that are on (workers/step_hooks.py), in the order their hooks
        # run; LoRA and grammars plug in with the model, the KV tiers with the KV cache
        self.features: list[StepHook] = []
        self.hooks = StepHooks(self.features)
        self._lora: LoRAFeature | LoRAOff = LoRAOff(dist.rank)  # PrepareLoRA's answerer
        self.accepts_images = False  # the model has a vision encoder (workers/multimodal/)
        self._closed = False

    def plug(self, feature: StepHook) -> None:
        """Turn a feature on: its hooks run from the next step (start-up only)."""
        self.features.append(feature)
        self.hooks = StepHooks(self.features)

    def load_model(self) -> None:
        from workers.model.loader import load_model, load_model_config

        self.dtype = torch_dtype(resolve_model_dtype(self.config, self.device,
                                                     load_model_config(self.config.model),
                                                     self.dist.rank))
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
            self._lora = LoRAFeature(self.lora, self.dist.rank)
        self.plug(self._lora)  # off, it still answers PrepareLoRA (with a refusal)
        # grammar matchers are built on the first constrained request (xgrammar loads only
        # then)
        self.plug(GrammarFeature(self.config, self.model_config.vocab_size, self.device,
                                 self.dist.rank))
        if self.model_config.vision is not None:  # images: the encoder and its output cache
            from workers.model.qwen2_vl import Qwen2VLForConditionalGeneration
            from workers.multimodal.feature import EncoderOutputs
            from workers.multimodal.settings import read_image_settings

            assert isinstance(self.model, Qwen2VLForConditionalGeneration)
            self.plug(EncoderOutputs(self.model, self.input_batch,
                                     read_image_settings(self.config.model), self.device,
                                     self.dtype))
            self.accepts_images = True
        if self.device.type == "cuda":
            budget = self.config.max_num_batched_tokens or GPU_MAX_BATCHED_TOKENS
            # A step's tokens fit the budget; drafts may add up to K per request on top.
            spec = self.config.max_num_seqs * (1 + self.config.num_speculative_tokens)
            self.staging = InputStaging(self.device, budget + spec, self.config.max_num_seqs,
                                        self.input_batch.max_blocks_per_req, self.num_kv_groups)

    def loaded_model_config(self) -> ModelConfig:
        """The loaded model's config (load_model() has run)."""
        if self.model_config is None:
            raise RuntimeError("load_model() must run first")
        return self.model_config

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
        with ExitStack() as stack:
            for worst_case in self.hooks.worst_case:
                stack.enter_context(worst_case())
            return plan_for_model(self.model, self.config, self.device, self.block_size,
                                  self.max_model_len, self.dist.rank, shapes,
                                  lora_bytes=sum(b() for b in self.hooks.reserved_bytes))

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
            from workers.kv_offload.feature import KVOffloadFeature

            offload = KVOffloadFeature.build(self.model.kv_caches, self.config, self.dist.rank,
                                             self.device)
            self.num_host_blocks = offload.num_host_blocks
            self.num_disk_blocks = offload.num_disk_blocks
            self.kv_bytes_per_block = offload.bytes_per_block
            self.plug(offload)
        if self.config.kv_transfer_config is not None:
            from protocol.transport import secret_from_env
            from workers.kv_connector.feature import KVConnectorFeature
            from workers.kv_connector.worker_side import KVConnectorWorker

            connector = KVConnectorWorker(self.config.kv_transfer_config, self.dist.rank,
                                          self.dist.world_size, secret_from_env())
            connector.register_kv_caches(self.model)
            self.kv_connector_port = connector.port
            self.plug(KVConnectorFeature(connector))
        return num_blocks

    def close(self) -> None:
        """Finish the features' background work (the KV offload tiers' copies and disk
        writes, the connector's transfers, the grammar threads); once."""
        if self._closed:
            return
        self._closed = True
        for close in self.hooks.close:
            close()

    def prepare_lora(self, lora: LoRARequest, content_hash: str) -> str:
        """PrepareLoRA, waited for: the adapter's slice into host memory; why it was refused,
        or ""."""
        return self._lora.prepare(lora, content_hash)

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
        hooks = self.hooks
        try:
            for before_diff in hooks.before_diff:
                before_diff(so)
            batch.apply(so)
            for after_diff in hooks.after_diff:
                after_diff(so)
            failed = batch.failed
        finally:
            batch.failed = in_flight_failed
        self._parked.extend(unpack_i32(so.preempted_handles, "preempted_handles").tolist())
        step = PreparedStep(so, failed)
        if so.total_num_scheduled_tokens:
            inputs = step.inputs = batch.prepare_inputs()
            step.logits_indices = inputs.logits_indices
            eager = False  # every hook sees the inputs, whatever the ones before decided
            for on_inputs in hooks.on_inputs:
                eager = on_inputs(inputs) or eager
            if self.graphs is not None and not eager and self.graphs.can_run(inputs):
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
        hooks = self.hooks
        for on_launch in hooks.on_launch:  # also for a step that carries only copies or loads
            on_launch(so)
        flight = self._unfinished = InFlightStep(so, step.prep_us, transfer)
        if inputs is None:
            self.token_copy.start(transfer, None, None)
            return flight
        flight.inputs = inputs
        flight.handles = batch.handles[inputs.sample_rows]
        for before_forward in hooks.before_forward:
            before_forward(flight.handles, inputs)
        if step.bucket is not None:
            assert self.graphs is not None
            hidden = self.graphs.replay(step.bucket)
        else:
            assert step.eager is not None
            hidden = self.model(*step.eager)
        out: StepTokens | DraftTokens = StepTokens()
        if len(inputs.sample_rows):
            assert step.logits_indices is not None
            if self.staging is not None:
                idx = self.staging.logits_index(step.logits_indices)
            else:
                idx = torch.from_numpy(step.logits_indices)
            out = sample_step(self.model, self.sampler, batch, inputs, hidden, idx,
                              hooks.logit_hooks())
        flight.tokens = out
        self._in_flight_tokens = out.launch(batch, inputs, self.token_copy, transfer)
        flight.overlappable = out.overlappable
        return flight

    def finish(self, flight: InFlightStep) -> ModelRunnerOutput:
        """Wait for the step's tokens, write them into the batch and build its output."""
        assert self.input_batch is not None and flight is self._unfinished
        self._unfinished = None
        batch = self.input_batch
        sampled, lp = flight.transfer.wait()
        t0 = time.perf_counter()
        so = flight.so
        sampled, counts, lp = flight.tokens.finish(batch, flight.inputs, flight.handles,
                                                   sampled, lp, self._parked)
        self._parked.clear()
        self._in_flight_tokens = None
        hooks = self.hooks
        for after_sampling in hooks.after_sampling:
            after_sampling(sampled, counts, batch.failed)
        failed = take_failed(batch.failed)
        checksum = None
        if self.config.enable_checksum:  # failed handles count: ranks must agree on them too
            checksum = tokens_checksum(sampled if failed is None else
                                       np.concatenate([sampled, failed[0]]))
        fields: dict[str, Any] = {}
        for step_end in hooks.step_end:
            step_end(fields)
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
            **fields,
            **failed_fields(failed),
        )
