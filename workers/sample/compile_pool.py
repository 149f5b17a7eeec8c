"""A small FIFO pool of daemon threads for grammar compiles.

Why not ThreadPoolExecutor: its threads are joined when the interpreter exits, so a
pathological schema still compiling (xgrammar cannot be interrupted) would keep a frontend or a
worker rank alive until it finished, long after its request was failed for taking too long.
Here the threads are daemons and a queued compile whose future was cancelled is skipped; a
future is marked running when its compile starts, so a caller that gave up can tell whether it
ever left the queue.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class CompilePool:
    def __init__(self, num_threads: int, name: str) -> None:
        self._num_threads = num_threads
        self._name = name
        self._threads: list[threading.Thread] = []
        self._queue: deque[tuple[Future[Any], Callable[[], Any]]] = deque()
        self._cv = threading.Condition()
        self._closed = False

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the grammar compile pool is closed")
            self._queue.append((fut, fn))
            if len(self._threads) < self._num_threads:
                t = threading.Thread(target=self._run, daemon=True,
                                     name=f"{self._name}-{len(self._threads)}")
                self._threads.append(t)
                t.start()
            self._cv.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                fut, fn = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled while queued: its requests are gone
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - the future carries it to the waiter
                fut.set_exception(e)
            else:
                fut.set_result(result)

    def close(self) -> None:
        """Cancel what is queued; a running compile finishes on its (daemon) thread."""
        with self._cv:
            self._closed = True
            queued, self._queue = self._queue, deque()
            self._cv.notify_all()
        for fut, _ in queued:
            fut.cancel()
