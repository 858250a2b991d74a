// The state ops' native CPU kernels (state_ops.cpp), entry points of the Python module (dispatch.cpp) for the cpu
// backend's methods (hybrid_ops/backends/cpu.py): hybrid_ops/state_ops.py's ops on the arguments its checks passed.
//
// Each takes the op's tensors (any strides, but the states: contiguous), the step's metadata (cu_seqlens_q [B + 1],
// seq_lens [B], state_slots [B] int32; `decode`: the decode path, one q_len for every request; `verify`:
// TARGET_VERIFY, each token's state to intermediate_states [num_slots, Q, *state shape] and the slots left as they
// were; tree_mask [T, Q] bool or none) and the op's scalars. It checks the metadata's values first (the rules of
// validation.check_state_metadata_values) and returns std::nullopt, having written nothing, when one fails;
// otherwise the output, contiguous in its input's dtype. Inputs float32, bfloat16 or float16; arithmetic in fp32.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace hybrid_ops {

// x [T, C]; weight [C, K]; bias [C] or none; conv_state [num_slots, K - 1, C] in x's dtype; activation "none" or
// "silu". -> [T, C].
std::optional<at::Tensor> causal_conv1d(const at::Tensor& x, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias, const at::Tensor& conv_state,
                                        const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                                        const at::Tensor& state_slots, bool decode, bool verify,
                                        const std::optional<at::Tensor>& tree_mask,
                                        const std::optional<at::Tensor>& intermediate_states,
                                        const std::string& activation);

// q, k [T, Hk, Dk]; v [T, Hv, Dv] (Hv % Hk == 0); g [T, Hv] or [T, Hv, Dk] float32; beta [T, Hv]; state
// [num_slots, Hv, Dk, Dv] float32. -> [T, Hv, Dv].
std::optional<at::Tensor> gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                           const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                                           const at::Tensor& state_slots, bool decode, bool verify,
                                           const std::optional<at::Tensor>& tree_mask,
                                           const std::optional<at::Tensor>& intermediate_states, double scale);

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
                                         double dt_max);

}  // namespace hybrid_ops
