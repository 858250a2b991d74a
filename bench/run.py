"""hybrid_ops against its peers, measured side by side in one run (this machine is shared: read the ratios).

    python -m bench                 # everything: op level, dispatch overhead, end to end, prefix caching, plot
    python -m bench op dispatch     # some sections
    python -m bench fp8             # the accuracy of fp8 KV caches on the demo model (no timing)
    python -m bench tree            # a speculative tree's verify step against the chain's, cpu backend
    python -m bench startup         # seconds from a new process's start to its first token (bench/startup.py)
    python -m bench hybrid          # hybrid model families against a Llama and transformers (bench/hybrid.py)
    python -m bench mla             # MLA decode over a latent cache against expanded K and V (bench/mla.py)
    python -m bench sglang          # sglang's Engine with hybrid_ops against its own backends (bench/engines.py)
    python -m bench vllm            # vLLM's CPU engine, its backend and ours, and our generator (bench/engines.py)
    python -m bench vllm --engine-models "8 layers, 1024 wide, bf16"   # the engines' sections on some models
    python -m bench --quick         # smaller sizes, fewer repetitions (prints only)
    python -m bench op e2e --save   # some sections, their tables written as the kept results

IPEX's rows (op) and llama.cpp's (e2e) run in processes of their own python, named by HYBRID_OPS_IPEX_PYTHON,
HYBRID_OPS_LLAMA_CPP_PYTHON and HYBRID_OPS_LLAMA_CPP_CONVERTER or the flags (docs/benchmarks.md makes them); the
engines' (sglang, vllm) under HYBRID_OPS_ENGINES_PYTHON, default <repo>/.venv-engines/bin/python. The engines'
sections run only when named: "everything" leaves them out.

A full run writes bench/results/cpu.json, .md (the tables) and .png (decode time against context length).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import hybrid_ops
from hybrid_ops import PagedKVCache
from hybrid_ops.fp8 import quantize
from hybrid_ops.options import Options, cpp_header

from .engines import MODELS as ENGINE_MODELS
from .engines import default_engines_python
from .peer_worker import case_spec, make_case, paged
from .peers import (
    ENGINES_PYTHON,
    IPEX_METHOD,
    IPEX_PYTHON,
    LLAMA_CPP_CONVERTER,
    LLAMA_CPP_PYTHON,
    Ipex,
    LlamaCpp,
    PeerError,
)
from .startup import LARGER_SIZES

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parent.parent))  # the e2e and prefix sections import examples/generate.py
HQ, HKV, D, PAGE = 32, 8, 128, 16
STATIC_CACHE_LEN = 4096
SECTIONS = ["op", "dispatch", "e2e", "step", "prefix", "fp8", "tree", "startup", "hybrid", "mla", "plot"]
# Sections run only when named (each starts serving engines under their own python: minutes per model).
ENGINE_SECTIONS = ["sglang", "vllm"]


def timeit(fn, reps=7, warmup=5):
    """Median seconds of `fn()`, after `warmup` calls (oneDNN generates its kernels over the first few: brgemm in the
    cpu backend's prefill, SDPA's on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timeit_side_by_side(make_fns, reps, warmup=5, notes=None, before=None):
    """Median seconds of each `make_fns[name]()`, timed in `reps` rounds that call every method once: this machine's
    speed drifts, so methods timed one after the other would compare different moments, and a method called many times
    in a row would find its data still in the last-level cache, which decode on a serving engine does not (a layer's
    cache is read once per step). A method run in another process returns the seconds it measured there (a float), so
    that the pipe to it is not timed. None where building or running a method fails (a peer that does not support the
    case, or is not installed), with the reason in `notes[name]`. `before()`, where given, runs untimed ahead of each
    timed call."""
    fns = {}
    for name, make_fn in make_fns.items():
        try:
            fns[name] = make_fn()
            for _ in range(warmup):
                fns[name]()
        except Exception as e:  # noqa: BLE001 - a failing peer is a result to report, not a reason to stop
            fns.pop(name, None)
            reason = str(e).splitlines()[0][:120] if isinstance(e, PeerError) else type(e).__name__
            print(f"    {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            if notes is not None:
                notes[name] = reason
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if before is not None:
                before()
            start = time.perf_counter()
            own = fn()
            times[name].append(own if isinstance(own, float) else time.perf_counter() - start)
    return {name: statistics.median(times[name]) if name in fns else None for name in make_fns}


def cpu_description():
    """The CPU's model name, family and model numbers, and which of the vector extensions these kernels use it has."""
    fields = dict(
        line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines() if ":" in line
    )
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    isa = [
        f
        for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16")
        if f in flags
    ]
    absent = [name for name, flag in (("AVX-512", "avx512f"), ("AMX", "amx_bf16")) if flag not in flags]
    return (
        f"{fields.get('model name', platform.processor())} (family {fields.get('cpu family')}, model "
        f"{fields.get('model')}; {' '.join(isa)}" + "".join(f"; no {name}" for name in absent) + ")"
    )


def read_bandwidth():
    """GB/s of summing a 512 MiB tensor: the floor for reading a KV cache."""
    x = torch.ones(128 << 20)
    return x.numel() * 4 / timeit(lambda: x.sum(), reps=5) / 1e9


class Batch:
    """Requests with a cached prefix and `n` new tokens each (`peer_worker.make_case`: a process of another python
    builds the same tensors from `spec`), in a paged cache and as the peers hold them."""

    def __init__(self, prefix_lens, new_lens, dtype, shuffle_pages):
        self.spec = case_spec(prefix_lens, new_lens, dtype, shuffle_pages, HQ, HKV, D, PAGE)
        self.case = make_case(self.spec)
        self.prefix_lens, self.new_lens = prefix_lens, new_lens
        self.seq_lens = self.case.seq_lens.tolist()
        self.dtype = dtype
        # Dense K/V per request: [1, Hkv, L, D], contiguous, the cache's contents
        self.k, self.v, self.q = self.case.k, self.case.v, self.case.q
        self.k_cache, self.v_cache = paged(self.case, self.k), paged(self.case, self.v)
        self.meta = self.case.cu_seqlens_q, self.case.seq_lens, self.case.block_table
        starts = self.case.cu_seqlens_q.tolist()
        self.k_new, self.v_new = self.case.k_new, self.case.v_new
        self.q_per_request = [self.q[a:b].transpose(0, 1)[None] for a, b in zip(starts, starts[1:])]
        self.kv_bytes = sum(self.seq_lens) * HKV * D * 2 * torch.finfo(dtype).bits // 8

    def hybrid(self, op, backend, **options):
        return lambda: op(
            self.q, self.k_new, self.v_new, self.k_cache, self.v_cache, *self.meta, backend=backend, **options
        )

    def fp8_caches(self, cache_dtype=torch.float8_e4m3fn):
        """(k_cache, v_cache, k_scale, v_scale): copies of the caches in `cache_dtype`, with a scale per kv head (its
        largest value to the format's largest)."""
        caches = self.k_cache, self.v_cache
        scales = [c.float().abs().amax(dim=(0, 1, 3)) / torch.finfo(cache_dtype).max for c in caches]
        return *(quantize(c, s, cache_dtype) for c, s in zip(caches, scales)), *scales

    def hybrid_fp8(self, op, backend, cache_dtype=torch.float8_e4m3fn):
        """The same call over fp8_caches(cache_dtype)."""
        k_cache, v_cache, k_scale, v_scale = self.fp8_caches(cache_dtype)
        return lambda: op(
            self.q,
            self.k_new,
            self.v_new,
            k_cache,
            v_cache,
            *self.meta,
            k_scale=k_scale,
            v_scale=v_scale,
            backend=backend,
        )

    def read_floor(self):
        """A sum over the caches' bytes (as fp32 words, whatever their dtype): the time of reading them once, in the
        same rounds as the decode rows, so that a loaded moment slows both."""
        words = [c.view(torch.float32) for c in (self.k_cache, self.v_cache)]
        return lambda: sum(w.sum() for w in words)

    def sdpa_exact(self):
        """Per-request SDPA over exact contiguous K/V: the dense ideal."""

        def run():
            for q, k, v in zip(self.q_per_request, self.k, self.v):
                mask = None if q.shape[2] == 1 else causal_lower_right(q.shape[2], k.shape[2])
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        return run

    def sdpa_padded(self):
        """One masked SDPA over a [B, Hkv, 4096, D] static cache, queries padded to the longest: StaticCache."""
        batch, width = len(self.seq_lens), max(self.new_lens)
        k_pad = torch.zeros(batch, HKV, STATIC_CACHE_LEN, D, dtype=self.dtype)
        v_pad = torch.zeros_like(k_pad)
        q_pad = torch.zeros(batch, HQ, width, D, dtype=self.dtype)
        for i, s in enumerate(self.seq_lens):
            k_pad[i, :, :s], v_pad[i, :, :s] = self.k[i][0], self.v[i][0]
            q_pad[i, :, width - self.new_lens[i] :] = self.q_per_request[i][0]
        q_pos = torch.tensor(self.seq_lens)[:, None] - width + torch.arange(width)  # left-padded queries
        mask = (torch.arange(STATIC_CACHE_LEN) <= q_pos[:, :, None])[:, None]
        return lambda: F.scaled_dot_product_attention(q_pad, k_pad, v_pad, attn_mask=mask, enable_gqa=True)

    def flex(self):
        """Compiled FlexAttention over packed K/V with a document (and causal) mask."""
        k = torch.cat([k for k in self.k], dim=2)
        v = torch.cat([v for v in self.v], dim=2)
        q = torch.cat(self.q_per_request, dim=2)
        doc_q = torch.repeat_interleave(torch.arange(len(self.new_lens)), torch.tensor(self.new_lens))
        doc_kv = torch.repeat_interleave(torch.arange(len(self.seq_lens)), torch.tensor(self.seq_lens))
        kv_start = torch.tensor([0] + self.seq_lens).cumsum(0)[:-1]
        q_pos = torch.cat([torch.arange(p, p + n) for p, n in zip(self.prefix_lens, self.new_lens)])

        def mask_mod(b, h, q_idx, kv_idx):
            doc = doc_q[q_idx]
            return (doc == doc_kv[kv_idx]) & (kv_idx - kv_start[doc] <= q_pos[q_idx])

        torch._dynamo.reset()  # a failed flex compile for one shape must not poison the next
        block_mask = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device="cpu")
        compiled = torch.compile(flex_attention)
        return lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=True)


# The backends that run on the CPU, each its own rows; ratios are against the first.
HYBRID_BACKENDS = ["cpu", "torch"]
# The peers' rows: method name -> the Batch method that builds it.
PEER_METHODS = {
    "sdpa exact per request": "sdpa_exact",
    "sdpa padded static cache": "sdpa_padded",
    "flex attention": "flex",
}
PEERS = list(PEER_METHODS)
# bf16 decode's extra rows: the cpu backend over an fp8 copy of the cache, timed in the same rounds.
FP8_METHOD = f"hybrid_ops {HYBRID_BACKENDS[0]}, fp8 e4m3 cache"
# Decode's floor: one read of the cache's bytes, timed in the same rounds.
READ_METHOD = "read the KV cache once (sum)"


def hybrid_methods(batch, op):
    return {f"hybrid_ops {b}": (lambda b=b: batch.hybrid(op, b)) for b in HYBRID_BACKENDS}


DECODE_LENS = torch.linspace(256, 2048, 16).long().tolist()
# The op section's cases: name, dtype, prefixes (for decode: the context, the new token included), new tokens, peers
# measured (pages do not matter to them: consecutive pages only).
OP_CASES = [
    ("decode", "fp32", [n - 1 for n in DECODE_LENS], [1] * 16, torch.float32, PEERS),
    ("decode", "bf16", [n - 1 for n in DECODE_LENS], [1] * 16, torch.bfloat16, PEERS),
    ("prefill", "fp32", [0] * 4, [512, 256, 1024, 384], torch.float32, PEERS),
    ("prefill", "bf16", [0] * 4, [512, 256, 1024, 384], torch.bfloat16, PEERS[:1]),
    ("prefill+prefix", "fp32", [1024, 512, 2048, 768], [256, 128, 512, 192], torch.float32, PEERS),
    ("prefill+prefix", "bf16", [1024, 512, 2048, 768], [256, 128, 512, 192], torch.bfloat16, PEERS[:1]),
]


def op_section(quick, bandwidth, ipex, reps=None):
    """Each case's methods timed side by side in `reps` rounds (default 3 quick, else 15), `ipex` (an `Ipex`) in its
    own process."""
    reps = reps or (3 if quick else 15)
    cases = OP_CASES
    if quick:
        cases = [c for c in cases if c[1] == "fp32" or c[:2] == ("decode", "bf16")]
    rows = []
    for name, dtype_name, prefixes, news, dtype, peers in cases:
        op = torch.ops.hybrid.decode if name == "decode" else torch.ops.hybrid.prefill
        batches = {
            layout: Batch(prefixes, news, dtype, shuffle_pages=layout == "scattered")
            for layout in ("consecutive", "scattered")
        }
        methods = {}
        for layout, batch in batches.items():
            methods |= {(layout, m): fn for m, fn in hybrid_methods(batch, op).items()}
            if layout == "consecutive" or name == "decode":
                methods |= {(layout, m): getattr(batch, PEER_METHODS[m]) for m in peers}
            if name == "decode":
                methods[(layout, READ_METHOD)] = batch.read_floor
            if (name, dtype) == ("decode", torch.bfloat16):
                methods[(layout, FP8_METHOD)] = lambda batch=batch: batch.hybrid_fp8(op, HYBRID_BACKENDS[0])
            methods[(layout, IPEX_METHOD)] = ipex.method(f"{name} {dtype_name} {layout}", batch)
        notes = {}
        times = timeit_side_by_side(methods, reps, notes=notes)
        ipex.forget()
        for layout, batch in batches.items():
            ours = times[(layout, f"hybrid_ops {HYBRID_BACKENDS[0]}")]
            measured = {m: t for (pages, m), t in times.items() if pages == layout}
            for method, seconds in measured.items():
                kv_bytes = batch.kv_bytes // 2 if method == FP8_METHOD else batch.kv_bytes  # 1 byte, not 2
                if method == READ_METHOD:  # every page's rows, the unused tails of last pages too
                    kv_bytes = batch.k_cache.nbytes + batch.v_cache.nbytes
                rows.append(
                    dict(
                        case=name,
                        dtype=dtype_name,
                        pages=layout,
                        method=method,
                        ms=seconds and seconds * 1e3,
                        kv_gbps=seconds and kv_bytes / seconds / 1e9,
                        of_read_bandwidth=seconds and kv_bytes / seconds / 1e9 / bandwidth,
                        vs_hybrid=seconds and ours and seconds / ours,
                        note=notes.get((layout, method)),
                    )
                )
            print(
                f"  {name} {dtype_name} {layout}: "
                + ", ".join(f"{m} {t * 1e3:.1f} ms" if t else f"{m} failed" for m, t in measured.items()),
                flush=True,
            )
            if measured.get(FP8_METHOD) and ours:
                print(f"  {name} {layout}: fp8 e4m3 / bf16 cache time {measured[FP8_METHOD] / ours:.2f}", flush=True)
    return rows


def context_sweep(quick):
    """Decode time against context length (16 requests of equal length, fp32), per method."""
    lengths = [256, 1024] if quick else [256, 512, 1024, 2048, 3072]
    series = {}
    for length in lengths:
        batch = Batch([length - 1] * 16, [1] * 16, torch.float32, shuffle_pages=False)
        methods = hybrid_methods(batch, torch.ops.hybrid.decode) | {m: getattr(batch, PEER_METHODS[m]) for m in PEERS}
        for method, seconds in timeit_side_by_side(methods, 3).items():
            if seconds:
                series.setdefault(method, []).append((length, seconds * 1e3))
    return series


class _Null(hybrid_ops.Backend):
    """A Python backend that does nothing: what remains of a call through the op is the dispatch cost."""

    name, checks_values = "null", True

    def supports(self, spec):
        return True

    def prefill(self, q, *args):
        return q.new_empty(q.shape)  # a fresh output, as every backend returns

    decode = prefill


# The floor: attn's schema with a C++ CPU kernel that only allocates the output (no checks, no routing, no work).
_BARE_OP = r"""
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include "options.h"
#define OPTION_TYPE(type, name) , type
at::Tensor bare(const at::Tensor& q, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                const at::Tensor&, const at::Tensor&, int64_t HYBRID_OPTIONS(OPTION_TYPE), c10::string_view,
                c10::string_view, c10::string_view) {
  return at::empty_like(q);
}
TORCH_LIBRARY_IMPL(hybrid_bench, CPU, m) { m.impl("attn", &bare); }
"""


def bare_op():
    """torch.ops.hybrid_bench.attn: the floor op (built once with torch's extension tooling)."""
    from torch.utils import cpp_extension

    from hybrid_ops.ops import SCHEMAS

    lib = torch.library.Library("hybrid_bench", "FRAGMENT")
    lib.define(SCHEMAS["attn"])
    torch.library.register_fake("hybrid_bench::attn", lambda q, *args, **kwargs: q.new_empty(q.shape), lib=lib)
    include = Path(tempfile.mkdtemp())
    (include / "options.h").write_text(cpp_header())
    cpp_extension.load_inline(
        "hybrid_bench_bare_op",
        [_BARE_OP],
        is_python_module=False,
        extra_cflags=["-O2"],
        extra_include_paths=[str(include)],
    )
    bare_op.lib = lib  # keeps the registration alive
    return torch.ops.hybrid_bench.attn


def dispatch_section(quick):
    """Per-call cost: the op against the kernel it runs and against the floor op, eager and inside a compiled graph;
    rounds of 20,000 calls (quick: 1,000)."""
    bare = bare_op()
    q = torch.randn(1, 1, 8)
    cache = torch.zeros(2, 1, 1, 8)
    one = torch.tensor([0, 1], dtype=torch.int32)
    decode = (q, q, q, cache, cache.clone(), one, one[1:], one[:1].view(1, 1))
    none = q[:0]
    idle = (none, none, none, cache, cache.clone(), one[:1], one[:0], one[:0].view(0, 1))
    kernel = hybrid_ops.get_backend("cpu")._module.forward
    options = Options(scale=0.3).keywords()
    n = 1000 if quick else 20000

    def per_call(fns):
        """Microseconds per call of each function, timed side by side in rounds of n calls each."""

        def loop(fn):
            def run():
                for _ in range(n):
                    fn()

            return run

        times = timeit_side_by_side({name: (lambda f=f: loop(f)) for name, f in fns.items()}, reps=5, warmup=1)
        return {name: seconds / n * 1e6 for name, seconds in times.items()}

    rows = []
    with torch.no_grad():
        for name, args, mode in (("decode (T = 1)", decode, 2), ("IDLE (T = 0)", idle, 4)):
            us = per_call(
                dict(
                    kernel=lambda: kernel(*args, **options, decode=True),
                    bare=lambda: bare(*args, mode, decode_backend="cpu"),
                    op=lambda: torch.ops.hybrid.attn(*args, mode, decode_backend="cpu"),
                )
            )
            rows.append(
                dict(mode=f"eager {name}, cpu backend", kernel_us=us["kernel"], bare_us=us["bare"], op_us=us["op"])
            )

        # Compiled: the same graph around the op and around the floor op (guards and wrapper are in both).
        def compiled(op):
            return torch.compile(lambda *a: op(*a, 2, decode_backend="cpu"), fullgraph=True, dynamic=True)

        compiled_bare, compiled_op = compiled(bare), compiled(torch.ops.hybrid.attn)
        us = per_call(dict(bare=lambda: compiled_bare(*decode), op=lambda: compiled_op(*decode)))
        rows.append(
            dict(
                mode="compiled decode (T = 1), cpu backend",
                kernel_us=rows[0]["kernel_us"],
                bare_us=us["bare"],
                op_us=us["op"],
            )
        )

        # A backend written in Python goes through the op's Python implementation.
        hybrid_ops.register_backend(_Null())
        null = _Null()
        us = per_call(
            dict(
                kernel=lambda: null.decode(*decode), op=lambda: torch.ops.hybrid.attn(*decode, 2, decode_backend="null")
            )
        )
        rows.append(
            dict(
                mode="eager decode (T = 1), a Python backend",
                kernel_us=us["kernel"],
                bare_us=rows[0]["bare_us"],
                op_us=us["op"],
            )
        )
    return rows


LLAMA_CPP_TYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the GGUF type of a model's dtype


def tokens_as_ours(tokens, ours):
    """Tokens equal to ours before each request's first difference, summed over the requests."""
    return sum(next((i for i, (a, b) in enumerate(zip(t, o)) if a != b), len(o)) for t, o in zip(tokens, ours))


def e2e_section(quick, llama_cpp):
    """Generation through our loop, transformers' static-cache compiled generate and llama.cpp (`llama_cpp`, a
    `LlamaCpp`: a GGUF of the model's type, f32 or bf16), greedy, on the demo's model and a larger one in fp32 and
    bf16: one prompt, the demo's prompts and a more ragged batch. Each method's tokens are compared with ours;
    llama.cpp's logits at the prompts' last positions with transformers' eager forward (their first token)."""
    from examples.generate import PROMPT_LENGTHS, demo_model, demo_prompts, run_hybrid, run_transformers_static

    ragged = torch.linspace(16, 1000, 16).long().tolist()
    models = {"demo": demo_model()}
    workloads = [
        ("demo", "1 prompt of 150, 48 new", [150], 48),
        ("demo", "8 prompts of 7..150, 48 new", PROMPT_LENGTHS, 48),
        ("demo", "16 prompts of 16..1000, 32 new", ragged, 32),
        ("8 layers, 1024 wide", "1 prompt of 150, 48 new", [150], 48),
        ("8 layers, 1024 wide", "8 prompts of 7..150, 48 new", PROMPT_LENGTHS, 48),
        ("8 layers, 1024 wide", "16 prompts of 16..1000, 32 new", ragged, 32),
        ("8 layers, 1024 wide, bf16", "8 prompts of 7..150, 48 new", PROMPT_LENGTHS, 48),
        ("8 layers, 1024 wide, bf16", "16 prompts of 16..1000, 32 new", ragged, 32),
    ]
    if quick:
        workloads = [("demo", "8 prompts of 7..150, 16 new", PROMPT_LENGTHS, 16)]
    else:
        models["8 layers, 1024 wide"] = demo_model(**LARGER_SIZES)
        models["8 layers, 1024 wide, bf16"] = demo_model(dtype=torch.bfloat16, **LARGER_SIZES)
    rows = []
    for model_name, name, lengths, new_tokens in workloads:
        model = models[model_name]
        workload = f"{model_name}: {name}"
        prompts = demo_prompts(model.config.vocab_size, lengths)
        tokens, stats, _, recompiles = run_hybrid(model, prompts, new_tokens)
        ref_tokens, seconds = run_transformers_static(model, prompts, new_tokens)
        _, first_seconds = run_transformers_static(model, prompts, 1)
        ours = dict(tokens_per_s=stats.tokens_per_second, ttft_ms=statistics.mean(stats.first_token_seconds) * 1e3)
        total = len(prompts) * new_tokens
        measured = {
            "hybrid_ops generate (compiled)": ours | dict(recompiles=recompiles),
            "transformers static cache (compiled)": dict(
                tokens_per_s=total / seconds,
                ttft_ms=first_seconds * 1e3,
                same_tokens=tokens_as_ours(ref_tokens, tokens),
            ),
        }
        with torch.no_grad():
            logits = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
        outtype = LLAMA_CPP_TYPES[model.dtype]
        llama_method = f"llama.cpp {outtype} (llama-cpp-python)"
        try:
            out = llama_cpp.generate(model, prompts, new_tokens, outtype)
            measured[llama_method] = dict(
                tokens_per_s=total / out["seconds"],
                ttft_ms=statistics.mean(out["first_token_seconds"]) * 1e3,
                same_tokens=tokens_as_ours(out["tokens"], tokens),
                logits_error=(torch.tensor(out["first_logits"]) - logits.float()).abs().max().item(),
                logits_std=logits.float().std().item(),
            )
        except PeerError as e:
            measured[llama_method] = dict(note=str(e))
            print(f"  {workload}: {llama_method} failed: {e}", flush=True)
        for peer in ("transformers static cache (compiled)", llama_method):
            if measured[peer].get("tokens_per_s"):
                measured[f"ratio hybrid_ops / {peer.split(' ')[0]}"] = dict(
                    tokens_per_s=ours["tokens_per_s"] / measured[peer]["tokens_per_s"],
                    ttft_ms=ours["ttft_ms"] / measured[peer]["ttft_ms"],
                )
        for method, row in measured.items():
            rows.append(dict(workload=workload, method=method, tokens=total) | row)
            print(f"  {workload}: {method} {row}", flush=True)
    return rows


def prefix_section(quick):
    """The demo's model on 16 prompts sharing a 1,000-token prefix (tails of 8..64 tokens), prefix caching on against
    off: one compiled generator each, warmed up on prompts of another prefix, so the measured run shares only within
    its own batch. The tokens must be the same."""
    from examples.generate import demo_model

    model = demo_model()
    new_tokens = 8 if quick else 32
    tails = torch.linspace(8, 64, 16).long().tolist()

    def prompts(seed):
        gen = torch.Generator().manual_seed(seed)
        prefix = torch.randint(1, model.config.vocab_size, (1000,), generator=gen).tolist()
        return [prefix + torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist() for n in tails]

    warm_up, measured = prompts(1), prompts(2)
    runs = {}
    for caching in (False, True):
        generator = hybrid_ops.HybridGenerator(
            model,
            max_batch_size=len(tails),
            max_seq_len=1000 + max(tails) + new_tokens,
            prefill_chunk=1024,
            prefix_caching=caching,
        )
        generator.generate(warm_up, new_tokens)
        stats = hybrid_ops.GenerationStats()
        runs[caching] = generator.generate(measured, new_tokens, stats=stats), stats
    assert runs[True][0] == runs[False][0], "prefix caching changed the tokens"
    rows = [
        dict(
            method=f"prefix caching {'on' if caching else 'off'}",
            ttft_ms=statistics.mean(stats.first_token_seconds) * 1e3,
            seconds=stats.seconds,
            prompt_tokens=stats.prompt_tokens,
        )
        for caching, (_, stats) in runs.items()
    ]
    off, on = rows
    rows.append(
        dict(
            method="ratio on / off",
            ttft_ms=on["ttft_ms"] / off["ttft_ms"],
            seconds=on["seconds"] / off["seconds"],
            prompt_tokens=on["prompt_tokens"] / off["prompt_tokens"],
        )
    )
    return rows


def fp8_section(quick):
    """The accuracy of fp8 KV caches (scale 1.0) on the demo model in bf16, against its bf16 cache: greedy tokens
    (eager, the 8 demo prompts), and the logits of every position of prompt + bf16 tokens in one prefill (teacher
    forced, so a difference does not compound). The fp32 model against the bf16 one gives the scale."""
    from examples.generate import demo_model, demo_prompts
    from hybrid_ops.integrations.transformers import HybridStep

    new_tokens = 8 if quick else 32
    models = {torch.bfloat16: demo_model(dtype=torch.bfloat16), torch.float32: demo_model()}
    prompts = demo_prompts(models[torch.bfloat16].config.vocab_size)

    def tokens(kv_cache_dtype):
        return hybrid_ops.generate(
            models[torch.bfloat16], prompts, new_tokens, compile=False, kv_cache_dtype=kv_cache_dtype
        )

    def logits(model, kv_cache_dtype, sequence):
        """[len(sequence), vocab] fp32 logits of one prefill over a fresh cache."""
        config = model.config
        cache = PagedKVCache(
            -(-len(sequence) // PAGE),
            PAGE,
            config.num_key_value_heads,
            config.head_dim,
            num_layers=config.num_hidden_layers,
            dtype=kv_cache_dtype,
        )
        cache.add(0)
        batch = cache.step([0], [len(sequence)])
        step = HybridStep(
            int(batch.forward_mode),
            *batch.metadata,
            cache.k_caches,
            cache.v_caches,
            k_scales=cache.k_scales,
            v_scales=cache.v_scales,
        )
        with torch.no_grad():
            return (
                model(
                    input_ids=torch.tensor([sequence]),
                    position_ids=torch.arange(len(sequence))[None],
                    use_cache=False,
                    hybrid_step=step,
                )
                .logits[0]
                .float()
            )

    baseline = tokens(None)
    sequences = [p + t for p, t in zip(prompts, baseline)]
    base_logits = [logits(models[torch.bfloat16], torch.bfloat16, s) for s in sequences]
    rows = []
    for name, model, kv_cache_dtype in (
        ("fp8 e4m3", models[torch.bfloat16], torch.float8_e4m3fn),
        ("fp8 e5m2", models[torch.bfloat16], torch.float8_e5m2),
        ("fp32 model, fp32 cache", models[torch.float32], torch.float32),
    ):
        generated = tokens(kv_cache_dtype) if model is models[torch.bfloat16] else None
        errors = torch.cat(
            [(logits(model, kv_cache_dtype, s) - b).abs().flatten() for s, b in zip(sequences, base_logits)]
        )
        agree = torch.cat(
            [logits(model, kv_cache_dtype, s).argmax(-1) == b.argmax(-1) for s, b in zip(sequences, base_logits)]
        )
        matched = (
            None
            if generated is None
            else sum(
                next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(generated, baseline)
            )
        )
        rows.append(
            dict(
                kv_cache=name,
                tokens_matched=matched,
                tokens=len(prompts) * new_tokens,
                max_logit_error=errors.max().item(),
                mean_logit_error=errors.mean().item(),
                logit_std=torch.cat(base_logits).std().item(),
                top1_agreement=agree.float().mean().item(),
            )
        )
    return rows


def verify_tree(depth, width):
    """[1 + depth * width, same] bool rows of a draft tree laid out level by level (EAGLE's shape): the root, then
    `width` nodes a level, node i hanging from node i // 2 of the level above (the first level from the root); a node
    sees itself and its ancestors."""
    rows = torch.eye(1 + depth * width, dtype=torch.bool)
    for level in range(depth):
        for i in range(width):
            parent = 1 + (level - 1) * width + i // 2 if level else 0
            rows[1 + level * width + i] |= rows[parent]
    return rows


def tree_section(quick):
    """A verify step of 8 requests x 16 draft tokens (a full tree of depth 5, width 3, plus its root) over contexts of
    256..2048 tokens, against the same tokens as a chain (tree_mask None): the cpu backend's decode path, fp32 and
    bf16, scattered pages."""
    reps = 5 if quick else 30
    prefixes = torch.linspace(256, 2048, 8).long().tolist()
    tree = verify_tree(5, 3)
    rows = []
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        batch = Batch(prefixes, [tree.shape[0]] * len(prefixes), dtype, shuffle_pages=True)
        tree_mask = tree.repeat(len(prefixes), 1)
        op = torch.ops.hybrid.decode
        methods = {
            "chain": lambda: batch.hybrid(op, "cpu"),
            "tree": lambda: batch.hybrid(op, "cpu", tree_mask=tree_mask),
        }
        times = timeit_side_by_side(methods, reps)
        rows.append(dict(dtype=dtype_name, chain_ms=times["chain"] * 1e3, tree_ms=times["tree"] * 1e3))
        print(
            f"  verify {dtype_name}: chain {times['chain'] * 1e3:.2f} ms, tree {times['tree'] * 1e3:.2f} ms, "
            f"tree / chain {times['tree'] / times['chain']:.2f}",
            flush=True,
        )
    return rows


def markdown(results):
    lines = [
        f"Measured {results['date']} on {results['machine']}; read bandwidth {results['read_gbps']:.1f} GB/s. "
        f"`{results['command']}`; load average (1 min, {os.cpu_count()} CPUs) {results['load'][0]:.1f} at the start, "
        f"{results['load'][-1]:.1f} at the end.",
        "",
    ]
    if "op" in results:
        lines += [
            f"| case | dtype | pages | method | ms | KV GB/s | of read bw | time / hybrid_ops {HYBRID_BACKENDS[0]} |",
            "|---|---|---|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['case']} | {r['dtype']} | {r['pages']} | {r['method']} | {r['ms']:.1f} | {r['kv_gbps']:.1f} "
            f"| {r['of_read_bandwidth']:.0%} | {r['vs_hybrid']:.2f} |"
            if r["ms"]
            else f"| {r['case']} | {r['dtype']} | {r['pages']} | {r['method']} | {r.get('note') or 'failed'} | | | |"
            for r in results["op"]
        ]
        lines.append("")
    if "dispatch" in results:
        lines += [
            "| dispatch | kernel us | floor op us | op us | op - floor us | op - floor - kernel us |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['mode']} | {r['kernel_us']:.1f} | {r['bare_us']:.1f} | {r['op_us']:.1f} "
            f"| {r['op_us'] - r['bare_us']:.1f} | {r['op_us'] - r['bare_us'] - r['kernel_us']:.1f} |"
            for r in results["dispatch"]
        ]
        lines += [
            "",
            "kernel: the backend's own call (the native kernel through its Python module; the Python "
            "backend's method). floor op: attn's schema with a C++ CPU kernel that only allocates the output.",
        ]
        lines.append("")
    if "e2e" in results:
        lines += [
            "| end to end | method | tokens/s | time to first token (ms) | greedy tokens as ours "
            "| first token's logits: max abs diff to transformers (their std) |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in results["e2e"]:
            fmt = "{:.2f}x" if r["method"].startswith("ratio") else "{:.1f}"
            cells = [fmt.format(r[k]) if r.get(k) else "" for k in ("tokens_per_s", "ttft_ms")]
            cells[0] = cells[0] or r.get("note", "")
            cells.append("" if r.get("same_tokens") is None else f"{r['same_tokens']} / {r['tokens']}")
            cells.append(f"{r['logits_error']:.2g} ({r['logits_std']:.2f})" if "logits_error" in r else "")
            lines.append(f"| {r['workload']} | {r['method']} | " + " | ".join(cells) + " |")
        lines.append("")
    if "prefix" in results:
        lines += [
            "| 16 prompts sharing a 1,000-token prefix | time to first token (ms) | total (s) | prefilled tokens |",
            "|---|---:|---:|---:|",
        ]
        for r in results["prefix"]:
            fmts = ["{:.2f}x"] * 3 if r["method"].startswith("ratio") else ["{:.1f}", "{:.1f}", "{:.0f}"]
            cells = [f.format(r[k]) for f, k in zip(fmts, ("ttft_ms", "seconds", "prompt_tokens"))]
            lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
        lines.append("")
    if "tree" in results:
        lines += ["| verify, 8 x 16 tokens, cpu | chain ms | tree ms | tree / chain |", "|---|---:|---:|---:|"]
        lines += [
            f"| {r['dtype']} | {r['chain_ms']:.2f} | {r['tree_ms']:.2f} | {r['tree_ms'] / r['chain_ms']:.2f} |"
            for r in results["tree"]
        ]
        lines.append("")
    if "fp8" in results:
        lines += [
            "| demo model in bf16, against its bf16 KV cache | greedy tokens before the first difference "
            "| logits: max abs error | mean abs error | (logits' std) | top-1 agreement, teacher forced |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in results["fp8"]:
            matched = "" if r["tokens_matched"] is None else f"{r['tokens_matched']} / {r['tokens']}"
            lines.append(
                f"| {r['kv_cache']} | {matched} | {r['max_logit_error']:.3f} | {r['mean_logit_error']:.4f} "
                f"| {r['logit_std']:.3f} | {r['top1_agreement']:.1%} |"
            )
    if "startup" in results:
        from .startup import markdown as startup_markdown

        lines += ["", startup_markdown(results["startup"])]
    if "step" in results:
        from .step import markdown as step_markdown

        lines += ["", step_markdown(results["step"])]
    if "hybrid" in results:
        from .hybrid import markdown as hybrid_markdown

        lines += ["", hybrid_markdown(results["hybrid"])]
    if "mla" in results:
        from .mla import markdown as mla_markdown

        lines += ["", mla_markdown(results["mla"])]
    for name in ENGINE_SECTIONS:
        if name in results:
            from .engines import markdown as engines_markdown

            lines += ["", engines_markdown(name, results[name])]
    return "\n".join(lines) + "\n"


def plot(series, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, points in series.items():
        ax.plot(*zip(*points), marker="o", label=method)
    ax.set_xlabel("context length per request (16 requests)")
    ax.set_ylabel("decode time per step (ms)")
    ax.set_yscale("log")
    ax.set_title("Decode attention, Hq 32 / Hkv 8, D 128, fp32, page 16")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sections", nargs="*", help=f"any of {SECTIONS + ENGINE_SECTIONS} (default: all of {SECTIONS})")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ipex-python", default=os.environ.get(IPEX_PYTHON), help=f"default: ${IPEX_PYTHON}")
    parser.add_argument(
        "--llama-cpp-python", default=os.environ.get(LLAMA_CPP_PYTHON), help=f"default: ${LLAMA_CPP_PYTHON}"
    )
    parser.add_argument(
        "--llama-cpp-converter", default=os.environ.get(LLAMA_CPP_CONVERTER), help=f"default: ${LLAMA_CPP_CONVERTER}"
    )
    parser.add_argument(
        "--engines-python",
        default=default_engines_python(),
        help=f"the engines' python, for sglang and vllm (default: ${ENGINES_PYTHON}, else <repo>/.venv-engines)",
    )
    parser.add_argument(
        "--engine-models",
        nargs="+",
        choices=ENGINE_MODELS,
        help="the sglang and vllm sections' models (default: all of them; --quick: the first)",
    )
    parser.add_argument(
        "--reps", type=int, help="rounds per op case (default: 15, quick 3), per engine workload (5, quick 1)"
    )
    parser.add_argument(
        "--save", action="store_true", help="write bench/results/cpu.md and .json from these sections (no plot)"
    )
    args = parser.parse_args(argv)
    args.sections = args.sections or SECTIONS
    if set(args.sections) - set(SECTIONS + ENGINE_SECTIONS):
        parser.error(f"sections must be among {SECTIONS + ENGINE_SECTIONS}, got {args.sections}")
    # A full run replaces the kept results; a partial one only when asked, a quick one never.
    full = set(args.sections) == set(SECTIONS)
    if args.quick and args.save:
        parser.error("--save keeps full-size runs only")
    save = (full or args.save) and not args.quick
    if full and save:  # its last step draws the plot: checked now, not after half an hour of measurements
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("a full run draws bench/results/cpu.png with matplotlib: pip install -e '.[bench]'")
    torch.manual_seed(0)
    load = [os.getloadavg()[0]]
    bandwidth = read_bandwidth()
    device = "cpu"
    results = dict(
        date=time.strftime("%Y-%m-%d"),
        machine=f"{cpu_description()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        command=" ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])]),
        read_gbps=bandwidth,
        load=load,
    )
    print(f"{results['machine']}; read bandwidth {bandwidth:.1f} GB/s; load average {load[0]:.1f}")
    if "op" in args.sections:
        with Ipex(args.ipex_python) as ipex:
            results["op"] = op_section(args.quick, bandwidth, ipex, args.reps)
    if "dispatch" in args.sections:
        results["dispatch"] = dispatch_section(args.quick)
    if "e2e" in args.sections:
        with LlamaCpp(args.llama_cpp_python, args.llama_cpp_converter) as llama_cpp:
            results["e2e"] = e2e_section(args.quick, llama_cpp)
    if "step" in args.sections:
        from .step import step_section

        results["step"] = step_section(args.quick)
    if "prefix" in args.sections:
        results["prefix"] = prefix_section(args.quick)
    if "fp8" in args.sections:
        results["fp8"] = fp8_section(args.quick)
    if "tree" in args.sections:
        results["tree"] = tree_section(args.quick)
    if "startup" in args.sections:
        from .startup import startup_section

        results["startup"] = startup_section(args.quick)
    if "hybrid" in args.sections:
        from .hybrid import hybrid_section

        results["hybrid"] = hybrid_section(args.quick)
    if "mla" in args.sections:
        from .mla import mla_section

        results["mla"] = mla_section(args.quick, args.reps)
    if "sglang" in args.sections:
        from .engines import sglang_section

        results["sglang"] = sglang_section(args.quick, args.reps, args.engines_python, args.engine_models)
    if "vllm" in args.sections:
        from .engines import vllm_section

        results["vllm"] = vllm_section(args.quick, args.reps, args.engines_python, args.engine_models)
    if "plot" in args.sections:
        results["sweep"] = context_sweep(args.quick)
    load.append(os.getloadavg()[0])
    table = markdown(results)
    print(table)
    if save:
        RESULTS.mkdir(exist_ok=True)
        if "sweep" in results:
            plot(results["sweep"], RESULTS / f"{device}.png")
        (RESULTS / f"{device}.json").write_text(json.dumps(results, indent=1))
        (RESULTS / f"{device}.md").write_text(table)
    return results


if __name__ == "__main__":
    main()
