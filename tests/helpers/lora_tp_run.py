"""One TP rank of the LoRA runner tests: `python tests/helpers/lora_tp_run.py SPEC.json`.

Builds a ModelRunner with LoRA on the spec's base model (RANK/WORLD_SIZE/MASTER_* as under
torchrun, gloo), runs tests.helpers.lora.run_spec and writes OUT/rank{R}.json (each wave's
greedy tokens).
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from tests.helpers.lora import lora_config, run_spec  # noqa: E402
from workers.parallel.distributed import init_distributed  # noqa: E402
from workers.runner.model_runner import ModelRunner  # noqa: E402


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)  # two ranks share two cores
    dist = init_distributed("cpu", timeout_s=60)
    runner = ModelRunner(lora_config(spec["base"], **spec.get("config", {})), dist)
    runner.load_model()
    runner.init_kv_cache()
    waves = run_spec(runner, spec)
    os.makedirs(spec["out"], exist_ok=True)
    with open(os.path.join(spec["out"], f"rank{dist.rank}.json"), "w") as f:
        json.dump(waves, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
