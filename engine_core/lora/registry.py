"""Registered adapters, and the requests that wait outside the scheduler until every rank has one.

An adapter is registered the first time the engine core sees it, in an AddRequest or a LoadLoRA:
1. its two files must exist (else the request or load is refused at once, naming the file);
2. their content hash is computed on a helper thread (a large adapter takes a moment to read,
   and steps go on meanwhile);
3. PrepareLoRA goes to every rank, which reads, checks and keeps its slice in host memory;
4. once every rank answered LoRAReady, the held requests go on (to the grammar gate or the
   scheduler) and the loads are answered. A rank's error fails the held requests and the loads
   with its message, and the adapter is forgotten (so a fixed directory can be loaded again).

Ids and names are one-to-one: a LoRARequest whose id is registered under another name or path,
or whose name is registered under another id, is refused. Unloading is by name and refused
while any request uses the adapter. A base-model request never comes here.
"""

from __future__ import annotations

import enum
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from engine_core.request import Request
from protocol.lora import LoRARequest
from protocol.lora_files import content_hash, missing_file
from protocol.messages import (
    DropLoRA,
    EngineCoreOutput,
    LoadLoRA,
    LoRAReady,
    LoRAResult,
    PrepareLoRA,
    UnloadLoRA,
)

if TYPE_CHECKING:
    from engine_core.lora.slots import LoRASlots

INT32_MAX = 2**31 - 1  # adapter ids travel as packed int32 in the step diff

NOT_ENABLED = ("LoRA adapters are not enabled: start the engine with --enable-lora "
               "(enable_lora=True)")

logger = logging.getLogger("tandem.lora")


class State(enum.Enum):
    HASHING = 0  # reading its files for the content hash
    PREPARING = 1  # PrepareLoRA sent, waiting for every rank
    READY = 2


@dataclass(eq=False)
class _Adapter:
    lora: LoRARequest
    state: State = State.HASHING
    content_hash: str = ""
    ready: set[int] = field(default_factory=set)  # ranks that answered LoRAReady
    held: list[Request] = field(default_factory=list)  # requests waiting for READY
    loads: list[int] = field(default_factory=list)  # call ids of the LoadLoRA answers owed


class LoRARegistry:
    def __init__(self, world_size: int, publish: Callable[[msgspec.Struct], None]) -> None:
        self.world_size = world_size
        self._publish = publish  # broadcast to every rank
        self._by_id: dict[int, _Adapter] = {}
        self._by_name: dict[str, int] = {}
        self._held_ids: dict[str, int] = {}  # held request id -> adapter id
        # (rank, adapter id): answers still to come from a registration that failed before
        # that rank answered; they must not count for a later registration of the same id
        self._stale: Counter[tuple[int, int]] = Counter()
        self._drops: list[int] = []  # DropLoRA held until the step that empties the slot
        self._pool: ThreadPoolExecutor | None = None
        self._hashing: dict[int, Future[str]] = {}
        # the hashing thread writes a byte here when it is done, so an idle engine core that
        # polls this fd beside its sockets wakes up at once
        self.wakeup_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wakeup_fd, False)
        self.results: list[LoRAResult] = []  # LoadLoRA answers for the frontend

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def busy(self) -> bool:
        """Requests held, files being hashed or ranks still to answer."""
        return any(a.state is not State.READY for a in self._by_id.values())

    @property
    def num_held(self) -> int:
        return len(self._held_ids)

    def held_requests(self) -> Iterable[Request]:
        for a in self._by_id.values():
            yield from a.held

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held_ids

    # ------------------------------------------------------------------ requests and loads

    def route(self, req: Request) -> Request | str | None:
        """An adapter request from the frontend: the request itself when its adapter is ready
        (``lora_hash`` set), an error that refuses it, or None while it is held here."""
        assert req.lora is not None
        a = self._find_or_register(req.lora)
        if isinstance(a, str):
            return a
        if a.state is State.READY:
            req.lora_hash = a.content_hash
            return req
        a.held.append(req)
        self._held_ids[req.request_id] = req.lora_int_id
        return None

    def load(self, lora: LoRARequest, call_id: int = 0) -> None:
        """LoadLoRA: answered in ``results``, now or once every rank has it."""
        a = self._find_or_register(lora)
        if isinstance(a, str):
            self.results.append(LoRAResult(lora_name=lora.lora_name, error=a, call_id=call_id))
        elif a.state is State.READY:
            self.results.append(LoRAResult(lora_name=lora.lora_name, call_id=call_id))
        else:
            a.loads.append(call_id)

    def _find_or_register(self, lora: LoRARequest) -> _Adapter | str:
        err = identity_error(lora)
        if err is not None:
            return err
        lid = lora.lora_int_id
        a = self._by_id.get(lid)
        if a is not None:
            known = a.lora
            if known.lora_name != lora.lora_name or known.lora_path != lora.lora_path:
                # no paths in the answer: the registered one may be another client's
                return (f"LoRA id {lid} is registered for adapter {known.lora_name!r} with "
                        f"another lora_path, not for {lora.lora_name!r} at this one")
            return a
        other = self._by_name.get(lora.lora_name)
        if other is not None:
            return (f"LoRA adapter {lora.lora_name!r} is registered with lora_int_id {other}, "
                    f"not {lid}")
        if lid in self._drops:
            return f"LoRA id {lid} is still being unloaded: try again"
        missing = missing_file(lora.lora_path)
        if missing is not None:
            # the file's name, not its path: answers carry no server paths
            return (f"LoRA adapter {lora.lora_name!r}: {os.path.basename(missing)} not found "
                    "in its lora_path")
        a = _Adapter(lora)
        self._by_id[lid] = a
        self._by_name[lora.lora_name] = lid
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-lora-hash")
        fut = self._pool.submit(content_hash, lora.lora_path)
        fut.add_done_callback(self._wake)
        self._hashing[lid] = fut
        return a

    def _wake(self, _: Future[str]) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # closed at shutdown, or the pipe is full (a wake-up is pending)
            pass

    def poll(self) -> list[EngineCoreOutput]:
        """Broadcast PrepareLoRA for the adapters whose hash is done; the outputs of requests
        whose adapter could not be read."""
        try:
            while os.read(self.wakeup_fd, 4096):
                pass
        except BlockingIOError:
            pass
        failed: list[EngineCoreOutput] = []
        for lid, fut in list(self._hashing.items()):
            if not fut.done():
                continue
            del self._hashing[lid]
            a = self._by_id[lid]
            exc = fut.exception()
            if exc is not None:
                logger.warning("LoRA adapter %r: cannot read %r: %s", a.lora.lora_name,
                               a.lora.lora_path, exc)
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
                    type(exc).__name__
                failed += self._fail(a, f"LoRA adapter {a.lora.lora_name!r}: cannot read its "
                                        f"files ({reason})")
                continue
            a.content_hash = fut.result()
            a.state = State.PREPARING
            self._publish(PrepareLoRA(a.lora, a.content_hash))
        return failed

    def settle(self, replies: list[LoRAReady]) -> tuple[list[Request], list[EngineCoreOutput]]:
        """Once per engine loop: hashes done, then the ranks' answers (``replies`` is emptied).
        Returns the requests that may go on and the outputs of those that failed; the loads'
        answers are in ``results``."""
        failed = self.poll() if self._hashing else []  # no syscall on a plain step
        go: list[Request] = []
        for msg in replies:
            ok, bad = self.answer(msg)
            go += ok
            failed += bad
        replies.clear()
        return go, failed

    def take_results(self) -> list[LoRAResult]:
        results, self.results = self.results, []
        return results

    def answer(self, msg: LoRAReady) -> tuple[list[Request], list[EngineCoreOutput]]:
        """A rank's LoRAReady: (requests that may go on now, outputs of failed requests)."""
        key = (msg.rank, msg.lora_int_id)
        if self._stale[key]:
            self._stale[key] -= 1
            if not self._stale[key]:
                del self._stale[key]
            return [], []
        a = self._by_id.get(msg.lora_int_id)
        if a is None or a.state is not State.PREPARING:
            return [], []
        if msg.error:
            for rank in range(self.world_size):
                if rank != msg.rank and rank not in a.ready:
                    self._stale[(rank, msg.lora_int_id)] += 1
            # ranks that accepted it forget it again
            self._publish(DropLoRA(msg.lora_int_id))
            return [], self._fail(a, f"LoRA adapter {a.lora.lora_name!r} refused by worker "
                                     f"rank {msg.rank}: {msg.error}")
        a.ready.add(msg.rank)
        if len(a.ready) < self.world_size:
            return [], []
        a.state = State.READY
        go, a.held = a.held, []
        for req in go:
            del self._held_ids[req.request_id]
            req.lora_hash = a.content_hash
        self.results += [LoRAResult(lora_name=a.lora.lora_name, call_id=c) for c in a.loads]
        a.loads = []
        return go, []

    def _fail(self, a: _Adapter, message: str) -> list[EngineCoreOutput]:
        del self._by_id[a.lora.lora_int_id]
        del self._by_name[a.lora.lora_name]
        self.results += [LoRAResult(lora_name=a.lora.lora_name, error=message, call_id=c)
                         for c in a.loads]
        outs = []
        for req in a.held:
            del self._held_ids[req.request_id]
            outs.append(EngineCoreOutput(request_id=req.request_id, new_token_ids=[],
                                      finish_reason="error", error=message))
        return outs

    def abort(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Drop held requests among ``request_ids``; their abort outputs."""
        outs = []
        for rid in request_ids:
            lid = self._held_ids.pop(rid, None)
            if lid is None:
                continue
            a = self._by_id[lid]
            a.held = [r for r in a.held if r.request_id != rid]
            outs.append(EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason="abort"))
        return outs

    # ------------------------------------------------------------------ unload

    def unload(self, name: str, users: Iterable[Request], slots: LoRASlots | None,
               call_id: int = 0) -> LoRAResult:
        """UnloadLoRA: refused while a request (``users``: the scheduler's and the grammar
        gate's, besides the ones held here) uses it; else forget it and empty its slot. The
        ranks are told (DropLoRA) after the step that empties the slot, if it had one."""
        lid = self._by_name.get(name)
        if lid is None:
            return LoRAResult(lora_name=name, call_id=call_id, not_found=True,
                              error=f"LoRA adapter {name!r} is not loaded")
        a = self._by_id[lid]
        if a.state is not State.READY:
            return LoRAResult(lora_name=name, call_id=call_id, in_use=True,
                              error=f"LoRA adapter {name!r} is still being loaded")
        n = len(a.held) + sum(1 for r in users if r.lora_int_id == lid)
        if n:
            return LoRAResult(lora_name=name, call_id=call_id, in_use=True,
                              error=f"LoRA adapter {name!r} is in use by {n} request(s)")
        del self._by_id[lid]
        del self._by_name[name]
        if slots is not None and slots.forget(lid):
            self._drops.append(lid)
        else:
            self._publish(DropLoRA(lid))
        return LoRAResult(lora_name=name, call_id=call_id)

    def after_publish(self) -> None:
        """A step was published: the slots it empties are empty on every rank by the time the
        ranks read what follows it, so the held DropLoRA can go."""
        drops, self._drops = self._drops, []
        for lid in drops:
            self._publish(DropLoRA(lid))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for fd in (self.wakeup_fd, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def control(
    registry: LoRARegistry | None,
    msg: LoadLoRA | UnloadLoRA,
    users: Callable[[], Iterable[Request]],
    slots: LoRASlots | None,
) -> LoRAResult | None:
    """The engine core's answer to LoadLoRA / UnloadLoRA now (None: a load answered later,
    through ``results``). ``users``: the requests outside the registry that may use an
    adapter (the scheduler's, the grammar gate's)."""
    if isinstance(msg, LoadLoRA):
        if registry is None:
            return LoRAResult(lora_name=msg.lora.lora_name, error=NOT_ENABLED,
                              call_id=msg.call_id)
        registry.load(msg.lora, msg.call_id)
        return None
    if registry is None:
        return LoRAResult(lora_name=msg.lora_name, error=NOT_ENABLED, not_found=True,
                          call_id=msg.call_id)
    return registry.unload(msg.lora_name, users(), slots, msg.call_id)


def identity_error(lora: LoRARequest) -> str | None:
    """What is wrong with a LoRARequest on its own (before the registry looks it up)."""
    lid = lora.lora_int_id
    if not isinstance(lid, int) or isinstance(lid, bool) or not 1 <= lid <= INT32_MAX:
        return f"lora_int_id must be an integer in [1, {INT32_MAX}], got {lid!r}"
    if not lora.lora_name:
        return "lora_name must not be empty"
    if not lora.lora_path:
        return "lora_path must not be empty"
    return None
