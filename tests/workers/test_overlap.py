"""The worker loop's overlap parts that need no model: the device watch (a frame while the device
is busy, the wake-up when it is done) and the host clock's split of host time."""

from __future__ import annotations

import threading

import pytest
import torch
import zmq

from workers.overlap import DeviceWatch, HostClock
from workers.runner.token_copy import TokenTransfer


class Gate:
    """Stands in for a step's blocking CUDA event: synchronize() returns once opened."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def synchronize(self) -> None:
        assert self.opened.wait(30)


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    ctx = zmq.Context()  # its own: inproc names live as long as their context
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://overlap-test")
    b.connect("inproc://overlap-test")
    yield a, b
    a.close(0)
    b.close(0)
    ctx.term()


def test_a_frame_while_busy_then_the_wake_up_when_done(pair) -> None:  # type: ignore[no-untyped-def]
    core, sub = pair
    watch = DeviceWatch(sub, torch.device("cpu"))
    try:
        gate = Gate()
        watch.arm(TokenTransfer(0.0, 0.0, watch=gate))  # type: ignore[arg-type]
        assert watch.wait(10) == (None, False)  # nothing came and the device is busy
        core.send(b"step k+1")
        assert watch.wait(10_000) == (b"step k+1", False)
        gate.opened.set()
        assert watch.wait(10_000) == (None, True)
        assert watch.wait(10_000) == (None, True)  # done stays done: only queued frames
        # armed and finished without the wake-up being read: disarm reads it
        gate2 = Gate()
        watch.arm(TokenTransfer(0.0, 0.0, watch=gate2))  # type: ignore[arg-type]
        gate2.opened.set()
        watch.disarm()
        assert watch.wait(10_000) == (None, True)
    finally:
        watch.close()


def test_nothing_to_watch_on_cpu_takes_only_queued_frames(pair) -> None:  # type: ignore[no-untyped-def]
    core, sub = pair
    watch = DeviceWatch(sub, torch.device("cpu"))
    watch.arm(TokenTransfer(0.0, 0.0))  # CPU: the step ran in its launch
    assert watch.wait(10_000) == (None, True)
    core.send(b"x")
    frame = None
    for _ in range(1000):  # inproc delivery is asynchronous
        frame, done = watch.wait(10_000)
        if frame is not None:
            break
    assert frame == b"x"


def test_host_clock_splits_at_the_device_end() -> None:
    clock = HostClock()
    assert clock.launched(0.0, 1.0) == (0.0, 0.0)  # nothing before the first launch
    # overlap: prepare 1..3 while the device runs to 5, wait 3..5, hand on 5..6, launch at 6
    clock.blocked(3.0, 5.0)
    clock.device_done(5.0)
    hidden, exposed = clock.launched(6.0, 6.5)
    assert (hidden, exposed) == pytest.approx((2e6, 1e6))
    # in order: the device ends at 7, hand on 7..8, socket 8..9.5, prepare 9.5..10
    clock.blocked(6.5, 7.0)
    clock.device_done(7.0)
    clock.blocked(8.0, 9.5)
    assert clock.launched(10.0, 10.5) == pytest.approx((0.0, 1.5e6))
    # the device ended inside the prepare (10.5..12, device done at 11): half hidden
    clock.device_done(11.0)
    assert clock.launched(12.0, 12.5) == pytest.approx((0.5e6, 1e6))
