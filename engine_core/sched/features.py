"""The seams where optional features meet the scheduler.

Two kinds of seam, so the base passes (schedule, admission, running pass) read without
feature branches:

- ``SchedulerFeature``: notifications with no-op defaults (a request arrived, was admitted,
  preempted, finished; a step was built; a step's results were applied; stats, invariants,
  close). The Scheduler keeps the enabled features in a ``Hooks`` table and calls, for each
  hook, only the features that override it: with no feature on, a hook is an empty loop.
- Decisions that really differ per feature are calls on objects that are always present; the
  null objects below stand in when the feature is off (``NoSlots`` admits every adapter,
  ``NoRestore`` restores nothing, ``NoPins`` relieves nothing, ``NoRemoteKV`` loads nothing,
  ``NoDrafts`` proposes nothing).

A new feature (another draft model) subclasses ``SchedulerFeature`` and implements the
decision protocol it changes; the passes do not change. The encoder's decisions (images:
engine_core/multimodal/scheduling.py) are ``EncoderPlan``'s, ``NoEncoder`` when images are off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine_core.kv_cache.block import KVCacheBlock
    from engine_core.kv_cache.coordinator import KVCacheBlocks
    from engine_core.kv_cache.single_type_manager import TableKey
    from engine_core.request import Request, RequestStatus
    from engine_core.sched.step_diff import StepDiff
    from protocol.lora import LoRASlotOp
    from protocol.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput


class SchedulerFeature:
    """A feature's notifications from the scheduler; every hook defaults to doing nothing.

    Hooks are called in the order the features were enabled (offload, continuum, connector,
    LoRA, trace): stats keep that key order, and the trace records a step after the features
    that add to its output."""

    def tick(self) -> None:
        """The scheduler is entered (a request arrives or is aborted, a step is planned or
        applied): clock-driven state moves on."""

    def refuse(self, req: Request) -> str | None:
        """A reason to refuse an arriving request the base checks let through, or None."""
        return None

    def on_arrival(self, req: Request, refused: bool) -> None:
        """``req`` arrived (and joined the waiting queue unless ``refused``)."""

    def on_abort(self, request_ids: list[str], reason: str) -> None:
        """The engine was asked to finish these requests (some may be unknown)."""

    def begin_step(self) -> None:
        """Before the step allocates anything: give back what expired, requeue what settled."""

    def on_admitted(self, req: Request, num_hit_tokens: int) -> None:
        """``req`` got its blocks and joins the running set, ``num_hit_tokens`` already held."""

    def on_preempt(self, req: Request, num_written_tokens: int) -> None:
        """``req`` is preempted; its blocks (KV written for ``num_written_tokens``) are still
        held and are freed right after."""

    def on_finish(self, req: Request, status: RequestStatus) -> None:
        """``req`` finished (status set); its blocks are still held and are freed right after
        (a feature may keep them: a pin, a lease)."""

    def after_free(self, req: Request) -> None:
        """``req``'s blocks went back; forget what was kept for it."""

    def before_build(self, diff: StepDiff) -> None:
        """The step's decisions are final: add the feature's part of the diff."""

    def on_step_built(self, so: SchedulerOutput, diff: StepDiff, step_id: int) -> None:
        """The step's output is built: add the feature's metadata, record the step."""

    def on_model_output(self, model_output: ModelRunnerOutput) -> None:
        """A step's results arrived (before they are applied): take the feature's figures."""

    def after_update(self, step_id: int, outputs: list[EngineCoreOutput],
                     kv_load: list[list[int]] | None) -> None:
        """The step's results were applied; ``kv_load``: offload reads that settled."""

    def has_work(self) -> bool:
        """An operation the ranks must be sent even when no request runs."""
        return False

    def stats(self) -> dict[str, float]:
        return {}

    def held_tables(self) -> Iterable[list[KVCacheBlock]]:
        """Block tables the feature holds outside the running set (they count as holders)."""
        return ()

    def exempt_ids(self) -> Iterable[TableKey]:
        """Tables the feature holds under a request id while that request is not running."""
        return ()

    def check(self, running: list[Request]) -> None:
        """The feature's own invariants (debug_invariants, property tests)."""

    def close(self) -> None:
        """The engine stops: give back what is held, finish files."""


HOOK_NAMES = (
    "tick", "refuse", "on_arrival", "on_abort", "begin_step", "on_admitted", "on_preempt",
    "on_finish", "after_free", "before_build", "on_step_built", "on_model_output",
    "after_update", "has_work", "stats", "held_tables", "exempt_ids", "check", "close",
)


class Hooks:
    """For each hook, the bound methods of the enabled features that override it.

    Rebuilt (in place, so the passes may hold on to it) when a feature is attached or
    detached after construction: the connector and the trace are."""

    tick: list[Callable[[], None]]
    refuse: list[Callable[[Request], str | None]]
    on_arrival: list[Callable[[Request, bool], None]]
    on_abort: list[Callable[[list[str], str], None]]
    begin_step: list[Callable[[], None]]
    on_admitted: list[Callable[[Request, int], None]]
    on_preempt: list[Callable[[Request, int], None]]
    on_finish: list[Callable[[Request, RequestStatus], None]]
    after_free: list[Callable[[Request], None]]
    before_build: list[Callable[[StepDiff], None]]
    on_step_built: list[Callable[[SchedulerOutput, StepDiff, int], None]]
    on_model_output: list[Callable[[ModelRunnerOutput], None]]
    after_update: list[Callable[[int, list[EngineCoreOutput], list[list[int]] | None], None]]
    has_work: list[Callable[[], bool]]
    stats: list[Callable[[], dict[str, float]]]
    held_tables: list[Callable[[], Iterable[list[KVCacheBlock]]]]
    exempt_ids: list[Callable[[], Iterable[TableKey]]]
    check: list[Callable[[list[Request]], None]]
    close: list[Callable[[], None]]

    def __init__(self) -> None:
        self.features: list[SchedulerFeature] = []
        for name in HOOK_NAMES:
            setattr(self, name, [])

    def set(self, features: Iterable[SchedulerFeature]) -> None:
        self.features = list(features)
        for name in HOOK_NAMES:
            default = getattr(SchedulerFeature, name)
            bound: list[Any] = getattr(self, name)
            bound[:] = [getattr(f, name) for f in self.features
                        if getattr(type(f), name) is not default]

    def __iter__(self) -> Iterator[SchedulerFeature]:
        return iter(self.features)


# ---------------------------------------------------------------------- decisions


class EncoderPlan(Protocol):
    """Which images a chunk needs encoded or read, and where the chunk must stop (images)."""

    encodes: bool  # False: plan() never cuts, the passes skip it

    def plan(self, req: Request, computed: int, n: int) -> tuple[int, list[int]]:
        """The chunk's tokens as far as its images fit this step, and the images it needs."""
        ...

    def commit(self, req: Request, needed: list[int]) -> None:
        """The chunk got its KV: encode or reference its images."""
        ...


class SlotPolicy(Protocol):
    """Which waiting requests' adapters may take a device slot this pass (LoRA)."""

    def begin_pass(self) -> None: ...

    def skip(self, req: Request) -> bool:
        """Admission passes over ``req`` this pass (its adapter gets no slot)."""
        ...

    def acquire(self, req: Request) -> None: ...

    def release(self, req: Request) -> None: ...

    def take_ops(self) -> list[LoRASlotOp] | None:
        """The slot loads / evictions for this step's diff (None: the feature is off)."""
        ...


class NoSlots:
    """Without LoRA every request is admitted and holds no slot."""

    def begin_pass(self) -> None:
        pass

    def skip(self, req: Request) -> bool:
        return False

    def acquire(self, req: Request) -> None:
        pass

    def release(self, req: Request) -> None:
        pass

    def take_ops(self) -> list[LoRASlotOp] | None:
        return None


class Restorer(Protocol):
    """Blocks past the device prefix hit that come back from a slower tier (KV offload)."""

    def blocks_to_restore(self, req: Request, num_hit_tokens: int) -> int | None:
        """How many blocks after the hit to restore; None: its prefix is still being read,
        admission stops until it is."""
        ...

    def on_restored(self, num_restored_blocks: int) -> None: ...

    def absorb(self, model_output: ModelRunnerOutput) -> list[list[int]] | None:
        """Take the tier's part of a step's results; the reads that settled, if any."""
        ...


class NoRestore:
    def blocks_to_restore(self, req: Request, num_hit_tokens: int) -> int | None:
        return 0

    def on_restored(self, num_restored_blocks: int) -> None:
        pass

    def absorb(self, model_output: ModelRunnerOutput) -> list[list[int]] | None:
        return None


class PinRelief(Protocol):
    """Blocks held for requests that are not running (continuum pins) that may go back."""

    def relieve(self, for_req: Request | None, strict: bool) -> bool:
        """Give one pin back to make room; False when none may go."""
        ...

    def blocks_to_fit(self, req: Request, hits: KVCacheBlocks, running: bool) -> int:
        """Blocks ``req`` needs free before it is admitted beside the pins (0: no check)."""
        ...


class NoPins:
    def relieve(self, for_req: Request | None, strict: bool) -> bool:
        return False

    def blocks_to_fit(self, req: Request, hits: KVCacheBlocks, running: bool) -> int:
        return 0


class RemoteKV(Protocol):
    """KV that another engine computed for a request (disaggregated prefill / decode)."""

    def loads_async(self, req: Request, num_hit_tokens: int) -> int:
        """Tokens to load from the remote engine before ``req`` may run (0: none, admit it
        as usual); it is then set aside while they arrive."""
        ...

    def on_set_aside(self, req: Request, num_hit_tokens: int, num_external: int) -> None: ...


class NoRemoteKV:
    def loads_async(self, req: Request, num_hit_tokens: int) -> int:
        return 0

    def on_set_aside(self, req: Request, num_hit_tokens: int, num_external: int) -> None:
        pass


class Drafter(Protocol):
    """Speculative drafts for a decoding request (set on the request). ``proposes`` is False
    only for the null drafter: the running pass reads it once per step and then skips the call
    for every request (a no-op call per decoding request cost the pass about a tenth)."""

    proposes: bool

    def draft(self, req: Request) -> None: ...


class NoDrafts:
    proposes = False

    def draft(self, req: Request) -> None:
        pass
