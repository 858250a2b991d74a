"""Compile every Triton kernel the backend launches on a GPU, for sm_80 (A100) and sm_90 (H200), without a GPU.

    python scripts/triton_resources.py                                   # compile all, check; print the table
    python scripts/triton_resources.py --write bench/results/triton_resources.md
    python scripts/triton_resources.py --check bench/results/triton_resources.md

Runs the Triton backend's own launch path (`TritonBackend.prefill` / `decode` and the state ops'
`causal_conv1d` / `gated_delta_rule` / `selective_scan`, with a GPU `Target`: the SM count, tiles and stages a GPU
gets) on CPU tensors with `JITFunction.run` replaced by a recorder, then specialises each recorded launch as
`JITFunction.run` does (constexprs, ints equal to 1, divisibility by 16 and 16-byte alignment) and compiles it with
the ptxas of the triton wheel, in a fresh cache so that ptxas reports every kernel. Identical specialisations are
compiled once. Checks, per target: a cubin; shared memory within the per-block limit; no register spills on sm_90
for attention at fp16/bf16 up to head dim 128 and over MLA's latent cache (D 576, Dv 512) in q's dtype, and for the
state ops at every size (their state lives in registers across the tokens). Exits 1 listing what failed.

Compiling all takes minutes, so the table keeps what it measured under a key per row (a hash of the kernel's
source, with the functions it calls, and of its whole specialisation). `--check` compiles nothing where the table is
this code's: it records the launches, fails listing each row that differs from the table's (a kernel edited, a
launch added or changed: rewrite the table), compiles again a sample (per kernel and target, the rows of the most
shared memory and the most registers) to show that its shared memory is what this Triton gives and that it is
within the limits (spills, which move between runs of ptxas, included), and applies the checks above to the table's
numbers.

Uses triton's private APIs (`create_function_from_signature`, `JITFunction._pack_args`): pinned to triton 3.9.0 in
the test extra. Must run without TRITON_INTERPRET (an interpreted kernel cannot be compiled).
"""

import argparse
import contextlib
import hashlib
import io
import os
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("run without TRITON_INTERPRET: interpreted kernels cannot be compiled")

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from hybrid_ops.backends.triton import TritonBackend  # noqa: E402
from hybrid_ops.kernels.config import Target  # noqa: E402
from hybrid_ops.options import Options  # noqa: E402
from hybrid_ops.state_ops import StateMetadata  # noqa: E402

DEFAULT_TABLE = Path("bench/results/triton_resources.md")
SHARED_LIMIT = {80: 166_912, 90: 232_448}  # per-block opt-in shared memory, bytes
SM_COUNT = {80: 108, 90: 132}  # A100, H200
NO_SPILL_CAPABILITY = 90
NO_SPILL_MAX_HEAD_DIM = 128
DTYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "e4m3",
    torch.float8_e5m2: "e5m2",
}


@dataclass(frozen=True)
class Case:
    """One backend call: `kind` "decode" (q_len tokens per request) or "prefill" (q_len new tokens per request)."""

    kind: str
    dtype: torch.dtype
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    q_len: int = 1
    page_size: int = 16
    options: tuple = ()  # (sliding_window, logit_cap) when set
    batch: int = 2
    kv_dtype: torch.dtype = None  # an fp8 cache's dtype; None: q's
    v_head_dim: int = None  # v's own head dim Dv (MLA); None: head_dim
    tree: bool = False  # a tree mask (speculative verify, a draft's prefill)
    chunk: int = -1  # attention_chunk
    latent: bool = False  # MLA's latent cache: v_cache = k_cache[..., :Dv], v = k[..., :Dv]
    prefix: int = 300  # tokens cached before the new ones (a multiple of no page size)

    @property
    def checks_spills(self):
        latent = self.latent and self.kv_dtype is None  # MLA's latent cache in q's dtype
        return self.dtype != torch.float32 and (self.head_dim <= NO_SPILL_MAX_HEAD_DIM or latent)

    def __str__(self):
        mode = ("decode" if self.q_len == 1 else f"verify {self.q_len}") if self.kind == "decode" else "prefill"
        dims = f"D{self.head_dim}" + (f" Dv{self.v_head_dim}" if self.v_head_dim else "")
        text = (
            f"{mode} {DTYPE_NAMES[self.dtype]} {dims} Hq{self.num_q_heads}/Hkv{self.num_kv_heads} page {self.page_size}"
        )
        text += f" batch {self.batch}" if self.batch != 2 else ""
        text += f" prefix {self.prefix}" if self.prefix != 300 else ""
        return (
            text
            + (" latent" if self.latent else "")
            + (" window+cap" if self.options else "")
            + (f" chunk {self.chunk}" if self.chunk > 0 else "")
            + (f" kv {DTYPE_NAMES[self.kv_dtype]}" if self.kv_dtype else "")
            + (" tree" if self.tree else "")
        )


def cases():
    """Each axis the backend supports; the product where resources depend on it (dtype x head dim x rows).

    Decode rows per (request, kv head) = q_len x group: 1 (MHA), 32 (MQA Hq 32 / Hkv 1), 256 (verify 16 x GQA 16);
    prefill rows = tokens x next_pow2(group) at group 1, 8, 32. fp16 compiles as bf16 does (checked at D 64, 128).
    """
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        for head_dim in (64, 128, 256):
            for q_len, hq, hkv in ((1, 8, 8), (1, 32, 1), (16, 32, 2)):
                out.append(Case("decode", dtype, head_dim, hq, hkv, q_len))
            for hq, hkv in ((8, 8), (64, 8), (32, 1)):
                out.append(Case("prefill", dtype, head_dim, hq, hkv, 40))
    for q_len, hq, hkv in ((1, 32, 8), (4, 64, 8), (8, 32, 8), (1, 32, 2)):  # GQA 4, verify 4 x GQA 8, ...
        out.append(Case("decode", torch.bfloat16, 128, hq, hkv, q_len))
    out.append(Case("decode", torch.float32, 256, 64, 8, 4))  # verify 4 x GQA 8 at fp32 D 256
    for head_dim in (64, 128):
        out.append(Case("decode", torch.float16, head_dim, 32, 8, 4))
        out.append(Case("prefill", torch.float16, head_dim, 32, 8, 40))
    for page_size in (1, 64):
        out.append(Case("decode", torch.bfloat16, 128, 32, 8, 1, page_size))
        out.append(Case("prefill", torch.bfloat16, 128, 32, 8, 40, page_size))
    for dtype in (torch.bfloat16, torch.float32):
        out.append(Case("decode", dtype, 128, 32, 8, 1, options=(256, 30.0)))
        out.append(Case("prefill", dtype, 128, 32, 8, 40, options=(256, 30.0)))
    out.append(Case("decode", torch.bfloat16, 128, 32, 8, 1, batch=64))  # one split per request
    for kind, q_len in (("decode", 1), ("prefill", 40)):  # head dim 8: padded to 16 for tl.dot
        out.append(Case(kind, torch.bfloat16, 8, 8, 2, q_len))
    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # fp8 caches: GQA decode, verify, prefill
        for q_len, hq, hkv in ((1, 32, 8), (4, 64, 8)):
            out.append(Case("decode", torch.bfloat16, 128, hq, hkv, q_len, kv_dtype=kv_dtype))
        out.append(Case("prefill", torch.bfloat16, 128, 32, 8, 40, kv_dtype=kv_dtype))
    for dtype, head_dim in ((torch.float32, 128), (torch.float16, 64), (torch.bfloat16, 256)):
        for kind, q_len in (("decode", 1), ("prefill", 40)):
            out.append(Case(kind, dtype, head_dim, 32, 8, q_len, kv_dtype=torch.float8_e4m3fn))
    mla = (
        ("decode", 1, 16, 16, None),
        ("decode", 4, 32, 2, None),
        ("prefill", 40, 16, 16, None),
        ("decode", 1, 16, 16, torch.float8_e4m3fn),
        ("prefill", 40, 16, 16, torch.float8_e4m3fn),
    )
    for kind, q_len, hq, hkv, kv_dtype in mla:  # MLA (DeepSeek): q/k head dim 192, v head dim 128
        out.append(Case(kind, torch.bfloat16, 192, hq, hkv, q_len, kv_dtype=kv_dtype, v_head_dim=128))
    # Trees (HAS_TREE): verify over 16 and 64 drafts and a draft's prefill, with positions (window, chunk) or not.
    tree_dims = ((torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 128), (torch.bfloat16, 256))
    for kind, q_len in (("decode", 16), ("prefill", 40)):
        for dtype, head_dim in tree_dims:
            out.append(Case(kind, dtype, head_dim, 32, 8, q_len, tree=True))
            out.append(Case(kind, dtype, head_dim, 32, 8, q_len, options=(256, 30.0), tree=True))
        out.append(Case(kind, torch.float16, 128, 32, 8, q_len, chunk=256, tree=True))
        out.append(Case(kind, torch.bfloat16, 128, 32, 8, q_len, kv_dtype=torch.float8_e4m3fn, tree=True))
        out.append(Case(kind, torch.bfloat16, 192, 16, 16, q_len, v_head_dim=128, options=(256, 30.0), tree=True))
    out.append(Case("decode", torch.bfloat16, 128, 64, 8, 64, tree=True))  # 64 drafts x GQA 8
    # MLA over its latent cache (DeepSeek: D 576 = kv_lora_rank 512 + rope 64, its values the first 512 of each row,
    # v_cache = k_cache[..., :512]), 16 and 128 query heads on its one kv head; then verify 4 (512 rows), 64 splits
    # (a batch of 1 over 4096 tokens: the reduction in column blocks), a tree, e4m3, and values in a cache of their
    # own (K's and V's tiles apart: the most shared memory).
    latent = dict(v_head_dim=512, latent=True)
    for hq in (16, 128):  # bf16 (fp16's tiles are bf16's); fp32 below, at 16 heads
        for kind, q_len in (("decode", 1), ("prefill", 40)):
            out.append(Case(kind, torch.bfloat16, 576, hq, 1, q_len, **latent))
    out.append(Case("decode", torch.bfloat16, 576, 128, 1, 1, 64, **latent))  # pages of 64
    out.append(Case("decode", torch.bfloat16, 576, 128, 1, 4, **latent))
    out.append(Case("decode", torch.bfloat16, 576, 16, 1, 1, batch=1, prefix=4096, **latent))
    for kind, q_len in (("decode", 16), ("prefill", 40)):
        out.append(Case(kind, torch.bfloat16, 576, 16, 1, q_len, options=(256, 30.0), tree=True, **latent))
    for kind, q_len in (("decode", 1), ("prefill", 40)):
        out.append(Case(kind, torch.bfloat16, 576, 128, 1, q_len, kv_dtype=torch.float8_e4m3fn, **latent))
        out.append(Case(kind, torch.float32, 576, 16, 1, q_len, **latent))
        for dtype in (torch.bfloat16, torch.float32):
            out.append(Case(kind, dtype, 576, 16, 1, q_len, v_head_dim=512))
    return out


# How a state case names its dims, per op.
STATE_DIMS = {
    "gated_delta_rule": "Hk{}/Hv{} Dk{} Dv{}",
    "selective_scan": "H{} P{} G{} N{}",
    "causal_conv1d": "C{} K{}",
}


@dataclass(frozen=True)
class StateCase:
    """One state-op call on `batch` requests with a 300-token prefix. op: a `STATE_OPS` name; mode: "prefill" (40 new
    tokens each), "decode" (1), "verify" (4 drafts, on the decode path), "verify tree" (a chain of 8 as a tree, on
    the decode path) or "prefill tree" (8); dims: (Hk, Hv, Dk, Dv) of the gated delta rule, (H, P, G, N) of the scan,
    (C, K) of the convolution; variant: "" as the models use the op, else "per-channel decay" (the gated delta
    rule's g [T, Hv, Dk]), "bare" (a scan without D, z, dt_bias, softplus), "no bias" (a convolution)."""

    op: str
    dtype: torch.dtype
    dims: tuple
    mode: str = "prefill"
    variant: str = ""
    batch: int = 2

    checks_spills = True

    @property
    def q_len(self):
        return {"prefill": 40, "decode": 1, "verify": 4}.get(self.mode, 8)

    def __str__(self):
        text = f"{self.op} {self.mode} {DTYPE_NAMES[self.dtype]} {STATE_DIMS[self.op].format(*self.dims)}"
        return text + (f" {self.variant}" if self.variant else "") + (f" batch {self.batch}" if self.batch != 2 else "")


def state_cases():
    """Each state op at its models' sizes in every mode, with the variants its kernels specialise on: the gated delta
    rule of Qwen3-Next (Hk 16, Hv 32, Dk = Dv 128), Kimi Linear's decay per key channel, Dk 64 and 256; Mamba2's
    scan (Nemotron-H, Granite 4: H 128, P 64, G 8, N 128), N 256, Mamba1's (Jamba: H 8192, P 1, N 16); the
    convolution in front of Mamba2 (C = 8192 + 2 x 8 x 128, K 4) and LFM2's (C 2048, K 3). fp16 compiles as bf16."""
    modes = ("prefill", "decode", "verify", "verify tree", "prefill tree")
    shapes = {
        "gated_delta_rule": ((16, 32, 128, 128), [(4, 8, 64, 64), (8, 8, 256, 256)], "per-channel decay"),
        "selective_scan": ((128, 64, 8, 128), [(32, 64, 1, 256), (8192, 1, 1, 16)], "bare"),
        "causal_conv1d": ((10240, 4), [(2048, 3)], "no bias"),
    }
    out = []
    for op, (main, others, variant) in shapes.items():
        out += [StateCase(op, torch.bfloat16, main, mode) for mode in modes]
        out += [StateCase(op, torch.float32, main, mode) for mode in ("prefill", "decode")]
        out += [StateCase(op, torch.bfloat16, main, mode, variant) for mode in ("prefill", "decode")]
        out += [StateCase(op, dtype, dims, mode) for dims in others for dtype in (torch.bfloat16, torch.float32)
                for mode in ("prefill", "decode")]  # fmt: skip
        out.append(StateCase(op, torch.float16, main, "decode"))
        out.append(StateCase(op, torch.bfloat16, main, "decode", batch=64))
    return out


@dataclass
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict
    case: Case


def record_launches(case_list, num_sms):
    """Every kernel launch of the backend's prefill/decode for each case, on CPU tensors, none executed."""
    launches, current = [], []

    def record(kernel, *args, grid, warmup, **kwargs):
        launches.append(Launch(kernel, args, kwargs, current[0]))

    backend = TritonBackend()
    backend.target = Target(num_sms=num_sms)
    saved = JITFunction.run
    JITFunction.run = record
    try:
        for case in case_list:
            current[:] = [case]
            call_backend(backend, case)
    finally:
        JITFunction.run = saved
    return launches


def call_backend(backend, case):
    """One backend call on CPU tensors (`call_state_op` for a state op's): `batch` requests of `prefix` cached tokens.
    fp8 caches get scales as the ops pass them: e4m3 one per kv head, e5m2 one for all (a stride-0 view). A latent
    case's values are the first Dv of its keys (v_cache a view of k_cache), as MLA layers pass them."""
    if isinstance(case, StateCase):
        call_state_op(backend, case)
        return
    gen = torch.Generator().manual_seed(0)
    prefix, num_tokens = case.prefix, case.batch * case.q_len
    pages_per_request = -(-(prefix + case.q_len) // case.page_size)
    k_cache = torch.zeros(
        case.batch * pages_per_request,
        case.page_size,
        case.num_kv_heads,
        case.head_dim,
        dtype=case.kv_dtype or case.dtype,
    )
    q = torch.randn(num_tokens, case.num_q_heads, case.head_dim, generator=gen).to(case.dtype)
    k = torch.randn(num_tokens, case.num_kv_heads, case.head_dim, generator=gen).to(case.dtype)
    cu_seqlens_q = torch.arange(case.batch + 1, dtype=torch.int32) * case.q_len
    seq_lens = torch.full((case.batch,), prefix + case.q_len, dtype=torch.int32)
    block_table = torch.arange(case.batch * pages_per_request, dtype=torch.int32).view(case.batch, -1)
    window, cap = case.options or (-1, 0.0)
    tree = torch.ones(case.q_len, case.q_len, dtype=torch.bool).tril().repeat(case.batch, 1) if case.tree else None
    scales = {}
    if case.kv_dtype is not None:
        scale = (
            torch.full((case.num_kv_heads,), 0.5)
            if case.kv_dtype == torch.float8_e4m3fn
            else torch.tensor([0.5]).expand(case.num_kv_heads)
        )
        scales = dict(k_scale=scale, v_scale=scale)
    v_head_dim = case.v_head_dim or case.head_dim
    v = torch.randn(num_tokens, case.num_kv_heads, v_head_dim, generator=gen).to(case.dtype)
    v_cache = k_cache.new_zeros(*k_cache.shape[:3], v_head_dim)
    if case.latent:
        v, v_cache = k[..., :v_head_dim], k_cache[..., :v_head_dim]
    options = Options(
        scale=case.head_dim**-0.5,
        sliding_window=window,
        logit_cap=cap,
        attention_chunk=case.chunk,
        tree_mask=tree,
        **scales,
    )
    getattr(backend, case.kind)(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, options)


def call_state_op(backend, case):
    """One state-op backend call on CPU tensors, its metadata as `state_ops` passes it: request i on slot i of
    batch + 1, intermediate states in TARGET_VERIFY, a chain as the tree."""
    gen = torch.Generator().manual_seed(0)
    num_tokens, q_len = case.batch * case.q_len, case.q_len
    verify, tree = case.mode.startswith("verify"), case.mode.endswith("tree")
    decode = case.mode in ("decode", "verify", "verify tree")
    randn = lambda *shape, dtype=case.dtype: torch.randn(*shape, generator=gen).to(dtype)

    def metadata(state):
        intermediate = state.new_zeros(state.shape[0], q_len, *state.shape[1:]) if verify else None
        return StateMetadata(
            torch.arange(case.batch + 1, dtype=torch.int32) * q_len,
            torch.full((case.batch,), 300 + q_len, dtype=torch.int32),
            torch.arange(case.batch, dtype=torch.int32),
            decode,
            verify,
            torch.ones(q_len, q_len, dtype=torch.bool).tril().repeat(case.batch, 1) if tree else None,
            intermediate,
        )

    slots = case.batch + 1
    if case.op == "gated_delta_rule":
        k_heads, v_heads, k_dim, v_dim = case.dims
        q, k = randn(num_tokens, k_heads, k_dim), randn(num_tokens, k_heads, k_dim)
        g_shape = (num_tokens, v_heads, k_dim) if case.variant else (num_tokens, v_heads)
        state = torch.zeros(slots, v_heads, k_dim, v_dim)
        args = (q, k, randn(num_tokens, v_heads, v_dim), -torch.rand(g_shape), torch.rand(num_tokens, v_heads))
        backend.gated_delta_rule(*args, state, metadata(state), k_dim**-0.5)
    elif case.op == "selective_scan":
        heads, head_dim, groups, state_size = case.dims
        x, dt = randn(num_tokens, heads, head_dim), randn(num_tokens, heads)
        A = -torch.rand(heads, state_size) if head_dim == 1 else -torch.rand(heads)  # Mamba1: a rate per channel
        B, C = randn(num_tokens, groups, state_size), randn(num_tokens, groups, state_size)
        state = torch.zeros(slots, heads, head_dim, state_size)
        bare = case.variant == "bare"
        D, dt_bias = (None, None) if bare else (torch.randn(heads), torch.randn(heads))
        z = None if bare else randn(num_tokens, heads, head_dim)
        backend.selective_scan(x, dt, A, B, C, state, metadata(state), D, z, dt_bias, not bare, 0.0, float("inf"))
    else:
        channels, width = case.dims
        bias = None if case.variant else randn(channels)
        state = torch.zeros(slots, width - 1, channels, dtype=case.dtype)
        x, weight = randn(num_tokens, channels), randn(channels, width)
        backend.causal_conv1d(x, weight, bias, state, metadata(state), "silu")


def specialise(launch, capability):
    """(cache key, ASTSource, options) of a launch for sm_<capability>, as `JITFunction.run` makes them."""
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    kwargs = dict(
        launch.kwargs,
        debug=launch.kernel.debug or knobs.runtime.debug,
        instrumentation_mode=knobs.compilation.instrumentation_mode,
    )
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # triton 3.6 has no such knob
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(launch.kernel.signature, launch.kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = launch.kernel._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    key = (launch.kernel.fn.__name__, capability, str(signature), str(constexprs), str(attrs), str(options))
    return key, ASTSource(launch.kernel, signature, constexprs, attrs), target, options


_LAUNCHES = []  # the forked workers' view of the launches to compile


def _compile(job):
    """(shared bytes, registers, spill store bytes, spill load bytes, error) of launch `index` for a target."""
    index, capability = job
    _, source, target, options = specialise(_LAUNCHES[index], capability)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(source, target=target, options=options.__dict__)
    except Exception as e:  # a compile error is a finding, reported with the others
        return None, None, None, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if not compiled.asm.get("cubin"):
        return None, None, None, None, "no cubin"
    registers = re.search(r"Used (\d+) registers", log.getvalue())
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue())
    if not (registers and spills):
        return compiled.metadata.shared, None, None, None, "no ptxas report"
    return (compiled.metadata.shared, int(registers.group(1)), int(spills.group(1)), int(spills.group(2)), None)


@dataclass
class Row:
    kernel: str
    capability: int
    constexprs: str
    cases: list
    key: str = ""  # a hash of the kernel's source (Triton's cache key) and its whole specialisation
    job: tuple = None  # (index into _LAUNCHES, capability): what compiles it
    shared: int = None
    registers: int = None
    spill_stores: int = None
    spill_loads: int = None
    error: str = None

    def problems(self):
        if self.error:
            return [self.error]
        found = []
        if self.shared > SHARED_LIMIT[self.capability]:
            found.append(f"shared memory {self.shared} B > {SHARED_LIMIT[self.capability]} B")
        no_spill = any(c.checks_spills for c in self.cases)
        if self.capability == NO_SPILL_CAPABILITY and no_spill and (self.spill_stores or self.spill_loads):
            found.append(f"spills {self.spill_stores}/{self.spill_loads} B (stores/loads)")
        return found

    def identity(self):
        """What the table's row says of the launch, less what compiling it measured."""
        return (self.kernel, f"sm_{self.capability}", self.key, self.constexprs, "; ".join(map(str, self.cases)))


def plan(case_list):
    """Every distinct specialisation the cases launch, for sm_80 and sm_90: a `Row` each, not compiled."""
    rows = {}
    for capability in SHARED_LIMIT:
        for launch in record_launches(case_list, SM_COUNT[capability]):
            key, source, _, options = specialise(launch, capability)
            if key not in rows:
                names = [p.name for p in launch.kernel.params]
                meta = ", ".join(f"{names[path[0]]}={value}" for path, value in source.constants.items())
                # The options name libdevice by its path in this environment: the key leaves the path out.
                where = str(key).replace(os.path.dirname(triton.__file__), "<triton>")
                digest = hashlib.sha256(f"{launch.kernel.cache_key} {where}".encode()).hexdigest()[:12]
                _LAUNCHES.append(launch)
                rows[key] = Row(
                    launch.kernel.fn.__name__,
                    capability,
                    f"{meta}, warps={options.num_warps}, stages={options.num_stages}",
                    [],
                    digest,
                    (len(_LAUNCHES) - 1, capability),
                )
            if launch.case not in rows[key].cases:
                rows[key].cases.append(launch.case)
    return sorted(rows.values(), key=lambda r: (r.kernel, r.capability, str(r.cases[0])))


def compile_rows(rows, workers=2):
    """Compiles each row's launch in a fresh Triton cache (ptxas reports only what it compiles) and fills in what it
    measured."""
    with tempfile.TemporaryDirectory() as cache:
        knobs.cache.dir = cache
        knobs.nvidia.dump_ptxas_log = True
        with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
            results = list(pool.map(_compile, [row.job for row in rows]))
    for row, result in zip(rows, results):
        row.shared, row.registers, row.spill_stores, row.spill_loads, row.error = result


def table(rows, path):
    lines = [
        "# Triton kernels compiled for the GPU (no GPU needed)",
        "",
        f"Written by `python scripts/triton_resources.py --write {path}` "
        f"(triton {triton.__version__}, its own ptxas; torch {torch.__version__}); checked by "
        "`tests/test_triton_compile.py`.",
        "Every launch the backend makes for the cases listed, specialised as Triton does on a GPU, compiled for "
        f"sm_80 ({SM_COUNT[80]} SMs, shared limit {SHARED_LIMIT[80]:,} B) and sm_90 ({SM_COUNT[90]} SMs, "
        f"{SHARED_LIMIT[90]:,} B). Key: a hash of the kernel's source and its whole specialisation. Spills: bytes of "
        "spill stores / loads.",
        "",
        "| kernel | target | key | shared B | registers | spills | specialisation | cases |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    for row in rows:
        measured = (row.shared, row.registers)
        spills = "" if row.spill_stores is None else f"{row.spill_stores}/{row.spill_loads}"
        lines.append(
            f"| {row.kernel} | sm_{row.capability} | {row.key} | "
            + " | ".join("" if value is None else str(value) for value in measured)
            + f" | {spills} | {row.constexprs} | {'; '.join(str(c) for c in row.cases)} |"
        )
    return "\n".join(lines) + "\n"


def read_table(path):
    """A written table's rows: identity (`Row.identity`) -> (shared, registers, spill stores, spill loads)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        if line.startswith("| _"):
            kernel, target, key, shared, registers, spills, constexprs, cases = line[2:-2].split(" | ")
            stores, loads = spills.split("/")
            out[(kernel, target, key, constexprs, cases)] = (int(shared), int(registers), int(stores), int(loads))
    return out


def check_table(rows, path, workers=2):
    """The differences between the table at `path` and this code's launches (kernel sources and specialisations
    included), else what the table says compiling them gives, reproduced on a sample: per kernel and target, the row
    of the most shared memory and the row of the most registers. Fills `rows` in from the table."""
    written = read_table(path)
    mine = {row.identity(): row for row in rows}
    found = [f"not in the table: {' | '.join(i)}" for i in mine if i not in written]
    found += [f"in the table, not launched: {' | '.join(i)}" for i in written if i not in mine]
    if found:
        return found + [f"rewrite it: python scripts/triton_resources.py --write {path}"]
    for identity, row in mine.items():
        row.shared, row.registers, row.spill_stores, row.spill_loads = written[identity]
    sample = {}
    for row in rows:
        for measure in ("shared", "registers"):
            best = sample.get((row.kernel, row.capability, measure))
            if best is None or getattr(row, measure) > getattr(best, measure):
                sample[(row.kernel, row.capability, measure)] = row
    sample = list({id(row): row for row in sample.values()}.values())
    compile_rows(sample, workers)
    for row in sample:
        # Shared memory is the same at every compile; ptxas's register allocation is not (a row spilling a few bytes
        # in one run may not in the next), so a compiled row's spills are held to the limits, not to the table.
        shared, _, stores, loads = written[row.identity()]
        if row.error or row.shared != shared or row.problems():
            found.append(
                f"{' | '.join(row.identity()[:4])}: compiled to shared {row.shared} B, spills {row.spill_stores}/"
                f"{row.spill_loads} ({'; '.join(row.problems()) or 'within the limits'}); the table says {shared} B, "
                f"{stores}/{loads}"
            )
    print(f"{len(sample)} of the table's {len(rows)} specialisations compiled again")
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path, help="compile every launch and write the resource table here")
    parser.add_argument("--check", type=Path, help="check that the table written here is this code's (a sample "
                        "compiled again) and within the limits")  # fmt: skip
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    rows = plan(cases() + state_cases())
    if args.check:
        stale = check_table(rows, args.check, args.workers)
        for difference in stale:
            print("STALE", difference)
        if stale:
            sys.exit(1)
    else:
        compile_rows(rows, args.workers)
        text = table(rows, args.write or DEFAULT_TABLE)
        print(text)
        if args.write:
            args.write.write_text(text)
    failures = [
        f"{row.kernel} sm_{row.capability} [{'; '.join(map(str, row.cases))}]: {problem}"
        for row in rows
        for problem in row.problems()
    ]
    print(f"{len(rows)} specialisations, {len(failures)} failing")
    for failure in failures:
        print("FAIL", failure)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
