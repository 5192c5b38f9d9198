// x @ W^T with W in GGUF Q4_1 blocks, through AMX, for steps of more tokens than the fp32 block kernels
// (quant_linear.cpp) serve well: a step of 32 decoding streams reads every weight once, and the dense bf16
// GEMM reads 2 bytes a weight where the blocks hold 0.625.
//
// Same values as the dense path: each block is dequantized to the very bf16 weights the loader made
// (w = fma(d, q, m) in fp32, exact as in quant_linear.cpp, rounded to nearest even as torch's
// .to(torch.bfloat16) rounds), x is the bf16 input the dense GEMM gets, tdpbf16ps forms the exact
// products in fp32 and adds them in fp32, and the result is rounded to bf16 the way oneDNN's bf16 output
// is. So it differs from the dense GEMM only in the order of the additions.
//
// Roles: the weight is the A operand (16 rows of W = 16 output features, 32 k in a 64-byte tile row,
// the plain layout a dequantized block lands in) and x the B operand, laid out once per call in AMX's
// pair-interleaved form (16 k-pairs x 16 rows of x). A C tile is then 16 features x 16 tokens, stored
// transposed into the [M, N] output. Per 32 features, one thread dequantizes the 32 x K slice into a
// scratch buffer (L2-resident: 96 KB at K = 1536) and runs every 32-token slice of x over it, so a
// weight is read from memory once per call whatever M is.
//
// Built where the compiler targets AMX-BF16 (-march=native on such a CPU; the build is keyed on the CPU's
// flags); elsewhere `amx_q4_1_available()` is false and the callers keep the dense GEMM.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

#include "amx.h"
#include "simd.h"

namespace sluice {

// Linux hands a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); oneDNN asks too, once is enough for every thread.
bool amx_permitted() {
#ifdef SLUICE_HAVE_AMX
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
#else
  return false;
#endif
}

namespace {

// Rows of a tile: 16 features (A), 16 k-pairs (B), 16 features (C); a tile row of A holds one block's 32 k.
constexpr int64_t kTile = 16;

#ifdef SLUICE_HAVE_AMX

// One Q4_1 block -> its 32 weights as bf16, in element order. The block's 16 possible weights fma(d, q, m),
// q = 0..15, are computed once and rounded to bf16 (to nearest even), and each nibble picks its own from
// that table (vpermw): the same values as converting every weight, for about half the instructions.
inline void dequantize_block(const uint8_t* qs, float d, float m, uint16_t* dst) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(packed, mask);  // weights 0..15
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  // weights 16..31
  const __m512i index = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));
  const __m512 q = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m256bh table = _mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_set1_ps(d), q, _mm512_set1_ps(m)));
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(index, _mm512_castsi256_si512(reinterpret_cast<__m256i>(table))));
}

// x [M, K] bf16 -> [M/16 (rounded up)][K/32][16 k-pairs][16 rows][2], zero rows past M: per 16 rows and
// 32 k, a 16 x 16 transpose of dwords (k-pairs). On the calling thread: a few us at 32 x 1536, less than
// waking the other threads for it costs.
void interleave_x(const uint16_t* x, int64_t m, int64_t k, uint32_t* out) {
  const int64_t pairs = k / 2, kblocks = k / kQuantBlock, mtiles = (m + kTile - 1) / kTile;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  __m512i r[16];
  for (int64_t mt = 0; mt < mtiles; ++mt) {
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      for (int64_t i = 0; i < kTile; ++i) {
        const int64_t row = mt * kTile + i;
        r[i] = row < m ? _mm512_loadu_si512(xp + row * pairs + kb * kTile) : _mm512_setzero_si512();
      }
      transpose16(r);
      uint32_t* tile = out + (mt * kblocks + kb) * kTile * kTile;
      for (int64_t i = 0; i < kTile; ++i) _mm512_storeu_si512(tile + i * kTile, r[i]);
    }
  }
}

// C tile (16 features x 16 tokens, fp32) -> out[t0 + t, f0 .. f0 + 15], a column of the tile per row.
inline __m512 tile_column(const float* c, int64_t t) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(kTile));
  return _mm512_i32gather_ps(rows, c + t, 4);
}

inline void write_tile(const float* c, int64_t f0, int64_t t0, int64_t m, int64_t n, float* out) {
  const int64_t rows = std::min(kTile, m - t0);
  for (int64_t t = 0; t < rows; ++t) _mm512_storeu_ps(out + (t0 + t) * n + f0, tile_column(c, t));
}

// Rounded to nearest even, as oneDNN's bf16 output and torch's .to(torch.bfloat16) round.
inline void write_tile(const float* c, int64_t f0, int64_t t0, int64_t m, int64_t n, at::BFloat16* out) {
  const int64_t rows = std::min(kTile, m - t0);
  for (int64_t t = 0; t < rows; ++t) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (t0 + t) * n + f0),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(tile_column(c, t))));
  }
}

template <typename Out>
void amx_q4_1_matmul(const uint16_t* x, int64_t m, int64_t k, const uint8_t* qs, const float* dm, int64_t n, Out* out) {
  const int64_t kblocks = k / kQuantBlock, mtiles = (m + kTile - 1) / kTile;
  std::vector<uint32_t> xt(static_cast<size_t>(mtiles * kblocks * kTile * kTile));
  interleave_x(x, m, k, xt.data());
  const uint32_t* xtiles = xt.data();
  at::parallel_for(0, n / (2 * kTile), 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    std::vector<uint16_t> w(static_cast<size_t>(2 * kTile * k));
    alignas(64) float c[4][kTile * kTile];
    for (int64_t fb = begin; fb < end; ++fb) {
      const int64_t f0 = fb * 2 * kTile;
      for (int64_t r = 0; r < 2 * kTile; ++r) {
        const uint8_t* rq = qs + (f0 + r) * kblocks * 16;
        const float* rs = dm + (f0 + r) * kblocks * 2;
        for (int64_t b = 0; b < kblocks; ++b) dequantize_block(rq + b * 16, rs[2 * b], rs[2 * b + 1], &w[r * k + b * kQuantBlock]);
      }
      const uint16_t* w0 = w.data();
      const uint16_t* w1 = w.data() + kTile * k;
      const int64_t wstride = k * 2;
      for (int64_t mt = 0; mt < mtiles; mt += 2) {
        const bool two = mt + 1 < mtiles;
        const uint32_t* x0 = xtiles + mt * kblocks * kTile * kTile;
        const uint32_t* x1 = x0 + kblocks * kTile * kTile;
        _tile_zero(4);
        _tile_zero(6);
        if (two) {
          _tile_zero(5);
          _tile_zero(7);
        }
        for (int64_t kb = 0; kb < kblocks; ++kb) {
          _tile_loadd(0, w0 + kb * kQuantBlock, wstride);
          _tile_loadd(1, w1 + kb * kQuantBlock, wstride);
          _tile_loadd(2, x0 + kb * kTile * kTile, 64);
          _tile_dpbf16ps(4, 0, 2);
          _tile_dpbf16ps(6, 1, 2);
          if (two) {
            _tile_loadd(3, x1 + kb * kTile * kTile, 64);
            _tile_dpbf16ps(5, 0, 3);
            _tile_dpbf16ps(7, 1, 3);
          }
        }
        _tile_stored(4, c[0], 64);
        _tile_stored(6, c[2], 64);
        write_tile(c[0], f0, mt * kTile, m, n, out);
        write_tile(c[2], f0 + kTile, mt * kTile, m, n, out);
        if (two) {
          _tile_stored(5, c[1], 64);
          _tile_stored(7, c[3], 64);
          write_tile(c[1], f0, (mt + 1) * kTile, m, n, out);
          write_tile(c[3], f0 + kTile, (mt + 1) * kTile, m, n, out);
        }
      }
    }
    _tile_release();
  });
}

#endif  // SLUICE_HAVE_AMX

bool amx_q4_1_available() { return amx_permitted(); }

// x [M, K] bf16 @ Q4_1 weight [N, K]^T -> [M, N] bf16 (out_bf16) or float32. N must be a multiple of 32.
torch::Tensor amx_q4_1_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm, bool out_bf16) {
  TORCH_CHECK(amx_q4_1_available(), "AMX-BF16 is not available on this CPU or build");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous bfloat16 [M, K] tensor");
  check_q4_1_blocks(qs, dm);
  const int64_t n = qs.size(0), k = qs.size(1) * kQuantBlock, m = x.size(0);
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight ", k);
  TORCH_CHECK(n % (2 * kTile) == 0, "the weight's rows (", n, ") must be a multiple of 32");
  auto out = torch::empty({m, n}, x.options().dtype(out_bf16 ? torch::kBFloat16 : torch::kFloat32));
#ifdef SLUICE_HAVE_AMX
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  if (out_bf16) {
    amx_q4_1_matmul(xp, m, k, qs.data_ptr<uint8_t>(), dm.data_ptr<float>(), n, out.data_ptr<at::BFloat16>());
  } else {
    amx_q4_1_matmul(xp, m, k, qs.data_ptr<uint8_t>(), dm.data_ptr<float>(), n, out.data_ptr<float>());
  }
#endif
  return out;
}

}  // namespace

// The raw entry panel_decode.cpp's DecodeLayers multiplies with: bf16 out, rounded as amx_q4_1_linear's.
void amx_q4_1_matmul_bf16(const uint16_t* x, int64_t m, int64_t k, const uint8_t* qs, const float* dm, int64_t n,
                          uint16_t* out) {
#ifdef SLUICE_HAVE_AMX
  amx_q4_1_matmul(x, m, k, qs, dm, n, reinterpret_cast<at::BFloat16*>(out));
#else
  (void)x, (void)m, (void)k, (void)qs, (void)dm, (void)n, (void)out;
  TORCH_CHECK(false, "AMX-BF16 is not available on this CPU or build");
#endif
}

}  // namespace sluice

void register_amx_linear(pybind11::module& m) {
  using namespace sluice;
  m.def("amx_q4_1_available", &amx_q4_1_available, "whether amx_q4_1_linear runs on this CPU and build");
  m.def("amx_q4_1_linear", &amx_q4_1_linear, "x [M, K] bf16 @ Q4_1 weight [N, K]^T -> [M, N] bf16 or fp32, via AMX",
        pybind11::arg("x"), pybind11::arg("qs"), pybind11::arg("dm"), pybind11::arg("out_bf16"));
}
