// The layers of a pure-decode step in one call, where one kernel takes all its GEMMs with bf16 in and out:
// the bf16 panels (steps of more than `quantized_max_rows` sequences on a CPU with AVX-512 BF16 and no AMX) or
// the AMX Q4_1 kernel (such steps of up to `amx_max_rows` on a CPU with AMX); model/llama.py
// `_layer_decoder_for`.
//
// The layer-by-layer path (DecoderLayer.forward with the row-wise kernels) makes ten calls from Python a
// layer, each with its argument checks, tensor allocations and dispatch around a few microseconds of work:
// at 32 sequences about a tenth of a step on a 2-core EPYC. Here the same kernels run in the same order on
// the same values: the norms, the rotation and cache writes and the SiLU of elementwise.cpp (rowops.h, rows
// split over ATen's threads as there), the GEMMs of bf16_panel.cpp or amx_linear.cpp, the attention of
// paged_attention.cpp, and the same bf16 roundings between them. Every output bit is the layer path's
// (tests/engine/test_panel_decode.py). The final norm and the LM head stay with the caller, as there.
//
//     per layer:  h = bf16(rmsnorm(x) * w_in);  qkv = bf16(h @ Wqkv^T + b);  rotate q, k;  write k, v;
//                 a = attention(q);  o = bf16(bf16(a) @ Wo^T);  x += o;  h = bf16(rmsnorm(x) * w_post);
//                 gu = bf16(h @ Wgu^T);  act = bf16(silu(g) * u);  x += bf16(act @ Wdown^T)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "decode_step.h"
#include "rowops.h"

namespace sluice {
namespace {

constexpr int64_t kRowGrain = 16;  // rows per task, as elementwise.cpp splits them

// compute(r, row) for each row r < m, row: an fp32 scratch row of `width` floats; rows split as elementwise.cpp's.
template <typename F>
void each_row(int64_t m, int64_t width, const F& compute) {
  at::parallel_for(0, m, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(width));
    for (int64_t r = begin; r < end; ++r) compute(r, row.data());
  });
}

uint16_t* bits(const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

}  // namespace

class DecodeLayers {
 public:
  // amx false: weights holds 4 panels per layer (qkv, o, gate_up, down), each [ceil(N/48), K/2, 48, 2] bf16
  // (model/bf16_panel.py); amx true: 8 per layer, each matrix's Q4_1 blocks qs [N, K/32, 16] uint8 and dm
  // [N, K/32, 2] fp32 (model/quant.py; N % 32 == 0, no qkv bias: the AMX kernel adds none).
  // qkv_bias: none or one fp32 [qkv_n] per layer; norms: input and post per layer, fp32.
  DecodeLayers(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
               bool amx, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> qkv_bias,
               std::vector<torch::Tensor> norms, std::vector<torch::Tensor> k_cache, std::vector<torch::Tensor> v_cache,
               torch::Tensor cos, torch::Tensor sin)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), d_(head_dim), inter_(intermediate),
        eps_(static_cast<float>(eps)), amx_(amx), weights_(std::move(weights)), bias_(std::move(qkv_bias)),
        norms_(std::move(norms)), k_cache_(std::move(k_cache)), v_cache_(std::move(v_cache)), cos_(std::move(cos)),
        sin_(std::move(sin)) {
#if !defined(__AVX512BF16__)
    TORCH_CHECK(false, "the layer decoder needs a build for AVX-512 BF16");
#endif
    layers_ = static_cast<int64_t>(k_cache_.size());
    TORCH_CHECK(hidden % 8 == 0 && head_dim % 16 == 0 && intermediate % 8 == 0, "sizes must be multiples of 8 (head_dim 16)");
    TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
    const int64_t per_layer = amx ? 8 : 4;
    TORCH_CHECK(static_cast<int64_t>(weights_.size()) == per_layer * layers_ &&
                    static_cast<int64_t>(norms_.size()) == 2 * layers_ && v_cache_.size() == k_cache_.size(),
                "expected ", amx ? "4 matrices' blocks (qs, dm)" : "4 panels", ", 2 norms and a K and V cache per layer");
    TORCH_CHECK(bias_.empty() || static_cast<int64_t>(bias_.size()) == layers_, "none or one qkv bias per layer");
    TORCH_CHECK(!amx || amx_permitted(), "AMX-BF16 is not available on this CPU or build");
    TORCH_CHECK(!(amx && !bias_.empty()), "the AMX kernel adds no qkv bias");
    const int64_t q_size = heads * head_dim, qkv_n = q_size + 2 * kv_heads * head_dim;
    const int64_t shapes[4][2] = {{qkv_n, hidden}, {hidden, q_size}, {2 * intermediate, hidden}, {hidden, intermediate}};
    for (int64_t l = 0; l < layers_; ++l) {
      for (int64_t i = 0; i < 4; ++i) {
        if (amx) {
          const torch::Tensor &qs = weights_[8 * l + 2 * i], &dm = weights_[8 * l + 2 * i + 1];
          check_q4_1_blocks(qs, dm);
          TORCH_CHECK(qs.size(0) == shapes[i][0] && qs.size(1) * 32 == shapes[i][1] && shapes[i][0] % 32 == 0,
                      "blocks ", i, " of layer ", l, " do not hold a [", shapes[i][0], ", ", shapes[i][1],
                      "] weight with a multiple of 32 rows");
          continue;
        }
        const torch::Tensor& p = weights_[4 * l + i];
        TORCH_CHECK(p.dim() == 4 && p.scalar_type() == torch::kBFloat16 && p.is_contiguous() && p.size(2) == 48 &&
                        p.size(3) == 2 && p.size(0) == (shapes[i][0] + 47) / 48 && p.size(1) * 2 == shapes[i][1],
                    "panel ", i, " of layer ", l, " does not hold a [", shapes[i][0], ", ", shapes[i][1], "] weight");
      }
      for (int64_t i = 0; i < 2; ++i)
        TORCH_CHECK(norms_[2 * l + i].dim() == 1 && norms_[2 * l + i].numel() == hidden &&
                        norms_[2 * l + i].scalar_type() == torch::kFloat32 && norms_[2 * l + i].is_contiguous(),
                    "norms must be contiguous fp32 [hidden]");
      if (!bias_.empty())
        TORCH_CHECK(bias_[l].numel() == qkv_n && bias_[l].scalar_type() == torch::kFloat32 && bias_[l].is_contiguous(),
                    "qkv bias must be contiguous fp32 [qkv]");
      const auto& k = k_cache_[l];
      TORCH_CHECK((k.scalar_type() == torch::kBFloat16 || k.scalar_type() == torch::kFloat32) &&
                      k.scalar_type() == k_cache_[0].scalar_type() && k.is_contiguous() && k.dim() == 4 &&
                      k.size(2) == kv_heads && k.size(3) == head_dim && v_cache_[l].sizes() == k.sizes() &&
                      v_cache_[l].scalar_type() == k.scalar_type() && v_cache_[l].is_contiguous(),
                  "KV caches must be contiguous fp32 or bf16 [blocks, block_size, kv_heads, head_dim]");
    }
    TORCH_CHECK(cos_.scalar_type() == torch::kFloat32 && sin_.scalar_type() == torch::kFloat32 && cos_.is_contiguous() &&
                    sin_.is_contiguous() && cos_.dim() == 2 && cos_.size(1) == head_dim && sin_.sizes() == cos_.sizes(),
                "rotary tables must be contiguous fp32 [positions, head_dim]");
  }

  // x [M, hidden] fp32, the token embeddings, updated in place to the last layer's residual stream and
  // returned; positions, slots, context_lens [M] int64; block_tables [M, max_blocks] int64.
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor block_tables,
                        torch::Tensor context_lens) {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
                "x: contiguous fp32 [M, hidden]");
    const int64_t m = x.size(0);
    const DecodeStep step = check_decode_step(m, positions, slots, block_tables, context_lens, cos_.size(0),
                                              k_cache_[0].size(0), k_cache_[0].size(1));
#if defined(__AVX512BF16__)
    if (k_cache_[0].scalar_type() == torch::kBFloat16) {
      layers<uint16_t>(x.data_ptr<float>(), m, step);
    } else {
      layers<float>(x.data_ptr<float>(), m, step);
    }
#endif
    return x;
  }

 private:
#if defined(__AVX512BF16__)
  template <typename KV>
  void layers(float* xr, int64_t m, const DecodeStep& step) {
    const int64_t *pos = step.pos, *slot = step.slot, *lens = step.lens, *tables = step.tables;
    const int64_t max_blocks = step.max_blocks;
    const int64_t n = hidden_, kv_size = kv_heads_ * d_, q_size = heads_ * d_, qkv_n = q_size + 2 * kv_size;
    const int64_t bs = k_cache_[0].size(1);
    std::vector<uint16_t> h(m * n), qkv(m * qkv_n), a16(m * q_size), o(m * n), gu(m * 2 * inter_), act(m * inter_);
    std::vector<float> q(m * q_size), a(m * q_size);
    // As the layer path passes it: Python's d ** -0.5, a double, to the kernel's float.
    const float scale = static_cast<float>(std::pow(static_cast<double>(d_), -0.5));
    const float* cs = cos_.data_ptr<float>();
    const float* sn = sin_.data_ptr<float>();
    for (int64_t l = 0; l < layers_; ++l) {
      KV* kc = reinterpret_cast<KV*>(k_cache_[l].data_ptr());
      KV* vc = reinterpret_cast<KV*>(v_cache_[l].data_ptr());
      const float* w_in = norms_[2 * l].data_ptr<float>();
      const float* w_post = norms_[2 * l + 1].data_ptr<float>();
      const float* bias = bias_.empty() ? nullptr : bias_[l].data_ptr<float>();
      // out [m, n] = x [m, k] @ W_i^T (+ bias) in bf16, through the kernel the layer path takes for this step.
      const auto matmul = [&](int64_t i, const uint16_t* x, int64_t k, int64_t n, const float* b, uint16_t* out) {
        if (amx_) {
          amx_q4_1_matmul_bf16(x, m, k, weights_[8 * l + 2 * i].data_ptr<uint8_t>(),
                               weights_[8 * l + 2 * i + 1].data_ptr<float>(), n, out);
        } else {
          bf16_panel_matmul(x, m, k, bits(weights_[4 * l + i]), n, b, out);
        }
      };
      each_row(m, n, [&](int64_t r, float* row) {  // rms_norm(out_bf16)
        rmsnorm(xr + r * n, w_in, n, eps_, row);
        store_row(h.data() + r * n, row, n);
      });
      matmul(0, h.data(), n, qkv_n, bias, qkv.data());
      each_row(m, qkv_n, [&](int64_t r, float* in) {  // rope_write_kv
        load_row(in, qkv.data() + r * qkv_n, qkv_n);
        const float *c = cs + pos[r] * d_, *s = sn + pos[r] * d_;
        float* qrow = q.data() + r * q_size;
        std::copy(in, in + q_size, qrow);
        rotate(qrow, heads_, d_, c, s);
        rotate(in + q_size, kv_heads_, d_, c, s);
        store_row(kc + slot[r] * kv_size, in + q_size, kv_size);
        store_row(vc + slot[r] * kv_size, in + q_size + kv_size, kv_size);
      });
      if constexpr (std::is_same_v<KV, uint16_t>) {
        paged_decode_bf16(q.data(), m, heads_, d_, kc, vc, bs, kv_heads_, tables, max_blocks, lens, scale, a.data());
      } else {
        paged_decode(q.data(), m, heads_, d_, kc, vc, k_cache_[l].size(0), bs, kv_heads_, tables, max_blocks, lens,
                     scale, a.data());
      }
      each_row(m, 0, [&](int64_t r, float*) { store_row(a16.data() + r * q_size, a.data() + r * q_size, q_size); });
      matmul(1, a16.data(), q_size, n, nullptr, o.data());
      each_row(m, 2 * n, [&](int64_t r, float* row) {  // add_rms_norm(out_bf16)
        load_row(row + n, o.data() + r * n, n);
        add_inplace(xr + r * n, row + n, n);
        rmsnorm(xr + r * n, w_post, n, eps_, row);
        store_row(h.data() + r * n, row, n);
      });
      matmul(2, h.data(), n, 2 * inter_, nullptr, gu.data());
      each_row(m, 3 * inter_, [&](int64_t r, float* row) {  // silu_mul(out_bf16)
        load_row(row, gu.data() + r * 2 * inter_, 2 * inter_);
        silu_mul(row, row + inter_, inter_, row + 2 * inter_);
        store_row(act.data() + r * inter_, row + 2 * inter_, inter_);
      });
      matmul(3, act.data(), inter_, n, nullptr, o.data());
      each_row(m, n, [&](int64_t r, float* row) {  // x += the down projection, widened exactly
        load_row(row, o.data() + r * n, n);
        add_inplace(xr + r * n, row, n);
      });
    }
  }
#endif

  int64_t hidden_, heads_, kv_heads_, d_, inter_, layers_ = 0;
  float eps_;
  bool amx_;
  std::vector<torch::Tensor> weights_, bias_, norms_, k_cache_, v_cache_;
  torch::Tensor cos_, sin_;
};

}  // namespace sluice

void register_panel_decode(pybind11::module& m) {
  pybind11::class_<sluice::DecodeLayers>(m, "DecodeLayers")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, bool, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, torch::Tensor, torch::Tensor>())
      .def("forward", &sluice::DecodeLayers::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
