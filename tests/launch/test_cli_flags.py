"""Launcher flags that no other test exercised: --allow-tf32 and --health."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import msgspec
import pytest
import torch

from launch.args import add_engine_args, engine_options
from protocol.config import EngineConfig
from tests.helpers.procs import wait_no_descendants


def parse(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return EngineConfig(**engine_options(p.parse_args(list(argv))))


def test_allow_tf32_reaches_the_config_the_workers_get() -> None:
    assert parse().allow_tf32 is False  # float32 stays exact unless asked
    cfg = parse("--allow-tf32")
    assert cfg.allow_tf32 is True
    # workers receive the config as JSON (TANDEM_CONFIG) or over the wire: the flag survives
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=EngineConfig).allow_tf32 is True


def test_allow_tf32_leaves_cpu_runs_alone() -> None:
    """On CPU the flag changes nothing: torch's CUDA matmul precision flags stay as they were."""
    from tests.helpers.runner import make_runner

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    make_runner(allow_tf32=True)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: TF32 applies to CUDA matmuls only")
@pytest.mark.parametrize("allow", [True, False])
def test_allow_tf32_sets_cuda_matmul_precision(allow: bool) -> None:
    from workers.parallel.distributed import DistEnv
    from workers.runner.model_runner import ModelRunner

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not allow
        config = EngineConfig(model="dummy:micro", dtype="float32", allow_tf32=allow)
        dist = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0),
                       backend="nccl")
        ModelRunner(config, dist).load_model()
        assert torch.backends.cuda.matmul.allow_tf32 is allow
        assert torch.backends.cudnn.allow_tf32 is allow
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_health_prints_every_rank_alive_and_exits() -> None:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "launch", "--model", "dummy:micro", "--nproc-per-node", "2",
             "--device", "cpu", "--kv-cache-memory", "8M", "--health"],
            capture_output=True, text=True, timeout=180,
        )
    finally:
        assert wait_no_descendants(10) == []
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["alive"] == [True, True]
    assert len(report["last_seen_s"]) == 2 and all(s >= 0 for s in report["last_seen_s"])
    assert isinstance(report["steps"], int)
