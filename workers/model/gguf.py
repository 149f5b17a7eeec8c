"""GGUF (llama.cpp) checkpoints: config from the header, tensors dequantized to float32 under their
HF names, with llama.cpp's q/k row permutation undone."""

from __future__ import annotations

import re

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from workers.model.config import ModelConfig

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _hf_name(gguf_name: str) -> str | None:
    m = _BLK.match(gguf_name)
    if m:
        part = _LAYER.get(m.group(2))
        return f"model.layers.{m.group(1)}.{part}.{m.group(3)}" if part else None
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL[stem]}.{kind}" if stem in _GLOBAL else None


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _config_from_reader(reader: GGUFReader, tensor_names: set[str]) -> ModelConfig:
    arch = _field(reader, "general.architecture", "llama")
    if arch != "llama":
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported: only dense 'llama' GGUF files load "
            f"(such as SmolLM2's); load {arch} from a Hugging Face directory (config.json + "
            f"*.safetensors)")
    experts = int(_field(reader, "llama.expert_count", 0) or 0)
    if experts:
        # llama.cpp stores Mixtral as 'llama' with expert tensors this loader does not map
        raise ValueError(
            f"GGUF architecture 'llama' with {experts} experts (mixture of experts, e.g. "
            f"Mixtral) is not supported: only dense 'llama' GGUF files load; load it from a "
            f"Hugging Face directory (config.json + *.safetensors)")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, "llama.vocab_size") or (len(tokens.data) if tokens else None)
    if vocab is None:
        raise ValueError("GGUF file names no llama.vocab_size and carries no token list")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rope_scaling=None,
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
        tie_word_embeddings="lm_head.weight" not in tensor_names,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


def gguf_model_config(path: str) -> ModelConfig:
    reader = GGUFReader(path)
    names = {n for n in (_hf_name(t.name) for t in reader.tensors) if n}
    return _config_from_reader(reader, names)


def gguf_vocab(path: str) -> list[str]:
    """The token strings of the GGUF's vocabulary (byte-level BPE pieces for GPT-2 style models)."""
    return list(_field(GGUFReader(path), "tokenizer.ggml.tokens"))


class GGUFSource:
    """Tensors of a .gguf by HF name. Quantized blocks cannot be sliced by row cheaply, so each
    read dequantizes the tensor and then slices it (fine for the small models used here)."""

    def __init__(self, path: str):
        self.reader = GGUFReader(path)
        self._tensors = {}
        for t in self.reader.tensors:
            name = _hf_name(t.name)
            if name:
                self._tensors[name] = t
        self.config = _config_from_reader(self.reader, set(self._tensors))

    def has(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        # GGUF lists dims fastest-first; torch wants them slowest-first.
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def read(self, name: str, dim: int | None = None, start: int = 0,
             end: int | None = None) -> torch.Tensor:
        t = self._tensors[name]
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(self.shape(name))
        heads = None
        if ".self_attn.q_proj." in name:
            heads = self.config.num_attention_heads
        elif ".self_attn.k_proj." in name:
            heads = self.config.num_key_value_heads
        if heads is not None:
            # llama.cpp interleaves each head's rotary halves; restore HF's rotate-half order.
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        # Unquantized tensors come back as read-only views of the memory map: copy those.
        full = torch.from_numpy(np.array(w, copy=not w.flags.writeable or not w.flags.c_contiguous))
        if dim is None:
            return full
        return full.narrow(dim, start, (full.shape[dim] if end is None else end) - start)
