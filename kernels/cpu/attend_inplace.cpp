// Few query rows per kv head (decode, short verify): dot products over tiles of BLOCK_N keys read in place, a unit
// taking every kv head and reading runs of positions in order (a position's Hkv * D elements lie together; see
// STREAMS). fp8 rows are read in place one byte per element and widened in registers (fp8.h); the query rows hold
// the scale and the kv head's k_scale, and unit.cpp applies v_scale to the output. bf16 rows, where the build has
// AVX512-BF16 (bf16_pairs), multiply in bf16 pairs without widening: q . k from q's own bf16 values, the scale applied
// to the scores, and P V with the probabilities rounded to bf16.

#include "kernel.h"
#include "sums4x4.h"

namespace hybrid_ops::cpu {
namespace {

// A unit of every kv head reads a whole tile as STREAMS runs of BLOCK_N / STREAMS consecutive positions side by side
// (attend_tile): where a cache page holds a run, each run is one stream of rising addresses, which the hardware
// prefetcher follows ahead of the arithmetic; it stops at a 4 KiB page of memory, which one position of 8 fp32 heads
// fills.
constexpr int64_t STREAMS = 8;

// The rows a loop prefetches into L2 a line at a time as it reads the same line of its own rows: V's beside K's, the
// next tile's K beside V's (attend_tile), no shorter than the rows read. In P V, key j's counterpart is rows[j - shift]
// + offset, for j - shift < n. In the scores, a loop that prefetches (PREFETCH) does so for every key with no branch,
// V's row lying a constant distance from K's (delta): a branch at each prefetch costs the scores' loop more than it
// saves. A line per line read keeps a steady number of reads from memory in flight under the arithmetic, where
// prefetches issued a slice at a time ahead leave the core waiting; fp8 rows prefetch a slice at a time
// (prefetch_rows), as their decode runs faster so.
//
// Each line read of a run's position also prefetches the same line of the run's next position (ahead), which the next
// pass reads: a line prefetched a tile ahead is not always in L2 when read (some cores drop PREFETCHT1), and the read
// then waits on memory, where a model's step finds each layer's cache (every other layer's weights and cache read
// between two steps).
template <typename R>
constexpr bool line_by_line = !is_fp8<R>;
template <typename R>
struct Beside {
  const R* const* rows = nullptr;  // P V's counterparts (null, n 0: none)
  int64_t shift = 0, n = 0, offset = 0;
  int64_t ahead = 0;    // elements from a row read to the next position's in its run (0: none)
  uintptr_t delta = 0;  // the scores': bytes from a K row to its V row (0: none, the K row's own lines again)
  // Key j's counterpart in P V (null: none). Loops find it once per key, not at each prefetch, where the look-up would
  // cost time from memory.
  [[gnu::always_inline]] const R* row(int64_t j) const {
    return line_by_line<R> && j - shift < n ? rows[j - shift] + offset : nullptr;
  }
  // The lines of a counterpart's elements [d, d + COUNT), where d is a multiple of COUNT, as the same elements of a row
  // are read: a line once where COUNT elements are less than one. Counterparts no shorter than the rows read keep every
  // address in the row, so that no prefetch checks a bound.
  template <int64_t COUNT>
  [[gnu::always_inline]] void prefetch(const R* row, int64_t d) const {
    constexpr int64_t LINE = 64 / sizeof(R);  // elements a line
    if (!line_by_line<R> || row == nullptr || (COUNT < LINE && d % LINE != 0)) return;
    for (int64_t c = 0; c < std::max(COUNT, LINE); c += LINE) __builtin_prefetch(row + d + c, 0, 2);
  }
  // The lines of the next position in the run of a row read, as prefetch: its elements [d, d + COUNT).
  template <int64_t COUNT>
  [[gnu::always_inline]] void prefetch_ahead(const R* row, int64_t d) const {
    if (ahead != 0) prefetch<COUNT>(row + ahead, d);
  }
  // The scores' prefetches as K row k's elements [d, d + COUNT) are read: its V row's, and its next position's (with
  // no ahead, its own), with no branch. V's row is an address only prefetched, in another allocation.
  template <int64_t COUNT>
  [[gnu::always_inline]] void prefetch_keyed(const R* k, int64_t d) const {
    prefetch<COUNT>(reinterpret_cast<const R*>(reinterpret_cast<uintptr_t>(k) + delta), d);
    prefetch<COUNT>(k + ahead, d);
  }
};

// Blocked scores come from a whole tile of STREAMS runs, whose passes take keys BLOCKED_KS apart: a constant, so that a
// key's block is a shift and a mask, not a division by the passes' stride (two each 4 keys in the scores, one each pair
// in P V).
constexpr int64_t BLOCKED_KS = BLOCK_N / STREAMS;

// The passes that a unit of `heads` kv heads takes over a tile of n keys (attend_tile): one key of each of the STREAMS
// runs a pass in a whole tile of several heads, else one pass over every key.
inline int64_t tile_passes(int64_t heads, int64_t n) { return heads > 1 && n == BLOCK_N ? BLOCK_N / STREAMS : 1; }

// The place of keys j, j + ks, j + 2 ks, j + 3 ks (ks = BLOCKED_KS, j >= 0) among a whole tile's blocks of 4 keys
// (blocked scores): pass j % ks's BLOCK_N / ks keys in blocks of 4, pass after pass.
inline int64_t score_block(int64_t j) {
  const uint64_t key = j;  // unsigned: a shift and a mask
  return key % BLOCKED_KS * (BLOCK_N / BLOCKED_KS / 4) + key / BLOCKED_KS / 4;
}

// The place of the pairs of keys (j, j + ks) among a whole tile's blocked pairs (softmax_pairs_blocked): block
// score_block(j), its pairs k = j / ks % 4 / 2.
inline int64_t pair_place(int64_t j) {
  const uint64_t key = j;
  return 8 * score_block(j) + 4 * (key / BLOCKED_KS % 4 / 2);
}

// The RB x KB sums acc[r][c] into scores[r * BLOCK_N + j + c * ks]: row r's score of key j + c * ks. Blocked (4 x 4
// sums only): the 4 rows' scores as one vector a block of keys, row r's score of key j + c * ks in lane 4 c + r of
// scores[16 * score_block(j)...].
template <int RB, int KB>
[[gnu::always_inline]] inline void store_scores(const Vec (&acc)[RB][KB], int64_t j, int64_t ks, bool blocked,
                                                float* scores) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (RB == 4 && KB == 4) {
    // The 16 sums in one reduction (sums4x4.h), then one vector store (blocked) or 16 scalar stores: the scatter of one
    // vector stalls the loads after it.
    __m512 a[4][4];
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 4; ++c) a[r][c] = acc[r][c];
    if (blocked) {
      _mm512_storeu_ps(scores + 16 * score_block(j), sums_4x4(a));
      return;
    }
    alignas(64) float sums[16];  // sums[4 c + r]: row r's score of key j + c * ks
    _mm512_store_ps(sums, sums_4x4(a));
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 4; ++c) scores[r * BLOCK_N + j + c * ks] = sums[4 * c + r];
    return;
  }
#endif
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KB; ++c) scores[r * BLOCK_N + j + c * ks] = hsum(acc[r][c]);
}

// scores[r, j] = q[r] . k_j for RB rows (few rows: decode, verify), KB keys j + c * ks at a time: one load of each K
// chunk serves the RB rows, and RB x KB independent accumulators keep the FMA units busy. Key j's row is at k[j] +
// offset (offset: a kv head's place in the rows of every head). Always inlined, as accumulate_pv: decode is slower
// where the compiler does not inline them. fp8 rows are widened a vector at a time here even where a load widens 4
// (row_vecs): a key's 4 vectors in turn would take 4 times the query loads, and 2 keys at a time halve the key block.
template <int RB, int KB, bool PREFETCH, typename R>
[[gnu::always_inline]] inline void scores_dot_keys(const float* q, int64_t dim, const R* const* k, int64_t j,
                                                   int64_t ks, int64_t offset, const Beside<R>& beside, bool blocked,
                                                   float* scores) {
  Vec acc[RB][KB];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KB; ++c) acc[r][c] = Vec(0.f);
  const R* keys[KB];
  for (int c = 0; c < KB; ++c) keys[c] = k[j + c * ks] + offset;
  for (int64_t d = 0; d < dim; d += VEC) {
    Vec kv[KB];
    for (int c = 0; c < KB; ++c) {
      kv[c] = load_row(keys[c] + d);
      if constexpr (PREFETCH) beside.template prefetch_keyed<VEC>(keys[c], d);
    }
    for (int r = 0; r < RB; ++r) {
      const Vec qv = Vec::loadu(q + r * dim + d);
      for (int c = 0; c < KB; ++c) acc[r][c] = at::vec::fmadd(qv, kv[c], acc[r][c]);
    }
  }
  store_scores(acc, j, ks, blocked, scores);
}

#ifdef HYBRID_OPS_BF16_PAIRS
// bf16 rows of q (unscaled) times bf16 keys, 32 products at a time in pairs (vdpbf16ps: each product exact in fp32,
// the pair summed into the accumulator, to nearest even): a key's chunk is one load and no widening, and one
// instruction takes the products of two FMAs. A head dim that is an odd number of 16s ends with half a chunk.
template <int RB, int KB, bool PREFETCH>
[[gnu::always_inline]] inline void scores_dot_keys(const at::BFloat16* q, int64_t dim, const at::BFloat16* const* k,
                                                   int64_t j, int64_t ks, int64_t offset,
                                                   const Beside<at::BFloat16>& beside, bool blocked, float* scores) {
  Vec acc[RB][KB];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KB; ++c) acc[r][c] = Vec(0.f);
  const at::BFloat16* keys[KB];
  for (int c = 0; c < KB; ++c) keys[c] = k[j + c * ks] + offset;
  const auto chunk = [&](int64_t d, __mmask32 lanes) {
    __m512bh kv[KB];
    for (int c = 0; c < KB; ++c) {
      kv[c] = (__m512bh)_mm512_maskz_loadu_epi16(lanes, keys[c] + d);
      if constexpr (PREFETCH) beside.template prefetch_keyed<32>(keys[c], d);
    }
    for (int r = 0; r < RB; ++r) {
      const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(lanes, q + r * dim + d);
      for (int c = 0; c < KB; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv, kv[c]);
    }
  };
  int64_t d = 0;
  for (; d + 32 <= dim; d += 32) chunk(d, ~__mmask32(0));
  if (d < dim) chunk(d, 0xFFFF);
  store_scores(acc, j, ks, blocked, scores);
}

// The probabilities of a row's pairs of keys (j, j + ks), j in [a, b): p[j] in the low 16 bits and p[j + ks] (0 from
// b on) in the high, each rounded to bf16 (to nearest even), as flash attention rounds them for P V.
inline void pair_probs(const float* p, int64_t a, int64_t b, int64_t ks, uint32_t* pairs) {
  for (int64_t j = a & ~int64_t(15); j < b; j += 16) {
    const __mmask16 second = _cvtu32_mask16(b - j - ks >= 16 ? 0xFFFF : b - j - ks > 0 ? (1u << (b - j - ks)) - 1 : 0);
    const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + j));
    const __m256i hi = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(second, p + j + ks));
    _mm512_storeu_si512(pairs + j,
                        _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16)));
  }
}

// Lanes 4 c + r of x reduced over c by op: every 128-bit lane then holds row r's result in its lane r.
template <typename Op>
[[gnu::always_inline]] inline __m512 over_keys(__m512 x, Op op) {
  x = op(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  return op(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
}

// softmax_tile and pair_probs for the scratch rows [0, rows) (4 a row block) of a whole tile of blocked scores (no
// soft-cap, and every row sees every key): the pairs of block b, (j, j + ks) for j = j0 + 2 k ks (k = 0, 1; j0 the
// block's first key), row r's at pairs[8 b + 4 k + r] of its row block's. A block's 16 scores are one vector (key j0 +
// c ks and row r in lane 4 c + r), so the 4 rows' maxima and sums are elementwise over the tile's 16 vectors and two
// steps across 128-bit lanes (over_keys), not a reduction a row.
template <typename T, typename C>
void softmax_pairs_blocked(const Problem<T, C>& pb, int64_t rows, Scratch<T, C>& s) {
  constexpr int64_t BLOCKS = BLOCK_N / 4;
  // Word 2 (4 k + r) + i of a block's pairs: the bf16 of key j0 + (2 k + i) ks, row r (lane 4 (2 k + i) + r).
  const __m256i pair_words = _mm256_setr_epi16(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  const __m512 scale = _mm512_set1_ps(pb.scale);
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    const float* sc = s.scores.data() + r0 * BLOCK_N;
    __m512 mx = _mm512_set1_ps(NEG_INF);
    for (int64_t b = 0; b < BLOCKS; ++b) mx = _mm512_max_ps(mx, _mm512_mul_ps(_mm512_loadu_ps(sc + 16 * b), scale));
    const __m512 tile_max = over_keys(mx, [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); });
    const __m512 m_old = _mm512_broadcast_f32x4(_mm_loadu_ps(s.m.data() + r0));
    const __m512 m_new = _mm512_max_ps(m_old, tile_max);
    // As softmax_tile: a row whose scores are all -inf keeps its sum (exp(-inf - -inf) is NaN where it had no maximum
    // yet) and takes no probability.
    const __mmask16 none = _mm512_cmp_ps_mask(tile_max, _mm512_set1_ps(NEG_INF), _CMP_EQ_OQ);
    const __m512 alpha = _mm512_mask_blend_ps(none, Vec(Vec(m_old) - Vec(m_new)).exp(), _mm512_set1_ps(1.f));
    const __m512 minus_m = _mm512_sub_ps(_mm512_setzero_ps(), m_new);
    uint32_t* pairs = s.p_pairs.data() + r0 * BLOCK_N;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t b = 0; b < BLOCKS; ++b) {
      const __m512 e =
          _mm512_maskz_mov_ps(~none, Vec(_mm512_fmadd_ps(_mm512_loadu_ps(sc + 16 * b), scale, minus_m)).exp_u20());
      sum = _mm512_add_ps(sum, e);
      const __m256i words = (__m256i)_mm512_cvtneps_pbh(e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + 8 * b), _mm256_permutexvar_epi16(pair_words, words));
    }
    sum = over_keys(sum, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
    alignas(64) float lanes[3][16];
    _mm512_store_ps(lanes[0], m_new);
    _mm512_store_ps(lanes[1], alpha);
    _mm512_store_ps(lanes[2], sum);
    for (int64_t r = 0; r < 4; ++r) {
      s.m[r0 + r] = lanes[0][r];
      s.l[r0 + r] = s.l[r0 + r] * lanes[1][r] + lanes[2][r];
      rescale_acc(s, r0 + r, pb.v_padded_dim, lanes[1][r]);
    }
  }
}

// P V's sums of RB rows and CH chunks of 32 values from d0, in accumulate_pv_pairs' order (below), from and to the
// accumulators, rows dim apart.
template <int RB, int S>
[[gnu::always_inline]] inline void load_sums(const float* acc, int64_t dim, int64_t d0, __m512 (&sum)[RB][S]) {
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < S; ++c) sum[r][c] = _mm512_loadu_ps(acc + r * dim + d0 + 16 * c);
}
template <int RB, int S>
[[gnu::always_inline]] inline void store_sums(const __m512 (&sum)[RB][S], int64_t dim, int64_t d0, float* acc) {
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < S; ++c) _mm512_storeu_ps(acc + r * dim + d0 + 16 * c, sum[r][c]);
}

// sum[r] += the pair of keys' probabilities for row r (pair[r * stride]) times their CH chunks of 32 values at first
// and second: the two keys' chunks interleaved, 16-bit value by value within each 128-bit lane (vpunpck*wd), and one
// vdpbf16ps per row and 16 values takes both keys.
template <int RB, int CH>
[[gnu::always_inline]] inline void pv_pair(const uint32_t* pair, int64_t stride, const at::BFloat16* first,
                                           const at::BFloat16* second, __m512 (&sum)[RB][2 * CH]) {
  __m512bh vv[2 * CH];
  for (int c = 0; c < CH; ++c) {
    const __m512i x = _mm512_loadu_si512(first + 32 * c), y = _mm512_loadu_si512(second + 32 * c);
    vv[2 * c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
    vv[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
  }
  for (int r = 0; r < RB; ++r) {
    const __m512bh pr = (__m512bh)_mm512_set1_epi32(pair[r * stride]);
    for (int c = 0; c < 2 * CH; ++c) sum[r][c] = _mm512_dpbf16_ps(sum[r][c], pr, vv[c]);
  }
}

// acc[r] += sum_j p[r, j] v_j over CH chunks of 32 values of the head dim from d0, for pairs of keys (j, j + ks), j =
// a, a + 2 ks, ... below b (a last key alone pairs with itself at probability 0), a pair at a time (pv_pair). The
// accumulators hold each chunk's values in pv_pair's order: values 0-3, 8-11, 16-19, 24-27 of the chunk, then the rest
// (pair_order_to_values puts them back). BLOCKED: the pairs stored blocked (softmax_pairs_blocked).
template <int RB, int CH, bool BLOCKED>
[[gnu::always_inline]] inline void accumulate_pv_pairs(const uint32_t* pairs, const at::BFloat16* const* v, int64_t a,
                                                       int64_t b, int64_t ks, int64_t offset,
                                                       const Beside<at::BFloat16>& beside, int64_t d0, int64_t dim,
                                                       float* acc) {
  __m512 sum[RB][2 * CH];
  load_sums(acc, dim, d0, sum);
  for (int64_t j = a; j < b; j += 2 * ks) {
    const at::BFloat16* first = v[j] + offset + d0;
    const at::BFloat16* second = (j + ks < b ? v[j + ks] : v[j]) + offset + d0;
    beside.template prefetch<32 * CH>(beside.row(j), d0);
    beside.template prefetch<32 * CH>(beside.row(j + ks), d0);
    beside.template prefetch_ahead<32 * CH>(v[j] + offset, d0);
    beside.template prefetch_ahead<32 * CH>(v[j + ks < b ? j + ks : j] + offset, d0);
    pv_pair<RB, CH>(BLOCKED ? pairs + pair_place(j) : pairs + j, BLOCKED ? 1 : BLOCK_N, first, second, sum);
  }
  store_sums(sum, dim, d0, acc);
}

// The next tile's K rows prefetched 256 bytes a step (a row of a head dim of 128, or half of one of 256) in the order
// that its scores read them: pass after pass, in each every head in turn, its keys p, p + passes, ... for pass p
// (attend_tile). P V by head (pv_pairs_by_head) steps once a pair of keys and 64 values: with V's rows as long as K's,
// as many steps as the next tile's K has 256 bytes.
struct NextKeyRows {
  const at::BFloat16* const* rows = nullptr;                                    // the next tile's
  int64_t head_stride = 0, passes = 0, per_pass = 0, heads = 0, row_bytes = 0;  // passes 0: none
  int64_t pass = 0, head = 0, i = 0, at = 0;  // the next 256 bytes: row pass + passes * i of head, from byte at
  [[gnu::always_inline]] void step() {
    if (pass == passes) return;
    const char* line = reinterpret_cast<const char*>(rows[pass + passes * i] + head * head_stride) + at;
    for (int c = 0; c < 256; c += 64) __builtin_prefetch(line + c, 0, 2);
    if ((at += 256) < row_bytes) return;
    at = 0;
    if (++i < per_pass) return;
    i = 0;
    if (++head < heads) return;
    head = 0;
    ++pass;
  }
};

// acc[r] += sum_j p[r, j] v_j for a head's whole tile of blocked pairs, 64 values from d0 (pv_pair's order): its ks
// passes (keys p, p + ks, ... for pass p) with the sums in registers throughout. Beside each pair, the next head's
// lines of the same values (v_next elements on, 0: none) and the next tile's K (next_k).
template <int RB>
[[gnu::always_inline]] inline void accumulate_pv_head(const uint32_t* pairs, const at::BFloat16* const* v, int64_t ks,
                                                      int64_t offset, int64_t v_next, NextKeyRows& next_k, int64_t d0,
                                                      int64_t dim, float* acc) {
  __m512 sum[RB][4];
  load_sums(acc, dim, d0, sum);
  for (int64_t pass = 0; pass < ks; ++pass) {
    for (int64_t j = pass; j < BLOCK_N; j += 2 * ks) {
      const at::BFloat16* first = v[j] + offset + d0;
      const at::BFloat16* second = v[j + ks] + offset + d0;
      if (v_next != 0) {
        for (int c = 0; c < 64; c += 32) {
          __builtin_prefetch(first + v_next + c, 0, 2);
          __builtin_prefetch(second + v_next + c, 0, 2);
        }
      }
      next_k.step();
      pv_pair<RB, 2>(pairs + pair_place(j), 1, first, second, sum);
    }
  }
  store_sums(sum, dim, d0, acc);
}

// A row's accumulators of whole chunks of 32 values from accumulate_pv_pairs' order back to the values'.
inline void pair_order_to_values(float* acc, int64_t dim) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t d = 0; d + 32 <= dim; d += 32) {
    const __m512 lo = _mm512_loadu_ps(acc + d), hi = _mm512_loadu_ps(acc + d + 16);
    _mm512_storeu_ps(acc + d, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(acc + d + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}
#endif

// Keys a, a + ks, ... below b, KEY_BLOCK at a time: with 4 rows, the accumulators, key chunks and query chunk then fit
// the vector registers (16 with AVX2, 32 with AVX512) instead of spilling to the stack.
constexpr int KEY_BLOCK = VEC >= 16 ? 4 : 2;
template <int RB, bool PREFETCH, typename Q, typename R>
void scores_dot(const Q* q, int64_t dim, const R* const* k, int64_t a, int64_t b, int64_t ks, int64_t offset,
                const Beside<R>& beside, bool blocked, float* scores) {
  int64_t j = a;
  for (; j + (KEY_BLOCK - 1) * ks < b; j += KEY_BLOCK * ks) {
    scores_dot_keys<RB, KEY_BLOCK, PREFETCH>(q, dim, k, j, ks, offset, beside, blocked, scores);
  }
  for (; j < b; j += ks) scores_dot_keys<RB, 1, PREFETCH>(q, dim, k, j, ks, offset, beside, false, scores);
}

// acc[r] += sum_j p[r, j] v_j for RB rows and DB vectors of the head dim, j = a, a + ks, ... below b, v_j at v[j] +
// offset: one load of each V chunk serves the RB rows (DB == row_vecs<R> > 1: one wide load of fp8 values).
template <int RB, int DB, typename R>
[[gnu::always_inline]] inline void accumulate_pv(const float* p, const R* const* v, int64_t a, int64_t b, int64_t ks,
                                                 int64_t offset, const Beside<R>& beside, int64_t d0, int64_t dim,
                                                 float* acc) {
  Vec sum[RB][DB];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < DB; ++c) sum[r][c] = Vec::loadu(acc + r * dim + d0 + c * VEC);
  for (int64_t j = a; j < b; j += ks) {
    Vec vv[DB];
    if constexpr (DB == row_vecs<R>) {
      load_rows(v[j] + offset + d0, vv);
    } else {
      for (int c = 0; c < DB; ++c) vv[c] = load_row(v[j] + offset + d0 + c * VEC);
    }
    beside.template prefetch<DB * VEC>(beside.row(j), d0);
    beside.template prefetch_ahead<DB * VEC>(v[j] + offset, d0);
    for (int r = 0; r < RB; ++r) {
      const Vec pr(p[r * BLOCK_N + j]);
      for (int c = 0; c < DB; ++c) sum[r][c] = at::vec::fmadd(pr, vv[c], sum[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < DB; ++c) sum[r][c].store(acc + r * dim + d0 + c * VEC);
}

// Calls fn.template operator()<RB>() for row blocks of up to 4 rows.
template <typename F>
void for_row_blocks(int64_t rows, F&& fn) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) fn(std::integral_constant<int, 4>(), r);
  switch (rows - r) {
    case 3:
      fn(std::integral_constant<int, 3>(), r);
      break;
    case 2:
      fn(std::integral_constant<int, 2>(), r);
      break;
    case 1:
      fn(std::integral_constant<int, 1>(), r);
      break;
    default:
      break;
  }
}

// Into L2: row_bytes from rows[j] + offset for j = a, a + ks, ... below b.
template <typename T>
void prefetch_rows(const T* const* rows, int64_t a, int64_t b, int64_t ks, int64_t offset, int64_t row_bytes) {
  for (int64_t j = a; j < b; j += ks)
    for (int64_t c = 0; c < row_bytes; c += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(rows[j] + offset) + c, 0, 2);
}

// The rows that a tile's reads go on to: the next tile's n rows of K and V (n = 0: none).
template <typename R>
struct NextTile {
  const R* const* k;
  const R* const* v;
  int64_t n;
};

// What pass a (of a tile's passes from a_min) of P V at kv head h prefetches beside V's lines, in a unit of several
// heads: the next tile's K line by line where K's rows are no shorter than V's, else a slice of it here at once (see
// attend_tile); and V's own next position (v_ahead, but in a run's last pass).
template <typename R, typename T, typename C>
Beside<R> beside_values(const Problem<T, C>& pb, NextTile<R> next, int64_t a, int64_t a_min, int64_t per_run, int64_t h,
                        int64_t v_ahead) {
  const bool k_lines = line_by_line<R> && pb.head_dim >= pb.v_padded_dim;
  if (!k_lines)
    prefetch_rows(next.k, a - a_min, next.n, per_run, h * pb.k_head_stride,
                  pb.head_dim * static_cast<int64_t>(sizeof(R)));
  return {next.k, a_min, k_lines ? next.n : 0, h * pb.k_head_stride, (a + 1) % per_run != 0 ? v_ahead : 0};
}

#ifdef HYBRID_OPS_BF16_PAIRS
// bf16 pairs' P V of a tile for the row block [r, r + RB) of every head (scratch rows [heads][rows]), in passes over
// keys [a_min, b_max) (a, a + per_run, ... for a = a_min, ..., a_min + per_run - 1), every head in turn. The first row
// block prefetches the next tile's K beside V's lines (see attend_tile); the others read V's again from L2. A head dim
// of an odd number of 16s ends with fp32 probabilities (accumulate_pv). BLOCKED: the pairs stored blocked. v_ahead:
// elements from a V row to the next position's (runs within pages), or 0.
template <int RB, bool BLOCKED, typename T, typename C>
[[gnu::noinline]] void pv_pairs_tile(const Problem<T, C>& pb, int64_t heads, int64_t rows, int64_t r, int64_t a_min,
                                     int64_t b_max, int64_t per_run, const at::BFloat16* const* v, int64_t v_ahead,
                                     NextTile<at::BFloat16> next, Scratch<T, C>& s) {
  const int64_t v_dim = pb.v_padded_dim;
  for (int64_t a = a_min; a < a_min + per_run; ++a) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t offset = h * pb.v_head_stride;
      const Beside<at::BFloat16> first =
          r == 0 && heads > 1 ? beside_values(pb, next, a, a_min, per_run, h, v_ahead) : Beside<at::BFloat16>{};
      const uint32_t* pairs = s.p_pairs.data() + (h * rows + r) * BLOCK_N;
      float* acc = s.acc.data() + (h * rows + r) * v_dim;
      int64_t d = 0;
      for (; d + 64 <= v_dim; d += 64)
        accumulate_pv_pairs<RB, 2, BLOCKED>(pairs, v, a, b_max, per_run, offset, first, d, v_dim, acc);
      if (d + 32 <= v_dim) {
        accumulate_pv_pairs<RB, 1, BLOCKED>(pairs, v, a, b_max, per_run, offset, first, d, v_dim, acc);
        d += 32;
      }
      if (d < v_dim) {
        const float* p = s.scores.data() + (h * rows + r) * BLOCK_N;
        accumulate_pv<RB, 1>(p, v, a, b_max, per_run, offset, first, d, v_dim, acc);
      }
    }
  }
}

// bf16 pairs' P V of a whole tile of blocked pairs for the row block [r, r + RB) of every head, head after head, its
// sums in registers over all of a head's passes (accumulate_pv_head), where K's and V's rows are as long, a multiple
// of 128 values, and runs lie within cache pages. The first row block prefetches the next tile's K in the order its
// scores read it and, as insurance for prefetches dropped, each head's lines of the next head's values, which the
// scores prefetched in this order (attend_tile).
template <int RB, typename T, typename C>
[[gnu::noinline]] void pv_pairs_by_head(const Problem<T, C>& pb, int64_t heads, int64_t rows, int64_t r,
                                        int64_t per_run, const at::BFloat16* const* v, NextTile<at::BFloat16> next,
                                        Scratch<T, C>& s) {
  const int64_t v_dim = pb.v_padded_dim, next_passes = tile_passes(heads, next.n);
  NextKeyRows next_k{.rows = next.k,
                     .head_stride = pb.k_head_stride,
                     .passes = r == 0 && next.n > 0 ? next_passes : 0,
                     .per_pass = next.n / next_passes,
                     .heads = heads,
                     .row_bytes = pb.head_dim * static_cast<int64_t>(sizeof(at::BFloat16))};
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t offset = h * pb.v_head_stride, v_next = r == 0 && h + 1 < heads ? pb.v_head_stride : 0;
    const uint32_t* pairs = s.p_pairs.data() + (h * rows + r) * BLOCK_N;
    float* acc = s.acc.data() + (h * rows + r) * v_dim;
    for (int64_t d = 0; d < v_dim; d += 64)
      accumulate_pv_head<RB>(pairs, v, per_run, offset, v_next, next_k, d, v_dim, acc);
  }
}
#endif

// One tile of n keys for few rows per kv head, rows given as pointers to `padded_dim` (K) and `v_padded_dim` (V)
// values (cache rows in place, or packed fp32 rows) of the unit's first kv head; head h's rows are h * k_head_stride
// and h * v_head_stride further (a unit of packed rows has one head). Scratch rows are head-major: [num_heads][rows].
//
// A unit of several heads takes a whole tile in per_run passes of one key from each of its STREAMS runs (s, s +
// per_run, ...), every kv head in turn, so that each run's positions are read in order (see STREAMS); other tiles in
// key order. As it reads each (pass, head) slice it prefetches the slice that comes next to the same pass and head,
// line by line (Beside; fp8: ahead of the slice): beside K's, V's; beside V's, the next tile's K.
template <typename T, typename C, typename R>
void attend_tile(const Problem<T, C>& pb, const Unit& u, int64_t j0, int64_t n, const R* const* k, const R* const* v,
                 NextTile<R> next, int64_t rows, Scratch<T, C>& s) {
  const int64_t dim = pb.padded_dim, heads = u.num_heads;
  const int64_t per_run = tile_passes(heads, n);
  using Q = std::conditional_t<bf16_pairs<R>, at::BFloat16, float>;
  const Q* q = reinterpret_cast<const Q*>(s.q.data());
  // Calls fn(a, b, ks) for the passes over keys [j, jb): keys a, a + ks, ... below b.
  const auto passes = [&](int64_t j, int64_t jb, auto&& fn) {
    for (int64_t p = 0; p < per_run; ++p) fn(j + p, jb, per_run);
  };
  // bf16 pairs' scores blocked (store_scores, softmax_pairs_blocked): a tile of STREAMS runs whose every row sees
  // every key (no window's or chunk's start, causal end, a tree's new keys, or soft-cap), whole chunks of 32 values
  // (no fp32 probabilities: accumulate_pv), rows in blocks of 4.
  static_assert(STREAMS % 4 == 0, "blocked scores take a pass's keys 4 at a time");
  bool blocked = bf16_pairs<R> && per_run == BLOCKED_KS && rows % 4 == 0 && pb.logit_cap == 0 &&
                 (!pb.md.tree || j0 + n <= s.prefix) && pb.v_padded_dim % 32 == 0;
  for (int64_t r = 0; blocked && r < heads * rows; ++r) blocked = s.key_begin[r] <= j0 && s.key_end[r] >= j0 + n;
  const int64_t v_bytes = pb.v_head_dim * static_cast<int64_t>(sizeof(R));
  // Each run within a cache page: its next position's rows a position of every kv head further (Beside::ahead).
  const bool ahead = line_by_line<R> && per_run > 1 && j0 % per_run == 0 && pb.page_size % per_run == 0;
  const int64_t k_ahead = ahead ? pb.num_kv_heads * pb.k_head_stride : 0;
  const int64_t v_ahead = ahead ? pb.num_kv_heads * pb.v_head_stride : 0;
  // Counterparts line by line where their rows are no shorter than the rows read beside them (Beside), else a slice at
  // a time ahead: V's beside K's here (a constant distance from K's, with the same head stride), the next tile's K
  // beside V's in beside_values.
  const bool v_lines = line_by_line<R> && pb.v_head_dim >= dim && pb.v_head_stride == pb.k_head_stride;
  const uintptr_t v_delta =
      v_lines ? reinterpret_cast<uintptr_t>(pb.v_cache) - reinterpret_cast<uintptr_t>(pb.k_cache) : 0;
  // P V by head (pv_pairs_by_head) where its rows allow. The scores then prefetch V's rows in its order: those of pass
  // a at head h, the slice-th of the tile's per_run x heads slices (slice = a heads + h), prefetch the slice-th that P
  // V reads, pass slice % per_run of head slice / per_run: each row a constant distance from the K row read (runs
  // within pages), so that V's lines come in the order P V reads them.
  const bool by_head = blocked && ahead && v_lines && pb.head_dim % 128 == 0 && pb.v_padded_dim == pb.head_dim;
  passes(0, n, [&](int64_t a, int64_t b, int64_t ks) {
    for (int64_t h = 0; h < heads; ++h) {
      if (heads > 1 && !v_lines) prefetch_rows(v, a, b, ks, h * pb.v_head_stride, v_bytes);
      const int64_t slice = a * heads + h, v_shift = (slice % ks - a) * k_ahead + (slice / ks - h) * pb.k_head_stride;
      const uintptr_t delta = v_delta + (by_head ? static_cast<uintptr_t>(v_shift * int64_t{sizeof(R)}) : 0);
      const Beside<R> beside{.ahead = (a + 1) % ks != 0 ? k_ahead : 0, .delta = delta};
      for_row_blocks(rows, [&](auto rb, int64_t r) {
        // Only the first row block prefetches: the others read the same rows again.
        const auto scores = [&](auto prefetch) {
          scores_dot<decltype(rb)::value, decltype(prefetch)::value>(q + (h * rows + r) * dim, dim, k, a, b, ks,
                                                                     h * pb.k_head_stride, beside, blocked,
                                                                     s.scores.data() + (h * rows + r) * BLOCK_N);
        };
        if (r == 0 && heads > 1) {
          scores(std::true_type());
        } else {
          scores(std::false_type());
        }
      });
    }
  });
  // fp32 query rows hold the scale (and the kv head's k_scale): the scores and probabilities take the rest of
  // raw_unit. bf16 ones do not (a bf16 cache has no k_scale).
  const float score_scale = bf16_pairs<R> ? pb.scale : raw_unit<C>() / lifted<C>();
#ifdef HYBRID_OPS_BF16_PAIRS
  if constexpr (bf16_pairs<R>) {
    int64_t a_min = 0, b_max = n;
    if (blocked) {
      softmax_pairs_blocked(pb, heads * rows, s);
    } else {
      std::tie(a_min, b_max) = softmax_tile(pb, j0, n, BLOCK_N, score_scale, lifted<C>(), 0, heads * rows, s);
      for (int64_t r = 0; r < heads * rows; ++r)
        pair_probs(s.scores.data() + r * BLOCK_N, a_min, b_max, per_run, s.p_pairs.data() + r * BLOCK_N);
    }
    // A call a tile and row block, not a pass, head and row block (as below): its setup would come around every 8 keys.
    for_row_blocks(rows, [&](auto rb, int64_t r) {
      constexpr int RB = decltype(rb)::value;
      if (by_head) {
        pv_pairs_by_head<RB>(pb, heads, rows, r, per_run, v, next, s);
      } else if (blocked) {
        pv_pairs_tile<RB, true>(pb, heads, rows, r, a_min, b_max, per_run, v, v_ahead, next, s);
      } else {
        pv_pairs_tile<RB, false>(pb, heads, rows, r, a_min, b_max, per_run, v, v_ahead, next, s);
      }
    });
    return;
  }
#endif
  const auto [a_min, b_max] = softmax_tile(pb, j0, n, BLOCK_N, score_scale, lifted<C>(), 0, heads * rows, s);
  passes(a_min, b_max, [&](int64_t a, int64_t b, int64_t ks) {
    for (int64_t h = 0; h < heads; ++h) {
      const Beside<R> beside = heads > 1 ? beside_values(pb, next, a, a_min, ks, h, v_ahead) : Beside<R>{};
      for_row_blocks(rows, [&](auto rb, int64_t r) {
        const Beside<R> first = r == 0 ? beside : Beside<R>{};
        constexpr int RB = decltype(rb)::value;
        const int64_t v_dim = pb.v_padded_dim, offset = h * pb.v_head_stride;
        const float* p = s.scores.data() + (h * rows + r) * BLOCK_N;
        float* acc = s.acc.data() + (h * rows + r) * v_dim;
        int64_t d = 0;
        // Where a load widens W > 1 vectors (fp8 with AVX512-VBMI), W at a time: a broadcast of p per W vectors.
        constexpr int W = row_vecs<R>;
        if constexpr (W > 1) {
          for (; d + W * VEC <= v_dim; d += W * VEC) accumulate_pv<RB, W>(p, v, a, b, ks, offset, first, d, v_dim, acc);
        }
        for (; d + 2 * VEC <= v_dim; d += 2 * VEC) accumulate_pv<RB, 2>(p, v, a, b, ks, offset, first, d, v_dim, acc);
        if (d < v_dim) accumulate_pv<RB, 1>(p, v, a, b, ks, offset, first, d, v_dim, acc);
      });
    }
  });
}

}  // namespace

// The unit's query rows in fp32, scaled (bf16 as they are, for bf16 rows in place: bf16_pairs); its tiles (attend_tile)
// with K/V rows in place when the head dim is whole vectors (always for a unit of several heads, see schedule.cpp),
// else copied (fp32 raw values, zero-padded) into the scratch tile.
template <typename T, typename C>
void attend_inplace(const Problem<T, C>& pb, const Unit& u, Scratch<T, C>& s, const Unit* following) {
  const QueryRows q_rows = pb.rows_of(u);
  const int64_t dim = pb.padded_dim, v_dim = pb.v_padded_dim, rows = q_rows.per_head;
  const bool in_place = pb.head_dim == dim && pb.v_head_dim == v_dim;
  const int64_t step = pb.q_strides[2];  // 1 but for an unusual q: then element by element
  for (int64_t r = 0; r < q_rows.count; ++r) {
    const T* src = pb.q_row(q_rows, r);
    if constexpr (bf16_pairs<C>) {
      if (in_place) {
        T* dst = reinterpret_cast<T*>(s.q.data()) + r * dim;
        if (step == 1) {
          std::copy_n(src, dim, dst);
        } else {
          for (int64_t d = 0; d < dim; ++d) dst[d] = src[d * step];
        }
        continue;
      }
    }
    float* dst = s.q.data() + r * dim;
    const float q_scale = pb.scale * pb.k_scale[q_rows.kv_head(r)] * lifted<C>();  // see attend_tile
    int64_t d = 0;
    if (step == 1) {
      for (; d + VEC <= pb.head_dim; d += VEC) (load_row(src + d) * Vec(q_scale)).store(dst + d);
    }
    for (; d < pb.head_dim; ++d) dst[d] = static_cast<float>(src[d * step]) * q_scale;
    std::fill(dst + pb.head_dim, dst + dim, 0.f);
  }
  const C* k_tiles[2][BLOCK_N];
  const C* v_tiles[2][BLOCK_N];
  const float* k_packed[BLOCK_N];
  const float* v_packed[BLOCK_N];
  tile_rows(pb, u.request, u.head, u.lo, std::min(BLOCK_N, u.hi - u.lo), k_tiles[0], v_tiles[0]);
  for (int64_t j0 = u.lo, t = 0; j0 < u.hi; j0 += BLOCK_N, t ^= 1) {
    const int64_t n = std::min(BLOCK_N, u.hi - j0), next = j0 + BLOCK_N;
    const C** k_rows = k_tiles[t];
    const C** v_rows = v_tiles[t];
    // A unit of one kv head, whose rows lie Hkv * D apart, prefetches the whole next tile; one of several as
    // attend_tile reads, and in its last tile the first of the unit its thread takes next when that one too takes
    // every kv head.
    int64_t n_next = next < u.hi ? std::min(BLOCK_N, u.hi - next) : 0;
    if (n_next > 0) {
      tile_rows(pb, u.request, u.head, next, n_next, k_tiles[t ^ 1], v_tiles[t ^ 1]);
      if (u.num_heads == 1) {
        prefetch_rows(k_tiles[t ^ 1], 0, n_next, 1, 0, pb.head_dim * static_cast<int64_t>(sizeof(C)));
        prefetch_rows(v_tiles[t ^ 1], 0, n_next, 1, 0, pb.v_head_dim * static_cast<int64_t>(sizeof(C)));
      }
    } else if (following && u.num_heads > 1 && following->num_heads == u.num_heads) {
      n_next = std::min(BLOCK_N, following->hi - following->lo);
      tile_rows(pb, following->request, following->head, following->lo, n_next, k_tiles[t ^ 1], v_tiles[t ^ 1]);
    }
    if (in_place) {
      attend_tile(pb, u, j0, n, k_rows, v_rows, NextTile<C>{k_tiles[t ^ 1], v_tiles[t ^ 1], n_next}, rows, s);
      continue;
    }
    for (int64_t j = 0; j < n; ++j) {
      float* kd = s.packed_k.data() + j * dim;
      float* vd = s.packed_v.data() + j * v_dim;
      for (int64_t d = 0; d < pb.head_dim; ++d) kd[d] = raw_value(k_rows[j][d]);
      for (int64_t d = 0; d < pb.v_head_dim; ++d) vd[d] = raw_value(v_rows[j][d]);
      k_packed[j] = kd;
      v_packed[j] = vd;
    }
    attend_tile(pb, u, j0, n, k_packed, v_packed, NextTile<float>{nullptr, nullptr, 0}, rows, s);
  }
#ifdef HYBRID_OPS_BF16_PAIRS
  if constexpr (bf16_pairs<C>) {
    if (in_place) {
      for (int64_t r = 0; r < q_rows.count; ++r) pair_order_to_values(s.acc.data() + r * v_dim, v_dim);
    }
  }
#endif
}

#define INSTANTIATE(T, C) template void attend_inplace(const Problem<T, C>&, const Unit&, Scratch<T, C>&, const Unit*);
HYBRID_OPS_CPU_TYPES(INSTANTIATE)

}  // namespace hybrid_ops::cpu
