"""CPU kernels (workers/cpu_ops/csrc/*.cpp) built on first use and called through ctypes.

The library is compiled once per source/compiler/CPU combination into a cache directory
($TANDEM_CACHE_DIR, default ~/.cache/tandem) with `-march=native`, then loaded by every worker.
Without a C++ compiler, or with TANDEM_CPU_KERNELS=0, `ops()` returns None and the model uses
its portable torch path (same math; the kernels exist because torch's per-op overhead and dtype
copies dominate the small ops of a CPU forward pass).

Every wrapper takes CPU tensors of dtype float32 or bfloat16 whose last dimension is contiguous.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False

_i64, _f32, _ptr, _int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_SIGNATURES: dict[str, list] = {
    "tandem_paged_attention": [_int, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr,
                               _i64, _i64, _i64, _i64, _i64, _f32, _i64, _i64],
    "tandem_rms_norm": [_int, _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _f32],
    "tandem_rotary": [_int, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr],
    "tandem_rotary_kv": [_int, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr,
                         _ptr],
    "tandem_silu_and_mul": [_int, _ptr, _ptr, _i64, _i64],
    "tandem_argmax": [_int, _ptr, _ptr, _ptr, _i64, _i64, _i64],
    "tandem_apply_token_bitmask": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64],
    "tandem_masked_argmax": [_ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr],
    "tandem_shm_post": [_ptr, _i64, _ptr, _ptr, _i64],
    "tandem_shm_wait": [_ptr, _i64, _int, _i64, _i64],
    "tandem_shm_sum": [_int, _ptr, _ptr, _i64, _int, _i64],
    "tandem_attention_any_length": [_i64],
    "tandem_bf16_matmul_available": [],
    "tandem_pack_bf16_pairs": [_ptr, _i64, _i64, _ptr],
    "tandem_bf16_matmul": [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr],
    "tandem_set_num_threads": [_int],
    "tandem_num_threads": [],
}
_RETURNS_INT = ("tandem_num_threads", "tandem_shm_wait", "tandem_attention_any_length",
                "tandem_bf16_matmul_available")


# Tests flip this to compare the kernels with the torch path in one process.
ENABLED = os.environ.get("TANDEM_CPU_KERNELS", "1") != "0"


def active(t: torch.Tensor) -> bool:
    """Whether the model should use the kernels for tensors like `t`."""
    return ENABLED and t.device.type == "cpu" and t.dtype in _DTYPE_CODES and ops() is not None


def _cpu_fingerprint() -> bytes:
    # -march=native code is only valid on the CPU it was built for.
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return b""
    for line in text.splitlines():
        if line.startswith(("flags", "model name")):
            return line.encode()
    return b""


def _build(compiler: str) -> Path:
    sources = sorted(CSRC.glob("*.cpp"))
    digest = hashlib.sha256()
    for path in sources + sorted(CSRC.glob("*.h")):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(FLAGS).encode() + compiler.encode() + _cpu_fingerprint())
    key = digest.hexdigest()[:16]
    cache = Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))
    lib = cache / f"cpu_ops-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: ranks starting together may all build, none sees a
    # half-written library.
    fd, tmp = tempfile.mkstemp(prefix=lib.name, suffix=".tmp", dir=cache)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, *map(str, sources), "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=300)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def ops() -> ctypes.CDLL | None:
    """The loaded kernel library, or None when disabled or it cannot be built."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
            return None
        compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if compiler is None:
            logger.warning("no C++ compiler found: CPU kernels off, using the torch path")
            return None
        try:
            # torch first: its OpenMP runtime is then the one the kernels share.
            lib = ctypes.CDLL(str(_build(compiler)))
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning("CPU kernels failed to build, using the torch path: %s", detail)
            return None
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = _int if name in _RETURNS_INT else None
        _lib = lib
        return _lib


def dtype_code(dtype: torch.dtype) -> int | None:
    return _DTYPE_CODES.get(dtype)


def _code(t: torch.Tensor) -> int:
    code = _DTYPE_CODES.get(t.dtype)
    if code is None or t.device.type != "cpu":
        raise TypeError(f"CPU kernels take float32/bfloat16 CPU tensors, got {t.dtype} {t.device}")
    return code


def _lib_or_raise() -> ctypes.CDLL:
    lib = ops()
    if lib is None:
        raise RuntimeError("CPU kernels are not available")
    # Follow torch's intra-op thread count (set per worker from cores / local ranks).
    lib.tandem_set_num_threads(torch.get_num_threads())
    return lib


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, num_reqs: int, scale: float,
                    max_query_len: int = 1 << 62, sliding_window: int = 0) -> None:
    """out/q [T, H, hd] (heads and hd contiguous); caches [blocks, block_size, KVH, hd];
    block_table [R, W], seq_lens [R], query_start_loc [R+1] int32. Token j of request r sits at
    position p = seq_len - q_len + j and attends to every key up to it (with a sliding window
    W > 0, to the keys in (p - W, p]; earlier blocks are never read). Requests with more than
    `max_query_len` new tokens are skipped (their rows of `out` are left as they are)."""
    lib = _lib_or_raise()
    _, heads, hd = q.shape
    assert q.stride(2) == 1 and q.stride(1) == hd and out.stride(2) == 1 and out.stride(1) == hd
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_table.stride(1) == 1
    assert block_table.dtype == seq_lens.dtype == query_start_loc.dtype == torch.int32
    lib.tandem_paged_attention(
        _code(q), out.data_ptr(), out.stride(0), q.data_ptr(), q.stride(0), k_cache.data_ptr(),
        v_cache.data_ptr(), block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
        query_start_loc.data_ptr(), num_reqs, heads, k_cache.shape[2], hd, k_cache.shape[1],
        scale, max_query_len, sliding_window)


@functools.cache
def attention_any_length(head_dim: int) -> bool:
    """Whether paged_attention takes prefill chunks of any length at this head dim (the
    AVX-512 query tiles); otherwise chunks longer than MAX_BATCHED_QUERY stay on SDPA."""
    lib = ops()
    return lib is not None and bool(lib.tandem_attention_any_length(head_dim))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [N, D]; with `residual`, first x += residual in place (x is then the new
    residual stream). Returns a new tensor."""
    lib = _lib_or_raise()
    assert x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    res_ptr, res_stride = 0, 0
    if residual is not None:
        assert residual.stride(1) == 1 and residual.dtype == x.dtype
        res_ptr, res_stride = residual.data_ptr(), residual.stride(0)
    lib.tandem_rms_norm(_code(x), out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0),
                        res_ptr or None, res_stride, weight.data_ptr(), x.shape[0], x.shape[1],
                        eps)
    return out


def rotary_(x: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half rotary in place on the first `heads` heads of each row of x [N, >= heads*hd];
    cos/sin [max_pos, hd/2] float32, positions [N] int64."""
    lib = _lib_or_raise()
    assert x.stride(1) == 1 and positions.dtype == torch.int64 and positions.is_contiguous()
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    lib.tandem_rotary(_code(x), x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim,
                      positions.data_ptr(), cos.data_ptr(), sin.data_ptr())


def rotary_kv_(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int,
               positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Rows of qkv [N, >= (q_heads + 2 * kv_heads) * hd] are a fused [q | k | v] projection:
    rotate the q and k heads in place, then copy each token's K and V into cache slot
    slots[i] of k_cache/v_cache [blocks, block_size, kv_heads, hd] (same dtype as qkv)."""
    lib = _lib_or_raise()
    assert qkv.stride(1) == 1 and positions.dtype == slots.dtype == torch.int64
    assert positions.is_contiguous() and slots.is_contiguous() and len(slots) == len(qkv)
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.dtype == v_cache.dtype == qkv.dtype
    assert k_cache.shape[2] * k_cache.shape[3] == kv_heads * head_dim
    lib.tandem_rotary_kv(_code(qkv), qkv.data_ptr(), qkv.stride(0), qkv.shape[0], q_heads,
                         kv_heads, head_dim, positions.data_ptr(), cos.data_ptr(),
                         sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                         slots.data_ptr())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] = [gate | up] -> silu(gate) * up [N, I]."""
    lib = _lib_or_raise()
    assert x.is_contiguous()
    n, two_i = x.shape
    out = torch.empty(n, two_i // 2, dtype=x.dtype)
    lib.tandem_silu_and_mul(_code(x), out.data_ptr(), x.data_ptr(), n, two_i // 2)
    return out


def argmax(x: torch.Tensor, cols: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise (max value float32, first index of it int64) over the first `cols` columns."""
    lib = _lib_or_raise()
    assert x.stride(1) == 1
    n = x.shape[0]
    idx = torch.empty(n, dtype=torch.int64)
    val = torch.empty(n, dtype=torch.float32)
    lib.tandem_argmax(_code(x), idx.data_ptr(), val.data_ptr(), x.data_ptr(), x.stride(0), n,
                      x.shape[1] if cols is None else cols)
    return val, idx


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                        vocab: int) -> None:
    """Set logits[r, t] = -inf, in place, for every row r in `rows` (int64) and token t < vocab
    whose bit is clear in bitmask[r] (int32 words, 32 tokens each, xgrammar's layout)."""
    lib = _lib_or_raise()
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and bitmask.stride(1) == 1
    assert bitmask.dtype == torch.int32 and rows.dtype == torch.int64 and rows.is_contiguous()
    assert bitmask.shape[1] * 32 >= vocab and logits.shape[1] >= vocab
    lib.tandem_apply_token_bitmask(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(),
                                   bitmask.stride(0), rows.data_ptr(), rows.numel(), vocab)


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor, mask_rows: torch.Tensor,
                  vocab: int) -> torch.Tensor:
    """Greedy tokens [N] int64 of float32 `logits` [N, >= vocab] over the first `vocab` columns:
    row i over the tokens bitmask[mask_rows[i]] allows (xgrammar's layout), or over all of them
    where mask_rows[i] < 0. Equal to masking the rows to -inf and taking torch.argmax."""
    lib = _lib_or_raise()
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and bitmask.stride(1) == 1
    assert bitmask.dtype == torch.int32 and bitmask.shape[1] * 32 >= vocab
    assert mask_rows.dtype == torch.int64 and mask_rows.is_contiguous()
    n = logits.shape[0]
    assert mask_rows.numel() == n and logits.shape[1] >= vocab
    idx = torch.empty(n, dtype=torch.int64)
    val = torch.empty(n, dtype=torch.float32)
    lib.tandem_masked_argmax(idx.data_ptr(), val.data_ptr(), logits.data_ptr(), logits.stride(0),
                             n, vocab, bitmask.data_ptr(), bitmask.stride(0),
                             mask_rows.data_ptr())
    return idx


def bf16_matmul_available() -> bool:
    """Whether pack_bf16_pairs/bf16_matmul are built (the CPU has AVX512-BF16)."""
    lib = ops()
    return ENABLED and lib is not None and bool(lib.tandem_bf16_matmul_available())


def pack_bf16_pairs(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 linear weight [N, K] (K even) in bf16_matmul's layout: panels of 16 output
    columns, each [K/2][16][2]; the columns past N are zero."""
    lib = _lib_or_raise()
    assert weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.is_contiguous()
    n, k = weight.shape
    assert k % 2 == 0, "bf16_matmul takes an even inner dimension"
    packed = torch.empty(-(-n // 16) * 16 * k, dtype=torch.bfloat16)
    lib.tandem_pack_bf16_pairs(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def bf16_matmul(x: torch.Tensor, packed: torch.Tensor, n: int, logits: bool = True,
                argmax_cols: int = 0
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """x [M, K] bf16 @ W^T with W [n, K] packed by pack_bf16_pairs -> (y [M, n] bf16 or None,
    argmax ids [M] int64 or None, max values [M] float32 or None). With argmax_cols > 0, each
    row's first column in [0, argmax_cols) holding the max of the bf16 values (NaN skipped);
    the values are the ones y holds, summed in the same order whatever the call."""
    lib = _lib_or_raise()
    m, k = x.shape
    assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and packed.numel() == -(-n // 16) * 16 * k
    y = torch.empty(m, n, dtype=torch.bfloat16) if logits else None
    idx = val = None
    if argmax_cols > 0:
        idx = torch.empty(m, dtype=torch.int64)
        val = torch.empty(m, dtype=torch.float32)
    lib.tandem_bf16_matmul(x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), n,
                           None if y is None else y.data_ptr(), n, argmax_cols,
                           None if idx is None else idx.data_ptr(),
                           None if val is None else val.data_ptr())
    return y, idx, val
