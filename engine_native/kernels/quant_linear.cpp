// Matrix products with weights kept in their GGUF block formats, for steps of a few tokens on CPU.
//
// A decode step of one or a few sequences reads every weight once per step: its time is the time to read
// the weights. These kernels read 4-bit (Q4_1) or 8-bit (Q8_0) blocks of 32 weights instead of fp32 rows,
// and dequantize them in registers to exactly the fp32 values the dense path holds:
//
//     Q4_1:  w = fma(d, q, m)   q in 0..15, d and m the block's fp16 scale and minimum (as fp32)
//     Q8_0:  w = d * q          q in -128..127
//
// (gguf's dequantize computes d * q + m in fp32: d * q is exact, so one fused multiply-add rounds the
// same way). Activations and accumulation stay fp32, so a row's result differs from the dense GEMM only
// in the order of the additions.
//
// Layouts (prepared once at load, see engine_native/model/quant.py):
//     q4_1: qs [N, K/32, 16] uint8 (byte j: element j in the low nibble, element j + 16 in the high one),
//           dm [N, K/32, 2] float32 (d, m)
//     q8_0: qs [N, K/32, 32] int8, d [N, K/32] float32
// x is [M, K] float32, contiguous; the result is [M, N] float32. Rows of the weight (N) are split across
// ATen's intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd.h"

namespace sluice {
namespace {

constexpr int64_t kMaxRows = 8;  // rows of x handled per pass over the weights

#ifdef __AVX512F__
// On an AVX-512 CPU a block is two vectors of 16: the same values (the same fma(d, q, m) and d * q) for
// half the widenings, FMAs and x loads of eight-wide code. Measured on a 2-core Xeon with AMX, in-process: a
// single-stream decode step ~1.7x faster (the eight-wide block's unpacks and widenings bound it), an
// 8-stream one ~8% (its FMAs and x loads dominate either way).

// The 32 weights of one Q4_1 block as two vectors of 16 floats, in element order.
inline void q4_1_block(const uint8_t* qs, float d, float m, __m512 w[2]) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m512 vd = _mm512_set1_ps(d);
  const __m512 vm = _mm512_set1_ps(m);
  const __m128i lo = _mm_and_si128(packed, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  w[0] = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vm);
  w[1] = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vm);
}

inline void q8_0_block(const int8_t* qs, float d, __m512 w[2]) {
  const __m512 vd = _mm512_set1_ps(d);
  for (int h = 0; h < 2; ++h) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * h));
    w[h] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
  }
}

using Vec = __m512;  // what a block decodes into, two per block

// One weight row n against R rows of x, A accumulators a row (two per block of a pass): with one or two
// rows two blocks a pass, so that each row has four accumulators to hide the FMA latency; with more rows
// their own accumulators do.
template <int R, int A, typename Block>
inline void row_dot(Block block, int64_t nblocks, const float* x, int64_t ldx, float* out, int64_t ldo) {
  constexpr int Blocks = A / 2;
  __m512 acc[R][A];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < A; ++a) acc[r][a] = _mm512_setzero_ps();
  __m512 w[A];
  int64_t b = 0;
  for (; b + Blocks <= nblocks; b += Blocks) {
    for (int i = 0; i < Blocks; ++i) block(b + i, w + 2 * i);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * ldx + b * kQuantBlock;
      for (int j = 0; j < A; ++j) acc[r][j] = _mm512_fmadd_ps(w[j], _mm512_loadu_ps(xb + 16 * j), acc[r][j]);
    }
  }
  if (b < nblocks) {  // two blocks a pass and an odd number of them: the last one alone
    block(b, w);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * ldx + b * kQuantBlock;
      for (int j = 0; j < 2; ++j) acc[r][j] = _mm512_fmadd_ps(w[j], _mm512_loadu_ps(xb + 16 * j), acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 s = acc[r][0];
    for (int a = 1; a < A; ++a) s = _mm512_add_ps(s, acc[r][a]);
    out[r * ldo] = _mm512_reduce_add_ps(s);
  }
}

constexpr int accumulators_per_row(int rows) { return rows <= 2 ? 4 : 2; }

#else

inline __m256 u8_to_ps(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }
inline __m256 i8_to_ps(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

// The 32 weights of one Q4_1 block as four vectors of 8 floats, in element order.
inline void q4_1_block(const uint8_t* qs, float d, float m, __m256 w[4]) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(packed, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  const __m256 vd = _mm256_set1_ps(d);
  const __m256 vm = _mm256_set1_ps(m);
  w[0] = _mm256_fmadd_ps(vd, u8_to_ps(lo), vm);
  w[1] = _mm256_fmadd_ps(vd, u8_to_ps(_mm_unpackhi_epi64(lo, lo)), vm);
  w[2] = _mm256_fmadd_ps(vd, u8_to_ps(hi), vm);
  w[3] = _mm256_fmadd_ps(vd, u8_to_ps(_mm_unpackhi_epi64(hi, hi)), vm);
}

inline void q8_0_block(const int8_t* qs, float d, __m256 w[4]) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16));
  const __m256 vd = _mm256_set1_ps(d);
  w[0] = _mm256_mul_ps(vd, i8_to_ps(a));
  w[1] = _mm256_mul_ps(vd, i8_to_ps(_mm_unpackhi_epi64(a, a)));
  w[2] = _mm256_mul_ps(vd, i8_to_ps(b));
  w[3] = _mm256_mul_ps(vd, i8_to_ps(_mm_unpackhi_epi64(b, b)));
}

using Vec = __m256;  // four per block

// One weight row n against R rows of x. A independent accumulators per row hide the FMA latency when R
// is small (R * A <= 8 keeps everything in the 16 ymm registers with the 4 weight vectors).
template <int R, int A, typename Block>
inline void row_dot(Block block, int64_t nblocks, const float* x, int64_t ldx, float* out, int64_t ldo) {
  __m256 acc[R][A];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
  __m256 w[4];
  for (int64_t b = 0; b < nblocks; ++b) {
    block(b, w);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * ldx + b * kQuantBlock;
      for (int j = 0; j < 4; ++j) acc[r][j % A] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), acc[r][j % A]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 s = acc[r][0];
    for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[r][a]);
    out[r * ldo] = hsum(s);
  }
}

constexpr int accumulators_per_row(int rows) { return rows <= 2 ? 4 : rows <= 4 ? 2 : 1; }

#endif  // __AVX512F__

template <typename Block>
inline void dot_rows(Block block, int64_t nblocks, const float* x, int64_t rows, int64_t ldx, float* out,
                     int64_t ldo) {
  switch (rows) {
    case 1: row_dot<1, accumulators_per_row(1)>(block, nblocks, x, ldx, out, ldo); break;
    case 2: row_dot<2, accumulators_per_row(2)>(block, nblocks, x, ldx, out, ldo); break;
    case 3: row_dot<3, accumulators_per_row(3)>(block, nblocks, x, ldx, out, ldo); break;
    case 4: row_dot<4, accumulators_per_row(4)>(block, nblocks, x, ldx, out, ldo); break;
    case 5: row_dot<5, accumulators_per_row(5)>(block, nblocks, x, ldx, out, ldo); break;
    case 6: row_dot<6, accumulators_per_row(6)>(block, nblocks, x, ldx, out, ldo); break;
    case 7: row_dot<7, accumulators_per_row(7)>(block, nblocks, x, ldx, out, ldo); break;
    default: row_dot<8, accumulators_per_row(8)>(block, nblocks, x, ldx, out, ldo); break;
  }
}

template <typename RowBlock>
void run(const float* x, int64_t m, int64_t k, int64_t n, int64_t nblocks, RowBlock row_block, float* out) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      auto block = row_block(row);
      for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
        dot_rows(block, nblocks, x + r0 * k, std::min(kMaxRows, m - r0), k, out + r0 * n + row, n);
      }
    }
  });
}

}  // namespace

void quant_matmul(QuantFormat format, const float* x, int64_t m, int64_t k, const void* qs, const float* scales,
                  int64_t n, float* out) {
  const int64_t nblocks = k / kQuantBlock;
  if (format == QuantFormat::Q4_1) {
    const uint8_t* q = static_cast<const uint8_t*>(qs);
    run(x, m, k, n, nblocks, [=](int64_t row) {
      const uint8_t* rq = q + row * nblocks * 16;
      const float* rs = scales + row * nblocks * 2;
      return [=](int64_t b, Vec* w) { q4_1_block(rq + b * 16, rs[2 * b], rs[2 * b + 1], w); };
    }, out);
  } else {
    const int8_t* q = static_cast<const int8_t*>(qs);
    run(x, m, k, n, nblocks, [=](int64_t row) {
      const int8_t* rq = q + row * nblocks * 32;
      const float* rs = scales + row * nblocks;
      return [=](int64_t b, Vec* w) { q8_0_block(rq + b * 32, rs[b], w); };
    }, out);
  }
}

void check_q4_1_blocks(const torch::Tensor& qs, const torch::Tensor& dm) {
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == 16 && qs.scalar_type() == torch::kUInt8 && qs.is_contiguous(),
              "qs must be a contiguous uint8 [N, K/32, 16] tensor");
  TORCH_CHECK(dm.dim() == 3 && dm.size(2) == 2 && dm.scalar_type() == torch::kFloat32 && dm.is_contiguous(),
              "dm must be a contiguous float32 [N, K/32, 2] tensor");
}

void check_x(const torch::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight ", k);
}

namespace {

Activations activations_arg(int64_t activations) {
  TORCH_CHECK(activations >= 0 && activations <= 2, "activations must be 0 (fp32), 1 (int16) or 2 (int8)");
  return static_cast<Activations>(activations);
}

torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm, int64_t activations) {
  check_q4_1_blocks(qs, dm);
  const int64_t n = qs.size(0), k = qs.size(1) * kQuantBlock;
  check_x(x, k);
  auto out = torch::empty({x.size(0), n}, x.options());
  quant_matmul(activations_arg(activations), QuantFormat::Q4_1, x.data_ptr<float>(), x.size(0), k,
               qs.data_ptr<uint8_t>(), dm.data_ptr<float>(), n, out.data_ptr<float>());
  return out;
}

torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, int64_t activations) {
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == 32 && qs.scalar_type() == torch::kInt8 && qs.is_contiguous(),
              "qs must be a contiguous int8 [N, K/32, 32] tensor");
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == torch::kFloat32 && d.is_contiguous(),
              "d must be a contiguous float32 [N, K/32] tensor");
  const int64_t n = qs.size(0), k = qs.size(1) * kQuantBlock;
  check_x(x, k);
  auto out = torch::empty({x.size(0), n}, x.options());
  quant_matmul(activations_arg(activations), QuantFormat::Q8_0, x.data_ptr<float>(), x.size(0), k,
               qs.data_ptr<int8_t>(), d.data_ptr<float>(), n, out.data_ptr<float>());
  return out;
}

}  // namespace
}  // namespace sluice

void register_quant_linear(pybind11::module& m) {
  using namespace sluice;
#ifdef __AVX512F__
  m.attr("BLOCKS_ON_16_LANES") = true;  // the fp32 block products decode a block into two vectors of 16
#else
  m.attr("BLOCKS_ON_16_LANES") = false;
#endif
  // activations: 0 fp32; 1, 2: x's rows rounded to int16 or int8 blocks of 32 first (quant_rounded.cpp).
  m.def("q4_1_linear", &q4_1_linear, "x [M, K] fp32 @ Q4_1 weight [N, K]^T -> [M, N] fp32", pybind11::arg("x"),
        pybind11::arg("qs"), pybind11::arg("dm"), pybind11::arg("activations") = 0);
  m.def("q8_0_linear", &q8_0_linear, "x [M, K] fp32 @ Q8_0 weight [N, K]^T -> [M, N] fp32", pybind11::arg("x"),
        pybind11::arg("qs"), pybind11::arg("d"), pybind11::arg("activations") = 0);
}
