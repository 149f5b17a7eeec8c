"""GGUF files load only for the dense 'llama' architecture; every other one is refused with
an error that names it (rather than loading wrong tensors or failing on a missing one)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from workers.model.gguf import GGUFSource, gguf_model_config


def write_gguf(path: Path, arch: str, fields: dict[str, int] | None = None) -> str:
    """A small GGUF of `arch` with the given `arch.*` header fields and one tensor."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": 1, **(fields or {})}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3moe", "mistral", "gemma"])
def test_other_architectures_are_refused_by_name(tmp_path: Path, arch: str) -> None:
    path = write_gguf(tmp_path / f"{arch}.gguf", arch)
    for load in (gguf_model_config, GGUFSource):
        with pytest.raises(ValueError, match=f"GGUF architecture '{arch}' is not supported"):
            load(path)


def test_llama_with_experts_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "mixtral.gguf", "llama",
                      {"expert_count": 8, "expert_used_count": 2})
    with pytest.raises(ValueError, match="'llama' with 8 experts .* is not supported"):
        gguf_model_config(path)


def test_dense_llama_header_loads(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "llama.gguf", "llama",
                      {"embedding_length": 4, "feed_forward_length": 8,
                       "attention.head_count": 1, "vocab_size": 8})
    cfg = gguf_model_config(path)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (4, 1, 8)
