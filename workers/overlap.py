"""Worker-loop overlap: a rank prepares step k+1 while its device runs step k.

With async scheduling the engine core sends step k+1 before it waits for step k's tokens. With
overlap on (EngineConfig.worker_overlap; by default on CUDA with async scheduling) a rank then
runs

    launch k | receive k+1, apply its diff, build and stage its inputs | wait for k's tokens,
    send them, write them into the batch | launch k+1 | ...

and the middle part is host work the device hides. Step k's tokens stay on the device and feed
step k+1's input ids there (workers/runner/pending_tokens.py); their one copy to the host runs on
a stream of its own (workers/runner/token_copy.py). What needs step k's tokens on the host
(the grammar matchers' advance before step k+1's masks, the KV tiers' copies after step k's
forward) waits for the launch of k+1, after k's finish, as without overlap; a step that
verifies drafts is finished before anything else is received.

A rank waits for step k+1's diff only while its device is still busy with step k: once step
k's tokens are ready it finishes step k at once, since the core may be waiting for them (at the
end of a burst there is no step k+1 to plan). On CUDA a helper thread sleeps on the step's
blocking-sync event and writes a byte to a pipe the worker's socket poll also watches, so the
loop blocks on both without spinning. On CPU every op has run when the launch returns, so the
rank takes step k+1 only if its diff is already there; the same code runs, with no gain.
"""

from __future__ import annotations

import os
import queue
import threading

import torch
import zmq

from protocol.transport import recv_frame
from workers.runner.token_copy import TokenTransfer


class DeviceWatch:
    """Wakes the worker's socket poll when the device has finished the step in flight."""

    def __init__(self, sub: zmq.Socket, device: torch.device) -> None:
        self.sub = sub
        self.device = device
        self._events: queue.SimpleQueue[torch.cuda.Event | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._r = self._w = -1
        self._poller: zmq.Poller | None = None
        self._owed = 0  # bytes the watcher writes (or wrote) for armed steps, not yet read

    def arm(self, t: TokenTransfer) -> None:
        """Watch the step whose tokens ``t`` brings (nothing to watch on CPU)."""
        if t.watch is None:
            return
        if self._thread is None:
            self._r, self._w = os.pipe()
            self._poller = zmq.Poller()
            self._poller.register(self.sub, zmq.POLLIN)
            self._poller.register(self._r, zmq.POLLIN)
            self._thread = threading.Thread(target=self._run, name="device-watch", daemon=True)
            self._thread.start()
        self._events.put(t.watch)
        self._owed += 1

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            ev = self._events.get()
            if ev is None:
                return
            ev.synchronize()  # a blocking-sync event: this thread sleeps, no core spins
            os.write(self._w, b"\0")

    def wait(self, timeout_ms: int) -> tuple[bytes | None, bool]:
        """(a frame that came while the device was busy, False), (None, True) once the device
        has finished the armed step, or (None, False) after ``timeout_ms`` of neither."""
        if not self._owed:  # finished already (CPU: at launch): take only what is queued
            frame = recv_frame(self.sub, 0)
            return frame, frame is None
        assert self._poller is not None
        ready = dict(self._poller.poll(timeout_ms))
        if self.sub in ready:
            frame = recv_frame(self.sub, 0)
            if frame is not None:
                return frame, False
        if self._r in ready:
            os.read(self._r, 1)
            self._owed -= 1
            return None, True
        return None, False

    def disarm(self) -> None:
        """The step was finished (its tokens waited for): read what the watcher owes."""
        while self._owed:
            os.read(self._r, 1)  # written right after the event the finish waited behind
            self._owed -= 1

    def close(self) -> None:
        if self._thread is not None:
            self._events.put(None)


class HostClock:
    """Splits a rank's host time between two launches into the part the device hid (the step
    before was still running on it) and the rest, for the step timeline; time blocked on the
    socket or on the device counts as neither.

    The device's end of a step is placed on the host clock from the step's own device time
    (token_copy.py); on CPU it is the end of the launch, so nothing shows as hidden there.
    """

    def __init__(self) -> None:
        self._since: float | None = None  # when the last launch returned
        self._device_end = 0.0
        self._blocked: list[tuple[float, float]] = []

    def blocked(self, start: float, end: float) -> None:
        if self._since is not None and end > start:
            self._blocked.append((start, end))

    def device_done(self, at: float) -> None:
        """The step launched last is through on the device at host time ``at``."""
        self._device_end = at

    def launched(self, t_launch: float, t_returned: float) -> tuple[float, float]:
        """A step launched at ``t_launch``: (hidden, not hidden) host time in microseconds
        since the launch before it returned."""
        hidden = exposed = 0.0
        since = self._since
        if since is not None:
            split = min(max(self._device_end, since), t_launch)
            hidden = self._busy(since, split)
            exposed = self._busy(split, t_launch)
        self._since = t_returned
        self._device_end = t_returned
        self._blocked = []
        return hidden * 1e6, exposed * 1e6

    def _busy(self, start: float, end: float) -> float:
        if end <= start:
            return 0.0
        idle = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self._blocked)
        return max(0.0, end - start - idle)
