// The gated delta rule (hybrid_ops/state_ops.py's gated_delta_rule), one task per (request, value head) over the
// request's tokens in order (`recur`), the head's state S [Dk, Dv] fp32, vectorised along its rows (Dv wide).
//
// Per token t, with D the decay (exp(g): one per head, or one per key channel):
//   sums    a = (D S)^T k and b = (D S)^T q: the rows of S times k_i d_i and q_i d_i;
//   update  S' = D S + k u^T, u = beta (v - a) (in place when src is dst: each value is read, then written);
// and o = scale S'^T q = scale (b + (k . q) u), from the sums: no pass of its own. Both passes go over S a block of
// columns at a time, every row of it, their sums in registers. When the next token follows this one (a plain
// sequence; a child right after its parent in a tree), the update pass also makes the next token's sums from the
// rows it writes: S is read once and written once per token. Each column's sums add the same rows in the same order
// either way, so the result does not depend on the fusion.

#include <cstring>
#include <utility>

#include "state_kernel.h"

namespace hybrid_ops::state {
namespace {

// A token's rows [Dk]: q, k, the decay d, and k d, q d (the sums' weights); kq = k . q.
struct TokenRows {
  float *q, *k, *decay, *kd, *qd;
  float kq;
};

// What a pass over S reads and writes: with Update, dst = D src + k u^T (u [Dv]); with Sums, a = sum_i ka[i] S_i and
// b = sum_i kb[i] S_i over the rows S_i of the pass's S (dst's new rows with Update, else src's).
struct Pass {
  const float* src = nullptr;
  float* dst = nullptr;
  const float *decay = nullptr, *k = nullptr, *u = nullptr, *ka = nullptr, *kb = nullptr;
  float *a = nullptr, *b = nullptr;
  int64_t rows = 0, cols = 0;
};

// The pass over NV vectors of columns from c0, the last one n wide.
template <int NV, bool Update, bool Sums>
void column_block(const Pass& p, int64_t c0, int64_t n) {
  Vec u[NV], sum_a[NV], sum_b[NV];
  for (int v = 0; v < NV; ++v) {
    const int64_t m = v + 1 < NV ? VEC : n;
    if (Update) u[v] = Vec::loadu(p.u + c0 + v * VEC, m);
    sum_a[v] = sum_b[v] = Vec(0.f);
  }
  for (int64_t i = 0; i < p.rows; ++i) {
    const float* in = p.src + i * p.cols + c0;
    float* out = p.dst + i * p.cols + c0;
    const Vec d(Update ? p.decay[i] : 0.f), k(Update ? p.k[i] : 0.f);
    const Vec ka(Sums ? p.ka[i] : 0.f), kb(Sums ? p.kb[i] : 0.f);
    for (int v = 0; v < NV; ++v) {
      const int64_t m = v + 1 < NV ? VEC : n;
      Vec x = Vec::loadu(in + v * VEC, m);
      if (Update) {
        x = at::vec::fmadd(d, x, k * u[v]);
        x.store(out + v * VEC, m);
      }
      if (Sums) {
        sum_a[v] = at::vec::fmadd(ka, x, sum_a[v]);
        sum_b[v] = at::vec::fmadd(kb, x, sum_b[v]);
      }
    }
  }
  for (int v = 0; v < NV && Sums; ++v) {
    sum_a[v].store(p.a + c0 + v * VEC, v + 1 < NV ? VEC : n);
    sum_b[v].store(p.b + c0 + v * VEC, v + 1 < NV ? VEC : n);
  }
}

// The pass over every column: blocks of as many vectors as stay in registers (16 on AVX2: 4 for one kind of pass, 2
// for both), then vector by vector.
template <bool Update, bool Sums>
void pass(const Pass& p) {
  constexpr int NV = Update && Sums ? 2 : 4;
  int64_t c0 = 0;
  for (; c0 + NV * VEC <= p.cols; c0 += NV * VEC) column_block<NV, Update, Sums>(p, c0, VEC);
  for (; c0 < p.cols; c0 += VEC) column_block<1, Update, Sums>(p, c0, std::min(VEC, p.cols - c0));
}

}  // namespace

void gated_delta_rule(const Batch& b, const DeltaProblem& p) {
  const int64_t Hv = p.states.heads, Dk = p.k_dim, Dv = p.v_dim, group = Hv / p.k_heads, size = p.states.size;
  const int64_t elem = c10::elementSize(p.out_dtype);
  char* const out = static_cast<char*>(p.out);
  int64_t longest = 0;
  for (int64_t i = 0; i < b.num_requests; ++i) longest = std::max(longest, b.q_len(i));
  // Scratch: two tokens' rows [5, Dk] (this one's, the next one's); v, a, b, u, o [Dv]; with a tree outside verify,
  // the task's states.
  const int64_t tree_states = b.tree && !b.verify ? longest * size : 0;
  const int64_t tasks = b.num_requests * Hv, work = b.cu[b.num_requests] * Hv * size / std::max<int64_t>(tasks, 1);
  run_tasks(tasks, work, 10 * Dk + 5 * Dv + tree_states, [&](int64_t task, float* scratch) {
    const int64_t i = task / Hv, h = task % Hv, kh = h / group;
    if (b.slots[i] < 0) {
      for (int64_t t = b.cu[i]; t < b.cu[i + 1]; ++t) std::memset(out + (t * Hv + h) * Dv * elem, 0, Dv * elem);
      return;
    }
    const auto rows_at = [&](float* r) { return TokenRows{r, r + Dk, r + 2 * Dk, r + 3 * Dk, r + 4 * Dk, 0.f}; };
    TokenRows now = rows_at(scratch), next = rows_at(scratch + 5 * Dk);  // this token's rows, the next one's
    float *v = scratch + 10 * Dk, *sum_k = v + Dv, *sum_q = sum_k + Dv, *u = sum_q + Dv, *o = u + Dv;
    const auto load = [&](int64_t t, TokenRows& r) {  // token t's rows
      p.q.read(t, kh, 0, Dk, r.q);
      p.k.read(t, kh, 0, Dk, r.k);
      if (p.g_per_channel) {
        p.g.read(t, h, 0, Dk, r.decay);
        for_vectors(Dk, [&](int64_t c, int64_t m) { Vec::loadu(r.decay + c, m).exp().store(r.decay + c, m); });
      } else {
        std::fill_n(r.decay, Dk, std::exp(p.g.value(t, h)));
      }
      r.kq = 0.f;
      for (int64_t c = 0; c < Dk; ++c) {
        r.kd[c] = r.k[c] * r.decay[c];
        r.qd[c] = r.q[c] * r.decay[c];
        r.kq += r.k[c] * r.q[c];
      }
    };
    bool summed = false;  // whether the previous token's update made this token's sums
    recur(b, p.states, i, h, 1, o + Dv, [&](const float* src, float* dst, int64_t t) {
      if (!summed) {
        load(t, now);
        pass<false, true>({.src = src, .ka = now.kd, .kb = now.qd, .a = sum_k, .b = sum_q, .rows = Dk, .cols = Dv});
      }
      p.v.read(t, h, 0, Dv, v);
      const Vec beta(p.beta.value(t, h)), scale(p.scale), kq(now.kq);
      for_vectors(Dv, [&](int64_t c, int64_t m) {
        const Vec uc = beta * (Vec::loadu(v + c, m) - Vec::loadu(sum_k + c, m));
        uc.store(u + c, m);
        (scale * at::vec::fmadd(kq, uc, Vec::loadu(sum_q + c, m))).store(o + c, m);
      });
      narrow(o, Dv, p.out_dtype, out + (t * Hv + h) * Dv * elem);
      summed = t + 1 < b.cu[i + 1] && b.parents[t + 1] == t - b.cu[i];  // its src will be this dst
      if (summed) load(t + 1, next);
      const Pass update{.src = src,
                        .dst = dst,
                        .decay = now.decay,
                        .k = now.k,
                        .u = u,
                        .ka = next.kd,
                        .kb = next.qd,
                        .a = sum_k,
                        .b = sum_q,
                        .rows = Dk,
                        .cols = Dv};
      if (summed) {
        pass<true, true>(update);
        std::swap(now, next);
      } else {
        pass<true, false>(update);
      }
    });
  });
}

}  // namespace hybrid_ops::state
