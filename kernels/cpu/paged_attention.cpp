// Paged attention on the CPU: KV store, then attention of every request's new tokens over its pages, read where
// they lie (no gather copy). Shapes and metadata as in hybrid_ops/metadata.py:
//   q [T, Hq, D], k, v [T, Hkv, D] (any strides); k_cache, v_cache [num_pages, page_size, Hkv, D] contiguous;
//   cu_seqlens_q [B + 1], seq_lens [B], block_table [B, max_pages] int32. Caches fp32, fp16 or bf16; fp32 math.
//
// Work is cut into units (request, kv head, block of query tokens, slice of keys), taken by the threads of
// at::parallel_for from a shared counter, since units differ in length. One unit keeps the query rows of its kv
// head's group (tokens x GQA group) and streams its keys in tiles of BLOCK_N: each K/V row is loaded once per tile
// and serves every query row of the group (online softmax, fp32 accumulation). A request with one block of
// queries (decode, verify, a short chunk over a long prefix) splits its keys into slices of KV_SPLIT, merged by
// log-sum-exp, so a batch of one still uses every core. The slicing depends on the request alone, so a request's
// result is the same in any batch.
//
// The metadata's values are checked first (before anything is written); on bad values `forward` returns an
// undefined tensor (None in Python) and the caller reports which value is wrong.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

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
constexpr int64_t BLOCK_ROWS = 256;  // query rows (tokens x group) per unit of a longer prefill
constexpr int64_t GEMM_ROWS = 16;    // from this many rows, scores go through a transposed K tile (see scores_gemm)
constexpr int64_t AMX_BLOCK_N = 128;  // keys per tile of the 16-bit many-rows path on AMX (see attend_tile_amx)
constexpr int64_t AMX_ROWS = 16;      // its row count is padded to a multiple of this (AMX tile rows): few GEMM shapes
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
  int64_t request, head, t0, num_tokens;  // query tokens t0 .. t0 + num_tokens - 1 of the request
  int64_t lo, hi;                         // keys [lo, hi) of the request
  int64_t partial;                        // first row in the split partials, or -1: write the output directly
};

struct Merge {
  int64_t request, head, num_tokens, num_splits, partial;
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

// Whether fp16/bf16 many-rows tiles run on AMX: oneDNN's brgemm on VNNI-packed tiles. cpublas reports packing
// available exactly when its brgemm takes the dtype on AMX (bf16: AMX-BF16; fp16: AMX-FP16).
template <typename T>
bool amx_available() {
  return !std::is_same_v<T, float> && at::native::cpublas::could_pack(c10::CppTypeToScalarType<T>::value);
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Per-thread scratch, reused across the units a thread takes; the 16-bit tiles only when AMX runs.
template <typename T>
struct Scratch {
  const bool amx;
  std::vector<float> q, acc, scores, m, l, kt, packed_k, packed_v;
  std::vector<T> q16, k_vnni, v_vnni, p16;
  Scratch(int64_t rows, int64_t padded_dim)
      : amx(amx_available<T>() && rows >= GEMM_ROWS), q(rows * padded_dim),
        acc(round_up(rows, AMX_ROWS) * padded_dim), scores(round_up(rows, AMX_ROWS) * AMX_BLOCK_N), m(rows), l(rows),
        kt(padded_dim * BLOCK_N), packed_k(BLOCK_N * padded_dim, 0.f), packed_v(BLOCK_N * padded_dim, 0.f) {
    if (!amx) return;
    q16.assign(round_up(rows, AMX_ROWS) * padded_dim, T(0.f));
    k_vnni.assign(padded_dim * AMX_BLOCK_N, T(0.f));
    v_vnni.assign(AMX_BLOCK_N * padded_dim, T(0.f));
    p16.assign(round_up(rows, AMX_ROWS) * AMX_BLOCK_N, T(0.f));
  }
};

// scores[r, j] = q[r] . k_j for RB rows (few rows: decode, verify), KB keys at a time: one load of each K chunk
// serves the RB rows, and RB x KB independent accumulators keep the FMA units busy.
template <int RB, int KB, typename R>
void scores_dot_keys(const float* q, int64_t dim, const R* const* k, int64_t j, float* scores) {
  Vec acc[RB][KB];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KB; ++c) acc[r][c] = Vec(0.f);
  for (int64_t d = 0; d < dim; d += VEC) {
    Vec kv[KB];
    for (int c = 0; c < KB; ++c) kv[c] = load_row(k[j + c] + d);
    for (int r = 0; r < RB; ++r) {
      const Vec qv = Vec::loadu(q + r * dim + d);
      for (int c = 0; c < KB; ++c) acc[r][c] = at::vec::fmadd(qv, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KB; ++c) scores[r * BLOCK_N + j + c] = hsum(acc[r][c]);
}

template <int RB, typename R>
void scores_dot(const float* q, int64_t dim, const R* const* k, int64_t n, float* scores) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) scores_dot_keys<RB, 4>(q, dim, k, j, scores);
  for (; j < n; ++j) scores_dot_keys<RB, 1>(q, dim, k, j, scores);
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

// acc[r] += sum_j p[r, j] v_j for RB rows and DB vectors of the head dim, j in [a, b): one load of each V chunk
// serves the RB rows.
template <int RB, int DB, typename R>
void accumulate_pv(const float* p, const R* const* v, int64_t a, int64_t b, int64_t d0, int64_t dim, float* acc) {
  Vec sum[RB][DB];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < DB; ++c) sum[r][c] = Vec::loadu(acc + r * dim + d0 + c * VEC);
  for (int64_t j = a; j < b; ++j) {
    Vec vv[DB];
    for (int c = 0; c < DB; ++c) vv[c] = load_row(v[j] + d0 + c * VEC);
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

// Online softmax over a tile of n keys whose scores s.scores hold, ld apart, times score_scale: per row over its
// visible keys [a, b) of the tile, p replaces the scores (0 where not visible), m, l and acc are updated. Returns the
// tile's visible span [a_min, b_max) over all rows (empty: nothing to accumulate).
template <typename T>
std::pair<int64_t, int64_t> softmax_tile(const Problem<T>& pb, const Unit& u, int64_t j0, int64_t n, int64_t ld,
                                         float score_scale, int64_t rows, Scratch<T>& s) {
  const int64_t dim = pb.padded_dim, group = pb.group;
  const int64_t prefix = pb.md.lens[u.request] - (pb.md.cu[u.request + 1] - pb.md.cu[u.request]);
  int64_t a_min = n, b_max = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = prefix + u.t0 + r / group;
    const int64_t lo = pb.window > 0 ? std::max<int64_t>(0, pos + 1 - pb.window) : 0;
    const int64_t a = std::clamp<int64_t>(lo - j0, 0, n), b = std::clamp<int64_t>(pos + 1 - j0, 0, n);
    float* sc = s.scores.data() + r * ld;
    if (a >= b) {
      std::fill(sc, sc + n, 0.f);
      continue;
    }
    a_min = std::min(a_min, a);
    b_max = std::max(b_max, b);
    if (score_scale != 1.f) {
      for (int64_t j = a; j < b; ++j) sc[j] *= score_scale;
    }
    if (pb.logit_cap > 0) {
      for (int64_t j = a; j < b; ++j) sc[j] = pb.logit_cap * std::tanh(sc[j] / pb.logit_cap);
    }
    float mx = NEG_INF;
    int64_t j = a;
    if (b - a >= VEC) {
      Vec mv(NEG_INF);
      for (; j + VEC <= b; j += VEC) mv = at::vec::maximum(mv, Vec::loadu(sc + j));
      mx = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, mv);
    }
    for (; j < b; ++j) mx = std::max(mx, sc[j]);
    const float m_new = std::max(s.m[r], mx);
    const float alpha = std::exp(s.m[r] - m_new);  // 0 while no key was seen (m = -inf)
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
    s.m[r] = m_new;
    s.l[r] = s.l[r] * alpha + sum;
    if (alpha != 1.f) {
      float* acc = s.acc.data() + r * dim;
      for (int64_t d = 0; d < dim; d += VEC) (Vec::loadu(acc + d) * Vec(alpha)).store(acc + d);
    }
  }
  return {a_min, b_max};
}

// One tile of n keys, rows given as pointers to `padded_dim` values (cache rows in place, or packed fp32 rows).
template <typename T, typename R>
void attend_tile(const Problem<T>& pb, const Unit& u, int64_t j0, int64_t n, const R* const* k, const R* const* v,
                 int64_t rows, Scratch<T>& s) {
  const int64_t dim = pb.padded_dim;
  if (rows >= GEMM_ROWS) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < pb.head_dim; ++d) s.kt[d * BLOCK_N + j] = static_cast<float>(k[j][d]);
    for (int64_t j = n; j < BLOCK_N; ++j)
      for (int64_t d = 0; d < pb.head_dim; ++d) s.kt[d * BLOCK_N + j] = 0.f;
    for_row_blocks(rows, [&](auto rb, int64_t r) {
      scores_gemm<decltype(rb)::value>(s.q.data() + r * dim, dim, pb.head_dim, s.kt.data(),
                                       s.scores.data() + r * BLOCK_N);
    });
  } else {
    for_row_blocks(rows, [&](auto rb, int64_t r) {
      scores_dot<decltype(rb)::value>(s.q.data() + r * dim, dim, k, n, s.scores.data() + r * BLOCK_N);
    });
  }
  const auto [a_min, b_max] = softmax_tile(pb, u, j0, n, BLOCK_N, 1.f, rows, s);
  if (a_min >= b_max) return;
  for_row_blocks(rows, [&](auto rb, int64_t r) {
    constexpr int RB = decltype(rb)::value;
    const float* p = s.scores.data() + r * BLOCK_N;
    float* acc = s.acc.data() + r * dim;
    int64_t d = 0;
    for (; d + 2 * VEC <= dim; d += 2 * VEC) accumulate_pv<RB, 2>(p, v, a_min, b_max, d, dim, acc);
    if (d < dim) accumulate_pv<RB, 1>(p, v, a_min, b_max, d, dim, acc);
  });
}

// Two 16-bit values as one 32-bit word (a VNNI pair), the first in the low half.
template <typename T>
inline uint32_t pair_bits(T lo, T hi) {
  return static_cast<uint32_t>(c10::bit_cast<uint16_t>(lo)) | static_cast<uint32_t>(c10::bit_cast<uint16_t>(hi)) << 16;
}

// One tile of n <= AMX_BLOCK_N keys for many rows of a 16-bit cache, on AMX: S = Q K^T and acc += P V by brgemm, with
// q rows in the cache dtype (the scale applied to the fp32 scores), K^T and V packed into VNNI pairs ([D / 2,
// AMX_BLOCK_N, 2] and [AMX_BLOCK_N / 2, D, 2], zero past n keys and the head dim), and P rounded to the cache dtype
// for its product, as flash attention does; softmax and accumulation in fp32.
template <typename T>
void attend_tile_amx(const Problem<T>& pb, const Unit& u, int64_t j0, int64_t n, const T* const* k,
                     const T* const* v, int64_t rows, Scratch<T>& s) {
  const int64_t dim = pb.padded_dim, pairs = pb.head_dim / 2, m = round_up(rows, AMX_ROWS);
  auto* kt = reinterpret_cast<uint32_t*>(s.k_vnni.data());
  auto* vp = reinterpret_cast<uint32_t*>(s.v_vnni.data());
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < pairs; ++i) kt[i * AMX_BLOCK_N + j] = pair_bits(k[j][2 * i], k[j][2 * i + 1]);
    if (pb.head_dim % 2) kt[pairs * AMX_BLOCK_N + j] = pair_bits(k[j][pb.head_dim - 1], T(0.f));
  }
  for (int64_t j = 0; j < n; j += 2) {
    uint32_t* dst = vp + (j / 2) * dim;
    const T* v1 = j + 1 < n ? v[j + 1] : nullptr;
    for (int64_t d = 0; d < pb.head_dim; ++d) dst[d] = pair_bits(v[j][d], v1 ? v1[d] : T(0.f));
  }
  if (n < AMX_BLOCK_N) {  // the last tile of a unit: zero the keys past n (later tiles of other units refill them)
    for (int64_t i = 0; i < dim / 2; ++i) std::fill(kt + i * AMX_BLOCK_N + n, kt + (i + 1) * AMX_BLOCK_N, 0u);
    std::fill(vp + round_up(n, 2) / 2 * dim, vp + AMX_BLOCK_N / 2 * dim, 0u);
  }
  at::native::cpublas::brgemm(m, AMX_BLOCK_N, dim, dim, AMX_BLOCK_N, AMX_BLOCK_N, false, s.q16.data(),
                              s.k_vnni.data(), s.scores.data(), true);
  const auto [a_min, b_max] = softmax_tile(pb, u, j0, n, AMX_BLOCK_N, pb.scale, rows, s);
  if (a_min >= b_max) return;
  for (int64_t r = 0; r < rows; ++r) {
    const float* sc = s.scores.data() + r * AMX_BLOCK_N;
    T* p = s.p16.data() + r * AMX_BLOCK_N;
    at::vec::convert(sc, p, n);
    std::fill(p + n, p + AMX_BLOCK_N, T(0.f));
  }
  at::native::cpublas::brgemm(m, dim, AMX_BLOCK_N, AMX_BLOCK_N, dim, dim, true, s.p16.data(), s.v_vnni.data(),
                              s.acc.data(), true);
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

// Rows in place when the head dim is whole vectors; else copied (fp32, zero-padded) into the scratch tile. Many rows
// of a 16-bit cache on AMX: packed per tile instead (attend_tile_amx).
template <typename T>
void run_unit(const Problem<T>& pb, const Unit& u, Scratch<T>& s) {
  const int64_t dim = pb.padded_dim, group = pb.group, rows = u.num_tokens * group;
  const int64_t q_start = pb.md.cu[u.request] + u.t0;
  const bool amx = s.amx && rows >= GEMM_ROWS;
  const int64_t block_n = amx ? AMX_BLOCK_N : BLOCK_N;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = pb.q + (q_start + r / group) * pb.q_strides[0] + (u.head * group + r % group) * pb.q_strides[1];
    if (amx) {
      T* dst = s.q16.data() + r * dim;
      for (int64_t d = 0; d < pb.head_dim; ++d) dst[d] = src[d * pb.q_strides[2]];
      continue;
    }
    float* dst = s.q.data() + r * dim;
    for (int64_t d = 0; d < pb.head_dim; ++d) dst[d] = static_cast<float>(src[d * pb.q_strides[2]]) * pb.scale;
    std::fill(dst + pb.head_dim, dst + dim, 0.f);
  }
  if (amx) {  // rows up to the padded count: zero queries and probabilities, so they add nothing
    const int64_t m = round_up(rows, AMX_ROWS);
    std::fill(s.q16.begin() + rows * dim, s.q16.begin() + m * dim, T(0.f));
    std::fill(s.p16.begin() + rows * AMX_BLOCK_N, s.p16.begin() + m * AMX_BLOCK_N, T(0.f));
  }
  std::fill(s.acc.begin(), s.acc.begin() + rows * dim, 0.f);
  std::fill(s.m.begin(), s.m.begin() + rows, NEG_INF);
  std::fill(s.l.begin(), s.l.begin() + rows, 0.f);

  const bool in_place = pb.head_dim == dim;
  const int64_t row_bytes = pb.head_dim * static_cast<int64_t>(sizeof(T));
  const T* k_tiles[2][AMX_BLOCK_N];
  const T* v_tiles[2][AMX_BLOCK_N];
  const float* k_packed[BLOCK_N];
  const float* v_packed[BLOCK_N];
  tile_rows(pb, u, u.lo, std::min(block_n, u.hi - u.lo), k_tiles[0], v_tiles[0]);
  for (int64_t j0 = u.lo, t = 0; j0 < u.hi; j0 += block_n, t ^= 1) {
    const int64_t n = std::min(block_n, u.hi - j0), next = j0 + block_n;
    const T** k_rows = k_tiles[t];
    const T** v_rows = v_tiles[t];
    // The next tile's rows lie a kv-head row apart (not one stream): prefetch them while this tile computes.
    if (next < u.hi) {
      const int64_t n_next = std::min(block_n, u.hi - next);
      tile_rows(pb, u, next, n_next, k_tiles[t ^ 1], v_tiles[t ^ 1]);
      prefetch_rows(k_tiles[t ^ 1], n_next, row_bytes);
      prefetch_rows(v_tiles[t ^ 1], n_next, row_bytes);
    }
    if constexpr (!std::is_same_v<T, float>) {
      if (amx) {
        attend_tile_amx(pb, u, j0, n, k_rows, v_rows, rows, s);
        continue;
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
  if (amx) at::native::cpublas::brgemm_release();  // AMX's tile state, kept between tiles, freed per unit

  for (int64_t r = 0; r < rows; ++r) {
    const float* acc = s.acc.data() + r * dim;
    const float inv = s.l[r] > 0 ? 1.f / s.l[r] : 0.f;
    if (u.partial < 0) {
      T* dst = pb.out + ((q_start + r / group) * pb.num_kv_heads * group + u.head * group + r % group) * pb.head_dim;
      for (int64_t d = 0; d < pb.head_dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
    } else {
      float* dst = pb.partial_out + (u.partial + r) * pb.head_dim;
      for (int64_t d = 0; d < pb.head_dim; ++d) dst[d] = acc[d] * inv;
      pb.partial_lse[u.partial + r] = s.l[r] > 0 ? s.m[r] + std::log(s.l[r]) : NEG_INF;
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
    for (int64_t sp = 0; sp < mg.num_splits; ++sp) mx = std::max(mx, pb.partial_lse[mg.partial + sp * rows + r]);
    std::fill(acc.begin(), acc.end(), 0.f);
    float total = 0.f;
    for (int64_t sp = 0; sp < mg.num_splits; ++sp) {
      const int64_t row = mg.partial + sp * rows + r;
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
      const int64_t splits = q_len <= block_tokens ? (hi - lo + KV_SPLIT - 1) / KV_SPLIT : 1;
      max_rows = std::max(max_rows, nt * group);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        if (splits <= 1) {
          units.push_back({i, h, t0, nt, lo, hi, -1});
          continue;
        }
        merges.push_back({i, h, nt, splits, partial_rows});
        for (int64_t sp = 0; sp < splits; ++sp) {
          units.push_back({i, h, t0, nt, lo + sp * KV_SPLIT, std::min(hi, lo + (sp + 1) * KV_SPLIT), partial_rows});
          partial_rows += nt * group;
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
  std::vector<std::unique_ptr<Scratch<T>>> scratch(num_threads);
  parallel_dynamic(static_cast<int64_t>(units.size()), [&](int64_t i) {
    auto& s = scratch[at::get_thread_num()];
    if (!s) s = std::make_unique<Scratch<T>>(max_rows, pb.padded_dim);
    run_unit(pb, units[i], *s);
  });
  // parallel_for returns when every unit is done: the merges read finished slices.
  parallel_dynamic(static_cast<int64_t>(merges.size()), [&](int64_t i) { run_merge(pb, merges[i]); });
  return out;
}

at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                   const at::Tensor& block_table, double scale, int64_t window, double logit_cap, bool decode) {
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "KV store, then paged attention; None when the metadata's values are invalid");
}
