"""Images compose with the engine's other paths: greedy tokens with images equal transformers'
(fp32) through disaggregated prefill / decode, the host KV tier, LoRA (peft's tokens) and async
scheduling.

A tiny random Qwen2.5-VL (Qwen2-VL too for LoRA); prompts with 0 to 3 images given as vLLM
takes them (one image pad per image), two with the same text and different images, so a block
hash or a restore that ignored the image would serve the other image's KV and fail. Each case is
one small engine (two for P/D).
"""

from __future__ import annotations

import pytest

from launch import LLM, LoRARequest, SamplingParams
from protocol.kv_connector import KVTransferConfig, KVTransferParams
from tests.helpers.procs import wait_no_descendants
from tests.helpers.tiny_vl import (
    hf_greedy_with_images,
    make_tiny_hf_vl,
    vl_cases,
    vl_expanded,
)

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 6
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)





def _prompts(cases) -> list[dict]:
    return [{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}} for ids, imgs in cases]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(model path, cases, expanded prompt lengths, transformers' greedy tokens)."""
    path = str(tmp_path_factory.mktemp("qwen2_5_vl"))
    hf = make_tiny_hf_vl(path, "qwen2_5_vl")
    cases = vl_cases(11, 12)
    refs = [hf_greedy_with_images(hf, vl_expanded(ids, imgs), imgs, MAX_NEW)
            for ids, imgs in cases]
    assert refs[1] != refs[2], "the random model ignores its images"
    lengths = [len(vl_expanded(ids, imgs)) for ids, imgs in cases]
    return path, cases, lengths, refs


# ----------------------------------------------------------------------------------- P/D


def test_pd_prefill_with_images_decode_without_encoder(vl) -> None:
    """P encodes and prefills; D pulls the KV, recomputes only the last prompt token (text,
    after vision_end) and never runs its encoder."""
    path, cases, lengths, refs = vl
    opts = dict(block_size=4, dtype="float32", enforce_eager=True, max_model_len=256)
    try:
        with LLM(model=path, kv_transfer_config=KVTransferConfig(kv_connector="auto"),
                 **opts) as p, \
             LLM(model=path, kv_transfer_config=KVTransferConfig(kv_connector="tcp"),
                 **opts) as d:
            pre = p.generate(_prompts(cases), SamplingParams(max_tokens=1, temperature=0.0,
                                                             ignore_eos=True),
                             use_tqdm=False, timeout_s=120,
                             kv_transfer_params=KVTransferParams(do_remote_decode=True))
            assert all(o.kv_transfer_params is not None for o in pre), [o.error for o in pre]
            d.start_profile(torch_profiler=False)
            out = d.generate(_prompts(cases), GREEDY, use_tqdm=False, timeout_s=120,
                             kv_transfer_params=[o.kv_transfer_params for o in pre])
            stats = d.stop_profile().stats
    finally:
        left = wait_no_descendants(15)
    assert left == [], f"processes outlived the engines: {left}"
    assert [o.token_ids for o in out] == refs
    # every prompt token but the last came from P
    assert [o.metrics.num_cached_tokens for o in out] == [n - 1 for n in lengths]
    assert stats["encoder_runs"] == 0, stats
    assert stats["kv_loaded_tokens"] == sum(n - 1 for n in lengths), stats


# ------------------------------------------------------------------------ host KV tier


def test_host_tier_restores_image_blocks(vl) -> None:
    """A device pool far smaller than the batch: blocks (image blocks among them) go to the
    host tier and come back in the second round, where same-text prompts with different images
    must each find their own KV."""
    path, cases, _, refs = vl
    opts = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=3,
                num_gpu_blocks_override=16, kv_offload_memory=128 * 2048, debug_invariants=True)
    try:
        with LLM(model=path, **opts) as llm:
            llm.start_profile(torch_profiler=False)
            rounds = [llm.generate(_prompts(cases), GREEDY, use_tqdm=False, timeout_s=120)
                      for _ in range(2)]
            stats = llm.stop_profile().stats
    finally:
        left = wait_no_descendants(10)
    assert left == [], f"processes outlived the engine: {left}"
    for r, outs in enumerate(rounds):
        assert [o.token_ids for o in outs] == refs, f"round {r}"
    assert stats["kv_offload_offloaded"] > 0, stats
    assert stats["kv_offload_host_hits"] > 0, stats
    assert stats["kv_offload_restored_tokens"] > 0, stats


# -------------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_lora_on_the_language_model_with_images_equals_peft(tmp_path, family: str) -> None:
    """A PEFT adapter on the language model's q_proj / v_proj (saved by transformers 5 as
    model.language_model.layers.*): requests with images and the adapter, mixed with base
    requests in one batch, give peft's tokens."""
    import peft
    import torch

    base = str(tmp_path / "base")
    hf = make_tiny_hf_vl(base, family)
    torch.manual_seed(5)
    model = peft.get_peft_model(hf, peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapter = str(tmp_path / "adapter")
    model.save_pretrained(adapter)
    model.eval()
    cases = vl_cases(11, 12)[1:4]
    with torch.no_grad():
        want = [hf_greedy_with_images(model, vl_expanded(ids, imgs), imgs, MAX_NEW)
                for ids, imgs in cases]
        with model.disable_adapter():
            plain = [hf_greedy_with_images(model, vl_expanded(ids, imgs), imgs, MAX_NEW)
                     for ids, imgs in cases]
    assert want != plain, "the adapter changes nothing"
    lora = LoRARequest("vl", 1, adapter)
    try:
        with LLM(model=base, block_size=4, dtype="float32", enable_lora=True, max_loras=1,
                 max_lora_rank=8) as llm:
            outs = llm.generate(_prompts(cases + cases), GREEDY, use_tqdm=False, timeout_s=120,
                                lora_request=[lora] * len(cases) + [None] * len(cases))
    finally:
        left = wait_no_descendants(10)
    assert left == [], f"processes outlived the engine: {left}"
    assert [o.error for o in outs] == [None] * len(outs)
    assert [o.token_ids for o in outs] == want + plain


def test_an_adapter_on_the_vision_tower_is_refused(tmp_path) -> None:
    """Qwen2.5-VL's vision MLP has gate_proj too: an adapter PEFT put there is refused, naming
    the module, not served as if the tower were unadapted."""
    import peft

    from workers.lora.peft_config import LoRAAdapterError, check_adapter

    hf = make_tiny_hf_vl(str(tmp_path / "base"), "qwen2_5_vl")
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["gate_proj"]))
    model.save_pretrained(str(tmp_path / "adapter"))
    with pytest.raises(LoRAAdapterError, match=r"model\.visual\."):
        check_adapter(str(tmp_path / "adapter"))


# ---------------------------------------------------------------------- async scheduling


def test_async_scheduling_chunks_inside_images_and_prefix_hits(vl) -> None:
    path, cases, _, refs = vl
    try:
        with LLM(model=path, async_scheduling=True, block_size=4, max_num_batched_tokens=8,
                 max_num_encoder_input_tokens=12, encoder_cache_size=24, max_num_seqs=3,
                 debug_invariants=True) as llm:
            llm.start_profile(torch_profiler=False)
            rounds = [llm.generate(_prompts(cases), GREEDY, use_tqdm=False, timeout_s=120)
                      for _ in range(2)]
            stats = llm.stop_profile().stats
    finally:
        left = wait_no_descendants(10)
    assert left == [], f"processes outlived the engine: {left}"
    for r, outs in enumerate(rounds):
        assert [o.token_ids for o in outs] == refs, f"round {r}"
    assert stats["prefix_cache_hits"] > 0, stats
