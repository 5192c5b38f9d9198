// Matrix products with GGUF-block weights for steps of 9 to a few hundred tokens, on AVX-512 CPUs without
// native bf16, where the dense path is fp32.
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

#include <vector>

#include "simd.h"

namespace sluice {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kGroup = 16;             // weight rows per dequantized vector
constexpr int64_t kTile = 2 * kGroup;      // weight rows per panel: two vectors per x row and k
constexpr int64_t kPassRows = 12;          // x rows per pass over a panel: 24 accumulators + 2 panel vectors

#ifdef __AVX512F__

// Dequantize 16 weight rows (one group) over all K into panel columns [0, 16) (row stride kTile floats).
void q4_1_group(const uint8_t* qs, const float* dm, int64_t nblocks, float* panel) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* q = qs + b * kBlock * 8;
    const __m512 d = _mm512_loadu_ps(dm + b * 2 * kGroup), m = _mm512_loadu_ps(dm + b * 2 * kGroup + kGroup);
    float* p = panel + b * kBlock * kTile;
    for (int64_t j = 0; j < kBlock; j += 2) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * 8));  // elements j, j + 1
      const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
      const __m128i row0 = _mm_unpacklo_epi64(lo, hi), row1 = _mm_unpackhi_epi64(lo, hi);
      _mm512_storeu_ps(p + j * kTile, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(row0)), m));
      _mm512_storeu_ps(p + (j + 1) * kTile, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(row1)), m));
    }
  }
}

void q8_0_group(const int8_t* qs, const float* d, int64_t nblocks, float* panel) {
  for (int64_t b = 0; b < nblocks; ++b) {
    const int8_t* q = qs + b * kBlock * kGroup;
    const __m512 vd = _mm512_loadu_ps(d + b * kGroup);
    float* p = panel + b * kBlock * kTile;
    for (int64_t j = 0; j < kBlock; ++j) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * kGroup));
      _mm512_storeu_ps(p + j * kTile, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))));
    }
  }
}

// R rows of x against one panel: out[r, 0:32] = sum over k of x[r, k] * panel[k, 0:32], k in order.
template <int R>
void pass(const float* x, int64_t ldx, const float* panel, int64_t k, float* out, int64_t ldo) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const __m512 p0 = _mm512_loadu_ps(panel + kk * kTile), p1 = _mm512_loadu_ps(panel + kk * kTile + kGroup);
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

void pass_rows(const float* x, int64_t rows, int64_t ldx, const float* panel, int64_t k, float* out, int64_t ldo) {
  switch (rows) {
    case 1: pass<1>(x, ldx, panel, k, out, ldo); break;
    case 2: pass<2>(x, ldx, panel, k, out, ldo); break;
    case 3: pass<3>(x, ldx, panel, k, out, ldo); break;
    case 4: pass<4>(x, ldx, panel, k, out, ldo); break;
    case 5: pass<5>(x, ldx, panel, k, out, ldo); break;
    case 6: pass<6>(x, ldx, panel, k, out, ldo); break;
    case 7: pass<7>(x, ldx, panel, k, out, ldo); break;
    case 8: pass<8>(x, ldx, panel, k, out, ldo); break;
    case 9: pass<9>(x, ldx, panel, k, out, ldo); break;
    case 10: pass<10>(x, ldx, panel, k, out, ldo); break;
    case 11: pass<11>(x, ldx, panel, k, out, ldo); break;
    default: pass<12>(x, ldx, panel, k, out, ldo); break;
  }
}

// `group(g, panel)` dequantizes weight-row group g into the panel's first 16 columns.
template <typename Group>
void panel_matmul(const float* x, int64_t m, int64_t k, int64_t n, Group group, float* out) {
  at::parallel_for(0, n / kTile, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(static_cast<size_t>(k * kTile));
    for (int64_t t = begin; t < end; ++t) {
      group(2 * t, panel.data());
      group(2 * t + 1, panel.data() + kGroup);
      // Balanced passes (e.g. 32 rows as 11 + 11 + 10): no pass with a few rows and idle FMA slots.
      const int64_t passes = (m + kPassRows - 1) / kPassRows;
      for (int64_t i = 0, r0 = 0; i < passes; ++i) {
        const int64_t rows = (m - r0) / (passes - i);
        pass_rows(x + r0 * k, rows, k, panel.data(), k, out + r0 * n + t * kTile, n);
        r0 += rows;
      }
    }
  });
}

#endif  // __AVX512F__

bool panel_available() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

// The checks both formats share: the kernels built, qs [N/16, K/32, 32, bytes_per_element] of `dtype`
// with N a multiple of 32, x [M, K]. Returns the empty [M, N] output.
torch::Tensor checked_output(const torch::Tensor& x, const torch::Tensor& qs, torch::ScalarType dtype,
                             int64_t bytes_per_element, const char* what) {
  TORCH_CHECK(panel_available(), "the panel kernels need AVX-512");
  TORCH_CHECK(qs.dim() == 4 && qs.size(2) == kBlock && qs.size(3) == bytes_per_element &&
                  qs.scalar_type() == dtype && qs.is_contiguous(), what);
  TORCH_CHECK(qs.size(0) % 2 == 0, "the weight's rows must be a multiple of 32");
  check_x(x, qs.size(1) * kBlock);
  return torch::empty({x.size(0), qs.size(0) * kGroup}, x.options());
}

torch::Tensor q4_1_panel_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm) {
  auto out = checked_output(x, qs, torch::kUInt8, 8, "qs must be a contiguous uint8 [N/16, K/32, 32, 8] tensor");
  TORCH_CHECK(dm.dim() == 4 && dm.size(0) == qs.size(0) && dm.size(1) == qs.size(1) && dm.size(2) == 2 &&
                  dm.size(3) == kGroup && dm.scalar_type() == torch::kFloat32 && dm.is_contiguous(),
              "dm must be a contiguous float32 [N/16, K/32, 2, 16] tensor");
  const int64_t n = out.size(1), nblocks = qs.size(1), k = nblocks * kBlock;
#ifdef __AVX512F__
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const float* s = dm.data_ptr<float>();
  panel_matmul(x.data_ptr<float>(), x.size(0), k, n, [=](int64_t g, float* panel) {
    q4_1_group(q + g * nblocks * kBlock * 8, s + g * nblocks * 2 * kGroup, nblocks, panel);
  }, out.data_ptr<float>());
#endif
  return out;
}

torch::Tensor q8_0_panel_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d) {
  auto out = checked_output(x, qs, torch::kInt8, kGroup, "qs must be a contiguous int8 [N/16, K/32, 32, 16] tensor");
  TORCH_CHECK(d.dim() == 3 && d.size(0) == qs.size(0) && d.size(1) == qs.size(1) && d.size(2) == kGroup &&
                  d.scalar_type() == torch::kFloat32 && d.is_contiguous(),
              "d must be a contiguous float32 [N/16, K/32, 16] tensor");
  const int64_t n = out.size(1), nblocks = qs.size(1), k = nblocks * kBlock;
#ifdef __AVX512F__
  const int8_t* q = qs.data_ptr<int8_t>();
  const float* s = d.data_ptr<float>();
  panel_matmul(x.data_ptr<float>(), x.size(0), k, n, [=](int64_t g, float* panel) {
    q8_0_group(q + g * nblocks * kBlock * kGroup, s + g * nblocks * kGroup, nblocks, panel);
  }, out.data_ptr<float>());
#endif
  return out;
}

}  // namespace
}  // namespace sluice

void register_quant_panel(pybind11::module& m) {
  using namespace sluice;
  m.def("panel_available", &panel_available, "whether the panel kernels were built (AVX-512)");
  m.def("q4_1_panel_linear", &q4_1_panel_linear, "x [M, K] fp32 @ Q4_1 weight (panel layout)^T -> [M, N] fp32");
  m.def("q8_0_panel_linear", &q8_0_panel_linear, "x [M, K] fp32 @ Q8_0 weight (panel layout)^T -> [M, N] fp32");
}
