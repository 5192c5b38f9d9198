// Row-wise operations of a Llama-family layer on fp32 rows, shared by the fused decode step
// (fused_decode.cpp) and the per-op kernels the layer-by-layer path calls (elementwise.cpp).
#pragma once

#include "simd.h"

namespace sluice {

// out[i] = x[i] / sqrt(mean(x^2) + eps) * w[i] over one row of length n (a multiple of 8).
inline void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* out) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const float inv = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(n) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv), _mm256_loadu_ps(w + i)));
}

// Rotate-half RoPE of `heads` heads of dimension d in place: with x = [x1, x2] (halves),
// x <- x * cos + [-x2, x1] * sin, cos/sin the position's rows of the table (both halves equal).
inline void rotate(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    float* v = x + hd * d;
    for (int64_t i = 0; i < half; i += 8) {
      const __m256 x1 = _mm256_loadu_ps(v + i), x2 = _mm256_loadu_ps(v + half + i);
      const __m256 c1 = _mm256_loadu_ps(cos + i), s1 = _mm256_loadu_ps(sin + i);
      const __m256 c2 = _mm256_loadu_ps(cos + half + i), s2 = _mm256_loadu_ps(sin + half + i);
      _mm256_storeu_ps(v + i, _mm256_fnmadd_ps(x2, s1, _mm256_mul_ps(x1, c1)));
      _mm256_storeu_ps(v + half + i, _mm256_fmadd_ps(x1, s2, _mm256_mul_ps(x2, c2)));
    }
  }
}

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + e^-gate[i]) * up[i], length n (a multiple of 8).
inline void silu_mul(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
#ifdef __AVX512F__
  // 16 lanes at a time, the same operations lane by lane as the 8-lane loop below: the same values.
  const __m512 one16 = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = exp16_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one16, e)), _mm512_loadu_ps(up + i)));
  }
#endif
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i < n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
}

inline void add_inplace(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
}

}  // namespace sluice
