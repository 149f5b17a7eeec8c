"""The Python API: `with LLM(model=..., tensor_parallel_size=N) as llm: llm.generate(...)`."""

from __future__ import annotations

import atexit
import queue
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import msgspec

from launch.census import Census, assemble
from launch.client import Delivery, EngineClient, EngineDeadError, Sink, Tracked
from launch.lora_modules import LoRAArg, resolve_lora_options
from launch.multimodal.options import MM_OPTION_NAMES, MultiModalOptions
from launch.outputs import RequestMetrics, RequestOutput, StreamEvent
from launch.processes import (
    ProcessGroup,
    base_env,
    free_port,
    start_engine_core,
)
from launch.processes import (
    start_workers as start_local_workers,
)
from launch.request_options import RequestOptions, per_prompt_options
from protocol.config import EngineConfig, config_error
from protocol.kv_connector import KVTransferParams, parse_kv_transfer_config, with_engine_id
from protocol.lora import LoRARequest
from protocol.messages import EngineCoreOutput as WireOutput
from protocol.messages import HealthReport, SamplingParams
from protocol.multimodal import MMItem
from protocol.transport import Endpoints, ipc_endpoints, remove_ipc_dir, tcp_endpoints

# a dict is vLLM's form for a prompt with images: {"prompt" or "prompt_token_ids",
# "multi_modal_data": {"image": ...}} (launch/multimodal/inputs.py)
Prompt = str | Sequence[int] | Mapping[str, Any]

ENGINE_OPTIONS = set(EngineConfig.__struct_fields__) - {"model", "tensor_parallel_size"}


def _engine_config(model: str, tensor_parallel_size: int, options: dict[str, Any]) -> EngineConfig:
    unknown = sorted(set(options) - ENGINE_OPTIONS)
    if unknown:
        raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(ENGINE_OPTIONS)}")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if options.get("kv_transfer_config") is not None:  # the flag's JSON, vLLM's dict, or ours
        options["kv_transfer_config"] = parse_kv_transfer_config(
            options["kv_transfer_config"], "kv_transfer_config")
    options = resolve_lora_options(options)  # the default max_lora_rank, module ids
    config = EngineConfig(model=model, tensor_parallel_size=tensor_parallel_size, **options)
    err = config_error(config)
    if err is not None:
        raise ValueError(err)
    return config


class LLM:
    """Starts an engine core and its worker ranks; generate() / generate_stream() / shutdown().

    Multi-node: the instance on node 0 passes nnodes, master_addr and master_port; every other
    node runs `python -m launch --node-rank R ...`, which starts only workers.
    `start_workers=False` starts only the engine core, for workers launched by `torchrun`.
    """

    def __init__(
        self,
        model: str = "dummy:tiny",
        tensor_parallel_size: int = 1,
        *,
        load_tokenizer: bool = True,
        nnodes: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        start_workers: bool = True,
        startup_timeout_s: float = 600.0,
        **engine_options: Any,
    ) -> None:
        # the image options (vLLM's limit_mm_per_prompt, ...) are the frontend's, not the engine's
        mm_kwargs = {k: engine_options.pop(k) for k in list(engine_options) if k in MM_OPTION_NAMES}
        self.mm_options = MultiModalOptions.from_kwargs(mm_kwargs)
        self._image_inputs: Any = None  # launch.multimodal.inputs.ImageInputs, on first use
        self.config = _engine_config(model, tensor_parallel_size, engine_options)
        if self.config.kv_transfer_config is not None:  # one engine id for core and ranks
            self.config = msgspec.structs.replace(
                self.config, kv_transfer_config=with_engine_id(self.config.kv_transfer_config))
        self.group = ProcessGroup(on_failure=self._on_process_failure)
        self.client: EngineClient | None = None
        self._ipc_dir: str | None = None
        self._closed = False
        self._torch_profiling = False
        self._grammar_cache: Any = None
        if tensor_parallel_size % nnodes:
            raise ValueError(
                f"tensor_parallel_size {tensor_parallel_size} is not divisible by nnodes {nnodes}"
            )
        run_config = self.config
        if start_workers:
            # Before anything is spawned: a rank without a GPU, or a dtype the GPU cannot run,
            # is an error that says what to do; "auto" becomes the device every rank will use.
            from workers.device_check import check_node

            device = check_node(self.config.device, self.config.dtype,
                                tp_size=tensor_parallel_size,
                                local_ranks=tensor_parallel_size // nnodes)
            run_config = msgspec.structs.replace(self.config, device=device)
        endpoints, self._ipc_dir = ipc_endpoints()
        port = master_port or free_port()
        if nnodes > 1 or not start_workers:
            # Workers on other nodes (or started by torchrun) reach the core over tcp, next to
            # the rendezvous port, as workers.worker derives it.
            remote = tcp_endpoints(master_addr, port + 1)
            endpoints = Endpoints(
                requests=endpoints.requests,
                outputs=endpoints.outputs,
                broadcast=remote.broadcast,
                results=remote.results,
            )
        env = base_env(run_config, endpoints)
        atexit.register(self.shutdown)
        try:
            start_engine_core(self.group, env, tensor_parallel_size)
            if start_workers:
                start_local_workers(
                    self.group,
                    env,
                    nproc_per_node=tensor_parallel_size // nnodes,
                    nnodes=nnodes,
                    node_rank=0,
                    master_addr=master_addr,
                    master_port=port,
                )
            self.group.watch()
            self.client = EngineClient(endpoints, self.config.max_frame_bytes,
                                       self.config.max_queued_requests)
            self.tokenizer = self._load_tokenizer() if load_tokenizer else None
            self._wait_ready(startup_timeout_s)
            for lora in self.config.lora_modules:  # an adapter the ranks refuse stops start-up
                self.add_lora(lora, startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ start-up / shutdown

    def _load_tokenizer(self) -> Any:
        from launch.tokenizer import load_tokenizer

        return load_tokenizer(self.config.tokenizer or self.config.model)

    def _grammars(self) -> Any:
        """The frontend's grammar cache (launch.structured), built on first use."""
        if self._grammar_cache is None:
            from launch.structured import FrontendGrammars

            self._grammar_cache = FrontendGrammars(self.tokenizer, self.info.vocab_size,
                                                   self.config)
        return self._grammar_cache

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.client is not None
        deadline = time.monotonic() + timeout_s
        while not self.client.ready_event.wait(0.1):
            if self.group.failure is not None:
                raise RuntimeError(f"engine failed to start: {self.group.failure}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not ready after {timeout_s} s")
        if self.client.dead_reason is not None:
            raise RuntimeError(f"engine failed to start: {self.client.dead_reason}")
        assert self.client.ready is not None
        self.info = self.client.ready

    def _on_process_failure(self, cause: str) -> None:
        if self.client is not None and not self._closed:
            self.client.mark_dead(f"engine process {cause}")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every process this LLM started; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.group.stop_watching()
        if self.client is not None and self.client.dead_reason is None:
            self.client.shutdown_engine()
            self.group.wait_all(timeout_s)
        self.group.terminate()
        if self.client is not None:
            self.client.close()
        if self._ipc_dir is not None:
            remove_ipc_dir(self._ipc_dir)
        atexit.unregister(self.shutdown)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ LoRA adapters

    def add_lora(self, lora_request: LoRARequest, timeout_s: float = 600.0) -> None:
        """Register an adapter now (requests may also name one it has never seen: the engine
        registers it then); returns once every rank has read it. ValueError with the reason
        when it is refused."""
        result = self._client().load_lora(lora_request, timeout_s)
        if result.error:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} refused: {result.error}")

    def remove_lora(self, lora_name: str, timeout_s: float = 30.0) -> None:
        """Unload an adapter by name; ValueError while requests use it or when unknown."""
        result = self._client().unload_lora(lora_name, timeout_s)
        if result.error:
            raise ValueError(result.error)

    # ------------------------------------------------------------------ requests

    def _client(self) -> EngineClient:
        if self.client is None or self._closed:
            raise RuntimeError("this LLM has been shut down")
        if self.client.dead_reason is not None:
            raise EngineDeadError(self.client.dead_reason)
        return self.client

    def image_inputs(self) -> Any:
        """The model's ImageInputs (launch/multimodal/inputs.py), read on first use."""
        if self._image_inputs is None:
            from launch.multimodal.inputs import ImageInputs

            self._image_inputs = ImageInputs.for_model(self.config.model, self.mm_options)
        return self._image_inputs

    def prompt_inputs(self, prompt: Prompt) -> tuple[list[int], list[MMItem]]:
        """A prompt's token ids and its images' items; a dict prompt's placeholders are
        expanded (ValueError for a bad image, a text-only model or too many images)."""
        if isinstance(prompt, Mapping):
            ids, items = self.image_inputs().prompt_inputs(prompt, self.encode)
            return ids, items
        return self.encode(prompt), []

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"model {self.config.model!r} has no tokenizer: pass token-id lists"
                )
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def apply_chat_template(self, message: str) -> str:
        if self.tokenizer is None or not self.tokenizer.has_chat_template:
            return message
        return str(self.tokenizer.apply_chat_template(message))

    def _submit(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        sink: Sink,
        options: Sequence[RequestOptions],
    ) -> list[RequestOutput]:
        client = self._client()
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # every prompt's slot under max_queued_requests first: a full queue is a
        # QueueFullError before anything is tokenized or compiled, and nothing is sent
        with client.admission.reserve(len(prompts)) as ticket:
            if any(sp.structured_outputs is not None for sp in params):
                try:
                    params = self._grammars().prepare(params)  # ValueError for a bad one
                except ValueError as e:
                    # a failed compile is cached and its exception raised for every call
                    # with that constraint, each raise adding frames to its traceback: start
                    # it afresh, so it holds one caller's frames, not every caller's
                    e.__traceback__ = None
                    raise
            # every prompt's ids and images before any is sent: a bad image in the third
            # prompt is a ValueError with nothing running, not two requests left behind
            inputs = [self.prompt_inputs(p) for p in prompts]
            results: list[RequestOutput] = []
            for i, ((ids, mm), sp, opts) in enumerate(zip(inputs, params, options, strict=True)):
                if mm:
                    opts = msgspec.structs.replace(opts, mm=mm)
                rid = client.new_request_id()
                tr = client.add_request(rid, ids, sp, sink, index=i, options=opts, ticket=ticket)
                results.append(RequestOutput(rid, ids, metrics=RequestMetrics(tr.arrival_time)))
        return results

    @staticmethod
    def _apply(res: RequestOutput, out: WireOutput, ts: float) -> None:
        if out.new_token_ids:
            if res.metrics.first_token_time is None:
                res.metrics.first_token_time = ts
            res.token_ids.extend(out.new_token_ids)
            res.metrics.token_times.extend([ts] * len(out.new_token_ids))
            if out.new_logprobs is not None:
                res.logprobs = (res.logprobs or []) + list(out.new_logprobs)
        if out.num_cached_tokens:
            res.metrics.num_cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            res.kv_transfer_params = out.kv_transfer_params
        if out.finish_reason is not None:
            res.finish_reason = out.finish_reason
            res.error = out.error
            res.metrics.finished_time = ts

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        timeout_s: float | None = None,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
        job_id: str | Sequence[str | None] | None = None,
        is_last_step: bool | Sequence[bool] = False,
        tool_name: str | Sequence[str | None] | None = None,
        kv_transfer_params: KVTransferParams | Sequence[KVTransferParams | None] | None = None,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        priority (one per prompt): for --scheduling-policy priority; cache_salt: prefix-cache
        isolation (only requests with the same salt share cached blocks).
        job_id / is_last_step / tool_name (one value, or one per prompt): the agent program
        each prompt is a turn of, for --scheduling-policy continuum (see README).
        kv_transfer_params (one, or one per prompt): disaggregated prefill / decode, as in
        vLLM; a prefill's answer is in each output's ``kv_transfer_params``.
        lora_request: a LoRARequest(name, int_id, path) for every prompt, or one (or None,
        the base model) per prompt; needs enable_lora=True."""
        options = self._options(
            len(_as_list(prompts)), priority=priority, cache_salt=cache_salt, job_id=job_id,
            is_last_step=is_last_step, tool_name=tool_name,
            kv_transfer_params=kv_transfer_params, lora_request=lora_request)
        results: list[RequestOutput] = []
        bar = None
        try:
            for results, _, out in self._events(prompts, sampling_params, options, timeout_s):
                if bar is None and use_tqdm and len(results) > 1:
                    bar = _progress(len(results))
                if out.finish_reason is not None and bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        if self.tokenizer is not None:
            for r in results:
                r.text = self.tokenizer.decode(r.token_ids)
        return results

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        timeout_s: float | None = None,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
        job_id: str | Sequence[str | None] | None = None,
        is_last_step: bool | Sequence[bool] = False,
        tool_name: str | Sequence[str | None] | None = None,
        kv_transfer_params: KVTransferParams | Sequence[KVTransferParams | None] | None = None,
        lora_request: LoRAArg = None,
    ) -> Iterator[StreamEvent]:
        """Yield new tokens (and text deltas) of every prompt as they are generated; the
        request options are generate()'s.

        Closing the iterator early aborts the requests still running.
        """
        options = self._options(
            len(_as_list(prompts)), priority=priority, cache_salt=cache_salt, job_id=job_id,
            is_last_step=is_last_step, tool_name=tool_name,
            kv_transfer_params=kv_transfer_params, lora_request=lora_request)
        detoks: list[Any] | None = None
        for results, tr, out in self._events(prompts, sampling_params, options, timeout_s):
            if detoks is None:
                detoks = self._detokenizers(results)
            delta = detoks[tr.index].add(out.new_token_ids) if detoks else None
            if out.finish_reason is not None and detoks:
                # release text held back waiting for a character to complete
                delta = (delta or "") + detoks[tr.index].finish()
            yield StreamEvent(
                tr.index,
                tr.request_id,
                list(out.new_token_ids),
                delta,
                out.finish_reason,
                out.error,
            )

    def _options(self, n: int, **keywords: Any) -> list[RequestOptions]:
        """generate()'s and generate_stream()'s request keywords, one RequestOptions per
        prompt (both pass every keyword by name, so neither can drop or misplace one)."""
        return per_prompt_options(n, lora_enabled=self.config.enable_lora, **keywords)

    def _events(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        options: Sequence[RequestOptions],
        timeout_s: float | None,
    ) -> Iterator[tuple[list[RequestOutput], Tracked, WireOutput]]:
        """The one receive loop behind generate() and generate_stream().

        Submits every prompt, folds each engine output into its RequestOutput and yields it;
        on an error or an early close, aborts whatever is still running.
        """
        sink: Sink = queue.Queue()
        results = self._submit(_as_list(prompts), sampling_params, sink, options)
        pending = len(results)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while pending:
                for tr, out, ts in _get(sink, deadline):
                    self._apply(results[tr.index], out, ts)
                    if out.finish_reason is not None:
                        pending -= 1
                    yield results, tr, out
        finally:
            if pending and self.client is not None and self.client.dead_reason is None:
                self.client.abort([r.request_id for r in results if not r.finished])

    def _detokenizers(self, results: list[RequestOutput]) -> list[Any]:
        if self.tokenizer is None:
            return []
        from launch.detokenizer import IncrementalDetokenizer

        return [IncrementalDetokenizer(self.tokenizer) for _ in results]

    def abort(self, request_ids: Sequence[str]) -> None:
        self._client().abort(request_ids)

    def health(self, timeout_s: float = 5.0) -> HealthReport:
        """Liveness of every rank (seconds since each was last heard) and forward progress."""
        return self._client().health(timeout_s)

    def census(self, timeout_s: float = 5.0) -> Census:
        """The size of every map that grows with client input, per process ("frontend",
        "engine_core", "rank0", ...); launch/census.py says which are freed with their request
        (all 0 when idle) and which are bounded caches."""
        client = self._client()
        return assemble(client.census(), client.health(timeout_s))

    def get_stats(self, timeout_s: float = 5.0) -> dict[str, float]:
        """The scheduler's counters: prefix-cache hits, preemptions, steps, and with
        speculative decoding spec_acceptance_rate and spec_mean_accepted_len."""
        return dict(self._client().health(timeout_s).stats)

    def start_profile(self, trace_dir: str = "", torch_profiler: bool = True) -> None:
        """torch.profiler on every rank (Chrome traces in trace_dir) + the step timeline."""
        self._torch_profiling = torch_profiler
        self._client().profile(True, trace_dir, torch_profiler)

    def stop_profile(self) -> Any:
        """Stops profiling; returns EngineStats with the step timeline rows."""
        return self._client().profile(False, torch_profiler=self._torch_profiling)


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    seq: list[Any] = list(prompts)
    if seq and isinstance(seq[0], int):
        return [cast(list[int], seq)]  # one token-id prompt
    return cast(list[Prompt], seq)


def _get(sink: Sink, deadline: float | None) -> Delivery:
    while True:
        try:
            return sink.get(timeout=0.5)
        except queue.Empty:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("generation did not finish in time") from None


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)
