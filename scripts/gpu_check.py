"""Every GPU check and the GPU benchmark, in one run of a few minutes on one GPU.

    python scripts/gpu_check.py            # on a CUDA machine; writes bench/results/gpu.{md,json}
    python scripts/gpu_check.py --smoke    # tiny sizes, on the CPU too (Triton through its interpreter)

1. Every backend (torch, triton, flashinfer when importable) and mode against the float64 reference, with a sliding
   window and soft-cap, over caches of q's dtype and fp8 caches (e4m3, e5m2, per kv head scales; exact cache bytes),
   and again under a random tree mask where the backend serves one; prefill queries up to 100 tokens (FlashInfer's
   FA3 kernels on an H100/H200 past 64). Triton with fp8 caches also over long prefixes, and its store's bytes
   against torch's conversion where an approximate division would show. Speculative trees (`tree_mask`) on every
   backend that serves them: random trees of depths 1-6 and widths 1-4, prefill and verify, with a window shorter
   than their depths and a soft-cap, bf16 and e4m3 caches (FlashInfer: its fa2 kernel reading the custom mask that
   kernels/custom_mask.py packs on the GPU).
2. torch.compile(mode="reduce-overhead") of a module calling torch.ops.hybrid.plan(cuda_graph=True) then
   torch.ops.hybrid.attn with EXTEND, DECODE and TARGET_VERIFY alternating: CUDA-graph trees must replay it (no
   "skipping cudagraphs"), with correct outputs and the KV writes landing in the caller's cache.
3. The demo model through HybridGenerator with cuda_graphs=True (every step padded to a bucket, compiled with
   mode="reduce-overhead") against the same run without graphs: CUDA graphs recorded, "skipping cudagraphs" reasons
   (none expected), tokens/s of each, identical tokens. On the CPU the padding path runs without graphs (and with
   --smoke, without compiling: tests/test_buckets.py covers the compiled padding path).
4. Decode (batch 1/16/64 x context 1k/4k/32k) and prefill (512/4k new tokens, prefix 0/2k) at Hq 32, Hkv 8, D 128,
   bf16, page 16, decode also over fp8 (e4m3) caches: KV bandwidth and TFLOP/s against the copy bandwidth and bf16
   matmul rate measured in this run.
"""

import argparse
import json
import logging
import logging.handlers
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if "--smoke" in sys.argv and not os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from helpers.reference import (  # noqa: E402
    TOLERANCE,
    assert_close,
    expected_cache,
    fp8_case,
    fp8_store_case,
    make_case,
    random_tree,
    reference,
    tree_mask_for,
)

import hybrid_ops  # noqa: E402
from hybrid_ops import ForwardMode  # noqa: E402
from hybrid_ops.backends import registry  # noqa: E402
from hybrid_ops.backends.deps import importable  # noqa: E402


def timed(fn, device):
    """Median milliseconds of fn()."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50)
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def available_backends(device):
    names = ["torch", "triton"]
    # Not backend_names(available=True): that would build the cpu backend's kernels here too.
    if device == "cuda" and importable("flashinfer"):
        names.append("flashinfer")
    return names


def random_tree_mask(q_lens, rng):
    """[T, max q_len] bool: for each request a random tree over its new tokens, each node's parent an earlier one;
    a row sees its node and its ancestors."""
    width, blocks = max(q_lens), []
    for n in q_lens:
        rows = torch.zeros(n, width, dtype=torch.bool)
        for j in range(n):
            if j:
                rows[j] = rows[rng.randrange(j)]
            rows[j, j] = True
        blocks.append(rows)
    return torch.cat(blocks)


def check_correctness(device, smoke, report):
    """Every mode of every backend for q in fp16 and bf16 (and fp32 on the CPU, where FlashInfer does not run), over
    caches of q's dtype and over fp8 caches (per kv head scales), against float64 over what the cache holds; modes
    with new tokens again under a random tree mask, on the backends that serve one."""
    kinds = [
        (torch.bfloat16, None),
        (torch.float16, None),
        (torch.bfloat16, torch.float8_e4m3fn),
        (torch.float16, torch.float8_e5m2),
    ] + ([(torch.float32, None)] if device == "cpu" else [])
    if smoke:  # the script's logic, not every dtype: the suite covers those
        kinds = [kinds[0], kinds[2]]
    # On the GPU a prefill query of more than 64 tokens: FlashInfer runs its FA3 kernels there on an H100/H200.
    long_query = 100 if device == "cuda" else 19
    kv_scales = {"k_scale": torch.tensor([0.3, 1.7], device=device), "v_scale": torch.tensor([2.5, 0.6], device=device)}
    for backend in available_backends(device):
        trees = "tree_mask" in hybrid_ops.get_backend(backend).features
        for dtype, cache_dtype in kinds:
            for mode in ForwardMode:
                for spec in ("prefill", "decode"):
                    decode_path = hybrid_ops.select_path(mode, spec) == "decode"
                    q_lens = (
                        []
                        if mode == ForwardMode.IDLE
                        else ([1 if mode == ForwardMode.DECODE else 3] * 3 if decode_path else [7, 1, 0, long_query])
                    )
                    case = make_case(
                        q_lens,
                        [30, 0, 65, 12][: len(q_lens)],
                        num_q_heads=8,
                        num_kv_heads=2,
                        head_dim=128,
                        page_size=16,
                        dtype=dtype,
                        device=device,
                        seed=int(mode),
                    )
                    options = dict(sliding_window=24, logit_cap=20.0)
                    read, (k_ref, v_ref) = case, expected_cache(case)
                    if cache_dtype is not None:
                        case, read, (k_ref, v_ref) = fp8_case(case, cache_dtype, *kv_scales.values())
                        options.update(kv_scales)
                    tree_masks = [None]
                    if trees and sum(q_lens):
                        tree_masks.append(random_tree_mask(q_lens, random.Random(int(mode))))
                    for tree_mask in tree_masks:
                        out = torch.ops.hybrid.attn(
                            *case.args,
                            int(mode),
                            **options,
                            tree_mask=None if tree_mask is None else tree_mask.to(device),
                            prefill_backend=backend,
                            decode_backend=backend,
                            speculative_attention_mode=spec,
                        )
                        ref_options = {k: v for k, v in options.items() if k not in kv_scales}
                        assert_close(out.cpu(), reference(read, tree_mask=tree_mask, **ref_options), dtype)
                    raw = (lambda t: t.cpu().view(torch.uint8)) if cache_dtype else (lambda t: t.cpu())
                    assert torch.equal(raw(case.k_cache), k_ref.cpu()) and torch.equal(raw(case.v_cache), v_ref.cpu())
            report.append(
                f"correct: {backend} q {dtype}, cache {cache_dtype or dtype}, every mode, both speculative settings"
                + (", with and without a tree" if trees else "")
            )
            print(report[-1], flush=True)


def check_trees(device, smoke, report):
    """Every backend here that serves `tree_mask`: trees over ragged prefill (with a request of one token) and over
    verify (as many nodes in every tree), against float64 over the same tree; bf16 q over bf16 and e4m3 caches."""
    rng = random.Random(0)
    shapes = [(3, 2)] if smoke else [(1, 1), (3, 2), (6, 4), (4, 3)]
    options = dict(sliding_window=3, logit_cap=20.0)  # the window shorter than the trees' depths
    kv_scales = {"k_scale": torch.tensor([0.3, 1.7], device=device), "v_scale": torch.tensor([2.5, 0.6], device=device)}
    for backend in [b for b in available_backends(device) if "tree_mask" in registry.lookup(b).features]:
        for cache_dtype in (None, torch.float8_e4m3fn):
            for op in ("prefill", "decode"):
                for depth, width in shapes:
                    trees = [random_tree(depth, width, rng, full=op == "decode")[0] for _ in range(4)]
                    if op == "prefill":
                        trees[1] = trees[1][:1, :1]
                    case = make_case(
                        [t.shape[0] for t in trees],
                        [30, 0, 65, 12],
                        num_q_heads=8,
                        num_kv_heads=2,
                        head_dim=128,
                        page_size=16,
                        dtype=torch.bfloat16,
                        device=device,
                        seed=depth,
                    )
                    tree_mask = tree_mask_for(trees, 64, rng)
                    read, (k_ref, v_ref), scales = case, expected_cache(case), {}
                    if cache_dtype is not None:
                        case, read, (k_ref, v_ref) = fp8_case(case, cache_dtype, *kv_scales.values())
                        scales = kv_scales
                    out = getattr(torch.ops.hybrid, op)(
                        *case.args, tree_mask=tree_mask.to(device), backend=backend, **options, **scales
                    )
                    assert_close(out.cpu(), reference(read, tree_mask=tree_mask, **options), torch.bfloat16)
                    raw = (lambda t: t.cpu().view(torch.uint8)) if cache_dtype else (lambda t: t.cpu())
                    assert torch.equal(raw(case.k_cache), k_ref.cpu()) and torch.equal(raw(case.v_cache), v_ref.cpu())
        report.append(f"trees: {backend}, prefill and verify, (depth, width) {shapes}, bf16 and e4m3 caches")
        print(report[-1], flush=True)


def check_triton_fp32(device, report):
    """fp32 through the Triton kernels at the reference's fp32 tolerance: their dots use tf32x3 (three TF32 products,
    about fp32's precision), not plain TF32. Decode, verify and prefill over several KV blocks and splits."""
    for head_dim in (64, 128, 256):
        for path, q_lens in (("decode", [1, 1]), ("decode", [4, 4]), ("prefill", [37, 5])):
            case = make_case(
                q_lens,
                [300, 41],
                num_q_heads=8,
                num_kv_heads=2,
                head_dim=head_dim,
                page_size=16,
                device=device,
                seed=head_dim,
            )
            out = getattr(torch.ops.hybrid, path)(*case.args, backend="triton", sliding_window=200, logit_cap=20.0)
            assert_close(out.cpu(), reference(case, sliding_window=200, logit_cap=20.0), torch.float32)
    report.append(
        f"triton fp32: decode, verify 4, prefill at D 64/128/256 within the fp32 tolerance {TOLERANCE[torch.float32]:g}"
    )
    print(report[-1], flush=True)


def check_triton_many_rows(device, report):
    """The decode shapes whose single row tile once overflowed shared memory: MQA decode (Hq 32 / Hkv 1) at D 256
    fp32, verify 4 x GQA 8 at D 256 fp32, verify 16 x GQA 16 at D 256 bf16."""
    shapes = [(1, 32, 1, torch.float32), (4, 16, 2, torch.float32), (16, 32, 2, torch.bfloat16)]
    for q_len, hq, hkv, dtype in shapes:
        case = make_case(
            [q_len] * 2,
            [200, 33],
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=256,
            page_size=16,
            dtype=dtype,
            device=device,
            seed=q_len,
        )
        out = torch.ops.hybrid.decode(*case.args, backend="triton")
        assert_close(out.cpu(), reference(case), dtype)
        report.append(f"triton decode q_len {q_len}, Hq {hq} / Hkv {hkv}, D 256, {dtype}: correct")
        print(report[-1], flush=True)


def check_triton_fp8(device, smoke, report):
    """fp8 caches through the Triton kernels, one scale per kv head: the store's bytes as torch's conversion on the
    CPU for quotients at and next to rounding ties, subnormal and saturating (`fp8_store_case`), then decode, verify
    and prefill over several KV blocks and splits against float64 over the dequantized cache, with exact bytes."""
    from hybrid_ops.kernels import kv_store

    k_scale, v_scale = torch.tensor([1.0, 0.37]), torch.tensor([3.1, 1.0])
    scales = dict(k_scale=k_scale.to(device), v_scale=v_scale.to(device))
    options = dict(sliding_window=200, logit_cap=20.0)
    for cache_dtype in (torch.float8_e4m3fn,) if smoke else (torch.float8_e4m3fn, torch.float8_e5m2):
        fp8, _, expected = fp8_case(fp8_store_case(cache_dtype, k_scale, v_scale), cache_dtype, k_scale, v_scale)
        args = [a.to(device) for a in fp8.args]
        kv_store.store_kv(*args[1:], **scales)
        assert all(torch.equal(c.cpu().view(torch.uint8), e) for c, e in zip(args[3:5], expected)), "store bytes"
        for dtype in (torch.bfloat16,) if smoke else (torch.bfloat16, torch.float16, torch.float32):
            for path, q_lens in (("decode", [1, 1]), ("decode", [4, 4]), ("prefill", [37, 5])):
                case = make_case(
                    q_lens,
                    [300, 41],
                    num_q_heads=8,
                    num_kv_heads=2,
                    head_dim=128,
                    page_size=16,
                    dtype=dtype,
                    seed=len(q_lens),
                )
                fp8, read, expected = fp8_case(case, cache_dtype, k_scale, v_scale)
                args = [a.to(device) for a in fp8.args]
                out = getattr(torch.ops.hybrid, path)(*args, backend="triton", **scales, **options)
                assert_close(out.cpu(), reference(read, **options), dtype)
                assert all(torch.equal(c.cpu().view(torch.uint8), e) for c, e in zip(args[3:5], expected))
        report.append(
            f"triton {cache_dtype}: store bit-exact at ties, subnormals, saturation; decode, verify 4, "
            "prefill at bf16/fp16/fp32 correct"
        )
        print(report[-1], flush=True)


def check_cuda_graphs(report):
    """reduce-overhead compile with the mode alternating: replays, no skips, correct, writes in the real cache."""
    from torch._dynamo.utils import counters

    backends = [b for b in available_backends("cuda") if b != "torch"]  # the torch backend syncs: not capturable
    for backend in backends:
        torch._dynamo.reset()
        counters.clear()

        def step(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, forward_mode: int):
            # Outside the captured partitions (graph_partition): FlashInfer plans into its CUDA-graph buffers.
            torch.ops.hybrid.plan(
                k_cache,
                cu_seqlens_q,
                seq_lens,
                block_table,
                forward_mode,
                q_dtype=q.dtype,
                num_q_heads=q.shape[1],
                prefill_backend=backend,
                decode_backend=backend,
                speculative_attention_mode="decode",
                cuda_graph=True,
            )
            return (
                torch.ops.hybrid.attn(
                    q,
                    k,
                    v,
                    k_cache,
                    v_cache,
                    cu_seqlens_q,
                    seq_lens,
                    block_table,
                    forward_mode,
                    prefill_backend=backend,
                    decode_backend=backend,
                    speculative_attention_mode="decode",
                )
                * 1.0
            )

        compiled = torch.compile(step, mode="reduce-overhead", dynamic=False, options={"graph_partition": True})
        shapes = {ForwardMode.EXTEND: [9, 70], ForwardMode.DECODE: [1, 1], ForwardMode.TARGET_VERIFY: [4, 4]}
        # One persistent cache, as a model has: each step's case is copied into its first pages.
        k_cache = torch.zeros(64, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.zeros_like(k_cache)
        torch._dynamo.mark_static_address(k_cache)
        torch._dynamo.mark_static_address(v_cache)
        for round_ in range(4):
            for mode, q_lens in shapes.items():
                case = make_case(
                    q_lens,
                    [40, 7],
                    num_q_heads=8,
                    num_kv_heads=2,
                    head_dim=128,
                    page_size=16,
                    dtype=torch.bfloat16,
                    device="cuda",
                    seed=round_ * 10 + int(mode),
                )
                used = case.k_cache.shape[0]
                k_cache[:used].copy_(case.k_cache)
                v_cache[:used].copy_(case.v_cache)
                k_ref, _ = expected_cache(case)
                out = compiled(case.q, case.k, case.v, k_cache, v_cache, *case.args[5:], int(mode))
                torch.cuda.synchronize()
                assert_close(out.cpu(), reference(case), torch.bfloat16)
                assert torch.equal(k_cache[:used].cpu(), k_ref.cpu()), "the KV write did not land in the real cache"
        skips = counters["inductor"].get("cudagraph_skips", 0)
        assert skips == 0, f"{backend}: {skips} cudagraph skips"
        report.append(f"cuda graphs: {backend} replays EXTEND/DECODE/TARGET_VERIFY, 0 skips, writes in place")
        print(report[-1], flush=True)


def count_cuda_graphs():
    """CUDA graphs recorded by CUDA-graph trees on the current device (nodes of its trees)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    nodes, count = list(manager.get_roots()) if manager is not None else [], 0
    while nodes:
        count += 1
        nodes += [child for children in nodes.pop().children.values() for child in children]
    return count


def check_generator_graphs(device, smoke, report):
    """The demo model through HybridGenerator with and without cuda_graphs: graphs, skips, tokens/s, tokens."""
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_utils import cudagraphs_log

    sys.path.insert(0, str(ROOT / "examples"))
    from generate import PROMPT_LENGTHS, demo_model, demo_prompts

    model = demo_model().to(device)
    prompts = demo_prompts(model.config.vocab_size, PROMPT_LENGTHS[:3] if smoke else PROMPT_LENGTHS)
    new_tokens = 4 if smoke else 48
    # FlashInfer plans on the host inside the op: the generator's graphs need a sync-free backend.
    backend = "triton" if device == "cuda" else "auto"
    skips = logging.handlers.BufferingHandler(capacity=1000)  # the "skipping cudagraphs" messages
    cudagraphs_log.addHandler(skips)
    if cudagraphs_log.getEffectiveLevel() > logging.WARNING:
        cudagraphs_log.setLevel(logging.WARNING)
    runs = {}
    for graphs in (False, True):
        torch._dynamo.reset()
        counters.clear()
        generator = hybrid_ops.HybridGenerator(
            model,
            max_batch_size=len(prompts),
            max_seq_len=max(map(len, prompts)) + new_tokens,
            prefill_chunk=1024,
            prefill_backend=backend,
            decode_backend=backend,
            cuda_graphs=graphs,
            compile=device == "cuda" or not smoke,
        )
        generator.generate(prompts, new_tokens)  # compiles and, with graphs, records them
        warm = count_cuda_graphs() if device == "cuda" else 0
        stats = hybrid_ops.GenerationStats()
        tokens = generator.generate(prompts, new_tokens, stats=stats)
        recorded = (warm, count_cuda_graphs() - warm) if device == "cuda" else (0, 0)
        runs[graphs] = tokens, stats.tokens_per_second, recorded, counters["inductor"]["cudagraph_skips"]
    cudagraphs_log.removeHandler(skips)
    (plain, plain_rate, _, _), (padded, rate, (warm, later), skip_count) = runs[False], runs[True]
    reasons = sorted({record.getMessage() for record in skips.buffer})
    report.append(
        f"generator with cuda_graphs ({'CUDA graphs' if device == 'cuda' else 'padding only, no graphs'}): "
        f"{warm} graphs recorded in the warm-up run, {later} in the measured run; {skip_count} cudagraph "
        f"skips {reasons}; {rate:.0f} tokens/s against {plain_rate:.0f} without "
        f"({rate / plain_rate:.2f}x); identical tokens for {sum(a == b for a, b in zip(padded, plain))}/"
        f"{len(prompts)} prompts"
    )
    print(report[-1], flush=True)
    assert padded == plain and skip_count == 0, report[-1]


def paged_batch(q_lens, prefixes, hq, hkv, d, page, dtype, device):
    """Op arguments for a benchmark batch, built on the device: random caches over scattered pages."""
    seq_lens = [p + n for p, n in zip(prefixes, q_lens)]
    counts = [-(-s // page) for s in seq_lens]
    pages = torch.randperm(sum(counts)).split(counts)
    meta = hybrid_ops.build_metadata(q_lens, seq_lens, [p.tolist() for p in pages], device=device)
    k_cache = torch.randn(sum(counts), page, hkv, d, dtype=dtype, device=device)
    total = sum(q_lens)
    q, k, v = (torch.randn(total, heads, d, dtype=dtype, device=device) for heads in (hq, hkv, hkv))
    return q, k, v, k_cache, torch.randn_like(k_cache), *meta.metadata


def benchmark(device, smoke, rows):
    dtype = torch.bfloat16
    hq, hkv, d, page = (8, 2, 64, 16) if smoke else (32, 8, 128, 16)
    elt = 2
    if device == "cuda":
        big = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        copy_gbps = 2 * big.numel() / timed(lambda: big.clone(), device) / 1e6
        a = torch.randn(8192, 8192, dtype=dtype, device=device)
        matmul_tflops = 2 * 8192**3 / timed(lambda: a @ a, device) / 1e9
        del big, a
    else:
        copy_gbps = matmul_tflops = float("nan")
    print(f"copy {copy_gbps:.0f} GB/s, bf16 matmul {matmul_tflops:.0f} TFLOP/s", flush=True)
    decode = [(b, c) for b in (1, 16, 64) for c in (1024, 4096, 32768)] if not smoke else [(2, 64)]
    prefill = [(n, p) for n in (512, 4096) for p in (0, 2048)] if not smoke else [(32, 16)]
    backends = [b for b in available_backends(device) if b != "torch"]
    for kind, shapes in (("decode", decode), ("prefill", prefill)):
        for a, b in shapes:
            q_lens, prefixes = ([1] * a, [b - 1] * a) if kind == "decode" else ([a], [b])
            args = paged_batch(q_lens, prefixes, hq, hkv, d, page, dtype, device)
            op = torch.ops.hybrid.decode if kind == "decode" else torch.ops.hybrid.prefill
            kv_bytes = sum(p + n for p, n in zip(prefixes, q_lens)) * hkv * d * 2 * elt
            flops = sum(4 * n * (p + (n + 1) / 2) * hq * d for p, n in zip(prefixes, q_lens))
            row = dict(kind=kind, shape=f"batch {a} x ctx {b}" if kind == "decode" else f"new {a} prefix {b}")
            # Decode also over an fp8 (e4m3) copy of the caches: half the bytes to read.
            variants = {"": (args, {}, 1)}
            if kind == "decode":
                fp8_caches = tuple(c.to(torch.float8_e4m3fn) for c in args[3:5])
                one = torch.ones((), device=device)
                variants[" fp8"] = ((*args[:3], *fp8_caches, *args[5:]), dict(k_scale=one, v_scale=one), 0.5)
            for backend in backends:
                for suffix, (op_args, scales, fraction) in variants.items():
                    ms = timed(lambda: op(*op_args, backend=backend, **scales), device)
                    row[backend + suffix] = dict(
                        ms=ms,
                        kv_gbps=kv_bytes * fraction / ms / 1e6,
                        tflops=flops / ms / 1e9,
                        of_copy=kv_bytes * fraction / ms / 1e6 / copy_gbps,
                        of_matmul=flops / ms / 1e9 / matmul_tflops,
                    )
            rows.append(row)
            print(row, flush=True)
    return dict(copy_gbps=copy_gbps, matmul_tflops=matmul_tflops)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.time()
    report, rows = (
        [f"{device}: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}"],
        [],
    )
    check_correctness(device, args.smoke, report)
    check_trees(device, args.smoke, report)
    check_triton_fp32(device, report)
    check_triton_many_rows(device, report)
    check_triton_fp8(device, args.smoke, report)
    if device == "cuda":
        check_cuda_graphs(report)
    check_generator_graphs(device, args.smoke, report)
    rates = benchmark(device, args.smoke, rows)
    lines = report + [
        "",
        f"copy bandwidth {rates['copy_gbps']:.0f} GB/s, bf16 matmul {rates['matmul_tflops']:.0f} "
        "TFLOP/s (measured in this run)",
        "",
        "| kind | shape | backend | ms | KV GB/s | of copy bw | TFLOP/s | of matmul |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for backend, r in row.items():
            if isinstance(r, dict):
                lines.append(
                    f"| {row['kind']} | {row['shape']} | {backend} | {r['ms']:.3f} | {r['kv_gbps']:.0f} "
                    f"| {r['of_copy']:.0%} | {r['tflops']:.1f} | {r['of_matmul']:.0%} |"
                )
    lines.append(f"\n{time.time() - start:.0f} s in all")
    text = "\n".join(lines) + "\n"
    print(text)
    name = "gpu" if device == "cuda" else "gpu_check_smoke_cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.md").write_text(text)
    (args.out / f"{name}.json").write_text(json.dumps(dict(report=report, rates=rates, rows=rows), indent=1))
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / f"{name}.md").write_text(text)


if __name__ == "__main__":
    main()
