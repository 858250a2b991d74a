"""The block_table contract: entries past a request's ceil(seq_len / page_size) pages are never read, whatever they
hold (-1, as transformers' paged cache pads, 0, or garbage), for every backend that runs on the CPU and every mode,
with validation on or off."""

import math

import pytest
import torch
from helpers.reference import BACKENDS, assert_close, expected_cache, make_case, reference

import hybrid_ops
from hybrid_ops import ROUTING, ForwardMode

FILLS = [-1, 2**31 - 1]  # 0 is the padding test_unused_entries_never_read compares with


def pad_table(case, fill):
    """The case's block table with every entry past each request's pages set to `fill`."""
    table = case.block_table.clone()
    page_size = case.k_cache.shape[1]
    for i, length in enumerate(case.seq_lens.tolist()):
        table[i, math.ceil(length / page_size) :] = fill
    return table


def batch(mode, spec):
    """(q_lens, prefix_lens) for a mode: requests of different page counts, so every table row has unused entries."""
    if mode == ForwardMode.IDLE:
        return [], []
    if hybrid_ops.select_path(mode, spec) == "decode":
        q_len = 1 if mode == ForwardMode.DECODE else 3
        return [q_len] * 4, [0, 5, 17, 33]
    return [5, 1, 0, 7], [0, 9, 3, 22]


def run(case, table, mode, spec, backend, validate):
    """attn on a fresh copy of the case's caches with `table`: (output, k_cache, v_cache)."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    with hybrid_ops.set_validation(validate):
        out = torch.ops.hybrid.attn(
            case.q,
            case.k,
            case.v,
            k_cache,
            v_cache,
            case.cu_seqlens_q,
            case.seq_lens,
            table,
            int(mode),
            sliding_window=6,
            logit_cap=5.0,
            prefill_backend=backend,
            decode_backend=backend,
            speculative_attention_mode=spec,
        )
    return out, k_cache, v_cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", ["prefill", "decode"])
@pytest.mark.parametrize("mode", list(ROUTING))
def test_unused_entries_never_read(backend, spec, mode):
    """Every mode: a table padded with -1 (validation on) gives the 0-padded table's output bit for bit, and the
    reference's; the caches end the same."""
    case = make_case(*batch(mode, spec), num_q_heads=4, num_kv_heads=2, page_size=4, seed=int(mode))
    k_ref, v_ref = expected_cache(case)
    out, k_cache, v_cache = run(case, pad_table(case, -1), mode, spec, backend, validate=True)
    out_zero, *_ = run(case, pad_table(case, 0), mode, spec, backend, validate=False)
    assert torch.equal(out, out_zero)
    assert_close(out, reference(case, sliding_window=6, logit_cap=5.0), torch.float32)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY])
def test_any_padding_value(backend, validate, fill, mode):
    case = make_case(*batch(mode, "decode"), num_q_heads=4, num_kv_heads=2, page_size=4, seed=fill % 7)
    out, k_cache, _ = run(case, pad_table(case, fill), mode, "decode", backend, validate)
    assert_close(out, reference(case, sliding_window=6, logit_cap=5.0), torch.float32)
    assert torch.equal(k_cache, expected_cache(case)[0])
