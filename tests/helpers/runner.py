"""A ModelRunner on dummy:micro in this process (TP=1, gloo-free), for worker tests."""

from __future__ import annotations

import torch

from protocol.config import EngineConfig
from workers.parallel.distributed import DistEnv
from workers.runner.model_runner import ModelRunner

BS = 4  # block size of the runners below
NUM_BLOCKS = 200


def make_runner(max_model_len: int = 128, **kw: object) -> ModelRunner:
    cfg = EngineConfig(
        model="dummy:micro",
        block_size=BS,
        max_num_seqs=4,
        max_model_len=max_model_len,
        num_gpu_blocks_override=NUM_BLOCKS,
        **kw,  # type: ignore[arg-type]
    )
    dist = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    r = ModelRunner(cfg, dist)
    r.load_model()
    assert r.init_kv_cache() == NUM_BLOCKS
    return r
