// The depthwise causal convolution (hybrid_ops/state_ops.py's causal_conv1d), one task per (request, block of
// CHANNEL_BLOCK channels) over the request's tokens in order, vectorised over the block's channels.
//
// Token j's window is the K inputs along its path, oldest first, gathered newest first: its own input, its parent's,
// its parent's parent's, ..., then, past the path's first token, the slot's K - 1 inputs newest first (zeros
// without a prefix). So no token's state needs keeping for a tree: the path holds it. In a plain sequence (parents
// j - 1) a token's window is the previous one shifted by its own input, kept in a ring: one read per token. The
// state after token j is its window's last K - 1 inputs, stored in x's dtype (exactly: they come from x or a state in
// it): to intermediate_states[slot, j] in verify, otherwise the last token's to the slot, once the request's outputs
// are done.

#include <cstring>

#include "state_kernel.h"

namespace hybrid_ops::state {
namespace {

constexpr int64_t CHANNEL_BLOCK = 64;  // channels per task
static_assert(CHANNEL_BLOCK % VEC == 0);

// A task's window: K rows of CHANNEL_BLOCK fp32 values in a ring, its k-th input (oldest first) in row (base + k) % K.
struct Window {
  float* rows;
  int64_t width, base = 0;
  float* row(int64_t k) const {
    const int64_t r = base + k;
    return rows + (r < width ? r : r - width) * CHANNEL_BLOCK;
  }
};

// The window's last K - 1 inputs (cb channels of each) as the rows [K - 1, channels] of dst from channel c0, in
// `dtype`.
void store_state(const Window& w, int64_t cb, at::ScalarType dtype, char* dst, int64_t channels, int64_t c0) {
  const int64_t elem = c10::elementSize(dtype);
  for (int64_t r = 0; r + 1 < w.width; ++r) narrow(w.row(r + 1), cb, dtype, dst + (r * channels + c0) * elem);
}

}  // namespace

void causal_conv1d(const Batch& b, const ConvProblem& p) {
  const int64_t C = p.channels, K = p.width, blocks = (C + CHANNEL_BLOCK - 1) / CHANNEL_BLOCK;
  const at::ScalarType dtype = p.x.dtype;
  const int64_t elem = c10::elementSize(dtype), slot_elems = (K - 1) * C;
  // The slots' inputs as rows slot * (K - 1) + r.
  const Rows prefix{.data = p.state, .dtype = dtype, .strides = {C, 0, 1}};
  char *const out = static_cast<char*>(p.out), *const state = static_cast<char*>(p.state);
  char* const intermediate = static_cast<char*>(p.intermediate);
  const int64_t tasks = b.num_requests * blocks, work = b.cu[b.num_requests] * K * C / std::max<int64_t>(tasks, 1);
  // Scratch: the window [K, CHANNEL_BLOCK], then the outputs [CHANNEL_BLOCK].
  run_tasks(tasks, work, (K + 1) * CHANNEL_BLOCK, [&](int64_t task, float* scratch) {
    const int64_t i = task / blocks, c0 = task % blocks * CHANNEL_BLOCK, cb = std::min(CHANNEL_BLOCK, C - c0);
    const int64_t t0 = b.cu[i], n = b.q_len(i), slot = b.slots[i];
    if (slot < 0) {
      for (int64_t t = t0; t < t0 + n; ++t) std::memset(out + (t * C + c0) * elem, 0, cb * elem);
      return;
    }
    Window window{.rows = scratch, .width = K};
    float* y = scratch + K * CHANNEL_BLOCK;
    for (int64_t j = 0; j < n; ++j) {
      if (j > 0 && !b.tree) {
        // A chain: the previous token's window, this token's input in place of its oldest.
        p.x.read(t0 + j, 0, c0, cb, window.row(0));
        window.base = window.base + 1 < K ? window.base + 1 : 0;
      } else {
        window.base = 0;
        int64_t token = j, prefix_row = K - 2;  // the next input along the path: a new token's, then the slot's
        for (int64_t k = K - 1; k >= 0; --k) {
          if (token >= 0) {
            p.x.read(t0 + token, 0, c0, cb, window.row(k));
            token = b.parents[t0 + token];
          } else if (b.has_prefix(i)) {
            prefix.read(slot * (K - 1) + prefix_row--, 0, c0, cb, window.row(k));
          } else {
            std::fill_n(window.row(k), cb, 0.f);
          }
        }
      }
      for_vectors(cb, [&](int64_t c, int64_t m) {
        Vec acc = p.bias ? Vec::loadu(p.bias + c0 + c, m) : Vec(0.f);
        for (int64_t k = 0; k < K; ++k) {
          acc = at::vec::fmadd(Vec::loadu(p.weight + k * C + c0 + c, m), Vec::loadu(window.row(k) + c, m), acc);
        }
        if (p.silu) acc = silu(acc);
        acc.store(y + c, m);
      });
      narrow(y, cb, dtype, out + ((t0 + j) * C + c0) * elem);
      if (b.verify) store_state(window, cb, dtype, intermediate + (slot * b.verify_len + j) * slot_elems * elem, C, c0);
    }
    // The window still holds the last token's inputs, read before this overwrites the slot's.
    if (!b.verify && n > 0) store_state(window, cb, dtype, state + slot * slot_elems * elem, C, c0);
  });
}

}  // namespace hybrid_ops::state
