"""The Triton kernels with a GPU's tiles, stages and SM count, run by the interpreter, against the float64 reference.

The interpreter's own tiles (128 keys, 128 query rows) leave small cases inside one block; here a decode program
walks several KV blocks, a request's queries span several tiles (prefill) or row tiles (decode), and the KV range
splits into several non-empty parts, with and without a sliding window and soft-cap. bf16 is held to a tolerance
that a 1% softmax-scale error fails, checked on the same case.
"""

import contextlib
import math

import pytest
import torch
from helpers.reference import expected_cache, make_case, reference, slow_except

import hybrid_ops
from hybrid_ops.kernels.config import Target, decode_tiles, prefill_tiles
from hybrid_ops.kernels.decode import num_kv_splits

# Per element |out - ref| <= atol + rtol * |ref|. Measured on these cases (interpreter): fp32 1e-6, fp16 2e-4,
# bf16 within one bf16 ulp of the output (the interpreter truncates fp32 -> bf16; an ulp is at most 2^-7 |x|).
# `check` shows on each case that a 1% error of the softmax scale exceeds it.
TOLERANCE = {torch.float32: (2e-5, 0.0), torch.float16: (1e-3, 0.0), torch.bfloat16: (1e-3, 2**-7)}
MANY_SMS = Target(num_sms=132, interpret=True)  # an H200: GPU tiles, stages and SM count
# Logits of standard deviation 2 (scale 2 / sqrt(D)), so that the scale matters.
OPTIONS = {"plain": dict(scale=0.25), "window_softcap": dict(scale=0.25, sliding_window=150, logit_cap=10.0)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@contextlib.contextmanager
def launch_target(target):
    backend = hybrid_ops.get_backend("triton")
    saved, backend.target = backend.target, target
    try:
        yield
    finally:
        backend.target = saved


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
