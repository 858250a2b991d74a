// The state ops' native CPU kernels (state_ops.cpp), entry points of the Python module for the cpu backend's methods
// (hybrid_ops/backends/cpu.py): hybrid_ops/state_ops.py's ops on the arguments its checks passed.
//
// Each takes the op's tensors (any strides, but the states: contiguous), the step's metadata (cu_seqlens_q [B + 1],
// seq_lens [B], state_slots [B] int32; `decode`: the decode path, one q_len for every request; `verify`:
// TARGET_VERIFY, each token's state to intermediate_states [num_slots, Q, *state shape] and the slots left as they
// were; tree_mask [T, Q] bool or none) and the op's scalars. It checks the metadata's values first (the rules of
// validation.check_state_metadata_values) and returns std::nullopt, having written nothing, when one fails;
// otherwise the output, contiguous in its input's dtype. Inputs float32, bfloat16 or float16; arithmetic in fp32.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace hybrid_ops {

// Defines causal_conv1d, gated_delta_rule and selective_scan in the Python module `m` (dispatch.cpp's).
void define_state_ops(py::module_& m);

}  // namespace hybrid_ops
