"""Multi-LoRA cost at the runner level (one rank, no IPC): what serving adapters adds to a step.

Rank-16 adapters on all seven projections (written as PEFT directories for the model's shapes)
and, per repeat and interleaved (A/B/A/B...) over two runners of each kind, the median step
time of:

- decode at batch 64 and a prefill of 8 x 512 tokens: LoRA disabled, LoRA enabled with
  base-model traffic only, and every request on an adapter with 1, 8 and 32 distinct adapters
  in the batch (32 slots; the prefill's 8 requests use at most 8 of them);
- cold load (read + check + slice an adapter into the host cache) and warm swap (a slot op
  from the host cache);
- thrash: 16 adapters over 8 slots, each step admits 8 short requests whose adapters are not
  in the slots (8 swaps per step), against the same steps with the adapters already there.

    python scripts/bench_lora.py [--model dummy:tiny | HF dir] [--repeats 5] --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from safetensors.torch import save_file  # noqa: E402

from protocol.codec import pack  # noqa: E402
from protocol.config import EngineConfig  # noqa: E402
from protocol.lora import LoRARequest, LoRASlotOp, LoRAStep  # noqa: E402
from protocol.lora_files import content_hash  # noqa: E402
from protocol.messages import NewRequestData, SamplingParams, SchedulerOutput  # noqa: E402
from workers.lora.peft_config import PROJECTIONS  # noqa: E402
from workers.model.loader import load_model_config  # noqa: E402
from workers.parallel.distributed import DistEnv  # noqa: E402
from workers.runner.model_runner import ModelRunner  # noqa: E402

BS = 16


def write_adapter(path: str, model: str, rank: int, seed: int) -> str:
    """A PEFT LoRA directory with random A and B for every projection of every layer."""
    cfg = load_model_config(model)
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for p, block in PROJECTIONS.items():
            n_in, n_out = dims[p]
            name = f"base_model.model.model.layers.{i}.{block}.{p}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.05
            tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.05
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                   "target_modules": list(PROJECTIONS)}, f)
    return path


class Timing(NamedTuple):
    wall: float  # seconds
    cpu: float  # this thread's CPU seconds (torch runs in it with --threads 1): what other
    # processes on a shared machine do not inflate


class LoRABench:
    """One runner and the requests it is running; every wave finishes the previous one."""

    def __init__(self, model: str, max_len: int, **lora: object) -> None:
        cfg = EngineConfig(model=model, block_size=BS, max_num_seqs=64, max_model_len=max_len,
                           num_gpu_blocks_override=600,
                           max_num_batched_tokens=8 * max_len, **lora)  # type: ignore[arg-type]
        self.runner = ModelRunner(cfg, DistEnv(0, 1, 0, torch.device("cpu"), "gloo"))
        self.runner.load_model()
        self.vocab = load_model_config(model).vocab_size
        self.runner.init_kv_cache()
        self.step_id = 0
        self.handle = 0
        self.running: list[int] = []
        self.paths: dict[int, str] = {}
        self.hashes: dict[int, str] = {}

    def prepare(self, lora_int_id: int, path: str) -> float:
        t0 = time.perf_counter()
        self.hashes[lora_int_id] = content_hash(path)
        err = self.runner.prepare_lora(LoRARequest(f"a{lora_int_id}", lora_int_id, path),
                                       self.hashes[lora_int_id])
        assert not err, err
        self.paths[lora_int_id] = path
        return time.perf_counter() - t0

    def op(self, slot: int, lora_int_id: int) -> LoRASlotOp:
        return LoRASlotOp(slot=slot, lora_int_id=lora_int_id, lora_name=f"a{lora_int_id}",
                          lora_path=self.paths[lora_int_id], content_hash=self.hashes[lora_int_id])

    def wave(self, prompt_len: int, loras: list[int], ops: list[LoRASlotOp]) -> Timing:
        """Admit len(loras) requests with their whole prompts (one step); its seconds."""
        handles = list(range(self.handle, self.handle + len(loras)))
        self.handle += len(loras)
        blocks = -(-(prompt_len + 64) // BS)
        new = [NewRequestData(handle=h, prompt_token_ids=pack([(h * 7 + j) % (self.vocab - 1) + 1
                                                              for j in range(prompt_len)]),
                              sampling_params=SamplingParams(temperature=0.0),
                              block_ids=pack(list(range(1 + i * blocks, 1 + (i + 1) * blocks))),
                              num_computed_tokens=0, num_scheduled_tokens=prompt_len)
               for i, h in enumerate(handles)]
        with_lora = [(h, w) for h, w in zip(handles, loras, strict=True) if w]
        lora = None
        if ops or with_lora:
            lora = LoRAStep(ops=ops, handles=pack([h for h, _ in with_lora]),
                            lora_int_ids=pack([w for _, w in with_lora]))
        so = SchedulerOutput(step_id=self.step_id, new_reqs=new,
                             finished_handles=pack(self.running), num_running=len(handles),
                             total_num_scheduled_tokens=prompt_len * len(handles), lora=lora)
        self.running = handles
        return self._run(so)

    def decode(self, steps: int) -> list[Timing]:
        n = len(self.running)
        return [self._run(SchedulerOutput(step_id=self.step_id, num_running=n,
                                          total_num_scheduled_tokens=n)) for _ in range(steps)]

    def _run(self, so: SchedulerOutput) -> Timing:
        t0, c0 = time.perf_counter(), time.thread_time()
        self.runner.execute(so)
        self.step_id += 1
        return Timing(time.perf_counter() - t0, time.thread_time() - c0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="repeats run first and dropped")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (one rank's share)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        paths = {i: write_adapter(os.path.join(tmp, f"a{i}"), args.model, args.rank, i)
                 for i in range(1, 33)}
        result = run(args, paths)
    if not args.json:
        for k, v in result.items():
            print(f"{k}: {v}")
    print(json.dumps(result))


def run(args: argparse.Namespace, paths: dict[int, str]) -> dict:
    # a prefill of 8 x 512 tokens (fewer where the model's context is shorter), decodes of 64
    max_len = min(576, load_model_config(args.model).max_position_embeddings)
    prompt = max_len - 64
    # Two runners of each kind, built alternately: two runners of the same kind differ by a
    # few percent (where their buffers landed), which must not pass for LoRA's cost.
    offs, ons = [], []
    for _ in range(2):
        offs.append(LoRABench(args.model, max_len))
        ons.append(LoRABench(args.model, max_len, enable_lora=True, max_loras=32,
                         max_lora_rank=args.rank, max_cpu_loras=48))
    cold = [ons[0].prepare(i, p) for i, p in paths.items()]
    for i, p in paths.items():
        ons[1].prepare(i, p)
    for b in ons:
        b.wave(4, [0], [b.op(s, s + 1) for s in range(32)])  # all 32 in their slots
    on = ons[0]

    cases = {"disabled": (offs, 0), "enabled_base": (ons, 0), "adapters_1": (ons, 1),
             "adapters_8": (ons, 8), "adapters_32": (ons, 32)}
    decode: dict[str, list[Timing]] = {k: [] for k in cases}
    prefill: dict[str, list[Timing]] = {k: [] for k in cases}
    for rep in range(args.warmup + args.repeats):  # interleaved: every case once per repeat
        for name, (benches, k) in cases.items():
            loras = [1 + i % k if k else 0 for i in range(64)]
            for b in benches:
                b.wave(64, loras, [])
                steps = b.decode(args.decode_steps)
                pre = b.wave(prompt, loras[:8], [])
                if rep >= args.warmup:
                    decode[name].append(Timing(*(statistics.median(x)
                                                 for x in zip(*steps, strict=True))))
                    prefill[name].append(pre)

    # warm swaps: a slot op whose adapter is in the host cache
    swap = []
    for i in range(args.repeats * 4):
        t0 = time.perf_counter()
        on.runner.lora.apply_ops([on.op(i % 32, 1 + (i + 7) % 32)])
        swap.append(time.perf_counter() - t0)

    thrash = LoRABench(args.model, max_len, enable_lora=True, max_loras=8, max_lora_rank=args.rank,
                   max_cpu_loras=16)
    for i in range(1, 17):
        thrash.prepare(i, paths[i])
    swapping, steady = [], []
    for r in range(args.repeats * 4):
        group = [1 + 8 * (r % 2) + s for s in range(8)]  # adapters 1-8, then 9-16, ...
        swapping.append(thrash.wave(16, group, [thrash.op(s, w) for s, w in enumerate(group)]))
        steady.append(thrash.wave(16, group, []))

    def ms(xs: list[float]) -> float:
        return round(statistics.median(xs) * 1e3, 3)

    def table(runs: dict[str, list[Timing]], field: str) -> dict[str, float]:
        return {k: ms([getattr(t, field) for t in v]) for k, v in runs.items()}

    def pct(t: dict[str, float], a: str, b: str) -> float:
        return round(100 * (t[a] / t[b] - 1), 2)

    result: dict = {"model": args.model, "rank": args.rank, "threads": args.threads,
                    "prefill_tokens_per_request": prompt,
                    "repeats": args.repeats, "kernel_path": on.runner.lora.state.path_name}
    for field in ("wall", "cpu"):
        d, p = table(decode, field), table(prefill, field)
        result |= {
            f"decode64_{field}_ms": d, f"prefill_8x512_{field}_ms": p,
            f"decode64_{field}_enabled_base_vs_disabled_pct": pct(d, "enabled_base", "disabled"),
            f"decode64_{field}_adapters_8_vs_disabled_pct": pct(d, "adapters_8", "disabled"),
            f"prefill_{field}_enabled_base_vs_disabled_pct": pct(p, "enabled_base", "disabled"),
            f"prefill_{field}_adapters_8_vs_disabled_pct": pct(p, "adapters_8", "disabled"),
        }
    result |= {
        "cold_load_ms": ms(cold), "warm_swap_ms": ms(swap),
        "thrash_16_over_8_step_ms": ms([t.wall for t in swapping]),
        "thrash_no_swap_step_ms": ms([t.wall for t in steady]),
    }
    return result


if __name__ == "__main__":
    main()
