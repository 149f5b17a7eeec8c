"""The frontend's connection to the engine core: send requests, route outputs to their callers.

A background thread owns the PULL socket and hands each engine message's EngineCoreOutputs to the
sinks of their requests, one list per sink and message: a per-output hand-off cost a thread
wake-up and a GIL switch per request per step. Callers own no socket. When the engine dies
(EngineDead, or a process the supervisor saw exit) every unfinished request gets finish_reason
"error" with the cause. Every request passes the bound on waiting requests (launch/admission.py)
before it is sent.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from engine_core.frontend.validation import (
    validate_cache_salt,
    validate_job,
    validate_priority,
    validate_request_id,
    validate_sampling,
)
from engine_core.lora.registry import identity_error
from launch.admission import QueueBound, Ticket
from launch.request_options import NO_OPTIONS, RequestOptions
from protocol.codec import Encoder, ProtocolError, engine_decoder, pack
from protocol.lora import LoRARequest
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
    LoadLoRA,
    LoRAResult,
    ProfileRequest,
    SamplingParams,
    ShutdownEngine,
    UnloadLoRA,
)
from protocol.transport import Endpoints, make_socket, recv_frame, secret_from_env

# What a sink receives: (request, its new output, engine time) for every request of that sink
# in one engine message.
Delivery = list[tuple["Tracked", EngineCoreOutput, float]]
Sink = queue.Queue[Delivery]


class EngineDeadError(RuntimeError):
    """The engine is gone; the message says why."""


@dataclass
class Tracked:
    """Frontend-side state of one in-flight request."""

    request_id: str
    index: int
    sink: Sink
    arrival_time: float
    prompt_token_ids: list[int] = field(default_factory=list)


class EngineClient:
    def __init__(self, endpoints: Endpoints, max_frame_bytes: int = 64 * 1024 * 1024,
                 max_queued_requests: int | None = None) -> None:
        secret = secret_from_env()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.push = make_socket(self.ctx, zmq.PUSH, endpoints.requests, bind=False, secret=secret)
        self.pull = make_socket(self.ctx, zmq.PULL, endpoints.outputs, bind=False, secret=secret)
        self.encoder = Encoder()
        self.decoder = engine_decoder(max_frame_bytes)
        self.send_lock = threading.Lock()
        self.tracked: dict[str, Tracked] = {}
        self.tracked_lock = threading.Lock()
        self.ready: EngineReady | None = None
        self.ready_event = threading.Event()
        self.dead_reason: str | None = None
        self.replies: queue.Queue[msgspec.Struct] = queue.Queue()
        # callers waiting for a LoRAResult, by the call id their ask carried (an answer
        # whose caller gave up finds no box and is dropped)
        self._lora_waiters: dict[int, queue.Queue[LoRAResult]] = {}
        self._lora_calls = itertools.count(1)
        self.admission = QueueBound(max_queued_requests)
        self._health_nonces: set[int] = set()  # health calls waiting for their report
        self._ids = itertools.count()
        self._closing = False
        self._thread = threading.Thread(target=self._recv_loop, name="tandem-outputs", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ sending

    def _send(self, msg: msgspec.Struct, ticket: Ticket | None = None) -> None:
        """Send one frame; with a ticket it is an AddRequest taking one of the ticket's slots."""
        with self.send_lock:  # the encoder's buffer and the socket are not thread-safe
            self.push.send(self.encoder.encode(msg))
            self.admission.on_frame_sent(ticket)  # in send order, as the core reads them

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        sink: Sink,
        index: int = 0,
        options: RequestOptions = NO_OPTIONS,
        ticket: Ticket | None = None,
    ) -> Tracked:
        """Send one request. `ticket`: a slot held for it under the queue bound; without one,
        a slot is taken here (QueueFullError when the queue is full)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if ticket is None:
            with self.admission.reserve(1) as own:
                return self.add_request(request_id, prompt_token_ids, params, sink, index,
                                        options, own)
        now = time.time()
        tr = Tracked(request_id, index, sink, now, list(prompt_token_ids))
        with self.tracked_lock:
            if request_id in self.tracked:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self.tracked[request_id] = tr
        # the engine core's own checks, first here: a value msgpack cannot carry (an int past
        # 64 bits) would otherwise raise in the encoder instead of failing this request
        err = (validate_request_id(request_id) or validate_sampling(params)
               or validate_priority(options.priority) or validate_job(options.job)
               or validate_cache_salt(options.cache_salt))
        if err is None and options.lora is not None:
            err = identity_error(options.lora)
        if err is not None:
            self._finish_locally(tr, err)
            return tr
        try:
            packed = pack(prompt_token_ids)
        except (OverflowError, TypeError) as e:
            self._finish_locally(tr, f"prompt token ids are not int32 values: {e}")
            return tr
        self._send(AddRequest(request_id=request_id, prompt_token_ids=packed,
                              sampling_params=params, arrival_time=now, options=options),
                   ticket)
        return tr

    def abort(self, request_ids: Sequence[str]) -> None:
        if request_ids and self.dead_reason is None:
            self._send(AbortRequests(list(request_ids)))

    def health(self, timeout_s: float = 5.0) -> HealthReport:
        nonce = int(time.monotonic_ns() & 0x7FFFFFFF)
        self._health_nonces.add(nonce)
        try:
            self._send(HealthRequest(nonce))
            return self._reply(HealthReport, timeout_s, lambda r: r.nonce == nonce)
        finally:
            self._health_nonces.discard(nonce)

    def profile(
        self,
        enable: bool,
        trace_dir: str = "",
        torch_profiler: bool = True,
        timeout_s: float = 30.0,
    ) -> EngineStats | None:
        self._send(ProfileRequest(enable, trace_dir, torch_profiler))
        if enable:
            return None
        return self._reply(EngineStats, timeout_s)

    def load_lora(self, lora: LoRARequest, timeout_s: float = 600.0) -> LoRAResult:
        """Register an adapter; the answer comes once every rank has read it."""
        err = identity_error(lora)
        if err is not None:
            return LoRAResult(lora_name=lora.lora_name, error=err)
        call_id = next(self._lora_calls)
        return self._lora_call(lora.lora_name, call_id, LoadLoRA(lora, call_id), timeout_s)

    def unload_lora(self, lora_name: str, timeout_s: float = 30.0) -> LoRAResult:
        """Forget an adapter (refused with ``in_use`` while requests use it)."""
        call_id = next(self._lora_calls)
        return self._lora_call(lora_name, call_id, UnloadLoRA(lora_name, call_id), timeout_s)

    def _lora_call(self, name: str, call_id: int, msg: msgspec.Struct,
                   timeout_s: float) -> LoRAResult:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        box: queue.Queue[LoRAResult] = queue.Queue()
        with self.tracked_lock:
            self._lora_waiters[call_id] = box
        try:
            self._send(msg)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    return box.get(timeout=0.1)
                except queue.Empty:
                    if self.dead_reason is not None:
                        raise EngineDeadError(self.dead_reason) from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"no answer from the engine about LoRA adapter {name!r} in "
                            f"{timeout_s} s") from None
        finally:
            with self.tracked_lock:
                self._lora_waiters.pop(call_id, None)

    def _reply(self, kind: type, timeout_s: float,  # type: ignore[no-untyped-def]
               match: Callable[[Any], bool] | None = None):
        deadline = time.monotonic() + timeout_s
        while True:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            try:
                msg = self.replies.get(timeout=max(0.0, min(0.1, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no {kind.__name__} from the engine in {timeout_s} s"
                    ) from None
                continue
            if isinstance(msg, kind) and (match is None or match(msg)):
                return msg
            if isinstance(msg, HealthReport) and msg.nonce in self._health_nonces:
                self.replies.put(msg)  # another thread's answer
                time.sleep(0.001)
            # else: a report whose caller timed out (stale: it must answer nobody) or a reply
            # nobody waits for

    # ------------------------------------------------------------------ receiving

    def _recv_loop(self) -> None:
        while not self._closing:
            try:
                frame = recv_frame(self.pull, 100)
            except zmq.ZMQError:
                return
            if frame is None:
                continue
            try:
                msg = self.decoder.decode(frame)
            except ProtocolError as e:
                self.mark_dead(f"undecodable message from the engine core: {e}")
                return
            if isinstance(msg, EngineOutputs):
                self.admission.on_report(msg.frames_seen, msg.num_waiting)
                self._dispatch(msg)
            elif isinstance(msg, EngineReady):
                self.ready = msg
                self.ready_event.set()
            elif isinstance(msg, EngineDead):
                self.mark_dead(msg.reason)
            elif isinstance(msg, LoRAResult):
                with self.tracked_lock:
                    box = self._lora_waiters.get(msg.call_id)
                if box is not None:
                    box.put(msg)
            else:
                self.replies.put(msg)

    def _dispatch(self, batch: EngineOutputs) -> None:
        ts = batch.timestamp
        by_sink: dict[Sink, Delivery] = {}  # queues hash by identity
        with self.tracked_lock:
            for out in batch.outputs:
                tr = self.tracked.get(out.request_id)
                if tr is None:
                    continue
                if out.finish_reason is not None:
                    del self.tracked[out.request_id]
                by_sink.setdefault(tr.sink, []).append((tr, out, ts))
        for sink, delivery in by_sink.items():
            sink.put(delivery)

    def census(self) -> dict[str, int]:
        """This object's maps that grow with client input (launch/census.py)."""
        with self.tracked_lock:
            tracked = len(self.tracked)
            lora_calls = len(self._lora_waiters)
        return {"client.tracked": tracked, "client.replies": self.replies.qsize(),
                "client.lora_calls": lora_calls,
                **self.admission.census()}

    def _finish_locally(self, tr: Tracked, reason: str) -> None:
        with self.tracked_lock:
            self.tracked.pop(tr.request_id, None)
        out = EngineCoreOutput(
            request_id=tr.request_id, new_token_ids=[], finish_reason="error", error=reason
        )
        tr.sink.put([(tr, out, time.time())])

    def mark_dead(self, reason: str) -> None:
        """Fail every unfinished request with `reason` (idempotent)."""
        if self.dead_reason is None:
            self.dead_reason = reason
        with self.tracked_lock:
            pending = list(self.tracked.values())
            self.tracked.clear()
        now = time.time()
        for tr in pending:
            out = EngineCoreOutput(
                request_id=tr.request_id, new_token_ids=[], finish_reason="error", error=reason
            )
            tr.sink.put([(tr, out, now)])
        self.ready_event.set()

    def shutdown_engine(self) -> None:
        if self.dead_reason is None:
            try:
                self._send(ShutdownEngine())
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        self._closing = True
        self._thread.join(timeout=1.0)
        self.push.close(0)
        self.pull.close(0)
