// Attention of decode tokens (one query per sequence) straight over the paged KV cache.
//
// The PyTorch path gathers each sequence's blocks into a padded [B, L, Hkv, D] copy for every layer
// (reading and writing the whole context once more than needed) and then multiplies. Here each
// (sequence, KV head) pair walks its block table in place: scores of the g = H / Hkv query heads that
// share the KV head against every cached key, a softmax, then the weighted sum of the values. K and V
// are read once, fp32 throughout.
//
//     q            [B, H, D] float32          one query token per sequence
//     k/v_cache    [num_blocks, block_size, Hkv, D] float32
//     block_tables [B, max_blocks] int64      block ids of each sequence, in token order
//     context_lens [B] int64                  tokens of each sequence in the cache (its query included)
//     -> out       [B, H, D] float32
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "simd.h"

namespace sluice {
namespace {

// s[0..len) <- softmax(s[0..len)) in place.
void softmax(float* s, int64_t len) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < len; ++t) mx = std::max(mx, s[t]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx));
    _mm256_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum(vsum);
  for (; t < len; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < len; ++i) s[i] *= inv;
}

}  // namespace

void paged_decode(const float* q, int64_t b, int64_t h, int64_t d, const float* k_cache, const float* v_cache,
                  int64_t num_blocks, int64_t block_size, int64_t hkv, const int64_t* tables, int64_t max_blocks,
                  const int64_t* lens, float scale, float* out) {
  const int64_t g = h / hkv, token_stride = hkv * d, block_stride = block_size * hkv * d;
  at::parallel_for(0, b * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t seq = job / hkv, kvh = job % hkv, len = lens[seq];
      const int64_t* table = tables + seq * max_blocks;
      scores.assign(static_cast<size_t>(g * len), 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const float* key = k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + kvh * d;
        for (int64_t j = 0; j < g; ++j) scores[j * len + t] = dot(q + (seq * h + kvh * g + j) * d, key, d) * scale;
      }
      for (int64_t j = 0; j < g; ++j) softmax(scores.data() + j * len, len);
      float* o = out + (seq * h + kvh * g) * d;
      std::fill(o, o + g * d, 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const float* value = v_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + kvh * d;
        for (int64_t j = 0; j < g; ++j) axpy(scores[j * len + t], value, o + j * d, d);
      }
    }
  });
}

namespace {

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: contiguous fp32 [B, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == torch::kFloat32 && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.is_contiguous(),
              "k/v_cache: contiguous fp32 [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous(),
              "block_tables: contiguous int64 [B, max_blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == torch::kInt64 && context_lens.is_contiguous(),
              "context_lens: contiguous int64 [B]");
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && d % 8 == 0, "head_dim must match and be a multiple of 8");
  TORCH_CHECK(h % hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.size(0) == b && context_lens.size(0) == b, "one table and length per sequence");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_blocks * bs, "context length out of its block table");
    for (int64_t j = 0; j < (lens[i] + bs - 1) / bs; ++j)
      TORCH_CHECK(tables[i * max_blocks + j] >= 0 && tables[i * max_blocks + j] < num_blocks, "block id out of the pool");
  }
  auto out = torch::empty_like(q);
  paged_decode(q.data_ptr<float>(), b, h, d, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), num_blocks, bs,
               hkv, tables, max_blocks, lens, static_cast<float>(scale), out.data_ptr<float>());
  return out;
}

}  // namespace
}  // namespace sluice

void register_paged_attention(pybind11::module& m) {
  m.def("paged_decode_attention", &sluice::paged_decode_attention,
        "q [B, H, D] over the paged fp32 KV cache -> [B, H, D]");
}
