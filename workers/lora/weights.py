"""This rank's tensor-parallel slice of a PEFT adapter, cut the way the base layers are cut.

The base model packs q/k/v into one column-parallel qkv_proj and gate/up into gate_up_proj;
o_proj and down_proj are row-parallel (workers/model/llama.py). LoRA follows that layout:

- column-parallel (qkv, gate_up): every rank keeps lora_A whole (its input is the whole hidden
  state) and the rows of lora_B that produce its own output rows, head by head exactly as
  TPLayout splits the base weights: K/V heads padded up to a multiple of tp_size, their query
  groups with them; padded heads (and padded MLP rows) get zero rows of lora_B.
- row-parallel (o, down): every rank keeps the columns of lora_A that read its input slice
  (zero past the real features) and lora_B whole; x_r A_r^T B^T summed over the ranks is
  x A^T B^T, so each rank adds its partial LoRA product to its partial base product before
  the layer's existing all-reduce, and no collective is added.

The scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into lora_B at load, in
float32 before rounding to the model dtype.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load as load_safetensors

from protocol.lora_files import CONFIG_NAME, WEIGHTS_NAME, content_hash_of
from workers.lora.peft_config import (
    AdapterSpec,
    LoRAAdapterError,
    ModuleSpec,
    check_adapter,
    parse_header,
)

if TYPE_CHECKING:
    from workers.model.llama import LlamaForCausalLM

_LINEAR = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}


@dataclass(frozen=True)
class LoRATarget:
    """One base linear of one layer that LoRA adds to, and how this rank cuts each projection
    packed in it."""

    layer: int
    kind: str  # qkv | o | gate_up | down
    block: str  # self_attn | mlp: where the linear lives in the decoder layer
    row_parallel: bool
    projections: tuple[str, ...]  # HF projection names, in packing order
    in_features: int  # of this rank's base linear
    out_features: int
    full_in: int  # lora_A's in-features the model expects
    full_out: tuple[int, ...]  # lora_B's out-features per projection
    # per projection, this rank's (start, count): of lora_B's rows (column-parallel) or of
    # lora_A's columns (row-parallel); past the real size the slice is zero (padding)
    spans: tuple[tuple[int, int], ...]
    # where each projection's rows start in the packed output, and the end (NS + 1 entries)
    offsets: tuple[int, ...]

    @property
    def linear_name(self) -> str:
        return _LINEAR[self.kind]

    def module(self, projection: str) -> str:
        return f"model.layers.{self.layer}.{self.block}.{projection}"


def lora_targets(model: LlamaForCausalLM) -> list[LoRATarget]:
    """Every linear of a Llama-family model (LlamaForCausalLM and its subclasses) LoRA can
    adapt on this rank; mixture-of-experts layers have no dense MLP to adapt."""
    cfg, lay = model.cfg, model.layout
    hd, h = cfg.head_dim, cfg.hidden_size
    q, kv, inter = lay.q_heads * hd, lay.kv_heads * hd, lay.inter
    out = []
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        if hasattr(attn, "qkv_proj") and hasattr(attn, "o_proj"):
            out.append(LoRATarget(
                i, "qkv", "self_attn", False, ("q_proj", "k_proj", "v_proj"), h, q + 2 * kv,
                h, (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd,
                    cfg.num_key_value_heads * hd),
                ((lay.q_start * hd, q), (lay.kv_start * hd, kv), (lay.kv_start * hd, kv)),
                (0, q, q + kv, q + 2 * kv)))
            out.append(LoRATarget(i, "o", "self_attn", True, ("o_proj",), q, h,
                                  cfg.num_attention_heads * hd, (h,),
                                  ((lay.q_start * hd, q),), (0, h)))
        mlp = layer.mlp
        if hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj"):
            span = (lay.inter_start, inter)
            full = cfg.intermediate_size
            out.append(LoRATarget(i, "gate_up", "mlp", False, ("gate_proj", "up_proj"), h,
                                  2 * inter, h, (full, full), (span, span),
                                  (0, inter, 2 * inter)))
            out.append(LoRATarget(i, "down", "mlp", True, ("down_proj",), inter, h, full, (h,),
                                  (span,), (0, h)))
    return out


@dataclass
class TargetWeights:
    """One target's slice on this rank: a [NS, r, in_features] (one rank-r block per packed
    projection, zero for a projection the adapter leaves alone) and b [out_features, r] with
    the scaling folded in; r is the largest rank among the packed projections."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass
class PreparedAdapter:
    """An adapter as this rank keeps it in host memory, ready to copy into a slot."""

    lora_int_id: int
    path: str
    content_hash: str
    weights: dict[tuple[int, str], TargetWeights]  # (layer, kind) -> slice; absent: no LoRA

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


# adapter_config.json is a few hundred bytes; a megabyte is no config
MAX_CONFIG_BYTES = 1 << 20
# room for the safetensors header beside the tensor data: its JSON entry per tensor (name,
# dtype, shape, offsets: ~150 bytes) and a __metadata__ block
HEADER_BYTES_PER_TENSOR = 512
HEADER_BYTES_EXTRA = 64 << 10


def max_adapter_bytes(targets: list[LoRATarget], max_lora_rank: int) -> int:
    """The largest adapter_model.safetensors a legitimate adapter for this model has: lora_A
    [r, in] and lora_B [out, r] in float32 (the widest dtype read) for every projection at
    ``max_lora_rank``, plus room for the header. A bigger file is refused before its data is
    read, so a hostile file costs a stat and a header, never gigabytes."""
    data = tensors = 0
    for t in targets:
        for out in t.full_out:
            data += 4 * max_lora_rank * (t.full_in + out)
            tensors += 2
    return 8 + data + tensors * HEADER_BYTES_PER_TENSOR + HEADER_BYTES_EXTRA


def _too_big(size: int, limit: int) -> LoRAAdapterError:
    return LoRAAdapterError(f"{WEIGHTS_NAME} is {size} bytes, more than the {limit} bytes the "
                            "largest adapter for this model at --max-lora-rank takes (the "
                            "limit)")


def read_adapter(path: str, max_bytes: int, max_lora_rank: int,
                 model_modules: set[str]) -> tuple[bytes, bytes, AdapterSpec]:
    """adapter_config.json's and adapter_model.safetensors' bytes (what is hashed is what is
    loaded: the files are read once) and the adapter checked from the config and the
    safetensors header. The header is read and checked, and the file's size held against
    ``max_bytes`` (max_adapter_bytes), before any tensor data is read."""
    from workers.lora.peft_config import check_files

    check_files(path)
    try:
        with open(os.path.join(path, CONFIG_NAME), "rb") as f:
            if os.fstat(f.fileno()).st_size > MAX_CONFIG_BYTES:
                raise LoRAAdapterError(f"{CONFIG_NAME} is larger than {MAX_CONFIG_BYTES} bytes")
            config_bytes = f.read(MAX_CONFIG_BYTES)
        with open(os.path.join(path, WEIGHTS_NAME), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            if 8 + n > max_bytes:
                raise _too_big(max(size, 8 + n), max_bytes)
            head += f.read(min(n, max(size - 8, 0)))
            spec = check_adapter(path, max_lora_rank, model_modules, config_bytes,
                                 parse_header(head, size))
            if size > max_bytes:  # checked first, this adapter's own faults are named above
                raise _too_big(size, max_bytes)
            weights_bytes = head + f.read(size - len(head))
    except OSError as e:
        raise LoRAAdapterError(f"cannot read LoRA adapter {path!r}: {e}") from None
    return config_bytes, weights_bytes, spec


def load_adapter(lora_int_id: int, path: str, targets: list[LoRATarget], max_lora_rank: int,
                 dtype: torch.dtype, expected_hash: str = "") -> PreparedAdapter:
    """Read, check and slice an adapter for this rank; LoRAAdapterError names what is refused.
    ``expected_hash``: the engine core's content hash ("" skips the check)."""
    names = {t.module(p) for t in targets for p in t.projections}
    config_bytes, weights_bytes, spec = read_adapter(
        path, max_adapter_bytes(targets, max_lora_rank), max_lora_rank, names)
    digest = content_hash_of(config_bytes, weights_bytes)
    if expected_hash and digest != expected_hash:
        raise LoRAAdapterError(
            f"LoRA adapter {path!r} changed on disk since it was registered (content hash "
            f"{digest[:12]}... != {expected_hash[:12]}...); load it again under a new name")
    try:
        tensors = load_safetensors(weights_bytes)
    except Exception as e:  # noqa: BLE001 - the library's own errors name no field
        raise LoRAAdapterError(f"{WEIGHTS_NAME} is corrupt: {e}") from None
    # a NaN or inf weight would turn every logit of its requests into NaN (and a batch's
    # sampling with them): refused here, where the file is read, naming the tensor
    for m in spec.modules.values():
        for name in (m.a_name, m.b_name):
            if not bool(torch.isfinite(tensors[name]).all()):
                raise LoRAAdapterError(f"{WEIGHTS_NAME}: tensor {name} holds non-finite "
                                       "values (NaN or inf)")
    weights = {}
    for t in targets:
        mods = [spec.modules.get(t.module(p)) for p in t.projections]
        if any(m is not None for m in mods):
            weights[(t.layer, t.kind)] = _slice_target(t, mods, tensors, dtype)
    return PreparedAdapter(lora_int_id, path, digest, weights)


def _slice_target(t: LoRATarget, mods: list[ModuleSpec | None],
                  tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> TargetWeights:
    r = max(m.rank for m in mods if m is not None)
    a = torch.zeros(len(mods), r, t.in_features, dtype=dtype)
    b = torch.zeros(t.out_features, r, dtype=dtype)
    for j, m in enumerate(mods):
        if m is None:
            continue
        proj = t.projections[j]
        if m.in_features != t.full_in or m.out_features != t.full_out[j]:
            raise LoRAAdapterError(
                f"{WEIGHTS_NAME}: {m.module} maps {m.in_features} -> {m.out_features} "
                f"features but the model's {proj} maps {t.full_in} -> {t.full_out[j]} "
                "(an adapter for another base model?)")
        lora_a = tensors[m.a_name].float()
        lora_b = tensors[m.b_name].float() * m.scaling
        start, count = t.spans[j]
        if t.row_parallel:
            lora_a = _padded(lora_a, 1, start, count)
        else:
            lora_b = _padded(lora_b, 0, start, count)
        a[j, : m.rank] = lora_a.to(dtype)
        lo = t.offsets[j]
        b[lo : lo + lora_b.shape[0], : m.rank] = lora_b.to(dtype)
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        # finite in the file, but the scaling or the model dtype's range made them inf
        raise LoRAAdapterError(f"{WEIGHTS_NAME}: the weights of {t.module(t.projections[0])} "
                               f"({t.linear_name}) overflow {dtype} once scaled")
    return TargetWeights(a, b)


def _padded(x: torch.Tensor, dim: int, start: int, count: int) -> torch.Tensor:
    """x's [start, start + count) along dim; zero where that runs past x (padded heads/rows)."""
    real = x.narrow(dim, min(start, x.shape[dim]),
                    max(0, min(start + count, x.shape[dim]) - start))
    missing = count - real.shape[dim]
    if missing <= 0:
        return real
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([real, torch.zeros(shape, dtype=x.dtype)], dim=dim)
