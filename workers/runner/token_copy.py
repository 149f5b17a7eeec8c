"""The one device-to-host copy of a step: its sampled tokens (and their logprobs).

On CUDA the copy runs on a stream of its own into persistent pinned buffers, after the step's
sampling on the compute stream, and nothing waits for it until the tokens are sent: the host
meanwhile receives and prepares the next step. Two events end it: `done`, which the worker
waits on (spinning, as a synchronous copy would), and `watch`, a blocking-sync event a helper
thread sleeps on to wake the worker's socket poll when the device is through (workers/overlap.py).
A timing event at the step's launch gives the device's time for the step (launch to copy done),
which places the end of the device's work on the host clock for the step timeline.

On CPU every op has run when the step's launch returns: the tokens are ready at once and the
device's time for the step is the launch itself. The same calls run, so CI exercises them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(eq=False)
class TokenTransfer:
    """The tokens of one launched step on their way to the host."""

    t_launch: float  # perf_counter at the step's launch
    t_ready: float  # CPU: when the launch returned (the work was done); CUDA: set by wait()
    tokens: torch.Tensor | None = None  # device int32 (kept alive until the copy is done)
    logprobs: torch.Tensor | None = None
    host_tokens: np.ndarray | None = None
    host_logprobs: np.ndarray | None = None
    start: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None
    watch: torch.cuda.Event | None = None
    waited: tuple[float, float] = (0.0, 0.0)  # perf_counter interval the host blocked in wait()

    def wait(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Block until the tokens are on the host; returns (tokens, logprobs) as host arrays
        this object owns (copies: the pinned buffers serve the next step)."""
        if self.done is not None:
            t0 = time.perf_counter()
            self.done.synchronize()
            t1 = time.perf_counter()
            self.waited = (t0, t1)
            assert self.start is not None
            self.t_ready = self.t_launch + self.start.elapsed_time(self.done) / 1e3
            self.done = None
            if self.host_tokens is not None:
                self.host_tokens = self.host_tokens.copy()
            if self.host_logprobs is not None:
                self.host_logprobs = self.host_logprobs.copy()
            self.tokens = self.logprobs = None
        return self.host_tokens, self.host_logprobs


class TokenCopy:
    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._tokens: torch.Tensor | None = None
        self._logprobs: torch.Tensor | None = None
        if self.cuda:
            self._alloc(max_rows)

    def _alloc(self, rows: int) -> None:
        self._tokens = torch.empty(rows, dtype=torch.int32, pin_memory=True)
        self._logprobs = torch.empty(rows, dtype=torch.float32, pin_memory=True)

    def begin(self) -> TokenTransfer:
        """At a step's launch, before any of its device work is queued."""
        t = TokenTransfer(t_launch=time.perf_counter(), t_ready=0.0)
        if self.cuda:
            t.start = torch.cuda.Event(enable_timing=True)
            t.start.record()
        return t

    def start(self, t: TokenTransfer, tokens: torch.Tensor | None,
              logprobs: torch.Tensor | None) -> None:
        """Queue the copy of the step's sampled ``tokens`` (None: it sampled nothing)."""
        if not self.cuda:
            t.host_tokens = (np.zeros(0, dtype=np.int32) if tokens is None
                             else tokens.to(torch.int32).numpy())
            t.host_logprobs = None if logprobs is None else logprobs.float().numpy()
            t.t_ready = time.perf_counter()
            return
        assert self.stream is not None and self._tokens is not None
        assert self._logprobs is not None
        n = 0 if tokens is None else len(tokens)
        if n > len(self._tokens):
            self._alloc(n)
        compute = torch.cuda.current_stream(self.device)
        t.tokens = None if tokens is None else tokens.to(torch.int32)
        t.logprobs = None if logprobs is None else logprobs.float()
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            if t.tokens is not None:
                self._tokens[:n].copy_(t.tokens, non_blocking=True)
            if t.logprobs is not None:
                self._logprobs[:n].copy_(t.logprobs, non_blocking=True)
            t.done = torch.cuda.Event(enable_timing=True)
            t.done.record(self.stream)
            t.watch = torch.cuda.Event(blocking=True)
            t.watch.record(self.stream)
        t.host_tokens = self._tokens.numpy()[:n]
        t.host_logprobs = None if t.logprobs is None else self._logprobs.numpy()[:n]

    def ready(self, t: TokenTransfer, tokens: np.ndarray, logprobs: np.ndarray | None) -> None:
        """The step's tokens came to the host by another way (draft verification)."""
        t.host_tokens, t.host_logprobs = tokens, logprobs
        t.done = t.watch = None
        t.t_ready = time.perf_counter()
