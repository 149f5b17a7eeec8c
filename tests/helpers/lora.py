"""LoRA test fixtures: a tiny HF Llama with PEFT adapters, peft's own greedy tokens for them,
and a driver that runs a ModelRunner with adapters through hand-built step diffs."""

from __future__ import annotations

import os

import torch

from protocol.codec import pack, unpack
from protocol.config import EngineConfig
from protocol.lora import LoRASlotOp, LoRAStep
from protocol.lora_files import content_hash
from protocol.messages import NewRequestData, SamplingParams, SchedulerOutput
from workers.runner.model_runner import ModelRunner

# 6 query / 3 KV heads and an odd intermediate size: at TP=2 a KV head, its query heads and
# one MLP row are padding, so the LoRA slices must follow the base layout's padding exactly
BASE_SHAPE = dict(hidden_size=96, intermediate_size=129, num_attention_heads=6,
                  num_key_value_heads=3)
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (name, LoraConfig keywords): ranks 8/16/32, one rsLoRA, one on q and v only, one with
# per-module rank and alpha patterns (PEFT's suffix-regex keys)
ADAPTERS = [
    ("qv8", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
    ("all16rs", dict(r=16, lora_alpha=8, use_rslora=True, target_modules=ALL7)),
    ("all32", dict(r=32, lora_alpha=48, target_modules=ALL7,
                   rank_pattern={"layers.1.mlp.up_proj": 8}, alpha_pattern={"o_proj": 20})),
]
BS = 4


def lora_case(num_tokens: int, dtype: torch.dtype, device: torch.device, packed: bool,
              seed: int = 0, num_slots: int = 4, rank: int = 16, in_features: int = 64,
              offsets: tuple[int, ...] = (0, 64, 80, 96)):
    """Slot buffers (the Triton layout if ``packed``, else the torch paths') of a packed target
    with output column ranges ``offsets``, filled through SlotBuffers.write with random
    adapters (slot 1's of half the rank: zero padding), an input, an output and token slots
    with base-model tokens and an empty slot 2: (bufs, weights per slot, x, y, token_slots)."""
    import numpy as np

    from workers.lora.slots import SlotBuffers
    from workers.lora.weights import LoRATarget, TargetWeights

    ns = len(offsets) - 1
    target = LoRATarget(0, "t", "self_attn", False, tuple(f"p{j}" for j in range(ns)),
                        in_features, offsets[-1], in_features, (), (), offsets)
    gen = torch.Generator().manual_seed(seed)
    bufs = SlotBuffers(target, num_slots, rank, dtype, device, packed)
    weights = []
    for s in range(num_slots):
        r = rank // 2 if s == 1 else rank
        w = TargetWeights(torch.randn(ns, r, in_features, generator=gen).to(dtype),
                          torch.randn(offsets[-1], r, generator=gen).to(dtype))
        bufs.write(s, w)
        weights.append(w)
    x = torch.randn(num_tokens, in_features, generator=gen).to(device, dtype)
    y = torch.randn(num_tokens, offsets[-1], generator=gen).to(device, dtype)
    slots = np.random.default_rng(seed).integers(-1, num_slots, num_tokens).astype(np.int32)
    slots[slots == 2] = -1
    return bufs, weights, x, y, slots


def lora_reference(weights, offsets, x: torch.Tensor, y: torch.Tensor, slots) -> torch.Tensor:
    """y + x A[s]^T B[s]^T for each token of slot s >= 0, per packed projection, in float64."""
    out = y.double().cpu().clone()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        w = weights[s]
        shrink = w.a.double() @ x[t].double().cpu()  # [NS, r]
        for j in range(len(offsets) - 1):
            lo, hi = offsets[j], offsets[j + 1]
            out[t, lo:hi] += w.b[lo:hi].double() @ shrink[j]
    return out


def make_base(path: str) -> str:
    from tests.helpers.tiny_llama import make_tiny_hf_llama

    return make_tiny_hf_llama(path, seed=1, **BASE_SHAPE)


def make_adapters(base: str, root: str) -> list[str]:
    """Save ADAPTERS with random A and B (init_lora_weights=False: B is not zero)."""
    import peft

    from tests.helpers.tiny_llama import hf_model

    dirs = []
    for i, (name, kw) in enumerate(ADAPTERS):
        torch.manual_seed(100 + i)
        model = peft.get_peft_model(hf_model(base),
                                    peft.LoraConfig(init_lora_weights=False, **kw))
        path = os.path.join(root, name)
        model.save_pretrained(path)
        dirs.append(path)
    return dirs


def peft_greedy(base: str, adapters: list[str], prompts: list[list[int]], which: list[int],
                max_new: int) -> list[list[int]]:
    """peft's greedy tokens (unmerged, float32) of prompts[i] under adapters[which[i] - 1]
    (0: the base model)."""
    import peft

    from tests.helpers.tiny_llama import hf_model

    model = peft.PeftModel.from_pretrained(hf_model(base), adapters[0], adapter_name="1")
    for i, path in enumerate(adapters[1:], start=2):
        model.load_adapter(path, adapter_name=str(i))
    model.eval()
    out = []
    with torch.no_grad():
        for p, w in zip(prompts, which, strict=True):
            ids = torch.tensor([p])
            kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                      do_sample=False, pad_token_id=0, eos_token_id=None)
            if w == 0:
                with model.disable_adapter():
                    gen = model.generate(input_ids=ids, **kw)
            else:
                model.set_adapter(str(w))
                gen = model.generate(input_ids=ids, **kw)
            out.append(gen[0, len(p):].tolist())
    return out


class LoRAWorld:
    """The base model and ADAPTERS under ``root``, and peft's tokens for them (cached, so the
    test modules that share one world pay for each reference once)."""

    def __init__(self, root: str) -> None:
        self.base = make_base(os.path.join(root, "base"))
        self.adapters = make_adapters(self.base, root)
        self._refs: dict[tuple[tuple[int, ...], int, int], list[int]] = {}

    def expected(self, prompts: list[list[int]], loras: list[int],
                 max_new: int) -> list[list[int]]:
        """peft's tokens for prompts[i] under adapter loras[i] (0: the base model)."""
        for w in sorted(set(loras) | {0}):
            todo = [p for p in prompts if (tuple(p), w, max_new) not in self._refs]
            if todo:
                got = peft_greedy(self.base, self.adapters, todo, [w] * len(todo), max_new)
                self._refs |= {(tuple(p), w, max_new): t for p, t in zip(todo, got, strict=True)}
        # an adapter that changed nothing would make equality with peft meaningless
        for w in set(loras) - {0}:
            changed = [self._refs[(tuple(p), w, max_new)] != self._refs[(tuple(p), 0, max_new)]
                       for p in prompts]
            assert sum(changed) >= len(prompts) // 2, f"adapter {w} barely changes the tokens"
        return [self._refs[(tuple(p), w, max_new)] for p, w in zip(prompts, loras, strict=True)]


def lora_config(model: str, **kw: object) -> EngineConfig:
    opts: dict = dict(block_size=BS, max_num_seqs=16, max_model_len=128,
                      num_gpu_blocks_override=400, dtype="float32", enable_lora=True,
                      max_loras=3, max_lora_rank=32)
    return EngineConfig(model=model, **(opts | kw))


def slot_op(slot: int, lora_int_id: int, path: str = "") -> LoRASlotOp:
    return LoRASlotOp(slot=slot, lora_int_id=lora_int_id, lora_name=f"a{lora_int_id}",
                      lora_path=path, content_hash=content_hash(path) if path else "")


class LoRADriver:
    """Runs waves of requests to max_new greedy tokens each: a wave's first step carries its
    slot ops, admits all its requests with their whole prompts and finishes the previous
    wave's; then one decode step per token."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step_id = 0
        self.next_block = 1
        self.next_handle = 0
        self.running: list[int] = []

    def wave(self, prompts: list[list[int]], loras: list[int], ops: list[LoRASlotOp],
             max_new: int) -> list[list[int]]:
        handles = list(range(self.next_handle, self.next_handle + len(prompts)))
        self.next_handle += len(prompts)
        new = []
        for h, p in zip(handles, prompts, strict=True):
            n = -(-(len(p) + max_new) // BS)
            new.append(NewRequestData(
                handle=h, prompt_token_ids=pack(p), block_ids=pack(list(range(self.next_block,
                                                                         self.next_block + n))),
                sampling_params=SamplingParams(temperature=0.0, max_tokens=max_new),
                num_computed_tokens=0, num_scheduled_tokens=len(p)))
            self.next_block += n
        with_lora = [(h, w) for h, w in zip(handles, loras, strict=True) if w]
        lora = LoRAStep(ops=ops, handles=pack([h for h, _ in with_lora]),
                        lora_int_ids=pack([w for _, w in with_lora]))
        out = {h: [] for h in handles}
        so = SchedulerOutput(step_id=self.step_id, new_reqs=new,
                             finished_handles=pack(self.running), num_running=len(handles),
                             total_num_scheduled_tokens=sum(map(len, prompts)), lora=lora)
        self.running = handles
        for _ in range(max_new):
            res = self.runner.execute(so)
            self.step_id += 1
            for h, t in zip(unpack(res.req_handles), unpack(res.sampled_token_ids),
                            strict=True):
                out[h].append(t)
            so = SchedulerOutput(step_id=self.step_id, num_running=len(handles),
                                 total_num_scheduled_tokens=len(handles))
        return [out[h] for h in handles]


def run_spec(runner: ModelRunner, spec: dict) -> list[list[list[int]]]:
    """Prepare spec["prepare"] (adapter ids, 1-based into spec["adapters"]) on the runner, then
    run spec["waves"]: each {"prompts", "loras", "ops": [[slot, lora_int_id], ...]}; returns
    each wave's tokens."""
    from protocol.lora import LoRARequest

    paths = spec["adapters"]
    for i in spec.get("prepare", []):
        err = runner.prepare_lora(LoRARequest(f"a{i}", i, paths[i - 1]),
                                  content_hash(paths[i - 1]))
        assert err == "", err
    driver = LoRADriver(runner)
    return [driver.wave(w["prompts"], w["loras"],
                        [slot_op(s, i, paths[i - 1] if i else "") for s, i in w["ops"]],
                        spec["max_new"])
            for w in spec["waves"]]
