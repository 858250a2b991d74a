// Paged attention on the CPU: KV store, then attention of every request's new tokens over its pages, read where
// they lie (no gather copy). Shapes and metadata as in hybrid_ops/metadata.py:
//   q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] (any strides); k_cache [num_pages, page_size, Hkv, D], v_cache
//   [num_pages, page_size, Hkv, Dv] contiguous (v_cache: or the leading Dv values of a contiguous tensor's rows, MLA's
//   latent cache); cu_seqlens_q [B + 1], seq_lens [B], block_table [B, max_pages] int32;
//   out [T, Hq, Dv]; sinks [Hq] float32 or none. q fp32, fp16 or bf16; caches in q's dtype,
//   or fp8 (float8_e4m3fn, float8_e5m2) holding saturate(x / scale) with one fp32 scale per kv head for k and for v
//   (hybrid_ops/fp8.py); softmax and accumulation in fp32.
//
// Work is cut into units (request, kv heads, block of query tokens, slice of keys), taken by the threads of
// at::parallel_for from a shared counter, since units differ in length (schedule.h). One unit keeps the query rows of
// its kv heads' groups (tokens x GQA group) and streams its keys in tiles: each K/V row is loaded once per tile and
// serves every query row of its group (online softmax, fp32 accumulation; unit.cpp). Few rows per kv head (decode,
// short verify) take dot products over tiles of BLOCK_N keys read in place, a unit taking every kv head and reading
// runs of positions in order, over bf16 caches in bf16 pairs where the CPU has AVX512-BF16 (attend_inplace.cpp). Many
// rows (prefill) take ATen's brgemm (oneDNN) per kv head over tiles of GEMM_BLOCK_N keys packed in fp32, or in the
// cache's 16-bit type on AMX: by the unit, or once for all the query blocks of a request (attend_brgemm.cpp). fp8 rows
// are read in place one byte per element and widened in registers; their scales apply to the query rows or scores (k)
// and to the output (v) (fp8.h). A request with one block of queries (decode, verify, a short chunk over a long prefix)
// splits its keys into slices, merged by log-sum-exp, so a batch of one still uses several cores. The slicing depends
// on the request alone, so a request's result is the same in any batch and on any number of threads.
//
// The metadata's values are checked first (before anything is written); on bad values `paged_attention` returns an
// undefined tensor (None in Python) and the caller reports which value is wrong. This file turns the tensors into the
// pointers the other files take (kernel.h), stores the new k and v (kv_store.cpp), then runs the schedule's pack jobs,
// units and merges, for each pair of q's and the caches' element types.

#include "paged_attention.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstring>
#include <memory>
#include <vector>

#include "kernel.h"
#include "parallel.h"

namespace hybrid_ops::cpu {
namespace {

// Views of contiguous metadata tensors, and of a contiguous tree mask [T, Q] bool (a byte a value), or undefined.
Metadata metadata_of(const at::Tensor& cu, const at::Tensor& lens, const at::Tensor& table, const at::Tensor& tree) {
  Metadata md{.cu = cu.data_ptr<int32_t>(),
              .lens = lens.data_ptr<int32_t>(),
              .table = table.data_ptr<int32_t>(),
              .table_stride = table.size(1),
              .width = table.size(1),
              .num_requests = lens.size(0)};
  if (tree.defined()) {
    md.tree = tree.data_ptr<bool>();
    md.tree_stride = tree.size(1);
    md.tree_width = tree.size(1);
  }
  return md;
}

// A scale argument as [Hkv] values: [], [1] or [Hkv] float32 (any stride), or none (1).
std::vector<float> per_head(const std::optional<at::Tensor>& kv_scale, int64_t num_kv_heads) {
  std::vector<float> out(num_kv_heads, 1.f);
  if (!kv_scale) return out;
  const float* p = kv_scale->data_ptr<float>();
  const int64_t stride = kv_scale->numel() == 1 ? 0 : kv_scale->stride(0);
  for (int64_t h = 0; h < num_kv_heads; ++h) out[h] = p[h * stride];
  return out;
}

// Few-rows units read K/V rows in place, and take every kv head, when both head dims are whole vectors.
ScheduleParams schedule_params(int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t v_head_dim,
                               int64_t window, int64_t chunk, int64_t gemm_rows) {
  return {.num_kv_heads = num_kv_heads,
          .group = group,
          .rows_in_place = head_dim % VEC == 0 && v_head_dim % VEC == 0,
          .window = window,
          .chunk = chunk,
          .gemm_rows = gemm_rows};
}

// Scales and the cache's dtype (C) as in paged_attention.
template <typename T, typename C>
at::Tensor forward_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                         at::Tensor& v_cache, const Metadata& md, double scale, int64_t window, double logit_cap,
                         const std::optional<at::Tensor>& sinks, int64_t chunk,
                         const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const int64_t num_tokens = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2), v_head_dim = v.size(2);
  const int64_t page_size = k_cache.size(1), num_kv_heads = k_cache.size(2), group = num_q_heads / num_kv_heads;
  auto out = at::empty({num_tokens, num_q_heads, v_head_dim}, q.options());
  if (num_tokens == 0) return out;

  const int64_t gemm_rows = amx_available<T, C>() ? GEMM_ROWS_AMX : GEMM_ROWS;
  const Schedule work =
      schedule(md, schedule_params(num_kv_heads, group, head_dim, v_head_dim, window, chunk, gemm_rows));
  const std::vector<float> k_scales = per_head(k_scale, num_kv_heads), v_scales = per_head(v_scale, num_kv_heads);
  store_kv<T, C>({.src = k.data_ptr<T>(),
                  .src_strides = {k.stride(0), k.stride(1), k.stride(2)},
                  .cache = k_cache.data_ptr<C>(),
                  .dim = head_dim,
                  .head_stride = k_cache.stride(2),
                  .kv_scale = k_scales.data()},
                 {.src = v.data_ptr<T>(),
                  .src_strides = {v.stride(0), v.stride(1), v.stride(2)},
                  .cache = v_cache.data_ptr<C>(),
                  .dim = v_head_dim,
                  .head_stride = v_cache.stride(2),
                  .kv_scale = v_scales.data()},
                 md, page_size, num_kv_heads);

  std::vector<float> sink_logits;
  if (sinks) {
    const auto values = sinks->contiguous();
    sink_logits.assign(values.data_ptr<float>(), values.data_ptr<float>() + num_q_heads);
  }
  const int64_t padded_dim = round_up(head_dim, VEC), v_padded_dim = round_up(v_head_dim, VEC);
  auto partial_out = at::empty({work.partial_rows, v_head_dim}, q.options().dtype(at::kFloat));
  auto partial_lse = at::empty({work.partial_rows}, q.options().dtype(at::kFloat));
  auto packed = at::empty({static_cast<int64_t>(work.pack_jobs.size()) * GEMM_BLOCK_N * (padded_dim + v_padded_dim)},
                          q.options().dtype(amx_available<T, C>() ? q.scalar_type() : at::kFloat));
  const Problem<T, C> pb{.q = q.data_ptr<T>(),
                         .k_cache = k_cache.data_ptr<C>(),
                         .v_cache = v_cache.data_ptr<C>(),
                         .out = out.data_ptr<T>(),
                         .partial_out = partial_out.data_ptr<float>(),
                         .partial_lse = partial_lse.data_ptr<float>(),
                         .k_scale = k_scales.data(),
                         .v_scale = v_scales.data(),
                         .sinks = sinks ? sink_logits.data() : nullptr,
                         .packed = packed.data_ptr(),
                         .md = md,
                         .q_strides = {q.stride(0), q.stride(1), q.stride(2)},
                         .page_size = page_size,
                         .num_kv_heads = num_kv_heads,
                         .group = group,
                         .head_dim = head_dim,
                         .padded_dim = padded_dim,
                         .v_head_dim = v_head_dim,
                         .v_padded_dim = v_padded_dim,
                         .k_head_stride = k_cache.stride(2),
                         .v_head_stride = v_cache.stride(2),
                         .scale = static_cast<float>(scale),
                         .logit_cap = static_cast<float>(logit_cap),
                         .window = window,
                         .chunk = chunk,
                         .gemm_rows = gemm_rows};
  std::vector<std::unique_ptr<Scratch<T, C>>> scratch(at::get_num_threads());
  const auto thread_scratch = [&]() -> Scratch<T, C>& {
    auto& s = scratch[at::get_thread_num()];
    if (!s) s = std::make_unique<Scratch<T, C>>(work.max_rows, work.max_gemm_rows, padded_dim, v_padded_dim);
    return *s;
  };
  const auto& jobs = work.pack_jobs;
  parallel_dynamic(static_cast<int64_t>(jobs.size()), [&](int64_t i) { pack(pb, jobs[i], i, thread_scratch()); });
  const int64_t num_units = static_cast<int64_t>(work.units.size());
  parallel_dynamic_ahead(num_units, [&](int64_t i, int64_t following) {
    run_unit(pb, work.units[i], thread_scratch(), following < num_units ? &work.units[following] : nullptr);
  });
  // parallel_for returns when every unit is done: the merges read finished slices.
  parallel_dynamic(static_cast<int64_t>(work.merges.size()), [&](int64_t i) { run_merge(pb, work.merges[i]); });
  return out;
}

template <typename X>
struct Of {
  using type = X;
};

// Items of a struct of int64_t fields as the rows of an int64 tensor, their fields in order.
template <typename S>
at::Tensor as_rows(const std::vector<S>& items) {
  static_assert(std::is_standard_layout_v<S> && sizeof(S) % sizeof(int64_t) == 0);
  auto out = at::empty({static_cast<int64_t>(items.size()), static_cast<int64_t>(sizeof(S) / sizeof(int64_t))},
                       at::TensorOptions().dtype(at::kLong));
  std::memcpy(out.data_ptr<int64_t>(), items.data(), items.size() * sizeof(S));
  return out;
}

}  // namespace
}  // namespace hybrid_ops::cpu

namespace hybrid_ops {

using cpu::Of;

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                           const at::Tensor& block_table, double scale, int64_t window, double logit_cap,
                           const std::optional<at::Tensor>& sinks, int64_t attention_chunk, bool decode,
                           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                           const std::optional<at::Tensor>& tree_mask) {
  const auto cu = cu_seqlens_q.contiguous(), lens = seq_lens.contiguous(), table = block_table.contiguous();
  const auto tree = tree_mask ? tree_mask->contiguous() : at::Tensor();
  cpu::Metadata md = cpu::metadata_of(cu, lens, table, tree);
  // Each new token's depth in a tree, computed once for every unit.
  if (!cpu::metadata_ok(md, q.size(0), k_cache.size(0), k_cache.size(1), decode)) return at::Tensor();
  const std::vector<int32_t> depth = tree.defined() ? cpu::tree_depths(md, q.size(0)) : std::vector<int32_t>();
  if (tree.defined()) md.depth = depth.data();
  // q's element type, then the caches': q's or fp8.
  const auto with_cache = [&](auto q_type) -> at::Tensor {
    using T = typename decltype(q_type)::type;
    const auto run = [&](auto cache_type) {
      return cpu::forward_typed<T, typename decltype(cache_type)::type>(
          q, k, v, k_cache, v_cache, md, scale, window, logit_cap, sinks, attention_chunk, k_scale, v_scale);
    };
    switch (k_cache.scalar_type()) {
      case at::kFloat8_e4m3fn:
        return run(Of<at::Float8_e4m3fn>());
      case at::kFloat8_e5m2:
        return run(Of<at::Float8_e5m2>());
      default:
        TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "the caches must have q's dtype or be fp8");
        return run(Of<T>());
    }
  };
  switch (q.scalar_type()) {
    case at::kFloat:
      return with_cache(Of<float>());
    case at::kHalf:
      return with_cache(Of<at::Half>());
    case at::kBFloat16:
      return with_cache(Of<at::BFloat16>());
    default:
      TORCH_CHECK(false, "q must be float32, float16 or bfloat16");
  }
}

bool multiplies_in_cache_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf:
      return cpu::amx_available<at::Half, at::Half>();
    case at::kBFloat16:
      return cpu::amx_available<at::BFloat16, at::BFloat16>();
    default:
      return false;
  }
}

at::Tensor widen_fp8(const at::Tensor& codes, bool wide) {
  constexpr int64_t W = cpu::WIDE_VECS, step = W * cpu::VEC;
  static_assert(64 % step == 0);
  TORCH_CHECK(codes.dim() == 1 && codes.is_contiguous() && codes.numel() % 64 == 0,
              "widen_fp8 takes contiguous codes [n], n a multiple of 64");
  at::Tensor out = at::empty({codes.numel()}, codes.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  const auto widen = [&](const auto* src) {
    for (int64_t i = 0; i < codes.numel(); i += step) {
      cpu::Vec raw[W];
      if (wide) {
        cpu::load_raw_wide(src + i, raw);
      } else {
        for (int64_t v = 0; v < W; ++v) raw[v] = cpu::load_raw(src + i + v * cpu::VEC);
      }
      for (int64_t v = 0; v < W; ++v) raw[v].store(dst + i + v * cpu::VEC);
    }
  };
  if (codes.scalar_type() == at::kFloat8_e4m3fn) {
    widen(codes.data_ptr<at::Float8_e4m3fn>());
  } else {
    TORCH_CHECK(codes.scalar_type() == at::kFloat8_e5m2, "widen_fp8 takes float8_e4m3fn or float8_e5m2 codes");
    widen(codes.data_ptr<at::Float8_e5m2>());
  }
  return out;
}

int64_t fp8_wide_vecs() { return cpu::WIDE_VECS; }

bool bf16_pairs() { return cpu::BF16_PAIRS; }

bool metadata_values_ok(const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& block_table,
                        int64_t num_tokens, int64_t num_pages, int64_t page_size, bool decode,
                        const std::optional<at::Tensor>& tree_mask) {
  const auto cu = cu_seqlens_q.contiguous(), lens = seq_lens.contiguous(), table = block_table.contiguous();
  const auto tree = tree_mask ? tree_mask->contiguous() : at::Tensor();
  return cpu::metadata_ok(cpu::metadata_of(cu, lens, table, tree), num_tokens, num_pages, page_size, decode);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> work_schedule(const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                                                             int64_t num_kv_heads, int64_t group, int64_t head_dim,
                                                             int64_t v_head_dim, int64_t window,
                                                             int64_t attention_chunk, int64_t gemm_rows) {
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt && cu_seqlens_q.dim() == 1 &&
                  seq_lens.dim() == 1 && cu_seqlens_q.size(0) == seq_lens.size(0) + 1,
              "cu_seqlens_q [B + 1] and seq_lens [B] must be int32");
  TORCH_CHECK(num_kv_heads > 0 && group > 0 && head_dim > 0 && v_head_dim > 0, "sizes must be positive");
  const auto cu = cu_seqlens_q.contiguous(), lens = seq_lens.contiguous();
  const cpu::Metadata md{.cu = cu.data_ptr<int32_t>(),
                         .lens = lens.data_ptr<int32_t>(),
                         .table = nullptr,
                         .table_stride = 0,
                         .width = 0,
                         .num_requests = lens.size(0)};
  TORCH_CHECK(md.cu[0] == 0, "cu_seqlens_q[0] must be 0");
  for (int64_t i = 0; i < md.num_requests; ++i) {
    TORCH_CHECK(md.cu[i + 1] >= md.cu[i] && md.lens[i] >= md.cu[i + 1] - md.cu[i],
                "each request needs a query length in [0, seq_lens]");
  }
  const cpu::Schedule work = cpu::schedule(
      md, cpu::schedule_params(num_kv_heads, group, head_dim, v_head_dim, window, attention_chunk, gemm_rows));
  return {cpu::as_rows(work.units), cpu::as_rows(work.merges), cpu::as_rows(work.pack_jobs)};
}

}  // namespace hybrid_ops
