// What the kernel's files share: the problem every unit reads, per-thread scratch, the helpers of both attention
// paths, and the function templates each file defines. A file instantiates its templates for the pairs of element
// types HYBRID_OPS_CPU_TYPES lists, and no other file compiles them again. None of them sees an at::Tensor: the entry
// (paged_attention.cpp) hands them pointers, which keeps their builds light.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "fp8.h"
#include "schedule.h"

namespace hybrid_ops::cpu {

static_assert(BLOCK_N % VEC == 0 && KV_SPLIT % BLOCK_N == 0 && KV_SPLIT_ALL_HEADS % BLOCK_N == 0);
constexpr int64_t GEMM_M = 16;  // the brgemm products' row counts are multiples of this (AMX tile rows): few shapes
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// The pairs (T, C) of q's element type and the caches': q's, or fp8.
// clang-format off
#define HYBRID_OPS_CPU_TYPES(X)                                                                 \
  X(float, float) X(at::Half, at::Half) X(at::BFloat16, at::BFloat16)                           \
  X(float, at::Float8_e4m3fn) X(at::Half, at::Float8_e4m3fn) X(at::BFloat16, at::Float8_e4m3fn) \
  X(float, at::Float8_e5m2) X(at::Half, at::Float8_e5m2) X(at::BFloat16, at::Float8_e5m2)
// clang-format on

inline Vec load_row(const float* p) { return Vec::loadu(p); }
template <typename T>
inline Vec load_row(const T* p) {
  if constexpr (is_fp8<T>) {
    return load_raw(p);
  } else {
    Vec out;
    at::vec::load_to_float(p, out);
    return out;
  }
}

// Whether few rows over bf16 rows in place multiply pairs of bf16 values (vdpbf16ps, attend_inplace.cpp): in the
// AVX512 builds with BF16 (hybrid_ops/backends/cpu.py).
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define HYBRID_OPS_BF16_PAIRS 1  // for the code that only such builds compile
constexpr bool BF16_PAIRS = true;
#else
constexpr bool BF16_PAIRS = false;
#endif
template <typename R>
constexpr bool bf16_pairs = BF16_PAIRS && std::is_same_v<R, at::BFloat16>;

// Vectors of a row that load_rows widens from one load: WIDE_VECS for fp8 (4 with AVX512-VBMI), else 1.
template <typename R>
constexpr int row_vecs = is_fp8<R> ? WIDE_VECS : 1;

// row_vecs<R> vectors of a row, out[v] holding values v * VEC ..
template <typename R>
inline void load_rows(const R* p, Vec* out) {
  if constexpr (is_fp8<R>) {
    load_raw_wide(p, out);
  } else {
    out[0] = load_row(p);
  }
}

inline float hsum(const Vec& x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Whether many rows of q in T over a C cache may multiply in T on AMX: 16-bit caches in q's dtype, not fp8.
template <typename T, typename C>
constexpr bool amx_type = std::is_same_v<T, C> && !std::is_same_v<T, float>;

// Whether they do (attend_brgemm.cpp).
template <typename T, typename C>
bool amx_available();

// A unit's query rows in scratch, head-major: row r is the query token token(r) of the batch, for query head q_head(r)
// of kv head kv_head(r). per_head: the unit's tokens x group; count: per_head for each of its kv heads.
struct QueryRows {
  int64_t first_token, first_head, group, per_head, count;
  int64_t token(int64_t r) const { return first_token + r % per_head / group; }
  int64_t kv_head(int64_t r) const { return first_head + r / per_head; }
  int64_t q_head(int64_t r) const { return kv_head(r) * group + r % group; }
};

// Everything a unit reads; T is q's element type, C the caches' (T or fp8).
template <typename T, typename C>
struct Problem {
  const T* q;
  const C *k_cache, *v_cache;
  T* out;                            // [T, Hq, Dv] contiguous
  float *partial_out, *partial_lse;  // [rows, Dv], [rows]
  const float *k_scale, *v_scale;    // [Hkv]: each kv head's scales (1 for caches in q's dtype)
  const float* sinks;                // [Hq] logits, or null
  // Tiles of PackJobs in the products' type: K^T then V, GEMM_BLOCK_N * (padded_dim + v_padded_dim) elements each.
  void* packed;
  Metadata md;
  int64_t q_strides[3], page_size, num_kv_heads, group;
  int64_t head_dim, padded_dim, v_head_dim, v_padded_dim;  // D and Dv, and rounded up to whole vectors
  // Elements from a cache row's head to the next: D and Dv, or wider for values that lead each row of a latent cache.
  int64_t k_head_stride, v_head_stride;
  float scale, logit_cap;
  int64_t window, chunk, gemm_rows;  // gemm_rows: the schedule's (schedule.h)

  // One kv head's row `in_page` of the request's `page`-th page, in a cache whose heads are head_stride apart.
  const C* row(const C* cache, int64_t head_stride, int64_t request, int64_t page, int64_t in_page,
               int64_t head) const {
    const int64_t id = md.table[request * md.table_stride + page];
    return cache + ((id * page_size + in_page) * num_kv_heads + head) * head_stride;
  }
  int64_t tile_elems() const { return GEMM_BLOCK_N * (padded_dim + v_padded_dim); }
  QueryRows rows_of(const Unit& u) const {
    const int64_t per_head = u.num_tokens * group;
    return {.first_token = md.cu[u.request] + u.t0,
            .first_head = u.head,
            .group = group,
            .per_head = per_head,
            .count = u.num_heads * per_head};
  }
  // Query row r of a unit's rows.
  const T* q_row(const QueryRows& rows, int64_t r) const {
    return q + rows.token(r) * q_strides[0] + rows.q_head(r) * q_strides[1];
  }
};

// The operands of a many-rows tile's two products in G, the type brgemm multiplies (fp32; 16-bit on AMX):
// q [m, D]; K rows staged [GEMM_BLOCK_N, D]; K^T [D, GEMM_BLOCK_N]; V [GEMM_BLOCK_N, Dv]; P [m, GEMM_BLOCK_N]. In
// 16-bit, K^T and V are in VNNI pairs ([D / 2, GEMM_BLOCK_N, 2], [GEMM_BLOCK_N / 2, Dv, 2]); fp32 P is the scores.
template <typename G>
struct GemmTiles {
  std::vector<G> q, k_rows, kt, v, p;
  void allocate(int64_t rows, int64_t dim, int64_t v_dim) {
    const int64_t m = round_up(rows, GEMM_M);
    q.assign(m * dim, G(0.f));
    k_rows.assign(GEMM_BLOCK_N * dim, G(0.f));
    kt.assign(dim * GEMM_BLOCK_N, G(0.f));
    v.assign(GEMM_BLOCK_N * v_dim, G(0.f));
    if (!std::is_same_v<G, float>) p.assign(m * GEMM_BLOCK_N, G(0.f));
  }
};

// Per-thread scratch, reused across the units a thread takes; the brgemm tiles in the type its products take.
template <typename T, typename C>
struct Scratch {
  const bool amx;
  std::vector<float> q, acc, scores, m, l, tile_max, alpha, packed_k, packed_v;
  std::vector<uint32_t> p_pairs;  // bf16_pairs: the probabilities of pairs of keys, [rows][BLOCK_N] (attend_inplace)
  std::vector<int64_t> key_begin, key_end;  // the request's keys [key_begin[r], key_end[r]) that row r sees
  // With a tree (unit.cpp): row r's mask row, and its token's index among the request's new tokens; the unit's
  // request's prefix length and its new tokens' depths.
  std::vector<const bool*> tree_row;
  std::vector<int64_t> own;
  int64_t prefix = 0;
  const int32_t* new_depth = nullptr;
  GemmTiles<float> f32;
  GemmTiles<T> amx16;
  // rows: the most rows of a unit; gemm_rows: of a unit whose products go through brgemm (0: none).
  Scratch(int64_t rows, int64_t gemm_rows, int64_t padded_dim, int64_t v_padded_dim)
      : amx(amx_available<T, C>()),
        q(rows * padded_dim),
        acc(round_up(rows, GEMM_M) * v_padded_dim),
        scores(round_up(rows, GEMM_M) * GEMM_BLOCK_N),
        m(rows),
        l(rows),
        tile_max(rows),
        alpha(rows),
        packed_k(BLOCK_N * padded_dim, 0.f),
        packed_v(BLOCK_N * v_padded_dim, 0.f),
        p_pairs(bf16_pairs<C> ? rows * BLOCK_N : 0),
        key_begin(rows),
        key_end(rows),
        tree_row(rows),
        own(rows) {
    if (gemm_rows == 0) return;
    if (amx) {
      amx16.allocate(gemm_rows, padded_dim, v_padded_dim);
    } else {
      f32.allocate(gemm_rows, padded_dim, v_padded_dim);
    }
  }
  template <typename G>
  GemmTiles<G>& tiles() {
    if constexpr (std::is_same_v<G, float>) {
      return f32;
    } else {
      return amx16;
    }
  }
};

// Pointers to the rows of keys j0 .. j0 + n - 1 of a request's kv head. Walks the pages instead of dividing per key;
// table entries past the request's last key are never read.
template <typename T, typename C>
void tile_rows(const Problem<T, C>& pb, int64_t request, int64_t head, int64_t j0, int64_t n, const C** k_rows,
               const C** v_rows) {
  int64_t page = j0 / pb.page_size, in_page = j0 % pb.page_size;
  for (int64_t j = 0; j < n; ++j, ++in_page) {
    if (in_page == pb.page_size) {
      ++page;
      in_page = 0;
    }
    if (j == 0 || in_page == 0) {
      k_rows[j] = pb.row(pb.k_cache, pb.k_head_stride, request, page, in_page, head);
      v_rows[j] = pb.row(pb.v_cache, pb.v_head_stride, request, page, in_page, head);
    } else {
      k_rows[j] = k_rows[j - 1] + pb.num_kv_heads * pb.k_head_stride;
      v_rows[j] = v_rows[j - 1] + pb.num_kv_heads * pb.v_head_stride;
    }
  }
}

// Scratch row r's accumulators (dim values) times alpha, the online softmax's factor of its old sums, unless it is 1.
template <typename T, typename C>
void rescale_acc(Scratch<T, C>& s, int64_t r, int64_t dim, float alpha) {
  if (alpha == 1.f) return;
  float* acc = s.acc.data() + r * dim;
  for (int64_t d = 0; d < dim; d += VEC) (Vec::loadu(acc + d) * Vec(alpha)).store(acc + d);
}

// Keys [a, b) of a tile starting at key j0 with n keys that scratch row r of the unit sees (a >= b: none).
template <typename T, typename C>
std::pair<int64_t, int64_t> visible(const Scratch<T, C>& s, int64_t r, int64_t j0, int64_t n) {
  return {std::clamp<int64_t>(s.key_begin[r] - j0, 0, n), std::clamp<int64_t>(s.key_end[r] - j0, 0, n)};
}

// Online softmax of rows [r0, r1) over a tile of n keys starting at key j0, whose scores s.scores hold (row r at
// r * ld) times score_scale: p times p_scale replaces the scores of each row's visible keys (0 elsewhere in [0, n)),
// and m, l (the sums of p) and acc are updated. Returns the visible span [a_min, b_max) over the rows (empty: nothing
// to accumulate). Both paths take it (unit.cpp).
template <typename T, typename C>
std::pair<int64_t, int64_t> softmax_tile(const Problem<T, C>& pb, int64_t j0, int64_t n, int64_t ld, float score_scale,
                                         float p_scale, int64_t r0, int64_t r1, Scratch<T, C>& s);

// A unit's attention, its scratch rows' keys, maxima, sums and accumulators set up (unit.cpp), for few rows per kv
// head (attend_inplace.cpp) or many (attend_brgemm.cpp). following: the unit the thread takes next, or null.
template <typename T, typename C>
void attend_inplace(const Problem<T, C>& pb, const Unit& u, Scratch<T, C>& s, const Unit* following);
template <typename T, typename C>
void attend_brgemm(const Problem<T, C>& pb, const Unit& u, Scratch<T, C>& s);

// The index-th PackJob's tile into pb.packed (attend_brgemm.cpp).
template <typename T, typename C>
void pack(const Problem<T, C>& pb, const PackJob& job, int64_t index, Scratch<T, C>& s);

// A unit, its output or split partials written; a request's slices merged into its output (unit.cpp).
template <typename T, typename C>
void run_unit(const Problem<T, C>& pb, const Unit& u, Scratch<T, C>& s, const Unit* following);
template <typename T, typename C>
void run_merge(const Problem<T, C>& pb, const Merge& mg);

// A cache and its new rows: src [T, Hkv, dim] in q's dtype, any strides, into cache [num_pages, page_size, Hkv, dim]
// whose heads' rows are head_stride >= dim apart (dim unless its values lead a latent cache's rows); fp8 caches
// quantized with kv_scale [Hkv].
template <typename T, typename C>
struct KvRows {
  const T* src;
  int64_t src_strides[3];
  C* cache;
  int64_t dim, head_stride;
  const float* kv_scale;
};

// The new tokens' k and v into the caches' rows of their positions (kv_store.cpp).
template <typename T, typename C>
void store_kv(const KvRows<T, C>& k, const KvRows<T, C>& v, const Metadata& md, int64_t page_size,
              int64_t num_kv_heads);

}  // namespace hybrid_ops::cpu
