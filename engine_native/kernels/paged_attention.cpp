// Attention of decode tokens (one query per sequence) straight over the paged KV cache.
//
// The PyTorch path gathers each sequence's blocks into a padded [B, L, Hkv, D] copy for every layer
// (reading and writing the whole context once more than needed) and then multiplies. Here each
// (sequence, KV head) pair walks its block table in place: scores of the g = H / Hkv query heads that
// share the KV head against every cached key, a softmax, then the weighted sum of the values. K and V
// are read once, fp32 throughout.
//
//     q            [B, H, D] float32          one query token per sequence
//     k/v_cache    [num_blocks, block_size, Hkv, D] float32 or bfloat16 (widened exactly as read)
//     block_tables [B, max_blocks] int64      block ids of each sequence, in token order
//     context_lens [B] int64                  tokens of each sequence in the cache (its query included)
//     -> out       [B, H, D] float32
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "balance.h"
#include "simd.h"

namespace sluice {

namespace {

// What a (sequence, KV head) item of the decode attention costs, for parallel_for_by_cost: its context
// length, plus a fixed part for the walk's set-up. Contexts of mixed lengths split by count left one
// thread waiting for the other.
inline int64_t item_cost(const int64_t* lens, int64_t hkv, int64_t item) { return lens[item / hkv] + 16; }

// s[t..len) <- e^(s - mx) in place, 8 lanes at a time then one by one; returns vsum's lanes plus all of them,
// added in that order (softmax16 below relies on the order to give softmax's bits).
float exp_sum_from(float* s, int64_t t, int64_t len, float mx, __m256 vsum) {
  const __m256 vmx = _mm256_set1_ps(mx);
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
  return sum;
}

// s[0..len) <- softmax(s[0..len)) in place.
void softmax(float* s, int64_t len) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < len; ++t) mx = std::max(mx, s[t]);
  const float inv = 1.0f / exp_sum_from(s, 0, len, mx, _mm256_setzero_ps());
  for (int64_t i = 0; i < len; ++i) s[i] *= inv;
}

// k[t], v[t] <- token t's K and V rows (every KV head's elements) of a sequence of `len` tokens whose block
// table is `table`, in token order.
template <typename KV>
void token_rows(const KV* k_cache, const KV* v_cache, const int64_t* table, int64_t len, int64_t block_size,
                int64_t token_stride, std::vector<const KV*>& k, std::vector<const KV*>& v) {
  k.resize(static_cast<size_t>(len));
  v.resize(static_cast<size_t>(len));
  // Block by block: a division per token (block_size is not known at compile time) cost more than the rest of this.
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const int64_t base = table[t0 / block_size] * block_size * token_stride, n = std::min(block_size, len - t0);
    for (int64_t i = 0; i < n; ++i) {
      k[t0 + i] = k_cache + base + i * token_stride;
      v[t0 + i] = v_cache + base + i * token_stride;
    }
  }
}

// The AVX2 path, where the AVX-512 one does not run (8 lanes, 16 registers), over an fp32 or a bf16 cache. Scores: one
// query head against eight keys at a time (eight accumulators over d, reduced together by an hadd tree);
// values: up to three query heads x 16 columns of the output held in registers over the whole context. The
// walk it replaced reduced a vector to one float for every (query head, key) pair and loaded and stored
// every output row once per key. 2-core AVX2-only EPYC, 32 sequences, 30 layers' caches: 110-121 -> 80-90 ms
// at 100-600 tokens; one layer's cache 30 times at 100-250 tokens: 48-50 -> 36-40 ms. Same sums of the same
// products, in another order: results agree to float rounding. Its rows are read ahead by a plain pass of
// loads (read_rows), not by prefetch instructions as in the AVX-512 path (prefetch_row, below). A bf16 row is
// widened to fp32 as it is loaded (exact: the sums of the stored values' products, as over an fp32 cache holding
// them); half the bytes to read: the same 32 sequences of 125-250 tokens over 30 layers' scattered caches, one
// process, alternating, 21.8 against 31.2 ms (medians). Widening each row into fp32 scratch first, so that a key
// is widened once and not once per query head, was slower (31.2), and so was scoring three heads against four
// keys at a time to share the widening (22.4): the walk is not bound by the widening.
namespace avx2_path {

// 8 cache elements as fp32: an fp32 cache is read as is, a bf16 one (uint16 bits) widened exactly.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return from_bf16x8(p); }

// Eight dot products' 8-lane partial sums -> their eight totals, in order. By value, so that a caller's
// accumulators can stay in registers (an array whose address is taken is kept in memory).
__attribute__((always_inline)) inline __m256 reduce8(__m256 s0, __m256 s1, __m256 s2, __m256 s3, __m256 s4,
                                                     __m256 s5, __m256 s6, __m256 s7) {
  const __m256 a = _mm256_hadd_ps(s0, s1), b = _mm256_hadd_ps(s2, s3);
  const __m256 c = _mm256_hadd_ps(s4, s5), e = _mm256_hadd_ps(s6, s7);
  const __m256 ab = _mm256_hadd_ps(a, b), ce = _mm256_hadd_ps(c, e);
  // ab = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low and high 128-bit halves of the same four dots).
  const __m256 lo = _mm256_permute2f128_ps(ab, ce, 0x20), hi = _mm256_permute2f128_ps(ab, ce, 0x31);
  return _mm256_add_ps(lo, hi);
}

inline __m256 reduce8(const __m256* acc) {
  return reduce8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]);
}

// scores[t0 .. t0 + n) of one query head q against the keys k[0 .. 8) (a short tail repeats its last key).
template <typename KV>
inline void score_head(const float* q, const KV* const* k, int64_t d, float scale, int64_t n, float* scores) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    const __m256 qc = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qc, load8(k[i] + c), acc[i]);
  }
  const __m256 s = _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale));
  if (n == 8) {
    _mm256_storeu_ps(scores, s);
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, s);
    std::copy(tmp, tmp + n, scores);
  }
}

// out[j * d ..][0, 8 CN) = sum_t p[j * len + t] * values[t][col ..] for JN query heads, in token order.
template <typename KV, int JN, int CN>
void weighted_values(const float* p, int64_t len, const KV* const* values, int64_t col, int64_t d, float* out) {
  __m256 acc[JN * CN];
#pragma GCC unroll 8
  for (int i = 0; i < JN * CN; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    __m256 pj[JN];
#pragma GCC unroll 4
    for (int j = 0; j < JN; ++j) pj[j] = _mm256_set1_ps(p[j * len + t]);
#pragma GCC unroll 4
    for (int c = 0; c < CN; ++c) {
      const __m256 v = load8(values[t] + col + c * 8);
#pragma GCC unroll 4
      for (int j = 0; j < JN; ++j) acc[j * CN + c] = _mm256_fmadd_ps(pj[j], v, acc[j * CN + c]);
    }
  }
  for (int j = 0; j < JN; ++j)
    for (int c = 0; c < CN; ++c) _mm256_storeu_ps(out + j * d + c * 8, acc[j * CN + c]);
}

template <typename KV, int JN>
void weighted_values_cols(const float* p, int64_t len, const KV* const* values, int64_t col, int64_t cn,
                          int64_t d, float* out) {
  if (cn == 2) {
    weighted_values<KV, JN, 2>(p, len, values, col, d, out);
  } else {
    weighted_values<KV, JN, 1>(p, len, values, col, d, out);
  }
}

// Reads this head's d elements of every K and V row of the item, one load per cache line and no arithmetic
// on them, before the walk below. On the 2-core AVX2-only EPYC (Zen 3) the walk's prefetches, 32 rows ahead,
// did not hide its misses: with the rows read first and no prefetches, 32 sequences of 125-250 tokens over
// 30 layers' scattered caches took 16.7-23.9 ms against 26.4-31.1 (medians, in-process, both ways
// alternating in one process, six runs), 300-600 tokens 40.4-58.2 against 59.3-78.3, 8 sequences of
// 564-1,128 tokens 18.6-25.6 against 26.4-30.5 (docs/engine.md, "The AVX2-only EPYC again"). A pass of plain
// loads keeps many misses in flight at once (nothing waits on them), and the walk then finds its rows in L2
// (or L3, for contexts longer than L2 holds). The same bits either way.
template <typename KV>
void read_rows(const KV* const* rows, const KV* const* vrows, int64_t head, int64_t d, int64_t len) {
  constexpr int64_t kLine = 64 / sizeof(KV);  // elements per cache line
  __m256i sink = _mm256_setzero_si256();
  for (int64_t t = 0; t < len; ++t)
    for (int64_t c = head; c < head + d; c += kLine)
      sink = _mm256_add_epi32(sink, _mm256_add_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[t] + c)),
                                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrows[t] + c))));
  asm volatile("" : : "x"(sink));  // the loads are the point: claim the sum is used
}

// One (sequence, KV head) item: the g query heads' scores against `len` keys, their softmax, the values.
// rows[t] / vrows[t]: token t's K / V row (token_rows); this head's d elements start at `head`.
template <typename KV>
void attend(const float* q, int64_t g, int64_t d, const KV* const* rows, const KV* const* vrows, int64_t head,
            int64_t len, float scale, float* scores, float* out) {
  read_rows(rows, vrows, head, d, len);
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, len - t0);
    const KV* k[8];
    for (int64_t i = 0; i < 8; ++i) k[i] = rows[t0 + std::min(i, n - 1)] + head;
    for (int64_t j = 0; j < g; ++j) score_head(q + j * d, k, d, scale, n, scores + j * len + t0);
  }
  for (int64_t j = 0; j < g; ++j) softmax(scores + j * len, len);
  for (int64_t j0 = 0; j0 < g; j0 += 3) {  // at most 3 heads x 2 chunks = 6 accumulators at a time
    const int64_t jn = std::min<int64_t>(3, g - j0);
    for (int64_t col = 0; col < d; col += 16) {
      const int64_t cn = std::min<int64_t>(2, (d - col) / 8);
      const float* pj = scores + j0 * len;
      float* oj = out + j0 * d + col;
      switch (jn) {
        case 1: weighted_values_cols<KV, 1>(pj, len, vrows, head + col, cn, d, oj); break;
        case 2: weighted_values_cols<KV, 2>(pj, len, vrows, head + col, cn, d, oj); break;
        default: weighted_values_cols<KV, 3>(pj, len, vrows, head + col, cn, d, oj); break;
      }
    }
  }
}

}  // namespace avx2_path

#ifdef __AVX512F__
// The AVX-512 path: the AVX2 one's shape on 16 lanes and 32 registers, with a bf16 cache too. Eight keys'
// partial sums are reduced together (hadd tree), and the weighted sum of the values keeps every output row
// of the query heads in registers across the whole context. Same sums of the same products as the AVX2
// path, in another order: results agree to float rounding.

// Rows are asked for into L2, not L1: a core has far fewer L1 misses in flight than L2 ones, and the
// walk over scattered blocks is bound by how many rows are on their way (2-core AVX-512 BF16 EPYC, 32
// sequences of 100-200 tokens, 30 layers: 16.7 ms with L1 prefetches 8 tokens ahead, 11.9 with L2 ones 32
// ahead, 10.6-11.1 with the next sequence's rows asked for too; the same results bit for bit).
template <typename KV>
inline void prefetch_row(const KV* row, int64_t from, int64_t to) {
  constexpr int64_t kLine = 64 / sizeof(KV);  // elements per cache line
  for (int64_t c = from; c < to; c += kLine) _mm_prefetch(reinterpret_cast<const char*>(row + c), _MM_HINT_T1);
}

// How far ahead of the score walk a sequence's own K and V rows are asked for, in tokens.
constexpr int64_t kRowsAhead = 32;

// softmax() with the max, the e^x and the scaling 16 lanes at a time (exp16_ps gives exp_ps's values lane by
// lane) and the sum added in softmax()'s 8-lane order: the same probabilities, bit for bit, in fewer ops.
void softmax16(float* s, int64_t len) {
  __m512 vmx16 = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) vmx16 = _mm512_max_ps(vmx16, _mm512_loadu_ps(s + t));
  float mx = _mm512_reduce_max_ps(vmx16);
  for (; t < len; ++t) mx = std::max(mx, s[t]);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  t = 0;
  for (; t + 16 <= len; t += 16) {
    const __m512 e = exp16_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), vmx));
    _mm512_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, _mm512_castps512_ps256(e));
    vsum = _mm256_add_ps(vsum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
  const float inv = 1.0f / exp_sum_from(s, t, len, mx, vsum);
  const __m512 vinv = _mm512_set1_ps(inv);
  t = 0;
  for (; t + 16 <= len; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), vinv));
  for (; t < len; ++t) s[t] *= inv;
}

// A 16-lane partial sum folded to 8 lanes (its low half plus its high half).
__attribute__((always_inline)) inline __m256 fold8(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

// Eight dot products' 16-lane partial sums -> their eight totals, in order: each folded to 8 lanes, then the
// AVX2 path's tree.
__attribute__((always_inline)) inline __m256 reduce8(const __m512 (&acc)[8]) {
  return avx2_path::reduce8(fold8(acc[0]), fold8(acc[1]), fold8(acc[2]), fold8(acc[3]), fold8(acc[4]), fold8(acc[5]),
                            fold8(acc[6]), fold8(acc[7]));
}

// 16 cache elements as fp32: an fp32 cache is read as is, a bf16 one (uint16 bits) widened exactly.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// The rows of the sequence a thread takes next, asked for while it scores the current one: spread over
// the current walk, so that its first rows are not waited for. Empty (len 0) for a thread's last item.
template <typename KV>
struct NextRows {
  const KV* const* k;
  const KV* const* v;
  int64_t len;
  int64_t row_elems;  // every KV head's elements: the next item may start at another head
};

// scores[(kvh * g + j) * len + t] = (q_{kvh,j} . key_{t,kvh}) * scale for the KV heads [kv0, kv1) of one
// sequence and the g query heads of each; `rows[t]` is token t's row of the cache (all KV heads, each
// d elements), d % 16 == 0. Rows are read whole, in token order, asked for ahead (decode_scores):
// the blocks are scattered over the pool and a row is read from memory, not cache.
// Up to three query heads of one KV head against eight keys: each 16-lane chunk of a key is widened to fp32
// once and multiplied by every head's query chunk (24 accumulators, 3 query chunks and the key chunk fit
// the 32 registers). Each accumulator sums the same products in the same order as one head at a time.
// NV (d / 16) is a template argument for the common head sizes: with the chunk loop unrolled and every
// index a constant, GCC keeps the 24 accumulators in registers. With a runtime nv it kept them on the stack
// (zeroed there, stored after the products and loaded again for the sums: half as many 64-byte stores as
// FMAs, and a call per eight keys). NV 0: nv at run time.
template <typename KV, int G, int NV>
__attribute__((always_inline)) inline void score_heads(const float* q, const KV* const* k, int64_t nv, float scale,
                                                       int64_t len, int64_t n, float* scores) {
  if constexpr (NV > 0) nv = NV;
  __m512 acc[G][8];
#pragma GCC unroll 3
  for (int j = 0; j < G; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[j][i] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int64_t c = 0; c < nv; ++c) {
    __m512 qc[G];
#pragma GCC unroll 3
    for (int j = 0; j < G; ++j) qc[j] = _mm512_loadu_ps(q + j * nv * 16 + c * 16);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m512 kc = load16(k[i] + c * 16);
#pragma GCC unroll 3
      for (int j = 0; j < G; ++j) acc[j][i] = _mm512_fmadd_ps(qc[j], kc, acc[j][i]);
    }
  }
  const __mmask8 tail = static_cast<__mmask8>((1u << n) - 1u);  // n in [1, 8]
#pragma GCC unroll 3
  for (int j = 0; j < G; ++j)
    _mm256_mask_storeu_ps(scores + j * len, tail, _mm256_mul_ps(reduce8(acc[j]), _mm256_set1_ps(scale)));
}

// score_heads for `heads` (1-3) query heads of one KV head: the count as a template argument.
template <typename KV, int NV>
inline void score_group(const float* q, const KV* const* k, int64_t heads, int64_t nv, float scale, int64_t len,
                        int64_t n, float* scores) {
  switch (heads) {
    case 1: score_heads<KV, 1, NV>(q, k, nv, scale, len, n, scores); break;
    case 2: score_heads<KV, 2, NV>(q, k, nv, scale, len, n, scores); break;
    default: score_heads<KV, 3, NV>(q, k, nv, scale, len, n, scores); break;
  }
}

// Asks for K rows kRowsAhead tokens ahead and V rows as far ahead (the value walk then finds them in L2),
// and for `next`'s rows a share per group of eight keys.
template <typename KV>
void decode_scores(const float* q, int64_t kv0, int64_t kv1, int64_t g, int64_t d, const KV* const* rows,
                   const KV* const* vrows, int64_t len, float scale, float* scores, const NextRows<KV>& next) {
  const int64_t nv = d / 16;
  const int64_t groups = (len + 7) / 8, next_per_group = (next.len + groups - 1) / groups;
  for (int64_t i = 0; i < std::min(kRowsAhead, len); ++i) {
    prefetch_row(rows[i], kv0 * d, kv1 * d);
    prefetch_row(vrows[i], kv0 * d, kv1 * d);
  }
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, len - t0);
    for (int64_t i = t0 + kRowsAhead; i < std::min(t0 + kRowsAhead + 8, len); ++i) {
      prefetch_row(rows[i], kv0 * d, kv1 * d);
      prefetch_row(vrows[i], kv0 * d, kv1 * d);
    }
    for (int64_t i = t0 / 8 * next_per_group; i < std::min((t0 / 8 + 1) * next_per_group, next.len); ++i) {
      prefetch_row(next.k[i], 0, next.row_elems);
      prefetch_row(next.v[i], 0, next.row_elems);
    }
    for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
      const KV* k[8];
      for (int64_t i = 0; i < 8; ++i) k[i] = rows[t0 + std::min(i, n - 1)] + kvh * d;  // a short tail repeats its last key
      for (int64_t j = kvh * g; j < (kvh + 1) * g; j += 3) {
        const float* qj = q + j * d;
        float* sj = scores + j * len + t0;
        const int64_t heads = std::min<int64_t>(3, (kvh + 1) * g - j);
        switch (nv) {
          case 4: score_group<KV, 4>(qj, k, heads, nv, scale, len, n, sj); break;
          case 8: score_group<KV, 8>(qj, k, heads, nv, scale, len, n, sj); break;
          default: score_group<KV, 0>(qj, k, heads, nv, scale, len, n, sj); break;
        }
      }
    }
  }
}

// CN 16-element chunks of a cache row as fp32. A bf16 row's chunks 2m and 2m+1 come from one 64-byte load
// as the even and the odd elements of its 32 (a shift and a mask: two ops for 32 elements where widening
// takes two for 16, on the two ports the FMAs need too); store_chunks puts sums of such chunks back in order.
template <typename KV, int CN>
inline void load_chunks(const KV* row, __m512* v) {
  int c = 0;
  if constexpr (std::is_same_v<KV, uint16_t>) {
    for (; c + 1 < CN; c += 2) {
      const __m512i raw = _mm512_loadu_si512(row + c * 16);
      v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      v[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    }
  }
  for (; c < CN; ++c) v[c] = load16(row + c * 16);
}

template <typename KV, int CN>
inline void store_chunks(const __m512* acc, float* out) {
  int c = 0;
  if constexpr (std::is_same_v<KV, uint16_t>) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (; c + 1 < CN; c += 2) {
      _mm512_storeu_ps(out + c * 16, _mm512_permutex2var_ps(acc[c], lo, acc[c + 1]));
      _mm512_storeu_ps(out + c * 16 + 16, _mm512_permutex2var_ps(acc[c], hi, acc[c + 1]));
    }
  }
  for (; c < CN; ++c) _mm512_storeu_ps(out + c * 16, acc[c]);
}

// out[j] = sum_t p[j * len + t] * value_t for JN query heads and CN 16-element chunks of d starting at
// `col`; every accumulator stays in a register for the whole walk over the context (decode_scores asked
// for the rows). Each output sums its products in token order whatever the chunks' lane order.
template <typename KV, int JN, int CN>
void weighted_values(const float* p, int64_t len, const KV* const* values, int64_t col, int64_t d, float* out) {
  __m512 acc[JN][CN];
  for (int j = 0; j < JN; ++j)
    for (int c = 0; c < CN; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    __m512 v[CN];
    load_chunks<KV, CN>(values[t] + col, v);
    for (int j = 0; j < JN; ++j) {
      const __m512 pj = _mm512_set1_ps(p[j * len + t]);
      for (int c = 0; c < CN; ++c) acc[j][c] = _mm512_fmadd_ps(pj, v[c], acc[j][c]);
    }
  }
  for (int j = 0; j < JN; ++j) store_chunks<KV, CN>(acc[j], out + j * d + col);
}

template <typename KV, int JN>
void weighted_values_cols(const float* p, int64_t len, const KV* const* values, int64_t col, int64_t cn, int64_t d,
                          float* out) {
  switch (cn) {
    case 1: weighted_values<KV, JN, 1>(p, len, values, col, d, out); break;
    case 2: weighted_values<KV, JN, 2>(p, len, values, col, d, out); break;
    case 3: weighted_values<KV, JN, 3>(p, len, values, col, d, out); break;
    default: weighted_values<KV, JN, 4>(p, len, values, col, d, out); break;
  }
}

// out[kvh * g + j] = sum_t p[(kvh * g + j) * len + t] * value_{t,kvh} for the KV heads [kv0, kv1).
template <typename KV>
void decode_values(const float* p, int64_t kv0, int64_t kv1, int64_t g, int64_t d, const KV* const* rows,
                   int64_t len, float* out, std::vector<const KV*>& shifted) {
  shifted.resize(static_cast<size_t>(len));
  for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
    for (int64_t t = 0; t < len; ++t) shifted[t] = rows[t] + kvh * d;
    for (int64_t j0 = 0; j0 < g; j0 += 4) {  // at most 4 heads x 4 chunks = 16 accumulators at a time
      const int64_t jn = std::min<int64_t>(4, g - j0);
      for (int64_t col = 0; col < d; col += 64) {
        const int64_t cn = std::min<int64_t>(4, (d - col) / 16);
        const float* pj = p + (kvh * g + j0) * len;
        float* oj = out + (kvh * g + j0) * d;
        switch (jn) {
          case 1: weighted_values_cols<KV, 1>(pj, len, shifted.data(), col, cn, d, oj); break;
          case 2: weighted_values_cols<KV, 2>(pj, len, shifted.data(), col, cn, d, oj); break;
          case 3: weighted_values_cols<KV, 3>(pj, len, shifted.data(), col, cn, d, oj); break;
          default: weighted_values_cols<KV, 4>(pj, len, shifted.data(), col, cn, d, oj); break;
        }
      }
    }
  }
}

template <typename KV>
void paged_decode_avx512(const float* q, int64_t b, int64_t h, int64_t d, const KV* k_cache, const KV* v_cache,
                         int64_t block_size, int64_t hkv, const int64_t* tables, int64_t max_blocks,
                         const int64_t* lens, float scale, float* out) {
  const int64_t g = h / hkv, token_stride = hkv * d;
  // Items are (sequence, KV head) pairs handed out by cost (item_cost). A thread walks the heads of a
  // sequence it holds together, reading each row once, in order.
  parallel_for_by_cost(
      b * hkv, [&](int64_t item) { return item_cost(lens, hkv, item); },
      [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        std::vector<const KV*> krows, vrows, next_k, next_v, shifted;
        const auto rows_of = [&](int64_t seq, std::vector<const KV*>& k, std::vector<const KV*>& v) {
          token_rows(k_cache, v_cache, tables + seq * max_blocks, lens[seq], block_size, token_stride, k, v);
        };
        rows_of(begin / hkv, next_k, next_v);
        for (int64_t item = begin; item < end;) {
          const int64_t seq = item / hkv, len = lens[seq];
          const int64_t kv0 = item % hkv, kv1 = std::min<int64_t>(hkv, kv0 + (end - item));
          item += kv1 - kv0;
          std::swap(krows, next_k);
          std::swap(vrows, next_v);
          if (item < end) rows_of(item / hkv, next_k, next_v);
          const NextRows<KV> next{next_k.data(), next_v.data(), item < end ? lens[item / hkv] : 0, token_stride};
          scores.resize(static_cast<size_t>(h * len));
          const float* qs = q + seq * h * d;
          decode_scores(qs, kv0, kv1, g, d, krows.data(), vrows.data(), len, scale, scores.data(), next);
          for (int64_t j = kv0 * g; j < kv1 * g; ++j) softmax16(scores.data() + j * len, len);
          decode_values(scores.data(), kv0, kv1, g, d, vrows.data(), len, out + seq * h * d, shifted);
        }
      });
}
#endif

// The AVX2 walk over the items, by cost, as the AVX-512 one hands them out.
template <typename KV>
void paged_decode_avx2(const float* q, int64_t b, int64_t h, int64_t d, const KV* k_cache, const KV* v_cache,
                       int64_t block_size, int64_t hkv, const int64_t* tables, int64_t max_blocks,
                       const int64_t* lens, float scale, float* out) {
  const int64_t g = h / hkv, token_stride = hkv * d;
  const auto cost = [&](int64_t item) { return item_cost(lens, hkv, item); };
  parallel_for_by_cost(b * hkv, cost, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const KV*> krows, vrows;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t seq = job / hkv, kvh = job % hkv, len = lens[seq];
      if (job == begin || kvh == 0)  // a sequence's rows once for all the KV heads this thread takes
        token_rows(k_cache, v_cache, tables + seq * max_blocks, len, block_size, token_stride, krows, vrows);
      scores.resize(static_cast<size_t>(g * len));
      avx2_path::attend(q + (seq * h + kvh * g) * d, g, d, krows.data(), vrows.data(), kvh * d, len, scale,
                        scores.data(), out + (seq * h + kvh * g) * d);
    }
  });
}

}  // namespace

void paged_decode(const float* q, int64_t b, int64_t h, int64_t d, const float* k_cache, const float* v_cache,
                  int64_t num_blocks, int64_t block_size, int64_t hkv, const int64_t* tables, int64_t max_blocks,
                  const int64_t* lens, float scale, float* out) {
#ifdef __AVX512F__
  if (d % 16 == 0) {
    paged_decode_avx512(q, b, h, d, k_cache, v_cache, block_size, hkv, tables, max_blocks, lens, scale, out);
    return;
  }
#endif
  paged_decode_avx2(q, b, h, d, k_cache, v_cache, block_size, hkv, tables, max_blocks, lens, scale, out);
}

void paged_decode_bf16(const float* q, int64_t b, int64_t h, int64_t d, const uint16_t* k_cache,
                       const uint16_t* v_cache, int64_t block_size, int64_t hkv, const int64_t* tables,
                       int64_t max_blocks, const int64_t* lens, float scale, float* out) {
  TORCH_CHECK(d % 16 == 0, "a bf16 cache needs head_dim % 16 == 0");
#ifdef __AVX512F__
  paged_decode_avx512(q, b, h, d, k_cache, v_cache, block_size, hkv, tables, max_blocks, lens, scale, out);
#else
  paged_decode_avx2(q, b, h, d, k_cache, v_cache, block_size, hkv, tables, max_blocks, lens, scale, out);
#endif
}

namespace {

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: contiguous fp32 [B, H, D]");
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(k_cache.dim() == 4 && (k_cache.scalar_type() == torch::kFloat32 || bf16) &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type() && v_cache.is_contiguous(),
              "k/v_cache: contiguous [num_blocks, block_size, Hkv, D], fp32 or bf16");
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
  if (bf16) {
    paged_decode_bf16(q.data_ptr<float>(), b, h, d, reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                      reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), bs, hkv, tables, max_blocks, lens,
                      static_cast<float>(scale), out.data_ptr<float>());
    return out;
  }
  paged_decode(q.data_ptr<float>(), b, h, d, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), num_blocks, bs,
               hkv, tables, max_blocks, lens, static_cast<float>(scale), out.data_ptr<float>());
  return out;
}

}  // namespace
}  // namespace sluice

void register_paged_attention(pybind11::module& m) {
  m.def("paged_decode_attention", &sluice::paged_decode_attention,
        "q [B, H, D] over the paged fp32 (or bf16) KV cache -> [B, H, D]");
}
