"""Model registry: a Hugging Face config's `architectures` (or `model_type`) -> the model class.

One small table, as vLLM's registry. It names classes by module path and is imported lazily, so
the table stays torch-free (config parsing uses it to validate a checkpoint) and model modules
can import the config without an import cycle.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    model_type: str  # the config's model_type, which selects its config keys (config.py)
    module: str
    cls: str


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", "workers.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": Architecture("mistral", "workers.model.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": Architecture("qwen2", "workers.model.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": Architecture("qwen3", "workers.model.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", "workers.model.qwen3_moe",
                                        "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": Architecture("mixtral", "workers.model.mixtral", "MixtralForCausalLM"),
    # one class serves both vision-language families; the config picks the vision blocks
    "Qwen2VLForConditionalGeneration": Architecture("qwen2_vl", "workers.model.qwen2_vl",
                                                    "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": Architecture("qwen2_5_vl", "workers.model.qwen2_vl",
                                                       "Qwen2VLForConditionalGeneration"),
}
_BY_MODEL_TYPE = {a.model_type: a for a in ARCHITECTURES.values()}


def supported() -> str:
    return ", ".join(f"{name} ({a.model_type})" for name, a in ARCHITECTURES.items())


def model_type_of(hf_config: dict) -> str:
    """The registry's model_type for a config.json dict: its first known architecture, else its
    model_type (configs without either are Llama, as GGUF-derived and hand-written ones are)."""
    for name in hf_config.get("architectures") or []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name].model_type
    model_type = hf_config.get("model_type", "llama")
    if model_type in _BY_MODEL_TYPE:
        return model_type
    raise ValueError(
        f"unsupported architecture {hf_config.get('architectures')} (model_type "
        f"{model_type!r}); supported: {supported()}")


def model_class(model_type: str) -> type:
    """The class that builds a model of this model_type."""
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {supported()}")
    arch = _BY_MODEL_TYPE[model_type]
    return getattr(importlib.import_module(arch.module), arch.cls)
