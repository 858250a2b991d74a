"""The Triton kernels with a GPU's tiles, stages and SM count, run by the interpreter, against the float64 reference.

The interpreter's own tiles (128 keys, 128 query rows) leave small cases inside one block; here a decode program
walks several KV blocks, a request's queries span several tiles (prefill) or row tiles (decode), and the KV range
splits into several non-empty parts, with and without a sliding window and soft-cap. bf16 is held to a tolerance
that a 1% softmax-scale error fails, checked on the same case.
"""

import math

import pytest
import torch
from helpers.cases import launch_target
from helpers.reference import expected_cache, latent_case, make_case, reference, slow_except

from hybrid_ops.kernels import kv_store
from hybrid_ops.kernels.common import values_in_keys
from hybrid_ops.kernels.config import Target, decode_tiles, head_blocks, prefill_tiles, reduce_columns
from hybrid_ops.kernels.decode import decode, num_kv_splits
from hybrid_ops.options import Options

# Per element |out - ref| <= atol + rtol * |ref|. Measured on these cases (interpreter): fp32 1e-6, fp16 2e-4 (1.3e-3
# at |out| ~ 1.6 over MLA's 512 values: within an fp16 ulp, 2^-10 |x|), bf16 within one bf16 ulp of the output
# (the interpreter truncates fp32 -> bf16; an ulp is at most 2^-7 |x|).
# `check` shows on each case that a 1% error of the softmax scale exceeds it.
TOLERANCE = {torch.float32: (2e-5, 0.0), torch.float16: (1e-3, 2**-10), torch.bfloat16: (1e-3, 2**-7)}
MANY_SMS = Target(num_sms=132, interpret=True)  # an H200: GPU tiles, stages and SM count
# Logits of standard deviation 2 (scale 2 / sqrt(D)), so that the scale matters.
OPTIONS = {"plain": dict(scale=0.25), "window_softcap": dict(scale=0.25, sliding_window=150, logit_cap=10.0)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def excess(out, ref):
    """How far past the tolerance the worst element is: <= 1 passes. out: any dtype; ref: float64."""
    atol, rtol = TOLERANCE[out.dtype]
    return ((out.double() - ref).abs() / (atol + rtol * ref.abs())).max().item()


def check(op, case, options, target, backend="triton"):
    """op on the case (Triton with `target`'s tiles) against the reference; the tolerance must also reject a 1%
    error of the softmax scale on this very case."""
    k_ref, v_ref = expected_cache(case)
    with launch_target(target):
        out = op(*case.args, backend=backend, **options)
    ref = reference(case, **options)
    assert out.dtype == case.q.dtype and excess(out, ref) <= 1, f"error {excess(out, ref):.3g}x the tolerance"
    assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref)
    off_scale = reference(case, **dict(options, scale=0.99 * options["scale"])).to(out.dtype)
    assert excess(off_scale, ref) > 1.5, "a 1% scale error would pass"


# q_len 1: DECODE, 2 requests, GQA 8; q_len 4: TARGET_VERIFY, 4 drafts x GQA 16 = 64 rows, in 2 or 4 row tiles.
DECODE_CASES = (
    [("4_splits", q_len, dtype) for q_len in (1, 4) for dtype in DTYPES]
    + [("132_sms", 1, dtype) for dtype in DTYPES]
    + [("132_sms", 4, torch.float32)]
)


@pytest.mark.parametrize(
    "sms, q_len, dtype", slow_except(DECODE_CASES[0], DECODE_CASES), ids=lambda x: str(x).replace("torch.", "")
)
def test_decode(sms, q_len, dtype):
    """4 splits of several KV blocks each, or an H200's 132 SMs: as many splits as the table has blocks."""
    prefixes, num_q_heads = ([290, 200], 8) if q_len == 1 else ([290], 16)
    case = make_case(
        [q_len] * len(prefixes),
        prefixes,
        num_q_heads=num_q_heads,
        num_kv_heads=1,
        head_dim=64,
        page_size=16,
        dtype=dtype,
        seed=q_len,
    )
    rows = q_len * num_q_heads
    tiles = decode_tiles(dtype, 64, rows, MANY_SMS)
    row_tiles = -(-rows // tiles.block_rows)
    programs = len(prefixes) * row_tiles  # requests x kv heads x row tiles
    target = MANY_SMS if sms == "132_sms" else Target(num_sms=2 * programs, interpret=True)
    splits = num_kv_splits(programs, case.block_table.shape[1] * 16, tiles.block_n, target.num_sms)
    chunk = math.ceil(math.ceil((prefixes[0] + q_len) / splits) / tiles.block_n) * tiles.block_n
    assert (prefixes[0] + q_len) // chunk >= 2, "fewer than 3 non-empty splits"
    assert target is MANY_SMS or chunk >= 2 * tiles.block_n, "one KV block per program"
    assert q_len == 1 or row_tiles >= 2, "one row tile"
    for options in OPTIONS.values():
        check(torch.ops.hybrid.decode, case, options, target)


PREFILL_BATCH = [20, 3, 12], [150, 0, 35]


@pytest.mark.parametrize("dtype", slow_except(torch.float32, DTYPES), ids=["fp32", "fp16", "bf16"])
def test_prefill(dtype):
    """Ragged requests over cached prefixes, each spanning several query tiles and KV blocks."""
    q_lens, prefixes = PREFILL_BATCH
    case = make_case(q_lens, prefixes, num_q_heads=8, num_kv_heads=1, head_dim=64, page_size=16, dtype=dtype, seed=3)
    tiles = prefill_tiles(dtype, 64, 8, MANY_SMS)
    assert q_lens[0] > tiles.block_rows and prefixes[0] > 2 * tiles.block_n
    for options in OPTIONS.values():
        check(torch.ops.hybrid.prefill, case, options, MANY_SMS)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_torch_backend_same_cases(dtype):
    """The reference backend on the same batches, at the same tolerances."""
    for q_lens, prefixes, op in (
        ([1, 1], [290, 200], torch.ops.hybrid.decode),
        ([4], [290], torch.ops.hybrid.decode),
        (*PREFILL_BATCH, torch.ops.hybrid.prefill),
    ):
        case = make_case(
            q_lens,
            prefixes,
            num_q_heads=16 if q_lens == [4] else 8,
            num_kv_heads=1,
            head_dim=64,
            page_size=16,
            dtype=dtype,
            seed=3,
        )
        for options in OPTIONS.values():
            check(op, case, options, None, backend="torch")


# MLA over its latent cache (DeepSeek's D 576 = 512 + a rope part of 64, its values the first 512 of each row: v_cache
# = k_cache[..., :512]) with a GPU's tiles: the scores in two dots (512 + 64 columns, not one padded to 1024), V read
# with K's first block, 16 or 128 query heads on the one kv head. Logits of standard deviation 2, as above.
MLA_OPTIONS = {"plain": dict(scale=1 / 12), "window_softcap": dict(scale=1 / 12, sliding_window=150, logit_cap=10.0)}
MLA_BLOCKS = (512, 64, 512)  # `head_blocks(576, 512)`: BLOCK_D, BLOCK_ROPE, BLOCK_DV


def mla_case(q_lens, prefixes, num_q_heads, dtype, latent=True):
    """A latent case, or (latent=False) values of their own in a cache of their own, at D 576 / Dv 512."""
    dims = dict(num_q_heads=num_q_heads, head_dim=576, v_head_dim=512, page_size=16, dtype=dtype, seed=num_q_heads)
    case = latent_case(q_lens, prefixes, **dims) if latent else make_case(q_lens, prefixes, num_kv_heads=1, **dims)
    assert head_blocks(576, 512) == MLA_BLOCKS
    assert values_in_keys(case.k_cache, case.v_cache, MLA_BLOCKS) == latent
    return case


# (q_len, Hq, dtype): DECODE at 128 heads, TARGET_VERIFY of 4 drafts at 16.
MLA_DECODE = [(1, 128, torch.bfloat16), (4, 16, torch.float32), (1, 128, torch.float32), (4, 16, torch.float16)]


@pytest.mark.parametrize("q_len, num_q_heads, dtype", slow_except(MLA_DECODE[0], MLA_DECODE), ids=str)
def test_mla_latent_decode(q_len, num_q_heads, dtype):
    """The rows of a request in several row tiles, its KV range in 3 non-empty splits of 2 KV blocks each."""
    case = mla_case([q_len] * 2, [150, 61], num_q_heads, dtype)
    rows = q_len * num_q_heads
    tiles = decode_tiles(dtype, 576, rows, MANY_SMS)
    row_tiles = -(-rows // tiles.block_rows)
    assert row_tiles >= 2, "one row tile"
    target = Target(num_sms=2 * 2 * row_tiles, interpret=True)  # 4 splits over the table's 11 pages
    splits = num_kv_splits(2 * row_tiles, case.block_table.shape[1] * 16, tiles.block_n, target.num_sms)
    chunk = math.ceil(math.ceil((150 + q_len) / splits) / tiles.block_n) * tiles.block_n
    assert chunk >= 2 * tiles.block_n and (150 + q_len) // chunk >= 2
    for options in MLA_OPTIONS.values():
        check(torch.ops.hybrid.decode, case, options, target)


@pytest.mark.parametrize(
    "num_q_heads, dtype",
    slow_except((128, torch.bfloat16), [(128, torch.bfloat16), (16, torch.float32), (128, torch.float16)]),
    ids=str,
)
def test_mla_latent_prefill(num_q_heads, dtype):
    """Ragged requests over prefixes, spanning several query tiles and KV blocks; 128 heads take several programs
    (head tiles) per query tile."""
    q_lens, prefixes = [5, 9, 0], [40, 0, 21]
    case = mla_case(q_lens, prefixes, num_q_heads, dtype)
    tiles = prefill_tiles(dtype, 576, num_q_heads, MANY_SMS)
    assert max(q_lens) > tiles.block_rows and prefixes[0] > tiles.block_n
    assert num_q_heads == 16 or num_q_heads // tiles.block_heads >= 2, "one head tile"
    for options in MLA_OPTIONS.values():
        check(torch.ops.hybrid.prefill, case, options, MANY_SMS)


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_mla_values_of_their_own(op):
    """D 576 / Dv 512 with values unlike their keys' first 512, in a cache of their own: V read from it."""
    q_lens = [1, 1] if op == "decode" else [6, 3]
    case = mla_case(q_lens, [40, 17], 16, torch.bfloat16, latent=False)
    check(getattr(torch.ops.hybrid, op), case, MLA_OPTIONS["plain"], MANY_SMS)


def test_mla_reduce_in_column_blocks():
    """64 splits of Dv 512: the reduction takes the partials' columns in two blocks of 256 (`reduce_columns`), most
    splits empty."""
    assert reduce_columns(64, 512) == 256
    case = mla_case([1], [300], 16, torch.bfloat16)
    k_ref, _ = expected_cache(case)
    kv_store.store_kv(case.k, case.v, case.k_cache, case.v_cache, *case.args[5:])
    assert torch.equal(case.k_cache, k_ref)
    options = Options(**MLA_OPTIONS["plain"])
    out = decode(case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_table, options, MANY_SMS, 64)
    assert excess(out, reference(case, **MLA_OPTIONS["plain"])) <= 1
