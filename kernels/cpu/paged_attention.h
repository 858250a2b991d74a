// The native CPU kernel (paged_attention.cpp), shared by its two entry points (dispatch.cpp): the dispatcher's CPU
// kernels of the hybrid ops, and the Python module's `forward`.
#pragma once

#include <ATen/core/Tensor.h>

namespace hybrid_ops {

// Stores k, v [T, Hkv, D] into the caches [num_pages, page_size, Hkv, D], then returns the attention of q [T, Hq, D]
// over each request's pages. Arguments as the ops' (checked by the caller), scale resolved; `decode`: every request
// has the same query length. Returns an undefined tensor, having written nothing, when the metadata's values are
// invalid.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                           const at::Tensor& block_table, double scale, int64_t window, double logit_cap,
                           bool decode);

}  // namespace hybrid_ops
