// The block products of quant_linear.cpp with the activations rounded to int8 blocks of 32 (opt-in, in steps
// of at most EngineConfig.int8_activation_max_rows tokens), as llama.cpp multiplies its Q4_1 and Q8_0 weights
// (by Q8_1 and Q8_0 activation blocks) on CPUs.
//
// Without AVX-512, dequantizing a block of 32 weights to fp32 (unpack, widen, convert, scale) costs more
// instructions than multiplying it by the activations, and a step of one or a few tokens is bound by
// them, not by reading the weights. Rounded to bytes, the activations meet the 4-bit weights in
// integer multiply-adds, 32 products a vpmaddubsw:
//
//     x block:  a_j = round(x_j / dx),  dx = max_j |x_j| / 127;  sx = dx * sum_j a_j
//     Q4_1:     sum_j (d q_j + m) dx a_j = d dx sum_j q_j a_j + m sx
//     Q8_0:     sum_j d q_j dx a_j       = d dx sum_j q_j a_j
//
// The integer sums are exact (vpmaddubsw's int16 pair sums stay within 2 * 15 * 127 for Q4_1 and, with the
// sign moved onto the activations, 2 * 128 * 127 for Q8_0); what differs from the fp32 products is the
// rounding of each activation to one of 255 steps of its block's largest magnitude. Each row of x is
// rounded on its own, so a row's result does not depend on the others in the step.
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

// x's rows as int8 blocks: a [M * K] (block i of row r at (r * K / 32 + i) * 32), dx and sx per block.
struct Int8Rows {
  std::vector<int8_t> a;
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

Int8Rows round_rows(const float* x, int64_t m, int64_t k) {
  Int8Rows r;
  r.nblocks = k / kQuantBlock;
  const int64_t blocks = m * r.nblocks;
  r.a.resize(blocks * kQuantBlock);
  r.dx.resize(blocks);
  r.sx.resize(blocks);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  // _mm256_packs_* interleave their two sources per 128-bit lane; this puts the 8 groups of 4 bytes back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < blocks; ++i) {
    const float* xb = x + i * kQuantBlock;  // rows are contiguous and K is a multiple of 32
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], abs_mask));
    }
    const float top = hmax(amax);
    const float dx = top / 127.0f;
    const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // to nearest, ties to even
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.a.data() + i * kQuantBlock), bytes);
    r.dx[i] = dx;
    r.sx[i] = dx * static_cast<float>(hsum_epi32(sum));
  }
  return r;
}

// A Q4_1 block's 32 weights as bytes 0..15 in element order (byte j: element j low, element j + 16 high).
inline __m256i q4_1_bytes(const uint8_t* qs) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), _mm_and_si128(packed, mask));
}

// 32 products of unsigned and signed bytes summed into 8 fp32 lanes (exact integers).
inline __m256 dot32(__m256i u, __m256i s) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

// One weight row against R rows of x. The blocks alternate between two accumulators a row, so that
// consecutive blocks' FMAs do not wait on each other; the same two whatever R, so that a row's sums, rounded
// the same way, do not depend on how many rows share the step (int8 rounding of the next product's input
// would turn a difference in the last bit into a different step of 1/127).
template <int R, QuantFormat F>
inline void row_dot(const void* row_qs, const float* row_scales, const Int8Rows& x, int64_t r0, float* out,
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
    __m256i w;
    float d, m = 0.0f;
    if constexpr (F == QuantFormat::Q4_1) {
      w = q4_1_bytes(static_cast<const uint8_t*>(row_qs) + b * 16);
      d = row_scales[2 * b];
      m = row_scales[2 * b + 1];
    } else {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const int8_t*>(row_qs) + b * 32));
      d = row_scales[b];
    }
    const __m256i w_abs = F == QuantFormat::Q8_0 ? _mm256_sign_epi8(w, w) : w;
    for (int r = 0; r < R; ++r) {
      const int64_t xb = (r0 + r) * nblocks + b;
      __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a.data() + xb * kQuantBlock));
      if constexpr (F == QuantFormat::Q8_0) a = _mm256_sign_epi8(a, w);  // q * a as |q| * (a with q's sign)
      acc[r][slot] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.dx[xb]), dot32(w_abs, a), acc[r][slot]);
      if constexpr (F == QuantFormat::Q4_1) acc_min[r] += m * x.sx[xb];
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

template <QuantFormat F>
inline void dot_rows(const void* row_qs, const float* row_scales, const Int8Rows& x, int64_t r0, int64_t rows,
                     float* out, int64_t ldo) {
  switch (rows) {
    case 1: row_dot<1, F>(row_qs, row_scales, x, r0, out, ldo); break;
    case 2: row_dot<2, F>(row_qs, row_scales, x, r0, out, ldo); break;
    case 3: row_dot<3, F>(row_qs, row_scales, x, r0, out, ldo); break;
    default: row_dot<4, F>(row_qs, row_scales, x, r0, out, ldo); break;
  }
}

template <QuantFormat F>
void run(const Int8Rows& x, int64_t m, int64_t n, const void* qs, const float* scales, float* out) {
  const int64_t nblocks = x.nblocks;
  const int64_t row_bytes = nblocks * (F == QuantFormat::Q4_1 ? 16 : 32);
  const int64_t row_scales = nblocks * (F == QuantFormat::Q4_1 ? 2 : 1);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const void* rq = static_cast<const uint8_t*>(qs) + row * row_bytes;
      const float* rs = scales + row * row_scales;
      for (int64_t r0 = 0; r0 < m; r0 += kMaxRows)
        dot_rows<F>(rq, rs, x, r0, std::min(kMaxRows, m - r0), out + r0 * n + row, n);
    }
  });
}

}  // namespace

void quant_matmul_int8(QuantFormat format, const float* x, int64_t m, int64_t k, const void* qs, const float* scales,
                       int64_t n, float* out) {
  const Int8Rows rows = round_rows(x, m, k);
  if (format == QuantFormat::Q4_1)
    run<QuantFormat::Q4_1>(rows, m, n, qs, scales, out);
  else
    run<QuantFormat::Q8_0>(rows, m, n, qs, scales, out);
}

}  // namespace sluice
