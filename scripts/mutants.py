"""Mutation check: small deliberate bugs, each applied alone to a temporary copy of the repository, where the
tests selected for it must fail.

    python scripts/mutants.py                  # every mutant; exit 1 if one survives or its anchor is stale
    python scripts/mutants.py -k truncate      # the mutants whose name contains "truncate" (a regex: "a|b")
    python scripts/mutants.py --list           # the table, without running anything
    python scripts/mutants.py -k capture --tests tests/test_sglang.py \
        -- --deselect tests/test_sglang.py::test_capture_metadata
                                               # other tests than the table's; arguments after -- go to pytest
                                               # (here: does anything else in the file catch it?)

Each row of MUTANTS names a file, a text that must occur in it exactly once, the text that replaces it, and the
tests (pytest arguments) that must catch the change: fail on an assertion or an error the code raises (`CAUGHT_ON`;
a crash, a collection error or a timeout is reported as an error, not caught). Edit the table when the code moves: a
missing anchor is reported as stale and fails the check. Needs Python >= 3.11 (tomllib) and git.
"""

import argparse
import os
import queue
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tomllib
import torch

from hybrid_ops.backends.cpu import kernel_capability

ROOT = Path(__file__).resolve().parent.parent

Mutant = namedtuple("Mutant", "name file original mutated tests")
# Mutants of code that runs only on CPUs with AMX; with AVX512-VBMI (the AVX512_VBMI build).
AMX_ONLY = {"cpu_vnni_pairs_swapped"}
VBMI_ONLY = {"cpu_fp8_wide_load_drops_the_sign", "cpu_fp8_wide_load_places_the_next_value"}
M = Mutant
# fmt: off
MUTANTS = [
    # -- Triton kernels (tests/test_triton*.py) ----------------------------------------------------------------
    M("decode_reduce_averages_splits", "kernels/decode.py",
      "weight = tl.exp(lse - lse_max)",
      "weight = tl.where(lse > float('-inf'), 1.0, 0.0)",
      "tests/test_triton_tiles.py"),
    M("prefill_key_bound_ignores_tile", "kernels/prefill.py",
      "kv_hi = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)",
      "kv_hi = tl.minimum(seq_len, prefix + BLOCK_M)",
      "tests/test_triton_tiles.py"),
    M("online_softmax_never_rescales", "kernels/common.py",
      'acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="tf32x3")',
      'acc = acc + tl.dot(p.to(v.dtype), v, input_precision="tf32x3")',
      "tests/test_triton_tiles.py"),
    M("triton_fp8_store_truncates", "kernels/common.py",
      "(magnitude + ((1 << (SHIFT - 1)) - 1) + ((magnitude >> SHIFT) & 1)) >> SHIFT",
      "magnitude >> SHIFT",
      "tests/test_triton.py -k fp8"),
    M("triton_fp8_store_never_saturates", "kernels/common.py",
      "    magnitude = tl.minimum(magnitude, MAX_BITS)\n",
      "",
      "tests/test_triton.py -k fp8"),
    M("triton_fp8_decode_ignores_v_scale", "kernels/decode.py",
      "out *= tl.load(VScale + kv_head * stride_vs)",
      "out *= 1.0",
      "tests/test_triton.py -k fp8"),
    M("triton_fp8_prefill_k_scale_of_head_0", "kernels/prefill.py",
      "scale *= tl.load(KScale + kv_head * stride_ks)",
      "scale *= tl.load(KScale)",
      "tests/test_triton.py -k fp8"),
    M("triton_v_read_with_k_strides", "kernels/common.py",
      "v_offset = page * stride_vp + row * stride_vr + kv_head * stride_vh",
      "v_offset = page * stride_kp + row * stride_kr + kv_head * stride_kh",
      "tests/test_triton.py -k v_head_dim"),
    M("triton_decode_output_of_head_dim", "kernels/decode.py",
      "out = q.new_empty(num_tokens, num_q_heads, v_head_dim)",
      "out = q.new_empty(q.shape)",
      "tests/test_triton.py -k v_head_dim"),
    M("kv_store_writes_at_seq_len", "kernels/kv_store.py",
      "in_table = (pos >= 0) & (pos < seq_len) & (page_index < num_table_pages)",
      "in_table = (pos >= 0) & (pos <= seq_len) & (page_index < num_table_pages)",
      "tests/test_triton.py -k rows_past_the_last_request"),
    M("kv_store_writes_past_seq_len", "kernels/kv_store.py",
      "in_table = (pos >= 0) & (pos < seq_len) & (page_index < num_table_pages)",
      "in_table = (pos >= 0) & (page_index < num_table_pages)",
      "tests/test_triton.py -k rows_past_the_last_request"),
    M("triton_tree_bit_ignored", "kernels/common.py",
      "visible = visible & seen",
      "visible = visible",
      "tests/test_triton.py -k 'tree_prefill or tree_verify'"),
    M("triton_tree_diagonal_not_forced", "kernels/common.py",
      "seen = (col < 0)[None, :] | (pos[None, :] == q_pos[:, None])",
      "seen = (col < 0)[None, :]",
      "tests/test_triton.py -k 'tree_prefill or tree_verify'"),
    M("triton_tree_reads_on_and_above_the_diagonal", "kernels/common.py",
      "tree_mask & (torch.arange(width, device=device) < (tokens - first_token)[:, None])",
      "tree_mask",
      "tests/test_triton.py -k 'tree_prefill or tree_verify'"),
    M("triton_tree_tile_misses_its_last_word", "kernels/common.py",
      "for w in tl.static_range((BLOCK_N + 30) // 32 + 1):",
      "for w in tl.static_range((BLOCK_N + 30) // 32):",
      "tests/test_triton.py -k 'tree_prefill or tree_verify'"),
    M("triton_tree_boundary_tile_reads_no_word", "kernels/common.py",
      "readable = tl.where(start + BLOCK_N > prefix, num_words - first, 0)",
      "readable = tl.where(start >= prefix, num_words - first, 0)",
      "tests/test_triton.py -k 'tree_prefill or tree_verify'"),
    M("triton_tree_depth_positions_are_slots", "kernels/common.py",
      "positions = (prefix + bits.sum(1)).to(torch.int32)",
      "positions = (prefix + tokens - first_token).to(torch.int32)",
      "tests/test_triton.py -k 'tree_prefill or tree_verify'"),
    M("triton_tree_key_positions_are_slots", "kernels/common.py",
      "key_pos = tl.where(col >= 0, depth_pos, pos)",
      "key_pos = pos",
      "tests/test_triton.py -k 'tree_prefill or tree_verify'"),
    M("triton_tree_prefill_first_key_from_the_first_row", "kernels/prefill.py",
      "first_pos = tl.min(tl.where(row_ok, row_pos, first_pos))",
      "first_pos = first_pos",
      "tests/test_triton.py -k 'tree_prefill or tree_verify'"),
    M("triton_tree_decode_key_positions_of_request_0", "kernels/decode.py",
      "Positions, request * q_len, q_len * tl.num_programs(0),",
      "Positions, 0, q_len * tl.num_programs(0),",
      "tests/test_triton.py -k 'tree_prefill or tree_verify'"),
    # -- Triton state kernels (tests/test_state_ops.py, tests/test_state_triton.py) ------------------------------
    M("triton_delta_rule_drops_the_decay", "kernels/gated_delta_rule.py",
      "            s = s * tl.exp(tl.load(G + t * stride_gt + head * stride_gh))\n",
      "            s = s\n",
      "tests/test_state_ops.py -k 'test_gated_delta_rule_shapes and triton and grouped'"),
    M("triton_delta_rule_final_state_off_by_a_thousandth", "kernels/gated_delta_rule.py",
      "tl.store(slot_state, s, mask=tl.where(held & (n > 0), tile_ok, False))",
      "tl.store(slot_state, s * 1.001, mask=tl.where(held & (n > 0), tile_ok, False))",
      "tests/test_state_triton.py -k 'gpu_tiles and delta-prefix'"),
    M("triton_state_tree_read_as_a_chain", "kernels/common.py",
      "    return tl.max(tl.where(seen != 0, c, -1), 0)\n",
      "    return tl.max(tl.where(seen != 0, c, -1), 0) * 0 + j - 1\n",
      "tests/test_state_triton.py -k 'gpu_tiles and tree'"),
    M("triton_conv_prefix_rows_shifted", "kernels/causal_conv1d.py",
      "prefix_rows[None, :] + (WIDTH - 1 + index)[:, None] * stride_sr",
      "prefix_rows[None, :] + (WIDTH - 2 + index)[:, None] * stride_sr",
      "tests/test_state_ops.py -k 'test_causal_conv1d_widths and triton'"),
    M("triton_scan_padding_writes_slot_0", "kernels/selective_scan.py",
      "tl.store(slot_state, s, mask=tl.where(held & (n > 0), tile_ok, False))",
      "tl.store(slot_state, s, mask=tl.where(n > 0, tile_ok, False))",
      "tests/test_state_triton.py -k 'slots_out_of_range and mamba'"),
    # -- native CPU backend: kernel and C++ entry points (tests/test_cpu.py; each mutant is a ~20 s build) ----------
    M("cpu_merge_averages_slices", "kernels/cpu/unit.cpp",
      "const float w = std::exp(pb.partial_lse[row] - mx);",
      "const float w = 1.f;",
      "tests/test_cpu.py -k long_contexts"),
    M("cpu_brgemm_chunk_keys_from_its_first_row", "kernels/cpu/attend_brgemm.cpp",
      "const int64_t seen = visible(s, r1 - 1, j0, n).second",
      "const int64_t seen = visible(s, r0, j0, n).second",
      "tests/test_cpu.py -k long_contexts"),
    M("cpu_packed_tiles_read_from_the_units_first_key", "kernels/cpu/attend_brgemm.cpp",
      "u.packed_from + (u.lo - u.packed_from) / GEMM_BLOCK_N * GEMM_BLOCK_N;",
      "u.lo;",
      "tests/test_cpu.py -k long_contexts"),
    M("cpu_page_passes_skip_a_position", "kernels/cpu/attend_inplace.cpp",
      "for (int64_t p = 0; p < per_page; ++p) fn(j + p, jb, per_page);",
      "for (int64_t p = 1; p < per_page; ++p) fn(j + p, jb, per_page);",
      "tests/test_cpu.py -k long_contexts"),
    M("cpu_strided_scores_in_key_order", "kernels/cpu/attend_inplace.cpp",
      "scores[r * BLOCK_N + j + c * ks] = hsum(acc[r][c]);",
      "scores[r * BLOCK_N + j + c] = hsum(acc[r][c]);",
      "tests/test_cpu.py -k long_contexts"),
    M("cpu_vnni_pairs_swapped", "kernels/cpu/attend_brgemm.cpp",
      "dst[d] = lo[d] | (static_cast<uint32_t>(hi[d]) << 16 & hi_mask);",
      "dst[d] = hi[d] | (static_cast<uint32_t>(lo[d]) << 16 & hi_mask);",
      "tests/test_cpu.py -k long_contexts"),
    M("cpu_all_heads_units_read_one_heads_values", "kernels/cpu/attend_inplace.cpp",
      "offset = h * pb.v_head_stride;",
      "offset = 0;",
      "tests/test_cpu.py -k long_contexts"),
    M("cpu_values_at_the_keys_head_dim", "kernels/cpu/attend_inplace.cpp",
      "offset = h * pb.v_head_stride;",
      "offset = h * pb.k_head_stride;",
      "tests/test_cpu.py -k long_contexts"),
    M("cpu_sinks_ignored", "kernels/cpu/unit.cpp",
      "const float sink = pb.sinks ? std::exp(pb.sinks[q_rows.q_head(r)] - s.m[r]) : 0.f;",
      "const float sink = 0.f;",
      "tests/test_cpu.py -k long_contexts"),
    M("cpu_merge_ignores_sinks", "kernels/cpu/unit.cpp",
      "if (pb.sinks && total > 0) total += std::exp(pb.sinks[q_head] - mx);",
      "",
      "tests/test_cpu.py -k long_contexts"),
    M("cpu_chunks_ignored", "kernels/cpu/schedule.h",
      "return chunk > 0 ? std::max(from, pos - pos % chunk) : from;",
      "return from;",
      "tests/test_cpu.py -k long_contexts"),
    M("cpu_fp8_ignores_v_scale", "kernels/cpu/unit.cpp",
      "const float v_factor = pb.v_scale[q_rows.kv_head(r)] * raw;",
      "const float v_factor = raw;",
      "tests/test_cpu.py -k fp8"),
    M("cpu_fp8_store_skips_saturation", "kernels/cpu/fp8.h",
      "at::vec::clamp(Vec::loadu(x + i) / scale, -limit, limit)",
      "Vec::loadu(x + i) / scale",
      "tests/test_cpu.py -k fp8"),
    M("cpu_fp8_store_rounds_ties_down", "kernels/cpu/fp8.h",
      "(magnitude + rounding + ((magnitude >> shift) & one)) >> shift",
      "(magnitude + rounding) >> shift",
      "tests/test_cpu.py -k fp8"),
    M("cpu_fp8_wide_load_drops_the_sign", "kernels/cpu/fp8.h",
      "high[i] = raw_bits<C>(i << high_shift & 0xFF) >> 24;",
      "high[i] = raw_bits<C>(i << high_shift & 0x7F) >> 24;",
      "tests/test_cpu.py -k 'wide or vbmi'"),
    M("cpu_fp8_wide_load_places_the_next_value", "kernels/cpu/fp8.h",
      "i % 4 == 2 ? 16 * v + i / 4 :",
      "i % 4 == 2 ? 16 * v + i / 4 + 1 :",
      "tests/test_cpu.py -k 'wide or vbmi'"),
    M("cpu_fp8_all_heads_units_take_the_first_heads_k_scale", "kernels/cpu/attend_inplace.cpp",
      "pb.scale * pb.k_scale[q_rows.kv_head(r)] * lifted<C>();",
      "pb.scale * pb.k_scale[u.head] * lifted<C>();",
      "tests/test_cpu.py -k fp8"),
    M("cpu_tree_bit_ignored", "kernels/cpu/unit.cpp",
      "(!row[c] || s.prefix + s.new_depth[c] < s.key_begin[r])",
      "(s.prefix + s.new_depth[c] < s.key_begin[r])",
      "tests/test_cpu.py -k trees_against"),
    M("cpu_tree_key_positions_are_slots", "kernels/cpu/unit.cpp",
      "s.prefix + s.new_depth[c] < s.key_begin[r]",
      "j0 + j < s.key_begin[r]",
      "tests/test_cpu.py -k trees_against"),
    M("cpu_tree_depth_positions_are_slots", "kernels/cpu/unit.cpp",
      "first_key(prefix + md.depth_of(t, j), pb.window, pb.chunk);",
      "first_key(prefix + j, pb.window, pb.chunk);",
      "tests/test_cpu.py -k trees_against"),
    M("cpu_tree_block_first_key_from_its_first_row", "kernels/cpu/schedule.cpp",
      "depth = std::min<int64_t>(depth, md.depth[t]);",
      "depth = md.depth[md.cu[i] + t0];",
      "tests/test_cpu.py -k trees_against"),
    M("cpu_tree_brgemm_chunk_first_key_from_its_first_row", "kernels/cpu/attend_brgemm.cpp",
      "*std::min_element(s.key_begin.begin() + r0, s.key_begin.begin() + r1);",
      "s.key_begin[r0];",
      "tests/test_cpu.py -k trees_against"),
    M("cpu_tree_hidden_tile_rows_take_exp", "kernels/cpu/unit.cpp",
      "    if (s.tile_max[r] == NEG_INF) b = a;",
      "",
      "tests/test_cpu.py -k trees_against"),
    M("cpu_tree_values_unchecked", "kernels/cpu/schedule.cpp",
      "    if (md.tree && !tree_rows_ok(md, md.cu[i], q_len)) return false;\n",
      "",
      "tests/test_errors.py -k tree"),
    M("entry_point_accepts_scales_without_fp8", "kernels/cpu/dispatch.cpp",
      "!(is_fp8(cache_dtype) && kv_scale_ok(o.k_scale, num_kv_heads)",
      "!(kv_scale_ok(o.k_scale, num_kv_heads)",
      "tests/test_checks.py"),
    M("entry_point_skips_gqa_check", "kernels/cpu/dispatch.cpp",
      "q.size(2) != k_cache.size(3) || q.size(1) % num_kv_heads != 0) {",
      "q.size(2) != k_cache.size(3)) {",
      "tests/test_cpu.py -k python"),
    M("entry_point_routes_verify_to_prefill", "kernels/cpu/dispatch.cpp",
      "return decode ? 1 : 0;",
      "return decode && mode != 5 ? 1 : 0;",
      "tests/test_cpu.py -k python"),
    M("entry_point_accepts_sinks_of_any_heads", "kernels/cpu/dispatch.cpp",
      "sinks->size(0) == q.size(1) &&",
      "",
      "tests/test_checks.py"),
    M("entry_point_accepts_any_v_cache", "kernels/cpu/dispatch.cpp",
      "v_cache.size(0) != k_cache.size(0) ||",
      "",
      "tests/test_checks.py"),
    M("entry_point_accepts_any_window", "kernels/cpu/dispatch.cpp",
      "(o.sliding_window == -1 || o.sliding_window > 0) &&",
      "",
      "tests/test_checks.py"),
    M("cpu_schedule_slice_ends_a_tile_early", "kernels/cpu/schedule.cpp",
      "u.hi = std::min(hi, lo + (sp + 1) * split);",
      "u.hi = std::min(hi, lo + (sp + 1) * split - BLOCK_N);",
      "tests/test_cpu_schedule.py"),
    M("kernel_metadata_check_skips_a_partly_filled_last_page", "kernels/cpu/schedule.cpp",
      "for (int64_t p = 0; p < (len + page_size - 1) / page_size; ++p) {",
      "for (int64_t p = 0; p < len / page_size; ++p) {",
      "tests/test_checks.py"),
    M("entry_point_keeps_auto_when_another_is_preferred", "hybrid_ops/backends/cpu.py",
      'names = ["cpu", "auto"] if registry.auto_order("cpu")[0] == "cpu" else ["cpu"]',
      'names = ["cpu", "auto"]',
      "tests/test_cpu.py -k preferred"),
    # -- validation ---------------------------------------------------------------------------------------------
    M("validation_skipped_for_masking_backends", "hybrid_ops/ops.py",
      "if validation_enabled() and not impl.checks_values:",
      "if validation_enabled() and impl.checks_values:",
      "tests/test_errors.py -k bad_values"),
    M("validation_capacity_off_by_a_page", "hybrid_ops/validation.py",
      "if length > capacity:",
      "if length > capacity + page_size:",
      "tests/test_errors.py -k bad_values"),
    # -- transformers integration -------------------------------------------------------------------------------
    M("transformers_drops_scaling", "hybrid_ops/integrations/transformers.py",
      "scale=scaling,",
      "scale=None,",
      "tests/test_transformers.py -k logits"),
    M("transformers_drops_scale_and_cap", "hybrid_ops/integrations/transformers.py",
      "scale=scaling,\n            sliding_window=sliding_window or -1,\n            logit_cap=softcap or 0.0,",
      "scale=None,\n            sliding_window=sliding_window or -1,\n            logit_cap=0.0,",
      "tests/test_transformers.py -k logits"),
    M("transformers_drops_cap_in_one_layer", "hybrid_ops/integrations/transformers.py",
      "logit_cap=softcap or 0.0,",
      "logit_cap=(softcap or 0.0) if layer != 2 else 0.0,",
      "tests/test_transformers.py -k logits"),
    M("transformers_drops_scale_in_one_layer", "hybrid_ops/integrations/transformers.py",
      "scale=scaling,",
      "scale=scaling if layer != 2 else None,",
      "tests/test_transformers.py -k logits"),
    M("transformers_drops_window", "hybrid_ops/integrations/transformers.py",
      "sliding_window=sliding_window or -1,",
      "sliding_window=-1,",
      "tests/test_transformers.py -k logits"),
    M("dense_attention_drops_cap", "hybrid_ops/integrations/transformers.py",
      "    if softcap:\n        scores = softcap",
      "    if False:\n        scores = softcap",
      "tests/test_transformers.py -k logits"),
    M("transformers_step_drops_the_tree", "hybrid_ops/integrations/transformers.py",
      "            tree_mask=step.tree_mask,\n",
      "",
      "tests/test_transformers.py -k tree_step"),
    # -- transformers integration: check_servable's refusals (tests/test_models.py) ------------------------------
    M("servable_accepts_bidirectional_attention", "hybrid_ops/integrations/transformers.py",
      "if not causal or key.shape[2] != query.shape[2]:",
      "if key.shape[2] != query.shape[2]:",
      "tests/test_models.py -k bidirectional"),
    M("servable_ignores_block_type_fields", "hybrid_ops/integrations/servable.py",
      "block_fields = [name for name in _BLOCK_TYPE_FIELDS if getattr(config, name, None)]",
      "block_fields = []",
      "tests/test_models.py -k block_types"),
    M("servable_accepts_chunks_without_chunked_layers", "hybrid_ops/integrations/servable.py",
      'if getattr(config, "attention_chunk_size", None) and "chunked_attention" not in layer_types:',
      "if False:",
      "tests/test_models.py -k chunks_without"),
    M("servable_accepts_no_attention_interface", "hybrid_ops/integrations/servable.py",
      "if not probe.calls and not probe.dense:",
      "if False:",
      "tests/test_models.py -k bloom"),
    M("servable_accepts_a_layer_without_attention", "hybrid_ops/integrations/servable.py",
      "    if missing:\n",
      "    if False:\n",
      "tests/test_models.py -k layer_without_attention"),
    M("servable_accepts_unpassed_sinks", "hybrid_ops/integrations/servable.py",
      "    if probe.unpassed_sinks:\n",
      "    if False:\n",
      "tests/test_models.py -k unpassed_sinks"),
    # -- HybridAttnBackend / PhaseBackend CUDA-graph metadata ---------------------------------------------------
    M("capture_swaps_bs_and_num_tokens", "hybrid_ops/integrations/sglang.py",
      ".init_forward_metadata_capture_cuda_graph(bs, num_tokens, forward_mode, tree)",
      ".init_forward_metadata_capture_cuda_graph(num_tokens, bs, forward_mode, tree)",
      "tests/test_sglang.py -k 'capture_metadata or replay_metadata'"),
    M("capture_cu_seqlens_one_token_each", "hybrid_ops/integrations/sglang.py",
      "torch.arange(bs + 1, dtype=torch.int32) * q_len",
      "torch.arange(bs + 1, dtype=torch.int32)",
      "tests/test_sglang.py -k 'capture_metadata or replay_metadata'"),
    M("replay_assumes_table_as_wide_as_buffers", "hybrid_ops/integrations/sglang.py",
      "batch.block_table[:, : padded.block_table.shape[1]].copy_(padded.block_table)",
      "batch.block_table.copy_(padded.block_table)",
      "tests/test_sglang.py -k 'capture_metadata or replay_metadata'"),
    M("replay_keeps_captured_seq_lens", "hybrid_ops/integrations/sglang.py",
      "batch.seq_lens.copy_(padded.seq_lens)",
      "batch.seq_lens.fill_(1)",
      "tests/test_sglang.py -k 'capture_metadata or replay_metadata'"),
    M("replay_leaves_static_buffers_stale", "hybrid_ops/integrations/sglang.py",
      "        self.forward_batch = batch\n        self._plan_cuda_graph(batch)\n\n    def _check_tree",
      "        self.forward_batch = forward_batch\n        self._plan_cuda_graph(batch)\n\n    def _check_tree",
      "tests/test_sglang.py -k 'capture_metadata or replay_metadata'"),
    M("phase_backend_drops_scale", "hybrid_ops/integrations/sglang.py",
      "scale=layer.scale,",
      "scale=None,",
      "tests/test_sglang.py -k 'capture_metadata or replay_metadata'"),
    M("phase_backend_drops_logit_cap", "hybrid_ops/integrations/sglang.py",
      "logit_cap=layer.logit_cap,",
      "logit_cap=0.0,",
      "tests/test_sglang.py -k 'capture_metadata or replay_metadata'"),
    M("phase_backend_drops_the_tree", "hybrid_ops/integrations/sglang.py",
      "tree_mask=self.forward_batch.tree_mask,",
      "tree_mask=None,",
      "tests/test_sglang.py -k tree"),
    M("replay_keeps_the_captured_tree", "hybrid_ops/integrations/sglang.py",
      "batch.tree_mask[: real.shape[0]].copy_(real[:, : batch.tree_mask.shape[1]])",
      "batch.tree_mask[: real.shape[0]].clone()",
      "tests/test_sglang.py -k tree"),
    M("replay_hook_plans_without_the_tree", "hybrid_ops/buckets.py",
      "plan_cuda_graph(path, k_cache, *batch.metadata, tree_mask=batch.tree_mask)",
      "plan_cuda_graph(path, k_cache, *batch.metadata)",
      "tests/test_flashinfer.py -k tree_phase"),
    # -- CUDA-graph padding and FlashInfer planning -------------------------------------------------------------
    M("padding_requests_use_page_0", "hybrid_ops/buckets.py",
      "torch.full((len(q_lens), width), scratch_page, dtype=int32, device=device)",
      "torch.full((len(q_lens), width), 0, dtype=int32, device=device)",
      "tests/test_buckets.py -k 'padding_changes'"),
    M("flashinfer_decode_plans_one_token_per_request", "hybrid_ops/backends/flashinfer.py",
      "q_len_per_req=num_tokens // batch,",
      "q_len_per_req=1,",
      "tests/test_flashinfer.py -k 'not compile'"),
    M("flashinfer_fp8_plans_the_q_dtype_for_the_cache", "hybrid_ops/backends/flashinfer.py",
      "kv_data_type=variant.kv_dtype",
      "kv_data_type=variant.q_dtype",
      "tests/test_flashinfer.py -k fp8"),
    M("flashinfer_fp8_k_scales_tiled_over_query_heads", "hybrid_ops/backends/flashinfer.py",
      "q = (q * k_scale.repeat_interleave(group)[:, None])",
      "q = (q * k_scale.repeat(group)[:, None])",
      "tests/test_flashinfer.py -k fp8"),
    # -- FlashInfer with speculative trees: the custom mask and its plans ------------------------------------------
    M("flashinfer_tree_mask_hides_the_prefix", "kernels/custom_mask.py",
      "seen = ((column < 0) & in_window_prefix)",
      "seen = ((column < -(1 << 30)) & in_window_prefix)",
      "tests/test_flashinfer.py -k 'tree and not phase'"),
    M("flashinfer_tree_mask_bits_big_endian", "kernels/custom_mask.py",
      "seen.to(tl.int32) << tl.arange(0, BITS)[None, :]",
      "seen.to(tl.int32) << (BITS - 1 - tl.arange(0, BITS))[None, :]",
      "tests/test_flashinfer.py -k 'custom_mask or tree_cuda'"),
    M("flashinfer_tree_window_by_slots", "kernels/custom_mask.py",
      "return (tree_mask & earlier).sum(1, dtype=torch.int32)",
      "return local.to(torch.int32)",
      "tests/test_flashinfer.py -k 'test_trees or custom_mask'"),
    M("flashinfer_tree_new_keys_window_by_slots", "kernels/custom_mask.py",
      "in_window_new = depth - key_depth < sliding_window",
      "in_window_new = depth - column < sliding_window",
      "tests/test_flashinfer.py -k 'test_trees or custom_mask'"),
    M("flashinfer_tree_plans_the_slot_window_too", "hybrid_ops/backends/flashinfer.py",
      "if variant.sliding_window > 0 and not variant.tree else -1",
      "if variant.sliding_window > 0 else -1",
      "tests/test_flashinfer.py -k test_trees"),
    M("flashinfer_tree_variant_shares_the_causal_wrapper", "hybrid_ops/backends/flashinfer.py",
      "    tree: bool  # a tree mask in use",
      "    tree: bool = __import__('dataclasses').field(compare=False)  # a tree mask in use",
      "tests/test_flashinfer.py -k 'tree_cuda or tree_plans'"),
    M("flashinfer_tree_graph_mask_never_packed", "hybrid_ops/backends/flashinfer.py",
      "            custom_mask(tree_mask, cu_seqlens_q, seq_lens, variant.sliding_window, *plan.mask_buffers)",
      "            pass",
      "tests/test_flashinfer.py -k 'tree_cuda or tree_phase'"),
    M("flashinfer_plan_misses_a_tree_rewritten_in_place", "hybrid_ops/backends/flashinfer.py",
      "and _versions(metadata) == self.versions",
      "and _versions(metadata[:3]) == self.versions[:3]",
      "tests/test_flashinfer.py -k tree_plans"),
    M("generators_share_one_code_object", "hybrid_ops/generation/runner.py",
      "code = _FORWARD_CODES.setdefault(self.model, {}).setdefault(shapes, fn.__code__.replace())",
      "code = fn.__code__",
      "tests/test_generator.py -k recompile_limit"),
    M("generators_of_one_shape_compile_again", "hybrid_ops/generation/runner.py",
      "code = _FORWARD_CODES.setdefault(self.model, {}).setdefault(shapes, fn.__code__.replace())",
      "code = fn.__code__.replace()",
      "tests/test_generator.py -k recompile_limit"),
    # -- sampling -----------------------------------------------------------------------------------------------
    M("sampling_ignores_top_k", "hybrid_ops/generation/sampler.py",
      "if params.top_k > 0:",
      "if False:",
      "tests/test_sampling.py"),
    M("sampling_ignores_top_p", "hybrid_ops/generation/sampler.py",
      "if params.top_p < 1:",
      "if False:",
      "tests/test_sampling.py"),
    M("top_p_keeps_a_token_at_the_boundary", "hybrid_ops/generation/sampler.py",
      "drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p",
      "drop = ascending.softmax(-1).cumsum(-1) < 1 - top_p",
      "tests/test_sampling.py -k tie"),
    M("sampling_ignores_min_p", "hybrid_ops/generation/sampler.py",
      "if params.min_p > 0:",
      "if False:",
      "tests/test_sampling.py"),
    M("sampling_ignores_temperature", "hybrid_ops/generation/sampler.py",
      "logits = logits.float() / params.temperature",
      "logits = logits.float()",
      "tests/test_sampling.py"),
    M("generate_never_samples", "hybrid_ops/generation/sampler.py",
      "next_ids[i] = sample(logits[i : i + 1], sampling, generator)[0]",
      "pass",
      "tests/test_sampling.py"),
    M("seeded_request_unseeded", "hybrid_ops/generation/sampler.py",
      "return torch.Generator(device=device).manual_seed(self.seed)",
      "return None",
      "tests/test_generator.py -k seeded"),
    # -- generator: input checks, cleanup, eos, warm-up ----------------------------------------------------------
    M("prompt_ids_not_checked_against_vocab", "hybrid_ops/generation/checks.py",
      "if not (is_int(token, 0) and token < vocab_size):",
      "if not is_int(token, 0):",
      "tests/test_generator.py -k bad_input"),
    M("failed_step_keeps_its_requests", "hybrid_ops/generation/api.py",
      "            self.scheduler.abort_step(step.requests)\n            raise",
      "            pass\n            raise",
      "tests/test_generator.py -k drops_its_requests"),
    M("stream_leaves_its_requests_behind", "hybrid_ops/generation/api.py",
      "                    self.scheduler.abort(rid)",
      "                    pass",
      "tests/test_generator.py -k 'failing_step_frees or closing'"),
    M("eos_list_keeps_only_its_first", "hybrid_ops/generation/sampler.py",
      "eos = [] if eos is None else [eos] if is_int(eos, 0) else eos",
      "eos = [] if eos is None else [eos] if is_int(eos, 0) else eos[:1]",
      "tests/test_generator.py -k eos"),
    M("no_warm_up", "hybrid_ops/generation/runner.py",
      "        self.warmed_up = not compile",
      "        self.warmed_up = True",
      "tests/test_generator.py -k compiled"),
    # -- hybrid models: state slots and the state op (tests/test_stateful.py, tests/test_models.py) ---------------
    M("state_first_chunk_reads_its_slot", "hybrid_ops/integrations/stateful.py",
      "layer.has_previous_state[spec.index] = has_previous",
      "layer.has_previous_state[spec.index] = True",
      "tests/test_stateful.py -k 'logits and zaya'"),
    M("state_chunk_continues_from_zero", "hybrid_ops/integrations/mixer_op.py",
      "parts = mixer.call(hidden[:, start + a : start + b], views, prefix + a > 0, positions)",
      "parts = mixer.call(hidden[:, start + a : start + b], views, a > 0, positions)",
      "tests/test_stateful.py -k 'logits and (zaya or minimax)'"),
    M("state_chunks_not_token_by_token", "hybrid_ops/integrations/mixer_op.py",
      "pieces = [(0, q)] if prefix == 0 or mixer.chunks_continue else [(t, t + 1) for t in range(q)]",
      "pieces = [(0, q)]",
      "tests/test_stateful.py -k 'logits and recurrent_gemma'"),
    M("state_decode_reads_another_slot", "hybrid_ops/integrations/mixer_op.py",
      "index = torch.tensor([slots[i] for i in decoding], device=hidden.device)",
      "index = torch.tensor([slots[i - 1] for i in decoding], device=hidden.device)",
      "tests/test_stateful.py -k 'logits and (zaya or minimax)'"),
    M("state_decode_not_written_back", "hybrid_ops/integrations/mixer_op.py",
      "state.index_copy_(0, index, new)",
      "pass",
      "tests/test_stateful.py -k 'logits and (zaya or minimax)'"),
    M("state_slots_are_batch_positions", "hybrid_ops/state.py",
      "return torch.tensor([self.slot(r) for r in request_ids], dtype=torch.int32, device=self.device)",
      "return torch.arange(len(request_ids), dtype=torch.int32, device=self.device)",
      "tests/test_stateful.py -k load"),
    M("state_slot_kept_by_a_finished_request", "hybrid_ops/generation/cache_manager.py",
      "        if self.states is not None:\n            self.states.free(request.id)",
      "        pass",
      "tests/test_stateful.py -k load"),
    M("state_not_counted_in_the_page_budget", "hybrid_ops/generation/cache_manager.py",
      "need = self.pages(request.num_tokens) - self.pages(reused) + self.state_pages",
      "need = self.pages(request.num_tokens) - self.pages(reused)",
      "tests/test_stateful.py -k page_budget"),
    M("state_not_held_by_running_requests", "hybrid_ops/generation/cache_manager.py",
      "return self.cache.num_free_pages - self.state_pages * held",
      "return self.cache.num_free_pages",
      "tests/test_stateful.py -k load"),
    M("attention_keyword_left_out", "hybrid_ops/integrations/transformers.py",
      "dropped = [name for name, value in kwargs.items() if name not in _UNUSED_KEYWORDS and holds_tensor(value)]",
      "dropped = []",
      "tests/test_models.py -k 'keyword or beside'"),
    M("nope_positions_refused", "hybrid_ops/integrations/servable.py",
      "and not _without_positions(model):",
      ":",
      "tests/test_models.py -k granitemoehybrid"),
    # -- hybrid models through the state ops: the torch backend, the served families, the generator's features ------
    M("state_torch_delta_forgets_the_decay", "hybrid_ops/backends/torch_state.py",
      "s = s * decay[:, j, :, :, None]",
      "s = s",
      "tests/test_state_ops.py -k 'test_gated_delta_rule and torch and prefix'"),
    M("state_torch_scan_drops_D", "hybrid_ops/backends/torch_state.py",
      "y = y + D.float()[:, None] * x_",
      "y = y",
      "tests/test_state_ops.py -k 'test_selective_scan_options and torch'"),
    M("state_torch_verify_writes_the_slots", "hybrid_ops/backends/torch_state.py",
      "    if step.verify:\n        held",
      "    if False:\n        held",
      "tests/test_state_ops.py -k 'verify and torch and gated'"),
    M("state_torch_tree_read_as_a_chain", "hybrid_ops/backends/torch_state.py",
      "self.parents = (earlier * (columns + 1)).amax(-1) - 1",
      "self.parents = None",
      "tests/test_state_ops.py -k 'tree and torch and scan'"),
    M("state_op_verify_commits", "hybrid_ops/state_ops.py",
      "verify = forward_mode == ForwardMode.TARGET_VERIFY",
      "verify = False",
      "tests/test_state_ops.py -k 'test_causal_conv1d and verify and cpu'"),
    M("state_conv_window_one_short", "hybrid_ops/state_ops.py",
      '_check_state("conv_state", conv_state, (weight.shape[1] - 1, channels), x.dtype, x.device)',
      '_check_state("conv_state", conv_state, (weight.shape[1] - 2, channels), x.dtype, x.device)',
      "tests/test_state_ops.py -k 'test_causal_conv1d_widths and torch'"),
    M("layer_delta_rule_without_l2norm", "hybrid_ops/integrations/layers.py",
      "q, k = (_l2norm(t.unflatten(-1, (k_heads, k_dim))) for t in (q, k))",
      "q, k = (t.unflatten(-1, (k_heads, k_dim)).float() for t in (q, k))",
      "tests/test_stateful.py -k 'logits and qwen3_5_text'"),
    M("layer_kimi_decay_per_head", "hybrid_ops/integrations/layers.py",
      "g = module.forget_gate(x[None])[0]  # [T, H, Dk] float32",
      "g = module.forget_gate(x[None])[0].mean(-1)",
      "tests/test_stateful.py -k 'logits and kimi_linear'"),
    M("layer_mamba2_without_dt_bias", "hybrid_ops/integrations/layers.py",
      "D=module.D, dt_bias=module.dt_bias, dt_softplus=True, dt_min=dt_min,",
      "D=module.D, dt_bias=None, dt_softplus=True, dt_min=dt_min,",
      "tests/test_stateful.py -k 'logits and bamba'"),
    M("layer_falcon_without_multipliers", "hybrid_ops/integrations/layers.py",
      "projected = projected * module.mup_vector[0, 0]",
      "projected = projected",
      "tests/test_stateful.py -k 'logits and falcon_h1'"),
    M("layer_jamba_b_not_normed", "hybrid_ops/integrations/layers.py",
      "module.b_layernorm(B)[:, None]",
      "B[:, None]",
      "tests/test_stateful.py -k 'logits and jamba'"),
    M("layer_short_conv_not_gated", "hybrid_ops/integrations/layers.py",
      "return module.out_proj(C * y)[None]",
      "return module.out_proj(y)[None]",
      "tests/test_stateful.py -k 'logits and lfm2'"),
    M("family_verify_without_intermediates", "hybrid_ops/integrations/stateful.py",
      "intermediates = None if intermediates is None else intermediates[mixer.index]",
      "intermediates = None",
      "tests/test_examples.py -k hybrid_target"),
    M("verify_commits_the_root", "hybrid_ops/state.py",
      "state[slots] = intermediate[slots, index]",
      "state[slots] = intermediate[slots, 0]",
      "tests/test_examples.py -k hybrid_target"),
    M("padding_requests_take_slot_0", "hybrid_ops/generation/runner.py",
      "state_slots.new_full((batch.batch_size - real,), -1)",
      "state_slots.new_full((batch.batch_size - real,), 0)",
      "tests/test_stateful.py -k 'cuda_graph and qwen3_5_text'"),
    M("prefix_snapshot_never_restored", "hybrid_ops/generation/cache_manager.py",
      "self.states.restore(request.id, last_page)",
      "pass",
      "tests/test_stateful.py -k 'prefix_caching and (qwen3_5_text or bamba)'"),
    M("prefix_chunks_not_aligned", "hybrid_ops/generation/cache_manager.py",
      "        if not (self.prefix_caching and self.states is not None) or end >= request.prefill_end:",
      "        if True:",
      "tests/test_stateful.py -k 'prefix_caching and qwen3_5_text'"),
    M("prefix_snapshot_of_a_partial_page", "hybrid_ops/generation/cache_manager.py",
      "if self.states is not None and prefilling and end % self.cache.page_size == 0:",
      "if self.states is not None and prefilling:",
      "tests/test_stateful.py -k 'prefix_caching and (qwen3_5_text or bamba)'"),
    M("package_without_states", "hybrid_ops/generation/aot.py",
      "            states=nested or None,",
      "            states=None,",
      "tests/test_package.py -k 'hybrid_models and qwen3_5_text'"),
    # -- scheduler (tests/test_scheduler.py: no model) ------------------------------------------------------------
    M("scheduler_preempts_the_oldest", "hybrid_ops/generation/scheduler.py",
      "self._preempt(self.running[-1], stats)",
      "self._preempt(self.running[0], stats)",
      "tests/test_scheduler.py"),
    M("scheduler_chunk_budget_per_request", "hybrid_ops/generation/scheduler.py",
      "                    budget -= n\n",
      "",
      "tests/test_scheduler.py"),
    M("admission_ignores_pages_promised_to_prefills", "hybrid_ops/generation/cache_manager.py",
      "if need > self.free_pages() - reserved_pages:",
      "if need > self.free_pages():",
      "tests/test_scheduler.py"),
    M("abort_keeps_the_pages", "hybrid_ops/generation/scheduler.py",
      "            self.kv.free(request)",
      "            pass",
      "tests/test_scheduler.py"),
    # -- cache truncation ---------------------------------------------------------------------------------------
    M("truncate_frees_partly_filled_page", "hybrid_ops/cache.py",
      "keep = -(-length // self.page_size)",
      "keep = length // self.page_size",
      "tests/test_cache.py -k truncate"),
    # -- keep (a speculative tree's accepted path) ----------------------------------------------------------------
    M("keep_writes_shared_pages_in_place", "hybrid_ops/cache.py",
      "shared = [p for p in written if self._shared(self._pages[request_id][p])]",
      "shared = []",
      "tests/test_cache.py -k keep"),
    M("keep_leaves_the_rejected_rows", "hybrid_ops/cache.py",
      "self.truncate(request_id, start + len(indices))",
      "self.truncate(request_id, length)",
      "tests/test_cache.py -k keep"),
    M("keep_ignores_indices", "hybrid_ops/cache.py",
      "moves = [(start + i, start + k) for k, i in enumerate(indices) if i != k]",
      "moves = []",
      "tests/test_cache.py -k keep"),
    M("keep_moves_keys_only", "hybrid_ops/cache.py",
      "            for cache in self.stored_caches:\n                rows = raw(cache)",
      "            for cache in self.k_caches:\n                rows = raw(cache)",
      "tests/test_cache.py -k keep"),
    M("keep_rows_within_the_first_page", "hybrid_ops/cache.py",
      "src, dst = (pages[p // self.page_size] * self.page_size + p % self.page_size for p in (src, dst))",
      "src, dst = (pages[0] * self.page_size + p % self.page_size for p in (src, dst))",
      "tests/test_cache.py -k keep"),
    M("speculative_tree_truncated_as_a_chain", "examples/speculative.py",
      "self.target.cache.keep(request, len(tokens), [0] + path)",
      "self.target.cache.truncate(request, self.target.cache.seq_len(request) - len(tokens) + 1 + len(path))",
      "tests/test_examples.py -k trees"),
    M("speculative_draft_drops_its_accepted_nodes", "examples/speculative.py",
      "kept = [caught_up + c - 1 for c in path if c - 1 < levels]",
      "kept = []",
      "tests/test_examples.py -k trees"),
    # -- shared pages and the prefix cache ------------------------------------------------------------------------
    M("shared_page_written_in_place", "hybrid_ops/cache.py",
      "return self._refs[page] > 1 or page in self._cached",
      "return page in self._cached",
      "tests/test_cache.py -k 'fork or random'"),
    M("cached_page_written_in_place", "hybrid_ops/cache.py",
      "return self._refs[page] > 1 or page in self._cached",
      "return self._refs[page] > 1",
      "tests/test_cache.py -k 'truncating or random'"),
    M("prefix_evicted_page_keeps_its_key", "hybrid_ops/cache.py",
      "            del self._prefix[self._cached.pop(page).key]",
      "            self._cached.pop(page)",
      "tests/test_cache.py -k 'finished or random'"),
    M("prefix_key_without_its_chain", "hybrid_ops/cache.py",
      "key = (parent, tuple(tokens[i * size : (i + 1) * size]))",
      "key = (None, tuple(tokens[i * size : (i + 1) * size]))",
      "tests/test_cache.py -k exact"),
    M("prefix_match_reuses_too_little", "hybrid_ops/generation/cache_manager.py",
      "request.tokens(0, request.num_tokens - 1) if self.prefix_caching",
      "request.tokens(0, request.num_tokens - 5) if self.prefix_caching",
      "tests/test_generator.py -k prefix_caching"),
    M("prefix_no_wait_for_a_page_in_prefill", "hybrid_ops/generation/scheduler.py",
      "return any(r.num_computed_tokens < end <= r.prefill_end and r.tokens(0, end) == prefix",
      "return any(False and r.tokens(0, end) == prefix",
      "tests/test_generator.py -k prefix_caching_prefills"),
    # -- masks (torch backend) ----------------------------------------------------------------------------------
    M("mask_sdpa_causal_with_prefix", "hybrid_ops/backends/torch_ref.py",
      "is_causal = plain and len(lens) == 1 and num_queries == length and not matmul",
      "is_causal = plain and len(lens) == 1 and not matmul",
      "tests/test_ops.py -k 'torch or routing'"),
    M("mask_batched_decode_sees_padding", "hybrid_ops/backends/torch_ref.py",
      "(plain and num_queries == 1 and min(lens) == length)",
      "(plain and num_queries == 1)",
      "tests/test_ops.py -k 'torch or routing'"),
    M("batched_decode_keeps_foreign_padding_rows", "hybrid_ops/backends/torch_ref.py",
      ".index_fill_(0, step.padding_rows(), 0)",
      "",
      "tests/test_reliability.py -k foreign"),
    # -- sliding window -----------------------------------------------------------------------------------------
    M("window_one_key_too_many", "hybrid_ops/backends/torch_ref.py",
      "visible &= key_pos[:, None, :] > query_pos[:, :, None] - sliding_window",
      "visible &= key_pos[:, None, :] >= query_pos[:, :, None] - sliding_window",
      "tests/test_ops.py -k 'torch or routing'"),
    # -- routing ------------------------------------------------------------------------------------------------
    M("routing_verify_to_decode", "hybrid_ops/modes.py",
      'ForwardMode.TARGET_VERIFY: ("prefill", "decode"),',
      'ForwardMode.TARGET_VERIFY: ("decode", "decode"),',
      "tests/test_ops.py -k 'torch or routing'"),
    M("routing_decode_path_uses_prefill_backend", "hybrid_ops/ops.py",
      'return "decode", route["decode_backend"], "decode_backend"',
      'return "decode", route["prefill_backend"], "decode_backend"',
      "tests/test_ops.py -k 'torch or routing'"),
    # -- fp8 caches (ops, torch backend, integration) ------------------------------------------------------------
    M("fp8_torch_reads_without_scales", "hybrid_ops/backends/torch_ref.py",
      "x.to(compute_dtype) if kv_scale is None else",
      "x.to(compute_dtype) if True else",
      "tests/test_fp8.py -k torch"),
    M("fp8_store_not_saturated", "hybrid_ops/fp8.py",
      ".clamp_(-limit, limit)",
      "",
      "tests/test_fp8.py -k saturates"),
    M("fp8_missing_scales_default_to_two", "hybrid_ops/fp8.py",
      "kv_scale = torch.ones((), dtype=torch.float32, device=device)",
      "kv_scale = torch.full((), 2.0, device=device)",
      "tests/test_fp8.py -k 'torch and softcap'"),
    M("fp8_integration_drops_the_caches_scales", "hybrid_ops/integrations/transformers.py",
      "v_scale=None if step.v_scales is None else step.v_scales[layer],",
      "v_scale=None,",
      "tests/test_transformers.py -k 'fp8_cache_generates and not compiled'"),
    # -- packages (hybrid_ops.package, HybridGenerator.from_package) --------------------------------------------
    M("package_of_another_torch_served", "hybrid_ops/generation/packaged.py",
      "if getattr(info, name) != here[name]:",
      "if False:",
      "tests/test_package.py -k another_torch"),
    M("package_of_another_config_served", "hybrid_ops/generation/packaged.py",
      "if fields:",
      "if False:",
      "tests/test_package.py -k another_config"),
    M("package_serves_past_its_sizes", "hybrid_ops/generation/packaged.py",
      "elif value > packaged:",
      "elif value > packaged + 1:",
      "tests/test_package.py -k another_config"),
    # -- cache slots of the new tokens (torch backend) ----------------------------------------------------------
    M("slot_ignores_request_start", "hybrid_ops/metadata.py",
      "position = (seq_lens[request] - q_len + token - q_start)",
      "position = (seq_lens[request] - q_len + token)",
      "tests/test_ops.py -k 'torch or routing'"),
    M("slot_row_off_by_one", "hybrid_ops/metadata.py",
      "return page * page_size + position.remainder(page_size)",
      "return page * page_size + (position + 1).remainder(page_size)",
      "tests/test_ops.py -k 'torch or routing'"),
    # -- the bench's peer worker (tests/test_bench_peers.py) ------------------------------------------------------
    M("peer_reference_sees_the_future", "bench/peer_worker.py",
      "visible = torch.arange(length)[None, :] <= torch.arange(length - (end - start), length)[:, None]",
      "visible = torch.arange(length)[None, :] <= torch.arange(length - (end - start), length)[:, None] + 1",
      "tests/test_bench_peers.py"),
    M("peer_pages_in_order", "bench/peer_worker.py",
      "cache[slots] = x[0].transpose(0, 1)",
      "cache[: len(slots)] = x[0].transpose(0, 1)",
      "tests/test_bench_peers.py"),
    M("peer_check_accepts_anything", "bench/peer_worker.py",
      "((out.double().flatten(1) - ref).norm(dim=1) / ref.norm(dim=1)).max()",
      "((out.double().flatten(1) - ref).norm(dim=1) / ref.norm(dim=1)).min()",
      "tests/test_bench_peers.py"),
    # -- MLA over its latent cache (tests/test_latent.py) ----------------------------------------------------------
    M("mla_output_without_value_half", "hybrid_ops/integrations/mla.py",
      'return torch.einsum("thr,hvr->thv", out, weight[:, self.nope :])[None]',
      'return torch.einsum("thr,hvr->thv", out, weight[:, : self.v_head_dim])[None]',
      "tests/test_latent.py -k 'logits and deepseek_v3'"),
    M("mla_query_without_rope_part", "hybrid_ops/integrations/mla.py",
      "q_rope.transpose(0, 1)], -1)",
      "torch.zeros_like(q_rope.transpose(0, 1))], -1)",
      "tests/test_latent.py -k 'logits and deepseek_v3'"),
    M("mla_values_past_the_rope_part", "hybrid_ops/integrations/mla.py",
      "out = attn(q, k, k[..., : self.rank], self.rank)",
      "out = attn(q, k, k[..., self.rope :], self.rank)",
      "tests/test_latent.py -k 'logits and deepseek_v3'"),
    M("mla_latent_cache_second_copy", "hybrid_ops/cache.py",
      "            k[..., : s.v_head_dim]\n            if s.latent",
      "            k[..., : s.v_head_dim].clone()\n            if s.latent",
      "tests/test_latent.py -k 'models_over and deepseek_v3'"),
    M("mla_layers_kept_expanded", "hybrid_ops/integrations/mla.py",
      "if type(module).__name__ not in LATENT_CLASSES or",
      "if True or",
      "tests/test_latent.py -k 'models_over and deepseek_v3'"),
    M("cpu_latent_values_at_their_own_width", "kernels/cpu/kernel.h",
      "v_rows[j] = v_rows[j - 1] + pb.num_kv_heads * pb.v_head_stride;",
      "v_rows[j] = v_rows[j - 1] + pb.num_kv_heads * pb.v_head_dim;",
      "tests/test_latent.py -k 'latent_cache and cpu'"),
    M("triton_latent_rope_block_dropped", "kernels/common.py",
      "            s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=\"tf32x3\")",
      "            s = s",
      "tests/test_triton_tiles.py -k mla"),
    # -- Each option on each backend that claims it (tests/test_backend_options.py) ----------------------------------
    M("torch_backend_ignores_sinks", "hybrid_ops/backends/torch_ref.py",
      "scale, logit_cap, sinks = options.scale, options.logit_cap, options.sinks",
      "scale, logit_cap, sinks = options.scale, options.logit_cap, None",
      "tests/test_backend_options.py -k 'torch and sinks'"),
    M("torch_backend_ignores_the_chunk", "hybrid_ops/backends/torch_ref.py",
      "        if attention_chunk > 0:\n            visible &=",
      "        if attention_chunk > 10**9:\n            visible &=",
      "tests/test_backend_options.py -k 'torch and attention_chunk'"),
]
# fmt: on


def package_dirs(root: Path) -> dict:
    """pyproject.toml's `package-dir`: package name -> the directory it is installed from."""
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"].get("package-dir", {})


def copy_repository(dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files, plus links that place each `package-dir` entry of
    pyproject.toml where Python looks for it (kernels/ as hybrid_ops/kernels), so nothing imports from ROOT."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for name in filter(None, listing.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    for package, directory in package_dirs(dest).items():
        link = dest / package.replace(".", "/")
        if not link.exists():
            link.symlink_to(os.path.relpath(dest / directory, link.parent), target_is_directory=True)


def module_name(file: str, dirs: dict) -> str | None:
    """The module that `file` (a path in the repository) is imported as, or None for a non-module."""
    if not file.endswith(".py"):
        return None
    stem = file[: -len(".py")].removesuffix("/__init__")
    for package, directory in dirs.items():
        if stem == directory or stem.startswith(directory + "/"):
            return package + stem[len(directory) :].replace("/", ".")
    return stem.replace("/", ".")


def check_imports_from(copy: Path, env, files) -> None:
    """Every mutated module must import from the copy (an editable install of ROOT would otherwise win)."""
    modules = sorted({m for m in (module_name(f, package_dirs(copy)) for f in files) if m})
    code = "import importlib\n" + "".join(f"print(importlib.import_module({m!r}).__file__)\n" for m in modules)
    result = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"importing the copy's modules failed:\n{result.stderr}")
    for module, path in zip(modules, result.stdout.split()):
        if not Path(path).absolute().is_relative_to(copy):
            sys.exit(f"{module} imports from {path}, not from the copy {copy}")


def run_tests(copy: Path, env, tests: str, extra) -> tuple[int, str, float, str]:
    """(pytest's exit status, its summary counts, seconds, its output) for one selection, stopping at the first
    failure."""
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *shlex.split(tests), *extra]
    start = time.perf_counter()
    try:
        result = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return -1, "timed out", time.perf_counter() - start, ""
    counts = re.findall(r"(\d+) (passed|failed|errors?|deselected)", result.stdout)
    summary = ", ".join(f"{n} {word}" for n, word in counts if word != "deselected") or "no summary"
    return result.returncode, summary, time.perf_counter() - start, result.stdout


# What a test may fail on for its mutant to count as caught, read from pytest's "E" lines: an assertion (pytest.raises'
# own included: "Failed: DID NOT RAISE", a message that does not match), or an error the code raises on purpose
# (HybridInputError, under torch.compile too). Anything else (a TypeError, an import or collection error, a timeout,
# a crash) is not a test catching the bug.
CAUGHT_ON = re.compile(r"^(assert |(?:[\w.]+\.)?(AssertionError|Failed|HybridInputError)\b)")


def verdict(returncode: int, output: str = "") -> str:
    if returncode == 0:
        return "NOT CAUGHT"
    if returncode == 5:
        return "ERROR (no tests selected)"
    if returncode != 1:  # 2: interrupted (collection), 3-4: pytest's own errors, < 0: timed out or died
        return f"ERROR (pytest exit {returncode})"
    raised = re.findall(r"^E\s+(.*)$", output, re.MULTILINE)
    if any(CAUGHT_ON.search(line) for line in raised):
        return "caught"
    first = next((line for line in raised if re.match(r"[\w.]+:", line)), "an error")
    return f"ERROR (failed on {first.split(':')[0][:60]})"


def apply_and_test(copy: Path, env, mutant, extra) -> tuple:
    """One mutant in `copy`, undone afterwards -> its table row (name, tests, summary, verdict, seconds)."""
    path = copy / mutant.file
    original = path.read_text()
    if original.count(mutant.original) != 1:
        return (
            mutant.name,
            mutant.tests,
            f"its text occurs {original.count(mutant.original)} times in {mutant.file}",
            "stale anchor",
            0.0,
        )
    path.write_text(original.replace(mutant.original, mutant.mutated))
    try:
        returncode, summary, seconds, output = run_tests(copy, env, mutant.tests, extra)
    finally:
        path.write_text(original)
    return mutant.name, mutant.tests, summary, verdict(returncode, output), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", dest="name", default="", help="only mutants whose name this regex finds (re.search)")
    parser.add_argument("-j", dest="jobs", type=int, default=2, help="mutants tested at once, each in its own copy")
    parser.add_argument("--list", action="store_true", help="print the table and exit")
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip running each selection on the unmutated copy (for a caller that has just run "
        "every test on this tree, as .ci/run has)",
    )
    parser.add_argument("--tests", help="run these tests (pytest arguments) for every mutant instead of the table's")
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments for every mutant")
    args = parser.parse_args()
    mutants = [
        m if args.tests is None else m._replace(tests=args.tests) for m in MUTANTS if re.search(args.name, m.name)
    ]
    if not torch.cpu._is_amx_tile_supported():  # the VNNI-packed tiles run only on AMX; their test skips elsewhere
        print("skipped (this CPU has no AMX): " + ", ".join(m.name for m in mutants if m.name in AMX_ONLY))
        mutants = [m for m in mutants if m.name not in AMX_ONLY]
    if kernel_capability() != "AVX512_VBMI":  # the look-up build's fp8 loads; their tests skip elsewhere
        print("skipped (this CPU has no AVX512-VBMI): " + ", ".join(m.name for m in mutants if m.name in VBMI_ONLY))
        mutants = [m for m in mutants if m.name not in VBMI_ONLY]
    if args.list or not mutants:
        for m in MUTANTS:
            print(f"{m.name:42} {m.file:42} {m.tests}")
        return 0 if mutants else 1

    with tempfile.TemporaryDirectory(prefix="hybrid_ops_mutants_") as tmp:
        # No bytecode: a mutant of the same size written within the same second would reuse a stale .pyc. No
        # shrinking of hypothesis's failing examples: a mutant is caught at its first failure.
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1", "HYPOTHESIS_PROFILE": "mutants"}

        def env_of(copy):
            python_path = [str(copy)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
            return {**env, "PYTHONPATH": os.pathsep.join(python_path)}

        copies = queue.SimpleQueue()  # a job takes a copy of its own and puts it back when done
        for i in range(max(1, args.jobs)):
            copy = Path(tmp, str(i)).resolve()
            copy_repository(copy)
            check_imports_from(copy, env_of(copy), [m.file for m in mutants])
            copies.put(copy)

        def in_a_copy(work, *work_args):
            copy = copies.get()
            try:
                return work(copy, env_of(copy), *work_args)
            finally:
                copies.put(copy)

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            # The unmutated copy must pass every selection, or a "caught" would mean nothing.
            selections = [] if args.no_baseline else list(dict.fromkeys(m.tests for m in mutants))
            baselines = pool.map(lambda tests: in_a_copy(run_tests, tests, args.pytest_args), selections)
            for tests, (returncode, summary, seconds, _) in zip(selections, baselines):
                print(f"baseline  {tests:64} {summary:24} {seconds:5.1f} s", flush=True)
                if returncode not in (0, 5):  # 5: --deselect may empty a selection
                    sys.exit(f"the unmutated copy fails `pytest {tests}`: fix the tests or the code first")
            rows = []
            for row in pool.map(lambda m: in_a_copy(apply_and_test, m, args.pytest_args), mutants):
                rows.append(row)
                print(f"{row[3]:12} {row[0]} ({row[4]:.1f} s)", flush=True)

    print("\n| mutant | tests run | result | s |\n|---|---|---|---:|")
    for name, tests, summary, result, seconds in rows:
        print(f"| {name} | `{tests}`: {summary} | {result} | {seconds:.1f} |")
    caught = sum(r[3] == "caught" for r in rows)
    print(f"\n{caught} of {len(rows)} mutants caught")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
