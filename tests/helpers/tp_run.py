"""One TP rank for multi-process model tests: `python tests/helpers/tp_run.py SPEC.json`.

Reads RANK/WORLD_SIZE/MASTER_* like a torchrun worker, loads its shard, then writes
OUT/rank{R}.pt with {"logits": [per-prompt prefill logits, all prompts in one batch],
"generated": [greedy tokens of each prompt through the paged cache],
"greedy": model.greedy_tokens over every prefill position, concatenated}.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.helpers.paged import Seq, build_step, greedy_generate, run_step  # noqa: E402
from workers.model.loader import load_model  # noqa: E402
from workers.parallel.distributed import init_distributed  # noqa: E402


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)  # two ranks share two cores
    env = init_distributed("cpu", timeout_s=60)
    model, _ = load_model(spec["model"], env.rank, env.world_size, torch.float32, env.device)
    bs = 4
    prompts: list[list[int]] = spec["prompts"]
    max_new = int(spec.get("max_new", 0))
    need = sum(-(-(len(p) + max_new) // bs) for p in prompts)
    model.allocate_kv_cache(2 * need + 1, bs)
    seqs, next_block = [], 1
    for p in prompts:
        n = -(-len(p) // bs)
        seqs.append(Seq(list(p), list(range(next_block, next_block + n))))
        next_block += n
    logits = run_step(model, seqs, [len(p) for p in prompts], bs)
    # The same prefill again (rewrites identical K/V) for the shard-wise greedy argmax.
    for s in seqs:
        s.num_computed = 0
    ids, pos, meta = build_step(seqs, [len(p) for p in prompts], bs)
    greedy = model.greedy_tokens(model(ids, pos, meta)).tolist()
    generated = [greedy_generate(model, p, max_new, bs, next_block, spec.get("eos"))
                 for p in prompts] if max_new else []
    os.makedirs(spec["out"], exist_ok=True)
    # tensors as safetensors and the rest as JSON: nothing the parent reads is unpickled
    base = os.path.join(spec["out"], f"rank{env.rank}")
    save_file({f"logits.{i}": t.contiguous() for i, t in enumerate(logits)},
              base + ".safetensors")
    with open(base + ".json", "w") as f:
        json.dump({"generated": generated, "greedy": greedy, "num_prompts": len(logits)}, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
