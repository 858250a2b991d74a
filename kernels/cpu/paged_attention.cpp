// Paged attention on the CPU: KV store, then attention of every request's new tokens over its pages, read where
// they lie (no gather copy). Shapes and metadata as in hybrid_ops/metadata.py:
//   q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] (any strides); k_cache [num_pages, page_size, Hkv, D], v_cache
//   [num_pages, page_size, Hkv, Dv] contiguous; cu_seqlens_q [B + 1], seq_lens [B], block_table [B, max_pages] int32;
//   out [T, Hq, Dv]; sinks [Hq] float32 or none. q fp32, fp16 or bf16; caches in q's dtype,
//   or fp8 (float8_e4m3fn, float8_e5m2) holding saturate(x / scale) with one fp32 scale per kv head for k and for v
//   (hybrid_ops/fp8.py); softmax and accumulation in fp32.
//
// Work is cut into units (request, kv heads, block of query tokens, slice of keys), taken by the threads of
// at::parallel_for from a shared counter, since units differ in length. One unit keeps the query rows of its kv
// heads' groups (tokens x GQA group) and streams its keys in tiles: each K/V row is loaded once per tile and serves
// every query row of its group (online softmax, fp32 accumulation). Few rows per kv head (decode, short verify) take
// dot products over tiles of BLOCK_N keys read in place, a unit taking every kv head and reading each 4 KiB page of
// memory in order (a position's Hkv * D elements lie together; see attend_tile). Many rows (prefill) take ATen's
// brgemm (oneDNN) per kv head over tiles of GEMM_BLOCK_N keys packed in fp32, or in the cache's 16-bit type on AMX:
// by the unit, or once for all the query blocks of a request. fp8 rows are read in place one byte per element and
// widened in registers (see Fp8); their scales apply to the query rows or scores (k) and to the output (v). A request
// with one block of queries (decode, verify, a short chunk over a long prefix) splits its keys into slices, merged by
// log-sum-exp, so a batch of one still uses several cores. The slicing depends on the request alone, so a request's
// result is the same in any batch and on any number of threads.
//
// The metadata's values are checked first (before anything is written); on bad values `paged_attention` returns an
// undefined tensor (None in Python) and the caller reports which value is wrong.

#include "paged_attention.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/bit_cast.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VEC = Vec::size();
constexpr int64_t BLOCK_N = 64;              // keys per tile (a multiple of VEC)
constexpr int64_t KV_SPLIT = 512;            // keys per slice of a request with one query block (a multiple of BLOCK_N)
constexpr int64_t KV_SPLIT_ALL_HEADS = 256;  // the same for a unit of every kv head
// The hardware prefetcher follows streams that rise within a 4 KiB page of memory: units of every kv head read each
// such page in order, PAGES_PER_PASS of them side by side (attend_tile); units of one kv head, whose rows lie Hkv * D
// apart, prefetch in software.
constexpr int64_t PAGE_BYTES = 4096;
constexpr int64_t PAGES_PER_PASS = 8;  // with 4 (fewer streams in flight), bf16 decode from L3 ran 20% slower
constexpr int64_t BLOCK_ROWS = 512;    // query rows (tokens x group) per unit of a longer prefill
constexpr int64_t GEMM_ROWS = 16;      // from this many rows, the products go through brgemm (see attend_tile_brgemm)
constexpr int64_t GEMM_BLOCK_N = 256;  // keys per tile of the brgemm path (see attend_tile_brgemm)
constexpr int64_t GEMM_M = 16;         // its products' row counts are multiples of this (AMX tile rows): few shapes
constexpr int64_t GEMM_N = 32;         // and their key counts (a divisor of GEMM_BLOCK_N)
constexpr int64_t GEMM_CHUNK = 64;     // rows per pair of its products (a multiple of GEMM_M)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// fp8 caches. A byte's raw value, the fp32 of its sign bit and, at the low end of fp32's exponent and mantissa, its
// other bits, is exactly its value / raw_unit (fp32's subnormals mirror fp8's): a sign extension, a shift and a mask.
// shift: fp32's mantissa bits past the format's; raw_unit: 2^(127 - bias).
template <typename C>
struct Fp8 {};
template <>
struct Fp8<at::Float8_e4m3fn> {
  static constexpr int shift = 20, bias = 7;
  static constexpr uint32_t mask = 0x87F00000u;  // sign, 4 exponent and 3 mantissa bits
  static constexpr float raw_unit = 0x1p120f, max = 448.f;
};
template <>
struct Fp8<at::Float8_e5m2> {
  static constexpr int shift = 21, bias = 15;
  static constexpr uint32_t mask = 0x8FE00000u;  // sign, 5 exponent and 2 mantissa bits
  static constexpr float raw_unit = 0x1p112f, max = 57344.f;
};
template <typename C>
constexpr bool is_fp8 = std::is_same_v<C, at::Float8_e4m3fn> || std::is_same_v<C, at::Float8_e5m2>;

// The rows of few-rows units hold raw fp8 values, near fp32's smallest normals. So that products and sums stay normal
// (subnormal results lose bits, and run slowly on some CPUs), the query rows and the probabilities take `lifted` of
// raw_unit each (they are O(1): far from fp32's largest), and the scores and the output the rest. All 1 but for fp8.
template <typename C>
constexpr float raw_unit() {
  if constexpr (is_fp8<C>) {
    return Fp8<C>::raw_unit;
  } else {
    return 1.f;
  }
}
template <typename C>
constexpr float lifted() {
  return is_fp8<C> ? 0x1p64f : 1.f;
}

// A cache element as few-rows units read it: its value, or (fp8) its raw value.
template <typename C>
inline float raw_value(C x) {
  if constexpr (is_fp8<C>) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(x.x))) << Fp8<C>::shift;
    return c10::bit_cast<float>(bits & Fp8<C>::mask);
  } else {
    return static_cast<float>(x);
  }
}

// VEC raw fp8 values: sign-extended bytes (the sign fills the bits the mask clears), shifted into place.
template <typename C>
inline Vec load_raw(const C* p) {
  constexpr auto mask = static_cast<int32_t>(Fp8<C>::mask);
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(b, Fp8<C>::shift), _mm512_set1_epi32(mask)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, Fp8<C>::shift), _mm256_set1_epi32(mask)));
#else
  float raw[VEC];
  for (int64_t i = 0; i < VEC; ++i) raw[i] = raw_value(p[i]);
  return Vec::loadu(raw);
#endif
}

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

inline float hsum(const Vec& x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}

struct Metadata {
  const int32_t* cu;
  const int32_t* lens;
  const int32_t* table;
  int64_t table_stride, width, num_requests;  // table_stride: elements between rows
};

// Views of contiguous metadata tensors.
Metadata metadata_of(const at::Tensor& cu, const at::Tensor& lens, const at::Tensor& table) {
  return {cu.data_ptr<int32_t>(),
          lens.data_ptr<int32_t>(),
          table.data_ptr<int32_t>(),
          table.size(1),
          table.size(1),
          lens.size(0)};
}

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
  int64_t packed, packed_from;       // its packed tile of keys [packed_from, + GEMM_BLOCK_N), or -1: packs its own
};

// A tile of keys [j0, j0 + n) of a request's kv head, packed before the units; the i-th job's tile is the i-th of
// Problem::packed.
struct PackJob {
  int64_t request, head, j0, n;
};

// One kv head's rows of a request's slices: slice s's rows start at partial + s * split_stride.
struct Merge {
  int64_t request, head, num_tokens, num_splits, partial, split_stride;
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
  float scale, logit_cap;
  int64_t window, chunk;

  // One kv head's row `in_page` of the request's `page`-th page, in a cache of `dim` values per head.
  const C* row(const C* cache, int64_t dim, int64_t request, int64_t page, int64_t in_page, int64_t head) const {
    const int64_t id = md.table[request * md.table_stride + page];
    return cache + ((id * page_size + in_page) * num_kv_heads + head) * dim;
  }
  int64_t tile_elems() const { return GEMM_BLOCK_N * (padded_dim + v_padded_dim); }
};

// The first key that a query at position pos sees: from its window's start and its chunk's (attention_chunk).
inline int64_t first_key(int64_t pos, int64_t window, int64_t chunk) {
  const int64_t from = window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0;
  return chunk > 0 ? std::max(from, pos - pos % chunk) : from;
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Whether many rows of q in T over a C cache may multiply in T on AMX: 16-bit caches in q's dtype, not fp8.
template <typename T, typename C>
constexpr bool amx_type = std::is_same_v<T, C> && !std::is_same_v<T, float>;

// Whether they do: oneDNN's brgemm on VNNI-packed tiles. cpublas reports packing available exactly when its brgemm
// takes the dtype on AMX (bf16: AMX-BF16; fp16: AMX-FP16).
template <typename T, typename C>
bool amx_available() {
  if constexpr (amx_type<T, C>) {
    return at::native::cpublas::could_pack(c10::CppTypeToScalarType<T>::value);
  } else {
    return false;
  }
}

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
  std::vector<int64_t> key_begin, key_end;  // the request's keys [key_begin[r], key_end[r]) that row r sees
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
        key_begin(rows),
        key_end(rows),
        packed_k(BLOCK_N * padded_dim, 0.f),
        packed_v(BLOCK_N * v_padded_dim, 0.f) {
    if (gemm_rows < GEMM_ROWS) return;
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

// scores[r, j] = q[r] . k_j for RB rows (few rows: decode, verify), KB keys j + c * ks at a time: one load of each K
// chunk serves the RB rows, and RB x KB independent accumulators keep the FMA units busy. Key j's row is at k[j] +
// offset (offset: a kv head's place in the rows of every head). Always inlined, as accumulate_pv: called from a
// unit's loop beside the brgemm path, they are not otherwise (decode 4% slower).
template <int RB, int KB, typename R>
[[gnu::always_inline]] inline void scores_dot_keys(const float* q, int64_t dim, const R* const* k, int64_t j,
                                                   int64_t ks, int64_t offset, float* scores) {
  Vec acc[RB][KB];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KB; ++c) acc[r][c] = Vec(0.f);
  for (int64_t d = 0; d < dim; d += VEC) {
    Vec kv[KB];
    for (int c = 0; c < KB; ++c) kv[c] = load_row(k[j + c * ks] + offset + d);
    for (int r = 0; r < RB; ++r) {
      const Vec qv = Vec::loadu(q + r * dim + d);
      for (int c = 0; c < KB; ++c) acc[r][c] = at::vec::fmadd(qv, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KB; ++c) scores[r * BLOCK_N + j + c * ks] = hsum(acc[r][c]);
}

// Keys a, a + ks, ... below b, KEY_BLOCK at a time: with 4 rows, the accumulators, key chunks and query chunk then fit
// the vector registers (16 with AVX2, 32 with AVX512) instead of spilling to the stack.
constexpr int KEY_BLOCK = VEC >= 16 ? 4 : 2;
template <int RB, typename R>
void scores_dot(const float* q, int64_t dim, const R* const* k, int64_t a, int64_t b, int64_t ks, int64_t offset,
                float* scores) {
  int64_t j = a;
  for (; j + (KEY_BLOCK - 1) * ks < b; j += KEY_BLOCK * ks) {
    scores_dot_keys<RB, KEY_BLOCK>(q, dim, k, j, ks, offset, scores);
  }
  for (; j < b; j += ks) scores_dot_keys<RB, 1>(q, dim, k, j, ks, offset, scores);
}

// acc[r] += sum_j p[r, j] v_j for RB rows and DB vectors of the head dim, j = a, a + ks, ... below b, v_j at v[j] +
// offset: one load of each V chunk serves the RB rows.
template <int RB, int DB, typename R>
[[gnu::always_inline]] inline void accumulate_pv(const float* p, const R* const* v, int64_t a, int64_t b, int64_t ks,
                                                 int64_t offset, int64_t d0, int64_t dim, float* acc) {
  Vec sum[RB][DB];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < DB; ++c) sum[r][c] = Vec::loadu(acc + r * dim + d0 + c * VEC);
  for (int64_t j = a; j < b; j += ks) {
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

// Keys [a, b) of a tile starting at key j0 with n keys that scratch row r of the unit sees (a >= b: none).
template <typename T, typename C>
std::pair<int64_t, int64_t> visible(const Scratch<T, C>& s, int64_t r, int64_t j0, int64_t n) {
  return {std::clamp<int64_t>(s.key_begin[r] - j0, 0, n), std::clamp<int64_t>(s.key_end[r] - j0, 0, n)};
}

// Online softmax of rows [r0, r1) over a tile of n keys starting at key j0, whose scores s.scores hold (row r at
// r * ld) times score_scale: p times p_scale replaces the scores of each row's visible keys (0 elsewhere in [0, n)),
// and m, l (the sums of p) and acc are updated. Returns the visible span [a_min, b_max) over the rows (empty: nothing
// to accumulate).
template <typename T, typename C>
std::pair<int64_t, int64_t> softmax_tile(const Problem<T, C>& pb, int64_t j0, int64_t n, int64_t ld, float score_scale,
                                         float p_scale, int64_t r0, int64_t r1, Scratch<T, C>& s) {
  const int64_t dim = pb.v_padded_dim;  // the accumulators'
  // Without a soft-cap, a positive scale folds into the exponent: exp(scale * x - m), m the scaled maximum.
  const bool fold = pb.logit_cap == 0 && score_scale > 0;
  const float k = fold ? score_scale : 1.f;
  int64_t a_min = n, b_max = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const auto [a, b] = visible(s, r, j0, n);
    float* sc = s.scores.data() + r * ld;
    s.tile_max[r] = NEG_INF;
    if (a >= b) continue;
    a_min = std::min(a_min, a);
    b_max = std::max(b_max, b);
    if (!fold && score_scale != 1.f) {
      for (int64_t j = a; j < b; ++j) sc[j] *= score_scale;
    }
    if (pb.logit_cap > 0) {
      for (int64_t j = a; j < b; ++j) sc[j] = pb.logit_cap * std::tanh(sc[j] / pb.logit_cap);
    }
    // Whole vectors, then the tail as a partial one (lanes past b: -inf).
    Vec mv(NEG_INF);
    int64_t j = a;
    for (; j + VEC <= b; j += VEC) mv = at::vec::clamp_min(mv, Vec::loadu(sc + j));
    if (j < b) mv = at::vec::clamp_min(mv, Vec::set(Vec(NEG_INF), Vec::loadu(sc + j, b - j), b - j));
    s.tile_max[r] = k * at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, mv);
  }
  // New maxima and the factors of the old sums, VEC rows at a time; rows that see no key keep theirs (factor 1).
  for (int64_t r = r0; r < r1; r += VEC) {
    const int64_t c = std::min(VEC, r1 - r);
    const Vec m_old = Vec::loadu(s.m.data() + r, c), mx = Vec::loadu(s.tile_max.data() + r, c);
    const Vec m_new = at::vec::maximum(m_old, mx);
    const Vec alpha = Vec::blendv((m_old - m_new).exp(), Vec(1.f), mx == Vec(NEG_INF));  // exp(-inf) = 0: first keys
    Vec::blendv(m_new, m_old, mx == Vec(NEG_INF)).store(s.m.data() + r, c);
    alpha.store(s.alpha.data() + r, c);
  }
  for (int64_t r = r0; r < r1; ++r) {
    const auto [a, b] = visible(s, r, j0, n);
    float* sc = s.scores.data() + r * ld;
    std::fill(sc, sc + a, 0.f);
    std::fill(sc + std::max(a, b), sc + n, 0.f);
    if (a >= b) continue;
    const Vec scale(k), m_new(-s.m[r]), p_factor(p_scale);
    Vec sum_v(0.f);
    int64_t j = a;
    for (; j + VEC <= b; j += VEC) {
      const Vec e = at::vec::fmadd(Vec::loadu(sc + j), scale, m_new).exp_u20();
      sum_v = sum_v + e;
      (e * p_factor).store(sc + j);
    }
    if (j < b) {
      const Vec e = Vec::set(Vec(0.f), at::vec::fmadd(Vec::loadu(sc + j, b - j), scale, m_new).exp_u20(), b - j);
      sum_v = sum_v + e;
      (e * p_factor).store(sc + j, b - j);
    }
    const float alpha = s.alpha[r];
    s.l[r] = s.l[r] * alpha + hsum(sum_v);
    if (alpha != 1.f) {
      float* acc = s.acc.data() + r * dim;
      for (int64_t d = 0; d < dim; d += VEC) (Vec::loadu(acc + d) * Vec(alpha)).store(acc + d);
    }
  }
  return {a_min, b_max};
}

template <typename T>
void prefetch_rows(const T* const* rows, int64_t n, int64_t row_bytes) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(rows[j]) + b, 0, 2);
}

// One tile of n keys for few rows per kv head, rows given as pointers to `padded_dim` (K) and `v_padded_dim` (V)
// values (cache rows in place, or packed fp32 rows) of the unit's first kv head; head h's rows are h * head_dim and
// h * v_head_dim further. Scratch rows are head-major: [num_heads][rows].
//
// A unit of several heads reads each memory page (PAGE_BYTES) front to back, as the hardware prefetcher follows: it
// takes keys in groups of `pages` memory pages of per_page positions each, and each group in per_page passes of one
// key from each page (s, s + per_page, ...), every kv head in turn. So pass s reads position s of each page, head by
// head: within the page, in order.
template <typename T, typename C, typename R>
void attend_tile(const Problem<T, C>& pb, const Unit& u, int64_t j0, int64_t n, const R* const* k, const R* const* v,
                 int64_t rows, Scratch<T, C>& s) {
  const int64_t dim = pb.padded_dim, heads = u.num_heads;
  const int64_t position_bytes = heads * pb.head_dim * static_cast<int64_t>(sizeof(R));
  // Positions per memory page, when passes are worth taking: a page of BLOCK_N or more positions (16-bit rows of
  // D 8, read in place where a vector is 8 floats) holds the whole tile, which key order reads front to back.
  const int64_t fit = PAGE_BYTES / position_bytes;
  const int64_t per_page = heads > 1 && fit > 1 && fit < BLOCK_N ? fit : 1;
  const int64_t pages = std::min(PAGES_PER_PASS, BLOCK_N / per_page);
  const int64_t group = heads > 1 ? pages * per_page : BLOCK_N;
  const float* q = s.q.data();
  // Calls fn(a, b, ks) for the passes over keys [j, jb): whole groups in per_page passes, a partial one in order.
  const auto passes = [&](int64_t j, int64_t jb, auto&& fn) {
    if (jb - j < group) return fn(j, jb, int64_t{1});
    for (int64_t p = 0; p < per_page; ++p) fn(j + p, jb, per_page);
  };
  for (int64_t j = 0; j < n; j += group) {
    passes(j, std::min(j + group, n), [&](int64_t a, int64_t b, int64_t ks) {
      for (int64_t h = 0; h < heads; ++h) {
        for_row_blocks(rows, [&](auto rb, int64_t r) {
          scores_dot<decltype(rb)::value>(q + (h * rows + r) * dim, dim, k, a, b, ks, h * pb.head_dim,
                                          s.scores.data() + (h * rows + r) * BLOCK_N);
        });
      }
    });
  }
  // The query rows hold the scale (and the kv head's k_scale): the scores and probabilities take the rest of raw_unit.
  const auto [a_min, b_max] =
      softmax_tile(pb, j0, n, BLOCK_N, raw_unit<C>() / lifted<C>(), lifted<C>(), 0, heads * rows, s);
  for (int64_t j = a_min; j < b_max; j += group) {
    passes(j, std::min(j + group, b_max), [&](int64_t a, int64_t b, int64_t ks) {
      for (int64_t h = 0; h < heads; ++h) {
        for_row_blocks(rows, [&](auto rb, int64_t r) {
          constexpr int RB = decltype(rb)::value;
          const int64_t v_dim = pb.v_padded_dim, offset = h * pb.v_head_dim;
          const float* p = s.scores.data() + (h * rows + r) * BLOCK_N;
          float* acc = s.acc.data() + (h * rows + r) * v_dim;
          int64_t d = 0;
          for (; d + 2 * VEC <= v_dim; d += 2 * VEC) accumulate_pv<RB, 2>(p, v, a, b, ks, offset, d, v_dim, acc);
          if (d < v_dim) accumulate_pv<RB, 1>(p, v, a, b, ks, offset, d, v_dim, acc);
        });
      }
    });
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// AMX-BF16 comes with AVX512-BF16 (oneDNN's AMX level includes it): one instruction rounds 32 values (to nearest
// even, as at::vec does).
__attribute__((target("avx512bf16"))) void round_bf16(const float* src, at::BFloat16* dst, int64_t count) {
  for (int64_t i = 0; i < count; i += 32) {
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(dst + i, (__m512i)h);
  }
}
#endif

// Probabilities in the products' 16-bit type; count a multiple of 32.
template <typename G>
void round_probs(const float* src, G* dst, int64_t count) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<G, at::BFloat16>) return round_bf16(src, dst, count);
#endif
  at::vec::convert(src, dst, count);
}

// n values of a row in D; fp8 into fp32, exactly (raw values times a power of two).
template <typename S, typename D>
void copy_row(const S* src, D* dst, int64_t n) {
  if constexpr (std::is_same_v<S, D>) {
    std::memcpy(dst, src, n * sizeof(S));
  } else if constexpr (is_fp8<S>) {
    static_assert(std::is_same_v<D, float>);
    const Vec unit(raw_unit<S>());
    int64_t i = 0;
    for (; i + VEC <= n; i += VEC) (load_raw(src + i) * unit).store(dst + i);
    for (; i < n; ++i) dst[i] = raw_value(src[i]) * raw_unit<S>();
  } else {
    at::vec::convert(src, dst, n);
  }
}

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
      k_rows[j] = pb.row(pb.k_cache, pb.head_dim, request, page, in_page, head);
      v_rows[j] = pb.row(pb.v_cache, pb.v_head_dim, request, page, in_page, head);
    } else {
      k_rows[j] = k_rows[j - 1] + pb.num_kv_heads * pb.head_dim;
      v_rows[j] = v_rows[j - 1] + pb.num_kv_heads * pb.v_head_dim;
    }
  }
}

// K^T and V of keys j0 .. j0 + n - 1 (n <= GEMM_BLOCK_N) of a request's kv head in G (fp8: its stored values,
// unscaled), as the products take them (see GemmTiles): kt [D / per_word, GEMM_BLOCK_N, per_word], v [GEMM_BLOCK_N /
// per_word, Dv, per_word], zero past n keys (up to the products' padded key count). K^T is zero past the head dim
// (g.k_rows stages the K rows for the transpose, zero there); V is not written there, as those columns of the
// accumulators are never read.
template <typename G, typename T, typename C>
void pack_tile(const Problem<T, C>& pb, int64_t request, int64_t head, int64_t j0, int64_t n, GemmTiles<G>& g, G* kt,
               G* vt) {
  constexpr bool vnni = !std::is_same_v<G, float>;
  const C* k[GEMM_BLOCK_N];
  const C* v[GEMM_BLOCK_N];
  tile_rows(pb, request, head, j0, n, k, v);
  const int64_t dim = pb.padded_dim, v_dim = pb.v_padded_dim;
  // K^T is the transpose of the staged rows (zero past the head dim); in VNNI pairs, of the rows read as 32-bit words.
  for (int64_t j = 0; j < n; ++j) copy_row(k[j], g.k_rows.data() + j * dim, pb.head_dim);
  constexpr int64_t per_word = vnni ? 2 : 1;
  at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(g.k_rows.data()), dim / per_word,
                                reinterpret_cast<float*>(kt), GEMM_BLOCK_N, n, dim / per_word);
  if constexpr (vnni) {
    auto* vp = reinterpret_cast<uint32_t*>(vt);
    for (int64_t j = 0; j < n; j += 2) {
      const auto* __restrict lo = reinterpret_cast<const uint16_t*>(v[j]);
      const auto* __restrict hi = reinterpret_cast<const uint16_t*>(j + 1 < n ? v[j + 1] : v[j]);
      const uint32_t hi_mask = j + 1 < n ? 0xffff0000u : 0u;  // an odd tile's last pair: 0 as its second key
      uint32_t* __restrict dst = vp + (j / 2) * v_dim;
      for (int64_t d = 0; d < pb.v_head_dim; ++d) dst[d] = lo[d] | (static_cast<uint32_t>(hi[d]) << 16 & hi_mask);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) copy_row(v[j], vt + j * v_dim, pb.v_head_dim);
  }
  const int64_t n_padded = round_up(n, GEMM_N);  // the products read keys up to here
  if (n < n_padded) {                            // zero the keys past n (the last tile of a request or unit)
    auto* kt_words = reinterpret_cast<float*>(kt);
    for (int64_t i = 0; i < dim / per_word; ++i) {
      std::fill(kt_words + i * GEMM_BLOCK_N + n, kt_words + i * GEMM_BLOCK_N + n_padded, 0.f);
    }
    std::fill(vt + round_up(n, per_word) * v_dim, vt + n_padded * v_dim, G(0.f));
  }
}

// One tile of n <= GEMM_BLOCK_N keys starting at key j0 for many rows, by brgemm in G over the packed kt and vt
// (pack_tile): S = Q K^T, online softmax in fp32, acc += P V. The scale (and the kv head's k_scale) is applied to the
// fp32 scores; in 16-bit (AMX), P is rounded to the cache dtype for its product, as flash attention does.
template <typename G, typename T, typename C>
void attend_tile_brgemm(const Problem<T, C>& pb, const Unit& u, int64_t j0, int64_t n, const G* kt, const G* vt,
                        int64_t rows, Scratch<T, C>& s) {
  constexpr bool vnni = !std::is_same_v<G, float>;
  GemmTiles<G>& g = s.template tiles<G>();
  const int64_t dim = pb.padded_dim;
  // Rows in chunks whose scores and accumulators stay in cache between the two products. A chunk takes the keys its
  // last row sees (rounded up to GEMM_N: on the causal diagonal, fewer), and none when it sees none of the tile (the
  // diagonal, a window's start).
  for (int64_t r0 = 0; r0 < rows; r0 += GEMM_CHUNK) {
    const int64_t r1 = std::min(rows, r0 + GEMM_CHUNK), m = round_up(r1 - r0, GEMM_M);
    const int64_t seen = visible(s, r1 - 1, j0, n).second, cols = round_up(seen, GEMM_N);
    if (seen == 0 || visible(s, r0, j0, n).first == n) continue;
    float* scores = s.scores.data() + r0 * GEMM_BLOCK_N;
    at::native::cpublas::brgemm(m, cols, dim, dim, GEMM_BLOCK_N, GEMM_BLOCK_N, false, g.q.data() + r0 * dim, kt, scores,
                                vnni);
    // Columns past n hold scores against K's zero columns (0), which meet V's zero rows; columns past the last
    // visible key get probability 0.
    softmax_tile(pb, j0, std::min(n, cols), GEMM_BLOCK_N, pb.scale * pb.k_scale[u.head], 1.f, r0, r1, s);
    const G* p;
    if constexpr (vnni) {
      p = g.p.data() + r0 * GEMM_BLOCK_N;
      for (int64_t r = r0; r < r1; ++r) {
        round_probs(s.scores.data() + r * GEMM_BLOCK_N, g.p.data() + r * GEMM_BLOCK_N, cols);
      }
    } else {
      p = scores;
    }
    const int64_t v_dim = pb.v_padded_dim;
    at::native::cpublas::brgemm(m, v_dim, cols, GEMM_BLOCK_N, v_dim, v_dim, true, p, vt, s.acc.data() + r0 * v_dim,
                                vnni);
  }
}

// A unit's tiles for few rows (attend_tile): K/V rows in place when the head dim is whole vectors (always for a unit
// of several heads, see forward_typed), else copied (fp32 raw values, zero-padded) into the scratch tile.
template <typename T, typename C>
void attend_dot(const Problem<T, C>& pb, const Unit& u, int64_t rows, Scratch<T, C>& s) {
  const int64_t dim = pb.padded_dim, v_dim = pb.v_padded_dim;
  const C* k_tiles[2][BLOCK_N];
  const C* v_tiles[2][BLOCK_N];
  const float* k_packed[BLOCK_N];
  const float* v_packed[BLOCK_N];
  tile_rows(pb, u.request, u.head, u.lo, std::min(BLOCK_N, u.hi - u.lo), k_tiles[0], v_tiles[0]);
  for (int64_t j0 = u.lo, t = 0; j0 < u.hi; j0 += BLOCK_N, t ^= 1) {
    const int64_t n = std::min(BLOCK_N, u.hi - j0), next = j0 + BLOCK_N;
    const C** k_rows = k_tiles[t];
    const C** v_rows = v_tiles[t];
    // A unit of one kv head prefetches the whole next tile (see PAGE_BYTES).
    if (next < u.hi) {
      const int64_t n_next = std::min(BLOCK_N, u.hi - next);
      tile_rows(pb, u.request, u.head, next, n_next, k_tiles[t ^ 1], v_tiles[t ^ 1]);
      if (u.num_heads == 1) {
        prefetch_rows(k_tiles[t ^ 1], n_next, pb.head_dim * static_cast<int64_t>(sizeof(C)));
        prefetch_rows(v_tiles[t ^ 1], n_next, pb.v_head_dim * static_cast<int64_t>(sizeof(C)));
      }
    }
    if (pb.head_dim == dim && pb.v_head_dim == v_dim) {
      attend_tile(pb, u, j0, n, k_rows, v_rows, rows, s);
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
    attend_tile(pb, u, j0, n, k_packed, v_packed, rows, s);
  }
}

// A unit with brgemm in G, or (G = float) with the dot products.
template <typename G, typename T, typename C>
void run_unit_typed(const Problem<T, C>& pb, const Unit& u, Scratch<T, C>& s, bool brgemm) {
  const int64_t dim = pb.padded_dim, group = pb.group, rows = u.num_tokens * group, all_rows = u.num_heads * rows;
  const int64_t q_start = pb.md.cu[u.request] + u.t0;
  // Scratch row r (head-major): query token r % rows / group, kv head u.head + r / rows, query head
  // (u.head + r / rows) * group + r % group.
  const auto q_token = [&](int64_t r) { return q_start + r % rows / group; };
  const auto kv_head = [&](int64_t r) { return u.head + r / rows; };
  const auto q_head = [&](int64_t r) { return kv_head(r) * group + r % group; };
  for (int64_t r = 0; r < all_rows; ++r) {
    const T* src = pb.q + q_token(r) * pb.q_strides[0] + q_head(r) * pb.q_strides[1];
    if (brgemm) {  // unscaled (the scale applies to the scores); dims past head_dim stay 0
      G* dst = s.template tiles<G>().q.data() + r * dim;
      if (pb.q_strides[2] == 1) {
        copy_row(src, dst, pb.head_dim);
      } else {
        for (int64_t d = 0; d < pb.head_dim; ++d) dst[d] = static_cast<G>(src[d * pb.q_strides[2]]);
      }
      continue;
    }
    float* dst = s.q.data() + r * dim;
    const float q_scale = pb.scale * pb.k_scale[kv_head(r)] * lifted<C>();  // see attend_tile
    for (int64_t d = 0; d < pb.head_dim; ++d) dst[d] = static_cast<float>(src[d * pb.q_strides[2]]) * q_scale;
    std::fill(dst + pb.head_dim, dst + dim, 0.f);
  }
  if (brgemm) {  // rows up to the products' padded count: zero queries (and 16-bit probabilities) add nothing
    auto& g = s.template tiles<G>();
    const int64_t m = round_up(rows, GEMM_M);
    std::fill(g.q.begin() + rows * dim, g.q.begin() + m * dim, G(0.f));
    if (!g.p.empty()) std::fill(g.p.begin() + rows * GEMM_BLOCK_N, g.p.begin() + m * GEMM_BLOCK_N, G(0.f));
  }
  const int64_t v_dim = pb.v_padded_dim;
  std::fill(s.acc.begin(), s.acc.begin() + all_rows * v_dim, 0.f);
  std::fill(s.m.begin(), s.m.begin() + all_rows, NEG_INF);
  std::fill(s.l.begin(), s.l.begin() + all_rows, 0.f);
  // Row r sees the request's keys up to its query token's position, from its window's and chunk's start.
  const int64_t prefix = pb.md.lens[u.request] - (pb.md.cu[u.request + 1] - pb.md.cu[u.request]);
  for (int64_t r = 0; r < all_rows; ++r) {
    s.key_end[r] = prefix + u.t0 + r % rows / group + 1;
    s.key_begin[r] = first_key(s.key_end[r] - 1, pb.window, pb.chunk);
  }

  if (brgemm) {
    // Tiles packed before the units (a request of several query blocks: packed once, not once per block), aligned at
    // u.packed_from, the first reaching u.lo; else packed here, from u.lo.
    GemmTiles<G>& g = s.template tiles<G>();
    const int64_t len = pb.md.lens[u.request];
    const int64_t start = u.packed < 0 ? u.lo : u.packed_from + (u.lo - u.packed_from) / GEMM_BLOCK_N * GEMM_BLOCK_N;
    for (int64_t j0 = start; j0 < u.hi; j0 += GEMM_BLOCK_N) {
      if (u.packed >= 0) {
        const int64_t tile = u.packed + (j0 - u.packed_from) / GEMM_BLOCK_N;
        const G* kt = static_cast<const G*>(pb.packed) + tile * pb.tile_elems();
        attend_tile_brgemm<G>(pb, u, j0, std::min(GEMM_BLOCK_N, len - j0), kt, kt + GEMM_BLOCK_N * dim, rows, s);
        continue;
      }
      const int64_t n = std::min(GEMM_BLOCK_N, u.hi - j0);
      pack_tile(pb, u.request, u.head, j0, n, g, g.kt.data(), g.v.data());
      attend_tile_brgemm<G>(pb, u, j0, n, g.kt.data(), g.v.data(), rows, s);
    }
  } else {
    attend_dot(pb, u, rows, s);
  }
  if (!std::is_same_v<G, float>) at::native::cpublas::brgemm_release();  // AMX's tile state, freed per unit

  // The kv head's v_scale, and for raw fp8 rows the rest of raw_unit (see attend_tile); split partials hold the
  // output's own values, so the merge takes them as they are, and their sinks join there.
  const float raw = brgemm ? 1.f : raw_unit<C>() / lifted<C>();
  for (int64_t r = 0; r < all_rows; ++r) {
    const float* acc = s.acc.data() + r * v_dim;
    const float v_factor = pb.v_scale[kv_head(r)] * raw;
    if (u.partial < 0) {
      // A sink adds exp(sink - m) to the sum of probabilities (a row that sees no key: output 0, sink or not).
      const float sink = pb.sinks ? std::exp(pb.sinks[q_head(r)] - s.m[r]) : 0.f;
      const float inv = (s.l[r] > 0 ? 1.f / (s.l[r] + sink) : 0.f) * v_factor;
      T* dst = pb.out + (q_token(r) * pb.num_kv_heads * group + q_head(r)) * pb.v_head_dim;
      for (int64_t d = 0; d < pb.v_head_dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
    } else {
      const float inv = (s.l[r] > 0 ? 1.f / s.l[r] : 0.f) * v_factor;
      float* dst = pb.partial_out + (u.partial + r) * pb.v_head_dim;
      for (int64_t d = 0; d < pb.v_head_dim; ++d) dst[d] = acc[d] * inv;
      pb.partial_lse[u.partial + r] = s.l[r] > 0 ? s.m[r] + std::log(s.l[r]) : NEG_INF;
    }
  }
}

// Few rows: K/V rows in place when the head dim is whole vectors, else copied (fp32, zero-padded) into the scratch
// tile. Many rows: brgemm over tiles packed in fp32, or in the cache's 16-bit type on AMX.
template <typename T, typename C>
void run_unit(const Problem<T, C>& pb, const Unit& u, Scratch<T, C>& s) {
  if (u.num_tokens * pb.group < GEMM_ROWS) return run_unit_typed<float>(pb, u, s, false);
  if constexpr (amx_type<T, C>) {
    if (s.amx) return run_unit_typed<T>(pb, u, s, true);
  }
  run_unit_typed<float>(pb, u, s, true);
}

// A PackJob, in the type G the products take.
template <typename G, typename T, typename C>
void run_pack_typed(const Problem<T, C>& pb, const PackJob& job, int64_t index, Scratch<T, C>& s) {
  G* kt = static_cast<G*>(pb.packed) + index * pb.tile_elems();
  pack_tile(pb, job.request, job.head, job.j0, job.n, s.template tiles<G>(), kt, kt + GEMM_BLOCK_N * pb.padded_dim);
}

template <typename T, typename C>
void run_pack(const Problem<T, C>& pb, const PackJob& job, int64_t index, Scratch<T, C>& s) {
  if constexpr (amx_type<T, C>) {
    if (s.amx) return run_pack_typed<T>(pb, job, index, s);
  }
  run_pack_typed<float>(pb, job, index, s);
}

// Combines a request's key slices: out = sum_s exp(lse_s - max) out_s / sum_s exp(lse_s - max), a sink (a slice of
// lse `sink` and output 0) joining the sums.
template <typename T, typename C>
void run_merge(const Problem<T, C>& pb, const Merge& mg) {
  const int64_t rows = mg.num_tokens * pb.group, q_start = pb.md.cu[mg.request], dim = pb.v_head_dim;
  std::vector<float> acc(dim);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t q_head = mg.head * pb.group + r % pb.group;
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
      for (int64_t d = 0; d < dim; ++d) acc[d] += w * pb.partial_out[row * dim + d];
    }
    if (pb.sinks && total > 0) total += std::exp(pb.sinks[q_head] - mx);  // as in run_unit_typed
    const float inv = total > 0 ? 1.f / total : 0.f;
    T* dst = pb.out + ((q_start + r / pb.group) * pb.num_kv_heads * pb.group + q_head) * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
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

// x as an fp8 cache of C holds it, as hybrid_ops.fp8.quantize stores it: divided by its kv head's scale in fp32,
// saturated (NaN stays NaN), then rounded to nearest even by c10's conversion.
template <typename C>
inline C quantize(float x, float kv_scale) {
  return C(std::clamp(x / kv_scale, -Fp8<C>::max, Fp8<C>::max));
}

// quantize of n values, VEC at a time, bit for bit: c10's conversion (Float8_e4m3fn.h, Float8_e5m2.h) on vectors.
// Normal values round to nearest even by a bias added to the fp32 bits before the shift; subnormal ones by an fp32
// addition of the power of two whose ulp is the format's smallest subnormal.
template <typename C>
void quantize_row(const float* x, float kv_scale, C* dst, int64_t n) {
  using F = Fp8<C>;
  using IVec = at::vec::Vectorized<int32_t>;
  constexpr int32_t min_normal = (127 - F::bias + 1) << 23, denorm = (127 - F::bias + F::shift + 1) << 23;
  const Vec scale(kv_scale), limit(F::max), denorm_value(c10::bit_cast<float>(denorm));
  const IVec rounding((F::bias - 127) * (1 << 23) + (1 << (F::shift - 1)) - 1);
  const IVec sign_bit(std::numeric_limits<int32_t>::min()), shift(F::shift), one(1), inf(0x7F800000), nan(0x7F);
  int64_t i = 0;
  for (; i + VEC <= n; i += VEC) {
    const IVec bits = at::vec::cast<int32_t>(at::vec::clamp(Vec::loadu(x + i) / scale, -limit, limit));
    const IVec sign = bits & sign_bit, magnitude = bits ^ sign;
    const IVec subnormal = at::vec::cast<int32_t>(at::vec::cast<float>(magnitude) + denorm_value) - IVec(denorm);
    const IVec normal = (magnitude + rounding + ((magnitude >> shift) & one)) >> shift;
    const IVec code = IVec::blendv(IVec::blendv(normal, subnormal, magnitude < IVec(min_normal)), nan, magnitude > inf);
    int32_t codes[VEC];
    (code | (sign >> IVec(24))).store(codes);  // the sign bit copied down to bit 7 and above: the byte's sign
    for (int64_t j = 0; j < VEC; ++j) dst[i + j].x = static_cast<uint8_t>(codes[j]);
  }
  for (; i < n; ++i) dst[i] = quantize<C>(x[i], kv_scale);
}

// src [T, Hkv, D] (q's dtype) into the cache's rows of the new tokens (fp8: quantized with kv_scale [Hkv]).
template <typename T, typename C>
void store_kv(const at::Tensor& src, at::Tensor& cache, const Metadata& md, const std::vector<int64_t>& request_of,
              int64_t page_size, const float* kv_scale) {
  const int64_t num_tokens = src.size(0), heads = src.size(1), dim = src.size(2);
  const int64_t st = src.stride(0), sh = src.stride(1), sd = src.stride(2);
  const T* s = src.data_ptr<T>();
  C* c = cache.data_ptr<C>();
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(is_fp8<C> ? dim : 0);  // a row in fp32, for quantize_row
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = request_of[t];
      const int64_t pos = md.lens[i] - (md.cu[i + 1] - md.cu[i]) + t - md.cu[i];
      const int64_t page = md.table[i * md.table_stride + pos / page_size];
      C* dst = c + (page * page_size + pos % page_size) * heads * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x = s + t * st + h * sh;
        if constexpr (is_fp8<C>) {
          for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(x[d * sd]);
          quantize_row(row.data(), kv_scale[h], dst + h * dim, dim);
        } else {
          for (int64_t d = 0; d < dim; ++d) dst[h * dim + d] = x[d * sd];
        }
      }
    }
  });
}

// A scale argument as [Hkv] values: [], [1] or [Hkv] float32 (any stride), or none (1).
std::vector<float> per_head(const std::optional<at::Tensor>& kv_scale, int64_t num_kv_heads) {
  std::vector<float> out(num_kv_heads, 1.f);
  if (!kv_scale) return out;
  const float* p = kv_scale->data_ptr<float>();
  const int64_t stride = kv_scale->numel() == 1 ? 0 : kv_scale->stride(0);
  for (int64_t h = 0; h < num_kv_heads; ++h) out[h] = p[h * stride];
  return out;
}

// Scales and the cache's dtype (C) as in paged_attention.
template <typename T, typename C>
at::Tensor forward_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                         at::Tensor& v_cache, const Metadata& md, double scale, int64_t window, double logit_cap,
                         const std::optional<at::Tensor>& sinks, int64_t chunk,
                         const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const int64_t num_tokens = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2), v_head_dim = v.size(2);
  const int64_t page_size = k_cache.size(1), num_kv_heads = k_cache.size(2), group = num_q_heads / num_kv_heads;
  auto out = at::empty({num_tokens, num_q_heads, v_head_dim}, q.options());
  if (num_tokens == 0) return out;

  // Units, merges and packed tiles, from the metadata alone (the same for a request in any batch).
  const int64_t block_tokens = std::max<int64_t>(1, BLOCK_ROWS / group);
  std::vector<Unit> units;
  std::vector<Merge> merges;
  std::vector<PackJob> pack_jobs;
  std::vector<int64_t> request_of(num_tokens);
  int64_t partial_rows = 0, max_rows = 0, max_gemm_rows = 0;
  for (int64_t i = 0; i < md.num_requests; ++i) {
    const int64_t q_len = md.cu[i + 1] - md.cu[i], len = md.lens[i], prefix = len - q_len;
    std::fill(request_of.begin() + md.cu[i], request_of.begin() + md.cu[i + 1], i);
    // A block of queries from token t0 sees keys from its first token's first on.
    const auto block_first_key = [&](int64_t t0) { return first_key(prefix + t0, window, chunk); };
    // Several query blocks (the first through brgemm) share their keys: each kv head's tiles are packed once, from
    // the tile of the first block's first key.
    const int64_t packed_from = block_first_key(0) / GEMM_BLOCK_N * GEMM_BLOCK_N;
    const int64_t num_tiles = (len - packed_from + GEMM_BLOCK_N - 1) / GEMM_BLOCK_N;
    const int64_t packed = q_len > block_tokens ? static_cast<int64_t>(pack_jobs.size()) : -1;
    for (int64_t h = 0; packed >= 0 && h < num_kv_heads; ++h) {
      for (int64_t t = 0; t < num_tiles; ++t) {
        const int64_t j0 = packed_from + t * GEMM_BLOCK_N;
        pack_jobs.push_back({i, h, j0, std::min(GEMM_BLOCK_N, len - j0)});
      }
    }
    for (int64_t t0 = 0; t0 < q_len; t0 += block_tokens) {
      const int64_t nt = std::min(block_tokens, q_len - t0), lo = block_first_key(t0), hi = prefix + t0 + nt;
      // Few rows per kv head, whole-vector rows: a unit takes every kv head, so that it reads each position's
      // Hkv * D elements together (one stream per page); else a unit per kv head.
      const int64_t rows = nt * group;
      const int64_t heads = rows < GEMM_ROWS && head_dim % VEC == 0 && v_head_dim % VEC == 0 ? num_kv_heads : 1;
      const int64_t split = heads > 1 ? KV_SPLIT_ALL_HEADS : KV_SPLIT;
      const int64_t splits = q_len <= block_tokens ? (hi - lo + split - 1) / split : 1;
      max_rows = std::max(max_rows, heads * rows);
      if (rows >= GEMM_ROWS) max_gemm_rows = std::max(max_gemm_rows, rows);
      for (int64_t h = 0; h < num_kv_heads; h += heads) {
        if (splits <= 1) {
          const int64_t tiles = packed >= 0 && rows >= GEMM_ROWS ? packed + h * num_tiles : -1;
          units.push_back({i, h, heads, t0, nt, lo, hi, -1, tiles, packed_from});
          continue;
        }
        for (int64_t g = 0; g < heads; ++g) {
          merges.push_back({i, h + g, nt, splits, partial_rows + g * rows, heads * rows});
        }
        for (int64_t sp = 0; sp < splits; ++sp) {
          units.push_back(
              {i, h, heads, t0, nt, lo + sp * split, std::min(hi, lo + (sp + 1) * split), partial_rows, -1, 0});
          partial_rows += heads * rows;
        }
      }
    }
  }

  const std::vector<float> k_scales = per_head(k_scale, num_kv_heads), v_scales = per_head(v_scale, num_kv_heads);
  store_kv<T, C>(k, k_cache, md, request_of, page_size, k_scales.data());
  store_kv<T, C>(v, v_cache, md, request_of, page_size, v_scales.data());

  std::vector<float> sink_logits;
  if (sinks) {
    const auto values = sinks->contiguous();
    sink_logits.assign(values.data_ptr<float>(), values.data_ptr<float>() + num_q_heads);
  }
  const int64_t padded_dim = round_up(head_dim, VEC), v_padded_dim = round_up(v_head_dim, VEC);
  auto partial_out = at::empty({partial_rows, v_head_dim}, q.options().dtype(at::kFloat));
  auto partial_lse = at::empty({partial_rows}, q.options().dtype(at::kFloat));
  auto packed = at::empty({static_cast<int64_t>(pack_jobs.size()) * GEMM_BLOCK_N * (padded_dim + v_padded_dim)},
                          q.options().dtype(amx_available<T, C>() ? q.scalar_type() : at::kFloat));
  Problem<T, C> pb{q.data_ptr<T>(),
                   k_cache.data_ptr<C>(),
                   v_cache.data_ptr<C>(),
                   out.data_ptr<T>(),
                   partial_out.data_ptr<float>(),
                   partial_lse.data_ptr<float>(),
                   k_scales.data(),
                   v_scales.data(),
                   sinks ? sink_logits.data() : nullptr,
                   packed.data_ptr(),
                   md,
                   {q.stride(0), q.stride(1), q.stride(2)},
                   page_size,
                   num_kv_heads,
                   group,
                   head_dim,
                   padded_dim,
                   v_head_dim,
                   v_padded_dim,
                   static_cast<float>(scale),
                   static_cast<float>(logit_cap),
                   window,
                   chunk};
  std::vector<std::unique_ptr<Scratch<T, C>>> scratch(at::get_num_threads());
  const auto thread_scratch = [&]() -> Scratch<T, C>& {
    auto& s = scratch[at::get_thread_num()];
    if (!s) s = std::make_unique<Scratch<T, C>>(max_rows, max_gemm_rows, padded_dim, v_padded_dim);
    return *s;
  };
  parallel_dynamic(static_cast<int64_t>(pack_jobs.size()),
                   [&](int64_t i) { run_pack(pb, pack_jobs[i], i, thread_scratch()); });
  parallel_dynamic(static_cast<int64_t>(units.size()), [&](int64_t i) { run_unit(pb, units[i], thread_scratch()); });
  // parallel_for returns when every unit is done: the merges read finished slices.
  parallel_dynamic(static_cast<int64_t>(merges.size()), [&](int64_t i) { run_merge(pb, merges[i]); });
  return out;
}

template <typename X>
struct Of {
  using type = X;
};

}  // namespace

namespace hybrid_ops {

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                           const at::Tensor& block_table, double scale, int64_t window, double logit_cap,
                           const std::optional<at::Tensor>& sinks, int64_t attention_chunk, bool decode,
                           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const auto cu = cu_seqlens_q.contiguous(), lens = seq_lens.contiguous(), table = block_table.contiguous();
  const Metadata md = metadata_of(cu, lens, table);
  if (!metadata_ok(md, q.size(0), k_cache.size(0), k_cache.size(1), decode)) return at::Tensor();
  // q's element type, then the caches': q's or fp8.
  const auto with_cache = [&](auto q_type) -> at::Tensor {
    using T = typename decltype(q_type)::type;
    const auto run = [&](auto cache_type) {
      return forward_typed<T, typename decltype(cache_type)::type>(q, k, v, k_cache, v_cache, md, scale, window,
                                                                   logit_cap, sinks, attention_chunk, k_scale, v_scale);
    };
    switch (k_cache.scalar_type()) {
      case at::kFloat8_e4m3fn:
        return run(Of<at::Float8_e4m3fn>());
      case at::kFloat8_e5m2:
        return run(Of<at::Float8_e5m2>());
      default:
        TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "the caches must have q's dtype or be fp8");
        return run(Of<T>());
    }
  };
  switch (q.scalar_type()) {
    case at::kFloat:
      return with_cache(Of<float>());
    case at::kHalf:
      return with_cache(Of<at::Half>());
    case at::kBFloat16:
      return with_cache(Of<at::BFloat16>());
    default:
      TORCH_CHECK(false, "q must be float32, float16 or bfloat16");
  }
}

bool multiplies_in_cache_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf:
      return amx_available<at::Half, at::Half>();
    case at::kBFloat16:
      return amx_available<at::BFloat16, at::BFloat16>();
    default:
      return false;
  }
}

bool metadata_values_ok(const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& block_table,
                        int64_t num_tokens, int64_t num_pages, int64_t page_size, bool decode) {
  const auto cu = cu_seqlens_q.contiguous(), lens = seq_lens.contiguous(), table = block_table.contiguous();
  return metadata_ok(metadata_of(cu, lens, table), num_tokens, num_pages, page_size, decode);
}

}  // namespace hybrid_ops
