"""Launch constants of the paged attention kernel, chosen per (head dim, dtype, arch, step kind).

One table, read by the kernel launcher (workers/attention/backends/triton.py) and by the
ahead-of-time compile check (scripts/compile_check.py), so what CI compiles and inspects is
what the engine launches.

Why these values (from the compile check's registers, spills, shared memory and TTGIR; tune
them on a GPU with scripts/bench_attention.py, nothing here was timed):

- num_stages 3 on every GPU row. The kernel reads the block table for tile i + 1 one iteration
  ahead (a plain load carried in a register), so Triton's pipeliner sees the K/V loads as
  direct and gives each num_stages - 1 shared-memory buffers: with 3, the K/V tiles of the
  next iteration are in flight (cp.async, `async_wait {num = 2}`) while this one's dots run.
  With 2 the K/V tiles get one buffer and the load is waited on at the top of each iteration.
- Decode (a query block is one token's GQA group, 16 rows): memory-bound, so tiles large
  enough for 16-byte vector loads and few loop trips, small enough that several programs
  share an SM. BLOCK_N 64 at head dim <= 64 (37 KB of shared memory, 79-109 registers), 32 at
  head dim 128 (38 KB, 80 registers); 4 warps. Head dims above 128 halve the tile again
  (not in the compile check: no preset has them).
- Prefill (64-row query blocks): compute-bound. Head dim 128 on sm_90 takes BLOCK_N 64 and 8
  warps (wgmma, 145 registers, 112 KB); on sm_80, whose register file fills first, BLOCK_N 32
  and 8 warps (172 registers; with 4 warps it reached 236-255 and spilled). Head dim <= 64 keeps
  BLOCK_N 32 and 4 warps (no more than 137 registers on either arch).
- programs_per_sm sizes the split-key grid of small decode batches: segments are added until
  the grid holds about this many programs per SM. The decode rows above leave room for four
  (sm_80: shared memory) to six (sm_90) resident programs per SM, so 4 keeps every SM busy
  while some programs wait on memory; the merge kernel's cost grows with the segment count,
  which is capped at MAX_SEGMENTS.
- float32 (the IEEE dot path, no tensor cores) keeps Triton's defaults: it is a correctness
  path, not a tuned one.
- Architectures: 90 is Hopper (and newer), 80 is Ampere and Ada (sm_86/89 have less shared
  memory than sm_80; every row fits their 99 KB except the sm_90 prefill row, which they never
  get). Older GPUs and the CPU interpreter take the float32 row's values.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SEGMENTS = 16


@dataclass(frozen=True)
class AttentionConfig:
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int  # software-pipeline depth: 3 double-buffers K/V (see above)
    programs_per_sm: int  # target grid size of a split-key decode step, per SM


_DEFAULT = AttentionConfig(block_n=32, num_warps=4, num_stages=3, programs_per_sm=2)

# (arch, decode, head dim at most) -> config; the first row whose head-dim bound holds wins.
_TABLE: dict[tuple[int, bool], list[tuple[int, AttentionConfig]]] = {
    (90, True): [(64, AttentionConfig(64, 4, 3, 4)), (128, AttentionConfig(32, 4, 3, 4)),
                 (1 << 30, AttentionConfig(16, 4, 3, 4))],
    (80, True): [(64, AttentionConfig(64, 4, 3, 4)), (128, AttentionConfig(32, 4, 3, 4)),
                 (1 << 30, AttentionConfig(16, 4, 3, 4))],
    (90, False): [(64, AttentionConfig(32, 4, 3, 2)), (128, AttentionConfig(64, 8, 3, 2)),
                  (1 << 30, AttentionConfig(32, 8, 3, 2))],
    (80, False): [(64, AttentionConfig(32, 4, 3, 2)), (128, AttentionConfig(32, 8, 3, 2)),
                  (1 << 30, AttentionConfig(16, 8, 3, 2))],
}


def arch_of(capability: tuple[int, int] | None) -> int:
    """The table's architecture key for a CUDA compute capability (None: no GPU)."""
    if capability is None or capability[0] < 8:
        return 0
    return 90 if capability[0] >= 9 else 80


def attention_config(head_dim: int, dtype_name: str, arch: int, decode: bool) -> AttentionConfig:
    """The launch constants for one attention kernel variant. dtype_name: "bfloat16",
    "float16" or "float32"; arch: arch_of(capability); decode: query blocks of one token's
    GQA group (block_m_for's narrow blocks), else prefill-width blocks."""
    rows = _TABLE.get((arch, decode))
    if rows is None or dtype_name == "float32":
        return _DEFAULT
    for bound, cfg in rows:
        if head_dim <= bound:
            return cfg
    return _DEFAULT
