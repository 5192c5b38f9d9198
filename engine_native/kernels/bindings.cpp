// The one Python module of Sluice's kernels; each source file registers its functions.
#include <torch/extension.h>

void register_quant_linear(pybind11::module& m);
void register_paged_attention(pybind11::module& m);
void register_fused_decode(pybind11::module& m);
void register_elementwise(pybind11::module& m);
void register_sample(pybind11::module& m);
void register_amx_linear(pybind11::module& m);
void register_prefill_attention(pybind11::module& m);
void register_quant_panel(pybind11::module& m);
void register_bf16_panel(pybind11::module& m);
void register_panel_decode(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_quant_linear(m);
  register_paged_attention(m);
  register_fused_decode(m);
  register_elementwise(m);
  register_sample(m);
  register_amx_linear(m);
  register_prefill_attention(m);
  register_quant_panel(m);
  register_bf16_panel(m);
  register_panel_decode(m);
}
