// Drawing one token per row from softmax(logits / temperature), for rows with no top-k, top-p or
// min-p cut. PyTorch needs a division, a softmax, a cumulative sum and a search over the whole
// vocabulary, each a pass with its own temporary; here each row is two passes (max, then the
// exponentials into a scratch row and their total) and a walk that stops at the token.
//
//     sample_rows(logits [R, V] fp32, inv_temperature [R] fp32, uniforms [R] fp32 in [0, 1))
//         -> tokens [R] int64: the first token whose cumulative probability exceeds u x total,
//            or the most likely one where rounding puts u x total past the last
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
}
