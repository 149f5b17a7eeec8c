"""Sampled-token logprobs reach the caller and equal transformers' log-softmax on the same
weights (fp32), for requests that ask; requests that do not ask get none."""

from __future__ import annotations

import pytest
import torch

from launch import LLM, SamplingParams
from tests.helpers.procs import wait_no_descendants
from tests.helpers.tiny_llama import make_tiny_hf_llama


@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_equal_transformers(tmp_path, tp: int) -> None:
    import transformers

    path = make_tiny_hf_llama(str(tmp_path / "m"))
    prompts = [[3, 17, 9, 44, 120], [7, 7, 8]]
    ref_model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        with LLM(model=path, tensor_parallel_size=tp) as llm:
            outs = llm.generate(prompts, [want, plain], use_tqdm=False, timeout_s=120)
            # a sampled (temperature) request gets the logprob of the token it drew
            hot = llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.8,
                                                            seed=5, logprobs=True),
                               use_tqdm=False, timeout_s=120)[0]
    finally:
        left = wait_no_descendants(10)
    assert left == []
    out = outs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
    ids = torch.tensor([prompts[0] + out.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(ref_model(ids).logits[0].float(), dim=-1)
    for j, tok in enumerate(out.token_ids):
        expected = logp[len(prompts[0]) - 1 + j, tok].item()
        assert abs(out.logprobs[j] - expected) < 1e-4, (j, out.logprobs[j], expected)
    assert outs[1].logprobs is None
    assert hot.logprobs is not None and len(hot.logprobs) == len(hot.token_ids)
    assert all(lp <= 0.0 for lp in hot.logprobs)
