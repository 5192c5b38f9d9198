// The row-wise steps between a layer's GEMMs, for the layer-by-layer path (steps the fused decoder
// does not take: prefills and batches past `quantized_max_rows`). PyTorch runs each as several ops
// with a temporary apiece (RMSNorm alone is pow, mean, add, rsqrt, mul, mul); at 32 tokens a step
// their dispatch and memory traffic cost about as much as the decode attention. Here each is one
// pass over its rows, split over ATen's threads by row. All fp32; same formulas as the PyTorch path,
// sums in another order.
//
//     rms_norm(x [T, n], w [n], eps)              -> x / sqrt(mean(x^2) + eps) * w
//     add_rms_norm(x [T, n], delta, w, eps)       x += delta in place; -> rms_norm(x)
//     rope_write_kv(qkv [T, (H + 2 Hkv) D], cos/sin [T, D] (each token's row), k/v_cache, slots [T], H, Hkv)
//                                                 -> q [T, H, D] rotated; rotated k and v written at their slots
//     silu_mul(gate_up [T, 2 I])                  -> silu(gate) * up [T, I]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "rowops.h"

namespace sluice {
namespace {

constexpr int64_t kRowGrain = 16;  // rows per task: a row is ~1 us of work, a task switch a few

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.size(1) % 8 == 0, name,
              ": contiguous fp32 [T, n], n a multiple of 8");
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == torch::kFloat32 && w.is_contiguous(),
              "w: fp32 [n]");
  const int64_t n = x.size(1);
  auto out = torch::empty_like(x);
  const float *xs = x.data_ptr<float>(), *ws = w.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rmsnorm(xs + r * n, ws, n, static_cast<float>(eps), os + r * n);
  });
  return out;
}

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  TORCH_CHECK(delta.sizes() == x.sizes(), "delta must have x's shape");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == torch::kFloat32 && w.is_contiguous(),
              "w: fp32 [n]");
  const int64_t n = x.size(1);
  auto out = torch::empty_like(x);
  float* xs = x.data_ptr<float>();
  const float *ds = delta.data_ptr<float>(), *ws = w.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      add_inplace(xs + r * n, ds + r * n, n);
      rmsnorm(xs + r * n, ws, n, static_cast<float>(eps), os + r * n);
    }
  });
  return out;
}

template <typename KV>
void write_rows(const torch::Tensor& qkv, torch::Tensor& q, KV* kc, KV* vc, const torch::Tensor& cos,
                const torch::Tensor& sin, const int64_t* ss, int64_t heads, int64_t kv_heads, int64_t d) {
  const int64_t row = kv_heads * d, width = qkv.size(1);
  const float* src = qkv.data_ptr<float>();
  float* qs = q.data_ptr<float>();
  const float *cs = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
  at::parallel_for(0, qkv.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> k(static_cast<size_t>(row));
    for (int64_t i = begin; i < end; ++i) {
      const float* in = src + i * width;
      const float *c = cs + i * d, *s = sn + i * d;
      float* qrow = qs + i * heads * d;
      std::copy(in, in + heads * d, qrow);
      rotate(qrow, heads, d, c, s);
      std::copy(in + heads * d, in + heads * d + row, k.data());
      rotate(k.data(), kv_heads, d, c, s);
      store_row(kc + ss[i] * row, k.data(), row);
      store_row(vc + ss[i] * row, in + heads * d + row, row);
    }
  });
}

torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slots, int64_t heads, int64_t kv_heads) {
  check_rows(qkv, "qkv");
  const int64_t t = qkv.size(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == t && cos.sizes() == sin.sizes() &&
                  cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "cos/sin: contiguous fp32 [T, head_dim], each token's row of the rotary table");
  const int64_t d = cos.size(1);
  TORCH_CHECK(d % 16 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * d, "qkv: [T, (H + 2 Hkv) * head_dim]");
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(k_cache.dim() == 4 && (bf16 || k_cache.scalar_type() == torch::kFloat32) && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  v_cache.is_contiguous() && k_cache.size(2) == kv_heads && k_cache.size(3) == d,
              "k/v_cache: contiguous fp32 or bf16 [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == t && slots.scalar_type() == torch::kInt64, "slots: int64 [T]");
  const auto slot = slots.contiguous();
  const int64_t* ss = slot.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(ss[i] >= 0 && ss[i] < num_slots, "slot beyond the KV pool");
  auto q = torch::empty({t, heads, d}, qkv.options());
  if (bf16) {
    write_rows(qkv, q, reinterpret_cast<uint16_t*>(k_cache.data_ptr()), reinterpret_cast<uint16_t*>(v_cache.data_ptr()),
               cos, sin, ss, heads, kv_heads, d);
  } else {
    write_rows(qkv, q, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), cos, sin, ss, heads, kv_heads, d);
  }
  return q;
}

torch::Tensor silu_mul_rows(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t inter = gate_up.size(1) / 2;
  TORCH_CHECK(inter % 8 == 0, "intermediate size must be a multiple of 8");
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  const float* gs = gate_up.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, gate_up.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul(gs + r * 2 * inter, gs + r * 2 * inter + inter, inter, os + r * inter);
  });
  return out;
}

}  // namespace
}  // namespace sluice

void register_elementwise(pybind11::module& m) {
  m.def("rms_norm", &sluice::rms_norm, "x [T, n] fp32 -> RMSNorm(x) * w");
  m.def("add_rms_norm", &sluice::add_rms_norm, "x += delta in place; -> RMSNorm(x) * w");
  m.def("rope_write_kv", &sluice::rope_write_kv, "rotate q and k of a step, write k and v to the fp32 cache; -> q");
  m.def("silu_mul", &sluice::silu_mul_rows, "gate_up [T, 2I] -> silu(gate) * up [T, I]");
}
