// The work of a call, from the metadata alone: units (request, kv heads, block of query tokens, slice of keys), taken
// by the threads of at::parallel_for from a shared counter since units differ in length; the tiles of keys packed
// before them; and the merges of split requests. A request with one block of queries (decode, verify, a short chunk
// over a long prefix) splits its keys into slices, merged by log-sum-exp, so a batch of one still uses several cores.
// The slicing depends on the request alone, so a request's result is the same in any batch and on any number of
// threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace hybrid_ops::cpu {

constexpr int64_t BLOCK_N = 64;              // keys per tile of few-rows units (a multiple of VEC)
constexpr int64_t KV_SPLIT = 512;            // keys per slice of a request with one query block (a multiple of BLOCK_N)
constexpr int64_t KV_SPLIT_ALL_HEADS = 256;  // the same for a unit of every kv head
constexpr int64_t BLOCK_ROWS = 512;          // query rows (tokens x group) per unit of a longer prefill
// From this many query rows per kv head a unit's products go through brgemm (attend_brgemm.cpp), else dot products
// over rows read in place: 16 where 16-bit rows multiply on AMX; 128 otherwise, below which the dot products beat
// brgemm without AMX (D 128 and MLA's 576 alike).
constexpr int64_t GEMM_ROWS_AMX = 16;
constexpr int64_t GEMM_ROWS = 128;
constexpr int64_t GEMM_BLOCK_N = 256;  // keys per tile of the brgemm path

// Views of contiguous metadata tensors: cu_seqlens_q [B + 1], seq_lens [B], block_table [B, width]; and of a tree
// (tree_mask [T, tree_width] bool, rows tree_stride apart) with each new token's depth in it [T] (`tree_depths`), or
// null: causal.
struct Metadata {
  const int32_t* cu;
  const int32_t* lens;
  const int32_t* table;
  int64_t table_stride, width, num_requests;  // table_stride: elements between rows
  const bool* tree = nullptr;
  int64_t tree_stride = 0, tree_width = 0;
  const int32_t* depth = nullptr;

  // New token j (token t of the batch) of a request counts its position from the prefix: j, or its depth in a tree.
  int64_t depth_of(int64_t t, int64_t j) const { return depth ? depth[t] : j; }
};

struct MetadataValues;  // value_checks.h

// The metadata's values as validation.py's rows read them (MetadataValues: the fields of md, num_tokens and decode).
MetadataValues values_of(const Metadata& md, int64_t num_tokens, bool decode);

// validation.py's LENGTH_VALUES, PAGE_VALUES and, where md has a tree, TREE_VALUES: cu_seqlens_q from 0 to num_tokens,
// non-decreasing; each request's length at least its new tokens and within its table row, the ids of its pages in
// [0, num_pages); one query length for every request when `decode`. Nothing is read or written out of bounds after it.
bool metadata_ok(const Metadata& md, int64_t num_tokens, int64_t num_pages, int64_t page_size, bool decode);

// Each new token's depth in a tree that metadata_ok accepted: the number of earlier new tokens its row names.
std::vector<int32_t> tree_depths(const Metadata& md, int64_t num_tokens);

// The first key that a query at position pos sees: from its window's start and its chunk's (attention_chunk).
inline int64_t first_key(int64_t pos, int64_t window, int64_t chunk) {
  const int64_t from = window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0;
  return chunk > 0 ? std::max(from, pos - pos % chunk) : from;
}

// Fields of int64_t only (the Python module reads the schedule as rows of them).
struct Unit {
  int64_t request, head, num_heads;  // kv heads head .. head + num_heads - 1
  int64_t t0, num_tokens;            // query tokens t0 .. t0 + num_tokens - 1 of the request
  int64_t lo, hi;                    // keys [lo, hi) of the request
  int64_t partial;                   // first row in the split partials, or -1: write the output directly
  int64_t packed, packed_from;       // its packed tile of keys [packed_from, + GEMM_BLOCK_N), or -1: packs its own
};

// A tile of keys [j0, j0 + n) of a request's kv head, packed before the units; the i-th job's tile is the i-th of
// Problem::packed.
struct PackJob {
  int64_t request, head, j0, n;
};

// One kv head's rows of a request's slices: slice s's rows start at partial + s * split_stride.
struct Merge {
  int64_t request, head, num_tokens, num_splits, partial, split_stride;
};

// What the schedule depends on besides the metadata. rows_in_place: the head dims are whole vectors, so few-rows
// units read K/V rows in place and take every kv head. gemm_rows: GEMM_ROWS_AMX or GEMM_ROWS.
struct ScheduleParams {
  int64_t num_kv_heads, group;
  bool rows_in_place;
  int64_t window, chunk, gemm_rows;
};

struct Schedule {
  std::vector<Unit> units;
  std::vector<Merge> merges;
  std::vector<PackJob> pack_jobs;
  int64_t partial_rows = 0;   // rows of the split partials
  int64_t max_rows = 0;       // the most query rows of a unit
  int64_t max_gemm_rows = 0;  // of a unit whose products go through brgemm (0: none)
  int64_t gemm_rows = 0;      // ScheduleParams::gemm_rows
};

// The schedule of requests whose cu_seqlens_q and seq_lens metadata_ok accepted (the block table is not read; a
// tree's depths bound its query blocks' first keys).
Schedule schedule(const Metadata& md, const ScheduleParams& params);

}  // namespace hybrid_ops::cpu
