#include "schedule.h"

#include "value_checks.h"  // generated from hybrid_ops/validation.py's rows when the kernels build

namespace hybrid_ops::cpu {

MetadataValues values_of(const Metadata& md, int64_t num_tokens, bool decode) {
  return {.cu = {md.cu},
          .lens = {md.lens},
          .table = {md.table, md.table_stride},
          .tree = {md.tree, md.tree_stride},
          .num_requests = md.num_requests,
          .num_tokens = num_tokens,
          .width = md.width,
          .tree_width = md.tree_width,
          .decode = decode};
}

bool metadata_ok(const Metadata& md, int64_t num_tokens, int64_t num_pages, int64_t page_size, bool decode) {
  MetadataValues values = values_of(md, num_tokens, decode);
  values.num_pages = num_pages;
  values.page_size = page_size;
  return length_values_ok(values) && page_values_ok(values) && (!md.tree || tree_values_ok(values));
}

std::vector<int32_t> tree_depths(const Metadata& md, int64_t num_tokens) {
  std::vector<int32_t> depth(num_tokens);
  for (int64_t i = 0; i < md.num_requests; ++i) {
    for (int64_t t = md.cu[i]; t < md.cu[i + 1]; ++t) {
      const bool* row = md.tree + t * md.tree_stride;
      depth[t] = static_cast<int32_t>(std::count(row, row + (t - md.cu[i]), true));
    }
  }
  return depth;
}

Schedule schedule(const Metadata& md, const ScheduleParams& params) {
  const int64_t num_kv_heads = params.num_kv_heads, group = params.group;
  const int64_t block_tokens = std::max<int64_t>(1, BLOCK_ROWS / group);
  Schedule out;
  out.gemm_rows = params.gemm_rows;
  for (int64_t i = 0; i < md.num_requests; ++i) {
    const int64_t q_len = md.cu[i + 1] - md.cu[i], len = md.lens[i], prefix = len - q_len;
    // A block of nt queries from token t0 sees keys from its lowest position's first key on (first_key rises with the
    // position): its first token's, t0, unless a tree puts a later one lower.
    const auto block_first_key = [&](int64_t t0, int64_t nt) {
      int64_t depth = t0;
      for (int64_t t = md.cu[i] + t0; md.depth && t < md.cu[i] + t0 + nt; ++t)
        depth = std::min<int64_t>(depth, md.depth[t]);
      return first_key(prefix + depth, params.window, params.chunk);
    };
    // Several query blocks (the first through brgemm) share their keys: each kv head's tiles are packed once, from
    // the tile of the first block's first key (token 0, at depth 0: no block's is lower).
    const int64_t packed_from = block_first_key(0, 1) / GEMM_BLOCK_N * GEMM_BLOCK_N;
    const int64_t num_tiles = (len - packed_from + GEMM_BLOCK_N - 1) / GEMM_BLOCK_N;
    const int64_t packed = q_len > block_tokens ? static_cast<int64_t>(out.pack_jobs.size()) : -1;
    for (int64_t h = 0; packed >= 0 && h < num_kv_heads; ++h) {
      for (int64_t t = 0; t < num_tiles; ++t) {
        const int64_t j0 = packed_from + t * GEMM_BLOCK_N;
        out.pack_jobs.push_back({.request = i, .head = h, .j0 = j0, .n = std::min(GEMM_BLOCK_N, len - j0)});
      }
    }
    for (int64_t t0 = 0; t0 < q_len; t0 += block_tokens) {
      const int64_t nt = std::min(block_tokens, q_len - t0), lo = block_first_key(t0, nt), hi = prefix + t0 + nt;
      // Few rows per kv head, whole-vector rows: a unit takes every kv head, so that it reads each position's
      // Hkv * D elements together (one stream per page); else a unit per kv head.
      const int64_t rows = nt * group;
      const int64_t heads = rows < params.gemm_rows && params.rows_in_place ? num_kv_heads : 1;
      const int64_t split = heads > 1 ? KV_SPLIT_ALL_HEADS : KV_SPLIT;
      const int64_t splits = q_len <= block_tokens ? (hi - lo + split - 1) / split : 1;
      out.max_rows = std::max(out.max_rows, heads * rows);
      if (rows >= params.gemm_rows) out.max_gemm_rows = std::max(out.max_gemm_rows, rows);
      for (int64_t h = 0; h < num_kv_heads; h += heads) {
        Unit u{.request = i,
               .head = h,
               .num_heads = heads,
               .t0 = t0,
               .num_tokens = nt,
               .lo = lo,
               .hi = hi,
               .partial = -1,
               .packed = -1,
               .packed_from = packed_from};
        if (splits <= 1) {
          if (packed >= 0 && rows >= params.gemm_rows) u.packed = packed + h * num_tiles;
          out.units.push_back(u);
          continue;
        }
        for (int64_t g = 0; g < heads; ++g) {
          out.merges.push_back({.request = i,
                                .head = h + g,
                                .num_tokens = nt,
                                .num_splits = splits,
                                .partial = out.partial_rows + g * rows,
                                .split_stride = heads * rows});
        }
        for (int64_t sp = 0; sp < splits; ++sp) {
          u.lo = lo + sp * split;
          u.hi = std::min(hi, lo + (sp + 1) * split);
          u.partial = out.partial_rows;
          out.units.push_back(u);
          out.partial_rows += heads * rows;
        }
      }
    }
  }
  return out;
}

}  // namespace hybrid_ops::cpu
