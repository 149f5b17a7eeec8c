"""The engine core process: owns the Scheduler, broadcasts step plans, collects tokens.

One loop: take frontend messages -> schedule -> encode once -> publish to every rank -> wait for
rank 0's ModelRunnerOutput -> update -> send RequestOutputs. It blocks on sockets (poll with
timeouts), pings the workers so they can tell it is alive, and declares a rank hung when it has
been silent for `worker_timeout_s`.

With async scheduling two steps are in flight: step k+1 is planned and published while the
workers run step k, so scheduling, encoding, the broadcast and the update hide behind the
forward pass. The token step k is sampling counts as an output placeholder (Scheduler).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections import deque
from collections.abc import Iterable
from itertools import chain

import msgspec
import zmq

from engine_core.census import core_census
from engine_core.frontend.intake import request_from
from engine_core.frontend.link import FrontendLink
from engine_core.handshake import build_scheduler, collect_hellos
from engine_core.kv_cache.events import NO_PUBLISHER, attach_kv_events
from engine_core.pens.base import HoldingPen, Settled
from engine_core.pens.setup import build_pens, control_routes, reply_routes
from engine_core.request import Request, RequestStatus
from engine_core.request_failures import finish_failed_requests
from engine_core.sched.scheduler import Scheduler
from engine_core.step_timeline import StepTimeline
from engine_core.worker_link import PING_INTERVAL_S, EngineFatal, WorkerLink
from protocol.codec import Encoder, ProtocolError, request_id_of
from protocol.config import EngineConfig
from protocol.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreOutput,
    EngineDead,
    EngineOutputs,
    EngineReady,
    EngineStats,
    HealthReport,
    HealthRequest,
    ModelRunnerOutput,
    ProfileControl,
    ProfileRequest,
    SchedulerOutput,
    Shutdown,
    ShutdownEngine,
    WorkerError,
)
from protocol.transport import Endpoints, recv_frame, secret_from_env

logger = logging.getLogger("tandem.engine_core")


class EngineCore:
    def __init__(self, config: EngineConfig, endpoints: Endpoints, world_size: int) -> None:
        self.config = config
        self.world_size = world_size
        secret = secret_from_env()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.encoder = Encoder()
        self.frontend = FrontendLink(self.ctx, endpoints, secret, config, self.encoder)
        self.link = WorkerLink(self.ctx, endpoints, secret, config, world_size)
        self.inflight = self.frontend.inflight  # request ids the frontend is owed an end for
        self.steps = 0
        self.timeline = StepTimeline()
        # published steps whose output has not arrived (at most one, two with async
        # scheduling), oldest first, with
        # their timeline stamps (schedule start, scheduled, encoded, published) and frame size
        self.in_flight: deque[tuple[SchedulerOutput, tuple[float, float, float, float], int]]
        self.in_flight = deque()
        self.early_outputs: dict[int, dict[int, ModelRunnerOutput]] = {}
        self.shutdown_requested = False
        # the enabled features' holding pens (engine_core.pens), in the order a new request
        # passes them, and which pen each rank reply and frontend control message goes to
        self.use_pens(build_pens(
            config, world_size, lambda m: self.link.pub.send(self.encoder.encode(m)),
            self.ctx, secret, self._requests_beside))
        self._intake_features = {"lora_enabled": config.enable_lora,
                                 "kv_enabled": config.kv_transfer_config is not None}

    # ------------------------------------------------------------------ start-up

    def use_pens(self, pens: list[HoldingPen]) -> None:
        """Keep ``pens`` and route the rank replies and frontend control messages they own."""
        self.pens = pens
        self.reply_routes = reply_routes(pens)
        self.control_routes = control_routes(pens)
        self.link.reply_types = frozenset(self.reply_routes)

    def handshake(self) -> None:
        """Wait for every rank, build the Scheduler from what they report, tell the frontend."""
        hellos = collect_hellos(self.link, self.encoder, self.world_size)
        # Ranks on this host, so a broken collective can be traced to the rank that died.
        here = socket.gethostname()
        self.link.local_pids = {r: h.pid for r, h in hellos.items() if h.hostname == here}
        self.scheduler = build_scheduler(self.config, hellos)
        self.kv_events = attach_kv_events(self.config, self.scheduler)  # a no-op when off
        for pen in self.pens:
            pen.start(self.scheduler, hellos)
        self.frontend.num_waiting = self.num_waiting
        h0 = hellos[0]
        self.num_blocks = self.scheduler.kv_cache_manager.num_blocks
        self.vocab_size = h0.vocab_size
        self.max_model_len = self.scheduler.max_model_len
        self.eos_token_id = h0.eos_token_id
        self.device = h0.device
        self.dtype = h0.dtype
        self.link.last_seen = [time.monotonic()] * self.world_size
        self._send_frontend(
            EngineReady(
                num_blocks=self.num_blocks,
                block_size=self.config.block_size,
                max_model_len=self.max_model_len,
                vocab_size=self.vocab_size,
                eos_token_id=self.eos_token_id,
                device=self.device,
                dtype=self.dtype,
            )
        )

    # ------------------------------------------------------------------ main loop

    def run(self) -> None:
        while not self.shutdown_requested:
            busy = (self.scheduler.has_unfinished_requests() or bool(self.in_flight)
                    or self._to_forget())
            if busy:
                self._poll_frontend(0)
            elif self._pens_busy():
                self._wait_frontend_or_workers(int(PING_INTERVAL_S * 1000))
            else:
                self._poll_frontend(int(PING_INTERVAL_S * 1000))
            if not self.in_flight:
                self.link.drain()  # idle: the workers' pongs must still count
            self._settle_pens()
            self.link.maybe_ping()
            self.link.check_alive()
            if self.shutdown_requested:
                break
            self._flush(self.scheduler.take_outputs())
            if self.scheduler.has_unfinished_requests() or self.in_flight or self._to_forget():
                self.step()

    def step(self) -> None:
        """Publish the next step if fewer than the allowed number are in flight, then finish
        the oldest one.

        Synchronous: one step at a time. Async: two, so step k+1 is planned before step k's
        tokens are known and its work (and the broadcast) overlaps step k's forward pass; the
        workers find it queued when they finish step k.
        """
        depth = 2 if self.config.async_scheduling else 1
        in_flight = self.in_flight
        if len(in_flight) < depth and (self.scheduler.has_unfinished_requests()
                                       or self._to_forget()):
            t0 = time.perf_counter()
            so = self.scheduler.schedule()
            t1 = time.perf_counter()
            frame = self.encoder.encode(so)
            t2 = time.perf_counter()
            self.link.pub.send(frame, copy=False)
            for pen in self.pens:
                pen.after_publish()
            in_flight.append((so, (t0, t1, t2, time.perf_counter()), len(frame)))
            if len(in_flight) < depth and self.scheduler.has_unfinished_requests():
                return  # the first step of a burst: plan the next one before waiting
        so, (t0, t1, t2, t3), nbytes = in_flight.popleft()
        out = self._wait_for_output(so.step_id)
        t4 = time.perf_counter()
        trace = self.scheduler.trace
        if trace is not None:  # the step's wall time: schedule start to the model output
            trace.set_wall_time(so.step_id, t4 - t0)
        finish_failed_requests(self.scheduler, out)
        outputs = self.scheduler.update_from_output(so, out)
        if self.config.debug_invariants:
            self.scheduler.check_invariants()
        t5 = time.perf_counter()
        self._flush(outputs)
        self._flush(self.scheduler.take_outputs())
        self.steps += 1
        self.kv_events.end_step()
        if self.timeline.enabled:
            self.timeline.record(t0, t1, t2, t3, t4, t5, time.perf_counter(), so, out, nbytes)
        if so.total_num_scheduled_tokens == 0 and not outputs and not in_flight:
            # Nothing could run (e.g. KV full, nothing to preempt): wait for input, don't spin.
            # A request waiting for its prefix's disk reads only needs the workers' next
            # report: a short wait (the reads take milliseconds); none when this step's
            # report settled reads, since the next step can admit it now.
            offload = self.scheduler.kv_offload
            if offload is not None and out.kv_load is not None:
                timeout_ms = 0
            elif offload is not None and offload.waiting_for_loads:
                timeout_ms = 2
            else:
                timeout_ms = int(PING_INTERVAL_S * 1000)
            if self._pens_busy():  # a rank's or a peer's answer to a pen may unblock it
                self._wait_frontend_or_workers(timeout_ms)
            else:
                self._poll_frontend(timeout_ms)

    def _to_forget(self) -> bool:
        """Idle, but the workers still hold the state of requests that finished in the last
        step: one step with nothing scheduled tells them (its finished_handles), so an idle
        engine holds no request's state on any rank."""
        return not self.in_flight and self.scheduler.has_handles_to_forget()

    def num_waiting(self) -> int:
        """Requests admitted but not running: the waiting queue (preempted ones included) and
        those held in a pen (until their grammar compiled, their adapter was read, ...)."""
        return len(self.scheduler.waiting) + sum(pen.num_held for pen in self.pens)

    def _pens_busy(self) -> bool:
        return any(pen.busy for pen in self.pens)

    def _wait_frontend_or_workers(self, timeout_ms: int) -> None:
        """Idle but for what the pens wait on (grammars compiling, adapters being read, P/D
        transfers): wake on a frontend message, a rank's answer or a pen's own socket or fd,
        so what it unblocks goes on at once rather than at the next ping."""
        poller = zmq.Poller()
        poller.register(self.frontend.req_sock, zmq.POLLIN)
        poller.register(self.link.results, zmq.POLLIN)
        for pen in self.pens:
            for source in pen.wake_sources():
                poller.register(source, zmq.POLLIN)
        poller.poll(timeout_ms)
        self._poll_frontend(0)

    def _settle_pens(self) -> None:
        """Between steps: each rank reply to the pen that owns its type, in arrival order,
        then every pen's tick (after the replies, so an answer beats its deadline)."""
        replies = self.link.replies
        if replies:
            self.link.replies = []
            for msg in replies:
                pen = self.reply_routes[type(msg)]
                self._settled(pen, pen.on_reply(msg))
        for pen in self.pens:
            self._settled(pen, pen.tick())

    def _settled(self, pen: HoldingPen, settled: Settled) -> None:
        """Released requests go on past ``pen``; failed ones and notices go to the frontend."""
        if settled.admit:
            start = self.pens.index(pen) + 1
            for req in settled.admit:
                self._admit(req, start)
        self._flush(list(settled.outputs))
        for notice in settled.notices:
            self._send_frontend(notice)

    def _wait_for_output(self, step_id: int) -> ModelRunnerOutput:
        """Block until rank 0's tokens for `step_id` arrive (and every rank's, with checksums)."""
        need = self.world_size if self.config.enable_checksum else 1
        # with two steps in flight a fast rank may answer step k+1 before a slow one answers k
        got = self.early_outputs.pop(step_id, {})
        while len(got) < need:
            frame = recv_frame(self.link.results, int(PING_INTERVAL_S * 1000))
            self.link.maybe_ping()
            self.link.check_alive()
            if frame is None:
                continue
            msg = self.link.decode(frame)
            if isinstance(msg, ModelRunnerOutput):
                if msg.step_id > step_id and any(
                    s.step_id == msg.step_id for s, _, _ in self.in_flight
                ):
                    self.early_outputs.setdefault(msg.step_id, {})[msg.rank] = msg
                    continue
                if msg.step_id != step_id:
                    raise EngineFatal(
                        f"rank {msg.rank} answered step {msg.step_id} while the engine waits "
                        f"for step {step_id}"
                    )
                got[msg.rank] = msg
            elif isinstance(msg, WorkerError):
                raise EngineFatal(self.link.describe_error(msg))
        if need > 1:
            sums = {r: o.checksum for r, o in got.items()}
            if len(set(sums.values())) != 1:
                raise EngineFatal(f"ranks sampled different tokens at step {step_id}: {sums}")
        return got[0]

    # ------------------------------------------------------------------ frontend side

    def _poll_frontend(self, timeout_ms: int) -> None:
        for frame in self.frontend.frames(timeout_ms):
            self._handle_frontend(frame)
        self.frontend.report_seen()

    def _handle_frontend(self, frame: bytes) -> None:
        try:
            msg = self.frontend.decode(frame)
        except ProtocolError as e:
            # One bad frame must not bring the engine down. When it names a request, that
            # request fails with the reason (its sender waits for an answer); an id already in
            # flight is another request's and is left alone.
            rid = request_id_of(frame) if len(frame) <= self.config.max_frame_bytes else None
            if rid is not None and rid not in self.inflight:
                self._reject(rid, f"the engine could not decode this request: {e}")
            else:
                logger.warning("dropped a bad frontend frame: %s", e)
            return
        if isinstance(msg, AddRequest):
            self._add_request(msg)
        elif isinstance(msg, AbortRequests):
            ids = [r for r in msg.request_ids if r in self.inflight]
            for pen in self.pens:
                self._flush(pen.abort(ids))
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            # Send the abort outputs (and free the ids) now: an AddRequest reusing an id in the
            # same burst must not be refused as a duplicate of the request just aborted.
            self._flush(self.scheduler.take_outputs())
        elif isinstance(msg, HealthRequest):
            self._send_frontend(self._health(msg.nonce))
        elif isinstance(msg, ProfileRequest):
            if msg.torch_profiler:
                self.link.pub.send(self.encoder.encode(ProfileControl(msg.enable, msg.trace_dir)))
            if msg.enable:
                self.timeline.start()
            else:
                self._send_frontend(
                    EngineStats(
                        stats=self.scheduler.get_stats(), step_timeline=self.timeline.stop()
                    )
                )
        elif isinstance(msg, ShutdownEngine):
            self.shutdown_requested = True
        elif type(msg) in self.control_routes:
            result = self.control_routes[type(msg)](msg)
            if result is not None:
                self._send_frontend(result)

    def _add_request(self, msg: AddRequest) -> None:
        if msg.request_id in self.inflight:
            # Don't touch the first request: only the duplicate is refused.
            self._reject(msg.request_id, f"request id {msg.request_id!r} is already in flight")
            return
        req = request_from(msg, self.vocab_size, self.eos_token_id, **self._intake_features)
        if isinstance(req, str):
            self._reject(msg.request_id, req)
            return
        self.inflight.add(msg.request_id)
        self._admit(req)

    def _requests_beside(self, pen: HoldingPen) -> Iterable[Request]:
        """The live requests outside ``pen``: the other pens' and the scheduler's."""
        others = (p.requests() for p in self.pens if p is not pen)
        return chain(chain.from_iterable(others), self.scheduler.requests.values())

    def _admit(self, req: Request, start: int = 0) -> None:
        """Offer ``req`` to each pen from ``start`` on (a released request goes on past the pen
        that held it), then give it to the scheduler; a pen may hold it or refuse it."""
        for pen in self.pens[start:]:
            held = pen.hold(req)
            if isinstance(held, str):
                self.inflight.discard(req.request_id)
                self._reject(req.request_id, held)
                return
            if held:
                return
        self.scheduler.add_request(req)

    def _reject(self, request_id: str, reason: str) -> None:
        self.frontend.reject(request_id, reason)

    def _flush(self, outputs: list[EngineCoreOutput]) -> None:
        self.frontend.flush(outputs)

    def _send_frontend(self, msg: msgspec.Struct) -> None:
        self.frontend.send(msg)

    def _health(self, nonce: int) -> HealthReport:
        now = time.monotonic()
        stats = self.scheduler.get_stats()
        return HealthReport(
            nonce=nonce,
            alive=[now - t < self.config.worker_timeout_s for t in self.link.last_seen],
            last_seen_s=[now - t for t in self.link.last_seen],
            steps=self.steps,
            num_running=int(stats.get("num_running", 0)),
            num_waiting=self.num_waiting(),
            kv_usage=float(stats.get("kv_usage", 0.0)),
            stats=self._stats_with_pens(stats),
            census=core_census(self),
        )

    def _stats_with_pens(self, stats: dict[str, float]) -> dict[str, float]:
        merged = dict(stats)
        for pen in self.pens:
            merged.update(pen.stats())
        return merged

    # ------------------------------------------------------------------ shutdown

    def fail_all(self, reason: str) -> None:
        """Every in-flight request ends with finish_reason 'error' and the reason."""
        outs = [
            EngineCoreOutput(request_id=r, new_token_ids=[], finish_reason="error", error=reason)
            for r in sorted(self.inflight)
        ]
        self.inflight.clear()
        try:
            if outs:
                self._send_frontend(EngineOutputs(outs, time.time()))
            self._send_frontend(EngineDead(reason))
        except zmq.ZMQError:
            pass

    def close(self, reason: str = "") -> None:
        scheduler: Scheduler | None = getattr(self, "scheduler", None)  # None before handshake
        if scheduler is not None:
            scheduler.close()  # finishes the scheduler trace file
            getattr(self, "kv_events", NO_PUBLISHER).close()  # sends what is left
        try:
            self.link.pub.send(self.encoder.encode(Shutdown(reason)))
        except zmq.ZMQError:
            pass
        self.link.close()
        self.frontend.close()
        for pen in self.pens:
            pen.close()


def main() -> int:
    logging.basicConfig(
        level=os.environ.get("TANDEM_LOG_LEVEL", "WARNING"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    raw = os.environ.get("TANDEM_CONFIG")
    config = msgspec.json.decode(raw.encode(), type=EngineConfig) if raw else EngineConfig()
    endpoints = Endpoints.from_env()
    if endpoints is None:
        sys.stderr.write("engine core: TANDEM_ENDPOINTS is not set\n")
        return 2
    world_size = int(os.environ.get("WORLD_SIZE", str(config.tensor_parallel_size)))
    core = EngineCore(config, endpoints, world_size)
    code = 0
    reason = "shutdown"
    try:
        core.handshake()
        core.run()
    except EngineFatal as e:
        reason = str(e)
        sys.stderr.write(f"engine core: {reason.splitlines()[0]}\n")
        code = 1
    except Exception as e:  # a bug here must still fail every request loudly
        import traceback

        reason = f"engine core crashed: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        sys.stderr.write(reason)
        code = 1
    finally:
        if code:
            core.fail_all(reason)
        core.close(reason)
    return code
