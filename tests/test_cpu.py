"""The native CPU backend on long contexts: past its key-slice boundaries (256 keys for units of every kv head, 512 for
units of one), tile boundaries (64 keys for few rows, 256 for many), query blocks (512 rows), row chunks of its
products (64 rows, padded to 16) and page boundaries, both row paths (few rows: dot products over every kv head; many:
brgemm per kv head, in fp32 or in 16-bit on AMX), head dims 8, 20, 64, 80 and 128 (read in place, or copied and
padded), with -1 past each request's pages; with sinks, chunks and value head dims of their own; the same over fp8
caches, whose bytes must be torch's quantization; speculative trees (tree_mask) on both row paths."""

import math
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.reference import expected_cache, fp8_case, fp8_store_case, make_case, reference, tree_mask_for

import hybrid_ops
from hybrid_ops import ROUTING, ForwardMode, select_path
from hybrid_ops.backends.cpu import _files, capability_flags, kernel_capability
from hybrid_ops.backends.torch_ref import TorchBackend
from hybrid_ops.fp8 import per_head
from hybrid_ops.options import Options

# Max abs error over the reference's largest magnitude: long contexts average many values, so outputs are small
# and an absolute bound would let a 1% error through. The bounds sit above each dtype's output rounding.
RELATIVE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 5e-3}

# op, q_lens, prefix_lens, Hq, head dim, page size; 2 kv heads (make_case's default).
CASES = {
    # Units of every kv head: 5 slices, exactly 2, and a slice boundary at the last key; page 16.
    "decode": ("decode", [1] * 3, [1100, 511, 1536], 8, 128, 16),
    # 3 draft tokens x group 4 = 12 rows per kv head: units of every kv head; 3 and 2 slices; page 7; head dim 80.
    "verify_all_heads": ("decode", [3] * 2, [600, 260], 8, 80, 7),
    # 8 draft tokens x group 16 = 128 rows (the many-rows path, with AMX from 16 rows: `GEMM_ROWS`); head dim 80
    # (copied rows where a vector holds 16 floats); page 5.
    "verify": ("decode", [8] * 2, [700, 1030], 32, 80, 5),
    # A short chunk over a long prefix (one query block: sliced keys) beside a chunk of two query blocks (group 4:
    # 128 tokens a block; 600 rows), whose tiles are packed once: from key 0, or (window 77) from the second tile.
    "chunk_over_prefix": ("prefill", [9, 150], [1200, 400], 8, 64, 16),
    # A head dim of no whole vectors (zero-padded in every tile), a prefix that ends mid-page, pages of 3; a chunk of
    # two query blocks (group 2: 256 tokens a block), whose tiles are packed once.
    "head_dim_20": ("prefill", [40, 300], [37, 0], 4, 20, 3),
    # Positions of 32 bytes in 16-bit caches (D 8, 2 kv heads): where a vector holds 8 floats (AVX2, DEFAULT) the rows
    # are read in place and a 4 KiB memory page holds more positions than a tile.
    "small_positions": ("decode", [1] * 2, [300, 70], 4, 8, 16),
    # Fresh prefills, one of two query blocks (group 1: 512 tokens a block), page 1.
    "prefill": ("prefill", [600, 70], [0, 0], 2, 128, 1),
    # Few rows (2 draft tokens x group 2) of a head dim of no whole vectors: units of one kv head over rows copied to
    # fp32; 2 slices and 1; page 3.
    "verify_head_dim_20": ("decode", [2] * 2, [700, 90], 4, 20, 3),
}
OPTIONS = {
    "default": dict(),
    "window": dict(sliding_window=200),  # the window's start moves across slices and tiles
    "softcap_scale": dict(logit_cap=5.0, scale=0.05),
    "window_softcap": dict(sliding_window=77, logit_cap=2.0),
    # Chunks of 300 positions start inside slices, tiles and query blocks; sinks as heavy as a chunk's keys.
    "sinks_chunk": dict(sinks=True, attention_chunk=300),
    # A value head dim 16 past the q/k one: whole vectors where D is (read in place), else copied and padded.
    "v_head_dim_sinks_window": dict(v_head_dim=16, sinks=True, sliding_window=200),
}


def long_case(name, option, dtype, seed, cases=CASES, options=OPTIONS):
    """cases[name]'s op; its case, the table entries past each request's pages at -1 (as transformers' paged cache pads
    them); and options[option] as op keywords: a value head dim (v_head_dim: that much past the head dim) in the case,
    sinks (True) drawn for its query heads."""
    op, q_lens, prefix_lens, num_q_heads, head_dim, page_size = cases[name]
    options = dict(options[option])
    v_head_dim = head_dim + options.pop("v_head_dim", 0)
    case = make_case(
        q_lens,
        prefix_lens,
        num_q_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        seed=seed,
        v_head_dim=v_head_dim,
    )
    if options.get("sinks"):
        # About the log of a row's summed probabilities (hundreds of keys of N(0, 1) scores): each moves its head's
        # output by tens of percent, so that an ignored sink, or another head's, fails.
        options["sinks"] = 6.0 + torch.randn(num_q_heads, generator=torch.Generator().manual_seed(seed))
    for i, length in enumerate(case.seq_lens.tolist()):
        case.block_table[i, math.ceil(length / page_size) :] = -1
    return op, case, options


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def diagonal(*axes):
    """Every combination of the axes' keys as a pytest.param, those off a diagonal marked slow: the fast tier (which
    .ci/run also runs at ATEN_CPU_CAPABILITY=default) takes each key of the first axis once with each key of the
    second, and the third's keys in turn, so that each path and option still runs there at least once."""
    params = []
    for i, a in enumerate(axes[0]):
        for j, b in enumerate(axes[1]):
            for k, c in enumerate(axes[2]):
                fast = k == (i + 2 * j) % len(axes[2])
                params.append(pytest.param(a, b, c, id=f"{a}-{b}-{c}", marks=() if fast else pytest.mark.slow))
    return params


@pytest.mark.parametrize("name, dtype, option", diagonal(CASES, DTYPES, OPTIONS))
def test_long_contexts_against_float64(name, dtype, option):
    dtype = DTYPES[dtype]
    check_long_case(name, option, dtype)


def check_long_case(name, option, dtype):
    """CASES[name] with OPTIONS[option] on the cpu backend against float64, the caches written as expected."""
    op, case, options = long_case(name, option, dtype, seed=7)
    k_ref, v_ref = expected_cache(case)
    out = getattr(torch.ops.hybrid, op)(*case.args, **options, backend="cpu")
    assert_relative(out, reference(case, **options), dtype)
    assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref)


def assert_relative(out, ref, dtype):
    error = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert out.dtype == dtype and out.shape == ref.shape
    assert error <= RELATIVE[dtype], f"relative error {error:.3g} > {RELATIVE[dtype]:.1g}"


FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_scales(kind, num_kv_heads):
    """(k_scale, v_scale): one per kv head, each head's at least 2x another's (a kernel that takes another head's scale
    is off by far), k's rising and v's falling; or one each, as [] and [1]."""
    if kind == "per_head":
        spread = torch.logspace(-1.3, 0.6, max(num_kv_heads, 2))[:num_kv_heads]
        return spread, spread.flip(0) * 1.7
    return torch.tensor(0.3), torch.tensor([2.5])


def check_fp8(op, case, cache_dtype, k_scale, v_scale, **options):
    """op over `case` with its caches quantized: the output against float64 over the dequantized values, and the new
    tokens' bytes in the caches exactly torch's quantization of them."""
    fp8, read, (k_expected, v_expected) = fp8_case(case, cache_dtype, k_scale, v_scale)
    out = getattr(torch.ops.hybrid, op)(*fp8.args, **options, k_scale=k_scale, v_scale=v_scale, backend="cpu")
    assert_relative(out, reference(read, **options), case.q.dtype)
    assert torch.equal(fp8.k_cache.view(torch.uint8), k_expected), "k_cache differs from torch's quantization"
    assert torch.equal(fp8.v_cache.view(torch.uint8), v_expected), "v_cache differs from torch's quantization"


# Each case with one q dtype; per-head scales without options and with a value head dim, sinks and a window; one
# scale with a window and a soft-cap.
FP8_DTYPES = dict(zip(CASES, [torch.bfloat16, torch.float32, torch.float16] * 3))
FP8_OPTIONS = {
    "per_head": ("per_head", "default"),
    "per_head_v_head_dim_sinks_window": ("per_head", "v_head_dim_sinks_window"),
    "one_window_softcap": ("one", "window_softcap"),
}


@pytest.mark.parametrize("name, cache_dtype, options", diagonal(CASES, FP8, FP8_OPTIONS))
def test_fp8_long_contexts_against_float64(name, cache_dtype, options):
    scales, option = FP8_OPTIONS[options]
    op, case, options = long_case(name, option, FP8_DTYPES[name], seed=11)
    check_fp8(op, case, FP8[cache_dtype], *fp8_scales(scales, case.k.shape[1]), **options)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_fp8_store_saturates(op, cache_dtype):
    """New k, v past the format's range (inf included) are stored as its largest value, as torch's conversion after the
    clamp: e5m2's conversion alone would make them inf. Decode reads them in place, prefill through brgemm."""
    q_lens = [1, 1] if op == "decode" else [20, 9]
    case = make_case(
        q_lens, [30, 70], num_q_heads=16, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float32, seed=12
    )
    k_scale, v_scale = fp8_scales("per_head", 2)
    limit = torch.finfo(FP8[cache_dtype]).max
    for t, kv_scale in ((case.k, k_scale), (case.v, v_scale)):
        t[:, :, :3] = torch.tensor([1e6, -1e9, math.inf])
        t[:, :, 3] = -1.1 * limit * kv_scale  # just past the range: e5m2's conversion alone would round it to -inf
    check_fp8(op, case, FP8[cache_dtype], k_scale, v_scale)


@pytest.mark.parametrize("head_dim", [64, 20])  # whole vectors; and a row's last values one by one
@pytest.mark.parametrize("cache_dtype", FP8)
def test_fp8_store_rounds_as_torch(cache_dtype, head_dim):
    """The store's bytes on the values where conversions go wrong (every fp8 value, the ties between neighbours and
    the floats beside them, subnormals, saturation, inf, NaN) times per-head scales: torch's quantization, bit for
    bit. The attention over them means nothing; it must only run."""
    k_scale, v_scale = torch.tensor([1.0, 0.37]), torch.tensor([3.1, 1.0])
    fp8, _, (k_expected, v_expected) = fp8_case(
        fp8_store_case(FP8[cache_dtype], k_scale, v_scale, head_dim), FP8[cache_dtype], k_scale, v_scale
    )
    torch.ops.hybrid.prefill(*fp8.args, k_scale=k_scale, v_scale=v_scale, backend="cpu")
    assert torch.equal(fp8.k_cache.view(torch.uint8), k_expected), "k_cache differs from torch's quantization"
    assert torch.equal(fp8.v_cache.view(torch.uint8), v_expected), "v_cache differs from torch's quantization"


def test_fp8_backend_object_takes_per_head_views():
    """The backend object's own call, as the ops' Python implementation makes it: scales as [Hkv] stride-0 views."""
    backend = hybrid_ops.get_backend("cpu")
    case = make_case(
        [1] * 3, [300, 5, 1000], num_q_heads=8, num_kv_heads=4, head_dim=64, page_size=16, dtype=torch.bfloat16, seed=13
    )
    k_scale, v_scale = torch.tensor(0.3), torch.tensor([2.5])
    fp8, read, (k_expected, v_expected) = fp8_case(case, torch.float8_e5m2, k_scale, v_scale)
    views = {name: per_head(s, 4, case.q.device) for name, s in (("k_scale", k_scale), ("v_scale", v_scale))}
    assert views["k_scale"].stride() == (0,)
    out = backend.decode(*fp8.args, Options(scale=0.125, **views))
    assert_relative(out, reference(read, scale=0.125), torch.bfloat16)
    assert torch.equal(fp8.k_cache.view(torch.uint8), k_expected)
    assert torch.equal(fp8.v_cache.view(torch.uint8), v_expected)


# fp8 widened 64 values at a time by byte look-ups (kernels/cpu/fp8.h: load_raw_wide), in the AVX512 builds with VBMI
# that CPUs with AVX512-VBMI load (hybrid_ops/backends/cpu.py).
needs_vbmi = pytest.mark.skipif(
    "VBMI" not in kernel_capability().split("_"),
    reason=f"the look-up builds are AVX512 with VBMI (ATen's AVX512 level on a CPU with AVX512-VBMI); here it is "
    f"{kernel_capability()}",
)
WIDE_LOAD = """#include "fp8.h"
using namespace hybrid_ops::cpu;
void widen_e4m3(const at::Float8_e4m3fn* p, Vec* out) { load_raw_wide(p, out); }
void widen_e5m2(const at::Float8_e5m2* p, Vec* out) { load_raw_wide(p, out); }
"""


def disassemble(source, capability, obj):
    """The disassembly of `source` (a path) compiled alone into `obj` with the flags of build `capability`, the kernels'
    headers on its include path; skips without a compiler or objdump."""
    from torch.utils.cpp_extension import include_paths

    compiler, objdump = shutil.which(os.environ.get("CXX", "g++")), shutil.which("objdump")
    if not compiler or not objdump:
        pytest.skip("no C++ compiler or objdump to build and read the object")
    includes = [f"-I{p}" for p in [*include_paths(), str(Path(_files(".h")[0]).parent)]]
    flags = ["-std=c++17", "-O3", "-c", *capability_flags(capability)]
    subprocess.run([compiler, *flags, *includes, str(source), "-o", str(obj)], check=True)
    return subprocess.run([objdump, "-d", str(obj)], check=True, capture_output=True, text=True).stdout


def test_fp8_wide_load_compiles_to_byte_permutes(tmp_path):
    """The wide load of the AVX512_VBMI build, compiled alone with its flags, is made of byte permutes (vpermb for the
    look-ups, vpermt2b or vpermi2b to place the bytes) and not of load_raw's sign extensions: on any machine."""
    source = tmp_path / "wide.cpp"
    source.write_text(WIDE_LOAD)
    code = disassemble(source, "AVX512_VBMI", tmp_path / "wide.o")
    for function in ("widen_e4m3", "widen_e5m2"):
        body = code.split(function, 1)[1].split("\n\n", 1)[0]
        assert body.count("vpermb") >= 2 and re.search(r"vperm[ti]2b", body), body
        assert "vpmovsxbd" not in body


def test_fp8_wide_load_is_load_raw_bit_for_bit():
    """Every pair of fp8 codes side by side (a code's high bits are looked up after a 16-bit shift, which brings in
    its neighbour's): the wide load's raw values are load_raw's bit for bit, and those are each finite code's value
    over raw_unit (2^(127 - bias)) exactly."""
    kernels = hybrid_ops.get_backend("cpu")._module
    pairs = torch.cartesian_prod(torch.arange(256), torch.arange(256)).flatten().to(torch.uint8)
    for cache_dtype, bias in ((torch.float8_e4m3fn, 7), (torch.float8_e5m2, 15)):
        codes = pairs.view(cache_dtype)
        wide, narrow = kernels.widen_fp8(codes, wide=True), kernels.widen_fp8(codes, wide=False)
        assert torch.equal(wide.view(torch.int32), narrow.view(torch.int32)), cache_dtype
        finite = codes.float().isfinite()
        assert torch.equal(narrow.double()[finite] * 2.0 ** (127 - bias), codes.double()[finite]), cache_dtype


@needs_vbmi
def test_vbmi_cpus_load_the_look_up_build():
    kernels = hybrid_ops.get_backend("cpu")._module
    assert "vbmi" in kernels.__name__.split("_") and kernels.FP8_WIDE_VECS == 4


@needs_vbmi
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("head_dim", [64, 96, 128])  # one wide load a row; one and a rest of 32; two
@pytest.mark.parametrize("op, q_len", [("decode", 1), ("decode", 3), ("prefill", 40)])  # decode, verify: few rows
def test_vbmi_fp8_against_float64(op, q_len, head_dim, cache_dtype, dtype):
    """fp8 caches through the look-up build's few rows (V read 64 values a load) and many rows (tiles widened 64 at a
    time), with a value head dim 16 past D (a rest of 16), against float64."""
    case = make_case(
        [q_len] * 2, [150, 70], 8, head_dim=head_dim, page_size=16, dtype=dtype, seed=head_dim, v_head_dim=head_dim + 16
    )
    check_fp8(op, case, FP8[cache_dtype], *fp8_scales("per_head", 2))


# Few rows over bf16 caches in place multiply bf16 pairs (kernels/cpu/attend_inplace.cpp: vdpbf16ps) in the AVX512
# builds with BF16, which CPUs with AVX512-BF16 load (hybrid_ops/backends/cpu.py); fp32 FMAs elsewhere.
needs_bf16 = pytest.mark.skipif(
    "BF16" not in kernel_capability().split("_"),
    reason=f"the pairs builds are AVX512 with BF16 (ATen's AVX512 level on a CPU with AVX512-BF16); here it is "
    f"{kernel_capability()}",
)


@needs_bf16
def test_bf16_cpus_load_the_pairs_build():
    kernels = hybrid_ops.get_backend("cpu")._module
    assert "bf16" in kernels.__name__.split("_") and kernels.BF16_PAIRS


@pytest.mark.slow
def test_bf16_pairs_compile_to_dot_products(tmp_path):
    """attend_inplace.cpp, compiled alone with the flags of the AVX512 build with BF16, multiplies bf16 pairs
    (vdpbf16ps) and rounds the probabilities to bf16 (vcvtneps2bf16): on any machine."""
    source = next(f for f in _files(".cpp") if f.endswith("attend_inplace.cpp"))
    code = disassemble(source, "AVX512_BF16", tmp_path / "attend_inplace.o")
    assert "vdpbf16ps" in code and "vcvtneps2bf16" in code


# Head dims (q/k, v) around the pairs' chunks of 32 values: half a chunk alone, a chunk and a half, whole chunks.
@pytest.mark.parametrize("head_dim, v_head_dim", [(16, 16), (48, 80), (96, 32), (128, 144)])
@pytest.mark.parametrize("option", ["default", "window"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_bf16_few_rows_against_float64(q_len, option, head_dim, v_head_dim):
    """bf16 decode and verify over every kv head (few rows, in place) against float64, on every build: contexts that
    end in tiles of 3, 14 and 1 keys (keys paired one after the other, a lone last key), and windows whose first key
    falls inside a tile's runs of positions (the pairs start mid-run)."""
    case = make_case(
        [q_len] * 3, [130, 77, 64], 8, head_dim=head_dim, page_size=16, dtype=torch.bfloat16, seed=head_dim,
        v_head_dim=v_head_dim,
    )  # fmt: skip
    options = {"window": dict(sliding_window=37)}.get(option, {})
    k_ref, v_ref = expected_cache(case)
    out = torch.ops.hybrid.decode(*case.args, **options, backend="cpu")
    assert_relative(out, reference(case, **options), torch.bfloat16)
    assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref)


# Whole tiles that every row sees are scored in blocks of 4 rows (attend_inplace.cpp: blocked), in the pairs builds
# where the rows per kv head are a multiple of 4 and the value head dim whole chunks of 32; other tiles and rows as
# before. Their P V goes head after head (pv_pairs_by_head) where K's and V's rows are as long, a multiple of 128
# values, and a tile's runs of 8 positions lie within cache pages; else pass after pass.
@pytest.mark.parametrize(
    "head_dim, v_head_dim, window, page_size",
    [(128, 128, -1, 16), (64, 96, 100, 16), (256, 256, -1, 8), (128, 128, -1, 12)],
)
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("group", [2, 4, 6, 8])
def test_bf16_blocked_scores_against_float64(group, q_len, head_dim, v_head_dim, window, page_size):
    """bf16 decode and verify over every kv head against float64, on every build: groups of 2-8 query heads (rows per kv
    head of 2, 6: not blocks of 4; 4, 8, 12, 24: one to 6 blocks), contexts of 2-3 slices, a tile and a partial one,
    where later tiles raise the maxima of the earlier ones; a value head dim of 3 chunks (two, then one); a window of
    100 keys, whose first tile the later draft tokens see but for its first keys; P V by head over 2 and 4 chunks of
    64 values, and pass after pass where pages of 12 positions split a tile's runs."""
    case = make_case(
        [q_len] * 3, [700, 259, 64 - q_len], 2 * group, head_dim=head_dim, page_size=page_size, dtype=torch.bfloat16,
        seed=group * 10 + q_len, v_head_dim=v_head_dim,
    )  # fmt: skip
    out = torch.ops.hybrid.decode(*case.args, sliding_window=window, backend="cpu")
    assert_relative(out, reference(case, sliding_window=window), torch.bfloat16)


def test_keys_of_minus_inf_scores_take_no_weight():
    """A request's first tile of keys whose every score is -inf (keys of -inf against queries of positive first
    values), blocked or not: the rows keep no maximum from it and take no probability, and attend to the rest."""
    for dtype in (torch.bfloat16, torch.float32):
        case = make_case([1, 1], [300, 200], 8, head_dim=128, page_size=16, dtype=dtype, seed=5)
        case.q[..., 0] = case.q[..., 0].abs() + 0.5
        for pos in range(64):  # the first tile of request 0
            page, row = case.pages[0][pos // 16], pos % 16
            case.k_cache[page, row, :, 0] = float("-inf")
            case.prefix_k[0][pos, :, 0] = float("-inf")
        out = torch.ops.hybrid.decode(*case.args, backend="cpu")
        assert out.isfinite().all()
        assert_relative(out, reference(case), dtype)


def test_tree_hides_a_new_key_in_a_tile_every_row_sees():
    """Two draft tokens after 511 keys: the tile of keys 448-511 ends with the first token's own key, which every row's
    window and causal end take in, but the second token's tree row leaves out (its only root is itself). Its key
    leans towards the second token's query, so that a kernel which shows it to that token is off by far."""
    for dtype in (torch.bfloat16, torch.float32):
        case = make_case([2], [511], 8, head_dim=128, page_size=16, dtype=dtype, seed=9)
        case.k[0] = 0.5 * case.q[1, ::4]  # each kv head's first query head
        tree_mask = tree_mask_for([torch.eye(2, dtype=torch.bool)], 5, random.Random(9))
        out = torch.ops.hybrid.decode(*case.args, tree_mask=tree_mask, backend="cpu")
        assert_relative(out, reference(case, tree_mask=tree_mask), dtype)


# Trees (tree_mask) laid out parents first but not level by level (`recursive_tree`): positions (prefix + depth) far
# below the slots, rising and falling along the rows. q_lens are tree sizes; 2 kv heads.
TREE_CASES = {
    # 7 tokens x group 2 = 14 rows per kv head: few rows, units of every kv head; 5, 2 and 3 slices of 256 keys.
    "verify": ("decode", [7] * 3, [1100, 300, 513], 4, 64, 16),
    # 5 tokens x group 3, head dim 20 (copied rows): few rows, units of one kv head; 2 slices of 512 keys and 1; page 3.
    "verify_head_dim_20": ("decode", [5] * 2, [700, 40], 6, 20, 3),
    # 32 tokens x group 4 = 128 rows: the many-rows path over 256-key tiles; 2 slices of 512 keys and 1; page 5.
    "verify_many_rows": ("decode", [32] * 2, [900, 260], 8, 64, 5),
    # 300 tokens x group 4: three query blocks (128 tokens) over tiles packed once, their rows in chunks of 64, the
    # tree's own keys across 256-key tiles; beside a 40-token tree without a prefix (one block, one slice).
    "prefill": ("prefill", [300, 40], [500, 0], 8, 64, 16),
}
TREE_OPTIONS = {
    "plain": dict(),
    "window": dict(sliding_window=150),  # prefix keys by position: a slot's would hide tens of them
    "window_softcap_sinks_v_head_dim": dict(sliding_window=9, logit_cap=2.0, sinks=True, v_head_dim=16),
    "chunk": dict(attention_chunk=40, scale=0.1),
}


def recursive_tree(n, rng, span=4):
    """[n, n] bool rows of a tree laid out parents first: node j's parent one of the `span` nodes before it, or one in
    ten times any earlier node, so that depths lie far below the slots and rise and fall along the rows (a query
    block's lowest is not its first)."""
    rows = torch.eye(n, dtype=torch.bool)
    for j in range(1, n):
        rows[j] |= rows[rng.randrange(0 if rng.random() < 0.1 else max(0, j - span), j)]
    return rows


def tree_long_case(name, option, dtype, seed, causal=False):
    """long_case over TREE_CASES and TREE_OPTIONS, and its tree_mask ([T, Q]: 3 columns past the longest tree, random
    past each request's tokens); `causal`: every row sees every earlier token."""
    op, case, options = long_case(name, option, dtype, seed, TREE_CASES, TREE_OPTIONS)
    rng = random.Random(seed)
    sizes = TREE_CASES[name][1]
    trees = [torch.ones(n, n, dtype=torch.bool).tril() if causal else recursive_tree(n, rng) for n in sizes]
    return op, case, options, tree_mask_for(trees, max(sizes) + 3, rng)


# Each option with one q dtype (the float64 reference takes seconds a case).
@pytest.mark.parametrize("option, dtype", list(zip(TREE_OPTIONS, [torch.float32, torch.bfloat16] * 2)))
@pytest.mark.parametrize("name", TREE_CASES)
def test_trees_against_float64(name, option, dtype):
    op, case, options, tree_mask = tree_long_case(name, option, dtype, seed=21)
    k_ref, v_ref = expected_cache(case)
    out = getattr(torch.ops.hybrid, op)(*case.args, **options, tree_mask=tree_mask, backend="cpu")
    assert_relative(out, reference(case, **options, tree_mask=tree_mask), dtype)
    assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref)


@pytest.mark.parametrize("name", TREE_CASES)
def test_trees_over_fp8_caches(name):
    op, case, options, tree_mask = tree_long_case(name, "window_softcap_sinks_v_head_dim", torch.bfloat16, seed=22)
    check_fp8(op, case, torch.float8_e4m3fn, *fp8_scales("per_head", 2), **options, tree_mask=tree_mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", TREE_CASES)
def test_causal_tree_is_none_bit_for_bit(name, dtype):
    """Both row paths, slices and tiles: a causal tree hides no key from the same computation."""
    op, case, options, tree_mask = tree_long_case(name, "window_softcap_sinks_v_head_dim", dtype, 23, causal=True)
    chain = getattr(torch.ops.hybrid, op)(*case.args, **options, backend="cpu")
    tree = getattr(torch.ops.hybrid, op)(*case.args, **options, tree_mask=tree_mask, backend="cpu")
    assert torch.equal(chain, tree)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_products_on_amx(dtype):
    """Many query rows over a 16-bit cache multiply in 16 bits on AMX (VNNI-packed tiles, probabilities rounded by
    AVX512-BF16): the prefill cases through that path. Elsewhere the same cases multiply in fp32, which
    test_long_contexts_against_float64 covers."""
    kernels = hybrid_ops.get_backend("cpu")._module
    if not kernels.multiplies_in_cache_dtype(dtype):
        pytest.skip(f"this CPU has no AMX for {dtype} (oneDNN's brgemm cannot pack it): 16-bit products cannot run")
    for name in ("prefill", "chunk_over_prefix", "head_dim_20"):
        check_long_case(name, "window_softcap", dtype)


# Split requests whose slices some rows see no key of: a draft token before the last slice's first key, or past a
# chunk boundary (attention_chunk) that starts after the first slices. op, q_lens, prefix_lens, Hq, head dim, page size
# (2 kv heads); the options with sinks.
SPLIT_CASES = {
    # Units of every kv head: 3 slices (tokens 1 and 2 see none of the first 2), 3 and 2 (the last of 2 keys, past the
    # first token's).
    "verify_all_heads": ("decode", [3] * 3, [1199, 511, 255], 8, 80, 7),
    # Units of one kv head (brgemm): 3 slices (tokens 1-7 see none of the first 2), and 2.
    "verify": ("decode", [8] * 2, [2399, 600], 32, 80, 5),
    # One token a request, which every row of sees each slice of: 8, 3 and 6 slices.
    "decode": ("decode", [1] * 3, [2000, 700, 1300], 8, 128, 16),
}
SPLIT_OPTIONS = {
    "verify_all_heads": dict(sinks=True, attention_chunk=600),
    "verify": dict(sinks=True, attention_chunk=1200),
    "decode": dict(sinks=True),
}


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("name", SPLIT_CASES)
def test_thread_count_does_not_change_the_result(name, cache_dtype):
    """A request's key slices run on one thread or on 2-4 (which thread runs which slice varies from call to call), and
    every call gives the same result bit for bit; with sinks, and rows that see no key of some slices, it matches
    float64."""
    op, case, options = long_case(name, name, torch.bfloat16, 8, cases=SPLIT_CASES, options=SPLIT_OPTIONS)
    read = case
    if cache_dtype is not None:
        options.update(zip(("k_scale", "v_scale"), fp8_scales("per_head", 2)))
        case, read, _ = fp8_case(case, cache_dtype, options["k_scale"], options["v_scale"])
    threads, thread_counts = torch.get_num_threads(), (1, 2, 3, 4, 2, 3)
    outs = []
    for n in thread_counts:
        torch.set_num_threads(n)
        try:
            outs.append(getattr(torch.ops.hybrid, op)(*case.args, **options, backend="cpu"))
        finally:
            torch.set_num_threads(threads)
    for n, out in zip(thread_counts[1:], outs[1:]):
        assert torch.equal(out, outs[0]), f"{n} threads"
    reference_options = {k: v for k, v in options.items() if k not in ("k_scale", "v_scale")}
    assert_relative(outs[0], reference(read, **reference_options), torch.bfloat16)


def test_without_a_compiler(monkeypatch):
    """A failed build: one warning, "auto" takes the torch backend, and asking for "cpu" by name is an error."""
    from hybrid_ops.backends import cpu

    hybrid_ops.get_backend("cpu")  # the registered backend built first: the last line checks it is back, loaded

    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpu, "build", no_compiler)
    with hybrid_ops.register_backend(cpu.CpuBackend()):
        case = make_case([3, 2], [4, 0], seed=9)
        with pytest.warns(UserWarning, match="cpu backend's kernels could not be built .*Ninja is required") as seen:
            out = torch.ops.hybrid.prefill(*case.args)
            torch.ops.hybrid.decode(*make_case([1], [5]).args)
        assert len(seen) == 1
        assert torch.allclose(out.double(), reference(case), atol=2e-5)
        with pytest.raises(hybrid_ops.HybridInputError, match="backend='cpu' needs a C\\+\\+ compiler and ninja"):
            torch.ops.hybrid.prefill(*case.args, backend="cpu")
    assert hybrid_ops.get_backend("cpu").loaded


# The C++ entry points (kernels/cpu/dispatch.cpp): calls the native kernel serves never enter Python; all others reach
# the ops' Python implementation, which runs the other backends and raises the errors.
ROUTES = [(mode, spec) for mode in ROUTING for spec in ("prefill", "decode")]


@pytest.fixture
def python_calls(monkeypatch):
    """Counts the calls that reach each op's Python implementation (the entry points look it up on every call)."""
    from hybrid_ops.ops import PYTHON_IMPLEMENTATIONS

    hybrid_ops.get_backend("cpu")  # loads the kernels and their entry points
    calls = []
    for name, impl in list(PYTHON_IMPLEMENTATIONS.items()):

        def counted(*args, _name=name, _impl=impl, **kwargs):
            calls.append(_name)
            return _impl(*args, **kwargs)

        monkeypatch.setitem(PYTHON_IMPLEMENTATIONS, name, counted)
    return calls


def attn_case(mode, spec):
    q_lens = {ForwardMode.IDLE: [], ForwardMode.DECODE: [1, 1]}.get(mode, [3, 3] if spec == "decode" else [3, 5])
    return make_case(q_lens, [6] * len(q_lens), num_q_heads=8, num_kv_heads=2, page_size=4)


@pytest.mark.parametrize("names", [("cpu", "cpu"), ("auto", "auto"), ("cpu", "torch"), ("torch", "cpu")])
def test_native_calls_skip_python(python_calls, names):
    """Every mode through attn with the native kernel named (or picked by "auto") on the routed side: the right
    values and cache, and no call into Python; with the torch backend routed to, one call into Python."""
    prefill_backend, decode_backend = names
    for mode, spec in ROUTES:
        case = attn_case(mode, spec)
        k_ref, v_ref = expected_cache(case)
        python_calls.clear()
        out = torch.ops.hybrid.attn(
            *case.args,
            int(mode),
            prefill_backend=prefill_backend,
            decode_backend=decode_backend,
            speculative_attention_mode=spec,
            logit_cap=3.0,
        )
        routed = decode_backend if select_path(mode, spec) == "decode" else prefill_backend
        assert python_calls == ([] if routed != "torch" else ["attn"]), (mode, spec)
        assert torch.allclose(out.double(), reference(case, logit_cap=3.0), atol=2e-5), (mode, spec)
        assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref)
    for op in ("prefill", "decode"):
        case = make_case([2, 2], [5, 0], seed=4)
        python_calls.clear()
        out = getattr(torch.ops.hybrid, op)(*case.args, backend=prefill_backend, scale=0.2)
        assert python_calls == ([] if prefill_backend != "torch" else [op])
        assert torch.allclose(out.double(), reference(case, scale=0.2), atol=2e-5)


def test_rejected_calls_reach_python(python_calls):
    """Bad arguments, values, modes and names go to Python, which names them; the cache is untouched."""
    case = make_case([2, 2], [5, 0], seed=5)
    before = case.k_cache.clone()
    bad = {
        "gqa ratio": ((case.q[:, :3], *case.args[1:]), 1, {}, "Hq % Hkv"),
        "strided cache": (
            (*case.args[:3], case.k_cache.transpose(0, 1).contiguous().transpose(0, 1), *case.args[4:]),
            1,
            {},
            "contiguous",
        ),
        "window": (case.args, 1, {"sliding_window": 0}, "sliding_window must be -1"),
        "scale": (case.args, 1, {"scale": math.inf}, "scale must be a finite positive"),
        "mode": (case.args, 10, {}, "forward_mode must be one of"),
        "spec mode": (case.args, 5, {"speculative_attention_mode": "x"}, "speculative_attention_mode must be"),
        "other backend": (case.args, 1, {"decode_backend": "nope"}, "decode_backend must be 'auto' or one of"),
        "decode shape": ((*(t[:-1] for t in case.args[:3]), *case.args[3:]), 2, {}, "same number of query tokens"),
        "ragged decode": (make_case([3, 1], [2, 2]).args, 2, {}, "same query length for every request"),
        "page id": ((*case.args[:7], case.block_table.clone().fill_(10_000)), 1, {}, "block_table[0, 0] = 10000"),
    }
    for name, (args, mode, kwargs, words) in bad.items():
        python_calls.clear()
        with pytest.raises(hybrid_ops.HybridInputError, match=re.escape(words)):
            torch.ops.hybrid.attn(*args, mode, **kwargs, prefill_backend="cpu")
        assert python_calls == ["attn"], name
        assert torch.equal(case.k_cache, before), name


def test_auto_follows_a_preferred_backend(python_calls):
    """A backend registered with prefer=True takes "auto" from the entry points, and gives it back when gone."""

    class Preferred(TorchBackend):
        name = "preferred"

    case = make_case([3], [2], seed=6)
    with hybrid_ops.register_backend(Preferred(), prefer=True):
        out = torch.ops.hybrid.prefill(*case.args)
        assert python_calls == ["prefill"]
        assert torch.allclose(out.double(), reference(case), atol=2e-5)
    python_calls.clear()
    torch.ops.hybrid.prefill(*make_case([3], [2], seed=6).args)
    assert python_calls == []


@pytest.mark.parametrize("backend", ["cpu", "auto"])
def test_fp8_calls_skip_python(python_calls, backend):
    """fp8 calls with scales of each accepted shape, or none, run in C++; with sinks, chunks and a value head dim of
    their own too."""
    one = torch.tensor(1.0)
    for scales in (
        {},
        dict(k_scale=torch.tensor(0.5), v_scale=torch.tensor([2.0])),
        dict(k_scale=torch.tensor([0.5, 3.0]), v_scale=torch.tensor([2.0, 0.2])),
    ):
        case = attn_case(ForwardMode.DECODE, "prefill")
        fp8, read, (k_expected, v_expected) = fp8_case(
            case, torch.float8_e4m3fn, scales.get("k_scale", one), scales.get("v_scale", one)
        )
        python_calls.clear()
        out = torch.ops.hybrid.decode(*fp8.args, **scales, backend=backend)
        assert python_calls == []
        assert torch.allclose(out.double(), reference(read), atol=2e-5)
        assert torch.equal(fp8.k_cache.view(torch.uint8), k_expected)
    options = dict(sinks=torch.randn(case.q.shape[1]), attention_chunk=3)
    case = make_case([1, 1], [4, 9], num_q_heads=case.q.shape[1], v_head_dim=24)
    fp8, read, _ = fp8_case(case, torch.float8_e4m3fn, one, one)
    out = torch.ops.hybrid.decode(*fp8.args, **options, backend=backend)
    assert python_calls == []
    assert torch.allclose(out.double(), reference(read, **options), atol=2e-5)
