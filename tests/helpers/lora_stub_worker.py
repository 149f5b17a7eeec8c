"""A stand-in worker rank that speaks the real protocol over real ZeroMQ sockets, for end-to-end
tests of the LoRA plumbing (frontend -> engine core -> ranks) without a model.

Started like a torchrun worker (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TANDEM_CONFIG) next
to an engine core that waits for external workers (``LLM(..., start_workers=False)``). It says
hello, answers pings, runs each step on tests/engine_core/fake_worker.FakeWorker (which applies
the LoRA slot ops and makes tokens depend on the adapter in the request's slot) and answers
PrepareLoRA as a rank would: it reads adapter_config.json, checks the engine's content hash
against its own, and refuses ``use_dora`` and a rank above max_lora_rank. Test-only keys of
adapter_config.json: ``"stub_refuse_rank": R`` (only rank R refuses) and ``"stub_stall": true``
(requests of the adapter never get a token, so they stay in flight until aborted).

    python -m tests.helpers.lora_stub_worker
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import msgspec
import zmq

from protocol.codec import Encoder, broadcast_decoder, pack, unpack
from protocol.config import EngineConfig
from protocol.lora_files import content_hash
from protocol.messages import (
    DropLoRA,
    HealthPing,
    HealthPong,
    LoRAReady,
    ModelRunnerOutput,
    PrepareLoRA,
    SchedulerOutput,
    Shutdown,
    WorkerError,
    WorkerHello,
    WorkerReady,
)
from protocol.transport import Endpoints, make_socket, recv_frame, tcp_endpoints
from tests.engine_core.fake_worker import FakeWorker

NUM_BLOCKS = 512
MAX_MODEL_LEN = 1024
VOCAB = 32000
SILENCE_S = 60.0  # exit when the engine core has said nothing for this long


def check_adapter(msg: PrepareLoRA, rank: int, max_rank: int) -> tuple[str, dict]:
    """(error or "", the adapter's config)."""
    path = msg.lora.lora_path
    try:
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        return f"adapter_config.json: {e}", {}
    if cfg.get("use_dora"):
        return "adapter_config.json: use_dora is not supported", cfg
    if cfg.get("stub_refuse_rank") == rank:
        return "adapter_config.json: refused by this rank (stub_refuse_rank)", cfg
    if int(cfg.get("r", 0)) > max_rank:
        return f"adapter_config.json: r={cfg['r']} is more than max_lora_rank {max_rank}", cfg
    if content_hash(path) != msg.content_hash:
        return "the adapter's files changed since the engine hashed them", cfg
    return "", cfg


class StubRank:
    def __init__(self, config: EngineConfig, rank: int, world: int, ep: Endpoints) -> None:
        self.config, self.rank, self.world = config, rank, world
        self.ctx = zmq.Context()
        self.sub = make_socket(self.ctx, zmq.SUB, ep.broadcast, bind=False)
        self.push = make_socket(self.ctx, zmq.PUSH, ep.results, bind=False, linger_ms=1000)
        self.enc = Encoder()
        self.dec = broadcast_decoder(config.max_frame_bytes)
        self.worker = FakeWorker(config.block_size)
        self.prepared: dict[int, tuple[str, dict]] = {}  # adapter id -> (hash, config)
        self.last_step = -1

    def send(self, msg: msgspec.Struct) -> None:
        self.push.send(self.enc.encode(msg))

    def run(self) -> int:
        self.send(WorkerHello(rank=self.rank, world_size=self.world, pid=os.getpid(),
                              hostname=socket.gethostname(), device="cpu",
                              num_blocks=NUM_BLOCKS, vocab_size=VOCAB,
                              max_model_len=MAX_MODEL_LEN, eos_token_id=None, dtype="float32"))
        parent = os.getppid()
        heard = time.monotonic()
        while True:
            frame = recv_frame(self.sub, 200)
            if frame is None:
                if os.getppid() != parent or time.monotonic() - heard > SILENCE_S:
                    return 1
                continue
            heard = time.monotonic()
            msg = self.dec.decode(frame)
            if isinstance(msg, HealthPing):
                if msg.nonce < 0:
                    self.send(WorkerReady(rank=self.rank, nonce=msg.nonce))
                else:
                    self.send(HealthPong(rank=self.rank, nonce=msg.nonce,
                                         last_step_id=self.last_step))
            elif isinstance(msg, PrepareLoRA):
                max_rank = self.config.max_lora_rank or 16
                error, cfg = check_adapter(msg, self.rank, max_rank)
                if not error:
                    self.prepared[msg.lora.lora_int_id] = (msg.content_hash, cfg)
                self.send(LoRAReady(rank=self.rank, lora_int_id=msg.lora.lora_int_id,
                                    error=error))
            elif isinstance(msg, DropLoRA):
                self.prepared.pop(msg.lora_int_id, None)
            elif isinstance(msg, SchedulerOutput):
                try:
                    out = self.step(msg)
                except AssertionError as e:  # a wrong diff: say so, as a rank does
                    self.send(WorkerError(rank=self.rank, message=f"stub rank: {e}",
                                          traceback="", step_id=msg.step_id))
                    return 1
                if self.rank == 0:
                    self.send(out)
            elif isinstance(msg, Shutdown):
                return 0

    def step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for op in so.lora.ops if so.lora is not None else []:
            if op.lora_int_id:  # a load: the adapter was prepared, with this very content
                got = self.prepared.get(op.lora_int_id)
                assert got is not None, f"slot op loads adapter {op.lora_int_id}, not prepared"
                assert got[0] == op.content_hash, "slot op's content hash differs"
        out = self.worker.step(so)
        self.last_step = so.step_id
        stalled = {lid for lid, (_, cfg) in self.prepared.items() if cfg.get("stub_stall")}
        if not stalled:
            return out
        handles, toks = [], []
        for h, t in zip(unpack(out.req_handles), unpack(out.sampled_token_ids), strict=True):
            if self.worker.adapter_of.get(h) in stalled:
                self.worker.reqs[h].tokens.pop()  # as if it had sampled nothing
            else:
                handles.append(h)
                toks.append(t)
        return ModelRunnerOutput(step_id=so.step_id, rank=0, req_handles=pack(handles),
                                 sampled_token_ids=pack(toks))


def main() -> int:
    raw = os.environ.get("TANDEM_CONFIG")
    config = msgspec.json.decode(raw.encode(), type=EngineConfig) if raw else EngineConfig()
    ep = Endpoints.from_env() or tcp_endpoints(
        os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]) + 1)
    stub = StubRank(config, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), ep)
    try:
        return stub.run()
    finally:
        stub.sub.close(0)
        stub.push.close(1000)
        stub.ctx.term()


if __name__ == "__main__":
    sys.exit(main())
