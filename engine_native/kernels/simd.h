// Small AVX2 (and, where built with it, AVX-512) helpers shared by Sluice's kernels, and the raw-pointer
// entry points one kernel file offers another (the fused decode step calls the quantized matmuls and the
// paged attention directly).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace at {
class Tensor;
}

namespace sluice {

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// The constants of exp_ps and exp16_ps: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial (relative error < 2e-7 there), x clamped to [-87, 88].
namespace exp_consts {
constexpr float kLo = -87.0f, kHi = 88.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln2 split so that n * kLn2Hi is exact
constexpr float kPoly[7] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
}  // namespace exp_consts

// e^x for 8 floats, times 2^n through the exponent bits. Below -87 the result is 0 (e^x is under the
// smallest normal float); above 88 it saturates near FLT_MAX.
inline __m256 exp_ps(__m256 x) {
  using namespace exp_consts;
  const __m256 lo = _mm256_set1_ps(kLo);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(kHi));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kPoly[i]));
  // 2^n, split in two factors so that n = 128 (x near 88) does not overflow the exponent field.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 b = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(_mm256_mul_ps(p, a), b));
}

#ifdef __AVX512F__
// exp_ps on 16 floats, the same values lane by lane (its last step scales by 2^n in one exact operation:
// p * 2^a * 2^b above is the same value, e^x being normal on [-87, 88]).
inline __m512 exp16_ps(__m512 x) {
  using namespace exp_consts;
  const __m512 lo = _mm512_set1_ps(kLo);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(kHi));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kPoly[i]));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~underflow), p, n);
}
#endif

// Weight formats the quantized matmuls read (see quant_linear.cpp for the layouts).
enum class QuantFormat : int64_t { Q4_1 = 0, Q8_0 = 1 };
// Weights per block of either format (GGUF's QK4_1 = QK8_0 = 32): one scale (and, Q4_1, one minimum) each.
constexpr int64_t kQuantBlock = 32;

// out [m, n] = x [m, k] @ W^T, W [n, k] in `format`; rows of W split across ATen's threads.
void quant_matmul(QuantFormat format, const float* x, int64_t m, int64_t k, const void* qs, const float* scales,
                  int64_t n, float* out);
// The same with each row of x rounded to int16 or int8 blocks of 32 first (quant_rounded.cpp): not the fp32 products.
void quant_matmul_int16(QuantFormat format, const float* x, int64_t m, int64_t k, const void* qs, const float* scales,
                        int64_t n, float* out);
void quant_matmul_int8(QuantFormat format, const float* x, int64_t m, int64_t k, const void* qs, const float* scales,
                       int64_t n, float* out);

// How a block product takes its activations: as they are (fp32), or each row rounded to integer blocks first.
// The values are model/quant.py's Activations.
enum class Activations : int64_t { FP32 = 0, INT16 = 1, INT8 = 2 };

inline void quant_matmul(Activations activations, QuantFormat format, const float* x, int64_t m, int64_t k,
                         const void* qs, const float* scales, int64_t n, float* out) {
  switch (activations) {
    case Activations::INT16: quant_matmul_int16(format, x, m, k, qs, scales, n, out); break;
    case Activations::INT8: quant_matmul_int8(format, x, m, k, qs, scales, n, out); break;
    default: quant_matmul(format, x, m, k, qs, scales, n, out); break;
  }
}

// Refuses (TORCH_CHECK) anything but a Q4_1 weight's blocks in the layout quant_linear.cpp describes.
void check_q4_1_blocks(const at::Tensor& qs, const at::Tensor& dm);
// x must be a contiguous fp32 [M, k] tensor (the activations of the block GEMMs).
void check_x(const at::Tensor& x, int64_t k);

// Attention of one query token per sequence over the paged fp32 cache (see paged_attention.cpp).
void paged_decode(const float* q, int64_t b, int64_t h, int64_t d, const float* k_cache, const float* v_cache,
                  int64_t num_blocks, int64_t block_size, int64_t hkv, const int64_t* tables, int64_t max_blocks,
                  const int64_t* lens, float scale, float* out);

// The same over a bf16 cache (uint16 bits of each element); head_dim a multiple of 16.
void paged_decode_bf16(const float* q, int64_t b, int64_t h, int64_t d, const uint16_t* k_cache,
                       const uint16_t* v_cache, int64_t block_size, int64_t hkv, const int64_t* tables,
                       int64_t max_blocks, const int64_t* lens, float scale, float* out);

// out [m, n] = x [m, k] (bf16 bits) @ W^T, W in Q4_1 blocks (N % 32 == 0), through AMX, into bf16 bits rounded to
// nearest even (amx_linear.cpp); refuses where the build or the OS gives no AMX.
void amx_q4_1_matmul_bf16(const uint16_t* x, int64_t m, int64_t k, const uint8_t* qs, const float* dm, int64_t n,
                          uint16_t* out);

#if defined(__AVX512BF16__)
// out [m, n] = x [m, k] (bf16 bits) @ W^T (+ bias [n] fp32 or null), W given as its bf16 panels (see
// bf16_panel.cpp), into fp32 or bf16 bits (rounded to nearest even); the panels split across ATen's threads.
void bf16_panel_matmul(const uint16_t* x, int64_t m, int64_t k, const uint16_t* panels, int64_t n, const float* bias,
                       float* out);
void bf16_panel_matmul(const uint16_t* x, int64_t m, int64_t k, const uint16_t* panels, int64_t n, const float* bias,
                       uint16_t* out);
#endif

// fp32 -> bf16 bits, rounded to nearest even as PyTorch's .to(torch.bfloat16) rounds.
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return 0x7FC0;
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// 8 floats -> 8 bf16 bits, rounded exactly as to_bf16 rounds (nearest even, NaN -> 0x7FC0).
inline __m128i to_bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // Each 32-bit lane holds its result in the low 16 bits: pack the two 128-bit halves (no saturation
  // happens, every value is < 0x10000).
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// 8 bf16 bits -> 8 floats (exact).
inline __m256 from_bf16x8(const uint16_t* src) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline void store_row(float* dst, const float* src, int64_t n) { std::copy(src, src + n, dst); }
#ifdef __AVX512F__
// to_bf16x8 and from_bf16x8 on 16 lanes: the same integer operations, so the same bits.
inline __m256i to_bf16x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

inline __m512 from_bf16x16(const uint16_t* src) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

#ifdef __AVX512F__
// r[i] <- column i of the 16 x 16 dword matrix whose rows are r[0..15] (four rounds of shuffles): the
// AMX kernels' B operands and the fp32 attention's keys are laid out with it.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}
#endif

inline void store_row(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), to_bf16x16(_mm512_loadu_ps(src + i)));
#endif
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), to_bf16x8(_mm256_loadu_ps(src + i)));
  for (; i < n; ++i) dst[i] = to_bf16(src[i]);
}

// A row of bf16 (its bits) or fp32 as fp32, into dst; n a multiple of 8.
inline void load_row(float* dst, const uint16_t* src, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, from_bf16x16(src + i));
#endif
  for (; i < n; i += 8) _mm256_storeu_ps(dst + i, from_bf16x8(src + i));
}
inline void load_row(float* dst, const float* src, int64_t n) { std::copy(src, src + n, dst); }

}  // namespace sluice
