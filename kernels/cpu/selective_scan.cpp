// The selective scan (hybrid_ops/state_ops.py's selective_scan), one task per (request, head) over the request's
// tokens in order (`recur`), the head's state S [P, N] fp32, vectorised along its rows (N wide): the same loop serves
// Mamba2 (A [H]: one decay per head, broadcast over N) and Mamba1 (P = 1, A [H, N]: a decay per state channel).
//
// Per token: d = clamp(softplus?(dt + dt_bias), dt_min, dt_max); the decay row exp(d A) [N]; then one pass over S,
// ROW_BLOCK rows at a time, row p: S_p = decay * S_p + (d x_p) B (in place when src is dst), y_p = S_p . C; then
// y + D x, gated by silu(z), vectorised over P.

#include <cstring>

#include "state_kernel.h"

namespace hybrid_ops::state {
namespace {

constexpr int ROW_BLOCK = 4;  // state rows updated together: they share the loads of decay, B and C

// Rows r0 .. r0 + R - 1 of a head's state [P, N]: S_r = decay * S_r + (d x_r) B into dst (src may be dst), and
// y_r = S_r . C, each row summing into its own accumulator.
template <int R>
void update_rows(const float* src, float* dst, int64_t r0, int64_t N, const float* decay, const float* B,
                 const float* C, const float* x, float d, float* y) {
  Vec acc[R], dx[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = Vec(0.f);
    dx[r] = Vec(d * x[r0 + r]);
  }
  for_vectors(N, [&](int64_t c, int64_t m) {
    const Vec a = Vec::loadu(decay + c, m), b = Vec::loadu(B + c, m), cv = Vec::loadu(C + c, m);
    for (int r = 0; r < R; ++r) {
      const int64_t off = (r0 + r) * N + c;
      const Vec s = at::vec::fmadd(a, Vec::loadu(src + off, m), dx[r] * b);
      s.store(dst + off, m);
      acc[r] = at::vec::fmadd(s, cv, acc[r]);
    }
  });
  for (int r = 0; r < R; ++r) y[r0 + r] = hsum(acc[r]);
}

}  // namespace

void selective_scan(const Batch& b, const ScanProblem& p) {
  const int64_t H = p.states.heads, P = p.head_dim, N = p.state_size, group = H / p.groups, size = p.states.size;
  const int64_t elem = c10::elementSize(p.out_dtype);
  char* const out = static_cast<char*>(p.out);
  int64_t longest = 0;
  for (int64_t i = 0; i < b.num_requests; ++i) longest = std::max(longest, b.q_len(i));
  // Scratch: the decay, B, C [N]; x, z, y [P]; with a tree outside verify, the task's states.
  const int64_t tree_states = b.tree && !b.verify ? longest * size : 0;
  const int64_t tasks = b.num_requests * H, work = b.cu[b.num_requests] * H * size / std::max<int64_t>(tasks, 1);
  run_tasks(tasks, work, 3 * N + 3 * P + tree_states, [&](int64_t task, float* scratch) {
    const int64_t i = task / H, h = task % H, g = h / group;
    if (b.slots[i] < 0) {
      for (int64_t t = b.cu[i]; t < b.cu[i + 1]; ++t) std::memset(out + (t * H + h) * P * elem, 0, P * elem);
      return;
    }
    float *decay = scratch, *B = decay + N, *C = B + N, *x = C + N, *z = x + P, *y = z + P;
    const float* A = p.A + h * (p.a_per_channel ? N : 1);
    const float D = p.D ? p.D[h] : 0.f, dt_bias = p.dt_bias ? p.dt_bias[h] : 0.f;
    recur(b, p.states, i, h, y + P, [&](const float* src, float* dst, int64_t t) {
      float d = p.dt.value(t, h) + dt_bias;
      if (p.dt_softplus && d <= 20.f) d = std::log1p(std::exp(d));  // softplus(d) is d to fp32 precision above 20
      d = std::min(std::max(d, p.dt_min), p.dt_max);
      if (p.a_per_channel) {
        const Vec dv(d);
        for_vectors(N, [&](int64_t c, int64_t m) { (dv * Vec::loadu(A + c, m)).exp().store(decay + c, m); });
      } else {
        std::fill_n(decay, N, std::exp(d * A[0]));
      }
      p.B.read(t, g, 0, N, B);
      p.C.read(t, g, 0, N, C);
      p.x.read(t, h, 0, P, x);
      if (p.z.data) p.z.read(t, h, 0, P, z);
      int64_t r = 0;
      for (; r + ROW_BLOCK <= P; r += ROW_BLOCK) update_rows<ROW_BLOCK>(src, dst, r, N, decay, B, C, x, d, y);
      for (; r < P; ++r) update_rows<1>(src, dst, r, N, decay, B, C, x, d, y);
      for_vectors(P, [&](int64_t c, int64_t m) {
        Vec yc = at::vec::fmadd(Vec(D), Vec::loadu(x + c, m), Vec::loadu(y + c, m));
        if (p.z.data) yc = yc * silu(Vec::loadu(z + c, m));
        yc.store(y + c, m);
      });
      narrow(y, P, p.out_dtype, out + (t * H + h) * P * elem);
    });
  });
}

}  // namespace hybrid_ops::state
