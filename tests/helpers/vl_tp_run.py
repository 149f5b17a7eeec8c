"""One TP rank of the VL model test: `python tests/helpers/vl_tp_run.py MODEL OUT`.

Loads its shard of MODEL, encodes GRIDS[:2] (tiny_vl.pixels) and runs the prompt holding those
two images; writes OUT/rank{R}.safetensors with "image.{i}" and "logits"."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.helpers.paged import Seq, build_step  # noqa: E402
from tests.helpers.tiny_vl import GRIDS, IMAGE, pixels, vl_prompt  # noqa: E402
from workers.model.loader import load_model  # noqa: E402
from workers.model.mrope import MMStep, mrope_positions  # noqa: E402
from workers.parallel.distributed import init_distributed  # noqa: E402


def main(model_path: str, out: str) -> None:
    torch.set_num_threads(1)  # two ranks share two cores
    env = init_distributed("cpu", timeout_s=60)
    model, _ = load_model(model_path, env.rank, env.world_size, torch.float32, env.device)
    grids = GRIDS[:2]
    images = model.encode_images(pixels(grids), grids)
    ids, spans = vl_prompt(grids, [5, 3, 4])
    model.allocate_kv_cache(8, 16)
    step_ids, step_pos, meta = build_step([Seq(ids, [1, 2, 3, 4])], [len(ids)], 16)
    index = torch.tensor([i for i, t in enumerate(ids) if t == IMAGE], dtype=torch.int64)
    model.mm_step = MMStep(torch.cat(images), index,
                           torch.from_numpy(mrope_positions(len(ids), spans)[0]))
    logits = model.compute_logits(model(step_ids, step_pos, meta))
    model.mm_step = None
    os.makedirs(out, exist_ok=True)
    tensors = {f"image.{i}": t.contiguous() for i, t in enumerate(images)}
    save_file(tensors | {"logits": logits.contiguous()},
              os.path.join(out, f"rank{env.rank}.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
