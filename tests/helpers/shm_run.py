"""One rank of tests/workers/parallel/test_shm_comm.py: shared-memory collectives against gloo's."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from workers.parallel import distributed  # noqa: E402
from workers.parallel.shm_comm import SLOT_BYTES, PeerGone  # noqa: E402


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    env = distributed.init_distributed("cpu")
    rank, world = env.rank, env.world_size
    result: dict = {"shm": distributed._shm is not None}
    if mode == "die":
        if rank == 1:
            os._exit(0)  # gone without a word, as a killed rank would be
        try:
            distributed.tp_all_reduce(torch.ones(8))
            result["error"] = None
        except PeerGone as e:
            result["error"] = str(e)
    else:
        g = torch.Generator().manual_seed(rank)
        errs = {}
        # small, exactly one slot, several slots (chunked)
        for numel in (1, 3 * 256, SLOT_BYTES // 4, SLOT_BYTES // 4 * 2 + 17):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(numel, generator=g).to(dtype)
                ref = x.clone()
                dist.all_reduce(ref)  # gloo
                got = distributed.tp_all_reduce(x.clone())
                errs[f"{numel}-{dtype}"] = (got.float() - ref.float()).abs().max().item()
        result["reduce_err"] = errs
        # every rank must hold identical bits (they sample from these sums)
        y = distributed.tp_all_reduce(torch.randn(1000, generator=g))
        every = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(every, y)
        result["identical"] = all(torch.equal(e, every[0]) for e in every)
        pair = torch.tensor([[float(rank), 10.0 * rank]])
        result["gather"] = distributed.tp_all_gather(pair, dim=0).tolist()
        # a step's logits: many slots' worth, gathered in row chunks, along either dim
        ok = True
        for rows, cols in ((300, 4099), (7, 1 << 17), (1, 5)):
            z = torch.randn(rows, cols, generator=g)
            ref_parts = [torch.empty_like(z) for _ in range(world)]
            dist.all_gather(ref_parts, z)
            for dim in (0, -1):
                ok &= torch.equal(distributed.tp_all_gather(z, dim=dim),
                                  torch.cat(ref_parts, dim=dim))
        result["big_gather_equal"] = ok
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if mode != "die":
        dist.barrier()
        dist.destroy_process_group()
    # Skip interpreter teardown: gloo's threads can abort a process that exits while a peer
    # still tears down its side of the group.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
