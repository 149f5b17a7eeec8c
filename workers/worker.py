"""The worker process: receive diff -> apply -> forward -> sample -> (rank 0) send tokens.

With worker overlap (workers/overlap.py) the next diff is received and applied while the
device still runs the step before, whose tokens are sent just before the next launch.

Broadcast messages are dispatched through one table (message type -> handler): the loop's own
(steps, pings, shutdown, profiling) and those of the rank's features (grammars, LoRA; see
workers/step_hooks.py), whose background work the loop polls each turn.

Every rank runs this same loop. Started by the launcher, or by the real `torchrun`
(`torchrun --nproc-per-node 2 -m workers`): it reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT, plus TANDEM_CONFIG (engine options as JSON) and TANDEM_ENDPOINTS (where the engine core
listens; derived from MASTER_ADDR/MASTER_PORT when absent).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from protocol.codec import Encoder, ProtocolError, broadcast_decoder
from protocol.config import EngineConfig, worker_overlap_on
from protocol.error_file import write_error_file
from protocol.messages import (
    EncoderSchedulerOutput,
    HealthPing,
    HealthPong,
    ProfileControl,
    ResetPrefixCache,
    SchedulerOutput,
    Shutdown,
    WorkerError,
    WorkerHello,
    WorkerReady,
)
from protocol.transport import Endpoints, make_socket, recv_frame, secret_from_env, tcp_endpoints
from workers.overlap import DeviceWatch, HostClock

if TYPE_CHECKING:
    import torch

    from workers.runner.step_flight import InFlightStep
from workers.census import worker_census

logger = logging.getLogger("tandem.worker")

# The engine core publishes a HealthPing at least every PING_INTERVAL_S while alive; a worker
# that hears nothing for CORE_SILENCE_S decides the core is gone and exits (no orphans).
CORE_SILENCE_S = 1.5
# Until the core's first step or liveness ping (it builds its scheduler after the start-up sync,
# a second or more with a large KV cache, and sends nothing meanwhile) the silence allowed is
# this long; a dead parent is still noticed within POLL_MS.
CORE_STARTUP_SILENCE_S = 60.0
POLL_MS = 100
# while a feature's background work is outstanding (a grammar compiling, an adapter read for
# the engine core), look for its end this often (a wake-up per 10 ms, only then): the request
# it belongs to waits for the answer to be admitted
GRAMMAR_POLL_MS = 10


def parse_fault(spec: str | None) -> tuple[str, int, int] | None:
    """TEST-ONLY fault hook: TANDEM_FAULT_INJECT="raise@step=5,rank=1", "hang@step=5,rank=1"
    or "slow_start@rank=0" (say hello 2 x CORE_SILENCE_S after the other ranks).

    Lets the reliability tests make a rank raise or go silent at a chosen step; unset in real use.
    """
    if not spec:
        return None
    kind, _, rest = spec.partition("@")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if "=" in kv)
    if kind not in ("raise", "hang", "slow_start"):
        raise ValueError(f"TANDEM_FAULT_INJECT: unknown fault {kind!r}")
    return kind, int(opts.get("step", "0")), int(opts.get("rank", "0"))


def config_from_env(env: dict[str, str] | os._Environ[str] = os.environ) -> EngineConfig:
    raw = env.get("TANDEM_CONFIG")
    if not raw:
        return EngineConfig()
    return msgspec.json.decode(raw.encode(), type=EngineConfig)


def endpoints_from_env() -> Endpoints:
    ep = Endpoints.from_env()
    if ep is not None:
        return ep
    # Started by a plain torchrun: the scheduler listens next to the rendezvous port.
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    return tcp_endpoints(host, port + 1)


def set_torch_threads(local_world_size: int) -> None:
    import torch

    if "TANDEM_NUM_THREADS" in os.environ:
        n = int(os.environ["TANDEM_NUM_THREADS"])
    else:
        n = max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(n)


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        from workers.parallel.distributed import init_distributed
        from workers.runner.model_runner import ModelRunner

        self.config = config
        self.dist = init_distributed(config.device, dtype=config.dtype)
        self.rank = self.dist.rank
        self.runner = ModelRunner(config, self.dist)
        self.runner.load_model()
        self.num_blocks = self.runner.init_kv_cache()
        self.runner.capture_cuda_graphs()
        self.encoder = Encoder()
        self.decoder = broadcast_decoder(config.max_frame_bytes)
        self.last_step_id = -1
        self.profiler: torch.profiler.profile | None = None
        self.fault = parse_fault(os.environ.get("TANDEM_FAULT_INJECT"))
        self.core_gone = False  # then nothing queued can be delivered: don't linger on exit
        self.stopping = False  # Shutdown came: run() returns 0
        # message type -> handler; the features' own (PrepareGrammar, PrepareLoRA, ...) too
        self.handlers: dict[type, Callable[[Any], None]] = {
            SchedulerOutput: self.execute,
            EncoderSchedulerOutput: self.execute,  # a step with images
            HealthPing: self.on_ping,
            Shutdown: self.on_shutdown,
            ProfileControl: self.on_profile,
            ResetPrefixCache: self.on_reset_prefix_cache,
        }
        for kind, handler in self.runner.hooks.messages().items():
            if kind in self.handlers:
                raise ValueError(f"a rank feature claims the loop's own {kind.__name__}")
            self.handlers[kind] = handler
        # worker overlap (workers/overlap.py): the launched step whose tokens are not sent yet
        self.overlap = worker_overlap_on(config, self.runner.device.type)
        self.in_flight: InFlightStep | None = None
        self.clock = HostClock()

    def connect(self, endpoints: Endpoints, secret: bytes | None) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sub = make_socket(self.ctx, zmq.SUB, endpoints.broadcast, bind=False, secret=secret)
        self.push = make_socket(
            self.ctx, zmq.PUSH, endpoints.results, bind=False, secret=secret, linger_ms=1000
        )
        self.watch = DeviceWatch(self.sub, self.runner.device)
        cfg = self.runner.loaded_model_config()
        self.push.send(
            self.encoder.encode(
                WorkerHello(
                    rank=self.rank,
                    world_size=self.dist.world_size,
                    pid=os.getpid(),
                    hostname=socket.gethostname(),
                    device=str(self.dist.device),
                    num_blocks=self.num_blocks,
                    # the per-layer KV spec: the core builds its KV cache groups from it
                    layer_windows=cfg.windows(),
                    num_host_blocks=self.runner.num_host_blocks,
                    num_disk_blocks=self.runner.num_disk_blocks,
                    kv_bytes_per_block=self.runner.kv_bytes_per_block,
                    vocab_size=cfg.vocab_size,
                    max_model_len=self.runner.max_model_len,
                    eos_token_id=cfg.eos_token_id,
                    dtype=str(self.runner.dtype).removeprefix("torch."),
                    kv_connector_port=self.runner.kv_connector_port,
                    accepts_images=self.runner.accepts_images,
                )
            )
        )
        for connect in self.runner.hooks.connect:  # answers go out on this PUSH socket
            connect(endpoints.results, self.send)

    def send(self, msg: msgspec.Struct) -> None:
        self.push.send(self.encoder.encode(msg))

    def run(self) -> int:
        """Serve until Shutdown, core silence or parent death. Returns the exit code."""
        parent = os.getppid()
        last_heard = time.monotonic()
        silence_limit = CORE_STARTUP_SILENCE_S
        hooks = self.runner.hooks
        while True:
            busy = any(busy() for busy in hooks.busy)
            timeout = GRAMMAR_POLL_MS if busy else POLL_MS
            t0 = time.perf_counter()
            if self.in_flight is not None:
                # the next diff while the device runs the step in flight, else finish that
                frame, device_done = self.watch.wait(timeout)
            else:
                frame, device_done = recv_frame(self.sub, timeout), False
            self.clock.blocked(t0, time.perf_counter())
            if device_done:
                self.finish_in_flight()
                continue
            if busy:
                for poll in hooks.poll:  # answer the features' background work that is done
                    poll()
            now = time.monotonic()
            if frame is None:
                if os.getppid() != parent:
                    logger.error("rank %d: parent process died; exiting", self.rank)
                    self.core_gone = True
                    return 1
                if now - last_heard > silence_limit:
                    logger.error(
                        "rank %d: no message from the engine core for %.1f s; exiting",
                        self.rank,
                        now - last_heard,
                    )
                    self.core_gone = True
                    return 1
                continue
            last_heard = now
            try:
                msg = self.decoder.decode(frame)
            except ProtocolError as e:
                # A corrupt broadcast means this rank can no longer trust its state.
                self.fail(f"bad broadcast frame: {e}", "")
                return 1
            if not (isinstance(msg, HealthPing) and msg.nonce < 0):
                silence_limit = CORE_SILENCE_S  # the core is past its start-up
            self.handlers.get(type(msg), self.on_other)(msg)
            if self.stopping:
                return 0

    def on_ping(self, msg: HealthPing) -> None:
        if msg.nonce < 0:  # start-up sync ping: say this SUB socket is live
            self.send(WorkerReady(rank=self.rank, nonce=msg.nonce))
        else:
            self.send(HealthPong(rank=self.rank, nonce=msg.nonce,
                                 last_step_id=self.last_step_id,
                                 census=worker_census(self.runner)))

    def on_shutdown(self, msg: Shutdown) -> None:
        self.stopping = True

    def on_profile(self, msg: ProfileControl) -> None:
        self.set_profiler(msg.enable, msg.trace_dir)

    def on_reset_prefix_cache(self, msg: ResetPrefixCache) -> None:
        pass  # KV contents need no reset: the scheduler only forgets hashes

    def on_other(self, msg: msgspec.Struct) -> None:
        pass  # a message no one on a rank handles is for the engine core's other peers

    def _maybe_inject_fault(self, step_id: int) -> None:
        if self.fault is None:
            return
        kind, step, rank = self.fault
        if kind == "slow_start" or rank != self.rank or step_id < step:
            return
        self.fault = None
        if kind == "raise":
            raise RuntimeError(f"injected fault at step {step_id} on rank {rank}")
        while True:  # "hang": stop answering; the core must notice; SIGTERM/KILL ends us
            signal.pause()

    def execute(self, so: SchedulerOutput) -> None:
        """Prepare the step (behind the step in flight, if any), finish the step in flight,
        launch this one; keep it in flight with overlap on, else finish it now."""
        self._maybe_inject_fault(so.step_id)
        step = self.runner.prepare(so)
        if self.in_flight is not None:
            self.finish_in_flight()
        flight = self.runner.launch(step)
        flight.hidden_us, flight.exposed_us = self.clock.launched(
            flight.transfer.t_launch, time.perf_counter())
        self.in_flight = flight
        if self.overlap and flight.overlappable:
            self.watch.arm(flight.transfer)
        else:
            self.finish_in_flight()

    def finish_in_flight(self) -> None:
        """Wait for the step in flight's tokens and send them (rank 0; every rank with
        checksums)."""
        flight = self.in_flight
        assert flight is not None
        self.in_flight = None
        out = self.runner.finish(flight)
        self.watch.disarm()
        t = flight.transfer
        self.clock.blocked(*t.waited)
        self.clock.device_done(t.t_ready)
        self.last_step_id = flight.so.step_id
        if self.rank == 0 or self.config.enable_checksum:
            self.push.send(self.encoder.encode(out))

    def fail(self, message: str, tb: str) -> None:
        try:
            self.send(
                WorkerError(
                    rank=self.rank, message=message, traceback=tb, step_id=self.last_step_id
                )
            )
        except zmq.ZMQError:
            pass

    def set_profiler(self, enable: bool, trace_dir: str) -> None:
        import torch

        if enable and self.profiler is None:
            self.profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]
                + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []),
            )
            self.profiler.__enter__()
            self.trace_dir = trace_dir or "."
        elif not enable and self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            os.makedirs(self.trace_dir, exist_ok=True)
            path = os.path.join(self.trace_dir, f"trace_rank{self.rank}.json")
            self.profiler.export_chrome_trace(path)
            logger.info("rank %d: wrote torch.profiler trace %s", self.rank, path)
            self.profiler = None


def main() -> int:
    logging.basicConfig(
        level=os.environ.get("TANDEM_LOG_LEVEL", "WARNING"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    config = config_from_env()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    set_torch_threads(local_world)
    rank = int(os.environ.get("RANK", "0"))
    worker: Worker | None = None
    try:
        worker = Worker(config)
        if worker.fault is not None and worker.fault[0] == "slow_start":
            if worker.fault[2] == worker.rank:
                time.sleep(2 * CORE_SILENCE_S)  # the other ranks already listen to the core
        worker.connect(endpoints_from_env(), secret_from_env())
        code = worker.run()
    except Exception as e:  # report, with traceback, before dying
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        # The launcher names the rank and this reason, also when we die before connecting.
        write_error_file(f"{type(e).__name__}: {e}", tb)
        if worker is not None and hasattr(worker, "push"):
            worker.fail(f"rank {rank}: {type(e).__name__}: {e}", tb)
        code = 1
    finally:
        if worker is not None and hasattr(worker, "watch"):
            worker.watch.close()
        if worker is not None:
            try:  # finish the KV offload tiers' copies and disk writes, stop their threads
                worker.runner.close()
            except Exception:
                logger.exception("rank %d: closing the KV offload tiers failed", rank)
        if worker is not None and hasattr(worker, "push"):
            worker.sub.close(0)
            worker.push.close(0 if worker.core_gone else 1000)
    if worker is not None and worker.core_gone:
        # Orphaned: skip interpreter/torch/gloo teardown (over a second), the OS frees it all.
        sys.stderr.flush()
        os._exit(code)
    try:
        import torch.distributed as dist

        if dist.is_initialized() and code == 0:
            dist.destroy_process_group()
    except Exception:
        pass
    return code
