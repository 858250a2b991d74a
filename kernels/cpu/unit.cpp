// A unit keeps the query rows of its kv heads' groups (tokens x GQA group) and streams its keys in tiles: each K/V row
// is loaded once per tile and serves every query row of its group (online softmax, fp32 accumulation). Few rows per
// kv head take dot products over keys read in place (attend_inplace.cpp), many rows brgemm (attend_brgemm.cpp); both
// share the online softmax, the unit's setup and its output here. A split request's slices write partials (output
// and log-sum-exp per row), which run_merge combines.

#include <cmath>

#include "kernel.h"

namespace hybrid_ops::cpu {
namespace {

// Scores -inf (which the max ignores and exp turns into exactly 0) for the new keys among [a, b) of a tile from key
// j0 that tree row r hides: those its row does not name but its own, and those whose position (prefix + depth) lies
// before the row's first key. Only entries below the diagonal are read (b <= the row's own key + 1). A causal tree
// hides none.
template <typename T, typename C>
void hide_outside_tree(const Scratch<T, C>& s, int64_t r, int64_t j0, int64_t a, int64_t b, float* sc) {
  const bool* row = s.tree_row[r];
  for (int64_t j = std::max(a, s.prefix - j0); j < b; ++j) {
    const int64_t c = j0 + j - s.prefix;
    if (c != s.own[r] && (!row[c] || s.prefix + s.new_depth[c] < s.key_begin[r])) sc[j] = NEG_INF;
  }
}

}  // namespace

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
    if (pb.md.tree) hide_outside_tree(s, r, j0, a, b, sc);  // after the cap: cap * tanh(-inf / cap) is -cap
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
    auto [a, b] = visible(s, r, j0, n);
    if (s.tile_max[r] == NEG_INF) b = a;  // a tree hid every key of its span: exp(-inf - -inf) would be NaN
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
    rescale_acc(s, r, dim, alpha);
  }
  return {a_min, b_max};
}

template <typename T, typename C>
void run_unit(const Problem<T, C>& pb, const Unit& u, Scratch<T, C>& s, const Unit* following) {
  const QueryRows q_rows = pb.rows_of(u);
  const int64_t v_dim = pb.v_padded_dim;
  std::fill(s.acc.begin(), s.acc.begin() + q_rows.count * v_dim, 0.f);
  std::fill(s.m.begin(), s.m.begin() + q_rows.count, NEG_INF);
  std::fill(s.l.begin(), s.l.begin() + q_rows.count, 0.f);
  // Row r sees the request's keys up to its query token's, from the first key of its position (prefix + depth): its
  // window's and chunk's start; a tree hides more of the new keys (hide_outside_tree).
  const Metadata& md = pb.md;
  const int64_t prefix = md.lens[u.request] - (md.cu[u.request + 1] - md.cu[u.request]);
  s.prefix = prefix;
  s.new_depth = md.depth ? md.depth + md.cu[u.request] : nullptr;
  for (int64_t r = 0; r < q_rows.count; ++r) {
    const int64_t t = q_rows.token(r), j = t - md.cu[u.request];
    s.key_end[r] = prefix + j + 1;
    s.key_begin[r] = first_key(prefix + md.depth_of(t, j), pb.window, pb.chunk);
    s.tree_row[r] = md.tree ? md.tree + t * md.tree_stride : nullptr;
    s.own[r] = j;
  }
  const bool brgemm = q_rows.per_head >= pb.gemm_rows;
  if (brgemm) {
    attend_brgemm(pb, u, s);
  } else {
    attend_inplace(pb, u, s, following);
  }

  // The kv head's v_scale, and for raw fp8 rows the rest of raw_unit (see attend_inplace.cpp); split partials hold
  // the output's own values, so the merge takes them as they are, and their sinks join there.
  const float raw = brgemm ? 1.f : raw_unit<C>() / lifted<C>();
  for (int64_t r = 0; r < q_rows.count; ++r) {
    float* acc = s.acc.data() + r * v_dim;
    const float v_factor = pb.v_scale[q_rows.kv_head(r)] * raw;
    // The accumulators times inv, into dst (T: rounded as c10 rounds, to nearest even).
    const auto write = [&](float inv, auto* dst) {
      for (int64_t d = 0; d < v_dim; d += VEC) (Vec::loadu(acc + d) * Vec(inv)).store(acc + d);
      at::vec::convert(acc, dst, pb.v_head_dim);
    };
    if (u.partial < 0) {
      // A sink adds exp(sink - m) to the sum of probabilities (a row that sees no key: output 0, sink or not).
      const float sink = pb.sinks ? std::exp(pb.sinks[q_rows.q_head(r)] - s.m[r]) : 0.f;
      write((s.l[r] > 0 ? 1.f / (s.l[r] + sink) : 0.f) * v_factor,
            pb.out + (q_rows.token(r) * pb.num_kv_heads * pb.group + q_rows.q_head(r)) * pb.v_head_dim);
    } else {
      write((s.l[r] > 0 ? 1.f / s.l[r] : 0.f) * v_factor, pb.partial_out + (u.partial + r) * pb.v_head_dim);
      pb.partial_lse[u.partial + r] = s.l[r] > 0 ? s.m[r] + std::log(s.l[r]) : NEG_INF;
    }
  }
}

// out = sum_s exp(lse_s - max) out_s / sum_s exp(lse_s - max), a sink (a slice of lse `sink` and output 0) joining
// the sums.
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
    if (pb.sinks && total > 0) total += std::exp(pb.sinks[q_head] - mx);  // as in run_unit
    const float inv = total > 0 ? 1.f / total : 0.f;
    T* dst = pb.out + ((q_start + r / pb.group) * pb.num_kv_heads * pb.group + q_head) * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
  }
}

#define INSTANTIATE(T, C)                                                                                          \
  template std::pair<int64_t, int64_t> softmax_tile(const Problem<T, C>&, int64_t, int64_t, int64_t, float, float, \
                                                    int64_t, int64_t, Scratch<T, C>&);                             \
  template void run_unit(const Problem<T, C>&, const Unit&, Scratch<T, C>&, const Unit*);                          \
  template void run_merge(const Problem<T, C>&, const Merge&);
HYBRID_OPS_CPU_TYPES(INSTANTIATE)

}  // namespace hybrid_ops::cpu
