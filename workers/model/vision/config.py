"""Vision-tower hyper-parameters of Qwen2-VL and Qwen2.5-VL, read from a config.json's
`vision_config` dict (Hub checkpoints and transformers 5 write the same keys, except the input
channels: `in_chans` on the Hub, `in_channels` in transformers 5)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

VisionKind = Literal["qwen2_vl", "qwen2_5_vl"]


@dataclass
class VisionConfig:
    # qwen2_vl: LayerNorm blocks, fc1/quick_gelu/fc2 MLP, full attention per frame;
    # qwen2_5_vl: RMSNorm blocks, gated MLP with biases, window attention outside
    # fullatt_block_indexes, an RMSNorm in the merger
    kind: VisionKind
    depth: int
    embed_dim: int  # the blocks' width (Qwen2-VL's embed_dim, Qwen2.5-VL's hidden_size)
    num_heads: int
    intermediate_size: int  # the MLP's width (Qwen2-VL: embed_dim * mlp_ratio)
    hidden_act: str
    out_hidden_size: int  # the merger's output = the LM's hidden size
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    in_channels: int = 3
    # Qwen2.5-VL: attention windows of window_size pixels (0 = no windows), full attention in
    # these blocks only
    window_size: int = 0
    fullatt_block_indexes: list[int] = field(default_factory=list)
    tokens_per_second: int = 0  # video time scale (kept for the frontend; images ignore it)
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one row of pixel_values: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches per LM token (a merge_size x merge_size square)."""
        return self.spatial_merge_size**2

    @classmethod
    def from_hf_dict(cls, d: dict, kind: VisionKind) -> VisionConfig:
        """Missing keys take transformers' defaults for the family."""
        rope = d.get("rope_parameters") or {}
        qwen2 = kind == "qwen2_vl"
        # Qwen2-VL names the blocks' width embed_dim and its MLP by mlp_ratio; its `hidden_size`
        # is the merger's output (the LM width), which Qwen2.5-VL calls out_hidden_size.
        embed = int(d.get("embed_dim", 1280) if qwen2 else d.get("hidden_size", 1280))
        inter = (int(embed * float(d.get("mlp_ratio", 4))) if qwen2
                 else int(d.get("intermediate_size", 3420)))
        return cls(
            kind=kind,
            depth=int(d.get("depth", 32)),
            embed_dim=embed,
            num_heads=int(d.get("num_heads", 16)),
            intermediate_size=inter,
            hidden_act=str(d.get("hidden_act", "quick_gelu" if qwen2 else "silu")),
            out_hidden_size=int(d.get("hidden_size" if qwen2 else "out_hidden_size", 3584)),
            patch_size=int(d.get("patch_size", 14)),
            spatial_merge_size=int(d.get("spatial_merge_size", 2)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            in_channels=int(d.get("in_channels") or d.get("in_chans") or 3),
            window_size=0 if qwen2 else int(d.get("window_size", 112)),
            fullatt_block_indexes=[] if qwen2 else [
                int(i) for i in d.get("fullatt_block_indexes", [7, 15, 23, 31])],
            tokens_per_second=0 if qwen2 else int(d.get("tokens_per_second", 4)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )


def vision_param_shapes(v: VisionConfig, prefix: str = "visual") -> dict[str, tuple[int, ...]]:
    """HF (Hub) names and full shapes of the tower's weights."""
    e, inter, unit = v.embed_dim, v.intermediate_size, v.merge_unit
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}.patch_embed.proj.weight": (e, v.in_channels, v.temporal_patch_size,
                                              v.patch_size, v.patch_size)}
    layer_norm = v.kind == "qwen2_vl"
    for i in range(v.depth):
        p = f"{prefix}.blocks.{i}"
        shapes |= {f"{p}.norm1.weight": (e,), f"{p}.norm2.weight": (e,),
                   f"{p}.attn.qkv.weight": (3 * e, e), f"{p}.attn.qkv.bias": (3 * e,),
                   f"{p}.attn.proj.weight": (e, e), f"{p}.attn.proj.bias": (e,)}
        if layer_norm:
            shapes |= {f"{p}.norm1.bias": (e,), f"{p}.norm2.bias": (e,),
                       f"{p}.mlp.fc1.weight": (inter, e), f"{p}.mlp.fc1.bias": (inter,),
                       f"{p}.mlp.fc2.weight": (e, inter), f"{p}.mlp.fc2.bias": (e,)}
        else:
            for name in ("gate_proj", "up_proj"):
                shapes |= {f"{p}.mlp.{name}.weight": (inter, e), f"{p}.mlp.{name}.bias": (inter,)}
            shapes |= {f"{p}.mlp.down_proj.weight": (e, inter), f"{p}.mlp.down_proj.bias": (e,)}
    m = f"{prefix}.merger"
    shapes |= {f"{m}.ln_q.weight": (e,), f"{m}.mlp.0.weight": (e * unit, e * unit),
               f"{m}.mlp.0.bias": (e * unit,), f"{m}.mlp.2.weight": (v.out_hidden_size, e * unit),
               f"{m}.mlp.2.bias": (v.out_hidden_size,)}
    if layer_norm:
        shapes[f"{m}.ln_q.bias"] = (e,)
    return shapes
