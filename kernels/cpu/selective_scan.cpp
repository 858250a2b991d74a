// The selective scan (hybrid_ops/state_ops.py's selective_scan), one task per (request, block of heads of one group)
// over the request's tokens in order (`recur`), the block's states [heads, P, N] fp32 taken as heads * P rows of N,
// each vectorised along its N. Mamba2 (P of 64 or so, A [H]: one decay per head, broadcast over N) takes one head a
// task, its P rows sharing the head's decay. Mamba1 (Jamba: P = 1, A [H, N]: a decay per state channel, G = 1) takes
// HEAD_BLOCK heads a task, one row each: a token's B and C are then read once for them all, its per-head values (dt,
// x, z, the output) as one row across the heads, and d is computed across them in vectors; with one task per head,
// the per-token overheads cost several times the row's own arithmetic.
//
// Per token: d = clamp(softplus?(dt + dt_bias), dt_min, dt_max) [heads]; each head's decay row exp(d A) [N]; then one
// pass over the rows, ROW_BLOCK at a time, row r: S_r = decay * S_r + (d x_r) B (in place when src is dst),
// y_r = S_r . C; then y + D x, gated by silu(z), vectorised over the rows. The blocks depend on the shapes alone, and a
// row's arithmetic only on its head: the results are the same for any thread count.

#include <cstring>

#include "state_kernel.h"

namespace hybrid_ops::state {
namespace {

constexpr int ROW_BLOCK = 4;        // state rows updated together: they share the loads of B and C
constexpr int64_t HEAD_BLOCK = 16;  // heads of one row (P = 1) a task: the fastest of 8, 16 and 32

// Rows r0 .. r0 + R - 1 of a task's states [rows, N]: S_r = decay * S_r + dx_r B into dst (src may be dst), and
// y_r = S_r . C, each row summing into its own accumulator. decay: one row [N] for all (a head's rows), or with
// HEAD_ROWS one per row ([rows, N]: Mamba1's heads of one row).
template <int R, bool HEAD_ROWS>
void update_rows(const float* src, float* dst, int64_t r0, int64_t N, const float* decay, const float* B,
                 const float* C, const float* dx, float* y) {
  Vec acc[R], dxr[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = Vec(0.f);
    dxr[r] = Vec(dx[r0 + r]);
  }
  for_vectors(N, [&](int64_t c, int64_t m) {
    const Vec b = Vec::loadu(B + c, m), cv = Vec::loadu(C + c, m), shared = Vec::loadu(decay + c, m);
    for (int r = 0; r < R; ++r) {
      const int64_t off = (r0 + r) * N + c;
      const Vec a = HEAD_ROWS ? Vec::loadu(decay + off, m) : shared;
      const Vec s = at::vec::fmadd(a, Vec::loadu(src + off, m), dxr[r] * b);
      s.store(dst + off, m);
      acc[r] = at::vec::fmadd(s, cv, acc[r]);
    }
  });
  for (int r = 0; r < R; ++r) y[r0 + r] = hsum(acc[r]);
}

// All the rows of a task, ROW_BLOCK at a time.
template <bool HEAD_ROWS>
void update(const float* src, float* dst, int64_t rows, int64_t N, const float* decay, const float* B, const float* C,
            const float* dx, float* y) {
  int64_t r = 0;
  for (; r + ROW_BLOCK <= rows; r += ROW_BLOCK) update_rows<ROW_BLOCK, HEAD_ROWS>(src, dst, r, N, decay, B, C, dx, y);
  for (; r < rows; ++r) update_rows<1, HEAD_ROWS>(src, dst, r, N, decay, B, C, dx, y);
}

// d = clamp(softplus?(dt + dt_bias), dt_min, dt_max) for one head or a vector of heads (dt + dt_bias given).
// softplus(d) is d to fp32 precision above 20 (and exp(d) overflows above 88).
float time_step(float d, const ScanProblem& p) {
  if (p.dt_softplus && d <= 20.f) d = std::log1p(std::exp(d));
  return std::min(std::max(d, p.dt_min), p.dt_max);
}
Vec time_step(Vec d, const ScanProblem& p) {
  if (p.dt_softplus) d = Vec::blendv(d.exp().log1p(), d, d > Vec(20.f));
  return at::vec::clamp(d, Vec(p.dt_min), Vec(p.dt_max));
}

}  // namespace

void selective_scan(const Batch& b, const ScanProblem& p) {
  const int64_t H = p.states.heads, P = p.head_dim, N = p.state_size, group = H / p.groups, size = p.states.size;
  const int64_t elem = c10::elementSize(p.out_dtype);
  char* const out = static_cast<char*>(p.out);
  int64_t longest = 0;
  for (int64_t i = 0; i < b.num_requests; ++i) longest = std::max(longest, b.q_len(i));
  // Tasks: (request, block of up to `per_task` heads of one group, the group's last block the rest).
  const bool head_rows = P == 1;  // a row per head: per-head decay rows, and d across the heads
  const int64_t per_task = head_rows ? std::min(HEAD_BLOCK, group) : 1, blocks = (group + per_task - 1) / per_task;
  const int64_t row_space = per_task * P, lanes = (per_task + VEC - 1) / VEC * VEC;  // heads in whole vectors
  // Scratch: the decay rows [heads, N]; B, C [N]; d, dt_bias [lanes]; D, x, silu(z), y, d x [rows]; with a tree outside
  // verify, the task's states.
  const int64_t scratch = per_task * N + 2 * (N + lanes) + 5 * row_space;
  const int64_t tree_states = b.tree && !b.verify ? longest * per_task * size : 0;
  const int64_t tasks = b.num_requests * p.groups * blocks;
  const int64_t work = b.cu[b.num_requests] * H * size / std::max<int64_t>(tasks, 1);
  run_tasks(tasks, work, scratch + tree_states, [&](int64_t task, float* mine) {
    const int64_t i = task / (p.groups * blocks), g = task / blocks % p.groups, k0 = task % blocks * per_task;
    const int64_t h0 = g * group + k0, heads = std::min(per_task, group - k0), rows = heads * P;
    // Rows of the outputs [T, H, P] and inputs [T, H, P] or [T, H]: the block's heads lie together in each.
    if (b.slots[i] < 0) {
      for (int64_t t = b.cu[i]; t < b.cu[i + 1]; ++t) std::memset(out + (t * H + h0) * P * elem, 0, rows * elem);
      return;
    }
    float *decay = mine, *Bs = decay + per_task * N, *Cs = Bs + N, *d = Cs + N, *bias = d + lanes;
    float *D = bias + lanes, *xs = D + row_space, *gate = xs + row_space, *y = gate + row_space, *dx = y + row_space;
    // The heads' parameters, read once for all the tokens: A [heads, N] or [heads]; dt_bias [lanes]; D by row.
    const float* A = p.A + h0 * (p.a_per_channel ? N : 1);
    for (int64_t k = 0; k < lanes; ++k) bias[k] = p.dt_bias && k < heads ? p.dt_bias[h0 + k] : 0.f;
    for (int64_t r = 0; r < rows; ++r) D[r] = p.D ? p.D[h0 + (head_rows ? r : 0)] : 0.f;
    recur(b, p.states, i, h0, heads, mine + scratch, [&](const float* src, float* dst, int64_t t) {
      p.dt.read_heads(t, h0, heads, 1, d);
      if (head_rows) {  // whole vectors: the lanes past the heads compute on leftovers, unused
        for (int64_t c = 0; c < heads; c += VEC) time_step(Vec::loadu(d + c) + Vec::loadu(bias + c), p).store(d + c);
      } else {  // a scalar: a vector load of the one value just stored would stall on the store
        d[0] = time_step(d[0] + bias[0], p);
      }
      // The inputs read first (fp32 in place, others widened), so that their cache misses wait beside the exps.
      const float* x = p.x.view_heads(t, h0, heads, P, xs);
      for (int64_t r = 0; r < rows; ++r) dx[r] = d[head_rows ? r : 0] * x[r];
      if (p.z.data) {
        const float* z = p.z.view_heads(t, h0, heads, P, gate);
        for_vectors(rows, [&](int64_t c, int64_t m) { silu(Vec::loadu(z + c, m)).store(gate + c, m); });
      }
      const float *B = p.B.view_heads(t, g, 1, N, Bs), *C = p.C.view_heads(t, g, 1, N, Cs);
      for (int64_t k = 0; k < heads; ++k) {
        float* row = decay + k * N;
        if (p.a_per_channel) {
          const Vec dk(d[k]);
          for_vectors(N, [&](int64_t c, int64_t m) { (dk * Vec::loadu(A + k * N + c, m)).exp().store(row + c, m); });
        } else {
          std::fill_n(row, N, std::exp(d[k] * A[k]));
        }
      }
      if (head_rows) {
        update<true>(src, dst, rows, N, decay, B, C, dx, y);
      } else {
        update<false>(src, dst, rows, N, decay, B, C, dx, y);
      }
      for_vectors(rows, [&](int64_t c, int64_t m) {
        Vec yc = at::vec::fmadd(Vec::loadu(D + c, m), Vec::loadu(x + c, m), Vec::loadu(y + c, m));
        if (p.z.data) yc = yc * Vec::loadu(gate + c, m);
        yc.store(y + c, m);
      });
      narrow(y, rows, p.out_dtype, out + (t * H + h0) * P * elem);
    });
  });
}

}  // namespace hybrid_ops::state
