// bf16 matmul on AVX512-BF16 dot-product instructions, with an optional fused argmax: the LM
// head. y[M, N] = x[M, K] @ W[N, K]^T, float32 sums rounded to bf16.
//
// Why not oneDNN: at decode shapes (M = 64 rows against a 32000 x 256 head, 2 threads of this
// project's 2-core CI machine kind) its bf16 matmul plus a separate argmax took 3.07 ms, where
// this register tiling with the argmax in its epilogue takes 2.6-2.9 ms (390-420 GFLOP/s):
// greedy decoding needs only each row's argmax, so the logits (4 MB per step) are never written
// or read back. With logits written it is on par with oneDNN; at prefill-sized M it is slower,
// which is why only the LM head uses it.
//
// The weight is packed once (tandem_pack_bf16_pairs) into panels of 16 output columns, each
// panel [K/2][16][2]: one 64-byte row per pair of k, which is what vdpbf16ps multiplies. Every
// output element is summed in the same order (k pairs ascending) whatever the tiling, thread
// count or column range, so a column's value is the same on every rank and in both modes.

#include <limits>
#include <vector>

#include "common.h"

namespace {

#if defined(__AVX512BF16__)
constexpr int kRows = 6;    // rows per register tile
constexpr int kPanels = 4;  // 16-column panels per register tile: 24 accumulators

// acc[m * NR + n] = x rows [0, MR) . panel n, over kp pairs of k.
template <int MR, int NR>
inline void dot_tile(const uint16_t* x, int64_t x_stride, const uint16_t* wp,
                     int64_t panel_stride, int64_t kp, __m512* acc) {
  for (int i = 0; i < MR * NR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kp; ++k) {
    __m512i b[NR];
    for (int n = 0; n < NR; ++n) b[n] = _mm512_loadu_si512(wp + n * panel_stride + 32 * k);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * x_stride + 2 * k, 4);
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int n = 0; n < NR; ++n)
        acc[m * NR + n] = _mm512_dpbf16_ps(acc[m * NR + n], a, reinterpret_cast<__m512bh>(b[n]));
    }
  }
}

struct MatmulArgs {
  const uint16_t* x;
  int64_t x_stride, m, k;
  const uint16_t* wp;
  int64_t n;
  uint16_t* y;  // nullptr: no logits written
  int64_t y_stride;
  int64_t argmax_cols;  // argmax over columns [0, argmax_cols); 0: none
};

// One register tile: rows [m0, m0 + MR), panels [p0, p0 + NR). best_v/best_i hold, per row and
// lane, the running max (bf16-rounded) and its column; columns arrive in ascending order per
// thread, so a strict > keeps the first (lowest) column holding the max.
template <int MR, int NR>
void tile(const MatmulArgs& a, int64_t m0, int64_t p0, float* best_v, int32_t* best_i) {
  const int64_t kp = a.k / 2;
  __m512 acc[MR * NR];
  dot_tile<MR, NR>(a.x + m0 * a.x_stride, a.x_stride, a.wp + p0 * kp * 32, kp * 32, kp, acc);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int n = 0; n < NR; ++n) {
    const int64_t col0 = (p0 + n) * 16;
    const __m512i cols = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(col0)), lane);
    const __mmask16 in_y = a.n - col0 >= 16 ? 0xffff : (1u << (a.n - col0)) - 1;
    const __mmask16 in_argmax = _mm512_cmplt_epi32_mask(
        cols, _mm512_set1_epi32(static_cast<int32_t>(a.argmax_cols)));
    for (int m = 0; m < MR; ++m) {
      const __m256i h = to_bf16x16(acc[m * NR + n]);
      if (a.y != nullptr)
        _mm256_mask_storeu_epi16(a.y + (m0 + m) * a.y_stride + col0, in_y, h);
      if (in_argmax) {
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        float* bv = best_v + (m0 + m) * 16;
        int32_t* bi = best_i + (m0 + m) * 16;
        const __m512 cur = _mm512_loadu_ps(bv);
        const __mmask16 gt = _mm512_mask_cmp_ps_mask(in_argmax, v, cur, _CMP_GT_OQ);
        _mm512_storeu_ps(bv, _mm512_mask_mov_ps(cur, gt, v));
        _mm512_mask_storeu_epi32(bi, gt, cols);
      }
    }
  }
}

template <int NR>
void row_tiles(const MatmulArgs& a, int64_t p0, float* best_v, int32_t* best_i) {
  int64_t m0 = 0;
  for (; m0 + kRows <= a.m; m0 += kRows) tile<kRows, NR>(a, m0, p0, best_v, best_i);
  switch (a.m - m0) {
    case 1: tile<1, NR>(a, m0, p0, best_v, best_i); break;
    case 2: tile<2, NR>(a, m0, p0, best_v, best_i); break;
    case 3: tile<3, NR>(a, m0, p0, best_v, best_i); break;
    case 4: tile<4, NR>(a, m0, p0, best_v, best_i); break;
    case 5: tile<5, NR>(a, m0, p0, best_v, best_i); break;
    default: break;
  }
}

void matmul(const MatmulArgs& a, int64_t* idx, float* val) {
  const int64_t panels = (a.n + 15) / 16;
  const int64_t groups = (panels + kPanels - 1) / kPanels;
  const int threads = omp_get_max_threads();
  // Per thread and row: (max, first column) of the columns that thread saw.
  std::vector<float> part_v(static_cast<size_t>(threads) * a.m, -INFINITY);
  std::vector<int64_t> part_i(static_cast<size_t>(threads) * a.m, -1);
#pragma omp parallel
  {
    std::vector<float> best_v(a.argmax_cols > 0 ? a.m * 16 : 0, -INFINITY);
    std::vector<int32_t> best_i(best_v.size(), std::numeric_limits<int32_t>::max());
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t p0 = g * kPanels;
      switch (panels - p0 < kPanels ? panels - p0 : kPanels) {
        case 1: row_tiles<1>(a, p0, best_v.data(), best_i.data()); break;
        case 2: row_tiles<2>(a, p0, best_v.data(), best_i.data()); break;
        case 3: row_tiles<3>(a, p0, best_v.data(), best_i.data()); break;
        default: row_tiles<kPanels>(a, p0, best_v.data(), best_i.data());
      }
    }
    if (a.argmax_cols > 0) {
      const int t = omp_get_thread_num();
      for (int64_t m = 0; m < a.m; ++m) {
        const __m512 v = _mm512_loadu_ps(best_v.data() + m * 16);
        const float mx = _mm512_reduce_max_ps(v);
        const __mmask16 at = _mm512_cmp_ps_mask(v, _mm512_set1_ps(mx), _CMP_EQ_OQ);
        const __m512i ids = _mm512_loadu_si512(best_i.data() + m * 16);
        const int32_t first = _mm512_mask_reduce_min_epi32(at, ids);
        if (at != 0 && first != std::numeric_limits<int32_t>::max()) {
          part_v[t * a.m + m] = mx;
          part_i[t * a.m + m] = first;
        }
      }
    }
  }
  if (a.argmax_cols <= 0) return;
  for (int64_t m = 0; m < a.m; ++m) {
    float bv = -INFINITY;
    int64_t bi = -1;
    for (int t = 0; t < threads; ++t) {
      const float v = part_v[t * a.m + m];
      const int64_t i = part_i[t * a.m + m];
      if (i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi))) bv = v, bi = i;
    }
    idx[m] = bi < 0 ? 0 : bi;  // no finite value at all: column 0, as a first-max scan would
    val[m] = bv;
  }
}
#endif

}  // namespace

extern "C" {

// 1 if tandem_bf16_matmul is built (the CPU has AVX512-BF16), else 0: use another matmul.
int tandem_bf16_matmul_available() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// w [n, k] bf16 row-major (k even) -> out, (n + 15) / 16 panels of [k/2][16][2]; the columns
// past n are zero.
void tandem_pack_bf16_pairs(const uint16_t* w, int64_t n, int64_t k, uint16_t* out) {
  const int64_t panels = (n + 15) / 16, kp = k / 2;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t j = 0; j < kp; ++j)
      for (int64_t c = 0; c < 16; ++c) {
        const int64_t col = p * 16 + c;
        uint16_t* dst = out + ((p * kp + j) * 16 + c) * 2;
        dst[0] = col < n ? w[col * k + 2 * j] : 0;
        dst[1] = col < n ? w[col * k + 2 * j + 1] : 0;
      }
}

// y [m, n] (row stride y_stride; nullptr: not written) = x [m, k] @ W^T in bf16, W packed by
// tandem_pack_bf16_pairs. With argmax_cols > 0, also idx/val [m]: each row's first column in
// [0, argmax_cols) holding the max bf16 value, as torch.argmax on y would (except that NaN is
// skipped, as in tandem_argmax).
void tandem_bf16_matmul(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k,
                        const uint16_t* wp, int64_t n, uint16_t* y, int64_t y_stride,
                        int64_t argmax_cols, int64_t* idx, float* val) {
#if defined(__AVX512BF16__)
  // Columns past n are the packing's zero padding: never argmax candidates.
  matmul({x, x_stride, m, k, wp, n, y, y_stride, argmax_cols < n ? argmax_cols : n}, idx, val);
#else
  (void)x, (void)x_stride, (void)m, (void)k, (void)wp, (void)n, (void)y, (void)y_stride;
  (void)argmax_cols, (void)idx, (void)val;
#endif
}

}  // extern "C"
