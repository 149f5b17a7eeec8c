"""PEFT adapter checks (torch-free side): what is served, what is refused and with which named
field; rank/alpha patterns matched as peft matches them; the content hash."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from protocol.lora_files import content_hash, content_hash_of
from workers.lora.peft_config import LoRAAdapterError, check_adapter, max_rank, parse_config

P = "base_model.model.model.layers"
BASE_CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
               "bias": "none", "use_dora": False, "modules_to_save": None,
               "fan_in_fan_out": False}


def qproj(layer: int = 0, r: int = 8, proj: str = "self_attn.q_proj") -> dict[str, torch.Tensor]:
    return {f"{P}.{layer}.{proj}.lora_A.weight": torch.zeros(r, 64),
            f"{P}.{layer}.{proj}.lora_B.weight": torch.zeros(64, r)}


def write(path, config: dict | None = None, tensors: dict | None = None) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(BASE_CONFIG | (config or {}), f)
    save_file(tensors if tensors is not None else qproj(),
              os.path.join(path, "adapter_model.safetensors"))
    return str(path)


MODEL = {f"model.layers.{i}.{b}.{p}" for i in range(2)
         for b, ps in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                       ("mlp", ("gate_proj", "up_proj", "down_proj"))) for p in ps}

REFUSALS = {
    "dora": (dict(use_dora=True), None, "use_dora"),
    "modules_to_save": (dict(modules_to_save=["lm_head"]), None, "modules_to_save"),
    "bias": (dict(bias="all"), None, "bias='all'"),
    "fan_in_fan_out": (dict(fan_in_fan_out=True), None, "fan_in_fan_out"),
    "lora_bias": (dict(lora_bias=True), None, "lora_bias"),
    "target_parameters": (dict(target_parameters=["experts.gate_up_proj"]), None,
                          "target_parameters"),
    "unknown_field": (dict(use_fancy_variant=True), None, "use_fancy_variant"),
    "peft_type": (dict(peft_type="IA3"), None, "peft_type"),
    "embed_target": (dict(target_modules=["q_proj", "embed_tokens"]), None, "embeddings"),
    "lm_head_tensor": (dict(target_modules=".*"), qproj(proj="x") | {
        "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
        "base_model.model.lm_head.lora_B.weight": torch.zeros(64, 8)}, "LM head"),
    "embedding_tensor": (None, qproj() | {
        "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 64)},
        "embeddings"),
    "moe_target": (dict(target_modules=["gate"]), None, "mixture-of-experts"),
    "moe_tensor": (dict(target_modules=".*"), qproj(proj="mlp.experts.0.gate_proj"),
                   "mixture-of-experts"),
    "unknown_target": (dict(target_modules=["query_key_value"]), None, "no such module"),
    "missing_layer": (None, qproj(layer=7), "does not have"),
    "rank_over_max": (dict(r=32), qproj(r=32), "exceeds max_lora_rank 16"),
    "rank_mismatch": (dict(r=4), None, "rank 8 but adapter_config.json"),
    "untargeted_tensor": (None, qproj() | qproj(proj="self_attn.v_proj"), "target_modules"),
    "missing_b": (None, {f"{P}.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64)},
                  "no lora_B"),
    "dora_tensor": (None, qproj() | {
        f"{P}.0.self_attn.q_proj.lora_magnitude_vector": torch.zeros(64)}, "DoRA"),
    "int_weights": (None, {k: v.to(torch.int8) for k, v in qproj().items()}, "I8"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused_with_the_field_named(tmp_path, case):
    config, tensors, message = REFUSALS[case]
    path = write(tmp_path / case, config, tensors)
    with pytest.raises(LoRAAdapterError, match=message.replace("(", r"\(")):
        check_adapter(path, max_lora_rank=16, model_modules=MODEL)


def test_missing_and_corrupt_files(tmp_path):
    path = write(tmp_path / "a")
    os.remove(os.path.join(path, "adapter_config.json"))
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        check_adapter(path)
    path = write(tmp_path / "b")
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(LoRAAdapterError, match="adapter_config.json is not valid JSON"):
        check_adapter(path)
    path = write(tmp_path / "c")
    os.rename(os.path.join(path, "adapter_model.safetensors"),
              os.path.join(path, "adapter_model.bin"))
    with pytest.raises(LoRAAdapterError, match="only adapter_model.safetensors is read"):
        check_adapter(path)
    path = write(tmp_path / "d")
    file = os.path.join(path, "adapter_model.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[:-10])  # truncated
    with pytest.raises(LoRAAdapterError, match="corrupt"):
        check_adapter(path)
    with pytest.raises(LoRAAdapterError, match="not a directory"):
        check_adapter(str(tmp_path / "nowhere"))


def test_patterns_match_like_peft(tmp_path):
    from peft.utils.other import get_pattern_key

    rank_pattern = {"layers.1.mlp.up_proj": 4, "o_proj": 2, r"layers\.0\..*v_proj": 6}
    alpha_pattern = {"up_proj": 3.0, "layers.1.self_attn.q_proj": 5}
    cfg = parse_config(json.dumps(BASE_CONFIG | dict(
        rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, use_rslora=True)).encode())
    for module in sorted(MODEL):
        r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), module), 8)
        alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), module), 16)
        assert cfg.rank_of(module) == r, module
        assert cfg.scaling_of(module) == pytest.approx(alpha / r**0.5), module
    plain = parse_config(json.dumps(BASE_CONFIG).encode())
    assert plain.scaling_of("model.layers.0.self_attn.q_proj") == 2.0


def test_served_adapter_and_max_rank(tmp_path):
    tensors = qproj(r=4) | qproj(layer=1, r=12, proj="mlp.down_proj")
    tensors[f"{P}.1.mlp.down_proj.lora_A.weight"] = torch.zeros(12, 172)
    path = write(tmp_path / "ok", dict(r=4, target_modules="model.*(q_proj|down_proj)",
                                       rank_pattern={"down_proj": 12}), tensors)
    spec = check_adapter(path, max_lora_rank=16, model_modules=MODEL)
    down = spec.modules["model.layers.1.mlp.down_proj"]
    assert (down.rank, down.in_features, down.out_features, down.scaling) == (12, 172, 64, 16 / 12)
    assert max_rank(path) == 12


def test_content_hash_is_sha256_of_config_then_weights(tmp_path):
    path = write(tmp_path / "h")
    with open(os.path.join(path, "adapter_config.json"), "rb") as f:
        config = f.read()
    with open(os.path.join(path, "adapter_model.safetensors"), "rb") as f:
        weights = f.read()
    digest = hashlib.sha256(config + weights).hexdigest()
    assert content_hash(path) == content_hash_of(config, weights) == digest


def test_a_vl_models_language_model_names_are_its_decoder_layers(tmp_path) -> None:
    """transformers 5 names a Qwen2-VL's decoder model.language_model.layers.*: PEFT's adapter
    on it adapts this engine's model.layers.*, its tensors found under the file's names and its
    rank / alpha patterns matched against them; the same projection under both names, and the
    vision tower, are refused."""
    lm = "base_model.model.model.language_model.layers"
    tensors = {f"{lm}.{i}.self_attn.q_proj.lora_{ab}.weight": torch.zeros(*shape)
               for i in range(2) for ab, shape in (("A", (8, 64)), ("B", (64, 8)))}
    path = write(tmp_path / "vl", dict(alpha_pattern={"language_model.layers.1.self_attn.q_proj":
                                                      4}), tensors)
    spec = check_adapter(path, 16, MODEL)
    assert sorted(spec.modules) == ["model.layers.0.self_attn.q_proj",
                                    "model.layers.1.self_attn.q_proj"]
    m0, m1 = (spec.modules[f"model.layers.{i}.self_attn.q_proj"] for i in range(2))
    assert {m0.a_name, m0.b_name, m1.a_name, m1.b_name} == set(tensors)
    assert (m0.scaling, m1.scaling) == (2.0, 0.5)
    both = write(tmp_path / "both", None, tensors | qproj())
    with pytest.raises(LoRAAdapterError, match="adapted twice"):
        check_adapter(both, 16, MODEL)
    vision = write(tmp_path / "vision", dict(target_modules=".*"), qproj() | {
        "base_model.model.model.visual.blocks.0.mlp.gate_proj.lora_A.weight": torch.zeros(8, 32),
        "base_model.model.model.visual.blocks.0.mlp.gate_proj.lora_B.weight": torch.zeros(48, 8)})
    with pytest.raises(LoRAAdapterError, match=r"model\.visual\.blocks\.0\.mlp\.gate_proj"):
        check_adapter(vision, 16, MODEL)
