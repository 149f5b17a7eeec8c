"""--worker-overlap / --no-worker-overlap -> EngineConfig.worker_overlap, its default per device,
and the combination config_error refuses before anything starts."""

from __future__ import annotations

import argparse

from launch.args import add_engine_args, engine_options
from protocol.config import EngineConfig, config_error, worker_overlap_on


def parse(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return EngineConfig(**engine_options(p.parse_args(list(argv))))


def test_default_is_on_with_async_scheduling_on_cuda_only() -> None:
    assert parse().worker_overlap is None
    asynchronous = parse("--async-scheduling")
    assert worker_overlap_on(asynchronous, "cuda") and not worker_overlap_on(asynchronous, "cpu")
    assert not worker_overlap_on(parse(), "cuda")
    assert config_error(asynchronous) is None


def test_forced_on_and_off() -> None:
    on = parse("--async-scheduling", "--worker-overlap")
    off = parse("--async-scheduling", "--no-worker-overlap")
    assert worker_overlap_on(on, "cpu") and not worker_overlap_on(off, "cuda")
    assert config_error(on) is None and config_error(off) is None


def test_overlap_without_async_scheduling_is_refused() -> None:
    err = config_error(parse("--worker-overlap")) or ""
    assert "worker_overlap needs async_scheduling" in err
    assert config_error(parse("--no-worker-overlap")) is None
