// The state ops' entry points (state_ops.h), defined in the Python module: the shapes the kernels index by checked
// (TORCH_CHECK: the op's own checks make these hold, and a direct call must not read out of bounds either), then the
// metadata's values (a failure: std::nullopt, nothing written), then the tensors turned into the kernels' pointers
// (state_kernel.h).

#include "state_ops.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <vector>

#include "schedule.h"
#include "state_kernel.h"
#include "value_checks.h"  // generated from hybrid_ops/validation.py's rows when the kernels build

namespace hybrid_ops {
namespace {

bool float_dtype(at::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf; }

// An input [T, H, D], or [T, H] (one value per head), or with `one_head` [T, C] (one head of C values), as Rows.
state::Rows rows_of(const at::Tensor& t, const char* name, bool one_head = false) {
  TORCH_CHECK(float_dtype(t.scalar_type()) && (t.dim() == 2 || t.dim() == 3) && t.device().is_cpu(), name,
              " must be a CPU float32, bfloat16 or float16 tensor of 2 or 3 dims");
  const int64_t last = t.dim() == 3 ? t.stride(2) : 0;
  return {.data = t.const_data_ptr(),
          .dtype = t.scalar_type(),
          .strides = {t.stride(0), one_head ? 0 : t.stride(1), one_head ? t.stride(1) : last}};
}

// rows x cols values of a parameter, row r at r * row_stride, its values col_stride apart, as contiguous fp32 (read
// in the kernels' own loop: an ATen copy would cost more than the kernel itself on a decode step).
std::vector<float> floats(const at::Tensor& t, int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride) {
  const state::Rows view{.data = t.const_data_ptr(), .dtype = t.scalar_type(), .strides = {row_stride, 0, col_stride}};
  std::vector<float> out(rows * cols);
  for (int64_t r = 0; r < rows; ++r) view.read(r, 0, 0, cols, out.data() + r * cols);
  return out;
}

// A parameter [n] (one value per head or channel) as fp32, or none (empty).
std::vector<float> per_head(const std::optional<at::Tensor>& t, int64_t n, const char* name) {
  if (!t) return {};
  TORCH_CHECK(float_dtype(t->scalar_type()) && t->dim() == 1 && t->size(0) == n && t->device().is_cpu(), name,
              " must be a CPU float tensor [", n, "]");
  return floats(*t, 1, n, 0, t->stride(0));
}
const float* data_or_null(const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); }

// A state [num_slots, *shape] of `dtype`, contiguous; in verify, intermediate_states [num_slots, Q, *shape] too.
void check_states(const at::Tensor& state, at::IntArrayRef shape, at::ScalarType dtype,
                  const std::optional<at::Tensor>& intermediate, bool verify) {
  TORCH_CHECK(state.dim() == static_cast<int64_t>(shape.size()) + 1 && state.sizes().slice(1) == shape &&
                  state.size(0) > 0 && state.scalar_type() == dtype && state.is_contiguous() && state.device().is_cpu(),
              "the state must be a contiguous CPU tensor [num_slots, ", shape, "] of ", dtype, ", got ", state.sizes());
  if (!verify) return;
  TORCH_CHECK(intermediate && intermediate->dim() == state.dim() + 1 && intermediate->size(0) == state.size(0) &&
                  intermediate->sizes().slice(2) == shape && intermediate->scalar_type() == dtype &&
                  intermediate->is_contiguous() && intermediate->device().is_cpu(),
              "verify needs contiguous intermediate_states [num_slots, Q, ", shape, "] in the state's dtype");
}

// The step's metadata as the kernels read it: contiguous copies (none where already so) kept alive, its values checked
// and each token's parent found.
class Step {
 public:
  // False when a value fails validation.check_state_metadata_values's rules.
  bool check(const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& state_slots,
             int64_t num_tokens, int64_t num_slots, bool decode, bool verify,
             const std::optional<at::Tensor>& tree_mask, const std::optional<at::Tensor>& intermediate) {
    for (const at::Tensor* t : {&cu_seqlens_q, &seq_lens, &state_slots}) {
      TORCH_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->device().is_cpu(),
                  "cu_seqlens_q, seq_lens and state_slots must be 1-dim int32 CPU tensors");
    }
    const int64_t num_requests = seq_lens.size(0);
    TORCH_CHECK(cu_seqlens_q.size(0) == num_requests + 1 && state_slots.size(0) == num_requests,
                "cu_seqlens_q must have B + 1 entries and state_slots B, for the B of seq_lens");
    cu_ = cu_seqlens_q.contiguous();
    lens_ = seq_lens.contiguous();
    slots_ = state_slots.contiguous();
    cpu::Metadata md{.cu = cu_.const_data_ptr<int32_t>(),
                     .lens = lens_.const_data_ptr<int32_t>(),
                     .table = nullptr,
                     .table_stride = 0,
                     .width = 0,
                     .num_requests = num_requests};
    if (tree_mask) {
      TORCH_CHECK(tree_mask->scalar_type() == at::kBool && tree_mask->dim() == 2 && tree_mask->size(0) == num_tokens &&
                      tree_mask->size(1) > 0 && tree_mask->device().is_cpu(),
                  "tree_mask must be a CPU bool tensor [T, Q], Q >= 1");
      tree_ = tree_mask->contiguous();
      md.tree = tree_.const_data_ptr<bool>();
      md.tree_stride = md.tree_width = tree_.size(1);
    }
    const int64_t verify_len = verify ? intermediate->size(1) : 0;
    cpu::MetadataValues values = cpu::values_of(md, num_tokens, decode);
    values.slots = {slots_.const_data_ptr<int32_t>()};
    values.num_slots = num_slots;
    values.verify = verify;
    values.verify_len = verify_len;
    if (!cpu::length_values_ok(values) || !cpu::slot_values_ok(values) || (md.tree && !cpu::tree_values_ok(values)))
      return false;
    const int32_t* slots = slots_.const_data_ptr<int32_t>();
    parents_.resize(num_tokens);
    for (int64_t i = 0; i < num_requests; ++i) {
      const int64_t t0 = md.cu[i], q_len = md.cu[i + 1] - t0;
      for (int64_t j = 0; j < q_len; ++j) {
        // A tree's parent: the last earlier token the row sees (tree_values_ok checked that it sees no later one).
        int64_t parent = j - 1;
        if (md.tree) {
          const bool* row = md.tree + (t0 + j) * md.tree_stride;
          while (parent >= 0 && !row[parent]) --parent;
        }
        parents_[t0 + j] = static_cast<int32_t>(parent);
      }
    }
    batch = {.cu = md.cu,
             .lens = md.lens,
             .slots = slots,
             .parents = parents_.data(),
             .num_requests = num_requests,
             .tree = md.tree != nullptr,
             .verify = verify,
             .verify_len = verify_len};
    return true;
  }

  state::Batch batch;

 private:
  at::Tensor cu_, lens_, slots_, tree_;
  std::vector<int32_t> parents_;
};

float* intermediate_data(const std::optional<at::Tensor>& intermediate, bool verify) {
  return verify ? intermediate->data_ptr<float>() : nullptr;
}

// x [T, C]; weight [C, K]; bias [C] or none; conv_state [num_slots, K - 1, C] in x's dtype; activation "none" or
// "silu". -> [T, C].
std::optional<at::Tensor> causal_conv1d(const at::Tensor& x, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias, const at::Tensor& conv_state,
                                        const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                                        const at::Tensor& state_slots, bool decode, bool verify,
                                        const std::optional<at::Tensor>& tree_mask,
                                        const std::optional<at::Tensor>& intermediate_states,
                                        const std::string& activation) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(0) == x.size(1) && weight.size(1) >= 1,
              "x must be [T, C] and weight [C, K], K >= 1");
  TORCH_CHECK(activation == "none" || activation == "silu", "activation must be none or silu, got ", activation);
  const int64_t channels = x.size(1), width = weight.size(1);
  check_states(conv_state, {width - 1, channels}, x.scalar_type(), intermediate_states, verify);
  Step step;
  if (!step.check(cu_seqlens_q, seq_lens, state_slots, x.size(0), conv_state.size(0), decode, verify, tree_mask,
                  intermediate_states)) {
    return std::nullopt;
  }
  TORCH_CHECK(float_dtype(weight.scalar_type()), "weight must be float32, bfloat16 or float16");
  // weight [C, K] as [K, C]: each tap's row of channels, which the kernel vectorises over.
  const std::vector<float> w = floats(weight, width, channels, weight.stride(1), weight.stride(0));
  const std::vector<float> b = per_head(bias, channels, "bias");
  at::Tensor out = at::empty({x.size(0), channels}, x.options());
  state::causal_conv1d(step.batch, {.x = rows_of(x, "x", true),
                                    .state = conv_state.data_ptr(),
                                    .intermediate = verify ? intermediate_states->data_ptr() : nullptr,
                                    .out = out.data_ptr(),
                                    .weight = w.data(),
                                    .bias = data_or_null(b),
                                    .channels = channels,
                                    .width = width,
                                    .silu = activation == "silu"});
  return out;
}

// q, k [T, Hk, Dk]; v [T, Hv, Dv] (Hv % Hk == 0); g [T, Hv] or [T, Hv, Dk] float32; beta [T, Hv]; state
// [num_slots, Hv, Dk, Dv] float32. -> [T, Hv, Dv].
std::optional<at::Tensor> gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                           const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                                           const at::Tensor& state_slots, bool decode, bool verify,
                                           const std::optional<at::Tensor>& tree_mask,
                                           const std::optional<at::Tensor>& intermediate_states, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "q, k must be [T, Hk, Dk] and v [T, Hv, Dv]");
  const int64_t num_tokens = q.size(0), k_heads = q.size(1), k_dim = q.size(2), v_heads = v.size(1);
  const int64_t v_dim = v.size(2);
  TORCH_CHECK(k_heads > 0 && v_heads % k_heads == 0, "v's heads must be a multiple of q's and k's");
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.dim() >= 2 && g.size(0) == num_tokens && g.size(1) == v_heads &&
                  (g.dim() == 2 || (g.dim() == 3 && g.size(2) == k_dim)),
              "g must be float32 [T, Hv] or [T, Hv, Dk]");
  TORCH_CHECK(beta.dim() == 2 && beta.size(0) == num_tokens && beta.size(1) == v_heads, "beta must be [T, Hv]");
  check_states(state, {v_heads, k_dim, v_dim}, at::kFloat, intermediate_states, verify);
  Step step;
  if (!step.check(cu_seqlens_q, seq_lens, state_slots, num_tokens, state.size(0), decode, verify, tree_mask,
                  intermediate_states)) {
    return std::nullopt;
  }
  at::Tensor out = at::empty({num_tokens, v_heads, v_dim}, v.options());
  state::gated_delta_rule(step.batch, {.q = rows_of(q, "q"),
                                       .k = rows_of(k, "k"),
                                       .v = rows_of(v, "v"),
                                       .g = rows_of(g, "g"),
                                       .beta = rows_of(beta, "beta"),
                                       .g_per_channel = g.dim() == 3,
                                       .states = {.state = state.data_ptr<float>(),
                                                  .intermediate = intermediate_data(intermediate_states, verify),
                                                  .heads = v_heads,
                                                  .size = k_dim * v_dim},
                                       .out = out.data_ptr(),
                                       .out_dtype = out.scalar_type(),
                                       .k_heads = k_heads,
                                       .k_dim = k_dim,
                                       .v_dim = v_dim,
                                       .scale = static_cast<float>(scale)});
  return out;
}

// x [T, H, P]; dt [T, H]; A [H] or [H, N] float32; B, C [T, G, N] (H % G == 0); state [num_slots, H, P, N] float32;
// D, dt_bias [H] or none; z [T, H, P] or none; dt_max a float (inf: no limit). -> [T, H, P].
std::optional<at::Tensor> selective_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                                         const at::Tensor& B, const at::Tensor& C, const at::Tensor& state,
                                         const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                                         const at::Tensor& state_slots, bool decode, bool verify,
                                         const std::optional<at::Tensor>& tree_mask,
                                         const std::optional<at::Tensor>& intermediate_states,
                                         const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                                         const std::optional<at::Tensor>& dt_bias, bool dt_softplus, double dt_min,
                                         double dt_max) {
  TORCH_CHECK(x.dim() == 3 && dt.dim() == 2 && dt.size(0) == x.size(0) && dt.size(1) == x.size(1),
              "x must be [T, H, P] and dt [T, H]");
  const int64_t num_tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  TORCH_CHECK(
      B.dim() == 3 && C.sizes() == B.sizes() && B.size(0) == num_tokens && B.size(1) > 0 && heads % B.size(1) == 0,
      "B and C must be [T, G, N], H % G == 0");
  const int64_t groups = B.size(1), state_size = B.size(2);
  TORCH_CHECK(A.scalar_type() == at::kFloat && (A.dim() == 1 || (A.dim() == 2 && A.size(1) == state_size)) &&
                  A.size(0) == heads,
              "A must be float32 [H] or [H, N]");
  TORCH_CHECK(!z || z->sizes() == x.sizes(), "z must be [T, H, P]");
  check_states(state, {heads, head_dim, state_size}, at::kFloat, intermediate_states, verify);
  Step step;
  if (!step.check(cu_seqlens_q, seq_lens, state_slots, num_tokens, state.size(0), decode, verify, tree_mask,
                  intermediate_states)) {
    return std::nullopt;
  }
  const std::vector<float> a =
      A.dim() == 2 ? floats(A, heads, state_size, A.stride(0), A.stride(1)) : per_head(A, heads, "A");
  const std::vector<float> d = per_head(D, heads, "D"), bias = per_head(dt_bias, heads, "dt_bias");
  at::Tensor out = at::empty({num_tokens, heads, head_dim}, x.options());
  state::selective_scan(step.batch, {.x = rows_of(x, "x"),
                                     .z = z ? rows_of(*z, "z") : state::Rows{},
                                     .dt = rows_of(dt, "dt"),
                                     .B = rows_of(B, "B"),
                                     .C = rows_of(C, "C"),
                                     .A = a.data(),
                                     .D = data_or_null(d),
                                     .dt_bias = data_or_null(bias),
                                     .a_per_channel = A.dim() == 2,
                                     .dt_softplus = dt_softplus,
                                     .dt_min = static_cast<float>(dt_min),
                                     .dt_max = static_cast<float>(dt_max),
                                     .states = {.state = state.data_ptr<float>(),
                                                .intermediate = intermediate_data(intermediate_states, verify),
                                                .heads = heads,
                                                .size = head_dim * state_size},
                                     .out = out.data_ptr(),
                                     .out_dtype = out.scalar_type(),
                                     .groups = groups,
                                     .head_dim = head_dim,
                                     .state_size = state_size});
  return out;
}

}  // namespace

void define_state_ops(py::module_& m) {
  m.def("causal_conv1d", &causal_conv1d,
        "The depthwise causal convolution; None when the metadata's values are invalid", py::arg("x"),
        py::arg("weight"), py::arg("bias"), py::arg("conv_state"), py::arg("cu_seqlens_q"), py::arg("seq_lens"),
        py::arg("state_slots"), py::arg("decode"), py::arg("verify"), py::arg("tree_mask"),
        py::arg("intermediate_states"), py::arg("activation"));
  m.def("gated_delta_rule", &gated_delta_rule, "The gated delta rule; None when the metadata's values are invalid",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("state"),
        py::arg("cu_seqlens_q"), py::arg("seq_lens"), py::arg("state_slots"), py::arg("decode"), py::arg("verify"),
        py::arg("tree_mask"), py::arg("intermediate_states"), py::arg("scale"));
  m.def("selective_scan", &selective_scan,
        "The selective state-space scan; None when the metadata's values are invalid", py::arg("x"), py::arg("dt"),
        py::arg("A"), py::arg("B"), py::arg("C"), py::arg("state"), py::arg("cu_seqlens_q"), py::arg("seq_lens"),
        py::arg("state_slots"), py::arg("decode"), py::arg("verify"), py::arg("tree_mask"),
        py::arg("intermediate_states"), py::arg("D"), py::arg("z"), py::arg("dt_bias"), py::arg("dt_softplus"),
        py::arg("dt_min"), py::arg("dt_max"));
}

}  // namespace hybrid_ops
