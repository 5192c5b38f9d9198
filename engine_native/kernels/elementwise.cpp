// The row-wise steps between a layer's GEMMs, for the layer-by-layer path (steps the fused decoder
// does not take: prefills and batches past `quantized_max_rows`). PyTorch runs each as several ops
// with a temporary apiece (RMSNorm alone is pow, mean, add, rsqrt, mul, mul); at 32 tokens a step
// their dispatch and memory traffic cost about as much as the decode attention. Here each is one
// pass over its rows, split over ATen's threads by row. Computed in fp32; same formulas as the
// PyTorch path, sums in another order.
//
// Where the dense GEMMs run in bf16, their outputs are read here as they come (bf16, widened exactly)
// and the outputs that feed the next GEMM are written in bf16 (`out_bf16`, rounded to nearest even as
// `.to(torch.bfloat16)` rounds): the same values as casting around each call, without the casts,
// which were a tenth of a 32-token step.
//
//     rms_norm(x [T, n], w [n], eps, out_bf16)         -> x / sqrt(mean(x^2) + eps) * w
//     add_rms_norm(x [T, n], delta, w, eps, out_bf16)  x += delta in place (delta fp32 or bf16); -> rms_norm(x)
//     rope_write_kv(qkv [T, (H + 2 Hkv) D] fp32 or bf16, cos/sin [T, D] (each token's row), k/v_cache, slots [T], H, Hkv)
//                                                      -> q [T, H, D] fp32, rotated; rotated k and v written at their slots
//     silu_mul(gate_up [T, 2 I] fp32 or bf16, out_bf16) -> silu(gate) * up [T, I]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

#include "rowops.h"

namespace sluice {
namespace {

constexpr int64_t kRowGrain = 16;  // rows per task: a row is ~1 us of work, a task switch a few

void check_rows(const torch::Tensor& t, const char* name, bool bf16_ok) {
  const auto type = t.scalar_type();
  TORCH_CHECK(t.dim() == 2 && (type == torch::kFloat32 || (bf16_ok && type == torch::kBFloat16)) &&
                  t.is_contiguous() && t.size(1) % 8 == 0,
              name, bf16_ok ? ": contiguous fp32 or bf16 [T, n], n a multiple of 8"
                            : ": contiguous fp32 [T, n], n a multiple of 8");
}

void check_norm_weight(const torch::Tensor& w, int64_t n) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == n && w.scalar_type() == torch::kFloat32 && w.is_contiguous(), "w: fp32 [n]");
}

torch::Tensor empty_rows(int64_t t, int64_t n, const torch::Tensor& like, bool bf16) {
  return torch::empty({t, n}, like.options().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
}

uint16_t* bf16_data(const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// Each row's result is computed in fp32: straight into an fp32 output, or into `row` and then rounded
// into a bf16 one.
template <typename Out, typename F>
void rows_to(torch::Tensor& out, int64_t t, int64_t n, F&& compute) {
  Out* os = reinterpret_cast<Out*>(out.data_ptr());
  at::parallel_for(0, t, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> row, scratch;
    if constexpr (!std::is_same_v<Out, float>) row.resize(static_cast<size_t>(n));
    for (int64_t r = begin; r < end; ++r) {
      if constexpr (std::is_same_v<Out, float>) {
        compute(r, os + r * n, scratch);
      } else {
        compute(r, row.data(), scratch);
        store_row(os + r * n, row.data(), n);
      }
    }
  });
}

template <typename F>
torch::Tensor rows(int64_t t, int64_t n, const torch::Tensor& like, bool out_bf16, F&& compute) {
  auto out = empty_rows(t, n, like, out_bf16);
  if (out_bf16) {
    rows_to<uint16_t>(out, t, n, compute);
  } else {
    rows_to<float>(out, t, n, compute);
  }
  return out;
}

// Row r of a [T, n] fp32 or bf16 tensor as fp32: a pointer into it (fp32) or into `scratch` (bf16, widened).
const float* row_f32(const torch::Tensor& t, int64_t r, std::vector<float>& scratch) {
  const int64_t n = t.size(1);
  if (t.scalar_type() == torch::kFloat32) return t.data_ptr<float>() + r * n;
  scratch.resize(static_cast<size_t>(n));
  load_row(scratch.data(), bf16_data(t) + r * n, n);
  return scratch.data();
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, bool out_bf16) {
  check_rows(x, "x", false);
  const int64_t n = x.size(1);
  check_norm_weight(w, n);
  const float *xs = x.data_ptr<float>(), *ws = w.data_ptr<float>();
  return rows(x.size(0), n, x, out_bf16, [&](int64_t r, float* out, std::vector<float>&) {
    rmsnorm(xs + r * n, ws, n, static_cast<float>(eps), out);
  });
}

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps, bool out_bf16) {
  check_rows(x, "x", false);
  check_rows(delta, "delta", true);
  TORCH_CHECK(delta.sizes() == x.sizes(), "delta must have x's shape");
  const int64_t n = x.size(1);
  check_norm_weight(w, n);
  float* xs = x.data_ptr<float>();
  const float* ws = w.data_ptr<float>();
  return rows(x.size(0), n, x, out_bf16, [&](int64_t r, float* out, std::vector<float>& scratch) {
    add_inplace(xs + r * n, row_f32(delta, r, scratch), n);
    rmsnorm(xs + r * n, ws, n, static_cast<float>(eps), out);
  });
}

template <typename KV>
void write_rows(const torch::Tensor& qkv, torch::Tensor& q, KV* kc, KV* vc, const torch::Tensor& cos,
                const torch::Tensor& sin, const int64_t* ss, int64_t heads, int64_t kv_heads, int64_t d) {
  const int64_t row = kv_heads * d;
  float* qs = q.data_ptr<float>();
  const float *cs = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
  at::parallel_for(0, qkv.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> k(static_cast<size_t>(row)), scratch;
    for (int64_t i = begin; i < end; ++i) {
      const float* in = row_f32(qkv, i, scratch);
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
  check_rows(qkv, "qkv", true);
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
  auto q = torch::empty({t, heads, d}, qkv.options().dtype(torch::kFloat32));
  if (bf16) {
    write_rows(qkv, q, bf16_data(k_cache), bf16_data(v_cache), cos, sin, ss, heads, kv_heads, d);
  } else {
    write_rows(qkv, q, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), cos, sin, ss, heads, kv_heads, d);
  }
  return q;
}

torch::Tensor silu_mul_rows(torch::Tensor gate_up, bool out_bf16) {
  check_rows(gate_up, "gate_up", true);
  const int64_t inter = gate_up.size(1) / 2;
  TORCH_CHECK(inter % 8 == 0, "intermediate size must be a multiple of 8");
  return rows(gate_up.size(0), inter, gate_up, out_bf16, [&](int64_t r, float* out, std::vector<float>& scratch) {
    const float* gu = row_f32(gate_up, r, scratch);
    silu_mul(gu, gu + inter, inter, out);
  });
}

}  // namespace
}  // namespace sluice

void register_elementwise(pybind11::module& m) {
  namespace py = pybind11;
  m.def("rms_norm", &sluice::rms_norm, "x [T, n] fp32 -> RMSNorm(x) * w", py::arg("x"), py::arg("w"), py::arg("eps"),
        py::arg("out_bf16") = false);
  m.def("add_rms_norm", &sluice::add_rms_norm, "x += delta in place; -> RMSNorm(x) * w", py::arg("x"),
        py::arg("delta"), py::arg("w"), py::arg("eps"), py::arg("out_bf16") = false);
  m.def("rope_write_kv", &sluice::rope_write_kv, "rotate q and k of a step, write k and v to the cache; -> q");
  m.def("silu_mul", &sluice::silu_mul_rows, "gate_up [T, 2I] -> silu(gate) * up [T, I]", py::arg("gate_up"),
        py::arg("out_bf16") = false);
}
