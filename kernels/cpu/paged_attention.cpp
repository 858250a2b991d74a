// Paged attention on the CPU: KV store, then attention of every request's new tokens over its pages, read where
// they lie (no gather copy). Shapes and metadata as in hybrid_ops/metadata.py:
//   q [T, Hq, D], k, v [T, Hkv, D] (any strides); k_cache, v_cache [num_pages, page_size, Hkv, D] contiguous;
//   cu_seqlens_q [B + 1], seq_lens [B], block_table [B, max_pages] int32. Caches fp32, fp16 or bf16; fp32 math.
//
// Work is cut into units (request, kv heads, block of query tokens, slice of keys), taken by the threads of
// at::parallel_for from a shared counter, since units differ in length. One unit keeps the query rows of its kv
// heads' groups (tokens x GQA group) and streams its keys in tiles of BLOCK_N: each K/V row is loaded once per tile
// and serves every query row of the group (online softmax, fp32 accumulation). With few rows per kv head (decode,
// verify) a unit takes every kv head and walks the positions in order, so each page is read front to back (its
// Hkv * D elements per position lie together); with many (prefill) a unit takes one kv head. A request with one
// block of queries (decode, verify, a short chunk over a long prefix) splits its keys into slices, merged by
// log-sum-exp, so a batch of one still uses several cores. The slicing depends on the request alone, so a
// request's result is the same in any batch and on any number of threads.
//
// The metadata's values are checked first (before anything is written); on bad values `paged_attention` returns an
// undefined tensor (None in Python) and the caller reports which value is wrong.

#include "paged_attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VEC = Vec::size();
constexpr int64_t BLOCK_N = 64;      // keys per tile (a multiple of VEC)
constexpr int64_t KV_SPLIT = 512;    // keys per slice of a request with one query block (a multiple of BLOCK_N)
constexpr int64_t KV_SPLIT_ALL_HEADS = 256;  // the same for a unit of every kv head
constexpr int64_t BLOCK_ROWS = 256;  // query rows (tokens x group) per unit of a longer prefill
constexpr int64_t GEMM_ROWS = 16;    // from this many rows, scores go through a transposed K tile (see scores_gemm)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline Vec load_row(const float* p) { return Vec::loadu(p); }
template <typename T>
inline Vec load_row(const T* p) {
  Vec out;
  at::vec::load_to_float(p, out);
  return out;
}

inline float hsum(const Vec& x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}

struct Metadata {
  const int32_t* cu;
  const int32_t* lens;
  const int32_t* table;
  int64_t table_stride, width, num_requests;  // table_stride: elements between rows
};

// The values check_metadata_values (validation.py) enforces: nothing is read or written out of bounds after it.
bool metadata_ok(const Metadata& md, int64_t num_tokens, int64_t num_pages, int64_t page_size, bool decode) {
  if (md.cu[0] != 0 || md.cu[md.num_requests] != num_tokens) return false;
  for (int64_t i = 0; i < md.num_requests; ++i) {
    const int64_t q_len = md.cu[i + 1] - md.cu[i], len = md.lens[i];
    if (q_len < 0 || len < q_len || len > md.width * page_size) return false;
    if (decode && q_len != md.cu[1] - md.cu[0]) return false;
    const int32_t* pages = md.table + i * md.table_stride;
    for (int64_t p = 0; p < (len + page_size - 1) / page_size; ++p) {
      if (pages[p] < 0 || pages[p] >= num_pages) return false;
    }
  }
  return true;
}

struct Unit {
  int64_t request, head, num_heads;  // kv heads head .. head + num_heads - 1
  int64_t t0, num_tokens;            // query tokens t0 .. t0 + num_tokens - 1 of the request
  int64_t lo, hi;                    // keys [lo, hi) of the request
  int64_t partial;                   // first row in the split partials, or -1: write the output directly
};

// One kv head's rows of a request's slices: slice s's rows start at partial + s * split_stride.
struct Merge {
  int64_t request, head, num_tokens, num_splits, partial, split_stride;
};

// Everything a unit reads; T is the caches' (and q's) element type.
template <typename T>
struct Problem {
  const T *q, *k_cache, *v_cache;
  T* out;  // [T, Hq, D] contiguous
  float *partial_out, *partial_lse;  // [rows, D], [rows]
  Metadata md;
  int64_t q_strides[3], page_size, num_kv_heads, group, head_dim, padded_dim;
  float scale, logit_cap;
  int64_t window;

  int64_t row_stride;  // num_kv_heads * head_dim

  // One kv head's row `in_page` of the request's `page`-th page.
  const T* row(const T* cache, int64_t request, int64_t page, int64_t in_page, int64_t head) const {
    const int64_t id = md.table[request * md.table_stride + page];
    return cache + (id * page_size + in_page) * row_stride + head * head_dim;
  }
};

// Per-thread scratch, reused across the units a thread takes.
struct Scratch {
  std::vector<float> q, acc, scores, m, l, kt, packed_k, packed_v;
  Scratch(int64_t rows, int64_t padded_dim)
      : q(rows * padded_dim), acc(rows * padded_dim), scores(rows * BLOCK_N), m(rows), l(rows),
        kt(padded_dim * BLOCK_N), packed_k(BLOCK_N * padded_dim, 0.f), packed_v(BLOCK_N * padded_dim, 0.f) {}
};

// scores[r, j] = q[r] . k_j for RB rows (few rows: decode, verify), KB keys at a time: one load of each K chunk
// serves the RB rows, and RB x KB independent accumulators keep the FMA units busy. Key j's row is at k[j] + offset
// (offset: a kv head's place in the rows of every head).
template <int RB, int KB, typename R>
void scores_dot_keys(const float* q, int64_t dim, const R* const* k, int64_t j, int64_t offset, float* scores) {
  Vec acc[RB][KB];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KB; ++c) acc[r][c] = Vec(0.f);
  for (int64_t d = 0; d < dim; d += VEC) {
    Vec kv[KB];
    for (int c = 0; c < KB; ++c) kv[c] = load_row(k[j + c] + offset + d);
    for (int r = 0; r < RB; ++r) {
      const Vec qv = Vec::loadu(q + r * dim + d);
      for (int c = 0; c < KB; ++c) acc[r][c] = at::vec::fmadd(qv, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KB; ++c) scores[r * BLOCK_N + j + c] = hsum(acc[r][c]);
}

// Keys [a, b).
template <int RB, typename R>
void scores_dot(const float* q, int64_t dim, const R* const* k, int64_t a, int64_t b, int64_t offset, float* scores) {
  int64_t j = a;
  for (; j + 4 <= b; j += 4) scores_dot_keys<RB, 4>(q, dim, k, j, offset, scores);
  for (; j < b; ++j) scores_dot_keys<RB, 1>(q, dim, k, j, offset, scores);
}

// scores[r, :] = q[r] . kt for RB rows over a transposed tile kt [D, BLOCK_N]: RB x 2 vector accumulators, a
// broadcast q value per row (many rows: prefill).
template <int RB>
void scores_gemm(const float* q, int64_t dim, int64_t head_dim, const float* kt, float* scores) {
  for (int64_t c = 0; c < BLOCK_N; c += 2 * VEC) {
    Vec acc[RB][2];
    for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = Vec(0.f);
    for (int64_t d = 0; d < head_dim; ++d) {
      const Vec k0 = Vec::loadu(kt + d * BLOCK_N + c), k1 = Vec::loadu(kt + d * BLOCK_N + c + VEC);
      for (int r = 0; r < RB; ++r) {
        const Vec qd(q[r * dim + d]);
        acc[r][0] = at::vec::fmadd(qd, k0, acc[r][0]);
        acc[r][1] = at::vec::fmadd(qd, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      acc[r][0].store(scores + r * BLOCK_N + c);
      acc[r][1].store(scores + r * BLOCK_N + c + VEC);
    }
  }
}

// acc[r] += sum_j p[r, j] v_j for RB rows and DB vectors of the head dim, j in [a, b), v_j at v[j] + offset: one
// load of each V chunk serves the RB rows.
template <int RB, int DB, typename R>
void accumulate_pv(const float* p, const R* const* v, int64_t a, int64_t b, int64_t offset, int64_t d0, int64_t dim,
                   float* acc) {
  Vec sum[RB][DB];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < DB; ++c) sum[r][c] = Vec::loadu(acc + r * dim + d0 + c * VEC);
  for (int64_t j = a; j < b; ++j) {
    Vec vv[DB];
    for (int c = 0; c < DB; ++c) vv[c] = load_row(v[j] + offset + d0 + c * VEC);
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
    case 3: fn(std::integral_constant<int, 3>(), r); break;
    case 2: fn(std::integral_constant<int, 2>(), r); break;
    case 1: fn(std::integral_constant<int, 1>(), r); break;
    default: break;
  }
}

// Online softmax of one row's scores sc[0, n) over its visible keys [a, b): p replaces the scores (0 where not
// visible), and the row's max m, sum l and accumulator acc [dim] are rescaled to the new max.
inline void softmax_row(float* sc, int64_t n, int64_t a, int64_t b, float logit_cap, float& m, float& l, float* acc,
                        int64_t dim) {
  if (logit_cap > 0) {
    for (int64_t j = a; j < b; ++j) sc[j] = logit_cap * std::tanh(sc[j] / logit_cap);
  }
  float mx = NEG_INF;
  int64_t j = a;
  if (b - a >= VEC) {
    Vec mv(NEG_INF);
    for (; j + VEC <= b; j += VEC) mv = at::vec::maximum(mv, Vec::loadu(sc + j));
    mx = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, mv);
  }
  for (; j < b; ++j) mx = std::max(mx, sc[j]);
  const float m_new = std::max(m, mx);
  const float alpha = std::exp(m - m_new);  // 0 while no key was seen (m = -inf)
  Vec sum_v(0.f);
  for (j = a; j + VEC <= b; j += VEC) {
    const Vec e = (Vec::loadu(sc + j) - Vec(m_new)).exp_u20();
    sum_v = sum_v + e;
    e.store(sc + j);
  }
  float sum = hsum(sum_v);
  for (; j < b; ++j) {
    sc[j] = std::exp(sc[j] - m_new);
    sum += sc[j];
  }
  std::fill(sc, sc + a, 0.f);
  std::fill(sc + b, sc + n, 0.f);
  m = m_new;
  l = l * alpha + sum;
  if (alpha != 1.f) {
    for (int64_t d = 0; d < dim; d += VEC) (Vec::loadu(acc + d) * Vec(alpha)).store(acc + d);
  }
}

// One tile of n keys, rows given as pointers to `padded_dim` values (cache rows in place, or packed fp32 rows) of
// the unit's first kv head; head h's row is h * head_dim further. Scratch rows are head-major: [num_heads][rows].
// A unit of several heads walks the keys in order, 4 positions of every head at a time, so that each page's K and V
// are read front to back (see forward_typed).
template <typename T, typename R>
void attend_tile(const Problem<T>& pb, const Unit& u, int64_t j0, int64_t n, const R* const* k, const R* const* v,
                 int64_t rows, Scratch& s) {
  const int64_t dim = pb.padded_dim, group = pb.group, heads = u.num_heads;
  const int64_t prefix = pb.md.lens[u.request] - (pb.md.cu[u.request + 1] - pb.md.cu[u.request]);
  const int64_t step = heads > 1 ? 4 : BLOCK_N;
  if (rows >= GEMM_ROWS) {  // one head (forward_typed)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < pb.head_dim; ++d) s.kt[d * BLOCK_N + j] = static_cast<float>(k[j][d]);
    for (int64_t j = n; j < BLOCK_N; ++j)
      for (int64_t d = 0; d < pb.head_dim; ++d) s.kt[d * BLOCK_N + j] = 0.f;
    for_row_blocks(rows, [&](auto rb, int64_t r) {
      scores_gemm<decltype(rb)::value>(s.q.data() + r * dim, dim, pb.head_dim, s.kt.data(),
                                       s.scores.data() + r * BLOCK_N);
    });
  } else {
    for (int64_t j = 0; j < n; j += step) {
      for (int64_t h = 0; h < heads; ++h) {
        for_row_blocks(rows, [&](auto rb, int64_t r) {
          scores_dot<decltype(rb)::value>(s.q.data() + (h * rows + r) * dim, dim, k, j, std::min(j + step, n),
                                          h * pb.head_dim, s.scores.data() + (h * rows + r) * BLOCK_N);
        });
      }
    }
  }
  // Each row's visible keys [a, b) of the tile (the same for every head).
  int64_t a_min = n, b_max = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = prefix + u.t0 + r / group;
    const int64_t lo = pb.window > 0 ? std::max<int64_t>(0, pos + 1 - pb.window) : 0;
    const int64_t a = std::clamp<int64_t>(lo - j0, 0, n), b = std::clamp<int64_t>(pos + 1 - j0, 0, n);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = h * rows + r;
      float* sc = s.scores.data() + row * BLOCK_N;
      if (a >= b) {
        std::fill(sc, sc + n, 0.f);
        continue;
      }
      softmax_row(sc, n, a, b, pb.logit_cap, s.m[row], s.l[row], s.acc.data() + row * dim, dim);
    }
    if (a < b) {
      a_min = std::min(a_min, a);
      b_max = std::max(b_max, b);
    }
  }
  for (int64_t j = a_min; j < b_max; j += step) {
    const int64_t jb = std::min(j + step, b_max);
    for (int64_t h = 0; h < heads; ++h) {
      for_row_blocks(rows, [&](auto rb, int64_t r) {
        constexpr int RB = decltype(rb)::value;
        const float* p = s.scores.data() + (h * rows + r) * BLOCK_N;
        float* acc = s.acc.data() + (h * rows + r) * dim;
        const int64_t offset = h * pb.head_dim;
        int64_t d = 0;
        for (; d + 2 * VEC <= dim; d += 2 * VEC) accumulate_pv<RB, 2>(p, v, j, jb, offset, d, dim, acc);
        if (d < dim) accumulate_pv<RB, 1>(p, v, j, jb, offset, d, dim, acc);
      });
    }
  }
}

// Pointers to the rows of keys j0 .. j0 + n - 1 of the unit's request and kv head. Walks the pages instead of
// dividing per key; table entries past the request's last key are never read.
template <typename T>
void tile_rows(const Problem<T>& pb, const Unit& u, int64_t j0, int64_t n, const T** k_rows, const T** v_rows) {
  int64_t page = j0 / pb.page_size, in_page = j0 % pb.page_size;
  for (int64_t j = 0; j < n; ++j, ++in_page) {
    if (in_page == pb.page_size) {
      ++page;
      in_page = 0;
    }
    if (j == 0 || in_page == 0) {
      k_rows[j] = pb.row(pb.k_cache, u.request, page, in_page, u.head);
      v_rows[j] = pb.row(pb.v_cache, u.request, page, in_page, u.head);
    } else {
      k_rows[j] = k_rows[j - 1] + pb.row_stride;
      v_rows[j] = v_rows[j - 1] + pb.row_stride;
    }
  }
}

template <typename T>
void prefetch_rows(const T* const* rows, int64_t n, int64_t row_bytes) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(rows[j]) + b, 0, 2);
}

// Rows in place when the head dim is whole vectors; else copied (fp32, zero-padded) into the scratch tile.
template <typename T>
void run_unit(const Problem<T>& pb, const Unit& u, Scratch& s) {
  const int64_t dim = pb.padded_dim, group = pb.group, rows = u.num_tokens * group, all_rows = u.num_heads * rows;
  const int64_t q_start = pb.md.cu[u.request] + u.t0;
  // Scratch row h * rows + r: query token r / group, query head (u.head + h) * group + r % group.
  const auto q_head = [&](int64_t row) { return (u.head + row / rows) * group + row % rows % group; };
  const auto q_token = [&](int64_t row) { return q_start + row % rows / group; };
  for (int64_t row = 0; row < all_rows; ++row) {
    const T* src = pb.q + q_token(row) * pb.q_strides[0] + q_head(row) * pb.q_strides[1];
    float* dst = s.q.data() + row * dim;
    for (int64_t d = 0; d < pb.head_dim; ++d) dst[d] = static_cast<float>(src[d * pb.q_strides[2]]) * pb.scale;
    std::fill(dst + pb.head_dim, dst + dim, 0.f);
  }
  std::fill(s.acc.begin(), s.acc.begin() + all_rows * dim, 0.f);
  std::fill(s.m.begin(), s.m.begin() + all_rows, NEG_INF);
  std::fill(s.l.begin(), s.l.begin() + all_rows, 0.f);

  const bool in_place = pb.head_dim == dim;  // always for a unit of several heads (forward_typed)
  const int64_t row_bytes = pb.head_dim * static_cast<int64_t>(sizeof(T));
  const T* k_tiles[2][BLOCK_N];
  const T* v_tiles[2][BLOCK_N];
  const float* k_packed[BLOCK_N];
  const float* v_packed[BLOCK_N];
  tile_rows(pb, u, u.lo, std::min(BLOCK_N, u.hi - u.lo), k_tiles[0], v_tiles[0]);
  for (int64_t j0 = u.lo, t = 0; j0 < u.hi; j0 += BLOCK_N, t ^= 1) {
    const int64_t n = std::min(BLOCK_N, u.hi - j0), next = j0 + BLOCK_N;
    const T** k_rows = k_tiles[t];
    const T** v_rows = v_tiles[t];
    // One kv head's rows lie Hkv * D apart (not one stream): prefetch the next tile's while this one computes. A
    // unit of every head reads its pages front to back, which the hardware prefetcher follows better on its own.
    if (next < u.hi) {
      const int64_t n_next = std::min(BLOCK_N, u.hi - next);
      tile_rows(pb, u, next, n_next, k_tiles[t ^ 1], v_tiles[t ^ 1]);
      if (u.num_heads == 1) {
        prefetch_rows(k_tiles[t ^ 1], n_next, row_bytes);
        prefetch_rows(v_tiles[t ^ 1], n_next, row_bytes);
      }
    }
    if (in_place) {
      attend_tile(pb, u, j0, n, k_rows, v_rows, rows, s);
      continue;
    }
    for (int64_t j = 0; j < n; ++j) {
      float* kd = s.packed_k.data() + j * dim;
      float* vd = s.packed_v.data() + j * dim;
      for (int64_t d = 0; d < pb.head_dim; ++d) {
        kd[d] = static_cast<float>(k_rows[j][d]);
        vd[d] = static_cast<float>(v_rows[j][d]);
      }
      k_packed[j] = kd;
      v_packed[j] = vd;
    }
    attend_tile(pb, u, j0, n, k_packed, v_packed, rows, s);
  }

  for (int64_t row = 0; row < all_rows; ++row) {
    const float* acc = s.acc.data() + row * dim;
    const float inv = s.l[row] > 0 ? 1.f / s.l[row] : 0.f;
    if (u.partial < 0) {
      T* dst = pb.out + (q_token(row) * pb.num_kv_heads * group + q_head(row)) * pb.head_dim;
      for (int64_t d = 0; d < pb.head_dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
    } else {
      float* dst = pb.partial_out + (u.partial + row) * pb.head_dim;
      for (int64_t d = 0; d < pb.head_dim; ++d) dst[d] = acc[d] * inv;
      pb.partial_lse[u.partial + row] = s.l[row] > 0 ? s.m[row] + std::log(s.l[row]) : NEG_INF;
    }
  }
}

// Combines a request's key slices: out = sum_s exp(lse_s - max) out_s / sum_s exp(lse_s - max).
template <typename T>
void run_merge(const Problem<T>& pb, const Merge& mg) {
  const int64_t rows = mg.num_tokens * pb.group, q_start = pb.md.cu[mg.request];
  std::vector<float> acc(pb.head_dim);
  for (int64_t r = 0; r < rows; ++r) {
    float mx = NEG_INF;
    for (int64_t sp = 0; sp < mg.num_splits; ++sp) {
      mx = std::max(mx, pb.partial_lse[mg.partial + sp * mg.split_stride + r]);
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    float total = 0.f;
    for (int64_t sp = 0; sp < mg.num_splits; ++sp) {
      const int64_t row = mg.partial + sp * mg.split_stride + r;
      if (pb.partial_lse[row] == NEG_INF) continue;
      const float w = std::exp(pb.partial_lse[row] - mx);
      total += w;
      for (int64_t d = 0; d < pb.head_dim; ++d) acc[d] += w * pb.partial_out[row * pb.head_dim + d];
    }
    const float inv = total > 0 ? 1.f / total : 0.f;
    T* dst = pb.out + ((q_start + r / pb.group) * pb.num_kv_heads * pb.group + mg.head * pb.group + r % pb.group) *
                          pb.head_dim;
    for (int64_t d = 0; d < pb.head_dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
  }
}

// Runs fn(i) for i in [0, n) on every thread, each taking the next index from a shared counter.
template <typename F>
void parallel_dynamic(int64_t n, F&& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) fn(i);
  });
}

template <typename T>
void store_kv(const at::Tensor& src, at::Tensor& cache, const Metadata& md, const std::vector<int64_t>& request_of,
              int64_t page_size) {
  const int64_t num_tokens = src.size(0), heads = src.size(1), dim = src.size(2);
  const int64_t st = src.stride(0), sh = src.stride(1), sd = src.stride(2);
  const T* s = src.data_ptr<T>();
  T* c = cache.data_ptr<T>();
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = request_of[t];
      const int64_t pos = md.lens[i] - (md.cu[i + 1] - md.cu[i]) + t - md.cu[i];
      const int64_t page = md.table[i * md.table_stride + pos / page_size];
      T* dst = c + (page * page_size + pos % page_size) * heads * dim;
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < dim; ++d) dst[h * dim + d] = s[t * st + h * sh + d * sd];
    }
  });
}

template <typename T>
at::Tensor forward_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                         at::Tensor& v_cache, const Metadata& md, double scale, int64_t window, double logit_cap) {
  const int64_t num_tokens = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t page_size = k_cache.size(1), num_kv_heads = k_cache.size(2), group = num_q_heads / num_kv_heads;
  auto out = at::empty({num_tokens, num_q_heads, head_dim}, q.options());
  if (num_tokens == 0) return out;

  // Units and merges, from the metadata alone (the same for a request in any batch).
  const int64_t block_tokens = std::max<int64_t>(1, BLOCK_ROWS / group);
  std::vector<Unit> units;
  std::vector<Merge> merges;
  std::vector<int64_t> request_of(num_tokens);
  int64_t partial_rows = 0, max_rows = 0;
  for (int64_t i = 0; i < md.num_requests; ++i) {
    const int64_t q_len = md.cu[i + 1] - md.cu[i], len = md.lens[i], prefix = len - q_len;
    std::fill(request_of.begin() + md.cu[i], request_of.begin() + md.cu[i + 1], i);
    for (int64_t t0 = 0; t0 < q_len; t0 += block_tokens) {
      const int64_t nt = std::min(block_tokens, q_len - t0);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, prefix + t0 + 1 - window) : 0, hi = prefix + t0 + nt;
      // Few rows per kv head, whole-vector rows: a unit takes every kv head, so that it reads each position's
      // Hkv * D elements together (one stream per page); else a unit per kv head.
      const int64_t rows = nt * group, heads = rows < GEMM_ROWS && head_dim % VEC == 0 ? num_kv_heads : 1;
      const int64_t split = heads > 1 ? KV_SPLIT_ALL_HEADS : KV_SPLIT;
      const int64_t splits = q_len <= block_tokens ? (hi - lo + split - 1) / split : 1;
      max_rows = std::max(max_rows, heads * rows);
      for (int64_t h = 0; h < num_kv_heads; h += heads) {
        if (splits <= 1) {
          units.push_back({i, h, heads, t0, nt, lo, hi, -1});
          continue;
        }
        for (int64_t g = 0; g < heads; ++g) {
          merges.push_back({i, h + g, nt, splits, partial_rows + g * rows, heads * rows});
        }
        for (int64_t sp = 0; sp < splits; ++sp) {
          units.push_back({i, h, heads, t0, nt, lo + sp * split, std::min(hi, lo + (sp + 1) * split), partial_rows});
          partial_rows += heads * rows;
        }
      }
    }
  }

  store_kv<T>(k, k_cache, md, request_of, page_size);
  store_kv<T>(v, v_cache, md, request_of, page_size);

  auto partial_out = at::empty({partial_rows, head_dim}, q.options().dtype(at::kFloat));
  auto partial_lse = at::empty({partial_rows}, q.options().dtype(at::kFloat));
  Problem<T> pb{q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), out.data_ptr<T>(),
                partial_out.data_ptr<float>(), partial_lse.data_ptr<float>(), md,
                {q.stride(0), q.stride(1), q.stride(2)}, page_size, num_kv_heads, group, head_dim,
                (head_dim + VEC - 1) / VEC * VEC, static_cast<float>(scale), static_cast<float>(logit_cap), window,
                num_kv_heads * head_dim};
  const int64_t num_threads = at::get_num_threads();
  std::vector<std::unique_ptr<Scratch>> scratch(num_threads);
  parallel_dynamic(static_cast<int64_t>(units.size()), [&](int64_t i) {
    auto& s = scratch[at::get_thread_num()];
    if (!s) s = std::make_unique<Scratch>(max_rows, pb.padded_dim);
    run_unit(pb, units[i], *s);
  });
  // parallel_for returns when every unit is done: the merges read finished slices.
  parallel_dynamic(static_cast<int64_t>(merges.size()), [&](int64_t i) { run_merge(pb, merges[i]); });
  return out;
}

}  // namespace

namespace hybrid_ops {

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                           const at::Tensor& block_table, double scale, int64_t window, double logit_cap,
                           bool decode) {
  const auto cu = cu_seqlens_q.contiguous(), lens = seq_lens.contiguous(), table = block_table.contiguous();
  const Metadata md{cu.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), table.data_ptr<int32_t>(), table.size(1),
                    table.size(1), lens.size(0)};
  if (!metadata_ok(md, q.size(0), k_cache.size(0), k_cache.size(1), decode)) return at::Tensor();
  switch (q.scalar_type()) {
    case at::kFloat: return forward_typed<float>(q, k, v, k_cache, v_cache, md, scale, window, logit_cap);
    case at::kHalf: return forward_typed<at::Half>(q, k, v, k_cache, v_cache, md, scale, window, logit_cap);
    case at::kBFloat16: return forward_typed<at::BFloat16>(q, k, v, k_cache, v_cache, md, scale, window, logit_cap);
    default: TORCH_CHECK(false, "q must be float32, float16 or bfloat16");
  }
}

}  // namespace hybrid_ops
