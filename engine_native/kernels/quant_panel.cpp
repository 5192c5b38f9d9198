// Matrix products with GGUF-block weights for steps of 9 to a few hundred tokens, on CPUs without native
// bf16, where the dense path is fp32; AVX-512 where built with it, else AVX2 (the same values and sums).
//
// There, a 32-sequence decode step spends most of its time streaming the fp32 weights (4 bytes each)
// from memory, and quant_linear.cpp's kernel, built for a handful of rows, re-dequantizes every weight
// for each 8 rows. This one dequantizes each weight once per call into a panel that stays in L2 and
// multiplies all rows by it with register-blocked FMAs, reading 0.625 (Q4_1) or 1.06 (Q8_0) bytes a weight.
// The values are exactly the dense path's (the same dequantization as quant_linear.cpp:
// fma(d, q, m) for Q4_1, d * q for Q8_0) and each output sums its K products in order in fp32: a row's
// result differs from the dense GEMM's only in the order of the additions.
//
// Layouts (prepared once at load from the GGUF blocks, see engine_native/model/quant.py panel_blocks):
//     q4_1: qs [N/16, K/32, 32, 8] uint8: for 16 weight rows, one block, element j: byte i holds row i's
//           nibble low and row i + 8's high; dm [N/16, K/32, 2, 16] fp32: the 16 rows' d, then their m
//     q8_0: qs [N/16, K/32, 32, 16] int8: the 16 rows' element j; d [N/16, K/32, 16] fp32
// x [M, K] fp32 contiguous -> [M, N] fp32. Tiles of 32 weight rows are split across ATen's threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <utility>
#include <vector>

#include "simd.h"

namespace sluice {
namespace {

constexpr int64_t kGroup = 16;              // weight rows per dequantized vector
constexpr int64_t kPanelRows = 2 * kGroup;  // weight rows per panel: two vectors per x row and k

#ifdef __AVX512F__

constexpr int64_t kPassRows = 12;  // x rows per pass: 24 accumulators + 2 panel vectors of 32 registers
constexpr int64_t kPassCols = 32;  // panel columns per pass: two 16-float vectors

// Dequantize 16 weight rows (one group) over all K into panel columns [0, 16) (row stride kPanelRows floats).
void q4_1_group(const uint8_t* qs, const float* dm, int64_t nblocks, float* panel) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* q = qs + b * kQuantBlock * 8;
    const __m512 d = _mm512_loadu_ps(dm + b * 2 * kGroup), m = _mm512_loadu_ps(dm + b * 2 * kGroup + kGroup);
    float* p = panel + b * kQuantBlock * kPanelRows;
    for (int64_t j = 0; j < kQuantBlock; j += 2) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * 8));  // elements j, j + 1
      const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
      const __m128i row0 = _mm_unpacklo_epi64(lo, hi), row1 = _mm_unpackhi_epi64(lo, hi);
      _mm512_storeu_ps(p + j * kPanelRows, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(row0)), m));
      _mm512_storeu_ps(p + (j + 1) * kPanelRows, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(row1)), m));
    }
  }
}

void q8_0_group(const int8_t* qs, const float* d, int64_t nblocks, float* panel) {
  for (int64_t b = 0; b < nblocks; ++b) {
    const int8_t* q = qs + b * kQuantBlock * kGroup;
    const __m512 vd = _mm512_loadu_ps(d + b * kGroup);
    float* p = panel + b * kQuantBlock * kPanelRows;
    for (int64_t j = 0; j < kQuantBlock; ++j) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * kGroup));
      _mm512_storeu_ps(p + j * kPanelRows, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))));
    }
  }
}

// R rows of x against the panel's 32 columns: out[r, 0:32] = sum over k of x[r, k] * panel[k, 0:32], k in
// order.
template <int R>
void pass(const float* x, int64_t ldx, const float* panel, int64_t k, float* out, int64_t ldo) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const __m512 p0 = _mm512_loadu_ps(panel + kk * kPanelRows), p1 = _mm512_loadu_ps(panel + kk * kPanelRows + kGroup);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + kk]);
      acc[r][0] = _mm512_fmadd_ps(xv, p0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, p1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * ldo, acc[r][0]);
    _mm512_storeu_ps(out + r * ldo + kGroup, acc[r][1]);
  }
}

#else  // AVX2: the same values and the same order of additions, on 8-float vectors

constexpr int64_t kPassRows = 6;   // x rows per pass: 12 accumulators + 2 panel vectors + 1 of x, of 16
constexpr int64_t kPassCols = 16;  // panel columns per pass: two 8-float vectors (a panel takes two passes)

void q4_1_group(const uint8_t* qs, const float* dm, int64_t nblocks, float* panel) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* q = qs + b * kQuantBlock * 8;
    const float* s = dm + b * 2 * kGroup;
    const __m256 d0 = _mm256_loadu_ps(s), d1 = _mm256_loadu_ps(s + 8);
    const __m256 m0 = _mm256_loadu_ps(s + kGroup), m1 = _mm256_loadu_ps(s + kGroup + 8);
    float* p = panel + b * kQuantBlock * kPanelRows;
    for (int64_t j = 0; j < kQuantBlock; j += 2) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * 8));  // elements j, j + 1
      const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
      const __m128i rows[2] = {_mm_unpacklo_epi64(lo, hi), _mm_unpackhi_epi64(lo, hi)};  // 16 rows of j, j + 1
      for (int e = 0; e < 2; ++e) {
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(rows[e]));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(rows[e], 8)));
        _mm256_storeu_ps(p + (j + e) * kPanelRows, _mm256_fmadd_ps(d0, w0, m0));
        _mm256_storeu_ps(p + (j + e) * kPanelRows + 8, _mm256_fmadd_ps(d1, w1, m1));
      }
    }
  }
}

void q8_0_group(const int8_t* qs, const float* d, int64_t nblocks, float* panel) {
  for (int64_t b = 0; b < nblocks; ++b) {
    const int8_t* q = qs + b * kQuantBlock * kGroup;
    const __m256 d0 = _mm256_loadu_ps(d + b * kGroup), d1 = _mm256_loadu_ps(d + b * kGroup + 8);
    float* p = panel + b * kQuantBlock * kPanelRows;
    for (int64_t j = 0; j < kQuantBlock; ++j) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * kGroup));
      _mm256_storeu_ps(p + j * kPanelRows, _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))));
      _mm256_storeu_ps(p + j * kPanelRows + 8,
                       _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))));
    }
  }
}

// R rows of x against 16 panel columns (panel and out point at the first): out[r, 0:16] = sum over k of
// x[r, k] * panel[k, 0:16], k in order.
template <int R>
void pass(const float* x, int64_t ldx, const float* panel, int64_t k, float* out, int64_t ldo) {
  __m256 acc[2 * R];
#pragma GCC unroll 16
  for (int i = 0; i < 2 * R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const __m256 p0 = _mm256_loadu_ps(panel + kk * kPanelRows), p1 = _mm256_loadu_ps(panel + kk * kPanelRows + 8);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + kk);
      acc[2 * r] = _mm256_fmadd_ps(xv, p0, acc[2 * r]);
      acc[2 * r + 1] = _mm256_fmadd_ps(xv, p1, acc[2 * r + 1]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * ldo, acc[2 * r]);
    _mm256_storeu_ps(out + r * ldo + 8, acc[2 * r + 1]);
  }
}

#endif  // __AVX512F__

template <int... R>
void pass_rows_impl(int64_t rows, std::integer_sequence<int, R...>, const float* x, int64_t ldx,
                    const float* panel, int64_t k, float* out, int64_t ldo) {
  // Calls pass<rows> (rows in 1..kPassRows).
  (void)((rows == R + 1 ? (pass<R + 1>(x, ldx, panel, k, out, ldo), true) : false) || ...);
}

void pass_rows(const float* x, int64_t rows, int64_t ldx, const float* panel, int64_t k, float* out, int64_t ldo) {
  pass_rows_impl(rows, std::make_integer_sequence<int, kPassRows>{}, x, ldx, panel, k, out, ldo);
}

// `group(g, panel)` dequantizes weight-row group g into the panel's first 16 columns.
template <typename Group>
void panel_matmul(const float* x, int64_t m, int64_t k, int64_t n, Group group, float* out) {
  at::parallel_for(0, n / kPanelRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(static_cast<size_t>(k * kPanelRows));
    for (int64_t t = begin; t < end; ++t) {
      group(2 * t, panel.data());
      group(2 * t + 1, panel.data() + kGroup);
      // Balanced passes (e.g. 32 rows as 11 + 11 + 10): no pass with a few rows and idle FMA slots.
      const int64_t passes = (m + kPassRows - 1) / kPassRows;
      for (int64_t i = 0, r0 = 0; i < passes; ++i) {
        const int64_t rows = (m - r0) / (passes - i);
        for (int64_t c = 0; c < kPanelRows; c += kPassCols)
          pass_rows(x + r0 * k, rows, k, panel.data() + c, k, out + r0 * n + t * kPanelRows + c, n);
        r0 += rows;
      }
    }
  });
}

// The checks both formats share: qs [N/16, K/32, 32, bytes_per_element] of `dtype`
// with N a multiple of 32, x [M, K]. Returns the empty [M, N] output.
torch::Tensor checked_output(const torch::Tensor& x, const torch::Tensor& qs, torch::ScalarType dtype,
                             int64_t bytes_per_element, const char* what) {
  TORCH_CHECK(qs.dim() == 4 && qs.size(2) == kQuantBlock && qs.size(3) == bytes_per_element &&
                  qs.scalar_type() == dtype && qs.is_contiguous(), what);
  TORCH_CHECK(qs.size(0) % 2 == 0, "the weight's rows must be a multiple of 32");
  check_x(x, qs.size(1) * kQuantBlock);
  return torch::empty({x.size(0), qs.size(0) * kGroup}, x.options());
}

torch::Tensor q4_1_panel_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm) {
  auto out = checked_output(x, qs, torch::kUInt8, 8, "qs must be a contiguous uint8 [N/16, K/32, 32, 8] tensor");
  TORCH_CHECK(dm.dim() == 4 && dm.size(0) == qs.size(0) && dm.size(1) == qs.size(1) && dm.size(2) == 2 &&
                  dm.size(3) == kGroup && dm.scalar_type() == torch::kFloat32 && dm.is_contiguous(),
              "dm must be a contiguous float32 [N/16, K/32, 2, 16] tensor");
  const int64_t n = out.size(1), nblocks = qs.size(1), k = nblocks * kQuantBlock;
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const float* s = dm.data_ptr<float>();
  panel_matmul(x.data_ptr<float>(), x.size(0), k, n, [=](int64_t g, float* panel) {
    q4_1_group(q + g * nblocks * kQuantBlock * 8, s + g * nblocks * 2 * kGroup, nblocks, panel);
  }, out.data_ptr<float>());
  return out;
}

torch::Tensor q8_0_panel_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d) {
  auto out = checked_output(x, qs, torch::kInt8, kGroup, "qs must be a contiguous int8 [N/16, K/32, 32, 16] tensor");
  TORCH_CHECK(d.dim() == 3 && d.size(0) == qs.size(0) && d.size(1) == qs.size(1) && d.size(2) == kGroup &&
                  d.scalar_type() == torch::kFloat32 && d.is_contiguous(),
              "d must be a contiguous float32 [N/16, K/32, 16] tensor");
  const int64_t n = out.size(1), nblocks = qs.size(1), k = nblocks * kQuantBlock;
  const int8_t* q = qs.data_ptr<int8_t>();
  const float* s = d.data_ptr<float>();
  panel_matmul(x.data_ptr<float>(), x.size(0), k, n, [=](int64_t g, float* panel) {
    q8_0_group(q + g * nblocks * kQuantBlock * kGroup, s + g * nblocks * kGroup, nblocks, panel);
  }, out.data_ptr<float>());
  return out;
}

}  // namespace
}  // namespace sluice

void register_quant_panel(pybind11::module& m) {
  using namespace sluice;
  m.def("q4_1_panel_linear", &q4_1_panel_linear, "x [M, K] fp32 @ Q4_1 weight (panel layout)^T -> [M, N] fp32");
  m.def("q8_0_panel_linear", &q8_0_panel_linear, "x [M, K] fp32 @ Q8_0 weight (panel layout)^T -> [M, N] fp32");
}
