"""Compile every Triton kernel of the engine ahead of time for sm_90 and sm_80, at the
constexpr sets and launch options (workers/triton_ops/attention_config.py) the engine uses for
the dummy real-shape presets, without a GPU (Triton ships ptxas and cuobjdump). Fails on a
compile error, on local-memory spills in a bf16/fp16 kernel, or on an attention kernel whose
dot is not a tensor-core instruction in the SASS (HMMA on sm_80, HMMA or HGMMA on sm_90) or
whose K/V tiles are not double-buffered in the TTGIR (fewer than 2
async-copy buffers). Prints a table: kernel, shape, registers, spills, shared memory, warps,
stages, K/V buffers.

    python scripts/compile_check.py [--quick] [--json]

--quick compiles a representative subset (one preset's decode and prefill attention, the small
kernels in bf16, sm_90 only); the CI test runs it, this script without it runs the full set.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
# Kernels decorated under the interpreter cannot be compiled ahead of time; a caller's
# TRITON_INTERPRET=1 (the CPU test suite sets it) must not reach the decorators below.
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from workers.model.config import DUMMY_PRESETS, REAL_SHAPE_PRESETS  # noqa: E402
from workers.triton_ops import next_pow2  # noqa: E402
from workers.triton_ops.attention_config import attention_config  # noqa: E402
from workers.triton_ops.fused_moe import compile_variants  # noqa: E402
from workers.triton_ops.kv_cache import _rotary_kv_kernel  # noqa: E402
from workers.triton_ops.lora import compile_variants as lora_variants  # noqa: E402
from workers.triton_ops.norm_act import _rms_norm_kernel, _silu_and_mul_kernel  # noqa: E402
from workers.triton_ops.paged_attention import (  # noqa: E402
    _merge_segments_kernel,
    _paged_attention_kernel,
    block_m_for,
    is_decode_block,
)

_TY = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
BLOCK_SIZE = 16  # the engine's default KV block size


@dataclass
class Case:
    kernel: str
    shape: str
    fn: object
    signature: dict[str, str]
    constexprs: dict[str, object]
    dtype: str
    attention_dot: bool = False  # the SASS must hold a tensor-core MMA, K/V double-buffered
    gemm_dot: bool = False  # the SASS must hold a tensor-core MMA
    # Example values of integer arguments (strides) at this preset's shapes: those divisible
    # by 16 are compiled as such, as the launcher's JIT specializes them at run time.
    ints: dict[str, int] | None = None
    # Per architecture: the constexprs and launch options (num_warps, num_stages) of the
    # attention config's row; Triton's defaults and `constexprs` otherwise.
    per_arch: dict[int, tuple[dict[str, object], dict[str, int]]] | None = None

    def attrs(self) -> dict[tuple[int, ...], list[list[object]]]:
        """What Triton's JIT would mark at a launch: every pointer 16-byte aligned (torch's
        allocations are, and the kernels take views at offset 0) and every integer argument
        whose value is a multiple of 16. Without these marks the compiler cannot prove a
        16-byte vector load, so cp.async (and the K/V pipelining) never appears and the
        registers are not the ones that run."""
        out: dict[tuple[int, ...], list[list[object]]] = {}
        for i, (name, ty) in enumerate(self.signature.items()):
            div = ty.startswith("*") or (self.ints or {}).get(name, 1) % 16 == 0
            if ty != "constexpr" and div:
                out[(i,)] = [["tt.divisibility", 16]]
        return out


def _attention(preset: str, dt: str, decode: bool) -> Case:
    cfg = DUMMY_PRESETS[preset]
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    block_m = block_m_for(group, 1 if decode else 512)
    segments = 16 if decode else 1
    p = "*" + _TY[dt]
    sig = {n: p for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
    sig |= {"block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32",
            "part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
            "scale_log2": "fp32", "num_reqs": "i32"}
    sig |= {n: "i32" for n in ("stride_q_t", "stride_q_h", "stride_o_t", "stride_o_h",
                               "stride_c_blk", "stride_c_slot", "stride_c_head", "stride_bt")}
    const = dict(BLOCK_SIZE=BLOCK_SIZE, HEAD_DIM=cfg.head_dim,
                 HEAD_DIM_P=max(16, next_pow2(cfg.head_dim)), NUM_HEADS=cfg.num_attention_heads,
                 GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_N=32,
                 NUM_SEGMENTS=segments, IEEE=dt == "float32", UPCAST=False, WINDOW=0)
    sig |= {k: "constexpr" for k in const}
    # The block table's row stride is its live width (any number): not marked divisible.
    h, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ints = dict(stride_q_t=(h + 2 * kvh) * hd, stride_q_h=hd, stride_o_t=h * hd, stride_o_h=hd,
                stride_c_blk=BLOCK_SIZE * kvh * hd, stride_c_slot=kvh * hd, stride_c_head=hd,
                stride_bt=1)
    per_arch = {}
    for arch in (90, 80):
        tune = attention_config(hd, dt, arch, is_decode_block(group, block_m))
        per_arch[arch] = (const | {"BLOCK_N": tune.block_n},
                          {"num_warps": tune.num_warps, "num_stages": tune.num_stages})
    kind = "decode" if decode else "prefill"
    return Case("paged_attention", f"{preset} {kind} M{block_m} S{segments}",
                _paged_attention_kernel, sig, const, dt, attention_dot=dt != "float32",
                ints=ints, per_arch=per_arch)


def _merge(preset: str, dt: str) -> Case:
    cfg = DUMMY_PRESETS[preset]
    sig = {"out_ptr": "*" + _TY[dt], "part_out_ptr": "*fp32", "part_max_ptr": "*fp32",
           "part_sum_ptr": "*fp32", "qsl_ptr": "*i32", "num_reqs": "i32",
           "stride_o_t": "i32", "stride_o_h": "i32"}
    const = dict(HEAD_DIM=cfg.head_dim, HEAD_DIM_P=max(16, next_pow2(cfg.head_dim)),
                 NUM_HEADS=cfg.num_attention_heads, NUM_SEGMENTS=16)
    sig |= {k: "constexpr" for k in const}
    return Case("merge_segments", preset, _merge_segments_kernel, sig, const, dt)


def _rotary(preset: str, dt: str) -> Case:
    cfg = DUMMY_PRESETS[preset]
    p = "*" + _TY[dt]
    sig = {"qkv_ptr": p, "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
           "slot_ptr": "*i64", "k_cache_ptr": p, "v_cache_ptr": p}
    sig |= {n: "i32" for n in ("stride_qkv", "stride_cos", "stride_c_blk", "stride_c_slot",
                               "stride_c_head")}
    const = dict(Q_HEADS=cfg.num_attention_heads, KV_HEADS=cfg.num_key_value_heads,
                 HEAD_DIM=cfg.head_dim, HALF_P=next_pow2(cfg.head_dim // 2),
                 BLOCK_SIZE=BLOCK_SIZE, ROTATE=True)
    sig |= {k: "constexpr" for k in const}
    return Case("rotary_kv", preset, _rotary_kv_kernel, sig, const, dt)


def _norm(preset: str, dt: str) -> Case:
    p = "*" + _TY[dt]
    sig = {"x_ptr": p, "delta_ptr": p, "w_ptr": p, "out_ptr": p, "stride_x": "i32",
           "stride_d": "i32", "stride_o": "i32", "n_cols": "i32", "eps": "fp32"}
    const = dict(BLOCK=next_pow2(DUMMY_PRESETS[preset].hidden_size), RESIDUAL=True)
    sig |= {k: "constexpr" for k in const}
    return Case("rms_norm", preset, _rms_norm_kernel, sig, const, dt)


def _silu(preset: str, dt: str) -> Case:
    p = "*" + _TY[dt]
    sig = {"x_ptr": p, "out_ptr": p, "stride_x": "i32", "stride_o": "i32", "n_cols": "i32",
           "BLOCK": "constexpr"}
    const = dict(BLOCK=min(1024, next_pow2(DUMMY_PRESETS[preset].intermediate_size)))
    return Case("silu_and_mul", preset, _silu_and_mul_kernel, sig, const, dt)


def _fused_moe(dt: str, top_k: int) -> list[Case]:
    """Every (GEMM, tile config) the fused MoE launches; its shapes are runtime arguments, so
    one set covers every MoE preset of that top-k."""
    out = []
    for fn, sig, const, options in compile_variants((_TY[dt],), top_k):
        name = "moe_gate_up" if const["GATED"] else "moe_down"
        tiles = f"M{const['BLOCK_M']} N{const['BLOCK_N']} K{const['BLOCK_K']} top{top_k}"
        out.append(Case(name, tiles, fn, sig, const, dt, gemm_dot=True,
                        per_arch={a: (const, options) for a in (90, 80)}))
    return out


def _lora(dt: str) -> list[Case]:
    """Every (kernel, tile config) of the batched LoRA; its shapes (hidden size, rank, number
    of slots) are runtime arguments, so one set covers every model."""
    out = []
    for name, fn, sig, const, options in lora_variants((_TY[dt],)):
        kernel, size = name.split()
        tiles = f"{size} M{const['BLOCK_M']} N{const['BLOCK_N']} K{const['BLOCK_K']}"
        out.append(Case(kernel, tiles, fn, sig, const, dt, gemm_dot=True,
                        per_arch={a: (const, options) for a in (90, 80)}))
    return out


def cases(quick: bool) -> list[Case]:
    if quick:
        return [_attention("llama-8b", "bfloat16", True), _attention("llama-8b", "bfloat16", False),
                _merge("llama-8b", "bfloat16"), _rotary("llama-8b", "bfloat16"),
                _norm("llama-8b", "bfloat16"), _silu("llama-8b", "bfloat16"),
                _fused_moe("bfloat16", 8)[0], *_lora("bfloat16")[::2]]
    out = []
    for preset in sorted(REAL_SHAPE_PRESETS):
        for dt in ("bfloat16", "float16"):
            out += [_attention(preset, dt, True), _attention(preset, dt, False),
                    _merge(preset, dt), _rotary(preset, dt), _norm(preset, dt), _silu(preset, dt)]
    top_ks = sorted({DUMMY_PRESETS[p].num_experts_per_tok for p in REAL_SHAPE_PRESETS
                     if DUMMY_PRESETS[p].num_experts_per_tok})
    for dt in ("bfloat16", "float16"):
        for top_k in top_ks:
            out += _fused_moe(dt, top_k)
    for dt in ("bfloat16", "float16"):
        out += _lora(dt)
    return out


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def check(case: Case, arch: int) -> dict:
    row = {"kernel": case.kernel, "shape": case.shape, "dtype": case.dtype, "arch": f"sm_{arch}"}
    constexprs: dict[str, object] = case.constexprs
    options: dict[str, int] = {}
    if case.per_arch is not None:
        constexprs, options = case.per_arch[arch]
    try:
        k = triton.compile(ASTSource(case.fn, case.signature, constexprs=constexprs,
                                     attrs=case.attrs()),
                           target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as e:  # noqa: BLE001 - any compile failure is the finding
        return row | {"error": f"compile: {type(e).__name__}: {str(e)[:300]}"}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout

    def field(name: str) -> int:
        m = re.search(rf"{name}:(\d+)", res)
        return int(m.group(1)) if m else 0

    spills = field("STACK") + field("LOCAL")
    mma = sorted(set(re.findall(r"\b(HGMMA|HMMA|IMMA)\b", sass)))
    bufs = kv_buffers(k.asm["ttgir"])
    # cuobjdump reports static shared memory only; the pipeline buffers are dynamic
    smem = max(field("SHARED"), int(k.metadata.shared))
    row |= {"registers": field("REG"), "spill_bytes": spills, "shared_bytes": smem,
            "num_warps": k.metadata.num_warps, "num_stages": k.metadata.num_stages,
            "kv_buffers": bufs, "mma": ",".join(mma) or "-"}
    if spills and case.dtype != "float32":
        row["error"] = f"{spills} B of local memory (spills) per thread"
    elif (case.attention_dot or case.gemm_dot) and not mma:
        row["error"] = "the dot is not a tensor-core instruction (no HMMA/HGMMA)"
    elif case.attention_dot and bufs < 2:
        row["error"] = f"K/V tiles not double-buffered in the TTGIR ({bufs} async buffer(s))"
    return row


def kv_buffers(ttgir: str) -> int:
    """How many shared-memory buffers the software pipeliner gave the deepest async-copied
    half-precision tile (the K/V tiles of the attention loop): the leading dimension of a
    mutable multi-buffer allocation, 0 when nothing is copied asynchronously."""
    if "async_copy_global_to_local" not in ttgir:
        return 0
    shapes = re.findall(r"ttg\.local_alloc[^\n]*!ttg\.memdesc<(\d+)x\d+x\d+x(?:bf16|f16)[^>]*"
                        r"mutable>", ttgir)
    return max((int(n) for n in shapes), default=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the representative subset (CI)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    archs = (90,) if args.quick else (90, 80)
    rows = [check(c, a) for c in cases(args.quick) for a in archs]
    print(f"triton {triton.__version__}")
    print(f"{'kernel':16} {'shape':34} {'dtype':9} {'arch':6} {'regs':>4} {'spill':>5} "
          f"{'smem':>6} {'w':>2} {'st':>2} {'kvb':>3} mma")
    for r in rows:
        print(f"{r['kernel']:16} {r['shape']:34} {r['dtype']:9} {r['arch']:6} "
              f"{r.get('registers', '-'):>4} {r.get('spill_bytes', '-'):>5} "
              f"{r.get('shared_bytes', '-'):>6} {r.get('num_warps', '-'):>2} "
              f"{r.get('num_stages', '-'):>2} {r.get('kv_buffers', '-'):>3} {r.get('mma', '-')}"
              + (f"  FAIL: {r['error']}" if "error" in r else ""))
    failed = [r for r in rows if "error" in r]
    if args.json:
        print(json.dumps({"triton": triton.__version__, "kernels": rows, "failed": len(failed)}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
