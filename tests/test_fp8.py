"""fp8 KV caches: every backend stores saturate(x / scale) in the cache and attends over stored * scale.

The reference attends in float64 over the dequantized values (`reference.fp8_case`), so the tolerance is q's dtype's
own; the caches must hold exactly the quantized values of the contract (fp32 division, round to nearest even).
"""

import random

import pytest
import torch
from helpers.cases import FP8_CASES, check_fp8_call, mode_batch, scales
from helpers.reference import BACKENDS, assert_close, fp8_case, make_case, reference
from torch._dynamo.testing import CompileCounter

import hybrid_ops
from hybrid_ops import ROUTING, ForwardMode

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("name", FP8_CASES)
def test_fp8_cache(backend, cache_dtype, name):
    op, case_kwargs, options, dtype, kind = FP8_CASES[name]
    case = make_case(**case_kwargs, dtype=dtype)
    check_fp8_call(getattr(torch.ops.hybrid, op), case, cache_dtype, kind, options, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", ["prefill", "decode"])
@pytest.mark.parametrize("mode", list(ROUTING))
def test_fp8_every_mode(backend, spec, mode):
    q_lens, prefixes = mode_batch(mode, spec)
    case = make_case(q_lens, prefixes, num_q_heads=4, num_kv_heads=2, dtype=torch.bfloat16)
    check_fp8_call(
        torch.ops.hybrid.attn,
        case,
        torch.float8_e4m3fn,
        "per_head",
        {"sliding_window": 6},
        forward_mode=int(mode),
        prefill_backend=backend,
        decode_backend=backend,
        speculative_attention_mode=spec,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op, q_lens, prefix_lens", [("prefill", [5, 3], [7, 0]), ("decode", [1, 1], [9, 30])])
def test_scales_reach_the_kernel(backend, op, q_lens, prefix_lens):
    """Stored values kept, scales doubled: a v_scale of 2 doubles the output, a k_scale of 2 doubles the scores."""
    case = make_case(q_lens, prefix_lens, num_kv_heads=2, dtype=torch.float32)
    stored = fp8_case(case, torch.float8_e4m3fn, torch.tensor(1.0), torch.tensor(1.0))[0]
    fn = getattr(torch.ops.hybrid, op)

    def run(k_scale, v_scale, scale=None):
        k_cache, v_cache = stored.k_cache.clone(), stored.v_cache.clone()
        k, v = case.k * k_scale[:, None], case.v * v_scale[:, None]  # stored as the same fp8 values
        return fn(
            case.q,
            k,
            v,
            k_cache,
            v_cache,
            *case.args[5:],
            scale=scale,
            k_scale=k_scale,
            v_scale=v_scale,
            backend=backend,
        )

    one, two = torch.ones(2), torch.tensor([1.0, 2.0])
    base = run(one, one)
    doubled_v = run(one, two)
    torch.testing.assert_close(doubled_v[:, 2:], 2 * base[:, 2:], rtol=1e-5, atol=1e-5)  # kv head 1's query heads
    torch.testing.assert_close(doubled_v[:, :2], base[:, :2], rtol=1e-5, atol=1e-5)
    doubled_k = run(torch.full((2,), 2.0), one)
    torch.testing.assert_close(doubled_k, run(one, one, scale=2 / 16**0.5), rtol=1e-5, atol=1e-5)
    assert (doubled_k - base).abs().max() > 0.05


def test_fp8_saturates():
    """Values past the format's range are stored as its largest value, not inf or NaN."""
    case = make_case([3], [0], num_kv_heads=1, num_q_heads=1, dtype=torch.float32)
    case.k[0, 0, 0], case.v[1, 0, 3] = 1e6, -1e6
    for cache_dtype in FP8:
        fp8 = fp8_case(case, cache_dtype, torch.tensor(1.0), torch.tensor(1.0))[0]
        torch.ops.hybrid.prefill(*fp8.args, backend="torch")
        limit = torch.finfo(cache_dtype).max
        assert fp8.k_cache.float().max() == limit and fp8.v_cache.float().min() == -limit
        assert torch.isfinite(fp8.k_cache.float()).all() and torch.isfinite(fp8.v_cache.float()).all()


@pytest.mark.usefixtures("fresh_dynamo")
def test_fp8_compiled_new_scales_and_modes_never_recompile():
    """Scales are tensors: new values reach the compiled graph without a recompile, in every mode."""
    rng = random.Random(0)
    counter = CompileCounter()

    def layer(*args, k_scale, v_scale):
        """args: the op's positional arguments, forward_mode an int."""
        return torch.ops.hybrid.attn(*args, k_scale=k_scale, v_scale=v_scale, speculative_attention_mode="decode")

    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)

    def step(mode, batch_size, seed):
        """(mode, the fp8 case, its scales, the case the reference reads)."""
        if mode == ForwardMode.IDLE:
            q_lens = []
        elif hybrid_ops.select_path(mode, "decode") == "decode":
            q_lens = [1 if mode == ForwardMode.DECODE else 3] * batch_size
        else:
            q_lens = [rng.randint(0, 6) for _ in range(batch_size)]
        case = make_case(q_lens, [rng.randint(0, 12) for _ in q_lens], dtype=torch.bfloat16, seed=seed)
        k_scale, v_scale = scales("per_head", 2, seed)
        fp8, read, _ = fp8_case(case, torch.float8_e4m3fn, k_scale, v_scale)
        return mode, fp8, (k_scale, v_scale), read

    def run(mode, fp8, kv_scales, read):
        return compiled(*fp8.args, int(mode), k_scale=kv_scales[0], v_scale=kv_scales[1])

    # Every mode at three batch sizes (Dynamo learns which sizes vary), then one step of each size class (sizes 0, 1
    # or more: Dynamo's specialisations) of the steps checked after it.
    warm_up = [step(mode, batch_size, seed=batch_size) for mode in ROUTING for batch_size in (1, 2, 3)]
    steps = [step(rng.choice(list(ROUTING)), rng.randint(1, 5), seed + 10) for seed in range(20)]
    size_class = lambda fp8: tuple(min(size, 2) for t in fp8.args for size in t.shape)
    classes = {size_class(s[1]) for s in warm_up}
    with torch.no_grad():
        for i, s in enumerate(warm_up + steps):
            if i < len(warm_up) or size_class(s[1]) not in classes:
                classes.add(size_class(s[1]))
                run(*s)
        warm = counter.frame_count
        with torch._dynamo.config.patch(error_on_recompile=True):
            for s in steps:
                assert_close(run(*s), reference(s[3]), torch.bfloat16)
    assert counter.frame_count == warm


@pytest.mark.parametrize("op", ["prefill", "decode", "attn"])
def test_fp8_opcheck(op):
    case = make_case([2, 2], [3, 6], num_q_heads=4, num_kv_heads=2, dtype=torch.bfloat16, seed=0)
    k_scale, v_scale = scales("per_head", 2)
    fp8 = fp8_case(case, torch.float8_e5m2, k_scale, v_scale)[0]
    args = (*fp8.args, int(ForwardMode.DECODE)) if op == "attn" else fp8.args
    # Not "test_schema": its mutation check compares tensors with ops torch does not implement for fp8 on the CPU.
    torch.library.opcheck(
        getattr(torch.ops.hybrid, op).default,
        args,
        {"k_scale": k_scale, "v_scale": v_scale, "sliding_window": 4},
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
