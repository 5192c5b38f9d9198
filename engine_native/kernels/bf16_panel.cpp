// x @ W^T with the dense bf16 weights laid out once in 48-column panels, through AVX-512 BF16 dot products
// (vdpbf16ps), for pure-decode steps of 9 to a few hundred sequences on CPUs with AVX-512 BF16 and no AMX.
//
// oneDNN's bf16 GEMM runs such steps at ~60-70% of what the same instructions reach on big prompts: a
// 32-row product spends its time on blocking, packing x and its own dispatch, not on dot products. Here the
// weights are already in the order the dot products read them, x is read in place (each bf16 pair broadcast
// to all 16 lanes), and every weight is read from memory once per call: 8 rows of x x 48 columns a pass
// (24 accumulators), each 48-column panel (K x 96 bytes: 54 KB at K = 576) hot in L2 for every pass.
// Against 12 rows x 32 columns (the same 24 accumulators), 8 x 48 loads 3 weight vectors and 8 broadcasts
// for 24 dot products instead of 2 and 12: 32 decode rows over the bundled model's 120 layer matrices
// took 9.8 against 10.7 ms (oneDNN 12.6), 16 rows 6.1 against 7.2 (8.7).
//
// Same values as oneDNN's: the dense path's very bf16 weights and bf16 inputs, each pair's products exact and
// added in fp32 (vdpbf16ps), the sums in fp32, the result rounded to bf16 to nearest even (vcvtneps2bf16) as
// oneDNN's bf16 output is, or returned in fp32. A row's result differs from oneDNN's only in the order of the
// additions, and it does not depend on how many rows a call has: each row's K pairs are added in order by the
// same instructions whichever pass it falls in.
//
// Layout (prepared once at load, engine_native/model/bf16_panel.py): panel [ceil(N/48), K/2, 48, 2] bf16: for
// 48 weight rows (output columns), k-pair j, column c: W[c, 2j], W[c, 2j + 1]; the last panel's columns
// beyond N are zeros and never stored. x [M, K] bf16 contiguous. Panels are split across ATen's threads.
//
// Built where the compiler targets AVX-512 BF16 (-march=native on such a CPU; the build is keyed on the CPU's
// flags); elsewhere `bf16_panel_available()` is false and the callers keep oneDNN.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "simd.h"

namespace sluice {
namespace {

constexpr int kVectors = 3;                      // 16-lane accumulators per row of a pass
constexpr int64_t kPanelCols = 16 * kVectors;    // output columns per panel
constexpr int kPassRows = 8;                     // rows of x per pass: 24 accumulators + 3 panel vectors + 1 broadcast

#if defined(__AVX512BF16__)

// Rows r of x against one panel: out[r, c] = sum over k-pairs j of x[r, 2j:2j+2] . panel[j, c, 0:2], for the
// panel's first `cols` columns (48, or fewer in the last panel). x32: x as bf16 pairs (uint32), ldx pairs a
// row; bias: the panel's first column's, or null; out: fp32 or bf16, ldo elements a row.
template <int R, typename Out>
inline void pass(const uint32_t* x32, int64_t ldx, const uint16_t* panel, int64_t pairs, int64_t cols,
                 const float* bias, Out* out, int64_t ldo) {
  __m512 acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh w[kVectors];
    for (int v = 0; v < kVectors; ++v) w[v] = (__m512bh)_mm512_loadu_si512(panel + (j * kPanelCols + 16 * v) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x32[r * ldx + j]));
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, w[v]);
    }
  }
  for (int v = 0; v < kVectors; ++v) {
    const int64_t valid = std::clamp<int64_t>(cols - 16 * v, 0, 16);
    if (valid == 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 y = bias ? _mm512_add_ps(acc[r][v], b) : acc[r][v];
      if constexpr (std::is_same_v<Out, float>) {
        _mm512_mask_storeu_ps(out + r * ldo + 16 * v, mask, y);
      } else {
        _mm256_mask_storeu_epi16(out + r * ldo + 16 * v, mask, (__m256i)_mm512_cvtneps_pbh(y));
      }
    }
  }
}

// The last m % kPassRows rows of a panel, in one pass of that many.
template <typename Out, int R = 1>
inline void tail(int64_t rows, const uint32_t* x32, int64_t ldx, const uint16_t* panel, int64_t pairs, int64_t cols,
                 const float* bias, Out* out, int64_t ldo) {
  if constexpr (R < kPassRows) {
    if (rows == R) return pass<R>(x32, ldx, panel, pairs, cols, bias, out, ldo);
    tail<Out, R + 1>(rows, x32, ldx, panel, pairs, cols, bias, out, ldo);
  }
}

template <typename Out>
void matmul(const uint32_t* x32, int64_t m, int64_t k, const uint16_t* panels, int64_t n, const float* bias,
            Out* out) {
  const int64_t pairs = k / 2, num_panels = (n + kPanelCols - 1) / kPanelCols;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* panel = panels + p * pairs * 2 * kPanelCols;
      const int64_t cols = std::min(kPanelCols, n - p * kPanelCols);
      const float* b = bias ? bias + p * kPanelCols : nullptr;
      Out* o = out + p * kPanelCols;
      int64_t r = 0;
      for (; r + kPassRows <= m; r += kPassRows)
        pass<kPassRows>(x32 + r * pairs, pairs, panel, pairs, cols, b, o + r * n, n);
      if (r < m) tail<Out>(m - r, x32 + r * pairs, pairs, panel, pairs, cols, b, o + r * n, n);
    }
  });
}

#endif  // __AVX512BF16__

}  // namespace

#if defined(__AVX512BF16__)
void bf16_panel_matmul(const uint16_t* x, int64_t m, int64_t k, const uint16_t* panels, int64_t n, const float* bias,
                       float* out) {
  matmul(reinterpret_cast<const uint32_t*>(x), m, k, panels, n, bias, out);
}

void bf16_panel_matmul(const uint16_t* x, int64_t m, int64_t k, const uint16_t* panels, int64_t n, const float* bias,
                       uint16_t* out) {
  matmul(reinterpret_cast<const uint32_t*>(x), m, k, panels, n, bias, out);
}
#endif

namespace {

bool bf16_panel_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [M, K] bf16 @ W^T, W [N, K] given as its panel [ceil(N/48), K/2, 48, 2] bf16, plus an optional fp32
// bias [N] -> [M, N] bf16 (out_bf16) or fp32.
torch::Tensor bf16_panel_linear(torch::Tensor x, torch::Tensor panel, int64_t n, std::optional<torch::Tensor> bias,
                                bool out_bf16) {
  TORCH_CHECK(bf16_panel_available(), "AVX-512 BF16 is not available on this CPU or build");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous bfloat16 [M, K] tensor");
  TORCH_CHECK(panel.dim() == 4 && panel.scalar_type() == torch::kBFloat16 && panel.is_contiguous() &&
                  panel.size(2) == kPanelCols && panel.size(3) == 2,
              "panel must be a contiguous bfloat16 [N/48, K/2, 48, 2] tensor");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(n > 0 && (n + kPanelCols - 1) / kPanelCols == panel.size(0), "the panel holds ",
              panel.size(0) * kPanelCols, " columns, not ", n, " rounded up to 48");
  TORCH_CHECK(panel.size(1) * 2 == k, "x has ", k, " columns, the panel ", panel.size(1) * 2);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n,
                "bias must be a contiguous float32 [N] tensor");
    b = bias->data_ptr<float>();
  }
  auto out = torch::empty({m, n}, x.options().dtype(out_bf16 ? torch::kBFloat16 : torch::kFloat32));
#if defined(__AVX512BF16__)
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(panel.data_ptr<at::BFloat16>());
  if (out_bf16) {
    matmul(x32, m, k, pp, n, b, out.data_ptr<at::BFloat16>());
  } else {
    matmul(x32, m, k, pp, n, b, out.data_ptr<float>());
  }
#endif
  return out;
}

}  // namespace
}  // namespace sluice

void register_bf16_panel(pybind11::module& m) {
  using namespace sluice;
  m.def("bf16_panel_available", &bf16_panel_available, "whether bf16_panel_linear runs on this CPU and build");
  m.def("bf16_panel_linear", &bf16_panel_linear,
        "x [M, K] bf16 @ W^T, W [N, K] as its panel [ceil(N/48), K/2, 48, 2] bf16, + optional fp32 bias -> [M, N] "
        "bf16 or fp32",
        pybind11::arg("x"), pybind11::arg("panel"), pybind11::arg("n"), pybind11::arg("bias"),
        pybind11::arg("out_bf16"));
}
