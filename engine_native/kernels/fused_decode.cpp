// A whole decode step of a Llama-family model in one call: for steps where every sequence computes one
// token (pure decode) and the weights are in GGUF blocks. The PyTorch path issues ~40 ATen operations per
// layer (norms, rotary, cache writes, attention, activations, residual adds), each with microseconds of
// Python and dispatch around it; for one or a few tokens that overhead is as large as the arithmetic.
// Here the step runs layer after layer in C++ over the same data the PyTorch path uses (the model's
// quantized blocks, fp32 norms, the rotary table, the paged fp32 KV cache) with the same math:
//
//     per layer:  h = rmsnorm(x) * w_in;  qkv = h @ Wqkv^T (+ bias);  rotate q, k (rotate-half layout);
//                 write k, v at the step's slots;  a = paged attention of q over the cache;
//                 x += a @ Wo^T;  h = rmsnorm(x) * w_post;  [g, u] = h @ Wgu^T;  x += (silu(g) * u) @ Wdown^T
//     then:       logits = (rmsnorm(x) * w_final) @ Wlm^T
//
// Results equal the PyTorch path's up to the order of floating-point additions. In steps of at most
// `int8_max_rows` sequences (opt-in, EngineConfig.int8_activation_max_rows) every product rounds its input rows
// to int8 blocks first, else in steps of at most `int16_max_rows` (EngineConfig.int16_activation_max_rows) to
// int16 blocks (quant_rounded.cpp), as the PyTorch path's block products then do.
#include <torch/extension.h>

#include <cmath>
#include <vector>

#include "decode_step.h"
#include "rowops.h"
#include "simd.h"

namespace sluice {
namespace {

struct Matrix {
  QuantFormat format;
  torch::Tensor qs, scales;  // kept alive here; the model owns the same storage
  int64_t n = 0, k = 0;

  void apply(const float* x, int64_t m, float* out, Activations activations) const {
    quant_matmul(activations, format, x, m, k, qs.data_ptr(), scales.data_ptr<float>(), n, out);
  }
};

Matrix matrix(int64_t format, const torch::Tensor& qs, const torch::Tensor& scales) {
  TORCH_CHECK(format == 0 || format == 1, "unknown quantized format ", format);
  TORCH_CHECK(qs.dim() == 3 && qs.is_contiguous() && scales.is_contiguous() &&
                  scales.scalar_type() == torch::kFloat32,
              "quantized blocks must be contiguous [N, K/32, bytes] with fp32 scales");
  TORCH_CHECK(qs.size(2) == (format == 0 ? 16 : 32), "block bytes do not match the format");
  return Matrix{static_cast<QuantFormat>(format), qs, scales, qs.size(0), qs.size(1) * 32};
}

}  // namespace

class FusedDecoder {
 public:
  FusedDecoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
               std::vector<int64_t> formats, std::vector<torch::Tensor> qs, std::vector<torch::Tensor> scales,
               std::vector<torch::Tensor> qkv_bias, std::vector<torch::Tensor> norms, torch::Tensor final_norm,
               std::vector<torch::Tensor> k_cache, std::vector<torch::Tensor> v_cache, torch::Tensor cos,
               torch::Tensor sin, int64_t int16_max_rows, int64_t int8_max_rows)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), d_(head_dim), inter_(intermediate),
        eps_(static_cast<float>(eps)), int16_max_rows_(int16_max_rows), int8_max_rows_(int8_max_rows),
        final_norm_(final_norm), k_cache_(k_cache),
        v_cache_(v_cache), cos_(cos), sin_(sin) {
    layers_ = static_cast<int64_t>(k_cache.size());
    TORCH_CHECK(hidden % 8 == 0 && head_dim % 16 == 0 && intermediate % 8 == 0, "sizes must be multiples of 8");
    TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
    // Per layer four matrices (qkv, o, gate_up, down), then the lm head; norms: input and post per layer.
    TORCH_CHECK(formats.size() == qs.size() && qs.size() == scales.size() &&
                    static_cast<int64_t>(qs.size()) == 4 * layers_ + 1,
                "expected 4 matrices per layer and an lm head");
    TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers_ && v_cache.size() == k_cache.size(),
                "expected two norms and a K and V cache per layer");
    TORCH_CHECK(qkv_bias.empty() || static_cast<int64_t>(qkv_bias.size()) == layers_, "one qkv bias per layer");
    for (size_t i = 0; i < qs.size(); ++i) mats_.push_back(matrix(formats[i], qs[i], scales[i]));
    const int64_t qkv_n = (heads + 2 * kv_heads) * head_dim;
    for (int64_t l = 0; l < layers_; ++l) {
      TORCH_CHECK(mats_[4 * l].n == qkv_n && mats_[4 * l].k == hidden, "qkv shape");
      TORCH_CHECK(mats_[4 * l + 1].n == hidden && mats_[4 * l + 1].k == heads * head_dim, "o shape");
      TORCH_CHECK(mats_[4 * l + 2].n == 2 * intermediate && mats_[4 * l + 2].k == hidden, "gate_up shape");
      TORCH_CHECK(mats_[4 * l + 3].n == hidden && mats_[4 * l + 3].k == intermediate, "down shape");
      const bool dtype_ok = k_cache[l].scalar_type() == torch::kFloat32 || k_cache[l].scalar_type() == torch::kBFloat16;
      TORCH_CHECK(dtype_ok && k_cache[l].scalar_type() == k_cache[0].scalar_type() && k_cache[l].is_contiguous() &&
                      v_cache[l].scalar_type() == k_cache[l].scalar_type() && v_cache[l].is_contiguous() &&
                      k_cache[l].dim() == 4 && k_cache[l].size(2) == kv_heads && k_cache[l].size(3) == head_dim,
                  "KV caches must be contiguous fp32 or bf16 [blocks, block_size, kv_heads, head_dim]");
    }
    TORCH_CHECK(mats_.back().k == hidden, "lm head shape");
    for (auto& n : norms) norms_.push_back(n.contiguous().to(torch::kFloat32));
    for (auto& b : qkv_bias) bias_.push_back(b.contiguous().to(torch::kFloat32));
    TORCH_CHECK(cos_.scalar_type() == torch::kFloat32 && sin_.scalar_type() == torch::kFloat32 &&
                    cos_.is_contiguous() && sin_.is_contiguous() && cos_.size(1) == head_dim,
                "rotary tables must be contiguous fp32 [positions, head_dim]");
  }

  // x [M, hidden] fp32 (the token embeddings); positions, slots, context_lens [M] int64;
  // block_tables [M, max_blocks] int64 -> logits [M, vocab] fp32.
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor block_tables,
                        torch::Tensor context_lens) {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == torch::kFloat32, "x: fp32 [M, hidden]");
    const int64_t m = x.size(0);
    const int64_t num_blocks = k_cache_[0].size(0), bs = k_cache_[0].size(1);
    const DecodeStep step = check_decode_step(m, positions, slots, block_tables, context_lens, cos_.size(0), num_blocks, bs);
    const int64_t *pos = step.pos, *slot = step.slot, *lens = step.lens, *tables = step.tables;
    const int64_t max_blocks = step.max_blocks;
    const int64_t kv_size = kv_heads_ * d_, q_size = heads_ * d_, qkv_n = q_size + 2 * kv_size;

    torch::Tensor residual = x.contiguous().clone();
    float* xr = residual.data_ptr<float>();
    std::vector<float> h(m * hidden_), qkv(m * qkv_n), q(m * q_size), attn(m * q_size), delta(m * hidden_),
        gu(m * 2 * inter_), act(m * inter_);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d_));
    const bool bf16 = k_cache_[0].scalar_type() == torch::kBFloat16;
    const Activations rounding = m <= int8_max_rows_    ? Activations::INT8
                                 : m <= int16_max_rows_ ? Activations::INT16
                                                        : Activations::FP32;
    for (int64_t l = 0; l < layers_; ++l) {
      void* kc = k_cache_[l].data_ptr();
      void* vc = v_cache_[l].data_ptr();
      const float* w_in = norms_[2 * l].data_ptr<float>();
      const float* w_post = norms_[2 * l + 1].data_ptr<float>();
      for (int64_t i = 0; i < m; ++i) rmsnorm(xr + i * hidden_, w_in, hidden_, eps_, h.data() + i * hidden_);
      mats_[4 * l].apply(h.data(), m, qkv.data(), rounding);
      for (int64_t i = 0; i < m; ++i) {
        float* row = qkv.data() + i * qkv_n;
        if (!bias_.empty()) add_inplace(row, bias_[l].data_ptr<float>(), qkv_n);
        const float* c = cos_.data_ptr<float>() + pos[i] * d_;
        const float* s = sin_.data_ptr<float>() + pos[i] * d_;
        rotate(row, heads_, d_, c, s);                 // q
        rotate(row + q_size, kv_heads_, d_, c, s);     // k
        std::copy(row, row + q_size, q.data() + i * q_size);
        if (bf16) {
          store_row(static_cast<uint16_t*>(kc) + slot[i] * kv_size, row + q_size, kv_size);
          store_row(static_cast<uint16_t*>(vc) + slot[i] * kv_size, row + q_size + kv_size, kv_size);
        } else {
          store_row(static_cast<float*>(kc) + slot[i] * kv_size, row + q_size, kv_size);
          store_row(static_cast<float*>(vc) + slot[i] * kv_size, row + q_size + kv_size, kv_size);
        }
      }
      if (bf16) {
        paged_decode_bf16(q.data(), m, heads_, d_, static_cast<const uint16_t*>(kc), static_cast<const uint16_t*>(vc),
                          bs, kv_heads_, tables, max_blocks, lens, scale, attn.data());
      } else {
        paged_decode(q.data(), m, heads_, d_, static_cast<const float*>(kc), static_cast<const float*>(vc),
                     num_blocks, bs, kv_heads_, tables, max_blocks, lens, scale, attn.data());
      }
      mats_[4 * l + 1].apply(attn.data(), m, delta.data(), rounding);
      add_inplace(xr, delta.data(), m * hidden_);
      for (int64_t i = 0; i < m; ++i) rmsnorm(xr + i * hidden_, w_post, hidden_, eps_, h.data() + i * hidden_);
      mats_[4 * l + 2].apply(h.data(), m, gu.data(), rounding);
      for (int64_t i = 0; i < m; ++i)
        silu_mul(gu.data() + i * 2 * inter_, gu.data() + i * 2 * inter_ + inter_, inter_, act.data() + i * inter_);
      mats_[4 * l + 3].apply(act.data(), m, delta.data(), rounding);
      add_inplace(xr, delta.data(), m * hidden_);
    }
    for (int64_t i = 0; i < m; ++i)
      rmsnorm(xr + i * hidden_, final_norm_.data_ptr<float>(), hidden_, eps_, h.data() + i * hidden_);
    const Matrix& lm = mats_.back();
    auto logits = torch::empty({m, lm.n}, x.options());
    lm.apply(h.data(), m, logits.data_ptr<float>(), rounding);
    return logits;
  }

 private:
  int64_t hidden_, heads_, kv_heads_, d_, inter_, layers_ = 0;
  float eps_;
  // Steps of at most int8_max_rows_ rows round their activations to int8 blocks, else of at most int16_max_rows_
  // to int16 blocks.
  int64_t int16_max_rows_, int8_max_rows_;
  std::vector<Matrix> mats_;
  std::vector<torch::Tensor> norms_, bias_;
  torch::Tensor final_norm_;
  std::vector<torch::Tensor> k_cache_, v_cache_;
  torch::Tensor cos_, sin_;
};

}  // namespace sluice

void register_fused_decode(pybind11::module& m) {
  pybind11::class_<sluice::FusedDecoder>(m, "FusedDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, std::vector<int64_t>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, torch::Tensor, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, torch::Tensor, torch::Tensor, int64_t, int64_t>())
      .def("forward", &sluice::FusedDecoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
