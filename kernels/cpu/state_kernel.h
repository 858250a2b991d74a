// What the state ops' kernels share (causal_conv1d.cpp, gated_delta_rule.cpp, selective_scan.cpp): the step's batch,
// its metadata's values checked by state_ops.cpp; inputs of any float dtype and strides read as fp32 rows; the split
// of the work into tasks over the threads; and the walk of a recurrence along a request's tokens. None of them sees an
// at::Tensor: state_ops.cpp hands them pointers.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "parallel.h"

namespace hybrid_ops::state {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VEC = Vec::size();

inline float hsum(const Vec& x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}

// f(c, n) for the vectors of a row of `size` values: n values from c, VEC but for the last. Vec::loadu(p, n) reads
// lanes [0, n) and zeroes the rest; store(p, n) writes lanes [0, n).
template <typename F>
inline void for_vectors(int64_t size, F&& f) {
  for (int64_t c = 0; c < size; c += VEC) f(c, std::min(VEC, size - c));
}

inline Vec silu(const Vec& x) { return x / (Vec(1.f) + x.neg().exp()); }

// n values of type T, `stride` elements apart, to fp32.
template <typename T>
void widen(const T* p, int64_t stride, int64_t n, float* out) {
  if (stride != 1) {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i * stride]);
  } else if constexpr (std::is_same_v<T, float>) {
    std::copy_n(p, n, out);
  } else {
    int64_t i = 0;
    for (; i + VEC <= n; i += VEC) {
      Vec x;
      at::vec::load_to_float(p + i, x);
      x.store(out + i);
    }
    for (; i < n; ++i) out[i] = static_cast<float>(p[i]);
  }
}

// n fp32 values to contiguous ones of `dtype` (float32, bfloat16 or float16), rounded to nearest even.
inline void narrow(const float* src, int64_t n, at::ScalarType dtype, void* dst) {
  switch (dtype) {
    case at::kBFloat16:
      return at::vec::convert(src, static_cast<at::BFloat16*>(dst), n);
    case at::kHalf:
      return at::vec::convert(src, static_cast<at::Half*>(dst), n);
    default:
      std::copy_n(src, n, static_cast<float*>(dst));
  }
}

// An input of float32, bfloat16 or float16 read as [rows, heads, values], any strides ([T, H] inputs: one value per
// head, values stride 0; [T, C]: one head).
struct Rows {
  const void* data = nullptr;
  at::ScalarType dtype = at::kFloat;
  int64_t strides[3] = {0, 0, 0};

  // n values of row t, head h, from value c, into out as fp32.
  void read(int64_t t, int64_t h, int64_t c, int64_t n, float* out) const {
    gather(t * strides[0] + h * strides[1] + c * strides[2], strides[2], n, out);
  }
  // n values of each of the heads h .. h + heads - 1 of row t into out [heads, n] as fp32; one value a head (dt, or
  // x of Mamba1's heads of one channel) is one read across the heads.
  void read_heads(int64_t t, int64_t h, int64_t heads, int64_t n, float* out) const {
    if (n == 1) return gather(t * strides[0] + h * strides[1], strides[1], heads, out);
    for (int64_t k = 0; k < heads; ++k) read(t, h + k, 0, n, out + k * n);
  }
  // The values read_heads reads: in place where they are fp32 and lie as out would hold them, else read into out.
  const float* view_heads(int64_t t, int64_t h, int64_t heads, int64_t n, float* out) const {
    if (dtype == at::kFloat && (heads == 1 || strides[1] == n) && (n == 1 || strides[2] == 1)) {
      return static_cast<const float*>(data) + t * strides[0] + h * strides[1];
    }
    read_heads(t, h, heads, n, out);
    return out;
  }
  float value(int64_t t, int64_t h) const {
    float x;
    read(t, h, 0, 1, &x);
    return x;
  }

 private:
  void gather(int64_t offset, int64_t stride, int64_t n, float* out) const {
    switch (dtype) {
      case at::kBFloat16:
        return widen(static_cast<const at::BFloat16*>(data) + offset, stride, n, out);
      case at::kHalf:
        return widen(static_cast<const at::Half*>(data) + offset, stride, n, out);
      default:
        return widen(static_cast<const float*>(data) + offset, stride, n, out);
    }
  }
};

// The step's B requests, their metadata's values checked (state_ops.cpp): request i's new tokens are the rows
// cu[i] .. cu[i + 1] - 1, its slot slots[i] (-1: a padding request), and it continues its slot's state when its
// length lens[i] exceeds its new tokens.
struct Batch {
  const int32_t *cu, *lens, *slots;
  const int32_t* parents;  // [T]: each token's parent among its request's new tokens (j - 1 without a tree), -1: none
  int64_t num_requests;
  bool tree, verify;
  int64_t verify_len;  // Q of intermediate_states [num_slots, Q, *state shape], in verify

  int64_t q_len(int64_t i) const { return cu[i + 1] - cu[i]; }
  bool has_prefix(int64_t i) const { return lens[i] > q_len(i); }
};

// Below this many element updates a call runs on the calling thread: waking the others costs more than it saves.
constexpr int64_t SERIAL_WORK = 1 << 15;

// task(i, scratch) for i in [0, n), `scratch_size` floats of scratch per thread, on the threads of at::parallel_for
// (parallel_dynamic: tasks are as ragged as the requests), or on this thread alone when the n tasks of about `work`
// element updates each are too little to share. A task's result does not depend on the thread that runs it.
template <typename Task>
void run_tasks(int64_t n, int64_t work, int64_t scratch_size, Task&& task) {
  if (n <= 1 || n * work < SERIAL_WORK) {
    std::vector<float> scratch(scratch_size);
    for (int64_t i = 0; i < n; ++i) task(i, scratch.data());
    return;
  }
  std::vector<std::vector<float>> scratch(at::get_num_threads());
  cpu::parallel_dynamic(n, [&](int64_t i) {
    auto& mine = scratch[at::get_thread_num()];
    if (mine.size() != static_cast<size_t>(scratch_size)) mine.resize(scratch_size);
    task(i, mine.data());
  });
}

// A recurrent op's fp32 states, `size` floats per head: state [num_slots, heads, size] and, in verify,
// intermediate [num_slots, Q, heads, size].
struct StatePool {
  float* state;
  float* intermediate;
  int64_t heads, size;
};

// Request i's recurrence for the heads h .. h + heads - 1 (not a padding request's), whose states lie together in
// every place as one [heads, size]: step(src, dst, t) for each of its tokens t in order, src the states the token
// follows (its parent's; for the first of a path the slot's, or zeros without a prefix) and dst where the states after
// it go: intermediate[slot, j, h] in verify; with a tree, tree_states[j] (the task's, [q_len, heads, size]), the last
// one then copied to the slot; otherwise the slot itself, updated in place (the heads' states are contiguous, as near
// in the caches as a copy would be, without copying them in and out). src may be dst.
template <typename Step>
void recur(const Batch& b, const StatePool& pool, int64_t i, int64_t h, int64_t heads, float* tree_states,
           Step&& step) {
  const int64_t n = b.q_len(i), t0 = b.cu[i], slot = b.slots[i], size = heads * pool.size;
  float* const own = pool.state + (slot * pool.heads + h) * pool.size;
  const auto place = [&](int64_t j) {
    if (b.verify) return pool.intermediate + ((slot * b.verify_len + j) * pool.heads + h) * pool.size;
    return b.tree ? tree_states + j * size : own;
  };
  for (int64_t j = 0; j < n; ++j) {
    const int64_t parent = b.parents[t0 + j];
    float* dst = place(j);
    const float* src = parent >= 0 ? place(parent) : b.has_prefix(i) ? own : nullptr;
    if (!src) {
      std::fill_n(dst, size, 0.f);
      src = dst;
    }
    step(src, dst, t0 + j);
  }
  if (!b.verify && b.tree && n > 0) std::copy_n(place(n - 1), size, own);
}

// The kernels (their files), each over the batch's tokens, writing every output row (padding requests': zeros).

// Depthwise causal convolution: x [T, C] (Rows of one head), conv_state [num_slots, K - 1, C] and, in verify,
// intermediate [num_slots, Q, K - 1, C], both contiguous in x's dtype; weight [K, C] (transposed) and bias [C] (or
// null) fp32; out [T, C] contiguous in x's dtype.
struct ConvProblem {
  Rows x;
  void *state, *intermediate, *out;
  const float *weight, *bias;
  int64_t channels, width;
  bool silu;
};
void causal_conv1d(const Batch& b, const ConvProblem& p);

// The gated delta rule: q, k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv] or [T, Hv, Dk] (g_per_channel), beta [T, Hv];
// states [num_slots, Hv, Dk * Dv]; out [T, Hv, Dv] contiguous in v's dtype.
struct DeltaProblem {
  Rows q, k, v, g, beta;
  bool g_per_channel;
  StatePool states;
  void* out;
  at::ScalarType out_dtype;
  int64_t k_heads, k_dim, v_dim;
  float scale;
};
void gated_delta_rule(const Batch& b, const DeltaProblem& p);

// The selective scan: x, z (or no data) [T, H, P], dt [T, H], B, C [T, G, N]; A [H, N] (a_per_channel) or [H], D
// and dt_bias [H] (or null) contiguous fp32; states [num_slots, H, P * N]; out [T, H, P] contiguous in x's dtype.
struct ScanProblem {
  Rows x, z, dt, B, C;
  const float *A, *D, *dt_bias;
  bool a_per_channel;
  bool dt_softplus;
  float dt_min, dt_max;
  StatePool states;
  void* out;
  at::ScalarType out_dtype;
  int64_t groups, head_dim, state_size;
};
void selective_scan(const Batch& b, const ScanProblem& p);

}  // namespace hybrid_ops::state
