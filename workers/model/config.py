"""Model hyper-parameters, read from a HF config.json dict, a GGUF header or a dummy preset."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from workers.model.registry import model_type_of
from workers.model.vision.config import VisionConfig, VisionKind

# the vision-language families: a Qwen2 LM (q/k/v bias, no o_proj bias, M-RoPE) fed by a vision
# tower (workers/model/vision/)
VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # HF Llama's attention_bias also biases o_proj; Qwen2 biases only q/k/v.
    o_proj_bias: bool = False
    # per layer: its sliding window in tokens (a query at p sees keys in (p - W, p]), 0 = full
    # attention; empty = every layer full attention
    layer_windows: list[int] = field(default_factory=list)
    # the dtype the checkpoint stores ("bfloat16", ...), None where it names none (GGUF);
    # `--dtype auto` runs in it on CUDA (protocol/devices.resolve_dtype)
    torch_dtype: str | None = None
    # the registry key (workers/model/registry.py) that picks the model class
    model_type: str = "llama"
    # Qwen3: per-head RMSNorm on q and k (weights of head_dim) before rotary
    qk_norm: bool = False
    # mixture of experts (0 experts = a dense model): each token's top-k experts of
    # moe_intermediate_size; layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is
    # not in mlp_only_layers (those keep a dense MLP of intermediate_size)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # vision-language models (VL_MODEL_TYPES): the vision tower, M-RoPE's split of the rotary
    # half-dims over the (time, height, width) position rows, and the special tokens
    vision: VisionConfig | None = None
    mrope_section: list[int] = field(default_factory=list)
    image_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None

    def windows(self) -> list[int]:
        """The sliding window of every layer (0 = full attention)."""
        return list(self.layer_windows) or [0] * self.num_hidden_layers

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % max(1, self.decoder_sparse_step) == 0)

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        model_type = model_type_of(d)
        top = d
        if model_type in VL_MODEL_TYPES:
            # transformers 5 nests the LM's keys in text_config; Hub checkpoints keep them at the
            # top level. Either way the outer dict names the architecture and the vision keys.
            d = {**d, **(d.get("text_config") or {}), "model_type": model_type}
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        qwen2 = model_type in ("qwen2", *VL_MODEL_TYPES)
        attention_bias = True if qwen2 else bool(d.get("attention_bias", False))
        # transformers >= 5 folds rope_theta and rope_scaling into one rope_parameters dict.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = float(d.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0)
        rope.pop("rope_theta", None)
        # M-RoPE (Hub configs: type "mrope"; transformers 5: "default" plus mrope_section) uses
        # the default frequencies; the section only says which position row each half-dim reads
        mrope_section = [int(n) for n in rope.pop("mrope_section", None) or []]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "mrope":
            rope_type = "default"
        rope_scaling = None if rope_type == "default" else rope
        eos = d.get("eos_token_id")
        if isinstance(eos, list):  # llama3 lists several; the first is the canonical one
            eos = eos[0] if eos else None
        config = cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            o_proj_bias=attention_bias and not qwen2,
            layer_windows=_layer_windows(d, model_type),
            torch_dtype=_checkpoint_dtype(d),
            model_type=model_type,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
        )
        if model_type in VL_MODEL_TYPES:
            config = _with_vision_fields(config, top, model_type, mrope_section)
        return _with_moe_fields(config, d, model_type)


def _with_vision_fields(config: ModelConfig, d: dict, model_type: str,
                        mrope_section: list[int]) -> ModelConfig:
    kind: VisionKind = "qwen2_vl" if model_type == "qwen2_vl" else "qwen2_5_vl"
    vision = VisionConfig.from_hf_dict(d.get("vision_config") or {}, kind)
    if vision.out_hidden_size != config.hidden_size:
        raise ValueError(f"vision merger outputs {vision.out_hidden_size} features for an LM of "
                         f"hidden size {config.hidden_size}")
    section = mrope_section or [16, 24, 24]  # transformers' default
    if sum(section) != config.head_dim // 2:
        raise ValueError(f"mrope_section {section} does not cover head_dim {config.head_dim} / 2")

    def token(key: str) -> int | None:
        value = d.get(key)
        return None if value is None else int(value)

    return replace(config, vision=vision, mrope_section=section,
                   image_token_id=token("image_token_id"),
                   vision_start_token_id=token("vision_start_token_id"),
                   vision_end_token_id=token("vision_end_token_id"))


def _with_moe_fields(config: ModelConfig, d: dict, model_type: str) -> ModelConfig:
    """Expert keys as transformers reads them: Qwen3-MoE's num_experts (transformers 5 also
    writes num_local_experts), Mixtral's num_local_experts; Mixtral always renormalises the
    top-k weights, Qwen3-MoE only with norm_topk_prob (default off). Spelled out as keywords of
    `replace` (not a **dict) so each field keeps its own type."""
    if model_type not in ("qwen3_moe", "mixtral"):
        return config
    experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    if model_type == "mixtral":
        return replace(config, num_experts=experts,
                       num_experts_per_tok=int(d.get("num_experts_per_tok", 2)),
                       moe_intermediate_size=int(d["intermediate_size"]), norm_topk_prob=True)
    return replace(config, num_experts=experts,
                   num_experts_per_tok=int(d.get("num_experts_per_tok", 8)),
                   moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
                   norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                   decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
                   mlp_only_layers=[int(i) for i in d.get("mlp_only_layers") or []])


def _checkpoint_dtype(d: dict) -> str | None:
    """config.json's torch_dtype (transformers < 5) or dtype (>= 5), as a torch dtype name."""
    raw = d.get("torch_dtype") or d.get("dtype")
    if not isinstance(raw, str):
        return None
    name = raw.removeprefix("torch.")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32",
            "fp32": "float32"}.get(name, name)


def _layer_windows(d: dict, model_type: str) -> list[int]:
    """Per-layer sliding windows as transformers reads them (0 = full attention):

    - mistral, mixtral: ``sliding_window`` (null = none) applies to every layer;
    - qwen2, qwen3: the window exists only with ``use_sliding_window``; ``layer_types`` names
      each layer's kind, else layers from ``max_window_layers`` on slide;
    - qwen3_moe: the window exists only with ``use_sliding_window`` and applies to every layer;
    - any other config with a ``layer_types`` list and a ``sliding_window``: the layers named
      "sliding_attention" slide.
    """
    n = int(d["num_hidden_layers"])
    window = d.get("sliding_window")
    if (model_type in ("qwen2", "qwen3", "qwen3_moe", *VL_MODEL_TYPES)
            and not d.get("use_sliding_window", False)):
        window = None
    if not window:
        return []
    window = int(window)
    types = d.get("layer_types")
    if model_type in ("mistral", "mixtral", "qwen3_moe"):
        windows = [window] * n
    elif types:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"unsupported layer_types {sorted(unknown)}")
        windows = [window if t == "sliding_attention" else 0 for t in types]
    elif model_type in ("qwen2", "qwen3", *VL_MODEL_TYPES):
        first = int(d.get("max_window_layers", n))
        windows = [window if i >= first else 0 for i in range(n)]
    else:
        return []
    return windows if any(windows) else []


# Random-weight presets. std 0.2 makes greedy tokens depend on the context (at HF's default 0.02 a
# tiny model emits one token whatever the prompt, and a broken attention would go unnoticed).
DUMMY_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    ),
    "micro": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    ),
}
DUMMY_INIT_STD = 0.2

# Real-shape presets: the published config.json values of these models, with random weights, so
# a real model size can be benchmarked without its weight files. Their weights are drawn with
# REAL_SHAPE_INIT_STD (HF's initializer_range), small enough that bf16 activations stay finite
# through 16-32 layers, directly into each rank's shard on its device (workers/model/loader.py).
_LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
DUMMY_PRESETS |= {
    # meta-llama/Llama-3.2-1B
    "llama-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_SCALING, max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
        torch_dtype="bfloat16",
    ),
    # meta-llama/Meta-Llama-3-8B
    "llama-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=None, max_position_embeddings=8192,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
        torch_dtype="bfloat16",
    ),
    # Qwen/Qwen2-0.5B (q/k/v carry a bias, o_proj does not)
    "qwen2-0.5b": ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=131072,
        tie_word_embeddings=True, attention_bias=True, bos_token_id=151643,
        eos_token_id=151643, torch_dtype="bfloat16",
    ),
    # HuggingFaceTB/SmolLM2-135M: the default real model's shape (9 query / 3 KV heads), so its
    # batch-1 latency can be timed in bf16 without the GGUF's dequantization
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, rope_scaling=None, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
    ),
}
# Qwen/Qwen3-0.6B; the larger Qwen3 presets differ from it only in their sizes
_QWEN3_0_6B = ModelConfig(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
    rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=40960,
    tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, model_type="qwen3",
    qk_norm=True, torch_dtype="bfloat16",
)
DUMMY_PRESETS |= {
    "qwen3-0.6b": _QWEN3_0_6B,
    # Qwen/Qwen3-8B
    "qwen3-8b": replace(_QWEN3_0_6B, hidden_size=4096, intermediate_size=12288,
                        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                        tie_word_embeddings=False),
    # Qwen/Qwen3-30B-A3B: 128 experts, 8 per token, every layer sparse
    "qwen3-30b-a3b": replace(_QWEN3_0_6B, model_type="qwen3_moe", hidden_size=2048,
                             intermediate_size=6144, num_hidden_layers=48,
                             num_attention_heads=32, num_key_value_heads=4,
                             tie_word_embeddings=False, num_experts=128,
                             num_experts_per_tok=8, moe_intermediate_size=768,
                             norm_topk_prob=True),
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=32768,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, model_type="mixtral",
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True,
        torch_dtype="bfloat16"),
}
REAL_SHAPE_PRESETS = frozenset({"llama-1b", "llama-8b", "qwen2-0.5b", "smollm2-135m",
                                "qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b"})

# Small random MoE for CPU runs, and a dense model of the same active size (its MLP is the
# 4 routed experts' width), so the two can be compared step for step. Drawn like dummy:tiny.
_QWEN3_TINY = ModelConfig(
    vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=32, rms_norm_eps=1e-6,
    rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=2048,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, model_type="qwen3", qk_norm=True,
    torch_dtype="float32",
)
DUMMY_PRESETS |= {
    "qwen3-moe-tiny": replace(_QWEN3_TINY, model_type="qwen3_moe", num_experts=32,
                              num_experts_per_tok=4, moe_intermediate_size=128,
                              norm_topk_prob=True),
    "qwen3-tiny": _QWEN3_TINY,
}
REAL_SHAPE_INIT_STD = 0.02

# Vision-language presets. Qwen/Qwen2-VL-2B-Instruct and Qwen/Qwen2.5-VL-7B-Instruct (their
# config.json values), and small ones of each family for CPU tests (vocab 256 with the special
# tokens at its top, head_dim 16 split 2/3/3 over (t, h, w) by M-RoPE).
_QWEN2_VL_2B = ModelConfig(
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
    num_attention_heads=12, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
    rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=32768,
    tie_word_embeddings=True, attention_bias=True, bos_token_id=151643, eos_token_id=151645,
    torch_dtype="bfloat16", model_type="qwen2_vl", mrope_section=[16, 24, 24],
    image_token_id=151655, vision_start_token_id=151652, vision_end_token_id=151653,
    vision=VisionConfig(kind="qwen2_vl", depth=32, embed_dim=1280, num_heads=16,
                        intermediate_size=5120, hidden_act="quick_gelu", out_hidden_size=1536),
)
_QWEN2_VL_TINY = replace(
    _QWEN2_VL_2B, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    rope_theta=10000.0, mrope_section=[2, 3, 3], image_token_id=250, vision_start_token_id=251,
    vision_end_token_id=252,
    vision=VisionConfig(kind="qwen2_vl", depth=2, embed_dim=32, num_heads=2,
                        intermediate_size=64, hidden_act="quick_gelu", out_hidden_size=64),
)
DUMMY_PRESETS |= {
    "qwen2-vl-2b": _QWEN2_VL_2B,
    "qwen2.5-vl-7b": replace(
        _QWEN2_VL_2B, model_type="qwen2_5_vl", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
        max_position_embeddings=128000, tie_word_embeddings=False,
        vision=VisionConfig(kind="qwen2_5_vl", depth=32, embed_dim=1280, num_heads=16,
                            intermediate_size=3420, hidden_act="silu", out_hidden_size=3584,
                            window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                            tokens_per_second=2)),
    "qwen2-vl-tiny": _QWEN2_VL_TINY,
    "qwen2.5-vl-tiny": replace(
        _QWEN2_VL_TINY, model_type="qwen2_5_vl",
        vision=VisionConfig(kind="qwen2_5_vl", depth=2, embed_dim=32, num_heads=2,
                            intermediate_size=48, hidden_act="silu", out_hidden_size=64,
                            window_size=56, fullatt_block_indexes=[1], tokens_per_second=2)),
}
REAL_SHAPE_PRESETS = REAL_SHAPE_PRESETS | {"qwen2-vl-2b", "qwen2.5-vl-7b"}


def dummy_config(name: str) -> ModelConfig:
    """Config of a `dummy:<preset>` model name (a fresh copy, safe to modify)."""
    preset = name.split(":", 1)[1] if ":" in name else name
    if preset not in DUMMY_PRESETS:
        raise ValueError(f"unknown dummy preset {preset!r}; known: {sorted(DUMMY_PRESETS)}")
    base = DUMMY_PRESETS[preset]
    # presets derived with `replace` share their list fields with their base, so every mutable
    # field is copied here
    vision = base.vision and replace(
        base.vision, fullatt_block_indexes=list(base.vision.fullatt_block_indexes))
    return replace(base, rope_scaling=_copy(base.rope_scaling),
                   mlp_only_layers=list(base.mlp_only_layers),
                   layer_windows=list(base.layer_windows), vision=vision,
                   mrope_section=list(base.mrope_section))


def _copy(d: dict | None) -> dict | None:
    return None if d is None else dict(d)


def dummy_preset_name(name: str) -> str:
    """'dummy:llama-1b' -> 'llama-1b'."""
    return name.split(":", 1)[1] if ":" in name else name
