"""The Triton kernels through the interpreter: every head dim and dtype, split-KV decode, compile, packaging, fp8
caches (at the kernels' boundaries, and the conversions against torch's)."""

import math
import os
import random
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from helpers.reference import (
    assert_close,
    expected_cache,
    fp8_case,
    fp8_hard_values,
    fp8_store_case,
    make_case,
    random_tree,
    reference,
    slow_except,
    tree_mask_for,
)

import hybrid_ops
from hybrid_ops.kernels import decode as decode_kernels
from hybrid_ops.kernels import kv_store
from hybrid_ops.kernels import prefill as prefill_kernels
from hybrid_ops.kernels.common import FP8_FORMATS, float_to_fp8, fp8_to_float
from hybrid_ops.kernels.config import INTERPRETER, Target, decode_tiles, prefill_tiles
from hybrid_ops.options import Options

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GPU_TILES = Target(num_sms=2, interpret=True)  # a GPU's tiles and stages; the tests choose the KV splits


def run_kernel(path, case, options, num_splits=None, target=GPU_TILES):
    """The kernel of `path` ("prefill" or "decode") on the case's q, caches and metadata with a GPU's tiles (or
    `target`'s); options: the ops' keywords, scale required (k_scale, v_scale [Hkv] with fp8 caches), as backends
    receive them."""
    options = Options(**options)
    if path == "decode":
        return decode_kernels.decode(
            case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_table, options, target, num_splits
        )
    metadata = (case.cu_seqlens_q, case.seq_lens, case.block_table)
    return prefill_kernels.prefill(case.q, case.k_cache, case.v_cache, *metadata, options, target)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", slow_except(64, [64, 80, 96, 128, 256]))
def test_head_dims(head_dim, dtype):
    case = make_case([4, 7], [9, 0], num_q_heads=4, num_kv_heads=2, head_dim=head_dim, page_size=8, dtype=dtype)
    k_ref, v_ref = expected_cache(case)
    out = torch.ops.hybrid.prefill(*case.args, backend="triton", sliding_window=8, logit_cap=5.0)
    assert_close(out, reference(case, sliding_window=8, logit_cap=5.0), dtype)
    assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref)
    case = make_case([2, 2], [9, 30], num_q_heads=4, num_kv_heads=1, head_dim=head_dim, page_size=8, dtype=dtype)
    out = torch.ops.hybrid.decode(*case.args, backend="triton", scale=0.1)
    assert_close(out, reference(case, scale=0.1), dtype)


@pytest.mark.parametrize("num_splits", slow_except(16, [1, 3, 16]))
@pytest.mark.parametrize("window", [-1, 5])
def test_decode_splits(num_splits, window):
    """More splits than the requests have pages (empty splits) and fewer; the reduction is exact either way."""
    case = make_case([1, 1, 1], [0, 6, 40], num_q_heads=8, num_kv_heads=2, page_size=4, seed=num_splits)
    torch.ops.hybrid.decode(*case.args, backend="torch")  # stores the new tokens
    scale = case.q.shape[-1] ** -0.5
    options = Options(scale=scale, sliding_window=window)
    out = decode_kernels.decode(
        case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_table, options, INTERPRETER, num_splits
    )
    assert_close(out, reference(case, sliding_window=window), torch.float32)


# A value head dim Dv of its own (MLA), at the kernels' boundaries with a GPU's tiles: (D, Dv, q dtype, options).
# Dv smaller and larger than D, neither always a power of two; DeepSeek's 192 / 128 pads K to 256 and V to 128.
V_HEAD_DIMS = {
    "d192_dv128_bf16_sinks": (192, 128, torch.bfloat16, dict(scale=0.15, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))),
    "d64_dv24_fp32_window_softcap": (64, 24, torch.float32, dict(scale=0.25, sliding_window=200, logit_cap=10.0)),
    "d24_dv80_fp16_chunk": (24, 80, torch.float16, dict(scale=0.4, attention_chunk=100)),
}


def v_head_dim_case(name, q_lens, prefixes, num_q_heads):
    head_dim, v_head_dim, dtype, options = V_HEAD_DIMS[name]
    options = dict(options, sinks=options["sinks"].repeat(num_q_heads // 4)) if "sinks" in options else options
    case = make_case(
        q_lens,
        prefixes,
        num_q_heads=num_q_heads,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=16,
        dtype=dtype,
        v_head_dim=v_head_dim,
    )
    kv_store.store_kv(case.k, case.v, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens, case.block_table)
    k_ref, v_ref = expected_cache(case)
    assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref)
    return case, options


@pytest.mark.parametrize("q_len", [1, 4], ids=["decode", "verify"])
@pytest.mark.parametrize("name", slow_except("d192_dv128_bf16_sinks", V_HEAD_DIMS))
def test_v_head_dim_decode(name, q_len):
    """3 KV splits of several KV blocks each; verify's 4 x 8 rows take 2 row tiles (1 at fp16, whose cap is 32)."""
    case, options = v_head_dim_case(name, [q_len] * 2, [290, 130], num_q_heads=16)
    head_dim, v_head_dim, dtype, _ = V_HEAD_DIMS[name]
    tiles = decode_tiles(dtype, max(head_dim, v_head_dim), q_len * 8, GPU_TILES)
    splits = 3
    visible = min(290 + q_len, options.get("sliding_window", 1000))
    chunk = math.ceil(math.ceil(visible / splits) / tiles.block_n) * tiles.block_n  # as the kernel splits
    assert chunk >= 2 * tiles.block_n and visible > 2 * chunk, "splits of one KV block, or fewer than 3 non-empty"
    out = run_kernel("decode", case, options, num_splits=splits)
    assert out.shape == (case.q.shape[0], 16, v_head_dim)
    assert_close(out, reference(case, **options), dtype)


@pytest.mark.parametrize("name", slow_except("d24_dv80_fp16_chunk", V_HEAD_DIMS))
def test_v_head_dim_prefill(name):
    """Requests spanning several query tiles and KV blocks."""
    q_lens, prefixes = [40, 3, 17], [70, 0, 33]
    case, options = v_head_dim_case(name, q_lens, prefixes, num_q_heads=8)
    head_dim, v_head_dim, dtype, _ = V_HEAD_DIMS[name]
    tiles = prefill_tiles(dtype, max(head_dim, v_head_dim), 4, GPU_TILES)
    assert q_lens[0] > tiles.block_rows and prefixes[0] > tiles.block_n
    out = run_kernel("prefill", case, options)
    assert out.shape == (sum(q_lens), 8, v_head_dim)
    assert_close(out, reference(case, **options), dtype)


@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_v_head_dim_above_256_refused(op):
    """Its tile tables stop at 256: `supports` refuses a larger Dv, so "auto" takes another backend."""
    case = make_case([1], [3], v_head_dim=264)
    before = case.v_cache.clone()
    with pytest.raises(hybrid_ops.HybridInputError, match="does not support .* D = 16, Dv = 264"):
        getattr(torch.ops.hybrid, op)(*case.args, backend="triton")
    assert torch.equal(case.v_cache, before)
    spec = hybrid_ops.backends.Spec(torch.device("cpu"), torch.float32, torch.float32, 16, 264, frozenset())
    assert not hybrid_ops.get_backend("triton").supports(spec)


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["q_dtype", "e4m3"])
def test_rows_past_the_last_request_are_not_stored(cache_dtype):
    """Without validation, q, k, v may have rows past cu_seqlens_q[-1] (a CUDA-graph bucket's padding): the store
    writes the real tokens only, never a position at or past a request's seq_len. The last request ends one row
    short of its third page and its table row has a spare column, so such a write would land in the cache; every
    other byte (the prefixes, POISON in every other slot) stays, and the real rows attend as without the padding."""
    case = make_case([3, 0, 5, 2], [6, 4, 0, 9], page_size=4)  # seq_lens 9, 4, 5, 11
    read, scales, expected = case, {}, [cache.view(torch.uint8) for cache in expected_cache(case)]
    if cache_dtype is not None:
        scales = dict(k_scale=torch.tensor([0.5, 2.0]), v_scale=torch.tensor([1.5, 0.25]))
        case, read, expected = fp8_case(case, cache_dtype, *scales.values())
    q, k, v = (torch.cat([t, torch.randn(6, *t.shape[1:])]) for t in (case.q, case.k, case.v))
    out = torch.ops.hybrid.prefill(q, k, v, *case.args[3:], backend="triton", **scales)
    assert_close(out[: case.q.shape[0]], reference(read), torch.float32)
    assert torch.equal(case.k_cache.view(torch.uint8), expected[0])
    assert torch.equal(case.v_cache.view(torch.uint8), expected[1])


def test_num_splits_from_static_sizes():
    sms = 132
    assert decode_kernels.num_kv_splits(1 * 8, 32768, 64, sms) == 33  # a batch of 1 still fills the GPU
    assert decode_kernels.num_kv_splits(64 * 8, 4096, 64, sms) == 1
    assert decode_kernels.num_kv_splits(4 * 8, 64, 64, sms) == 1  # never more splits than KV blocks
    assert decode_kernels.num_kv_splits(1 * 8 * 4, 32768, 64, sms) == 9  # row tiles count as programs


def test_matches_torch_backend():
    case = make_case([5, 1, 12], [3, 30, 0], num_q_heads=6, num_kv_heads=2, page_size=16, dtype=torch.float16)
    args_torch = [a.clone() for a in case.args]
    out_triton = torch.ops.hybrid.prefill(*case.args, backend="triton")
    out_torch = torch.ops.hybrid.prefill(*args_torch, backend="torch")
    assert (out_triton.float() - out_torch.float()).abs().max() < 2e-3
    assert torch.equal(case.k_cache, args_torch[3]) and torch.equal(case.v_cache, args_torch[4])


def test_compiled_with_triton_backends(fresh_dynamo):

    def step(*args):
        """args: the op's positional arguments, forward_mode an int."""
        return torch.ops.hybrid.attn(*args, prefill_backend="triton", decode_backend="triton")

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for mode, q_lens in [(1, [3, 5]), (2, [1, 1]), (5, [2, 2]), (3, [4, 1])]:
        case = make_case(q_lens, [6, 2], seed=mode)
        assert_close(compiled(*case.args, mode), reference(case), torch.float32)


def test_import_without_triton():
    """hybrid_ops imports without Triton; asking for it is a clear error."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, hybrid_ops\n"
        "q = torch.zeros(0, 2, 8); kc = torch.zeros(1, 1, 1, 8); i = torch.zeros(1, dtype=torch.int32)\n"
        "try:\n"
        "    torch.ops.hybrid.prefill(q, q[:, :1], q[:, :1], kc, kc, i, i[:0], i[:0].view(0, 1), backend='triton')\n"
        "except hybrid_ops.HybridInputError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "backend='triton' needs triton" in result.stdout


def test_auto_picks_the_native_kernels_on_cpu():
    """Not Triton's interpreter, even when it is on."""
    spec = hybrid_ops.backends.Spec(torch.device("cpu"), torch.float32, torch.float32, 8, 8, frozenset())
    assert hybrid_ops.get_backend("auto", spec).name == "cpu"


# -- fp8 caches --------------------------------------------------------------------------------------------------

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_scales(num_kv_heads, per_head):
    """(k_scale, v_scale) as the ops pass them: [Hkv] float32, one per kv head spread over [0.05, 4] (a kernel that
    takes another head's scale is off by far), or one value expanded (stride 0)."""
    if per_head:
        return tuple(torch.exp(torch.empty(num_kv_heads).uniform_(-3, 1.4)) for _ in range(2))
    return torch.tensor([0.3]).expand(num_kv_heads), torch.tensor([2.5]).expand(num_kv_heads)


def run_fp8(case, cache_dtype, per_head, attend, **options):
    """Stores the case's new k, v into fp8 caches with the Triton store and attends with `attend(fp8 case, k_scale,
    v_scale)`; checks the output against float64 over the dequantized cache and the cache bytes exactly."""
    k_scale, v_scale = fp8_scales(case.k.shape[1], per_head)
    fp8, read, (k_expected, v_expected) = fp8_case(case, cache_dtype, k_scale, v_scale)
    kv_store.store_kv(
        fp8.k, fp8.v, fp8.k_cache, fp8.v_cache, fp8.cu_seqlens_q, fp8.seq_lens, fp8.block_table, k_scale, v_scale
    )
    assert torch.equal(fp8.k_cache.view(torch.uint8), k_expected), "k_cache differs from the quantized values"
    assert torch.equal(fp8.v_cache.view(torch.uint8), v_expected), "v_cache differs from the quantized values"
    out = attend(fp8, k_scale, v_scale)
    assert_close(out, reference(read, **options), case.q.dtype)


# (q dtype, head dim, page size, q_len, Hq/Hkv, splits, options): each KV split spans several KV blocks; verify's
# 4 x 8 rows take 2 row tiles at fp32; D 80 is padded to 128.
FP8_DECODE = {
    "bf16_d64": (torch.bfloat16, 64, 16, 1, (8, 2), 3, dict(scale=0.25)),
    "fp16_d80_window": (torch.float16, 80, 4, 1, (4, 1), 3, dict(scale=0.25, sliding_window=270)),
    "fp32_verify_softcap": (torch.float32, 64, 16, 4, (16, 2), 3, dict(scale=0.25, logit_cap=10.0)),
}


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("name", slow_except("bf16_d64", FP8_DECODE))
def test_fp8_decode(name, cache_dtype):
    dtype, head_dim, page_size, q_len, (num_q_heads, num_kv_heads), splits, options = FP8_DECODE[name]
    case = make_case(
        [q_len] * 2,
        [290, 130],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )
    block_n = decode_tiles(dtype, head_dim, q_len * num_q_heads // num_kv_heads, GPU_TILES).block_n
    visible = min(290 + q_len, options.get("sliding_window", 1000))  # the longest request's keys
    chunk = math.ceil(math.ceil(visible / splits) / block_n) * block_n  # as the kernel splits
    assert chunk >= 2 * block_n and visible > 2 * chunk, "splits of one KV block, or fewer than 3 non-empty"

    def attend(fp8, k_scale, v_scale):
        return run_kernel("decode", fp8, options | dict(k_scale=k_scale, v_scale=v_scale), num_splits=splits)

    run_fp8(case, cache_dtype, cache_dtype == torch.float8_e4m3fn, attend, **options)


# (q dtype, head dim, page size, Hq/Hkv, options): requests spanning several query tiles and KV blocks.
FP8_PREFILL = {
    "bf16_d64": (torch.bfloat16, 64, 16, (8, 2), dict(scale=0.25)),
    "fp16_d80_window": (torch.float16, 80, 1, (4, 1), dict(scale=0.25, sliding_window=40)),
    "fp32_softcap": (torch.float32, 64, 16, (8, 2), dict(scale=0.25, logit_cap=10.0)),
}


@pytest.mark.parametrize("cache_dtype", slow_except(torch.float8_e4m3fn, FP8), ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("name", slow_except("bf16_d64", FP8_PREFILL))
def test_fp8_prefill(name, cache_dtype):
    dtype, head_dim, page_size, (num_q_heads, num_kv_heads), options = FP8_PREFILL[name]
    q_lens, prefixes = [40, 3, 17], [70, 0, 33]
    case = make_case(
        q_lens,
        prefixes,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )
    tiles = prefill_tiles(dtype, head_dim, num_q_heads // num_kv_heads, GPU_TILES)
    assert q_lens[0] > tiles.block_rows and prefixes[0] > tiles.block_n

    def attend(fp8, k_scale, v_scale):
        return run_kernel("prefill", fp8, options | dict(k_scale=k_scale, v_scale=v_scale))

    run_fp8(case, cache_dtype, cache_dtype == torch.float8_e4m3fn, attend, **options)


@pytest.mark.parametrize("op", slow_except("decode", ["decode", "prefill"]))
@pytest.mark.parametrize(
    "head_dim, v_head_dim, dtype",
    [(192, 128, torch.bfloat16), (64, 24, torch.float16)],
    ids=["d192_dv128_bf16", "d64_dv24_fp16"],
)
def test_fp8_v_head_dim(head_dim, v_head_dim, dtype, op):
    """e4m3 caches with per-head scales and a value head dim of its own, over 3 KV splits or several query tiles."""
    q_lens, prefixes = ([1, 1], [290, 130]) if op == "decode" else ([40, 3, 17], [70, 0, 33])
    case = make_case(
        q_lens,
        prefixes,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=16,
        dtype=dtype,
        v_head_dim=v_head_dim,
    )

    def attend(fp8, k_scale, v_scale):
        splits = dict(num_splits=3) if op == "decode" else {}
        return run_kernel(op, fp8, dict(scale=0.15, k_scale=k_scale, v_scale=v_scale), **splits)

    run_fp8(case, torch.float8_e4m3fn, True, attend, scale=0.15)


@triton.jit
def _convert_kernel(X, Codes, AnyCodes, Values, n, FP8: tl.constexpr, BLOCK: tl.constexpr):
    """Codes[i] = float_to_fp8(X[i]); Values[i] = fp8_to_float(AnyCodes[i])."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Codes + i, float_to_fp8(tl.load(X + i, mask=i < n), FP8), mask=i < n)
    tl.store(Values + i, fp8_to_float(tl.load(AnyCodes + i, mask=i < n), FP8), mask=i < n)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_fp8_conversions_match_torch(cache_dtype):
    """The kernels' fp32 -> fp8 (torch's clamp, then conversion) and fp8 -> fp32 (every code), bit for bit, on the
    values where conversions go wrong (ties, subnormals, saturation, +-0, NaN) and 2^20 random bit patterns."""
    random_bits = torch.randint(-(2**31), 2**31, (1 << 20,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([fp8_hard_values(cache_dtype), random_bits])
    any_codes = (torch.arange(x.numel()) % 256).to(torch.uint8)
    codes, values = torch.empty(x.shape, dtype=torch.uint8), torch.empty(x.shape)
    block = 1 << 16
    _convert_kernel[(triton.cdiv(x.numel(), block),)](
        x, codes, any_codes, values, x.numel(), FP8=FP8_FORMATS[cache_dtype], BLOCK=block
    )
    limit = torch.finfo(cache_dtype).max
    expected = x.clamp(-limit, limit).to(cache_dtype).view(torch.uint8)
    wrong = codes != expected
    assert not wrong.any(), f"{wrong.sum()} values, e.g. {x[wrong][:4].tolist()} -> {codes[wrong][:4].tolist()}"
    read = any_codes.view(cache_dtype).float()
    same = (values.view(torch.int32) == read.view(torch.int32)) | (values.isnan() & read.isnan())
    assert same.all(), f"codes {any_codes[~same][:4].tolist()} read as {values[~same][:4].tolist()}"


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_fp8_store_at_ties(cache_dtype):
    """The store divides (correctly rounded) before it converts: quotients at and next to ties, per-head scales."""
    k_scale, v_scale = torch.tensor([1.0, 0.37]), torch.tensor([3.1, 1.0])
    fp8, _, (k_expected, v_expected) = fp8_case(
        fp8_store_case(cache_dtype, k_scale, v_scale), cache_dtype, k_scale, v_scale
    )
    kv_store.store_kv(
        fp8.k, fp8.v, fp8.k_cache, fp8.v_cache, fp8.cu_seqlens_q, fp8.seq_lens, fp8.block_table, k_scale, v_scale
    )
    assert torch.equal(fp8.k_cache.view(torch.uint8), k_expected) and torch.equal(
        fp8.v_cache.view(torch.uint8), v_expected
    )


# -- speculative trees -------------------------------------------------------------------------------------------

# (q dtype, D, Dv, Hq/Hkv, page size, cache dtype, options): windows and chunks shorter than the trees' depths, so
# that positions (prefix + depth), not slots, decide what a node sees of the prefix and of its ancestors.
TREES = {
    "fp32_window_chunk_softcap": (
        torch.float32, 64, 64, (4, 2), 16, None,
        dict(scale=0.25, sliding_window=5, attention_chunk=7, logit_cap=10.0),
    ),
    "bf16_dv24_sinks_window": (
        torch.bfloat16, 64, 24, (4, 1), 4, None,
        dict(scale=0.25, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]), sliding_window=12),
    ),
    "fp16_d80_e4m3_chunk": (torch.float16, 80, 80, (4, 1), 1, torch.float8_e4m3fn, dict(scale=0.25, attention_chunk=6)),
}  # fmt: skip


def tree_mask_unread_random(trees, width, rng):
    """The [T, width] tree mask of `trees` (`tree_mask_for`) with every entry the kernels must not read random: past
    each request's tokens, and on and above each request's diagonal (the diagonal False about half the time)."""
    mask, start = tree_mask_for(trees, width, rng), 0
    for rows in trees:
        n = rows.shape[0]
        noise = torch.tensor([[rng.random() < 0.5 for _ in range(n)] for _ in range(n)], dtype=torch.bool)
        unread = torch.ones(n, n, dtype=torch.bool).triu()
        mask[start : start + n, :n] = torch.where(unread, noise.view(n, n), rows)
        start += n
    return mask


def check_tree_kernel(name, path, trees, prefixes, num_splits=None):
    """The kernel of `path` with a GPU's tiles over `trees` (a column-major mask of 64 columns, the unread entries
    random) against the float64 reference; fp8 caches through the Triton store, their bytes checked."""
    dtype, head_dim, v_head_dim, (num_q_heads, num_kv_heads), page_size, cache_dtype, options = TREES[name]
    heads = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    dims = dict(head_dim=head_dim, v_head_dim=v_head_dim, page_size=page_size, dtype=dtype)
    case = make_case([t.shape[0] for t in trees], prefixes, **heads, **dims)
    tree_mask = tree_mask_unread_random(trees, 64, random.Random(len(trees)))
    options = dict(options, tree_mask=tree_mask.t().contiguous().t())  # column-major: both strides count
    splits = {} if num_splits is None else dict(num_splits=num_splits)

    def attend(attended, k_scale=None, v_scale=None):
        scales = {} if k_scale is None else dict(k_scale=k_scale, v_scale=v_scale)
        return run_kernel(path, attended, options | scales, **splits)

    if cache_dtype is not None:
        return run_fp8(case, cache_dtype, True, attend, **options)
    kv_store.store_kv(case.k, case.v, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens, case.block_table)
    assert_close(attend(case), reference(case, **options), dtype)


@pytest.mark.parametrize("name", slow_except("fp32_window_chunk_softcap", TREES))
def test_tree_prefill(name):
    """A 64-node tree over a long prefix across several query tiles and KV blocks (a tile's first key from its
    rows' lowest position), a smaller tree without prefix, a single node."""
    rng = random.Random(1)
    trees = [random_tree(9, 7, rng, full=True)[0], random_tree(5, 4, rng)[0], random_tree(0, 1, rng)[0]]
    dtype, head_dim, v_head_dim, (num_q_heads, num_kv_heads), *_ = TREES[name]
    tiles = prefill_tiles(dtype, max(head_dim, v_head_dim), num_q_heads // num_kv_heads, GPU_TILES, tree=True)
    assert trees[0].shape[0] == 64 >= 2 * tiles.block_rows and 150 > 2 * tiles.block_n
    check_tree_kernel(name, "prefill", trees, [150, 0, 37])


@pytest.mark.parametrize("name", slow_except("bf16_dv24_sinks_window", TREES))
def test_tree_verify(name):
    """Verify over two 64-node trees: several row tiles, 3 KV splits, the new tokens across a split boundary."""
    rng = random.Random(2)
    trees = [random_tree(9, 7, rng, full=True)[0] for _ in range(2)]
    dtype, head_dim, v_head_dim, (num_q_heads, num_kv_heads), *_, options = TREES[name]
    rows = 64 * num_q_heads // num_kv_heads
    tiles = decode_tiles(dtype, max(head_dim, v_head_dim), rows, GPU_TILES)
    prefix = 230
    lo = max(prefix + 1 - options.get("sliding_window", prefix + 1), 0)
    chunk = math.ceil(math.ceil((prefix + 64 - lo) / 3) / tiles.block_n) * tiles.block_n  # as the kernel splits
    assert rows >= 4 * tiles.block_rows and (prefix - lo) // chunk < (prefix + 63 - lo) // chunk
    check_tree_kernel(name, "decode", trees, [prefix, 90], num_splits=3)


@pytest.mark.parametrize("path", slow_except("prefill", ["prefill", "decode"]))
def test_causal_tree_is_the_chain(path):
    """A causal tree (its unread entries random), window and chunk on: its bits are all set and its positions are the
    slots (so are the tiles' first keys and the splits), and the tree only ANDs them into the same computation. So
    where the tiles are the same, decode's with a GPU's tiles and prefill's with the interpreter's, the output is
    tree_mask=None's bit for bit; a GPU's prefill takes half the keys per step with a tree (the reference's
    tolerance there)."""
    q_lens = [64, 64] if path == "decode" else [64, 9, 30]
    case = make_case(q_lens, [230, 90, 7][: len(q_lens)], num_q_heads=4, num_kv_heads=2, page_size=16)
    kv_store.store_kv(case.k, case.v, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens, case.block_table)
    causal = [torch.ones(n, n, dtype=torch.bool).tril() for n in q_lens]
    options = dict(scale=0.25, sliding_window=5, attention_chunk=7)
    tree = options | dict(tree_mask=tree_mask_unread_random(causal, 64, random.Random(3)))
    if path == "decode":
        assert torch.equal(run_kernel(path, case, tree, num_splits=3), run_kernel(path, case, options, num_splits=3))
        return
    assert torch.equal(
        run_kernel(path, case, tree, target=INTERPRETER), run_kernel(path, case, options, target=INTERPRETER)
    )
    assert_close(run_kernel(path, case, tree), reference(case, **options), torch.float32)
