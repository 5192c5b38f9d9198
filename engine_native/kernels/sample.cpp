// Drawing one token per row from softmax(logits / temperature), for rows with no top-k, top-p or
// min-p cut. PyTorch needs a division, a softmax, a cumulative sum and a search over the whole
// vocabulary, each a pass with its own temporary; here each row is two vector passes over its logits
// (the max, then the exponentials' sums by blocks of 64) and a walk over the block sums that stops in
// the token's block.
//
//     sample_rows(logits [R, V] fp32, inv_temperature [R] fp32, uniforms [R] fp32 in [0, 1))
//         -> tokens [R] int64: the first token whose cumulative probability exceeds u x total,
//            or the most likely one where rounding puts u x total past the last
//     argmax_rows(logits [R, V] fp32) -> [R] int64: torch.argmax(logits, -1), the same indices (the first
//         maximum; a NaN counts as the maximum, the first NaN wins). PyTorch's reduction walks a 49k
//         vocabulary element by element: at 32 rows it took 3-4% of a decode step; this is two vector passes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.h"

namespace sluice {
namespace {

// A row's walk reads the exponentials of one block of kWalkBlock tokens: the pass before keeps only each
// block's sum, so a row costs two reads of its logits and no scratch row (a 49k vocabulary's exponentials
// were 192 KB a row written and read back, and a scalar walk over them: ~0.26 ms a row, 4.2 ms a 32-row
// step on the AMX host, 11% of its decode step).
constexpr int64_t kWalkBlock = 64;

// The largest of 8 lanes (a NaN lane is skipped, as std::max(mx, NaN) keeps mx); both the walk's max and
// argmax_row's.
inline float hmax(__m256 v) {
  float lanes[8];
  _mm256_storeu_ps(lanes, v);
  float mx = lanes[0];
  for (int k = 1; k < 8; ++k) mx = std::max(mx, lanes[k]);
  return mx;
}

#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
// e^(x * inv_t - mx * inv_t) of 16 logits: exp_ps's values lane by lane (exp16_ps), as the 8-lane build.
inline __m512 numerators(const float* x, __m512 vt, __m512 vmx) {
  return exp16_ps(_mm512_fmsub_ps(_mm512_loadu_ps(x), vt, vmx));
}
inline float row_max(const float* x, int64_t v) {  // v a multiple of kLanes; NaN lanes are skipped
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < v; i += kLanes) m = _mm512_max_ps(_mm512_loadu_ps(x + i), m);
  return _mm512_reduce_max_ps(m);
}
inline double block_sum(const float* x, __m512 vt, __m512 vmx) {
  __m512 s = numerators(x, vt, vmx);
  for (int64_t j = kLanes; j < kWalkBlock; j += kLanes) s = _mm512_add_ps(s, numerators(x + j, vt, vmx));
  return static_cast<double>(_mm512_reduce_add_ps(s));
}
inline void block_numerators(const float* x, __m512 vt, __m512 vmx, float* e) {
  for (int64_t j = 0; j < kWalkBlock; j += kLanes) _mm512_storeu_ps(e + j, numerators(x + j, vt, vmx));
}
using Vec = __m512;
inline Vec broadcast(float f) { return _mm512_set1_ps(f); }
#else
constexpr int64_t kLanes = 8;
inline __m256 numerators(const float* x, __m256 vt, __m256 vmx) {
  return exp_ps(_mm256_fmsub_ps(_mm256_loadu_ps(x), vt, vmx));
}
inline float row_max(const float* x, int64_t v) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < v; i += kLanes) m = _mm256_max_ps(_mm256_loadu_ps(x + i), m);
  return hmax(m);
}
inline double block_sum(const float* x, __m256 vt, __m256 vmx) {
  __m256 s = numerators(x, vt, vmx);
  for (int64_t j = kLanes; j < kWalkBlock; j += kLanes) s = _mm256_add_ps(s, numerators(x + j, vt, vmx));
  return static_cast<double>(hsum(s));
}
inline void block_numerators(const float* x, __m256 vt, __m256 vmx, float* e) {
  for (int64_t j = 0; j < kWalkBlock; j += kLanes) _mm256_storeu_ps(e + j, numerators(x + j, vt, vmx));
}
using Vec = __m256;
inline Vec broadcast(float f) { return _mm256_set1_ps(f); }
#endif

// The first index of the row's largest logit (NaNs skipped, as `>` skips them), 0 if none is above -inf.
int64_t first_max(const float* logits, int64_t v) {
  float mx = -INFINITY;
  int64_t best = 0;
  for (int64_t i = 0; i < v; ++i)
    if (logits[i] > mx) mx = logits[i], best = i;
  return best;
}

// The first token whose cumulative numerator exceeds u x total, numerators e^((l - max) / T). Blocks of
// kWalkBlock tokens are summed in fp32 and the walk adds the block sums, then the crossing block's
// numerators one by one, in double. The order of those additions decides a draw only where u x total
// falls within rounding of a boundary between two tokens.
int64_t sample_row(const float* logits, int64_t v, float inv_t, float u, std::vector<double>& sums) {
  // The row padded to whole blocks with -inf (numerator 0); a vocabulary of whole blocks is read in place.
  const int64_t blocks = (v + kWalkBlock - 1) / kWalkBlock, whole = v / kWalkBlock * kWalkBlock;
  alignas(64) float tail[kWalkBlock];
  if (whole < v) {
    std::fill(tail, tail + kWalkBlock, -INFINITY);
    std::copy(logits + whole, logits + v, tail);
  }
  const auto block_at = [&](int64_t b) { return b * kWalkBlock < whole ? logits + b * kWalkBlock : tail; };
  float mx = whole > 0 ? row_max(logits, whole) : -INFINITY;
  if (whole < v) mx = std::max(mx, row_max(tail, kWalkBlock));
  if (!std::isfinite(mx)) return first_max(logits, v);
  const Vec vmx = broadcast(mx * inv_t), vt = broadcast(inv_t);
  sums.resize(static_cast<size_t>(blocks));
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) total += sums[b] = block_sum(block_at(b), vt, vmx);
  const double target = static_cast<double>(u) * total;
  double cumulative = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (cumulative + sums[b] <= target) {
      cumulative += sums[b];
      continue;
    }
    alignas(64) float e[kWalkBlock];
    block_numerators(block_at(b), vt, vmx, e);
    int64_t last = -1;
    for (int64_t j = 0; j < kWalkBlock; ++j) {
      if (e[j] <= 0.0f) continue;
      cumulative += e[j];
      last = j;
      if (cumulative > target) return b * kWalkBlock + j;
    }
    if (last >= 0) return b * kWalkBlock + last;  // the block's own sum crossed; its tokens' sums fell short
  }
  return first_max(logits, v);
}

int64_t argmax_row(const float* x, int64_t v) {
  __m256 vmax = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    const __m256 y = _mm256_loadu_ps(x + i);
    vmax = _mm256_max_ps(vmax, y);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
  }
  float mx = hmax(vmax);
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
    std::vector<double> sums;
    for (int64_t i = begin; i < end; ++i) out[i] = sample_row(ls + i * v, v, ts[i], us[i], sums);
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
