// The native CPU kernel (paged_attention.cpp), shared by its two entry points (dispatch.cpp): the dispatcher's CPU
// kernels of the hybrid ops, and the Python module's `forward`.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace hybrid_ops {

// Stores k [T, Hkv, D], v [T, Hkv, Dv] into the caches [num_pages, page_size, Hkv, D or Dv], then returns the
// attention [T, Hq, Dv] of q [T, Hq, D] over each request's pages. Arguments as the ops' (checked by the caller), scale
// resolved; sinks [Hq] float32 or none, attention_chunk -1 or positive; `decode`: every request has the same query
// length. Caches in q's dtype (fp32, fp16, bf16), or both fp8 (float8_e4m3fn, float8_e5m2) with
// k_scale, v_scale: [], [1] or [Hkv] float32, any strides (none: 1). tree_mask: [T, Q] bool or none (causal), as the
// ops take it (hybrid_ops/ops.py). Returns an undefined tensor, having written nothing, when the metadata's values
// (a tree's included) are invalid.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                           const at::Tensor& block_table, double scale, int64_t window, double logit_cap,
                           const std::optional<at::Tensor>& sinks, int64_t attention_chunk, bool decode,
                           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                           const std::optional<at::Tensor>& tree_mask);

// Whether many query rows over a cache of `dtype` multiply in that dtype (16-bit brgemm on AMX), not in fp32.
bool multiplies_in_cache_dtype(at::ScalarType dtype);

// fp8 codes [n] (float8_e4m3fn or float8_e5m2, n a multiple of 64) widened as the few-rows units widen them, to their
// raw values [n] float32 (fp8.h): by the wide load (`wide`: 64 at a time, by byte look-ups where the build has
// AVX512-VBMI) or by load_raw, 16 at a time; for tests.
at::Tensor widen_fp8(const at::Tensor& codes, bool wide);

// Vectors that the wide load of fp8 codes fills: 4 where the build widens by byte look-ups (AVX512-VBMI), else 1.
int64_t fp8_wide_vecs();

// Whether few rows over bf16 caches multiply bf16 pairs (AVX512-BF16's vdpbf16ps), else fp32 FMAs.
bool bf16_pairs();

// cpu::metadata_ok (the rows of validation.check_metadata_values) over tensors, for metadata whose shapes and dtypes
// the entry points' checks passed; for tests.
bool metadata_values_ok(const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& block_table,
                        int64_t num_tokens, int64_t num_pages, int64_t page_size, bool decode,
                        const std::optional<at::Tensor>& tree_mask);

// The kernel's work for requests of cu_seqlens_q [B + 1] and seq_lens [B] int32 (schedule.h), for tests: int64 rows of
// its units, merges and pack jobs, each row the fields of a Unit, Merge or PackJob in order; gemm_rows as
// ScheduleParams'.
std::tuple<at::Tensor, at::Tensor, at::Tensor> work_schedule(const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                                                             int64_t num_kv_heads, int64_t group, int64_t head_dim,
                                                             int64_t v_head_dim, int64_t window,
                                                             int64_t attention_chunk, int64_t gemm_rows);

}  // namespace hybrid_ops
