// The block products of quant_linear.cpp with each row of the activations rounded to integer blocks of 32 first:
// to 16 bits (the default for small decode steps on CPUs without AVX-512, EngineConfig.int16_activation_max_rows)
// or to 8 bits (opt-in, EngineConfig.int8_activation_max_rows), as llama.cpp multiplies its Q4_1 and Q8_0
// weights by Q8_1 and Q8_0 activation blocks on CPUs.
//
// Without AVX-512, dequantizing a block of 32 weights to fp32 (unpack, widen, convert, scale) costs more
// instructions than multiplying it by the activations, and a step of one or a few tokens is bound by
// them, not by reading the weights. Rounded to integers, the activations meet the 4- or 8-bit weights in
// integer multiply-adds (16 products a vpmaddwd, 32 a vpmaddubsw), and the block's sum is scaled once:
//
//     x block:  a_j = round(x_j / dx),  dx = max_j |x_j| / L  (L = 32767 or 127);  sx = dx * sum_j a_j
//     Q4_1:     sum_j (d q_j + m) dx a_j = d dx sum_j q_j a_j + m sx
//     Q8_0:     sum_j d q_j dx a_j       = d dx sum_j q_j a_j
//
// The integer sums are exact (int16: vpmaddwd's int32 pair sums, four a lane, stay within 4 * 128 * 32767; int8:
// vpmaddubsw's int16 pair sums within 2 * 15 * 127 for Q4_1 and, the sign moved onto the activations, 2 * 128 *
// 127 for Q8_0), so the result is the exact weights' product with the rounded activations, up to the fp32
// additions of the block sums. What differs from the fp32 products is that rounding: to one of 65,535 steps of
// the block's largest magnitude (half a step, 1.5e-5 of it, at most; bf16 rounds each value to 2^-9 of itself),
// or to one of 255. Each row of x is rounded on its own, and its sums are added in the same order whatever the
// other rows, so a row's result does not depend on the others in the step.
//
// Weight layouts are quant_linear.cpp's; x [M, K] fp32 contiguous -> [M, N] fp32. Rows of the weight (N)
// are split across ATen's intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "simd.h"

namespace sluice {
namespace {

// Rows of x per pass over the weights: two accumulators a row (and a scalar one for Q4_1's minimums) stay in
// the 16 ymm registers beside the weight block.
constexpr int64_t kMaxRows = 4;

// x's rows as integer blocks: a [M * K] (block i of row r at (r * K / 32 + i) * 32), dx and sx per block.
template <typename T>
struct RoundedRows {
  std::vector<T> a;
  std::vector<float> dx, sx;
  int64_t nblocks = 0;  // per row
};

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// The block's 32 rounded values (4 vectors of 8 int32, in element order) stored as T.
inline void store_block(const __m256i q[4], int8_t* dst) {
  // _mm256_packs_* interleave their two sources per 128-bit lane; this puts the 8 groups of 4 bytes back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bytes);
}

inline void store_block(const __m256i q[4], int16_t* dst) {
  for (int h = 0; h < 2; ++h) {  // the pack interleaves 128-bit lanes: 0-3, 8-11, 4-7, 12-15 before the permute
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * h], q[2 * h + 1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * h), words);
  }
}

template <typename T>
RoundedRows<T> round_rows(const float* x, int64_t m, int64_t k) {
  constexpr float kLevels = sizeof(T) == 1 ? 127.0f : 32767.0f;
  RoundedRows<T> r;
  r.nblocks = k / kQuantBlock;
  const int64_t blocks = m * r.nblocks;
  r.a.resize(blocks * kQuantBlock);
  r.dx.resize(blocks);
  r.sx.resize(blocks);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t i = 0; i < blocks; ++i) {
    const float* xb = x + i * kQuantBlock;  // rows are contiguous and K is a multiple of 32
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], abs_mask));
    }
    const float top = hmax(amax);
    const float dx = top / kLevels;
    const __m256 inv = _mm256_set1_ps(top > 0.0f ? kLevels / top : 0.0f);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // to nearest, ties to even
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    store_block(q, r.a.data() + i * kQuantBlock);
    r.dx[i] = dx;
    r.sx[i] = dx * static_cast<float>(hsum_epi32(sum));
  }
  return r;
}

// A Q4_1 block's 32 weights (0..15) split into its low and high nibbles: elements 0-15 and 16-31, as bytes.
inline void q4_1_nibbles(const uint8_t* qs, __m128i& lo, __m128i& hi) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  lo = _mm_and_si128(packed, mask);
  hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
}

// One weight block as the integer products need it, and its sum with a row's block: Weights<T, F>::load reads
// block b of a weight row, dot(a) returns the 8 partial sums of q_j * a_j as exact fp32 integers.
template <typename T, QuantFormat F>
struct Weights;

template <QuantFormat F>
struct Weights<int16_t, F> {
  __m256i w[2];  // elements 0-15 and 16-31 as int16
  static Weights load(const void* row_qs, int64_t b) {
    Weights out;
    if constexpr (F == QuantFormat::Q4_1) {
      __m128i lo, hi;
      q4_1_nibbles(static_cast<const uint8_t*>(row_qs) + b * 16, lo, hi);
      out.w[0] = _mm256_cvtepu8_epi16(lo);
      out.w[1] = _mm256_cvtepu8_epi16(hi);
    } else {
      const int8_t* q = static_cast<const int8_t*>(row_qs) + b * 32;
      for (int h = 0; h < 2; ++h)
        out.w[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)));
    }
    return out;
  }
  __m256 dot(const int16_t* a) const {
    const __m256i lo = _mm256_madd_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
    const __m256i hi = _mm256_madd_epi16(w[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
  }
};

template <QuantFormat F>
struct Weights<int8_t, F> {
  __m256i w;      // Q4_1: the 32 weights as bytes 0..15; Q8_0: the signed weights
  __m256i w_abs;  // the unsigned operand of vpmaddubsw: w itself, or Q8_0's magnitudes
  static Weights load(const void* row_qs, int64_t b) {
    Weights out;
    if constexpr (F == QuantFormat::Q4_1) {
      __m128i lo, hi;
      q4_1_nibbles(static_cast<const uint8_t*>(row_qs) + b * 16, lo, hi);
      out.w = out.w_abs = _mm256_set_m128i(hi, lo);
    } else {
      out.w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const int8_t*>(row_qs) + b * 32));
      out.w_abs = _mm256_sign_epi8(out.w, out.w);
    }
    return out;
  }
  __m256 dot(const int8_t* a_ptr) const {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a_ptr));
    if constexpr (F == QuantFormat::Q8_0) a = _mm256_sign_epi8(a, w);  // q * a as |q| * (a with q's sign)
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, a), _mm256_set1_epi16(1)));
  }
};

// One weight row against R rows of x. The blocks alternate between two accumulators a row, so that
// consecutive blocks' FMAs do not wait on each other; the same two whatever R, so that a row's sums, rounded
// the same way, do not depend on how many rows share the step (the rounding of the next product's input
// would turn a difference in the last bit into a different step).
template <int R, typename T, QuantFormat F>
inline void row_dot(const void* row_qs, const float* row_scales, const RoundedRows<T>& x, int64_t r0, float* out,
                    int64_t ldo) {
  constexpr int A = 2;
  const int64_t nblocks = x.nblocks;
  __m256 acc[R][A];
  float acc_min[R];
  for (int r = 0; r < R; ++r) {
    for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
    acc_min[r] = 0.0f;
  }
  // Block b into accumulator `slot` of every row.
  auto block = [&](int64_t b, int slot) {
    const auto w = Weights<T, F>::load(row_qs, b);
    const float d = F == QuantFormat::Q4_1 ? row_scales[2 * b] : row_scales[b];
    for (int r = 0; r < R; ++r) {
      const int64_t xb = (r0 + r) * nblocks + b;
      acc[r][slot] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.dx[xb]), w.dot(x.a.data() + xb * kQuantBlock),
                                     acc[r][slot]);
      if constexpr (F == QuantFormat::Q4_1) acc_min[r] += row_scales[2 * b + 1] * x.sx[xb];
    }
  };
  int64_t b = 0;
  for (; b + A <= nblocks; b += A)
    for (int i = 0; i < A; ++i) block(b + i, i);
  for (; b < nblocks; ++b) block(b, 0);
  for (int r = 0; r < R; ++r) {
    __m256 s = acc[r][0];
    for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[r][a]);
    out[r * ldo] = hsum(s) + acc_min[r];
  }
}

template <typename T, QuantFormat F>
inline void dot_rows(const void* row_qs, const float* row_scales, const RoundedRows<T>& x, int64_t r0, int64_t rows,
                     float* out, int64_t ldo) {
  switch (rows) {
    case 1: row_dot<1, T, F>(row_qs, row_scales, x, r0, out, ldo); break;
    case 2: row_dot<2, T, F>(row_qs, row_scales, x, r0, out, ldo); break;
    case 3: row_dot<3, T, F>(row_qs, row_scales, x, r0, out, ldo); break;
    default: row_dot<4, T, F>(row_qs, row_scales, x, r0, out, ldo); break;
  }
}

template <typename T, QuantFormat F>
void run(const RoundedRows<T>& x, int64_t m, int64_t n, const void* qs, const float* scales, float* out) {
  const int64_t nblocks = x.nblocks;
  const int64_t row_bytes = nblocks * (F == QuantFormat::Q4_1 ? 16 : 32);
  const int64_t row_scales = nblocks * (F == QuantFormat::Q4_1 ? 2 : 1);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const void* rq = static_cast<const uint8_t*>(qs) + row * row_bytes;
      const float* rs = scales + row * row_scales;
      for (int64_t r0 = 0; r0 < m; r0 += kMaxRows)
        dot_rows<T, F>(rq, rs, x, r0, std::min(kMaxRows, m - r0), out + r0 * n + row, n);
    }
  });
}

template <typename T>
void rounded_matmul(QuantFormat format, const float* x, int64_t m, int64_t k, const void* qs, const float* scales,
                    int64_t n, float* out) {
  const RoundedRows<T> rows = round_rows<T>(x, m, k);
  if (format == QuantFormat::Q4_1)
    run<T, QuantFormat::Q4_1>(rows, m, n, qs, scales, out);
  else
    run<T, QuantFormat::Q8_0>(rows, m, n, qs, scales, out);
}

}  // namespace

void quant_matmul_int16(QuantFormat format, const float* x, int64_t m, int64_t k, const void* qs, const float* scales,
                        int64_t n, float* out) {
  rounded_matmul<int16_t>(format, x, m, k, qs, scales, n, out);
}

void quant_matmul_int8(QuantFormat format, const float* x, int64_t m, int64_t k, const void* qs, const float* scales,
                       int64_t n, float* out) {
  rounded_matmul<int8_t>(format, x, m, k, qs, scales, n, out);
}

}  // namespace sluice
