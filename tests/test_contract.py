"""The text a user reads as the contract: the op schemas, the whole error messages of bad input and the C++ that a
row of value checks becomes. A change to either shows here as a diff (`EXPECTTEST_ACCEPT=1 pytest
tests/test_contract.py` rewrites the expected text)."""

import expecttest
import torch
from helpers.bad_inputs import BAD_INPUTS, VALUE_INPUTS, call, valid_case
from helpers.state_cases import STATE_BAD_INPUTS, STATE_VALUE_INPUTS, state_message

import hybrid_ops
from hybrid_ops.check_rows import cpp_values
from hybrid_ops.validation import TREE_VALUES, VALUE_FIELDS


def message(op, mutation) -> str:
    case = valid_case(op)
    args, kwargs = mutation(case.args, {})
    try:
        call(op, args, kwargs)
    except hybrid_ops.HybridInputError as e:
        return str(e)
    raise AssertionError("no error")


class TestContract(expecttest.TestCase):
    def test_schemas(self):
        schemas = "\n".join(
            str(getattr(torch.ops.hybrid, name).default._schema) for name in ("prefill", "decode", "attn", "plan")
        )
        self.assertExpectedInline(
            schemas,
            """\
hybrid::prefill(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_table, *, float? scale=None, int sliding_window=-1, float logit_cap=0., Tensor? sinks=None, int attention_chunk=-1, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? tree_mask=None, str backend="auto") -> Tensor
hybrid::decode(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_table, *, float? scale=None, int sliding_window=-1, float logit_cap=0., Tensor? sinks=None, int attention_chunk=-1, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? tree_mask=None, str backend="auto") -> Tensor
hybrid::attn(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_table, SymInt forward_mode, *, float? scale=None, int sliding_window=-1, float logit_cap=0., Tensor? sinks=None, int attention_chunk=-1, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? tree_mask=None, str prefill_backend="auto", str decode_backend="auto", str speculative_attention_mode="prefill") -> Tensor
hybrid::plan(Tensor k_cache, Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_table, SymInt forward_mode, *, ScalarType q_dtype, int num_q_heads, float? scale=None, int sliding_window=-1, float logit_cap=0., Tensor? sinks=None, int attention_chunk=-1, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? tree_mask=None, str prefill_backend="auto", str decode_backend="auto", str speculative_attention_mode="prefill", bool cuda_graph=False) -> ()""",
        )

    def test_bad_input_messages(self):
        messages = "\n".join(f"{name}: {message(op, mutation)}" for name, (op, mutation, _) in BAD_INPUTS.items())
        self.assertExpectedInline(
            messages,
            """\
float_block_table: block_table must be int32, got torch.float32
int64_block_table: block_table must be int32, got torch.int64
int64_seq_lens: seq_lens must be int32, got torch.int64
int64_cu_seqlens: cu_seqlens_q must be int32, got torch.int64
int_q: q must be float16, bfloat16 or float32, got torch.int32
float64_q: q must be float16, bfloat16 or float32, got torch.float64
k_dtype: k must have q's dtype torch.float32, got torch.float16
cache_dtype: v_cache must have k_cache's dtype torch.float32, got torch.float16
int8_cache: k_cache must have q's dtype torch.float32 or be float8_e4m3fn or float8_e5m2, got torch.int8
fp8_caches_differ: v_cache must have k_cache's dtype torch.float8_e4m3fn, got torch.float8_e5m2
scale_without_fp8: k_scale applies to float8 caches only; k_cache is torch.float32
fp8_k_scale_alone: v_scale must be given with k_scale: an fp8 cache takes both scales or neither
fp8_scale_dtype: k_scale must be a float32 tensor of shape [], [1] or [Hkv] on q's device cpu, got torch.float64 of shape (2,) on cpu
fp8_scale_heads: v_scale must have 1 or the caches' 2 kv heads, got 3
meta_device: block_table must be on q's device cpu, got meta
q_rank: q must have 3 dimensions, got shape (1, 7, 4, 16)
cache_rank: k_cache must have 4 dimensions, got shape (28, 2, 16)
block_table_rank: block_table must have 2 dimensions, got shape (8,)
k_tokens: k must have q's 7 tokens, got 6
v_heads: v must have k_cache's 2 kv heads, got shape (7, 1, 16)
head_dim_mismatch: k_cache head dim 16 must equal q's head dim 8
gqa_ratio: q's 3 heads must be a multiple of the caches' 2 kv heads (Hq % Hkv == 0)
v_cache_shape: v_cache must be [num_pages, page_size, Hkv, Dv] with k_cache's first three sizes (8, 4, 2), got (7, 4, 2, 16)
v_head_dim: v head dim must equal its cache's 16, got 8
sinks_heads: sinks must have q's 4 heads, got 3
sinks_dtype: sinks must be a [Hq] float32 tensor on q's device cpu, got torch.bfloat16 of shape (4,) on cpu
zero_chunk: attention_chunk must be -1 (no chunking) or a positive int, got 0
tree_dtype: tree_mask must be a [T, Q] bool tensor on q's device cpu, got torch.uint8 of shape (7, 4) on cpu
tree_rank: tree_mask must be a [T, Q] bool tensor on q's device cpu, got torch.bool of shape (1, 3, 1) on cpu
tree_rows: tree_mask must have q's 7 rows, got 6
tree_columns: tree_mask must have Q >= 1 columns, got shape (7, 0)
cache_not_contiguous: k_cache must be a contiguous [num_pages, page_size, Hkv, D] tensor, got strides (32, 256, 16, 1)
cu_seqlens_len: cu_seqlens_q must have B + 1 = 3 entries (B = len(seq_lens)), got 2
block_table_rows: block_table must have B = 2 rows (B = len(seq_lens)), got 1
decode_ragged_T: decode needs the same number of query tokens per request: T = 2 is not a multiple of B = 3
nan_scale: scale must be a finite positive float or None, got nan
negative_scale: scale must be a finite positive float or None, got -1.0
zero_window: sliding_window must be -1 (no window) or a positive int, got 0
inf_logit_cap: logit_cap must be 0.0 (no soft-cap) or a finite positive float, got inf
unknown_backend: backend must be 'auto' or one of ['cpu', 'flashinfer', 'torch', 'triton'], got 'cudnn'
unknown_decode_backend: decode_backend must be 'auto' or one of ['cpu', 'flashinfer', 'torch', 'triton'], got 'x'
unknown_spec_mode: speculative_attention_mode must be one of ('prefill', 'decode'), got 'draft'""",
        )

    def test_bad_value_messages(self):
        with hybrid_ops.set_validation(True):
            messages = "\n".join(f"{name}: {message(op, mutation)}" for name, (op, mutation, _) in VALUE_INPUTS.items())
        self.assertExpectedInline(
            messages,
            """\
cu_seqlens_not_from_0: cu_seqlens_q must start at 0, got 1
cu_seqlens_decreasing: cu_seqlens_q must be non-decreasing, got [0, 9, 7]
cu_seqlens_not_T: cu_seqlens_q must end at the number of tokens T = 7, got 6
seq_lens_short: seq_lens[0] = 1 is shorter than request 0's 3 new tokens
seq_lens_negative: seq_lens[1] = -3 is shorter than request 1's 4 new tokens
block_id_high: block_table[0, 0] = 10000 is not a page of the cache (0 <= id < 8)
block_id_negative: block_table[1, 0] = -1 is not a page of the cache (0 <= id < 7)
table_too_short: seq_lens[1] = 400 exceeds block_table's capacity of 4 pages x 4 = 16 tokens
table_one_short: seq_lens[1] = 17 exceeds block_table's capacity of 4 pages x 4 = 16 tokens
tree_narrow: tree_mask has Q = 3 columns, fewer than the longest request's 4 new tokens
tree_blind: tree_mask[5, 2] is False: a token always sees itself
tree_later: tree_mask[3, 1] is True: a token sees only earlier new tokens (lay the tree out parents first)
decode_ragged_lengths: decode needs the same query length for every request, got [1, 0, 2]""",
        )

    def test_state_op_schemas(self):
        schemas = "\n".join(
            str(getattr(torch.ops.hybrid, name).default._schema)
            for name in ("causal_conv1d", "gated_delta_rule", "selective_scan")
        )
        self.assertExpectedInline(
            schemas,
            """\
hybrid::causal_conv1d(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, Tensor cu_seqlens_q, Tensor seq_lens, Tensor state_slots, SymInt forward_mode, *, str activation="none", Tensor? tree_mask=None, Tensor(b!)? intermediate_states=None, str prefill_backend="auto", str decode_backend="auto", str speculative_attention_mode="prefill") -> Tensor
hybrid::gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor cu_seqlens_q, Tensor seq_lens, Tensor state_slots, SymInt forward_mode, *, float? scale=None, Tensor? tree_mask=None, Tensor(b!)? intermediate_states=None, str prefill_backend="auto", str decode_backend="auto", str speculative_attention_mode="prefill") -> Tensor
hybrid::selective_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor(a!) state, Tensor cu_seqlens_q, Tensor seq_lens, Tensor state_slots, SymInt forward_mode, *, Tensor? D=None, Tensor? z=None, Tensor? dt_bias=None, bool dt_softplus=False, float dt_min=0., float? dt_max=None, Tensor? tree_mask=None, Tensor(b!)? intermediate_states=None, str prefill_backend="auto", str decode_backend="auto", str speculative_attention_mode="prefill") -> Tensor""",
        )

    def test_state_op_messages(self):
        messages = [f"{name}: {state_message(name)}" for name in STATE_BAD_INPUTS]
        messages += [f"{name}: {state_message(name, STATE_VALUE_INPUTS)}" for name in STATE_VALUE_INPUTS]
        self.assertExpectedInline(
            "\n".join(messages),
            """\
conv_x_int: x must be float16, bfloat16 or float32, got torch.int32
conv_weight_channels: weight must be [8, *], got (4, 4)
conv_state_width: conv_state must be [*, 3, 8], got (7, 2, 8)
conv_state_dtype: conv_state must be float32, got torch.float16
conv_activation: activation must be one of ('none', 'silu'), got 'gelu'
slots_int64: state_slots must be int32, got torch.int64
slots_count: state_slots must have one slot per request (6), got 5
cu_seqlens_count: cu_seqlens_q must have B + 1 = 7 entries (B = len(seq_lens)), got 6
state_strided: state must be contiguous, got strides (128, 32, 1, 8)
delta_v_heads: v's 3 heads must be a multiple of q's and k's 2 heads (Hv % Hk == 0)
delta_g_shape: g must be [23, 4, 8], got (23, 4, 5)
delta_beta_dtype: beta must be float32, got torch.float64
delta_state_dtype: state must be float32, got torch.bfloat16
scan_A_shape: A must be [2], got (1,)
scan_groups: x's 2 heads must be a multiple of B's 3 groups (H % G == 0)
scan_D_size: D must be [2], got (5,)
scan_dt_limits: dt_min, dt_max must be a finite float and None or a float >= it, got 0.0, -1.0
verify_needs_intermediate: forward_mode TARGET_VERIFY needs intermediate_states ([num_slots, Q, *state shape]): gated_delta_rule keeps each draft token's state there and leaves the slots' states to the accepted one
unknown_backend: prefill_backend must be 'auto' or one of ['cpu', 'flashinfer', 'torch', 'triton'], got 'x'
slots_repeated: state_slots must be distinct slots in [0, 7) or -1 (a padding request), got [1, 1, 1, 1, 1, 1]
slot_too_high: state_slots must be distinct slots in [0, 7) or -1 (a padding request), got [106, 103, 105, 100, 99, 99]
cu_seqlens_not_T: cu_seqlens_q must end at the number of tokens T = 23, got 22
seq_lens_short: seq_lens[0] = 0 is shorter than request 0's 7 new tokens""",
        )

    def test_value_rows_in_cpp(self):
        """The tree's rows as the cpu kernels run them: one loop per index, each bound over the indices before it."""
        self.assertExpectedInline(
            cpp_values("tree_values_ok", TREE_VALUES, "MetadataValues", VALUE_FIELDS),
            """\
inline bool tree_values_ok(const MetadataValues& m) {
  const auto& cu = m.cu;
  const auto& tree = m.tree;
  const auto& num_requests = m.num_requests;
  const auto& tree_width = m.tree_width;
  for (int64_t i = 0; i < num_requests; ++i) {
    if (!((cu(i + 1) - cu(i)) <= tree_width)) return false;
  }
  for (int64_t i = 0; i < num_requests; ++i) {
    for (int64_t j = 0; j < cu(i + 1) - cu(i); ++j) {
      if (!(tree(cu(i) + j, j))) return false;
    }
  }
  for (int64_t i = 0; i < num_requests; ++i) {
    for (int64_t j = 0; j < cu(i + 1) - cu(i); ++j) {
      for (int64_t c = 0; c < cu(i + 1) - cu(i); ++c) {
        if (!((c <= j) || !tree(cu(i) + j, c))) return false;
      }
    }
  }
  return true;
}
""",
        )
