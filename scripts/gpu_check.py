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
4. The demo model packaged (`hybrid_ops.package`: torch.export + AOTInductor, triton on CUDA) and served from the
   package with cuda_graphs=True (on CUDA a graph captured per bucket, `generation/graphs.py`) against the eager
   generator: identical tokens, tokens/s of each. With --smoke on the CPU: a 2-layer model, its padding path only.
5. Decode (batch 1/16/64 x context 1k/4k/32k) and prefill (512/4k new tokens, prefix 0/2k) at Hq 32, Hkv 8, D 128,
   bf16, page 16, decode also over fp8 (e4m3) caches: KV bandwidth and TFLOP/s against the copy bandwidth and bf16
   matmul rate measured in this run.
6. The state ops (causal_conv1d, gated_delta_rule with a decay per head and per key channel, selective_scan as
   Mamba2 and Mamba1) on Triton against the torch backend, at the models' sizes, bf16 and fp32: ragged prefill over
   prefixes (with a padding request), decode (with padding), TARGET_VERIFY of chains and trees on the decode path,
   a tree's prefill; outputs, slots' states and intermediate states, every slot the batch does not hold poisoned
   and left as it was. On CUDA each op also captured in a CUDA graph on the decode path and replayed over new
   inputs, slots and lengths, equal to eager calls. Then a timing table, Triton against torch, decode and prefill.
7. MLA over its latent cache (D 576 = 512 + a rope part of 64, v_cache = k_cache[..., :512], one kv head): Triton's
   decode, verify 4 and prefill at 16 and 128 query heads, bf16, fp16 and fp32, against the float64 reference, the
   cache written once; then decode (batch 16 x context 4k, 128 heads) over the latent cache against the same
   attention over expanded per-head K (192) and V (128), the cache bytes each reads.
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
sys.path.insert(0, str(ROOT / "examples"))  # the demo model: generate.py

import torch  # noqa: E402
from helpers.reference import (  # noqa: E402
    TOLERANCE,
    assert_close,
    expected_cache,
    fp8_case,
    fp8_store_case,
    latent_case,
    make_case,
    random_tree,
    reference,
    tree_mask_for,
)
from helpers.state_reference import POISON, make_batch, poisoned_states  # noqa: E402

import hybrid_ops  # noqa: E402
from hybrid_ops import ForwardMode  # noqa: E402
from hybrid_ops.backends import registry  # noqa: E402
from hybrid_ops.backends.deps import importable  # noqa: E402

# A model's attention shape (8 query heads over 2 kv heads of 128, pages of 16) for the checks' cases.
MODEL_SHAPE = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16)


def timed(fn, device):
    """Median milliseconds of fn() on the GPU; on the CPU (--smoke: the script's logic, no measurement) one call's."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50)
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
    head_dim = 32 if smoke else 128  # the interpreter's time grows with it; the logic does not
    kv_scales = {"k_scale": torch.tensor([0.3, 1.7], device=device), "v_scale": torch.tensor([2.5, 0.6], device=device)}
    for backend in available_backends(device):
        trees = "tree_mask" in hybrid_ops.get_backend(backend).features
        for dtype, cache_dtype in kinds:
            for mode in hybrid_ops.ROUTING:
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
                        head_dim=head_dim,
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
                        head_dim=32 if smoke else 128,
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


def check_triton_fp32(device, smoke, report):
    """fp32 through the Triton kernels at the reference's fp32 tolerance: their dots use tf32x3 (three TF32 products,
    about fp32's precision), not plain TF32. Decode, verify and prefill over several KV blocks and splits."""
    head_dims = (64,) if smoke else (64, 128, 256)
    for head_dim in head_dims:
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
        f"triton fp32: decode, verify 4, prefill at D {'/'.join(map(str, head_dims))} within the fp32 tolerance "
        f"{TOLERANCE[torch.float32]:g}"
    )
    print(report[-1], flush=True)


def check_triton_many_rows(device, smoke, report):
    """The decode shapes whose single row tile once overflowed shared memory: MQA decode (Hq 32 / Hkv 1) at D 256
    fp32, verify 4 x GQA 8 at D 256 fp32, verify 16 x GQA 16 at D 256 bf16 (--smoke: the first)."""
    shapes = [(1, 32, 1, torch.float32), (4, 16, 2, torch.float32), (16, 32, 2, torch.bfloat16)][: 1 if smoke else 3]
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
                case = make_case(q_lens, [300, 41], **MODEL_SHAPE, dtype=dtype, seed=len(q_lens))
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
                    q_lens, [40, 7], **MODEL_SHAPE, dtype=torch.bfloat16, device="cuda", seed=round_ * 10 + int(mode)
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
    from generate import PROMPT_LENGTHS, demo_model, demo_prompts
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_utils import cudagraphs_log

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


def check_package(device, smoke, report):
    """The demo model (a 2-layer Llama with --smoke) packaged, served from the package with cuda_graphs=True, against
    the eager generator on the same backends: tokens/s of each, identical tokens."""
    import tempfile

    from generate import PROMPT_LENGTHS, demo_model, demo_prompts

    model = demo_model().to(device)
    if smoke:
        del model.model.layers[2:]
        model.config.num_hidden_layers = 2
    prompts = demo_prompts(model.config.vocab_size, PROMPT_LENGTHS[:3] if smoke else PROMPT_LENGTHS)
    new_tokens = 4 if smoke else 48
    backend = "triton" if device == "cuda" else "auto"
    sizes = dict(max_batch_size=len(prompts), max_seq_len=max(map(len, prompts)) + new_tokens, prefill_chunk=1024)
    backends = dict(prefill_backend=backend, decode_backend=backend)
    eager = hybrid_ops.HybridGenerator(model, **sizes, **backends, compile=False)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        path = hybrid_ops.package(model, Path(folder, "demo.pt2"), **sizes, **backends)
        packaging = time.perf_counter() - start
        served = hybrid_ops.HybridGenerator.from_package(path, cuda_graphs=True)
    runs = []
    for generator in (eager, served):
        generator.generate(prompts, new_tokens)  # with graphs: captures them
        stats = hybrid_ops.GenerationStats()
        runs.append((generator.generate(prompts, new_tokens, stats=stats), stats.tokens_per_second))
    (want, eager_rate), (tokens, rate) = runs
    graphs = len(getattr(served.runner.forward, "graphs", ()))
    report.append(
        f"package ({packaging:.0f} s to package), served with cuda_graphs: {graphs} CUDA graphs captured; "
        f"{rate:.0f} tokens/s against {eager_rate:.0f} eager ({rate / eager_rate:.2f}x); identical tokens for "
        f"{sum(a == b for a, b in zip(tokens, want))}/{len(prompts)} prompts"
    )
    print(report[-1], flush=True)
    assert tokens == want and (graphs > 0) == (device == "cuda"), report[-1]


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


# The state layers checked: (name, op, dims on the GPU, dims with --smoke, variant). dims: (C, K) of a convolution,
# (Hk, Hv, Dk, Dv) of the gated delta rule, (H, P, G, N) of the scan. The GPU's are the models': Mamba2's
# convolution over x, B, C (Nemotron-H, Granite 4); Qwen3-Next's gated delta rule, Kimi Linear's decay per key channel;
# Mamba2's scan (H 128, P 64, G 8, N 128) and Jamba's Mamba1 (P 1, A [H, N]).
STATE_LAYERS = [
    ("conv", "causal_conv1d", (10240, 4), (40, 4), ""),
    ("delta", "gated_delta_rule", (16, 32, 128, 128), (2, 4, 32, 16), ""),
    ("delta per-channel decay", "gated_delta_rule", (16, 32, 128, 128), (2, 4, 32, 16), "per_channel"),
    ("mamba2", "selective_scan", (128, 64, 8, 128), (4, 8, 2, 16), ""),
    ("mamba1", "selective_scan", (1024, 1, 1, 16), (24, 1, 1, 16), "per_channel"),
]
# name -> (forward mode, speculative_attention_mode, make_batch's arguments); prefill's q_lens on the GPU, --smoke's.
STATE_BATCHES = {
    "prefill": (
        ForwardMode.MIXED,
        "prefill",
        dict(prefixes=[0, 20, 5, 9], padding=1),
        ([300, 1, 1000, 0], [9, 1, 17, 0]),
    ),
    "decode": (ForwardMode.DECODE, "prefill", dict(q_lens=[1] * 6, prefixes=[4, 1, 7, 30, 2, 0], padding=2), None),
    "verify": (ForwardMode.TARGET_VERIFY, "decode", dict(q_lens=[4] * 3, prefixes=[3, 8, 1], padding=1), None),
    "verify tree": (ForwardMode.TARGET_VERIFY, "decode", dict(q_lens=[0] * 3, prefixes=[5, 2, 9], tree=(3, 2)), None),
    "prefill tree": (ForwardMode.EXTEND, "prefill", dict(q_lens=[0] * 2, prefixes=[6, 0], tree=(2, 2)), None),
}
# Triton against torch, both float32 inside: max abs error over the expected tensor's magnitude (at least 1), by the
# compared tensor's dtype (bf16 and fp16 outputs: a rounding of nearly equal values, an ulp apart).
STATE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def state_inputs(op, dims, num_tokens, dtype, device, variant, gen):
    """(the op's tensors before its state, its keywords, the state's shape and dtype) for a layer of `dims`."""
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)
    rand = lambda *shape: torch.rand(*shape, generator=gen).to(device)
    if op == "causal_conv1d":
        channels, width = dims
        tensors = (randn(num_tokens, channels), randn(channels, width) / width, randn(channels))
        return tensors, dict(activation="silu"), (width - 1, channels), dtype
    if op == "gated_delta_rule":
        k_heads, v_heads, k_dim, v_dim = dims
        q, k = (
            torch.nn.functional.normalize(randn(num_tokens, k_heads, k_dim).float(), dim=-1).to(dtype) for _ in "qk"
        )
        g = -rand(num_tokens, v_heads, *([k_dim] if variant else [])) * 0.5
        return (
            (q, k, randn(num_tokens, v_heads, v_dim), g, rand(num_tokens, v_heads)),
            {},
            (v_heads, k_dim, v_dim),
            torch.float32,
        )
    heads, head_dim, groups, state_size = dims
    rate = -rand(heads, state_size) if variant else -rand(heads) * 2
    tensors = (randn(num_tokens, heads, head_dim), randn(num_tokens, heads) - 1, rate) + tuple(
        randn(num_tokens, groups, state_size) for _ in "BC"
    )
    extra = dict(D=randn(heads).float(), z=randn(num_tokens, heads, head_dim), dt_bias=randn(heads).float() * 0.5)
    return tensors, dict(extra, dt_softplus=True), (heads, head_dim, state_size), torch.float32


def run_state_op(op, tensors, keywords, state, batch, mode, spec_mode, backend, intermediate=None):
    device = state.device
    return getattr(torch.ops.hybrid, op)(
        *tensors,
        state,
        *(t.to(device) for t in batch.metadata),
        int(mode),
        **keywords,
        tree_mask=None if batch.tree_mask is None else batch.tree_mask.to(device),
        intermediate_states=intermediate,
        prefill_backend=backend,
        decode_backend=backend,
        speculative_attention_mode=spec_mode,
    )


def assert_state_close(got, want, what):
    """got (Triton) against want (torch) within STATE_TOLERANCE; entries want holds POISON in must be untouched."""
    tolerance, poisoned = STATE_TOLERANCE[want.dtype], (want == POISON).cpu()  # POISON in want's dtype
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.equal(got[poisoned], want[poisoned]), f"{what}: a slot the batch does not hold was written"
    got, want = got[~poisoned], want[~poisoned]
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    err = (got - want).abs().max().item() if want.numel() else 0.0
    assert err <= tolerance * scale, f"{what}: max abs error {err:.3g} > {tolerance:g} x {scale:.3g}"


def check_state_ops(device, smoke, report):
    """Every state layer, batch and dtype on Triton against the torch backend (STATE_LAYERS, STATE_BATCHES)."""
    dtypes = (torch.bfloat16,) if smoke else (torch.bfloat16, torch.float32)
    for name, op, gpu_dims, smoke_dims, variant in STATE_LAYERS:
        dims = smoke_dims if smoke else gpu_dims
        for dtype in dtypes:
            for batch_name, (mode, spec_mode, arguments, prefill_lens) in STATE_BATCHES.items():
                if prefill_lens is not None:
                    arguments = dict(arguments, q_lens=prefill_lens[smoke])
                batch = make_batch(**arguments, rng=random.Random(len(batch_name)))
                gen = torch.Generator().manual_seed(len(name))
                tensors, keywords, shape, state_dtype = state_inputs(
                    op, dims, batch.num_tokens, dtype, device, variant, gen
                )
                state = poisoned_states(batch, shape, state_dtype).to(device)
                results = {}
                for backend in ("torch", "triton"):
                    backend_state = state.clone()
                    intermediate = None
                    if mode == ForwardMode.TARGET_VERIFY:
                        verify_len = max(batch.q_lens) + 1
                        intermediate = torch.full((batch.num_slots, verify_len, *shape), POISON, dtype=state_dtype)
                        intermediate = intermediate.to(device)
                    out = run_state_op(
                        op, tensors, keywords, backend_state, batch, mode, spec_mode, backend, intermediate
                    )
                    results[backend] = (out, backend_state, intermediate)
                for what, want, got in zip(("output", "state", "intermediate states"), *results.values()):
                    if want is not None:
                        assert_state_close(got, want, f"{name} {batch_name} {dtype} {what}")
        report.append(f"state ops: triton {name} {dims} as torch, {', '.join(STATE_BATCHES)}, {dtypes}")
        print(report[-1], flush=True)


def check_state_graphs(report):
    """Each Triton state op captured in a CUDA graph on the decode path (6 requests and 2 padding ones), then
    replayed over new inputs, slots and lengths copied into the captured tensors: outputs and states as an eager call
    on the same values, bit for bit."""
    mode, _, arguments, _ = STATE_BATCHES["decode"]
    for name, op, dims, _, variant in STATE_LAYERS:
        rng, gen = random.Random(0), torch.Generator().manual_seed(0)
        batch = make_batch(**arguments, rng=rng)
        tensors, keywords, shape, state_dtype = state_inputs(
            op, dims, batch.num_tokens, torch.bfloat16, "cuda", variant, gen
        )
        state = poisoned_states(batch, shape, state_dtype).cuda()
        metadata = [t.cuda() for t in batch.metadata]

        def call(state=state):
            return getattr(torch.ops.hybrid, op)(
                *tensors, state, *metadata, int(mode), **keywords, prefill_backend="triton", decode_backend="triton"
            )

        call()  # compiles the kernel before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for _ in range(2):
            replay = make_batch(**arguments, rng=rng)
            new_tensors, _, _, _ = state_inputs(op, dims, batch.num_tokens, torch.bfloat16, "cuda", variant, gen)
            for static, new in zip((*tensors, *metadata), (*new_tensors, *(t.cuda() for t in replay.metadata))):
                static.copy_(new)
            state.copy_(poisoned_states(replay, shape, state_dtype))
            eager_state = state.clone()
            graph.replay()
            eager = call(eager_state)
            torch.cuda.synchronize()
            assert torch.equal(out, eager) and torch.equal(state, eager_state), f"{name}: a replay differs from eager"
        report.append(f"state ops: triton {name} captured in a CUDA graph, replayed over new inputs and slots as eager")
        print(report[-1], flush=True)


def benchmark_state_ops(device, smoke, rows):
    """Triton and torch per call, decode (64 requests, 1 token each) and prefill (4 requests of 512 tokens), bf16:
    rows of the state table, with the Triton decode's state traffic (each held state read and written once)."""
    shapes = {"decode": ([1] * 64, [100] * 64), "prefill": ([512] * 4, [0] * 4)}
    if smoke:
        shapes = {"decode": ([1] * 2, [3] * 2), "prefill": ([16] * 2, [0] * 2)}
    for name, op, gpu_dims, smoke_dims, variant in STATE_LAYERS:
        dims = smoke_dims if smoke else gpu_dims
        for kind, (q_lens, prefixes) in shapes.items():
            batch = make_batch(q_lens, prefixes, rng=random.Random(0))
            mode = ForwardMode.DECODE if kind == "decode" else ForwardMode.EXTEND
            gen = torch.Generator().manual_seed(0)
            tensors, keywords, shape, state_dtype = state_inputs(
                op, dims, batch.num_tokens, torch.bfloat16, device, variant, gen
            )
            state = poisoned_states(batch, shape, state_dtype).to(device)
            row = dict(op=name, shape=f"{kind} {len(q_lens)} x {q_lens[0]}")
            for backend in ("torch", "triton"):
                row[backend] = timed(
                    lambda: run_state_op(op, tensors, keywords, state, batch, mode, "prefill", backend), device
                )
            state_bytes = 2 * len(q_lens) * state[0].numel() * state.element_size()
            row["triton_state_gbps"] = state_bytes / row["triton"] / 1e6 if kind == "decode" else None
            rows.append(row)
            print(row, flush=True)


def check_mla_latent(device, smoke, rows, report):
    """Section 7: MLA's latent cache through the Triton kernels (two dots for the scores, V read with K's first
    block), then its decode time against expanded heads'."""
    dims = (4, 40, 32) if smoke else (576, 512)
    heads = (4,) if smoke else (16, 128)
    d, dv = dims[-2:]
    for dtype in (torch.bfloat16,) if smoke else (torch.bfloat16, torch.float16, torch.float32):
        for hq in heads:
            for path, q_lens in (("decode", [1, 1]), ("decode", [4, 4]), ("prefill", [37, 5])):
                case = latent_case(q_lens, [300, 41], hq, d, dv, page_size=16, dtype=dtype, seed=hq, device=device)
                k_expected, _ = expected_cache(case)
                out = getattr(torch.ops.hybrid, path)(*case.args, backend="triton")
                assert_close(out.cpu(), reference(case), dtype)
                assert torch.equal(case.k_cache.cpu(), k_expected.cpu()), "the latent cache's bytes"
    report.append(f"triton MLA latent cache D {d} / Dv {dv}: decode, verify 4, prefill at Hq {heads} correct")
    print(report[-1], flush=True)
    batch, context, hq = (2, 64, 4) if smoke else (16, 4096, 128)
    q_lens, prefixes = [1] * batch, [context - 1] * batch
    latent = paged_batch(q_lens, prefixes, hq, 1, d, 16, torch.bfloat16, device)
    latent = (*latent[:2], latent[1][..., :dv], latent[3], latent[3][..., :dv], *latent[5:])
    expanded_d, expanded_dv = (24, 16) if smoke else (192, 128)  # DeepSeek's qk_nope + rope, v_head_dim
    expanded = paged_batch(q_lens, prefixes, hq, hq, expanded_d, 16, torch.bfloat16, device)
    expanded = (*expanded[:2], expanded[2][..., :expanded_dv].contiguous(), expanded[3],
                expanded[4][..., :expanded_dv].contiguous(), *expanded[5:])  # fmt: skip
    for name, args, row_bytes in (("latent", latent, d), ("expanded", expanded, hq * (expanded_d + expanded_dv))):
        ms = timed(lambda: torch.ops.hybrid.decode(*args, backend="triton"), device)
        kv_bytes = batch * context * row_bytes * 2
        rows.append(dict(cache=name, shape=f"batch {batch} x ctx {context}, Hq {hq}", ms=ms, gbps=kv_bytes / ms / 1e6))
        print(rows[-1], flush=True)


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
    check_triton_fp32(device, args.smoke, report)
    check_triton_many_rows(device, args.smoke, report)
    check_triton_fp8(device, args.smoke, report)
    if device == "cuda":
        check_cuda_graphs(report)
    check_generator_graphs(device, args.smoke, report)
    check_package(device, args.smoke, report)
    check_state_ops(device, args.smoke, report)
    if device == "cuda":
        check_state_graphs(report)
    rates = benchmark(device, args.smoke, rows)
    state_rows = []
    benchmark_state_ops(device, args.smoke, state_rows)
    mla_rows = []
    check_mla_latent(device, args.smoke, mla_rows, report)
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
    lines += [
        "",
        "| state op | shape | torch ms | triton ms | torch / triton | triton state GB/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in state_rows:
        gbps = "" if row["triton_state_gbps"] is None else f"{row['triton_state_gbps']:.0f}"
        lines.append(
            f"| {row['op']} | {row['shape']} | {row['torch']:.3f} | {row['triton']:.3f} "
            f"| {row['torch'] / row['triton']:.1f}x | {gbps} |"
        )
    lines += ["", "| MLA decode cache | shape | triton ms | cache GB/s |", "|---|---|---:|---:|"]
    lines += [f"| {r['cache']} | {r['shape']} | {r['ms']:.3f} | {r['gbps']:.0f} |" for r in mla_rows]
    lines.append(f"\n{time.time() - start:.0f} s in all")
    text = "\n".join(lines) + "\n"
    print(text)
    name = "gpu" if device == "cuda" else "gpu_check_smoke_cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.md").write_text(text)
    results = dict(report=report, rates=rates, rows=rows, state_rows=state_rows, mla_rows=mla_rows)
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1))
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / f"{name}.md").write_text(text)


if __name__ == "__main__":
    main()
