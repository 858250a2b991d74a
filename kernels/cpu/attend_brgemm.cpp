// Many query rows per kv head (prefill, long verify): ATen's brgemm (oneDNN) per kv head over tiles of GEMM_BLOCK_N
// keys packed in fp32, or in the cache's 16-bit type on AMX: by the unit, or once for all the query blocks of a
// request (the schedule's pack jobs). fp8 tiles are packed in fp32, their stored values; the kv head's k_scale
// applies to the scores and unit.cpp applies v_scale to the output.

#include <ATen/native/CPUBlas.h>

#include <cstring>

#include "kernel.h"

namespace hybrid_ops::cpu {

// cpublas reports packing available exactly when its brgemm takes the dtype on AMX (bf16: AMX-BF16; fp16: AMX-FP16):
// many rows then multiply in 16 bits, on VNNI-packed tiles.
template <typename T, typename C>
bool amx_available() {
  if constexpr (amx_type<T, C>) {
    return at::native::cpublas::could_pack(c10::CppTypeToScalarType<T>::value);
  } else {
    return false;
  }
}

namespace {

constexpr int64_t GEMM_N = 32;      // the products' key counts are multiples of this (a divisor of GEMM_BLOCK_N)
constexpr int64_t GEMM_CHUNK = 64;  // rows per pair of products (a multiple of GEMM_M)

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
    constexpr int W = row_vecs<S>;
    const Vec unit(raw_unit<S>());
    int64_t i = 0;
    for (; i + W * VEC <= n; i += W * VEC) {
      Vec raw[W];
      load_rows(src + i, raw);
      for (int v = 0; v < W; ++v) (raw[v] * unit).store(dst + i + v * VEC);
    }
    for (; i + VEC <= n; i += VEC) (load_raw(src + i) * unit).store(dst + i);
    for (; i < n; ++i) dst[i] = raw_value(src[i]) * raw_unit<S>();
  } else {
    at::vec::convert(src, dst, n);
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
  // diagonal, a window's start: its lowest first key, the first row's unless a tree puts a later row's lower).
  for (int64_t r0 = 0; r0 < rows; r0 += GEMM_CHUNK) {
    const int64_t r1 = std::min(rows, r0 + GEMM_CHUNK), m = round_up(r1 - r0, GEMM_M);
    const int64_t seen = visible(s, r1 - 1, j0, n).second, cols = round_up(seen, GEMM_N);
    const int64_t first = *std::min_element(s.key_begin.begin() + r0, s.key_begin.begin() + r1);
    if (seen == 0 || first >= j0 + n) continue;
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

// A unit in G: its query rows (unscaled: the scale applies to the scores; dims past head_dim stay 0), then its tiles.
template <typename G, typename T, typename C>
void attend_brgemm_typed(const Problem<T, C>& pb, const Unit& u, Scratch<T, C>& s) {
  const QueryRows q_rows = pb.rows_of(u);
  const int64_t dim = pb.padded_dim, rows = q_rows.per_head;
  GemmTiles<G>& g = s.template tiles<G>();
  for (int64_t r = 0; r < q_rows.count; ++r) {
    const T* src = pb.q_row(q_rows, r);
    G* dst = g.q.data() + r * dim;
    if (pb.q_strides[2] == 1) {
      copy_row(src, dst, pb.head_dim);
    } else {
      for (int64_t d = 0; d < pb.head_dim; ++d) dst[d] = static_cast<G>(src[d * pb.q_strides[2]]);
    }
  }
  // Rows up to the products' padded count: zero queries (and 16-bit probabilities) add nothing.
  const int64_t m = round_up(rows, GEMM_M);
  std::fill(g.q.begin() + rows * dim, g.q.begin() + m * dim, G(0.f));
  if (!g.p.empty()) std::fill(g.p.begin() + rows * GEMM_BLOCK_N, g.p.begin() + m * GEMM_BLOCK_N, G(0.f));

  // Tiles packed before the units (a request of several query blocks: packed once, not once per block), aligned at
  // u.packed_from, the first reaching u.lo; else packed here, from u.lo.
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
  if (!std::is_same_v<G, float>) at::native::cpublas::brgemm_release();  // AMX's tile state, freed per unit
}

template <typename G, typename T, typename C>
void pack_typed(const Problem<T, C>& pb, const PackJob& job, int64_t index, Scratch<T, C>& s) {
  G* kt = static_cast<G*>(pb.packed) + index * pb.tile_elems();
  pack_tile(pb, job.request, job.head, job.j0, job.n, s.template tiles<G>(), kt, kt + GEMM_BLOCK_N * pb.padded_dim);
}

}  // namespace

template <typename T, typename C>
void attend_brgemm(const Problem<T, C>& pb, const Unit& u, Scratch<T, C>& s) {
  if constexpr (amx_type<T, C>) {
    if (s.amx) return attend_brgemm_typed<T>(pb, u, s);
  }
  attend_brgemm_typed<float>(pb, u, s);
}

template <typename T, typename C>
void pack(const Problem<T, C>& pb, const PackJob& job, int64_t index, Scratch<T, C>& s) {
  if constexpr (amx_type<T, C>) {
    if (s.amx) return pack_typed<T>(pb, job, index, s);
  }
  pack_typed<float>(pb, job, index, s);
}

#define INSTANTIATE(T, C)                                                         \
  template bool amx_available<T, C>();                                            \
  template void attend_brgemm(const Problem<T, C>&, const Unit&, Scratch<T, C>&); \
  template void pack(const Problem<T, C>&, const PackJob&, int64_t, Scratch<T, C>&);
HYBRID_OPS_CPU_TYPES(INSTANTIATE)

}  // namespace hybrid_ops::cpu
