// Paged attention over the KV cache: decode tokens one by one, prefill chunks in query tiles.
// Called through ctypes (workers/cpu_ops.py); plain C ABI on raw pointers.
//
// Sliding windows (window > 0): a query at position p sees keys in (p - window, p]. The key
// walk starts at the block holding the first visible key (blocks before it may have been
// given back to the pool and reused) and masks the few keys of that block before it.

#include <tuple>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

// sc[j] = exp(sc[j] - max(sc)) in place; returns the sum (softmax without the division).
inline float exp_minus_max(float* sc, int64_t n) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = sc[j] > m ? sc[j] : m;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    sc[j] = exp_nonpos(sc[j] - m);
    sum += sc[j];
  }
  return sum;
}

// One query token against its context, for the `group` query heads that share KV head `kvh`.
// Keys 0..n_keys-1 are read through the request's block-table row; the first n_masked of them
// are outside a sliding window (they share a block with visible keys) and get no weight.
// HD > 0: the head dim as a compile-time constant, so the per-key loops unroll fully.
template <typename T, int HD>
void attend_one(T* out, int64_t out_stride_head, const T* q, int64_t q_stride_head,
                const T* k_cache, const T* v_cache, const int32_t* blocks, int64_t n_keys,
                int64_t block_size, int64_t kv_heads, int64_t kvh, int64_t group,
                int64_t hd_runtime, float scale, int64_t n_masked, std::vector<float>& scores,
                std::vector<float>& qf, std::vector<float>& acc) {
  const int64_t hd = HD > 0 ? HD : hd_runtime;
  scores.resize(group * n_keys);
  qf.resize(group * hd);
  acc.assign(group * hd, 0.0f);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < hd; ++d) qf[g * hd + d] = load(q + g * q_stride_head, d) * scale;
  const int64_t slot_stride = kv_heads * hd;
  // Walk the context block by block (no division per key: block_size is a runtime value).
  for (int64_t j0 = 0, b = 0; j0 < n_keys; j0 += block_size, ++b) {
    const T* kb = k_cache + static_cast<int64_t>(blocks[b]) * block_size * slot_stride + kvh * hd;
    const int64_t n = n_keys - j0 < block_size ? n_keys - j0 : block_size;
    for (int64_t o = 0; o < n; ++o) {
      const T* k = kb + o * slot_stride;
      for (int64_t g = 0; g < group; ++g) {
        const float* qq = qf.data() + g * hd;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < hd; ++d) s += qq[d] * load(k, d);
        scores[g * n_keys + j0 + o] = s;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores.data() + g * n_keys;
    for (int64_t j = 0; j < n_masked; ++j) sc[j] = -INFINITY;
    const float sum = exp_minus_max(sc, n_keys);
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t j = 0; j < n_keys; ++j) sc[j] *= inv;
  }
  for (int64_t j0 = 0, b = 0; j0 < n_keys; j0 += block_size, ++b) {
    const T* vb = v_cache + static_cast<int64_t>(blocks[b]) * block_size * slot_stride + kvh * hd;
    const int64_t n = n_keys - j0 < block_size ? n_keys - j0 : block_size;
    for (int64_t o = 0; o < n; ++o) {
      const T* v = vb + o * slot_stride;
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * n_keys + j0 + o];
        float* a = acc.data() + g * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) a[d] += p * load(v, d);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < hd; ++d) store(out + g * out_stride_head, d, acc[g * hd + d]);
}
#if defined(__AVX512F__)
// Lane j of the result is the sum of v[j]'s 16 lanes. A transpose-and-add tree: 15 adds and
// 30 shuffles for 16 dot products, where 16 separate horizontal reductions are a dependent
// chain of ~8 instructions each (the scalar kernel's QK loop was bound by exactly that).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the 4 keys' sums over that lane
    const __m512d c = _mm512_castps_pd(w[2 * i]), d = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  for (int i = 0; i < 2; ++i)  // fold 128-bit lanes pairwise: (0+1, 2+3) of two vectors
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

constexpr int64_t kPrefetch = 16;
// Requests with fewer new tokens than this go token by token (decodes, short drafts).
constexpr int64_t kTileMinQueries = 4;

// attend_one with AVX-512 for head dims that are a multiple of 32, for GC query heads of one KV
// head at once: each K and V row is loaded, widened and located through the block table once
// for all GC heads, not once per head. QK runs in tiles of 16 keys reduced by sum_lanes16; PV
// keeps the accumulators in registers. With AVX512-BF16 and bf16 caches, QK multiplies the bf16
// q and k directly (vdpbf16ps: exact products, float32 sums) and scales the dot afterwards: one
// instruction per 32 elements instead of two loads, two widenings and two FMAs. Measured on 64
// decodes of ~160 keys, 8 query / 4 KV heads, bf16: 400 -> 340 us per layer (group 3: 630 ->
// 450). Same math (float32 scores, max-subtracted softmax) in another summation order.
template <typename T, int HD, int GC>
void attend_heads_avx512(T* out, const T* q, const T* k_cache, const T* v_cache,
                         const int32_t* blocks, int64_t n_keys, int64_t block_size,
                         int64_t kv_heads, int64_t kvh, float scale, int64_t n_masked,
                         std::vector<float>& scores) {
  static_assert(HD % 32 == 0 && HD > 0, "head dim must be a multiple of 32");
  constexpr int NV = HD / 16;
#if defined(__AVX512BF16__)
  constexpr bool kDot = std::is_same_v<T, uint16_t>;
#else
  constexpr bool kDot = false;
#endif
  const int64_t slot_stride = kv_heads * HD;
  const int64_t padded = (n_keys + 15) & ~int64_t{15};
  scores.resize(GC * padded);
  const T* k_head = k_cache + kvh * HD;
  const T* v_head = v_cache + kvh * HD;
  __m512 qv[GC][NV];       // float32 q * scale (without kDot)
  __m512i qb[GC][NV / 2];  // raw bf16 q, 32 elements per register (kDot)
  for (int g = 0; g < GC; ++g) {
    if constexpr (kDot)
      for (int v = 0; v < NV / 2; ++v) qb[g][v] = _mm512_loadu_si512(q + g * HD + 32 * v);
    else
      for (int v = 0; v < NV; ++v)
        qv[g][v] = _mm512_mul_ps(load16(q + g * HD + 16 * v), _mm512_set1_ps(scale));
  }
  // Prefetch K and V rows kPrefetch keys ahead: in a real step this layer's cache was evicted
  // by the other layers and the LM head, and a 64-byte row every slot stride is a pattern the
  // hardware prefetcher follows poorly (measured 2x slower than with the cache warm). The first
  // KV head's task fetches the whole slot (every head's row): the tasks of one token's other
  // heads follow on the same thread and find their rows cached, and the memory stream is
  // contiguous instead of one 64-byte row per slot stride.
  int64_t pb = 0, po = 0, pj = 0;
  auto prefetch_next = [&]() {
    if (pj >= n_keys) return;
    const int64_t off = (static_cast<int64_t>(blocks[pb]) * block_size + po) * slot_stride;
    const T* kr = kvh == 0 ? k_cache + off : k_head + off;
    const T* vr = kvh == 0 ? v_cache + off : v_head + off;
    const int64_t bytes = (kvh == 0 ? slot_stride : HD) * static_cast<int64_t>(sizeof(T));
    for (int64_t c = 0; c < bytes; c += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(kr) + c, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(vr) + c, _MM_HINT_T1);
    }
    if (++po == block_size) po = 0, ++pb;
    ++pj;
  };
  for (int64_t i = 0; i < kPrefetch; ++i) prefetch_next();
  int64_t b = 0, o = 0;  // block-table index and offset of the next key
  for (int64_t j0 = 0; j0 < n_keys; j0 += 16) {
    const int64_t n = n_keys - j0 < 16 ? n_keys - j0 : 16;
    __m512 part[GC][16];
    for (int64_t i = 0; i < 16; ++i) {
      if (i >= n) {
        for (int g = 0; g < GC; ++g) part[g][i] = _mm512_setzero_ps();
        continue;
      }
      prefetch_next();
      const T* k = k_head + (static_cast<int64_t>(blocks[b]) * block_size + o) * slot_stride;
      if constexpr (kDot) {
        __m512i kb[NV / 2];
        for (int v = 0; v < NV / 2; ++v) kb[v] = _mm512_loadu_si512(k + 32 * v);
        for (int g = 0; g < GC; ++g) {
          __m512 a = _mm512_setzero_ps();
          for (int v = 0; v < NV / 2; ++v)
            a = _mm512_dpbf16_ps(a, reinterpret_cast<__m512bh>(qb[g][v]),
                                 reinterpret_cast<__m512bh>(kb[v]));
          part[g][i] = a;
        }
      } else {
        __m512 kf[NV];
        for (int v = 0; v < NV; ++v) kf[v] = load16(k + 16 * v);
        for (int g = 0; g < GC; ++g) {
          __m512 a = _mm512_mul_ps(qv[g][0], kf[0]);
          for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(qv[g][v], kf[v], a);
          part[g][i] = a;
        }
      }
      if (++o == block_size) o = 0, ++b;
    }
    for (int g = 0; g < GC; ++g) {
      __m512 s = sum_lanes16(part[g]);
      if constexpr (kDot) s = _mm512_mul_ps(s, _mm512_set1_ps(scale));
      _mm512_storeu_ps(scores.data() + g * padded + j0, s);
    }
  }
  float inv_sum[GC];
  for (int g = 0; g < GC; ++g) {
    for (int64_t j = 0; j < n_masked; ++j) scores[g * padded + j] = -INFINITY;
    inv_sum[g] = 1.0f / exp_minus_max(scores.data() + g * padded, n_keys);
  }
  __m512 acc[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_setzero_ps();
  b = 0, o = 0;
  for (int64_t j = 0; j < n_keys; ++j) {
    const T* vr = v_head + (static_cast<int64_t>(blocks[b]) * block_size + o) * slot_stride;
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = load16(vr + 16 * v);
    for (int g = 0; g < GC; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * padded + j]);
      for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_fmadd_ps(p, vv[v], acc[g][v]);
    }
    if (++o == block_size) o = 0, ++b;
  }
  for (int g = 0; g < GC; ++g) {
    alignas(64) float res[HD];
    const __m512 inv = _mm512_set1_ps(inv_sum[g]);
    for (int v = 0; v < NV; ++v) _mm512_store_ps(res + 16 * v, _mm512_mul_ps(acc[g][v], inv));
    for (int d = 0; d < HD; ++d) store(out + g * HD, d, res[d]);
  }
}

// One query token, all `group` query heads of KV head kvh, in chunks of up to 4 heads (more
// would spill the QK partial sums out of the 32 vector registers).
template <typename T, int HD>
void attend_one_avx512(T* out, const T* q, const T* k_cache, const T* v_cache,
                       const int32_t* blocks, int64_t n_keys, int64_t block_size,
                       int64_t kv_heads, int64_t kvh, int64_t group, float scale,
                       int64_t n_masked, std::vector<float>& scores) {
  for (int64_t g = 0; g < group;) {
    const int64_t c = group - g < 4 ? group - g : 4;
    auto run = [&](auto gc) {
      attend_heads_avx512<T, HD, decltype(gc)::value>(out + g * HD, q + g * HD, k_cache,
                                                      v_cache, blocks, n_keys, block_size,
                                                      kv_heads, kvh, scale, n_masked, scores);
    };
    switch (c) {
      case 1: run(std::integral_constant<int, 1>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      case 3: run(std::integral_constant<int, 3>{}); break;
      default: run(std::integral_constant<int, 4>{});
    }
    g += c;
  }
}

// Query tiles: up to 16 consecutive new tokens of one request (the first at position pos0)
// against keys 0 .. pos0 + nq - 1, causal, for the `group` query heads of KV head kvh; with a
// sliding window (window > 0) lane i also masks keys <= pos0 + i - window (positions here
// are relative to the first block the caller passes). The
// 16 queries live in the 16 lanes: QK is one broadcast FMA per key and head-dim element,
// softmax is lane-wise, and each K/V row is read once per tile instead of once per query.
// Prefill chunks went through SDPA before: 3.2 ms per layer for 16 x 128-token prompts.
template <typename T, int HD>
void attend_tile_avx512(T* out, int64_t out_stride_tok, const T* q, int64_t q_stride_tok,
                        const T* k_cache, const T* v_cache, const int32_t* blocks, int64_t pos0,
                        int64_t nq, int64_t block_size, int64_t kv_heads, int64_t kvh,
                        int64_t group, float scale, int64_t window, std::vector<float>& buf) {
  constexpr int NV = HD / 16;
  constexpr int QS = 16 / NV;  // queries per PV pass: 16 accumulators in registers
  const int64_t n_keys = pos0 + nq;
  const int64_t slot_stride = kv_heads * HD;
  buf.resize(HD * 16 + n_keys * 16 + 16 + HD);
  float* qt = buf.data();          // [HD][16]: the tile's queries, transposed and scaled
  float* sc = qt + HD * 16;        // [n_keys][16]: scores, then probabilities
  float* kf = sc + n_keys * 16;    // [HD + 16]: one key row in float32, then 1/sum per lane
  const T* k_head = k_cache + kvh * HD;
  const T* v_head = v_cache + kvh * HD;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i qpos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(pos0)), lane);
  for (int64_t g = 0; g < group; ++g) {
    const int64_t head = kvh * group + g;
    for (int64_t i = 0; i < 16; ++i)
      for (int d = 0; d < HD; ++d)
        qt[d * 16 + i] = i < nq ? load(q + i * q_stride_tok + head * HD, d) * scale : 0.0f;
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t b = 0, o = 0;
    for (int64_t j = 0; j < n_keys; ++j) {
      const T* k = k_head + (static_cast<int64_t>(blocks[b]) * block_size + o) * slot_stride;
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(kf + 16 * v, load16(k + 16 * v));
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;  // 4 chains hide latency
      for (int d = 0; d < HD; d += 4) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qt + d * 16), _mm512_set1_ps(kf[d]), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qt + d * 16 + 16), _mm512_set1_ps(kf[d + 1]), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(qt + d * 16 + 32), _mm512_set1_ps(kf[d + 2]), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(qt + d * 16 + 48), _mm512_set1_ps(kf[d + 3]), a3);
      }
      __m512 s = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
      if (j > pos0)  // lane i sees keys up to pos0 + i
        s = _mm512_mask_mov_ps(s, _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(
                                      static_cast<int32_t>(j)), qpos),
                               _mm512_set1_ps(-INFINITY));
      if (window > 0 && j + window <= pos0 + 15)  // and keys after pos0 + i - window
        s = _mm512_mask_mov_ps(s, _mm512_cmpge_epi32_mask(qpos, _mm512_set1_epi32(
                                      static_cast<int32_t>(j + window))),
                               _mm512_set1_ps(-INFINITY));
      _mm512_storeu_ps(sc + j * 16, s);
      m = _mm512_max_ps(m, s);
      if (++o == block_size) o = 0, ++b;
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n_keys; ++j) {
      const __m512 e = exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(sc + j * 16), m));
      _mm512_storeu_ps(sc + j * 16, e);
      sum = _mm512_add_ps(sum, e);
    }
    _mm512_storeu_ps(kf, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));
    for (int64_t i0 = 0; i0 < nq; i0 += QS) {
      __m512 acc[QS][NV];
      for (int i = 0; i < QS; ++i)
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
      // Queries i0.. see keys up to pos0 + i0 + QS - 1; later ones are masked (exp of the
      // clamped -87: below 1e-37 against a sum of at least 1), so PV stops there.
      const int64_t last = pos0 + i0 + QS < n_keys ? pos0 + i0 + QS : n_keys;
      b = 0, o = 0;
      for (int64_t j = 0; j < last; ++j) {
        const T* vr = v_head + (static_cast<int64_t>(blocks[b]) * block_size + o) * slot_stride;
        __m512 vv[NV];
        for (int v = 0; v < NV; ++v) vv[v] = load16(vr + 16 * v);
        const float* pj = sc + j * 16 + i0;
        for (int i = 0; i < QS; ++i) {
          const __m512 p = _mm512_set1_ps(pj[i]);
          for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(p, vv[v], acc[i][v]);
        }
        if (++o == block_size) o = 0, ++b;
      }
      alignas(64) float res[HD];
      for (int i = 0; i < QS && i0 + i < nq; ++i) {
        const __m512 inv = _mm512_set1_ps(kf[i0 + i]);
        for (int v = 0; v < NV; ++v) _mm512_store_ps(res + 16 * v, _mm512_mul_ps(acc[i][v], inv));
        T* dst = out + (i0 + i) * out_stride_tok + head * HD;
        for (int d = 0; d < HD; ++d) store(dst, d, res[d]);
      }
    }
  }
}
#endif

template <typename T, int HD>
void paged_attention_impl(T* out, int64_t out_stride_tok, const T* q, int64_t q_stride_tok,
                          const T* k_cache, const T* v_cache, const int32_t* block_table,
                          int64_t bt_stride, const int32_t* seq_lens,
                          const int32_t* query_start_loc, int64_t num_reqs, int64_t num_heads,
                          int64_t kv_heads, int64_t hd, int64_t block_size, float scale,
                          int64_t max_query_len, int64_t window) {
  const int64_t num_tokens = query_start_loc[num_reqs];
  const int64_t group = num_heads / kv_heads;
#if defined(__AVX512F__)
  if constexpr (HD > 0) {
    // Work items: single tokens of short queries, tiles of up to 16 tokens of longer ones;
    // each item times each KV head is one task. Tiles differ in cost (later ones see more
    // keys), hence dynamic scheduling; results do not depend on which thread runs what.
    struct Item {
      int64_t r, t0, nq;
    };
    std::vector<Item> work;
    for (int64_t r = 0; r < num_reqs; ++r) {
      const int64_t start = query_start_loc[r], end = query_start_loc[r + 1];
      const int64_t q_len = end - start;
      if (q_len == 0 || q_len > max_query_len) continue;  // long chunks are the caller's
      const int64_t step = q_len < kTileMinQueries ? 1 : 16;
      for (int64_t t0 = start; t0 < end; t0 += step)
        work.push_back({r, t0, end - t0 < step ? end - t0 : step});
    }
    const int64_t n_tasks = static_cast<int64_t>(work.size()) * kv_heads;
#pragma omp parallel
    {
      std::vector<float> buf;
#pragma omp for schedule(dynamic, 4)
      for (int64_t it = 0; it < n_tasks; ++it) {
        const Item& w = work[it / kv_heads];
        const int64_t kvh = it % kv_heads;
        const int64_t q_len = query_start_loc[w.r + 1] - query_start_loc[w.r];
        // Token t sits at position seq_len - q_len + (t - start) and sees keys up to it.
        int64_t pos0 = seq_lens[w.r] - q_len + (w.t0 - query_start_loc[w.r]);
        const int32_t* blocks = block_table + w.r * bt_stride;
        // With a window, start at the block of the item's first visible key (pos0 - window
        // + 1) and count positions from there.
        int64_t first = 0;
        if (window > 0 && pos0 - window + 1 > 0) first = (pos0 - window + 1) / block_size;
        blocks += first;
        pos0 -= first * block_size;
        if (w.nq == 1) {
          const int64_t masked = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
          attend_one_avx512<T, HD>(out + w.t0 * out_stride_tok + kvh * group * hd,
                                   q + w.t0 * q_stride_tok + kvh * group * hd, k_cache, v_cache,
                                   blocks, pos0 + 1, block_size, kv_heads, kvh, group, scale,
                                   masked, buf);
        } else {
          attend_tile_avx512<T, HD>(out + w.t0 * out_stride_tok, out_stride_tok,
                                    q + w.t0 * q_stride_tok, q_stride_tok, k_cache, v_cache,
                                    blocks, pos0, w.nq, block_size, kv_heads, kvh, group, scale,
                                    window, buf);
        }
      }
    }
    return;
  }
#endif
  const int64_t items = num_tokens * kv_heads;
#pragma omp parallel
  {
    std::vector<float> scores, qf, acc;
    int64_t r = 0;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t t = it / kv_heads, kvh = it % kv_heads;
      // Items come in token order within a thread: advance to this token's request.
      if (t < query_start_loc[r]) r = 0;
      while (query_start_loc[r + 1] <= t) ++r;
      const int64_t q_len = query_start_loc[r + 1] - query_start_loc[r];
      if (q_len > max_query_len) continue;  // long prefill chunks are the caller's
      // Token t sits at position seq_len - q_len + (t - start) and sees keys up to it
      // (and, with a window, from pos - window + 1 on: start at that key's block).
      const int64_t pos = seq_lens[r] - q_len + (t - query_start_loc[r]);
      const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
      const int64_t first = lo / block_size;
      attend_one<T, HD>(out + t * out_stride_tok + kvh * group * hd, hd,
                        q + t * q_stride_tok + kvh * group * hd, hd, k_cache, v_cache,
                        block_table + r * bt_stride + first, pos + 1 - first * block_size,
                        block_size, kv_heads, kvh, group, hd, scale, lo - first * block_size,
                        scores, qf, acc);
    }
  }
}
template <typename T>
void paged_attention_dispatch(void* out, int64_t out_stride_tok, const void* q,
                              int64_t q_stride_tok, const void* k_cache, const void* v_cache,
                              const int32_t* block_table, int64_t bt_stride,
                              const int32_t* seq_lens, const int32_t* query_start_loc,
                              int64_t num_reqs, int64_t num_heads, int64_t kv_heads, int64_t hd,
                              int64_t block_size, float scale, int64_t max_query_len,
                              int64_t window) {
  auto run = [&](auto hd_const) {
    paged_attention_impl<T, decltype(hd_const)::value>(
        static_cast<T*>(out), out_stride_tok, static_cast<const T*>(q), q_stride_tok,
        static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), block_table, bt_stride,
        seq_lens, query_start_loc, num_reqs, num_heads, kv_heads, hd, block_size, scale,
        max_query_len, window);
  };
  switch (hd) {
    case 32: run(std::integral_constant<int, 32>{}); break;
    case 64: run(std::integral_constant<int, 64>{}); break;
    case 128: run(std::integral_constant<int, 128>{}); break;
    default: run(std::integral_constant<int, 0>{});
  }
}
}  // namespace

extern "C" {

// 1 if tandem_paged_attention takes queries of any length for this head dim (the AVX-512
// tiles), 0 if the caller should keep long prefill chunks for itself.
int tandem_attention_any_length(int64_t hd) {
#if defined(__AVX512F__)
  return hd == 32 || hd == 64 || hd == 128;
#else
  (void)hd;
  return 0;
#endif
}

void tandem_paged_attention(int dtype, void* out, int64_t out_stride_tok, const void* q,
                            int64_t q_stride_tok, const void* k_cache, const void* v_cache,
                            const int32_t* block_table, int64_t bt_stride,
                            const int32_t* seq_lens, const int32_t* query_start_loc,
                            int64_t num_reqs, int64_t num_heads, int64_t kv_heads, int64_t hd,
                            int64_t block_size, float scale, int64_t max_query_len,
                            int64_t window) {
  auto args = std::make_tuple(out, out_stride_tok, q, q_stride_tok, k_cache, v_cache,
                              block_table, bt_stride, seq_lens, query_start_loc, num_reqs,
                              num_heads, kv_heads, hd, block_size, scale, max_query_len, window);
  if (dtype == 0)
    std::apply(paged_attention_dispatch<float>, args);
  else
    std::apply(paged_attention_dispatch<uint16_t>, args);
}
}  // extern "C"
