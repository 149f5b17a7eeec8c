"""One instance of every wire message type, every field away from its default."""

from __future__ import annotations

import msgspec

from protocol import messages as m
from protocol.codec import pack, pack_f32
from protocol.kv_connector import (
    KVConnectorMetadata,
    KVConnectorReport,
    KVExposeOp,
    KVLoadOp,
    KVTransferParams,
)
from protocol.kv_transfer import KVLoadResult, KVTransfers, pack_tags
from protocol.lora import LoRARequest, LoRASlotOp, LoRAStep
from protocol.multimodal import (
    EncoderInput,
    EncoderStep,
    MMItem,
    MMPlaceholder,
    RequestPlaceholders,
)
from protocol.request_options import JobInfo, RequestOptions
from protocol.structured import StructuredOutputsParams

SP = m.SamplingParams(
    max_tokens=77,
    temperature=0.5,
    top_k=40,
    top_p=0.9,
    min_p=0.05,
    seed=1234,
    stop_token_ids=[2, 7],
    ignore_eos=True,
    min_tokens=3,
    logprobs=True,
)

LORA = LoRARequest("sql", 3, "/adapters/sql")

KV_PARAMS = KVTransferParams(
    do_remote_decode=True, do_remote_prefill=True, remote_engine_id="p0",
    remote_block_ids=[3, 4], remote_host="10.0.0.2", remote_port=5000,
    remote_rank_ports=[5001, 5002], tp_size=2, remote_request_id="r#1", remote_num_tokens=20,
    remote_lease_s=30.0,
)

IMAGE = MMItem(MMPlaceholder("ab" * 32, 1, 4, (1, 4, 4)), bytes(range(256)) * 3)

# one instance of every message type, every field away from its default
SAMPLES: list[msgspec.Struct] = [
    m.AddRequest(
        request_id="req-ä-1",
        prompt_token_ids=pack([1, 2, 3, 50000]),
        sampling_params=SP,
        arrival_time=12.5,
        options=RequestOptions(priority=-3, cache_salt="salt", lora=LORA,
                               kv_transfer_params=KV_PARAMS),
    ),
    m.LoadLoRA(lora=LORA),
    m.UnloadLoRA(lora_name="sql"),
    m.LoRAResult(lora_name="sql", error="in use", in_use=True, not_found=True),
    m.AddRequest(
        request_id="req-job-1",
        prompt_token_ids=pack([7, 8]),
        sampling_params=SP,
        options=RequestOptions(
            priority=2, job=JobInfo(job_id="agent-7", is_last_step=True, tool_name="grep")),
    ),
    m.AddRequest(
        request_id="req-img-1",
        prompt_token_ids=pack([1, 5, 5, 5, 5, 2]),
        sampling_params=SP,
        options=RequestOptions(mm=[IMAGE]),
    ),
    m.EncoderSchedulerOutput(
        step_id=8,
        num_running=1,
        total_num_scheduled_tokens=6,
        encoder=EncoderStep(
            new_placeholders=[RequestPlaceholders(3, [IMAGE.placeholder])],
            scheduled_encoder_inputs=[EncoderInput("ab" * 32, (1, 4, 4), bytes(range(9)))],
            free_encoder_mm_hashes=["cd" * 32],
        ),
    ),
    m.AbortRequests(request_ids=["a", "b"]),
    m.HealthRequest(nonce=99),
    m.ShutdownEngine(),
    m.ProfileRequest(enable=True, trace_dir="/tmp/trace"),
    m.EngineCoreOutput(
        request_id="r",
        new_token_ids=[5, 6],
        finish_reason="error",
        error="boom",
        new_logprobs=[-0.5, -1.25],
        num_cached_tokens=32,
        kv_transfer_params=KV_PARAMS,
    ),
    m.EngineOutputs(
        outputs=[m.EngineCoreOutput(request_id="x", new_token_ids=[1], finish_reason="stop")],
        timestamp=1.5,
        frames_seen=12,
        num_waiting=3,
    ),
    m.HealthReport(
        nonce=3,
        alive=[True, False],
        last_seen_s=[0.1, 9.0],
        steps=10,
        num_running=4,
        num_waiting=2,
        kv_usage=0.75,
        stats={"num_steps": 10.0},
        census={"scheduler.requests": 6, "rank0.input_batch.states": 4},
    ),
    m.EngineDead(reason="rank 1 died"),
    m.EngineReady(
        num_blocks=100,
        block_size=16,
        max_model_len=2048,
        vocab_size=32000,
        eos_token_id=2,
        device="cpu",
    ),
    m.EngineStats(stats={"steps": 3.0}, step_timeline=[[1.0, 2.0]]),
    m.SchedulerOutput(
        step_id=7,
        new_reqs=[
            m.NewRequestData(
                handle=4,
                prompt_token_ids=pack([9, 8, 7]),
                sampling_params=SP,
                block_ids=pack([0, 1]),
                num_computed_tokens=16,
                num_scheduled_tokens=3,
            )
        ],
        resumed_reqs=[
            m.ResumedRequestData(
                handle=2, block_ids=pack([5]), num_computed_tokens=0, num_scheduled_tokens=20
            )
        ],
        cached_reqs=m.CachedRequestData(
            handles=pack([1, 3]), new_block_counts=pack([1, 2]), new_block_ids=pack([6, 7, 8])
        ),
        finished_handles=pack([11]),
        preempted_handles=pack([12]),
        sched_override_handles=pack([1]),
        sched_override_counts=pack([0]),
        spec_handles=pack([3]),
        spec_token_counts=pack([2]),
        spec_token_ids=pack([100, 101]),
        num_running=4,
        total_num_scheduled_tokens=26,
        kv_transfers=KVTransfers(
            host_to_disk=pack([0, 3]),
            disk_to_host=pack([4, 1]),
            device_to_host=pack([9, 0]),
            host_to_device=pack([2, 13]),
            host_to_disk_tags=pack_tags([2**63 + 5]),
            disk_to_host_tags=pack_tags([7]),
        ),
        lora=LoRAStep(
            ops=[
                LoRASlotOp(slot=1, lora_int_id=3, lora_name="sql", lora_path="/a",
                           content_hash="ab"),
                LoRASlotOp(slot=0, lora_int_id=0),
            ],
            handles=pack([4]),
            lora_int_ids=pack([3]),
        ),
        kv_connector=KVConnectorMetadata(
            loads=[KVLoadOp(load_id=7, block_ids=pack([1, 2]), remote_block_ids=pack([8, 9]),
                            remote_key="r#1", remote_engine_id="p0", remote_host="10.0.0.2",
                            remote_rank_ports=[5001, 5002])],
            cancel=pack([6]),
            expose=[KVExposeOp("q#2", pack([10, 11]))],
            unexpose=["q#1"],
        ),
    ),
    m.Shutdown(reason="bye"),
    m.HealthPing(nonce=2**40),
    m.ProfileControl(enable=True, trace_dir="/t"),
    m.ResetPrefixCache(),
    m.PrepareGrammar(ticket=3, spec=StructuredOutputsParams(regex="[a-z]+"), grammar_id=7),
    m.DropGrammars(grammar_ids=[7, 2**40]),
    m.PrepareLoRA(lora=LORA, content_hash="ab12"),
    m.DropLoRA(lora_int_id=3),
    m.WorkerHello(
        rank=1,
        world_size=2,
        pid=1234,
        hostname="node",
        device="cuda:1",
        num_blocks=500,
        vocab_size=32000,
        max_model_len=4096,
        eos_token_id=None,
        protocol_version=m.PROTOCOL_VERSION,
        auth=b"\x01" * 32,
        layer_windows=[0, 4096],
        num_host_blocks=64,
        num_disk_blocks=256,
        kv_bytes_per_block=65536,
        kv_connector_port=5001,
    ),
    m.ModelRunnerOutput(
        step_id=7,
        rank=0,
        req_handles=pack([1, 3]),
        num_tokens=pack([1, 2]),
        sampled_token_ids=pack([4, 5, 6]),
        logprobs=pack_f32([-0.5, -1.0, -2.0]),
        checksum=2**62,
        timings_us=[1.0, 2.0, 3.0],
        kv_load=KVLoadResult(done_host_slots=pack([1]), failed_host_slots=pack([2])),
        kv_copy_us=12.5,
    ),
    m.WorkerError(rank=1, message="oom", traceback="Traceback ...", step_id=5),
    m.HealthPong(rank=1, nonce=3, last_step_id=9, census={"input_batch.states": 4}),
    m.WorkerReady(rank=2, nonce=5),
    m.GrammarReady(rank=1, ticket=3, error="invalid structured_outputs.regex"),
    m.LoRAReady(rank=1, lora_int_id=3, error="adapter_config.json: use_dora is not supported"),
    KVConnectorReport(rank=1, done=pack([7]), failed=pack([6]), reasons=["refused"],
                      nbytes=4096, seconds=[0.25], transport="tcp"),
    m.GrammarReady(rank=0, ticket=4, size_bytes=70_000, cache_bytes=2**28),
]
