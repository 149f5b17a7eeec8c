"""Write a tiny random Hugging Face Llama checkpoint (config.json + safetensors) for tests."""

from __future__ import annotations

import os

import torch

# Small expert counts keep the tests fast; top-2 of 4 with a moe_intermediate_size that TP=2
# splits evenly (Qwen3-MoE; Mixtral's experts use intermediate_size).
MOE_BASE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def make_tiny_hf_llama(path: str, seed: int = 0, arch: str = "llama",
                       max_shard_size: str | None = None, **overrides) -> str:
    """Save a random transformers Llama (or arch = "qwen2", "mistral", "qwen3", "qwen3_moe",
    "mixtral") in `path` and return `path`.

    initializer_range 0.2 (not HF's 0.02) so greedy tokens depend on the context.
    """
    import transformers

    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**kwargs)
        model = transformers.Qwen2ForCausalLM(cfg).eval()
    elif arch == "mistral":  # every layer windowed when sliding_window is given
        cfg = transformers.MistralConfig(**kwargs)
        model = transformers.MistralForCausalLM(cfg).eval()
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**kwargs)
        model = transformers.Qwen3ForCausalLM(cfg).eval()
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**(MOE_BASE | kwargs))
        model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    elif arch == "mixtral":
        kwargs.setdefault("num_local_experts", MOE_BASE["num_experts"])
        cfg = transformers.MixtralConfig(**kwargs)
        model = transformers.MixtralForCausalLM(cfg).eval()
    else:
        cfg = transformers.LlamaConfig(**kwargs)
        model = transformers.LlamaForCausalLM(cfg).eval()
    # HF inits norms to 1 and biases to 0; randomize them so those code paths are exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                # a wide router (transformers may start it at zero): distinct routes per token
                p.copy_(torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **extra)
    return path


def hf_model(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(path: str, token_ids: list[int]) -> torch.Tensor:
    """Reference logits [len, vocab] (float32) from transformers for one prompt."""
    with torch.no_grad():
        return hf_model(path)(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(path: str, token_ids: list[int], max_new: int) -> list[int]:
    """transformers' own greedy generate (no eos stop), the new tokens only."""
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([token_ids]), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0, min_new_tokens=max_new)
    return out[0, len(token_ids) :].tolist()


def hf_greedy_refs(path: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy generate (no eos stop) for each prompt, one model load; asserts
    the references depend on the context, so equality with them means something."""
    model = hf_model(path)
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    refs = []
    with torch.no_grad():
        for p in prompts:
            mask = torch.ones(1, len(p), dtype=torch.long)
            out = model.generate(torch.tensor([p]), attention_mask=mask, max_new_tokens=max_new,
                                 do_sample=False, pad_token_id=0)
            refs.append(out[0, len(p) :].tolist())
    assert len({tuple(r) for r in refs}) > 3, "the random model ignores its context"
    return refs


def hf_greedy_steps(path: str, prompts: list[list[int]], max_new: int, dtype: torch.dtype,
                    device: str) -> list[tuple[list[int], list[float], list[float]]]:
    """transformers' greedy tokens in `dtype` on `device`, per prompt with each step's
    log-softmax of the chosen token and the gap between the two largest logits (how far
    from a tie the choice was, so a test knows which choices a rounding error may flip)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids, lps, gaps = list(p), [], []
            for _ in range(max_new):  # no KV cache: the tiny model recomputes in microseconds
                row = model(torch.tensor([ids], device=device)).logits[0, -1].float()
                top = row.topk(2).values
                tok = int(row.argmax())
                lps.append(float(torch.log_softmax(row, -1)[tok]))
                gaps.append(float(top[0] - top[1]))
                ids.append(tok)
            refs.append((ids[len(p):], lps, gaps))
    return refs
