// Attention of decode tokens (one query per sequence) straight over the paged KV cache.
//
// The Python path gathers each sequence's blocks into a padded [B, L, Hkv, D] copy for every layer
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
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// Dot product of two fp32 vectors of length d (a multiple of 8).
inline float dot(const float* a, const float* b, int64_t d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i < d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  return hsum8(_mm256_add_ps(acc0, acc1));
}

// e^x for 8 floats, x <= 0 (softmax after subtracting the max): x = n ln2 + r with |r| <= ln2 / 2,
// e^r by its degree-6 Taylor polynomial (relative error < 2e-7 there), times 2^n through the exponent
// bits. Inputs below -87 give 0, as e^x is then below the smallest normal float.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, with ln2 split in two so that n * ln2_hi is exact.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
  return _mm256_andnot_ps(underflow, result);
}

// s[0..len) <- softmax(s[0..len)) in place.
inline void softmax(float* s, int64_t len) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < len; ++t) mx = std::max(mx, s[t]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx));
    _mm256_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum8(vsum);
  for (; t < len; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < len; ++i) s[i] *= inv;
}

// out += p * v over length d (a multiple of 8).
inline void axpy(float p, const float* v, float* out, int64_t d) {
  const __m256 vp = _mm256_set1_ps(p);
  for (int64_t i = 0; i < d; i += 8)
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(vp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: contiguous fp32 [B, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == torch::kFloat32 && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.is_contiguous(),
              "k/v_cache: contiguous fp32 [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous(),
              "block_tables: contiguous int64 [B, max_blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == torch::kInt64, "context_lens: int64 [B]");
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && d % 8 == 0, "head_dim must match and be a multiple of 8");
  TORCH_CHECK(h % hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.size(0) == b && context_lens.size(0) == b, "one table and length per sequence");
  const int64_t g = h / hkv, max_blocks = block_tables.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_blocks * bs, "context length out of its block table");

  auto out = torch::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t token_stride = hkv * d, block_stride = bs * hkv * d;
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, b * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t seq = job / hkv, kvh = job % hkv, len = lens[seq];
      const int64_t* table = tables + seq * max_blocks;
      scores.assign(static_cast<size_t>(g * len), 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = table[t / bs];
        TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of the pool");
        const float* key = kp + block * block_stride + (t % bs) * token_stride + kvh * d;
        for (int64_t j = 0; j < g; ++j) scores[j * len + t] = dot(qp + (seq * h + kvh * g + j) * d, key, d) * fscale;
      }
      for (int64_t j = 0; j < g; ++j) softmax(scores.data() + j * len, len);
      for (int64_t t = 0; t < len; ++t) {
        const float* value = vp + table[t / bs] * block_stride + (t % bs) * token_stride + kvh * d;
        for (int64_t j = 0; j < g; ++j) axpy(scores[j * len + t], value, op + (seq * h + kvh * g + j) * d, d);
      }
    }
  });
  return out;
}

}  // namespace

void register_paged_attention(pybind11::module& m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "q [B, H, D] over the paged fp32 KV cache -> [B, H, D]");
}
