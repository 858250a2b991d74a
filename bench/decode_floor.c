// The cpu backend's bf16 decode with nothing but its work: what a lean loop of the same reads, products and softmax
// reaches from memory on one core, beside the kernel and the read (`python -m bench.bound --floor`, which builds it).
// The op section's decode case: 8 kv heads of D 128, 4 query rows each, 16 positions a page. As attend_inplace.cpp:
// slices of 256 keys, tiles of 64 as 8 runs of 8 positions, K/V row pointers from the block table a tile at a time;
// the scores 4 keys by 4 rows a chunk of 32 (vdpbf16ps) with V's line prefetched beside each K line and reduced in one
// transposing step; each tile's max, exps (a degree-5 polynomial), sums and bf16 pairs of probabilities; P V over
// pairs of keys interleaved, the next tile's K prefetched beside; a slice's output and log-sum-exp written apart and
// the slices merged. Not the kernel's results: the query rows are fixed, and P V takes fixed probabilities (the
// softmax's work is done, its pairs unused), so that no value depends on the cache's; no window, soft-cap or sinks.
//   gcc -O3 -shared -fPIC -mavx512f -mavx512bw -mavx512dq -mavx512bf16 bench/decode_floor.c -o decode_floor.so
// Parts of the work switched off or added, each by a -D flag (`python -m bench.bound --floor` times each; the
// outputs then wrong): NO_SCORE_SUMS, each 4 x 4 block's sums added into one vector and stored, not reduced into 16
// scores stored one by one; NO_SOFTMAX; PV_SUMS_KEPT, P V's sums not loaded and stored around each pass (a pass's
// start from a constant, the last pass's stored); NO_PRODUCTS, each vdpbf16ps a bitwise OR; PREFETCH_AGAIN, the line
// of the next pass's key in the same run (K's beside K's, V's beside V's) prefetched as each line is read.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "../kernels/cpu/sums4x4.h"

#ifdef NO_PRODUCTS
#define PRODUCT(acc, a, b) ((void)(a), _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(acc), (__m512i)(b))))
#else
#define PRODUCT(acc, a, b) _mm512_dpbf16_ps(acc, a, b)
#endif
#ifdef PREFETCH_AGAIN
#define AGAIN 1
#else
#define AGAIN 0
#endif

#define HEADS 8
#define D 128
#define ROWS 4  // query rows a kv head
#define PAGE 16
#define TILE 64
#define RUNS 8
#define SLICE 256
#define POS_BYTES (HEADS * D * 2)  // a position of every kv head

static uint16_t q_rows[HEADS][ROWS][D] __attribute__((aligned(64)));
static float scores[HEADS][ROWS][TILE] __attribute__((aligned(64)));
static uint32_t probs[HEADS][ROWS][TILE] __attribute__((aligned(64)));  // bf16 pairs read by P V
static uint32_t pairs[HEADS][ROWS][TILE] __attribute__((aligned(64)));  // the softmax's pairs
static float acc[HEADS][ROWS][D] __attribute__((aligned(64)));
static float m_run[HEADS][ROWS], l_run[HEADS][ROWS];

// scores[h][r][j + c ks] for the 4 x 4 sums acc4[r][c] (row r, key j + c ks), as attend_inplace.cpp's store_scores.
static inline void store_scores(const __m512 (*acc4)[4], long j, long ks, float* sc) {
  float sums[16] __attribute__((aligned(64)));
  _mm512_store_ps(sums, sums_4x4(acc4));
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) sc[r * TILE + j + c * ks] = sums[4 * c + r];
}

// The scores of a tile's n keys (rows k[j]), in per_run passes of one key a run, every head in turn; V's rows beside.
static void scores_pass(const char* const* k, const char* const* v, long n, long per_run) {
  for (long p = 0; p < per_run; p++)
    for (long h = 0; h < HEADS; h++) {
      const long off = h * D * 2;
      for (long j = p; j < n; j += 4 * per_run) {
        const long keys = (n - j + per_run - 1) / per_run < 4 ? (n - j + per_run - 1) / per_run : 4;
        __m512 a[4][4];
        for (int r = 0; r < 4; r++)
          for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();
        for (long d = 0; d < D; d += 32) {
          __m512i kv[4];
          for (int c = 0; c < 4; c++) {
            const long jj = j + (c < keys ? c : 0) * per_run;
            kv[c] = _mm512_loadu_si512(k[jj] + off + 2 * d);
            _mm_prefetch(v[jj] + off + 2 * d, _MM_HINT_T1);
            if (AGAIN && p + 1 < per_run) _mm_prefetch(k[jj + 1] + off + 2 * d, _MM_HINT_T1);
          }
          for (int r = 0; r < 4; r++) {
            const __m512bh qv = (__m512bh)_mm512_load_si512(&q_rows[h][r][d]);
            for (int c = 0; c < 4; c++) a[r][c] = PRODUCT(a[r][c], qv, (__m512bh)kv[c]);
          }
        }
#ifdef NO_SCORE_SUMS
        __m512 sum = _mm512_setzero_ps();
        for (int r = 0; r < 4; r++)
          for (int c = 0; c < 4; c++) sum = _mm512_add_ps(sum, a[r][c]);
        _mm512_store_ps(&scores[h][0][(j / per_run % 4) * 16], sum);
        continue;
#endif
        if (keys == 4) {
          store_scores(a, j, per_run, scores[h][0]);
        } else {  // a tile's last keys: fewer than 4 in the pass
          float sc[ROWS * TILE];
          store_scores(a, 0, 1, sc);
          for (int r = 0; r < 4; r++)
            for (long c = 0; c < keys; c++) scores[h][r][j + c * per_run] = sc[r * TILE + c];
        }
      }
    }
}

// exp(x) for x <= 0: 2^i p(f), t = x log2(e) = i + f, f in [-0.5, 0.5].
static inline __m512 exp_ps(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504f));
  const __m512 i = _mm512_roundscale_ps(t, 0), f = _mm512_sub_ps(t, i);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, i);
}

// Each row's online softmax over the tile's n keys and the bf16 pairs (j, j + ks) of its probabilities.
static void softmax(long n, long ks) {
#ifdef NO_SOFTMAX
  return;
#endif
  const float scale = 0.088388f;  // 1 / sqrt(D)
  for (int h = 0; h < HEADS; h++)
    for (int r = 0; r < ROWS; r++) {
      float* sc = scores[h][r];
      const __mmask16 tail = _cvtu32_mask16(n % 16 ? (1u << (n % 16)) - 1 : 0xFFFF);
      __m512 mv = _mm512_set1_ps(-INFINITY);
      for (long j = 0; j < n; j += 16)
        mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), j + 16 <= n ? 0xFFFF : tail, sc + j));
      const float m_new = fmaxf(_mm512_reduce_max_ps(mv) * scale, m_run[h][r]);
      const float alpha = expf(m_run[h][r] - m_new);
      m_run[h][r] = m_new;
      __m512 sum = _mm512_setzero_ps();
      for (long j = 0; j < n; j += 16) {
        const __mmask16 lanes = j + 16 <= n ? 0xFFFF : tail;
        const __m512 s = _mm512_maskz_loadu_ps(lanes, sc + j);
        const __m512 e =
            _mm512_maskz_mov_ps(lanes, exp_ps(_mm512_fmadd_ps(s, _mm512_set1_ps(scale), _mm512_set1_ps(-m_new))));
        sum = _mm512_add_ps(sum, e);
        _mm512_mask_storeu_ps(sc + j, lanes, e);
      }
      l_run[h][r] = l_run[h][r] * alpha + _mm512_reduce_add_ps(sum);
      if (alpha != 1.f)
        for (int d = 0; d < D; d += 16)
          _mm512_store_ps(&acc[h][r][d], _mm512_mul_ps(_mm512_load_ps(&acc[h][r][d]), _mm512_set1_ps(alpha)));
      for (long j = 0; j < n; j += 16) {
        const long second = n - j - ks;
        const __mmask16 both = _cvtu32_mask16(second >= 16 ? 0xFFFF : second > 0 ? (1u << second) - 1 : 0);
        const __mmask16 lanes = j + 16 <= n ? 0xFFFF : tail;
        const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(lanes, sc + j));
        const __m256i hi = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(both, sc + j + ks));
        _mm512_mask_storeu_epi32(
            pairs[h][r] + j, lanes,
            _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16)));
      }
    }
}

// P V over a tile's n keys (rows v[j]) in pairs (j, j + ks) of a pass, 64 values at a time; the next tile's nn K rows
// (nk[j]) prefetched beside.
static void pv_pass(const char* const* v, long n, const char* const* nk, long nn, long per_run) {
  for (long p = 0; p < per_run; p++)
    for (long h = 0; h < HEADS; h++) {
      const long off = h * D * 2;
#ifdef PV_SUMS_KEPT
      __m512 s[4][4];
      for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) s[r][c] = _mm512_set1_ps((float)p);
#endif
      for (long d0 = 0; d0 < D; d0 += 64) {
#ifndef PV_SUMS_KEPT
        __m512 s[4][4];
        for (int r = 0; r < 4; r++)
          for (int c = 0; c < 4; c++) s[r][c] = _mm512_load_ps(&acc[h][r][d0 + 16 * c]);
#endif
        for (long j = p; j < n; j += 2 * per_run) {
          const long j2 = j + per_run < n ? j + per_run : j;
          const char* first = v[j] + off + 2 * d0;
          const char* second = v[j2] + off + 2 * d0;
          if (j < nn) {
            _mm_prefetch(nk[j] + off + 2 * d0, _MM_HINT_T1);
            _mm_prefetch(nk[j] + off + 2 * d0 + 64, _MM_HINT_T1);
          }
          if (j + per_run < nn) {
            _mm_prefetch(nk[j + per_run] + off + 2 * d0, _MM_HINT_T1);
            _mm_prefetch(nk[j + per_run] + off + 2 * d0 + 64, _MM_HINT_T1);
          }
          if (AGAIN && p + 1 < per_run) {
            for (int c = 0; c < 2; c++) {
              _mm_prefetch(v[j + 1] + off + 2 * d0 + 64 * c, _MM_HINT_T1);
              _mm_prefetch(v[j2 + 1] + off + 2 * d0 + 64 * c, _MM_HINT_T1);
            }
          }
          __m512i vv[4];
          for (int c = 0; c < 2; c++) {
            const __m512i x = _mm512_loadu_si512(first + 64 * c), y = _mm512_loadu_si512(second + 64 * c);
            vv[2 * c] = _mm512_unpacklo_epi16(x, y);
            vv[2 * c + 1] = _mm512_unpackhi_epi16(x, y);
          }
          for (int r = 0; r < 4; r++) {
            const __m512bh pr = (__m512bh)_mm512_set1_epi32(probs[h][r][j]);
            for (int c = 0; c < 4; c++) s[r][c] = PRODUCT(s[r][c], pr, (__m512bh)vv[c]);
          }
        }
#ifndef PV_SUMS_KEPT
        for (int r = 0; r < 4; r++)
          for (int c = 0; c < 4; c++) _mm512_store_ps(&acc[h][r][d0 + 16 * c], s[r][c]);
#endif
      }
#ifdef PV_SUMS_KEPT
      if (p == per_run - 1)
        for (int r = 0; r < 4; r++)
          for (int c = 0; c < 4; c++) _mm512_store_ps(&acc[h][r][16 * c], s[r][c]);
#endif
    }
}

// K and V row pointers of a request's positions [pos, pos + n) (its block table row `table`).
static void tile_rows(const char* k_cache, const char* v_cache, const int32_t* table, long pos, long n, const char** k,
                      const char** v) {
  for (long j = 0; j < n; j++) {
    const long at = ((long)table[(pos + j) / PAGE] * PAGE + (pos + j) % PAGE) * POS_BYTES;
    k[j] = k_cache + at;
    v[j] = v_cache + at;
  }
}

// Decode of nseq requests of lens[i] keys: block_table [nseq, width] (int32), partial_out [slices * 32, D] and
// partial_lse [slices * 32] (fp32), out [nseq * 32, D] (bf16 bits). Returns a value of the outputs, so that none of
// the work is left out.
float decode_floor(const char* k_cache, const char* v_cache, const int32_t* block_table, long width,
                   const int32_t* lens, int nseq, float* partial_out, float* partial_lse, uint16_t* out) {
  const char* k_rows[2][TILE];
  const char* v_rows[2][TILE];
  long partial = 0;
  for (int i = 0; i < nseq; i++) {
    const int32_t* table = block_table + i * width;
    const long len = lens[i], slices = (len + SLICE - 1) / SLICE;
    for (long sl = 0; sl < slices; sl++) {
      const long lo = sl * SLICE, hi = lo + SLICE < len ? lo + SLICE : len;
      for (int h = 0; h < HEADS; h++)
        for (int r = 0; r < ROWS; r++) {
          m_run[h][r] = -INFINITY;
          l_run[h][r] = 0.f;
          for (int d = 0; d < D; d += 16) _mm512_store_ps(&acc[h][r][d], _mm512_setzero_ps());
        }
      int t = 0;
      tile_rows(k_cache, v_cache, table, lo, hi - lo < TILE ? hi - lo : TILE, k_rows[0], v_rows[0]);
      for (long j0 = lo; j0 < hi; j0 += TILE, t ^= 1) {
        const long n = hi - j0 < TILE ? hi - j0 : TILE;
        // The next tile: this slice's, the request's next slice's or the next request's first.
        long next_n = 0;
        if (j0 + TILE < hi) {
          next_n = hi - j0 - TILE < TILE ? hi - j0 - TILE : TILE;
          tile_rows(k_cache, v_cache, table, j0 + TILE, next_n, k_rows[t ^ 1], v_rows[t ^ 1]);
        } else if (hi < len) {
          next_n = len - hi < TILE ? len - hi : TILE;
          tile_rows(k_cache, v_cache, table, hi, next_n, k_rows[t ^ 1], v_rows[t ^ 1]);
        } else if (i + 1 < nseq) {
          next_n = lens[i + 1] < TILE ? lens[i + 1] : TILE;
          tile_rows(k_cache, v_cache, table + width, 0, next_n, k_rows[t ^ 1], v_rows[t ^ 1]);
        }
        const long per_run = n == TILE ? TILE / RUNS : 1;
        scores_pass(k_rows[t], v_rows[t], n, per_run);
        softmax(n, per_run);
        pv_pass(v_rows[t], n, k_rows[t ^ 1], next_n, per_run);
      }
      for (int h = 0; h < HEADS; h++)
        for (int r = 0; r < ROWS; r++) {
          const long row = partial + sl * HEADS * ROWS + h * ROWS + r;
          const __m512 inv = _mm512_set1_ps(1.f / l_run[h][r]);
          for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(partial_out + row * D + d, _mm512_mul_ps(_mm512_load_ps(&acc[h][r][d]), inv));
          partial_lse[row] = m_run[h][r] + logf(l_run[h][r]);
        }
    }
    for (int r = 0; r < HEADS * ROWS; r++) {
      float mx = -INFINITY, total = 0.f;
      for (long sl = 0; sl < slices; sl++) mx = fmaxf(mx, partial_lse[partial + sl * HEADS * ROWS + r]);
      __m512 a[D / 16];
      for (int c = 0; c < D / 16; c++) a[c] = _mm512_setzero_ps();
      for (long sl = 0; sl < slices; sl++) {
        const long row = partial + sl * HEADS * ROWS + r;
        const float w = expf(partial_lse[row] - mx);
        total += w;
        for (int c = 0; c < D / 16; c++)
          a[c] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(partial_out + row * D + 16 * c), a[c]);
      }
      for (int c = 0; c < D / 16; c++)
        _mm256_storeu_si256((__m256i*)(out + (i * HEADS * ROWS + r) * D + 16 * c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a[c], _mm512_set1_ps(1.f / total))));
    }
    partial += slices * HEADS * ROWS;
  }
  return acc[0][0][0] + scores[0][0][0] + (float)pairs[0][0][0];
}

// Fixed query rows and probabilities (bf16 near 1 and 1/64).
void decode_floor_init(void) {
  for (int h = 0; h < HEADS; h++)
    for (int r = 0; r < ROWS; r++) {
      for (int d = 0; d < D; d++) q_rows[h][r][d] = (uint16_t)(0x3f80 + (h * 7 + r * 3 + d) % 64);
      for (int j = 0; j < TILE; j++) probs[h][r][j] = 0x3c803c80u;
    }
}
