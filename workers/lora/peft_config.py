"""Reading and checking a PEFT LoRA directory without torch: adapter_config.json and the header
of adapter_model.safetensors.

Torch-free (the standard library only), so the frontend can check an adapter and find its rank
(``max_rank``, the default of ``--max-lora-rank``) without loading a model. The ranks read the
tensors themselves in workers/lora/weights.py after ``check_adapter`` passed.

What is served: plain LoRA (``lora_B @ lora_A`` scaled by ``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``) on any of the seven linear projections of a
Llama-family decoder layer, with PEFT's per-module ``rank_pattern`` / ``alpha_pattern``. Anything
else that changes what the adapter computes is refused with an error naming the field or file,
never ignored: a refused adapter fails its own requests only.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Collection
from dataclasses import dataclass

from protocol.lora_files import CONFIG_NAME, WEIGHTS_NAME
from workers.lora import patterns as _patterns

# the projections LoRA may target, and the block each lives in (the HF module names)
PROJECTIONS: dict[str, str] = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}
_EMBEDDINGS = ("embed_tokens", "lm_head", "wte", "word_embeddings", "embed_out")
_MOE = ("experts", "block_sparse_moe", "w1", "w2", "w3", "gate", "router", "shared_expert")
# more keys than a model has modules is no adapter; each key costs a match per module
MAX_PATTERN_KEYS = 1024
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
_MODULE_RE = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)")
# transformers 5 (and 4.52+) names a vision-language model's decoder model.language_model.*
# (Qwen2-VL / Qwen2.5-VL), so a PEFT adapter on its language model saves those names; they are
# the decoder layers this engine adapts (model.layers.*), the vision tower (model.visual.*) is
# never adapted and a tensor for it is refused
_LM_PREFIX = "model.language_model.layers."
_SUPPORTED = ", ".join(PROJECTIONS)

# Fields that change what the adapter computes and that this engine does not implement: refused
# when set to anything but their "off" value (None, False, empty, or the value given here).
_REFUSED: dict[str, str] = {
    "use_dora": "DoRA adapters (use_dora) are not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "fan_in_fan_out": "fan_in_fan_out (transposed Conv1D weights) is not supported",
    "lora_bias": "lora_bias (a bias on lora_B) is not supported",
    "target_parameters": "target_parameters (LoRA on parameters, e.g. MoE experts) is not "
                         "supported",
    "layer_replication": "layer_replication is not supported",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows) is not "
                               "supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "kasa_config": "kasa_config is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
}
# Fields that only shape training, initialisation or bookkeeping, or that are handled here:
# accepted whatever their value. Any other field with a value set is refused by name, so a
# future PEFT option that changes the computation is never silently dropped.
_ACCEPTED = frozenset({
    "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules",
    "exclude_modules", "layers_to_transform", "layers_pattern", "bias", "peft_type",
    "peft_version", "task_type", "base_model_name_or_path", "revision", "inference_mode",
    "auto_mapping", "init_lora_weights", "lora_dropout", "loftq_config", "eva_config",
    "corda_config", "lora_ga_config", "megatron_config", "megatron_core", "runtime_config",
    "qalora_group_size", "ensure_weight_tying", "velora_config", "target_modules_bd_a",
    "target_modules_bd_b",
})


class LoRAAdapterError(ValueError):
    """An adapter this engine refuses; the message names the PEFT field or the file."""


@dataclass(frozen=True)
class PeftLoRAConfig:
    """The fields of adapter_config.json that decide what the adapter computes."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: tuple[str, ...] | str | None

    def rank_of(self, module: str) -> int:
        return self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)

    def scaling_of(self, module: str) -> float:
        """PEFT's scaling of one module: its alpha over its rank (or the rank's square root)."""
        r = self.rank_of(module)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_key(patterns: dict, module: str) -> str:
    """The first key of rank_pattern / alpha_pattern that names ``module`` as PEFT matches it:
    the key is a regex that must match a dotted suffix of the module's full name (checked by
    parse_config to match in bounded time)."""
    for key in patterns:
        if _patterns.key_matches(key, module):
            return key
    return module


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]  # byte range in the data section


@dataclass(frozen=True)
class ModuleSpec:
    """One adapted projection: ``lora_A`` [rank, in_features], ``lora_B`` [out_features, rank]."""

    module: str  # e.g. model.layers.0.self_attn.q_proj
    layer: int
    projection: str  # q_proj ... down_proj
    rank: int
    scaling: float
    in_features: int
    out_features: int
    source: str = ""  # the module's name in the file when it is not ``module``

    @property
    def a_name(self) -> str:
        return f"base_model.model.{self.source or self.module}.lora_A.weight"

    @property
    def b_name(self) -> str:
        return f"base_model.model.{self.source or self.module}.lora_B.weight"


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: its config and every adapted projection, by module name."""

    path: str
    config: PeftLoRAConfig
    modules: dict[str, ModuleSpec]

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())


# ------------------------------------------------------------------------- adapter_config.json


def parse_config(data: bytes) -> PeftLoRAConfig:
    """adapter_config.json's bytes -> its LoRA fields; LoRAAdapterError on anything refused."""
    try:
        d = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{CONFIG_NAME} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise LoRAAdapterError(f"{CONFIG_NAME} must hold a JSON object")
    peft_type = d.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"peft_type {peft_type!r} is not supported (only LORA adapters)")
    for name, why in _REFUSED.items():
        if d.get(name):
            raise LoRAAdapterError(f"{CONFIG_NAME}: {why} ({name}={d[name]!r})")
    bias = d.get("bias", "none")
    if bias not in (None, "none"):
        raise LoRAAdapterError(f"{CONFIG_NAME}: bias={bias!r} (trained biases) is not "
                               "supported; only bias=\"none\"")
    unknown = sorted(k for k, v in d.items()
                     if k not in _ACCEPTED and k not in _REFUSED and v not in (None, False, [], {}))
    if unknown:
        raise LoRAAdapterError(f"{CONFIG_NAME}: unknown field(s) {unknown} are set; this "
                               "engine does not know what they change")
    r = _positive_int(d.get("r", 8), "r")
    alpha = _number(d.get("lora_alpha", 8), "lora_alpha")
    rank_pattern = {str(k): _positive_int(v, f"rank_pattern[{k!r}]")
                    for k, v in _mapping(d.get("rank_pattern"), "rank_pattern").items()}
    alpha_pattern = {str(k): _number(v, f"alpha_pattern[{k!r}]")
                     for k, v in _mapping(d.get("alpha_pattern"), "alpha_pattern").items()}
    for name, pattern in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        if len(pattern) > MAX_PATTERN_KEYS:
            raise LoRAAdapterError(f"{CONFIG_NAME}: {name} has {len(pattern)} keys, more than "
                                   f"{MAX_PATTERN_KEYS}")
        for key in pattern:
            _check_pattern(key, f"{name} key")
    return PeftLoRAConfig(r=r, lora_alpha=alpha, use_rslora=bool(d.get("use_rslora", False)),
                          rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
                          target_modules=_target_modules(d.get("target_modules")))


def _positive_int(v: object, field: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise LoRAAdapterError(f"{CONFIG_NAME}: {field} must be an integer >= 1, got {v!r}")
    return v


def _number(v: object, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise LoRAAdapterError(f"{CONFIG_NAME}: {field} must be a finite number, got {v!r}")
    return float(v)


def _mapping(v: object, field: str) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise LoRAAdapterError(f"{CONFIG_NAME}: {field} must be an object, got {v!r}")
    return v


def _target_modules(v: object) -> tuple[str, ...] | str | None:
    """A list's names must be projections this engine adapts ("all-linear": all of them); a
    string is PEFT's full-match regex over module names, checked through the tensors."""
    if v is None:
        return v
    if isinstance(v, str):
        if v != "all-linear":
            _check_pattern(v, "target_modules")
        return v
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
        raise LoRAAdapterError(f"{CONFIG_NAME}: target_modules must be a list of names or a "
                               f"regex string, got {v!r}")
    for t in v:
        leaf = t.rsplit(".", 1)[-1]
        if leaf in PROJECTIONS or t == "all-linear":
            continue
        raise LoRAAdapterError(f"{CONFIG_NAME}: target_modules names {t!r}: {_why_not(leaf)}")
    return tuple(v)


def _check_pattern(pattern: str, field: str) -> None:
    """A hostile config must not hang whoever matches its patterns: refuse, naming the
    pattern, what patterns.py cannot match in bounded time."""
    why = _patterns.why_refused(pattern)
    if why is not None:
        raise LoRAAdapterError(f"{CONFIG_NAME}: {field} {pattern[:80]!r} is refused: {why}")


def _why_not(leaf: str) -> str:
    if leaf in _EMBEDDINGS:
        return "LoRA on the embeddings or the LM head is not supported"
    if leaf in _MOE:
        return "LoRA on mixture-of-experts experts or routers is not supported"
    return f"the model has no such module (LoRA applies to {_SUPPORTED})"


# ------------------------------------------------------------- adapter_model.safetensors header


def parse_header(head: bytes, file_size: int) -> dict[str, TensorInfo]:
    """The tensor table of a safetensors file from its first bytes (at least the 8-byte length
    and the JSON header); checked against the file's size so a truncated file is refused."""
    bad = f"{WEIGHTS_NAME} is corrupt"
    if len(head) < 8 or file_size < 8:
        raise LoRAAdapterError(f"{bad}: shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", head[:8])
    if n > file_size - 8 or len(head) < 8 + n:
        raise LoRAAdapterError(f"{bad}: its header length {n} exceeds the file")
    try:
        table = json.loads(head[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{bad}: the header is not valid JSON ({e})") from None
    if not isinstance(table, dict):
        raise LoRAAdapterError(f"{bad}: the header is not a JSON object")
    data_size = file_size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, info in table.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = str(info["dtype"]), tuple(int(s) for s in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (TypeError, KeyError, ValueError):
            raise LoRAAdapterError(f"{bad}: the header entry of {name!r} is malformed") from None
        if not 0 <= begin <= end <= data_size:
            raise LoRAAdapterError(f"{bad}: tensor {name!r} lies past the end of the file")
        if dtype in _DTYPE_BYTES and end - begin != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise LoRAAdapterError(f"{bad}: tensor {name!r} has {end - begin} bytes for "
                                   f"shape {list(shape)} in {dtype}")
        out[name] = TensorInfo(dtype, shape, (begin, end))
    return out


def read_header(path: str) -> dict[str, TensorInfo]:
    file = os.path.join(path, WEIGHTS_NAME)
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        n = struct.unpack("<Q", first)[0] if len(first) == 8 else 0
        head = first + f.read(min(n, max(size - 8, 0)))
    return parse_header(head, size)


# ------------------------------------------------------------------------ the whole adapter


def check_files(path: str) -> None:
    """Both files exist (a pickled adapter_model.bin alone is refused: only safetensors is read)."""
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter path {path!r} is not a directory")
    if not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        raise LoRAAdapterError(f"LoRA adapter {path!r} has no {CONFIG_NAME}")
    if not os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise LoRAAdapterError(
                f"LoRA adapter {path!r} has only adapter_model.bin: only {WEIGHTS_NAME} is read "
                "(convert it, e.g. save_pretrained(..., safe_serialization=True))")
        raise LoRAAdapterError(f"LoRA adapter {path!r} has no {WEIGHTS_NAME}")


def check_adapter(path: str, max_lora_rank: int | None = None,
                  model_modules: Collection[str] | None = None,
                  config_bytes: bytes | None = None,
                  header: dict[str, TensorInfo] | None = None) -> AdapterSpec:
    """Check a PEFT directory (or its config bytes and weights header, already read) and list
    what it adapts. ``model_modules``: the names of the projections the model has (e.g.
    ``model.layers.0.self_attn.q_proj``), None to skip that check; ``max_lora_rank``: the
    largest rank a slot holds, None for no limit."""
    if config_bytes is None or header is None:
        check_files(path)
        try:
            with open(os.path.join(path, CONFIG_NAME), "rb") as f:
                config_bytes = f.read()
            header = read_header(path)
        except OSError as e:
            raise LoRAAdapterError(f"cannot read LoRA adapter {path!r}: {e}") from None
    config = parse_config(config_bytes)
    modules = _modules(header, config)
    for m in modules.values():
        if model_modules is not None and m.module not in model_modules:
            raise LoRAAdapterError(f"{WEIGHTS_NAME} adapts {m.module}, which the model does "
                                   "not have (another base model?)")
        if max_lora_rank is not None and m.rank > max_lora_rank:
            raise LoRAAdapterError(f"rank {m.rank} of {m.module} exceeds max_lora_rank "
                                   f"{max_lora_rank} (raise --max-lora-rank)")
    return AdapterSpec(path=path, config=config, modules=modules)


def _modules(header: dict[str, TensorInfo], config: PeftLoRAConfig) -> dict[str, ModuleSpec]:
    pairs: dict[str, dict[str, TensorInfo]] = {}
    for name, info in header.items():
        module, kind = _classify(name)
        if info.dtype not in _DTYPE_BYTES:
            raise LoRAAdapterError(f"{WEIGHTS_NAME}: tensor {name} is {info.dtype}; only F32, "
                                   "F16 and BF16 are read")
        if len(info.shape) != 2:
            raise LoRAAdapterError(f"{WEIGHTS_NAME}: tensor {name} has shape "
                                   f"{list(info.shape)}, not a matrix")
        pairs.setdefault(module, {})[kind] = info
    if not pairs:
        raise LoRAAdapterError(f"{WEIGHTS_NAME} holds no LoRA weights")
    out: dict[str, ModuleSpec] = {}
    for source, ab in sorted(pairs.items()):
        # PEFT's own name (what target_modules and rank / alpha patterns match) and this
        # engine's (model.layers.*)
        module = _canonical(source)
        if module in out:
            raise LoRAAdapterError(f"{WEIGHTS_NAME}: {module} is adapted twice (as "
                                   f"{out[module].source or module} and {source})")
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRAAdapterError(f"{WEIGHTS_NAME}: {module} has no {missing}.weight")
        (r, n_in), (n_out, r_b) = ab["A"].shape, ab["B"].shape
        if r != r_b:
            raise LoRAAdapterError(f"{WEIGHTS_NAME}: {module} has lora_A of rank {r} but "
                                   f"lora_B of rank {r_b}")
        want = config.rank_of(source)
        if r != want:
            raise LoRAAdapterError(f"{WEIGHTS_NAME}: {module} has rank {r} but {CONFIG_NAME} "
                                   f"(r / rank_pattern) says {want}")
        if not _targeted(config.target_modules, source):
            raise LoRAAdapterError(f"{WEIGHTS_NAME} adapts {source}, which target_modules "
                                   f"({config.target_modules!r}) does not name")
        m = _MODULE_RE.fullmatch(module)
        assert m is not None  # _classify checked it
        out[module] = ModuleSpec(module=module, layer=int(m.group(1)), projection=m.group(3),
                                 rank=r, scaling=config.scaling_of(source), in_features=n_in,
                                 out_features=n_out, source="" if source == module else source)
    return out


def _canonical(module: str) -> str:
    """A decoder projection's name as this engine's model names it (model.layers.*)."""
    if module.startswith(_LM_PREFIX):
        return "model.layers." + module[len(_LM_PREFIX):]
    return module


def _targeted(targets: tuple[str, ...] | str | None, module: str) -> bool:
    """Whether PEFT would put LoRA on ``module`` (a tensor it would not load must not be
    served either): a regex must match the whole name, a list entry the name or a dotted
    suffix of it."""
    if targets is None:
        return True
    if isinstance(targets, str):
        return targets == "all-linear" or _patterns.fullmatch(targets, module)
    return any(t == "all-linear" or module == t or module.endswith("." + t) for t in targets)


def _classify(name: str) -> tuple[str, str]:
    """A tensor name -> (module name, "A" or "B"); LoRAAdapterError for anything else."""
    where = f"{WEIGHTS_NAME}: tensor {name}"
    if "lora_magnitude_vector" in name:
        raise LoRAAdapterError(f"{where}: DoRA adapters (use_dora) are not supported")
    if "lora_embedding_" in name:
        raise LoRAAdapterError(f"{where}: LoRA on the embeddings is not supported")
    m = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.(weight|bias)", name)
    if m is None:
        raise LoRAAdapterError(f"{where} is not a LoRA weight (expected "
                               "base_model.model.<module>.lora_A.weight / lora_B.weight)")
    module, kind, what = m.groups()
    if what == "bias":
        raise LoRAAdapterError(f"{where}: lora_bias (a bias on lora_B) is not supported")
    parts = module.split(".")
    if any(p in _EMBEDDINGS for p in parts):
        raise LoRAAdapterError(f"{where}: LoRA on the embeddings or the LM head is not "
                               "supported")
    if any(p in ("experts", "block_sparse_moe", "shared_expert") for p in parts):
        raise LoRAAdapterError(f"{where}: LoRA on mixture-of-experts experts is not supported")
    mm = _MODULE_RE.fullmatch(_canonical(module))
    if mm is None or PROJECTIONS.get(mm.group(3)) != mm.group(2):
        raise LoRAAdapterError(f"{where}: the model has no module {module} (LoRA applies to "
                               f"{_SUPPORTED} of model.layers.<i>)")
    return module, kind


def max_rank(path: str) -> int:
    """The largest LoRA rank of a PEFT directory (the adapter is checked on the way):
    the frontend's default for ``--max-lora-rank``."""
    return check_adapter(path).max_rank
