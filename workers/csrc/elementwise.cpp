// Row-wise kernels of the forward pass: RMSNorm (with the residual add), rotary embeddings,
// SiLU-and-mul, argmax; and the OpenMP thread count every kernel follows.

#include "common.h"

namespace {

template <typename T>
void rms_norm_impl(T* out, int64_t out_stride, T* x, int64_t x_stride, const T* residual_in,
                   int64_t res_stride, const T* weight, int64_t n, int64_t dim, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    T* xi = x + i * x_stride;
    if (residual_in != nullptr) {
      // x += residual, rounded to x's dtype first (as the unfused `h = h + delta` does).
      const T* ri = residual_in + i * res_stride;
      for (int64_t d = 0; d < dim; ++d) store(xi, d, load(xi, d) + load(ri, d));
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < dim; ++d) {
      const float v = load(xi, d);
      ss += v * v;
    }
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    T* oi = out + i * out_stride;
    for (int64_t d = 0; d < dim; ++d) {
      // normalized value rounded to the model dtype, then scaled by the weight (HF's order)
      T normed;
      store(&normed, 0, load(xi, d) * r);
      store(oi, d, load(weight, d) * load(&normed, 0));
    }
  }
}

// Rotate-half rotary embedding in place on `heads` consecutive heads of each token's row.
template <typename T>
void rotary_impl(T* x, int64_t x_stride, int64_t n, int64_t heads, int64_t hd,
                 const int64_t* positions, const float* cos, const float* sin) {
  const int64_t half = hd / 2;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* c = cos + positions[i] * half;
    const float* s = sin + positions[i] * half;
    for (int64_t h = 0; h < heads; ++h) {
      T* p = x + i * x_stride + h * hd;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) {
        const float a = load(p, d), b = load(p, d + half);
        store(p, d, a * c[d] - b * s[d]);
        store(p, d + half, b * c[d] + a * s[d]);
      }
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
#pragma omp simd
    for (int64_t d = 0; d < inter; ++d) {
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
    rotary_impl(static_cast<float*>(x), x_stride, n, heads, hd, positions, cos, sin);
  else
    rotary_impl(static_cast<uint16_t*>(x), x_stride, n, heads, hd, positions, cos, sin);
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

}  // extern "C"
