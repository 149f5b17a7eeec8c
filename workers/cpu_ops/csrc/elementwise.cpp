// Row-wise kernels of the forward pass: RMSNorm (with the residual add), rotary embeddings,
// SiLU-and-mul, argmax, token-bitmask masking; and the OpenMP thread count every kernel follows.

#include "common.h"

namespace {

// The kernels below run 16 lanes at a time where the compiler targets AVX-512 and finish each
// row (or all of it, elsewhere) with the scalar loop: same math, float32 inside. These ops are
// bound by instruction count, not memory, and bf16 rounding is most of it: with AVX512-BF16's
// one-instruction rounding, 2048 bf16 rows on one thread went from 274 to 228 us (RMSNorm,
// dim 256) and from 898 to 619 us (SiLU-and-mul, 688 wide).

template <typename T>
void rms_norm_row(T* out, T* x, const T* residual, const T* weight, int64_t dim, float eps) {
  int64_t d = 0;
  float ss = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= dim; d += 16) {
    __m512 v = load16(x + d);
    if (residual != nullptr) {
      v = round16(_mm512_add_ps(v, load16(residual + d)), x);
      store16(x + d, v);
    }
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  // x += residual, rounded to x's dtype first (as the unfused `h = h + delta` does).
  if (residual != nullptr)
    for (int64_t e = d; e < dim; ++e) store(x, e, load(x, e) + load(residual, e));
#pragma omp simd reduction(+ : ss)
  for (int64_t e = d; e < dim; ++e) ss += load(x, e) * load(x, e);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
  // normalized value rounded to the model dtype, then scaled by the weight (HF's order)
  d = 0;
#if defined(__AVX512F__)
  const __m512 rv = _mm512_set1_ps(r);
  for (; d + 16 <= dim; d += 16) {
    const __m512 normed = round16(_mm512_mul_ps(load16(x + d), rv), x);
    store16(out + d, _mm512_mul_ps(load16(weight + d), normed));
  }
#endif
  for (; d < dim; ++d) {
    T normed;
    store(&normed, 0, load(x, d) * r);
    store(out, d, load(weight, d) * load(&normed, 0));
  }
}

template <typename T>
void rms_norm_impl(T* out, int64_t out_stride, T* x, int64_t x_stride, const T* residual_in,
                   int64_t res_stride, const T* weight, int64_t n, int64_t dim, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i)
    rms_norm_row(out + i * out_stride, x + i * x_stride,
                 residual_in == nullptr ? nullptr : residual_in + i * res_stride, weight, dim,
                 eps);
}

// Rotate-half rotary embedding of one head in place; c/s: this position's cos/sin [hd/2].
template <typename T>
void rotate_head(T* p, const float* c, const float* s, int64_t half) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= half; d += 16) {
    const __m512 a = load16(p + d), b = load16(p + d + half);
    const __m512 cv = _mm512_loadu_ps(c + d), sv = _mm512_loadu_ps(s + d);
    store16(p + d, _mm512_sub_ps(_mm512_mul_ps(a, cv), _mm512_mul_ps(b, sv)));
    store16(p + d + half, _mm512_add_ps(_mm512_mul_ps(b, cv), _mm512_mul_ps(a, sv)));
  }
#endif
  for (; d < half; ++d) {
    const float a = load(p, d), b = load(p, d + half);
    store(p, d, a * c[d] - b * s[d]);
    store(p, d + half, b * c[d] + a * s[d]);
  }
}

// Rotates `heads` consecutive heads of each token's row of x in place. With caches, the row is
// a fused [q | k | v] projection whose last 2 * kv_heads heads are K and V: the (rotated) K
// and V of token i are then also copied into cache slot slots[i], as write_kv would. Slots are
// distinct within a step (every new token owns its slot), so the copies do not race.
template <typename T>
void rotary_impl(T* x, int64_t x_stride, int64_t n, int64_t heads, int64_t hd,
                 const int64_t* positions, const float* cos, const float* sin, T* k_cache,
                 T* v_cache, const int64_t* slots, int64_t kv_heads) {
  const int64_t half = hd / 2;
  const int64_t kv_width = kv_heads * hd;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    T* row = x + i * x_stride;
    for (int64_t h = 0; h < heads; ++h)
      rotate_head(row + h * hd, cos + positions[i] * half, sin + positions[i] * half, half);
    if (k_cache != nullptr) {
      const T* k = row + (heads - kv_heads) * hd;
      std::memcpy(k_cache + slots[i] * kv_width, k, kv_width * sizeof(T));
      std::memcpy(v_cache + slots[i] * kv_width, k + kv_width, kv_width * sizeof(T));
    }
  }
}

template <typename T>
void silu_and_mul_impl(T* out, const T* x, int64_t n, int64_t inter) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T* g = x + i * 2 * inter;
    const T* u = g + inter;
    T* o = out + i * inter;
    int64_t d = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; d + 16 <= inter; d += 16) {
      const __m512 a = load16(g + d);
      const __m512 e = exp_nonpos16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(a)));
      const __m512 den = _mm512_add_ps(one, e);
      const __mmask16 pos = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GE_OQ);
      const __m512 sig = _mm512_mask_blend_ps(pos, _mm512_div_ps(e, den), _mm512_div_ps(one, den));
      store16(o + d, _mm512_mul_ps(_mm512_mul_ps(a, sig), load16(u + d)));
    }
#endif
    for (; d < inter; ++d) {
      const float a = load(g, d);
      // silu(a) = a / (1 + e^-a); e^-|a| keeps the exponent argument non-positive.
      const float e = exp_nonpos(-std::fabs(a));
      const float sig = a >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
      store(o, d, a * sig * load(u, d));
    }
  }
}

template <typename T>
void argmax_impl(int64_t* idx, float* val, const T* x, int64_t x_stride, int64_t n,
                 int64_t cols) {
  constexpr int64_t kChunk = 64;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T* row = x + i * x_stride;
    // Vectorized max per chunk; only the first chunk holding the overall max is rescanned.
    float m = -INFINITY;
    int64_t best_chunk = 0;
    for (int64_t c = 0; c < cols; c += kChunk) {
      const int64_t end = c + kChunk < cols ? c + kChunk : cols;
      float cm = -INFINITY;
#pragma omp simd reduction(max : cm)
      for (int64_t j = c; j < end; ++j) {
        const float v = load(row, j);
        cm = v > cm ? v : cm;
      }
      if (cm > m) {
        m = cm;
        best_chunk = c;
      }
    }
    int64_t best = best_chunk;
    for (int64_t j = best_chunk; j < cols; ++j) {
      if (load(row, j) == m) {  // first (lowest) index holding the max, as torch.argmax
        best = j;
        break;
      }
    }
    idx[i] = best;
    val[i] = m;
  }
}

// Tokens a grammar refuses get a logit of -inf. Bit t % 32 of word t / 32 of a row's bitmask is
// set when token t is allowed (xgrammar's layout). Only refused tokens are written, and a word
// with every token allowed (most of them inside a JSON string) costs one compare per 32 tokens.
void apply_bitmask_row(float* row, const uint32_t* bits, int64_t vocab) {
  const int64_t words = (vocab + 31) / 32;
  for (int64_t w = 0; w < words; ++w) {
    uint32_t refused = ~bits[w];
    if (refused == 0) continue;
    const int64_t base = w * 32;
    if (refused == 0xFFFFFFFFu && base + 32 <= vocab) {
#pragma omp simd
      for (int64_t j = 0; j < 32; ++j) row[base + j] = -INFINITY;
      continue;
    }
    while (refused != 0) {
      const int64_t t = base + __builtin_ctz(refused);
      if (t < vocab) row[t] = -INFINITY;
      refused &= refused - 1;
    }
  }
}

// argmax over the tokens a row's bitmask allows, without writing the masked logits: what a
// greedy constrained row needs, in one read of the row instead of a masking pass and a scan.
// Ties go to the lowest id; a row allowing nothing (or only NaN/-inf logits) returns its first
// allowed token, or 0.
void masked_argmax_row(int64_t* idx, float* val, const float* row, const uint32_t* bits,
                       int64_t cols) {
  const int64_t words = (cols + 31) / 32;
  float m = -INFINITY;
  int64_t first_allowed = -1, best_word = -1;
  for (int64_t w = 0; w < words; ++w) {
    uint32_t allowed = bits[w];
    if (allowed == 0) continue;
    const int64_t base = w * 32;
    // (a bit past `cols` in the last word is padding, never a token)
    if (first_allowed < 0 && base + __builtin_ctz(allowed) < cols)
      first_allowed = base + __builtin_ctz(allowed);
    float cm = -INFINITY;
    if (allowed == 0xFFFFFFFFu && base + 32 <= cols) {
#pragma omp simd reduction(max : cm)
      for (int64_t j = base; j < base + 32; ++j) cm = row[j] > cm ? row[j] : cm;
    } else {
      for (uint32_t a = allowed; a != 0; a &= a - 1) {
        const int64_t t = base + __builtin_ctz(a);
        if (t < cols && row[t] > cm) cm = row[t];
      }
    }
    if (cm > m) {  // the first word reaching the max holds its first (lowest) index
      m = cm;
      best_word = w;
    }
  }
  int64_t best = first_allowed < 0 ? 0 : first_allowed;
  if (best_word >= 0) {
    for (uint32_t a = bits[best_word]; a != 0; a &= a - 1) {
      const int64_t t = best_word * 32 + __builtin_ctz(a);
      if (t < cols && row[t] == m) {
        best = t;
        break;
      }
    }
  }
  *idx = best;
  *val = m;
}

}  // namespace

extern "C" {

int tandem_num_threads() { return omp_get_max_threads(); }

void tandem_set_num_threads(int n) { omp_set_num_threads(n); }

void tandem_rms_norm(int dtype, void* out, int64_t out_stride, void* x, int64_t x_stride,
                     const void* residual_in, int64_t res_stride, const void* weight, int64_t n,
                     int64_t dim, float eps) {
  if (dtype == 0)
    rms_norm_impl(static_cast<float*>(out), out_stride, static_cast<float*>(x), x_stride,
                  static_cast<const float*>(residual_in), res_stride,
                  static_cast<const float*>(weight), n, dim, eps);
  else
    rms_norm_impl(static_cast<uint16_t*>(out), out_stride, static_cast<uint16_t*>(x), x_stride,
                  static_cast<const uint16_t*>(residual_in), res_stride,
                  static_cast<const uint16_t*>(weight), n, dim, eps);
}

void tandem_rotary(int dtype, void* x, int64_t x_stride, int64_t n, int64_t heads, int64_t hd,
                   const int64_t* positions, const float* cos, const float* sin) {
  if (dtype == 0)
    rotary_impl(static_cast<float*>(x), x_stride, n, heads, hd, positions, cos, sin,
                static_cast<float*>(nullptr), static_cast<float*>(nullptr), nullptr, 0);
  else
    rotary_impl(static_cast<uint16_t*>(x), x_stride, n, heads, hd, positions, cos, sin,
                static_cast<uint16_t*>(nullptr), static_cast<uint16_t*>(nullptr), nullptr,
                0);
}

// Rotary on the q and k heads of a fused [q | k | v] row, then K and V into the cache slots.
void tandem_rotary_kv(int dtype, void* qkv, int64_t stride, int64_t n, int64_t q_heads,
                      int64_t kv_heads, int64_t hd, const int64_t* positions, const float* cos,
                      const float* sin, void* k_cache, void* v_cache, const int64_t* slots) {
  if (dtype == 0)
    rotary_impl(static_cast<float*>(qkv), stride, n, q_heads + kv_heads, hd, positions, cos,
                sin, static_cast<float*>(k_cache), static_cast<float*>(v_cache), slots,
                kv_heads);
  else
    rotary_impl(static_cast<uint16_t*>(qkv), stride, n, q_heads + kv_heads, hd, positions, cos,
                sin, static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache), slots,
                kv_heads);
}

void tandem_silu_and_mul(int dtype, void* out, const void* x, int64_t n, int64_t inter) {
  if (dtype == 0)
    silu_and_mul_impl(static_cast<float*>(out), static_cast<const float*>(x), n, inter);
  else
    silu_and_mul_impl(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x), n, inter);
}

void tandem_argmax(int dtype, int64_t* idx, float* val, const void* x, int64_t x_stride,
                   int64_t n, int64_t cols) {
  if (dtype == 0)
    argmax_impl(idx, val, static_cast<const float*>(x), x_stride, n, cols);
  else
    argmax_impl(idx, val, static_cast<const uint16_t*>(x), x_stride, n, cols);
}

void tandem_apply_token_bitmask(float* logits, int64_t l_stride, const int32_t* bitmask,
                                int64_t b_stride, const int64_t* rows, int64_t n, int64_t vocab) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i)
    apply_bitmask_row(logits + rows[i] * l_stride,
                      reinterpret_cast<const uint32_t*>(bitmask + rows[i] * b_stride), vocab);
}

// Rows with mask_rows[i] < 0 take the plain argmax, the others the argmax over the tokens
// bitmask row mask_rows[i] allows.
void tandem_masked_argmax(int64_t* idx, float* val, const float* x, int64_t x_stride, int64_t n,
                          int64_t cols, const int32_t* bitmask, int64_t b_stride,
                          const int64_t* mask_rows) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    if (mask_rows[i] < 0)
      argmax_impl(idx + i, val + i, x + i * x_stride, x_stride, 1, cols);
    else
      masked_argmax_row(idx + i, val + i, x + i * x_stride,
                        reinterpret_cast<const uint32_t*>(bitmask + mask_rows[i] * b_stride),
                        cols);
  }
}

}  // extern "C"
