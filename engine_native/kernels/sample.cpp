// Drawing one token per row from softmax(logits / temperature), for rows with no top-k, top-p or
// min-p cut. PyTorch needs a division, a softmax, a cumulative sum and a search over the whole
// vocabulary, each a pass with its own temporary; here each row is two passes (max, then the
// exponentials into a scratch row and their total) and a walk that stops at the token.
//
//     sample_rows(logits [R, V] fp32, inv_temperature [R] fp32, uniforms [R] fp32 in [0, 1))
//         -> tokens [R] int64: the first token whose cumulative probability exceeds u x total,
//            or the most likely one where rounding puts u x total past the last
//     argmax_rows(logits [R, V] fp32) -> [R] int64: torch.argmax(logits, -1), the same indices (the first
//         maximum; a NaN counts as the maximum, the first NaN wins). PyTorch's reduction walks a 49k
//         vocabulary element by element: at 32 rows it took 3-4% of a decode step; this is two vector passes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "simd.h"

namespace sluice {
namespace {

int64_t sample_row(const float* logits, int64_t v, float inv_t, float u, std::vector<float>& e) {
  float mx = -INFINITY;
  int64_t best = 0;
  for (int64_t i = 0; i < v; ++i)
    if (logits[i] > mx) mx = logits[i], best = i;
  if (!std::isfinite(mx)) return best;
  e.resize(static_cast<size_t>(v));
  const __m256 vmx = _mm256_set1_ps(mx * inv_t), vt = _mm256_set1_ps(inv_t);
  double total = 0.0;
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    const __m256 x = exp_ps(_mm256_fmsub_ps(_mm256_loadu_ps(logits + i), vt, vmx));
    _mm256_storeu_ps(e.data() + i, x);
    total += hsum(x);
  }
  for (; i < v; ++i) total += e[i] = std::exp(logits[i] * inv_t - mx * inv_t);
  const double target = static_cast<double>(u) * total;
  double cumulative = 0.0;
  for (int64_t t = 0; t < v; ++t) {
    cumulative += e[t];
    if (cumulative > target) return t;
  }
  return best;
}

int64_t argmax_row(const float* x, int64_t v) {
  __m256 vmax = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    const __m256 y = _mm256_loadu_ps(x + i);
    vmax = _mm256_max_ps(vmax, y);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float mx = lanes[0];
  for (int k = 1; k < 8; ++k) mx = std::max(mx, lanes[k]);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < v; ++j) {
    if (std::isnan(x[j])) has_nan = true;
    mx = std::max(mx, x[j]);
  }
  if (has_nan) {
    for (int64_t j = 0; j < v; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m256 target = _mm256_set1_ps(mx);
  for (i = 0; i + 8 <= v; i += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
    if (hits != 0) return i + __builtin_ctz(static_cast<unsigned>(hits));
  }
  for (; i < v; ++i)
    if (x[i] == mx) return i;
  return 0;  // v == 0 is refused by the caller
}

torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() &&
                  logits.size(1) > 0,
              "logits: contiguous fp32 [R, V], V > 0");
  const int64_t r = logits.size(0), v = logits.size(1);
  const float* ls = logits.data_ptr<float>();
  auto tokens = torch::empty({r}, logits.options().dtype(torch::kInt64));
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, r, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = argmax_row(ls + i * v, v);
  });
  return tokens;
}

torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor inv_temperature, torch::Tensor uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "logits: contiguous fp32 [R, V]");
  const int64_t r = logits.size(0), v = logits.size(1);
  TORCH_CHECK(inv_temperature.numel() == r && uniforms.numel() == r &&
                  inv_temperature.scalar_type() == torch::kFloat32 && uniforms.scalar_type() == torch::kFloat32,
              "one fp32 inverse temperature and uniform per row");
  const auto it = inv_temperature.contiguous(), un = uniforms.contiguous();
  const float *ls = logits.data_ptr<float>(), *ts = it.data_ptr<float>(), *us = un.data_ptr<float>();
  auto tokens = torch::empty({r}, logits.options().dtype(torch::kInt64));
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, r, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e;
    for (int64_t i = begin; i < end; ++i) out[i] = sample_row(ls + i * v, v, ts[i], us[i], e);
  });
  return tokens;
}

}  // namespace
}  // namespace sluice

void register_sample(pybind11::module& m) {
  m.def("sample_rows", &sluice::sample_rows,
        "one token per row from softmax(logits * inv_temperature), by inverse CDF at the given uniforms");
  m.def("argmax_rows", &sluice::argmax_rows, "torch.argmax(logits, -1) of contiguous fp32 [R, V] logits");
}
