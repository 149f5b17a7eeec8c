"""Module-name patterns from adapter_config.json: PEFT's answers for ordinary patterns (peft's
own matching functions are the reference), and catastrophic ones refused by name before any
match runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.lora import patterns
from workers.lora.peft_config import LoRAAdapterError, PeftLoRAConfig, parse_config

NAMES = [f"model.layers.{i}.{block}.{proj}" for i in (0, 1, 11)
         for block, proj in (("self_attn", "q_proj"), ("self_attn", "v_proj"),
                             ("self_attn", "o_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))]
PATTERNS = [
    "q_proj", "v_proj", "o_proj", "layers.1.mlp.up_proj", r"layers\.1\.mlp\.up_proj",
    "q_proj|v_proj", "(q|v)_proj", ".*_proj", r".*\.(q_proj|v_proj)", r".*\.(q_proj|v_proj)$",
    r"model\.layers\.\d+\.self_attn\.(q|k|v)_proj", r"model.layers.[0-9]+.mlp.*",
    "model.*(q_proj|k_proj)", r"layers\.1[0-9]?\..*", "^model.*proj$", "[qv]_proj", "(?i:Q)_proj",
    "layers.1.self_attn.q_proj", "self_attn.q_proj", "attn.q_proj", "1.mlp.down_proj",
    r"(layers\.1\.)?q_proj", "up_proj?", "mlp", "", ".", "d.wn_proj", r"[^q]_proj",
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_ordinary_patterns_match_as_peft_matches(pattern: str) -> None:
    from peft.utils.other import get_pattern_key, match_target_against_key

    assert patterns.why_refused(pattern) is None
    for name in NAMES:
        assert patterns.fullmatch(pattern, name) == (
            match_target_against_key(pattern, name) is not None), (pattern, name)
        assert patterns.key_matches(pattern, name) == (
            get_pattern_key([pattern], name) == pattern), (pattern, name)


def test_rank_and_alpha_patterns_pick_peft_s_key() -> None:
    from peft.utils.other import get_pattern_key

    rank = {"layers.1.mlp.up_proj": 8, r".*\.(q_proj|v_proj)": 4, "o_proj": 2}
    alpha = {"up_proj": 3.0, "layers.11.*": 5.0}
    cfg = PeftLoRAConfig(r=16, lora_alpha=16, use_rslora=False, rank_pattern=rank,
                         alpha_pattern=alpha, target_modules=None)
    for name in NAMES:
        want_r = rank.get(get_pattern_key(list(rank), name), 16)
        want_a = alpha.get(get_pattern_key(list(alpha), name), 16.0)
        assert cfg.rank_of(name) == want_r
        assert cfg.scaling_of(name) == want_a / want_r


@pytest.mark.parametrize("pattern", [
    "(a+)+$", "(.*a){20}", "(a|a)*b", "(a*)*", r"(\w+\.)+q_proj", "(q_proj)\\1",
    "(?=q)q_proj", "(?<!x)q_proj", ".*a.*b.*c", "(?>a*)b", "a*+b",
    "(a.*)?b", "x" * 600,
])
def test_pathological_patterns_are_refused_by_name(pattern: str, tmp_path: Path) -> None:
    assert patterns.why_refused(pattern) is not None
    for field in ("rank_pattern", "alpha_pattern"):
        cfg = json.dumps({"r": 8, "lora_alpha": 8, field: {pattern: 4}}).encode()
        with pytest.raises(LoRAAdapterError, match=f"{field} key .* is refused"):
            parse_config(cfg)
    cfg = json.dumps({"r": 8, "target_modules": pattern}).encode()
    with pytest.raises(LoRAAdapterError, match="target_modules .* is refused"):
        parse_config(cfg)
    with pytest.raises(ValueError, match="refused"):  # a caller that did not check first
        patterns.key_matches(pattern, "a" * 40)


def test_too_many_pattern_keys_are_refused() -> None:
    keys = {f"layers.{i}.q_proj": 4 for i in range(patterns.MAX_PATTERN_CHARS * 3)}
    with pytest.raises(LoRAAdapterError, match="more than 1024"):
        parse_config(json.dumps({"r": 8, "rank_pattern": keys}).encode())
