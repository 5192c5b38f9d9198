// The prefill chunks' attention over a bf16 paged KV cache at fp32's accuracy (model/attention.py's prefill
// path; the decode kernel computes in fp32 too), every chunk of a step in one call: through AMX where the OS
// grants it, else with AVX-512 fp32 FMAs, else with AVX2 ones.
//
// AMX multiplies bf16 by bf16 into fp32. K and V are bf16 already (the cache); the two fp32 operands, q and
// the softmax numerators p, are each split into three bf16 parts, x = hi + mid + lo with hi = bf16(x),
// mid = bf16(x - hi), lo = bf16(x - hi - mid): 8 + 8 + 8 significant bits, their sum x itself. All three
// parts are multiplied (q.k = q_hi.k + q_mid.k + q_lo.k, likewise p.v), every product exact, the sums in
// fp32: against float64 attention it errs less than PyTorch's fp32 SDPA
// (tests/engine/test_prefill_attention_kernel.py). Two parts (16 bits) were ~20% faster and 4-6x SDPA's
// error. Three times the tile products of plain bf16 is still 2-3x faster than SDPA's fp32 FMAs on these cores.
//
// Per chunk and KV head the context's keys are first laid out as AMX B operands (pairs of head-dim
// elements, 16 keys a tile) and the values likewise (pairs of keys, 16 columns a tile), once for all the
// query heads that share them. Then each task takes 16 query rows of one head: scores against the keys
// they may see (causal: a tile of queries stops at its last row's position, so a prompt costs about half
// its full square), an exact softmax over the whole row (the max first, then e^(s - max) with the same
// polynomial as the other kernels), the unnormalised probabilities times V, and a division by their sum.
//
// Without AMX (fma_path below) the tasks and the softmax are the same; the keys and values are widened to
// fp32 and multiplied with register-blocked FMAs, which form each product exactly and round each sum once:
// the same accuracy. On a 2-core AVX-512 BF16 EPYC it computes 140-170 useful GFLOP/s against SDPA's 40-115.
// fma8_path is the same on 8 lanes, for CPUs without AVX-512 (every build has it; the AMX path is built where
// the compiler targets AMX-BF16, amx.h, the 16-lane one where it targets AVX-512).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "amx.h"
#include "balance.h"
#include "simd.h"

namespace sluice {
namespace {

constexpr int64_t kKeys = 32;  // keys per P tile row (32 bf16 = 64 bytes); the context is padded to it
constexpr int64_t kTaskRows = 16;  // query rows per task (one AMX tile's rows)

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Plain data, outside the AMX guard: the argument checks below build it on every CPU.
struct Chunk {
  int64_t start, qlen, ctx;
  const int64_t* table;
  int64_t packed;  // offset of its first KV head's packed keys (and values) in the scratch, in dwords
};

// One task of the attention: 16 query rows (from r0) of one head of one chunk.
struct RowTile {
  const Chunk* chunk;
  int64_t head, r0;
};

// Calls pack(chunk, kv_head) for every pair, in parallel. Both loops here hand their items out by cost
// (balance.h): a chunk's keys to pack and a row tile's keys to attend grow with its context, and a step's
// chunks range from a few keys to thousands.
template <typename Pack>
void parallel_pack(const std::vector<Chunk>& chunks, int64_t hkv, const Pack& pack) {
  const int64_t nc = static_cast<int64_t>(chunks.size());
  parallel_for_by_cost(nc * hkv, [&](int64_t job) { return round_up(chunks[job / hkv].ctx, kKeys); },
                       [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) pack(chunks[job / hkv], job % hkv);
  });
}

// Splits the (chunk, head, 16 query rows) tasks across threads: fn(begin, end, tile_at) once per thread,
// tile_at(task) -> its RowTile.
template <typename Fn>
void parallel_row_tiles(const std::vector<Chunk>& chunks, int64_t h, const Fn& fn) {
  const int64_t nc = static_cast<int64_t>(chunks.size());
  std::vector<int64_t> task_start(static_cast<size_t>(nc + 1), 0);
  for (int64_t i = 0; i < nc; ++i)
    task_start[i + 1] = task_start[i] + h * ((chunks[i].qlen + kTaskRows - 1) / kTaskRows);
  const auto tile_at = [&](int64_t task) {
    const int64_t ci =
        static_cast<int64_t>(std::upper_bound(task_start.begin(), task_start.end(), task) - task_start.begin()) - 1;
    const Chunk& c = chunks[ci];
    const int64_t local = task - task_start[ci], tiles = (c.qlen + kTaskRows - 1) / kTaskRows;
    return RowTile{&c, local / tiles, (local % tiles) * kTaskRows};
  };
  const auto task_cost = [&](int64_t task) {  // the keys its rows see, padded as attend_rows pads them, + its q
    const RowTile t = tile_at(task);
    const Chunk& c = *t.chunk;
    return round_up(c.ctx - c.qlen + t.r0 + std::min(kTaskRows, c.qlen - t.r0), kKeys) + kKeys;
  };
  parallel_for_by_cost(task_start[nc], task_cost, [&](int64_t begin, int64_t end) { fn(begin, end, tile_at); });
}

// Values [0, lpad) of one KV head widened to fp32 rows [lpad][d] (0 past ctx): both FMA paths' P.V operand.
void widen_values(const uint16_t* cache, int64_t bs, int64_t hkv, int64_t d, int64_t kvh, const Chunk& c, float* out) {
  const int64_t lpad = round_up(c.ctx, kKeys), row = hkv * d;
  for (int64_t n = 0; n < lpad; ++n) {
    float* dst = out + n * d;
    if (n < c.ctx) {
      load_row(dst, cache + (c.table[n / bs] * bs + n % bs) * row + kvh * d, d);
    } else {
      std::fill(dst, dst + d, 0.0f);
    }
  }
}

#ifdef __AVX512F__
// One row's softmax numerators from its raw scores s[0, len): the max over the raw scores first (scale > 0:
// the same key wins), then e^(s * scale - max * scale), 16 at a time handed to emit(t, e, live) (lanes past
// len are 0 in e and off in live). Returns their sum. Both paths' rows go through it.
template <typename Emit>
inline float softmax_numerators(const float* s, int64_t len, float scale, const Emit& emit) {
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 live = t + 16 <= len ? 0xFFFF : static_cast<__mmask16>((1u << (len - t)) - 1);
    vmax = _mm512_mask_max_ps(vmax, live, vmax, _mm512_loadu_ps(s + t));
  }
  const __m512 mx = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(vmax)), vscale);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 live = t + 16 <= len ? 0xFFFF : static_cast<__mmask16>((1u << (len - t)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, exp16_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s + t), vscale, mx)));
    vsum = _mm512_add_ps(vsum, e);
    emit(t, e, live);
  }
  return _mm512_reduce_add_ps(vsum);
}
#endif

#ifdef SLUICE_HAVE_AMX

constexpr int64_t kRows = kTileRows;  // 16 query rows, 16 keys or 16 key pairs per tile

inline __m512 widen(__m256bh h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(h)), 16));
}

// 16 floats -> three bf16 parts whose sum is x (8 + 8 + 8 significant bits: exact for every normal x whose
// parts stay normal): hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid).
inline void split16(__m512 x, uint16_t* hi, uint16_t* mid, uint16_t* lo) {
  const __m256bh h = _mm512_cvtneps_pbh(x);
  const __m512 r = _mm512_sub_ps(x, widen(h));
  const __m256bh m = _mm512_cvtneps_pbh(r);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), reinterpret_cast<__m256i>(h));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(mid), reinterpret_cast<__m256i>(m));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_sub_ps(r, widen(m)))));
}

// Keys [0, ctx) of one KV head -> B tiles of Q.K^T: for each 16 keys and each 32 head-dim elements, a
// tile whose row r holds, for each of the 16 keys, the pair (k[2r], k[2r+1]) of that 32: the transpose,
// in dwords, of the 16 keys' rows. Keys past ctx are 0.
void pack_keys(const uint32_t* cache, int64_t bs, int64_t hkv, int64_t d, int64_t kvh, const Chunk& c, uint32_t* out) {
  const int64_t halves = d / 32, lpad = round_up(c.ctx, kKeys), row = hkv * d / 2;
  __m512i r[16];
  for (int64_t n0 = 0; n0 < lpad; n0 += kRows) {
    for (int64_t hf = 0; hf < halves; ++hf) {
      for (int64_t i = 0; i < kRows; ++i) {
        const int64_t n = n0 + i;
        r[i] = n < c.ctx ? _mm512_loadu_si512(cache + (c.table[n / bs] * bs + n % bs) * row + kvh * d / 2 + hf * kRows)
                         : _mm512_setzero_si512();
      }
      transpose16(r);
      uint32_t* tile = out + ((n0 / kRows) * halves + hf) * kRows * kRows;
      for (int64_t i = 0; i < kRows; ++i) _mm512_storeu_si512(tile + i * kRows, r[i]);
    }
  }
}

// Values [0, ctx) of one KV head -> B tiles of P.V: for each 32 keys and each 16 head-dim columns, a tile
// whose row r holds, for each column, the pair (v[2r][col], v[2r+1][col]). Keys past ctx are 0.
void pack_values(const uint16_t* cache, int64_t bs, int64_t hkv, int64_t d, int64_t kvh, const Chunk& c, uint32_t* out) {
  const int64_t cols = d / kRows, lpad = round_up(c.ctx, kKeys), row = hkv * d;
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t n = 0; n < lpad; n += 2) {
    const uint16_t* a = n < c.ctx ? cache + (c.table[n / bs] * bs + n % bs) * row + kvh * d : nullptr;
    const uint16_t* b = n + 1 < c.ctx ? cache + (c.table[(n + 1) / bs] * bs + (n + 1) % bs) * row + kvh * d : nullptr;
    uint32_t* tiles = out + (n / kKeys) * cols * kRows * kRows + ((n % kKeys) / 2) * kRows;
    for (int64_t col = 0; col < cols; ++col) {
      const __m512i va = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + col * kRows))) : zero;
      const __m512i vb = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + col * kRows))) : zero;
      _mm512_storeu_si512(tiles + col * kRows * kRows, _mm512_or_si512(va, _mm512_slli_epi32(vb, 16)));
    }
  }
}

// One task: query rows [r0, r0 + 16) of head h in chunk c -> out.
void attend_rows(const float* q, int64_t h_total, int64_t d, int64_t h, int64_t r0, const Chunk& c,
                 const uint32_t* keys, const uint32_t* values, float scale, float* out, std::vector<uint16_t>& qs,
                 std::vector<float>& scores, std::vector<uint16_t>& probs) {
  const int64_t rows = std::min(kRows, c.qlen - r0);
  const int64_t first_pos = c.ctx - c.qlen + r0;       // position of row 0; row m sees keys [0, first_pos + m]
  const int64_t seen = first_pos + rows;               // keys any row sees
  const int64_t lpad = round_up(seen, kKeys), halves = d / 32, cols = d / kRows;
  // q rows as three bf16 parts: [3][16][d], rows past the chunk 0.
  qs.assign(static_cast<size_t>(3 * kRows * d), 0);
  uint16_t *q_hi = qs.data(), *q_mid = q_hi + kRows * d, *q_lo = q_mid + kRows * d;
  for (int64_t m = 0; m < rows; ++m) {
    const float* src = q + ((c.start + r0 + m) * h_total + h) * d;
    for (int64_t i = 0; i < d; i += 16)
      split16(_mm512_loadu_ps(src + i), q_hi + m * d + i, q_mid + m * d + i, q_lo + m * d + i);
  }
  // Scores [16][lpad]: sum over the head-dim halves of q_hi.k + q_lo.k, 32 keys (two C tiles, 0 and 4, so
  // that one's products overlap the other's) at a time.
  scores.resize(static_cast<size_t>(kRows * lpad));
  for (int64_t n0 = 0; n0 < lpad; n0 += kKeys) {
    _tile_zero(0);
    _tile_zero(4);
    const uint32_t* kt = keys + (n0 / kRows) * halves * kRows * kRows;
    for (int64_t hf = 0; hf < halves; ++hf) {
      _tile_loadd(1, q_hi + hf * 32, d * 2);
      _tile_loadd(2, q_mid + hf * 32, d * 2);
      _tile_loadd(6, q_lo + hf * 32, d * 2);
      _tile_loadd(3, kt + hf * kRows * kRows, 64);
      _tile_loadd(5, kt + (halves + hf) * kRows * kRows, 64);
      _tile_dpbf16ps(0, 1, 3);
      _tile_dpbf16ps(4, 1, 5);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(4, 2, 5);
      _tile_dpbf16ps(0, 6, 3);
      _tile_dpbf16ps(4, 6, 5);
    }
    _tile_stored(0, scores.data() + n0, lpad * 4);
    _tile_stored(4, scores.data() + n0 + kRows, lpad * 4);
  }
  // Softmax numerators (softmax_numerators) as three bf16 parts: [3][16][lpad]; 0 past each row's last
  // visible key.
  probs.resize(static_cast<size_t>(3 * kRows * lpad));
  uint16_t *p_hi = probs.data(), *p_mid = p_hi + kRows * lpad, *p_lo = p_mid + kRows * lpad;
  alignas(64) float sums[kRows] = {};
  for (int64_t m = 0; m < kRows; ++m) {
    const int64_t len = m < rows ? first_pos + m + 1 : 0, len16 = round_up(len, 16);
    sums[m] = softmax_numerators(scores.data() + m * lpad, len, scale, [&](int64_t t, __m512 e, __mmask16) {
      split16(e, p_hi + m * lpad + t, p_mid + m * lpad + t, p_lo + m * lpad + t);
    });
    for (uint16_t* part : {p_hi, p_mid, p_lo}) std::fill(part + m * lpad + len16, part + (m + 1) * lpad, 0);
  }
  // Output [16][d] = P.V, 16 columns per C tile, four at a time.
  alignas(64) float o[kRows * kRows];
  for (int64_t c0 = 0; c0 < cols; c0 += 4) {
    const int64_t cn = std::min<int64_t>(4, cols - c0);
    _tile_zero(0);  // tile numbers are immediates: the unused ones are zeroed too, and stay unread
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t n0 = 0; n0 < lpad; n0 += kKeys) {
      _tile_loadd(4, p_hi + n0, lpad * 2);
      _tile_loadd(5, p_mid + n0, lpad * 2);
      _tile_loadd(7, p_lo + n0, lpad * 2);
      const uint32_t* vt = values + (n0 / kKeys) * cols * kRows * kRows;
#define SLUICE_PV(J)                                              \
  if (cn > J) {                                                   \
    _tile_loadd(6, vt + (c0 + J) * kRows * kRows, 64);            \
    _tile_dpbf16ps(J, 4, 6);                                      \
    _tile_dpbf16ps(J, 5, 6);                                      \
    _tile_dpbf16ps(J, 7, 6);                                      \
  }
      SLUICE_PV(0) SLUICE_PV(1) SLUICE_PV(2) SLUICE_PV(3)
#undef SLUICE_PV
    }
    for (int64_t j = 0; j < cn; ++j) {
      switch (j) {
        case 0: _tile_stored(0, o, 64); break;
        case 1: _tile_stored(1, o, 64); break;
        case 2: _tile_stored(2, o, 64); break;
        default: _tile_stored(3, o, 64); break;
      }
      for (int64_t m = 0; m < rows; ++m) {
        float* dst = out + ((c.start + r0 + m) * h_total + h) * d + (c0 + j) * kRows;
        _mm512_storeu_ps(dst, _mm512_div_ps(_mm512_load_ps(o + m * kRows), _mm512_set1_ps(sums[m])));
      }
    }
  }
}

#endif  // SLUICE_HAVE_AMX

#ifdef __AVX512F__
// The same attention with fp32 FMAs, for AVX-512 CPUs without AMX. fma(q, k, acc) forms each product exactly
// and rounds the sum once, as the AMX path's exact products summed in fp32 do: the same accuracy, the
// additions in another order. K and V are widened from the bf16 cache once per chunk and KV head (exact),
// for all the query heads that share them:
//     keys   [lpad / 16][d][16] fp32: per 16 keys, element i of each (16 keys a vector)
//     values [lpad][d] fp32
namespace fma_path {

constexpr int64_t kScoreRows = 8;  // query rows per scores pass: 16 accumulators (8 rows x 32 keys)
constexpr int64_t kPvRows = 6;     // rows per P.V pass: 24 accumulators (6 rows x 64 columns)

void pack_keys(const uint16_t* cache, int64_t bs, int64_t hkv, int64_t d, int64_t kvh, const Chunk& c, float* out) {
  const int64_t lpad = round_up(c.ctx, kKeys), row = hkv * d;
  __m512i r[16];
  for (int64_t n0 = 0; n0 < lpad; n0 += 16) {
    for (int64_t i0 = 0; i0 < d; i0 += 16) {
      for (int64_t j = 0; j < 16; ++j) {  // key n0 + j, elements i0 .. i0 + 15
        const int64_t n = n0 + j;
        r[j] = n < c.ctx ? _mm512_castps_si512(from_bf16x16(cache + (c.table[n / bs] * bs + n % bs) * row + kvh * d + i0))
                         : _mm512_setzero_si512();  // keys past ctx
      }
      transpose16(r);  // r[i]: element i0 + i of the 16 keys
      float* dst = out + (n0 / 16) * d * 16 + i0 * 16;
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * 16, r[i]);
    }
  }
}

// scores[m][0, lpad) = q row m . keys, for R rows; 32 keys (two vectors) at a time, k in order.
template <int R>
void scores_pass(const float* q, int64_t q_stride, int64_t d, const float* keys, int64_t lpad, float* scores,
                 int64_t ld) {
  for (int64_t n0 = 0; n0 < lpad; n0 += 32) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float* k0 = keys + (n0 / 16) * d * 16;
    const float* k1 = k0 + d * 16;
    for (int64_t i = 0; i < d; ++i) {
      const __m512 a = _mm512_loadu_ps(k0 + i * 16), b = _mm512_loadu_ps(k1 + i * 16);
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_set1_ps(q[r * q_stride + i]);
        acc[r][0] = _mm512_fmadd_ps(x, a, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(x, b, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(scores + r * ld + n0, acc[r][0]);
      _mm512_storeu_ps(scores + r * ld + n0 + 16, acc[r][1]);
    }
  }
}

// o[m][c0, c0 + 16 CV) = sum over keys [0, len) of p[m][n] v[n][c0 ..], for R rows, keys in order.
template <int R, int CV>
void pv_pass(const float* p, int64_t ldp, int64_t len, const float* values, int64_t d, int64_t c0, float* o,
             int64_t ldo) {
  __m512 acc[R][CV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < CV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t n = 0; n < len; ++n) {
    __m512 v[CV];
    for (int j = 0; j < CV; ++j) v[j] = _mm512_loadu_ps(values + n * d + c0 + j * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(p[r * ldp + n]);
      for (int j = 0; j < CV; ++j) acc[r][j] = _mm512_fmadd_ps(x, v[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < CV; ++j) _mm512_storeu_ps(o + r * ldo + j * 16, acc[r][j]);
}

template <int... R>
void scores_rows(int64_t rows, std::integer_sequence<int, R...>, const float* q, int64_t q_stride, int64_t d,
                 const float* keys, int64_t lpad, float* scores, int64_t ld) {
  (void)((rows == R + 1 ? (scores_pass<R + 1>(q, q_stride, d, keys, lpad, scores, ld), true) : false) || ...);
}

template <int CV, int... R>
void pv_rows(int64_t rows, std::integer_sequence<int, R...>, const float* p, int64_t ldp, int64_t len,
             const float* values, int64_t d, int64_t c0, float* o, int64_t ldo) {
  (void)((rows == R + 1 ? (pv_pass<R + 1, CV>(p, ldp, len, values, d, c0, o, ldo), true) : false) || ...);
}

// One task: query rows [r0, r0 + 16) of head h in chunk c -> out (as the AMX path's attend_rows).
void attend_rows(const float* q, int64_t h_total, int64_t d, int64_t h, int64_t r0, const Chunk& c, const float* keys,
                 const float* values, float scale, float* out, std::vector<float>& scores) {
  const int64_t rows = std::min(kTaskRows, c.qlen - r0);
  const int64_t first_pos = c.ctx - c.qlen + r0;  // position of row 0; row m sees keys [0, first_pos + m]
  const int64_t seen = first_pos + rows;
  const int64_t lpad = round_up(seen, kKeys);
  scores.resize(static_cast<size_t>(kTaskRows * lpad));
  const float* q0 = q + ((c.start + r0) * h_total + h) * d;
  const int64_t q_stride = h_total * d;
  for (int64_t m = 0; m < rows; m += kScoreRows) {
    scores_rows(std::min(kScoreRows, rows - m), std::make_integer_sequence<int, kScoreRows>{}, q0 + m * q_stride,
                q_stride, d, keys, lpad, scores.data() + m * lpad, lpad);
  }
  // Softmax numerators in place, 0 from each row's last visible key to `seen`; then P.V and the division.
  alignas(64) float sums[kTaskRows] = {};
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t len = first_pos + m + 1;
    float* s = scores.data() + m * lpad;
    sums[m] = softmax_numerators(s, len, scale, [&](int64_t t, __m512 e, __mmask16 live) {
      _mm512_mask_storeu_ps(s + t, live, e);
    });
    std::fill(s + len, s + seen, 0.0f);
  }
  alignas(64) float o[kPvRows * 64];
  const int64_t width = d % 64 == 0 ? 64 : 32;  // columns per P.V pass (d is a multiple of 32)
  // Rows split over the fewest passes in near-equal parts (16 as 6, 5, 5, not 6, 6, 4): with 4 rows GCC folds
  // the value loads into the FMAs, a load per FMA, and the pass ran ~1.5x slower per FMA. A row's sums do not
  // depend on the rows beside it in a pass.
  for (int64_t m = 0, left = (rows + kPvRows - 1) / kPvRows, pr; m < rows; m += pr, --left) {
    pr = (rows - m + left - 1) / left;
    for (int64_t c0 = 0; c0 < d; c0 += width) {
      if (width == 64) {
        pv_rows<4>(pr, std::make_integer_sequence<int, kPvRows>{}, scores.data() + m * lpad, lpad, seen, values, d,
                   c0, o, 64);
      } else {
        pv_rows<2>(pr, std::make_integer_sequence<int, kPvRows>{}, scores.data() + m * lpad, lpad, seen, values, d,
                   c0, o, 64);
      }
      for (int64_t i = 0; i < pr; ++i) {
        float* dst = out + ((c.start + r0 + m + i) * h_total + h) * d + c0;
        const __m512 sum = _mm512_set1_ps(sums[m + i]);
        for (int64_t j = 0; j < width; j += 16)
          _mm512_storeu_ps(dst + j, _mm512_div_ps(_mm512_loadu_ps(o + i * 64 + j), sum));
      }
    }
  }
}

}  // namespace fma_path
#endif  // __AVX512F__


// The same attention with 8-lane fp32 FMAs, for CPUs without AVX-512 (and, on request, for the tests on
// those with it): fma_path's layout and tasks on AVX2 vectors, the same accuracy (each product exact, each
// sum rounded once), the additions in another order.
//     keys   [lpad / 8][d][8] fp32: per 8 keys, element i of each (8 keys a vector)
//     values [lpad][d] fp32
namespace fma8_path {

constexpr int64_t kScoreRows = 6;  // query rows per scores pass: 12 accumulators (6 rows x 16 keys)
constexpr int64_t kPvRows = 6;     // rows per P.V pass: 12 accumulators (6 rows x 16 columns)

// r[i] <- column i of the 8 x 8 matrix whose rows are r[0..7].
inline void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

void pack_keys(const uint16_t* cache, int64_t bs, int64_t hkv, int64_t d, int64_t kvh, const Chunk& c, float* out) {
  const int64_t lpad = round_up(c.ctx, kKeys), row = hkv * d;
  __m256 r[8];
  for (int64_t n0 = 0; n0 < lpad; n0 += 8) {
    for (int64_t i0 = 0; i0 < d; i0 += 8) {
      for (int64_t j = 0; j < 8; ++j) {  // key n0 + j, elements i0 .. i0 + 7
        const int64_t n = n0 + j;
        r[j] = n < c.ctx ? from_bf16x8(cache + (c.table[n / bs] * bs + n % bs) * row + kvh * d + i0)
                         : _mm256_setzero_ps();  // keys past ctx
      }
      transpose8(r);  // r[i]: element i0 + i of the 8 keys
      float* dst = out + (n0 / 8) * d * 8 + i0 * 8;
      for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(dst + i * 8, r[i]);
    }
  }
}

// scores[m][0, lpad) = q row m . keys, for R rows; 16 keys (two vectors) at a time, k in order.
template <int R>
void scores_pass(const float* q, int64_t q_stride, int64_t d, const float* keys, int64_t lpad, float* scores,
                 int64_t ld) {
  for (int64_t n0 = 0; n0 < lpad; n0 += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* k0 = keys + (n0 / 8) * d * 8;
    const float* k1 = k0 + d * 8;
    for (int64_t i = 0; i < d; ++i) {
      const __m256 a = _mm256_loadu_ps(k0 + i * 8), b = _mm256_loadu_ps(k1 + i * 8);
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_broadcast_ss(q + r * q_stride + i);
        acc[r][0] = _mm256_fmadd_ps(x, a, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(x, b, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(scores + r * ld + n0, acc[r][0]);
      _mm256_storeu_ps(scores + r * ld + n0 + 8, acc[r][1]);
    }
  }
}

// o[m][0, 16) = sum over keys [0, len) of p[m][n] v[n][c0 ..], for R rows, keys in order.
template <int R>
void pv_pass(const float* p, int64_t ldp, int64_t len, const float* values, int64_t d, int64_t c0, float* o,
             int64_t ldo) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t n = 0; n < len; ++n) {
    const __m256 v0 = _mm256_loadu_ps(values + n * d + c0), v1 = _mm256_loadu_ps(values + n * d + c0 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(p + r * ldp + n);
      acc[r][0] = _mm256_fmadd_ps(x, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, v1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(o + r * ldo, acc[r][0]);
    _mm256_storeu_ps(o + r * ldo + 8, acc[r][1]);
  }
}

template <int... R>
void scores_rows(int64_t rows, std::integer_sequence<int, R...>, const float* q, int64_t q_stride, int64_t d,
                 const float* keys, int64_t lpad, float* scores, int64_t ld) {
  (void)((rows == R + 1 ? (scores_pass<R + 1>(q, q_stride, d, keys, lpad, scores, ld), true) : false) || ...);
}

template <int... R>
void pv_rows(int64_t rows, std::integer_sequence<int, R...>, const float* p, int64_t ldp, int64_t len,
             const float* values, int64_t d, int64_t c0, float* o, int64_t ldo) {
  (void)((rows == R + 1 ? (pv_pass<R + 1>(p, ldp, len, values, d, c0, o, ldo), true) : false) || ...);
}

// softmax_numerators on 8 lanes, in place: s[0, len) <- e^(s * scale - max * scale), s[len, round_up(len, 8))
// <- 0 (the row has room: lpad is a multiple of 32). Returns their sum.
inline float softmax_numerators8(float* s, int64_t len, float scale) {
  const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const auto live_at = [&](int64_t t) {  // lanes t + i < len
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(len - t)), lane));
  };
  __m256 vmax = ninf;
  for (int64_t t = 0; t < len; t += 8)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + t), live_at(t)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const __m256 mx = _mm256_mul_ps(_mm256_set1_ps(_mm_cvtss_f32(m4)), vscale);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t t = 0; t < len; t += 8) {
    const __m256 e = _mm256_and_ps(live_at(t), exp_ps(_mm256_fmsub_ps(_mm256_loadu_ps(s + t), vscale, mx)));
    vsum = _mm256_add_ps(vsum, e);
    _mm256_storeu_ps(s + t, e);
  }
  return hsum(vsum);
}

// One task: query rows [r0, r0 + 16) of head h in chunk c -> out (as fma_path's attend_rows).
void attend_rows(const float* q, int64_t h_total, int64_t d, int64_t h, int64_t r0, const Chunk& c, const float* keys,
                 const float* values, float scale, float* out, std::vector<float>& scores) {
  const int64_t rows = std::min(kTaskRows, c.qlen - r0);
  const int64_t first_pos = c.ctx - c.qlen + r0;  // position of row 0; row m sees keys [0, first_pos + m]
  const int64_t seen = first_pos + rows;
  const int64_t lpad = round_up(seen, kKeys);
  scores.resize(static_cast<size_t>(kTaskRows * lpad));
  const float* q0 = q + ((c.start + r0) * h_total + h) * d;
  const int64_t q_stride = h_total * d;
  for (int64_t m = 0; m < rows; m += kScoreRows) {
    scores_rows(std::min(kScoreRows, rows - m), std::make_integer_sequence<int, kScoreRows>{}, q0 + m * q_stride,
                q_stride, d, keys, lpad, scores.data() + m * lpad, lpad);
  }
  // Softmax numerators in place, 0 from each row's last visible key to `seen`; then P.V and the division.
  alignas(32) float sums[kTaskRows] = {};
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t len = first_pos + m + 1;
    float* s = scores.data() + m * lpad;
    sums[m] = softmax_numerators8(s, len, scale);
    if (len < seen) std::fill(s + len, s + seen, 0.0f);
  }
  alignas(32) float o[kPvRows * 16];
  for (int64_t m = 0; m < rows; m += kPvRows) {
    const int64_t pr = std::min(kPvRows, rows - m);
    for (int64_t c0 = 0; c0 < d; c0 += 16) {
      pv_rows(pr, std::make_integer_sequence<int, kPvRows>{}, scores.data() + m * lpad, lpad, seen, values, d, c0, o,
              16);
      for (int64_t i = 0; i < pr; ++i) {
        float* dst = out + ((c.start + r0 + m + i) * h_total + h) * d + c0;
        const __m256 sum = _mm256_set1_ps(sums[m + i]);
        for (int64_t j = 0; j < 16; j += 8)
          _mm256_storeu_ps(dst + j, _mm256_div_ps(_mm256_loadu_ps(o + i * 16 + j), sum));
      }
    }
  }
}

}  // namespace fma8_path

// The kernel's paths this build and CPU have, fastest first: "amx" (where built for AMX-BF16 and the OS grants
// it), "avx512" (where built for AVX-512), "avx2" (every build).
std::vector<std::string> prefill_attention_paths() {
  std::vector<std::string> paths;
#ifdef SLUICE_HAVE_AMX
  if (amx_permitted()) paths.emplace_back("amx");
#endif
#ifdef __AVX512F__
  paths.emplace_back("avx512");
#endif
  paths.emplace_back("avx2");
  return paths;
}

// q [T, H, D] fp32; k/v_cache [num_blocks, block_size, Hkv, D] bf16; per chunk: its first row in T, its
// query length, its context length (its own tokens included, already in the cache) and its block table
// row -> out [T, H, D] fp32, written at the chunks' rows only. Through `path`, one of prefill_attention_paths()
// (the tests run each), or the fastest where empty.
void prefill_attention_kernel(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor starts,
                           torch::Tensor query_lens, torch::Tensor context_lens, torch::Tensor block_tables,
                           double scale, torch::Tensor out, const std::string& path) {
  const std::vector<std::string> paths = prefill_attention_paths();
  const std::string& use = path.empty() ? paths.front() : path;
  TORCH_CHECK(std::find(paths.begin(), paths.end(), use) != paths.end(), "prefill attention path '", use,
              "' is not built or not permitted here");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: contiguous fp32 [T, H, D]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == torch::kFloat32 && out.is_contiguous(), "out: like q");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == torch::kBFloat16 && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == torch::kBFloat16 && v_cache.is_contiguous(),
              "k/v_cache: contiguous bf16 [num_blocks, block_size, Hkv, D]");
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && d % 32 == 0, "head_dim must match the cache and be a multiple of 32");
  TORCH_CHECK(h % hkv == 0, "query heads must be a multiple of KV heads");
  for (const auto* v : {&starts, &query_lens, &context_lens})
    TORCH_CHECK(v->dim() == 1 && v->scalar_type() == torch::kInt64 && v->is_contiguous() && v->size(0) == starts.size(0),
                "starts, query_lens, context_lens: contiguous int64 [C]");
  const int64_t nc = starts.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous() &&
                  block_tables.size(0) == nc, "block_tables: contiguous int64 [C, max_blocks]");
  const int64_t max_blocks = block_tables.size(1);
  std::vector<Chunk> chunks(static_cast<size_t>(nc));
  int64_t packed = 0;
  for (int64_t i = 0; i < nc; ++i) {
    Chunk& c = chunks[i];
    c = {starts.data_ptr<int64_t>()[i], query_lens.data_ptr<int64_t>()[i], context_lens.data_ptr<int64_t>()[i],
         block_tables.data_ptr<int64_t>() + i * max_blocks, packed};
    TORCH_CHECK(c.qlen >= 1 && c.ctx >= c.qlen && c.start >= 0 && c.start + c.qlen <= t, "chunk ", i, " out of range");
    TORCH_CHECK(c.ctx <= max_blocks * bs, "chunk ", i, ": context past its block table");
    for (int64_t j = 0; j < (c.ctx + bs - 1) / bs; ++j)
      TORCH_CHECK(c.table[j] >= 0 && c.table[j] < num_blocks, "chunk ", i, ": block id out of the pool");
    packed += hkv * round_up(c.ctx, kKeys) * d / 2;
  }
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
#ifdef SLUICE_HAVE_AMX
  if (use == "amx") {
    // Keys then values of every (chunk, KV head), each lpad * d / 2 dwords.
    std::vector<uint32_t> keys(static_cast<size_t>(packed)), values(static_cast<size_t>(packed));
    const auto* kw = reinterpret_cast<const uint32_t*>(kc);
    parallel_pack(chunks, hkv, [&](const Chunk& c, int64_t kvh) {
      const int64_t at = c.packed + kvh * round_up(c.ctx, kKeys) * d / 2;
      pack_keys(kw, bs, hkv, d, kvh, c, keys.data() + at);
      pack_values(vc, bs, hkv, d, kvh, c, values.data() + at);
    });
    parallel_row_tiles(chunks, h, [&](int64_t begin, int64_t end, const auto& tile_at) {
      configure_tiles();
      std::vector<uint16_t> qs, probs;
      std::vector<float> scores;
      for (int64_t task = begin; task < end; ++task) {
        const RowTile t = tile_at(task);
        const int64_t at = t.chunk->packed + (t.head / (h / hkv)) * round_up(t.chunk->ctx, kKeys) * d / 2;
        attend_rows(qp, h, d, t.head, t.r0, *t.chunk, keys.data() + at, values.data() + at, sc, op, qs, scores, probs);
      }
      _tile_release();
    });
    return;
  }
#endif
  // Keys then values of every (chunk, KV head) in fp32, each lpad * d floats (twice the dwords above), for
  // either FMA path: the same values in another layout of the keys.
  std::vector<float> keys(static_cast<size_t>(2 * packed)), values(static_cast<size_t>(2 * packed));
  const bool wide = use == "avx512";
  parallel_pack(chunks, hkv, [&](const Chunk& c, int64_t kvh) {
    const int64_t at = 2 * c.packed + kvh * round_up(c.ctx, kKeys) * d;
#ifdef __AVX512F__
    if (wide) fma_path::pack_keys(kc, bs, hkv, d, kvh, c, keys.data() + at);
#endif
    if (!wide) fma8_path::pack_keys(kc, bs, hkv, d, kvh, c, keys.data() + at);
    widen_values(vc, bs, hkv, d, kvh, c, values.data() + at);
  });
  parallel_row_tiles(chunks, h, [&](int64_t begin, int64_t end, const auto& tile_at) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const RowTile t = tile_at(task);
      const int64_t at = 2 * t.chunk->packed + (t.head / (h / hkv)) * round_up(t.chunk->ctx, kKeys) * d;
      const float *k = keys.data() + at, *v = values.data() + at;
#ifdef __AVX512F__
      if (wide) fma_path::attend_rows(qp, h, d, t.head, t.r0, *t.chunk, k, v, sc, op, scores);
#endif
      if (!wide) fma8_path::attend_rows(qp, h, d, t.head, t.r0, *t.chunk, k, v, sc, op, scores);
    }
  });
}

}  // namespace
}  // namespace sluice

void register_prefill_attention(pybind11::module& m) {
  using namespace sluice;
  m.def("prefill_attention_paths", &prefill_attention_paths,
        "prefill_attention_kernel's paths on this build and CPU, fastest first");
  m.def("prefill_attention_kernel", &prefill_attention_kernel,
        "prefill chunks' causal attention over a bf16 paged cache, fp32 in and out (AMX split-bf16 tiles, or AVX-512 or AVX2 FMAs)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("starts"),
        pybind11::arg("query_lens"), pybind11::arg("context_lens"), pybind11::arg("block_tables"),
        pybind11::arg("scale"), pybind11::arg("out"), pybind11::arg("path") = "");
}
