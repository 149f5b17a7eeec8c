"""The seam a rank's optional features plug into: LoRA, the KV connector, the KV offload tiers,
grammars (structured outputs), and the next ones (an encoder cache, EAGLE drafts).

A feature is a ``StepHook`` that overrides the points where it acts; every point has a no-op
default, so the model runner's step and the rank loop call them without asking which features
are on. ``StepHooks`` keeps, per point, only the features that override it: a point nobody uses
costs an empty loop, and a rank without optional features runs the same step as before.

A step's points, in order (prepare -> launch -> finish, workers/runner/model_runner.py):

- prepare: ``before_diff`` (slot ops that the batch's new rows look up), the batch applies the
  diff, ``after_diff`` (checks over the applied batch), the inputs are built, ``on_inputs`` (per-row
  state for this forward; True when the step cannot replay a CUDA graph);
- launch, after the step before has finished: ``on_launch`` (the diff's copies and loads, also for
  a step with nothing scheduled), ``before_forward`` (work that overlaps the forward, or must land
  before it), the forward, ``masks_logits`` / ``on_logits`` (edit the logits before sampling);
- finish, tokens on the host: ``after_sampling`` (advance per-request state by the tokens, report
  failed requests), ``step_end`` (fields of the step's ModelRunnerOutput).

The rank loop (workers/worker.py) dispatches the broadcast messages a feature owns through one
table built from ``messages`` and calls ``poll`` each loop turn for background work whose answers
are sent from the loop (``busy``: such work is outstanding, wake up sooner). Start-up points:
``worst_case`` / ``reserved_bytes`` (the KV cache's profile), ``connect``; and ``census``,
``close``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import msgspec
    import numpy as np
    import torch

    from protocol.messages import SchedulerOutput
    from workers.runner.batch_inputs import BatchInputs

Reply = Callable[["msgspec.Struct"], None]  # sends a message to the engine core
Handler = Callable[[Any], None]  # one broadcast message a feature owns


class StepHook:
    """One optional feature of a rank. Override the points it acts at; the rest are no-ops."""

    # ------------------------------------------------------------------ start-up
    def worst_case(self) -> AbstractContextManager[None]:
        """Held around the KV cache's profile forward: the feature's heaviest per-token work."""
        return nullcontext()

    def reserved_bytes(self) -> int:
        """Device bytes the feature allocated before the KV cache is sized."""
        return 0

    def connect(self, results_addr: str, reply: Reply) -> None:
        """The rank is connected to the engine core: ``reply`` sends it a message."""

    # ------------------------------------------------------------------ the rank loop
    def messages(self) -> dict[type, Handler]:
        """The broadcast message types this feature handles, and their handlers."""
        return {}

    def poll(self) -> None:
        """Each loop turn: answer the background work that is done."""

    def busy(self) -> bool:
        """Background work is outstanding: the loop wakes up sooner to answer it."""
        return False

    # ------------------------------------------------------------------ prepare
    def before_diff(self, so: SchedulerOutput) -> None:
        """Before the batch applies the step's diff (and may still be read by the step in
        flight)."""

    def after_diff(self, so: SchedulerOutput) -> None:
        """After the batch applied the diff, before the inputs are built."""

    def on_inputs(self, inputs: BatchInputs) -> bool:
        """The step's inputs are built; True: this step must run eagerly (no CUDA graph)."""
        return False

    # ------------------------------------------------------------------ launch
    def on_launch(self, so: SchedulerOutput) -> None:
        """The step before has finished; nothing of this step is queued yet."""

    def before_forward(self, handles: np.ndarray, inputs: BatchInputs) -> None:
        """Right before the forward (``handles``: the sampling rows' requests)."""

    def masks_logits(self) -> bool:
        """Whether this step's logits go through ``on_logits`` (then the sampler never takes
        the vocab-shard argmax shortcut)."""
        return False

    def on_logits(self, logits: torch.Tensor, greedy: bool) -> torch.Tensor | None:
        """Edit the sampling rows' float32 logits in place before sampling. ``greedy``: every
        row is greedy, with no drafts and no logprobs; then the feature may return the tokens
        itself, which ends the sampling of this step."""
        return None

    # ------------------------------------------------------------------ finish
    def after_sampling(self, sampled: np.ndarray, counts: np.ndarray | None,
                       failed: dict[int, str]) -> None:
        """The step's tokens are on the host (``counts`` per request when drafts were
        verified, else one each); add requests that failed to ``failed`` (handle -> why)."""

    def step_end(self, fields: dict[str, Any]) -> None:
        """Add this feature's fields to the step's ModelRunnerOutput."""

    # ------------------------------------------------------------------ always
    def census(self, out: dict[str, int]) -> None:
        """Add {map: size} of the feature's maps that grow with client input."""

    def close(self) -> None:
        """The rank is going down: finish or drop the feature's background work."""


class StepHooks:
    """Per point, the bound hooks of the features that override it, in the features' order."""

    def __init__(self, features: list[StepHook]) -> None:
        def bound(name: str) -> list[Any]:
            base = getattr(StepHook, name)
            return [getattr(f, name) for f in features if getattr(type(f), name) is not base]

        self.features = features
        self.worst_case: list[Callable[[], AbstractContextManager[None]]] = bound("worst_case")
        self.reserved_bytes: list[Callable[[], int]] = bound("reserved_bytes")
        self.connect: list[Callable[[str, Reply], None]] = bound("connect")
        self.poll: list[Callable[[], None]] = bound("poll")
        self.busy: list[Callable[[], bool]] = bound("busy")
        self.before_diff: list[Callable[[SchedulerOutput], None]] = bound("before_diff")
        self.after_diff: list[Callable[[SchedulerOutput], None]] = bound("after_diff")
        self.on_inputs: list[Callable[[BatchInputs], bool]] = bound("on_inputs")
        self.on_launch: list[Callable[[SchedulerOutput], None]] = bound("on_launch")
        self.before_forward: list[Callable[[np.ndarray, BatchInputs], None]] = \
            bound("before_forward")
        # features that may edit logits; masks_logits() asks each step
        self.logits: list[StepHook] = [f for f in features
                                       if type(f).on_logits is not StepHook.on_logits]
        self.after_sampling: list[Callable[[np.ndarray, np.ndarray | None, dict[int, str]],
                                           None]] = bound("after_sampling")
        self.step_end: list[Callable[[dict[str, Any]], None]] = bound("step_end")
        self.census: list[Callable[[dict[str, int]], None]] = bound("census")
        self.close: list[Callable[[], None]] = bound("close")

    def messages(self) -> dict[type, Handler]:
        """message type -> handler; two features claiming one type is a wiring error."""
        table: dict[type, Handler] = {}
        for f in self.features:
            for kind, handler in f.messages().items():
                if kind in table:
                    raise ValueError(f"two rank features handle {kind.__name__}")
                table[kind] = handler
        return table

    def logit_hooks(self) -> list[StepHook]:
        """The features that edit this step's logits."""
        return [f for f in self.logits if f.masks_logits()]
