"""MLA's latent cache through the attention ops: one kv head whose values are the first Dv values of its keys, stored
once (v_cache = k_cache[..., :Dv]), on every backend that runs on the CPU, against the float64 reference; the write
lands once in the one cache tensor; the op compiles over it."""

import pytest
import torch
from helpers.reference import BACKENDS, assert_close, expected_cache, latent_case, reference, slow_except
from torch._inductor.utils import run_and_get_code

from hybrid_ops import ForwardMode, HybridInputError

# (q_lens, prefix_lens, mode): a ragged prefill over prefixes, decode, verify of 3 draft tokens.
STEPS = {
    "prefill": ([5, 9, 0], [3, 0, 6], ForwardMode.EXTEND),
    "decode": ([1, 1, 1], [17, 4, 40], ForwardMode.DECODE),
    "verify": ([3, 3], [9, 30], ForwardMode.TARGET_VERIFY),
}
# (Hq, D, Dv): a small one, and DeepSeek-V3's latent (kv_lora_rank 512 + qk_rope_head_dim 64) with 16 heads.
SIZES = {"small": (8, 40, 32), "deepseek": (16, 576, 512)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("size", slow_except("small", list(SIZES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_cache(backend, step, size, dtype):
    q_lens, prefix_lens, mode = STEPS[step]
    num_q_heads, head_dim, v_head_dim = SIZES[size]
    case = latent_case(q_lens, prefix_lens, num_q_heads, head_dim, v_head_dim, page_size=16, dtype=dtype)
    k_expected, _ = expected_cache(case)
    out = torch.ops.hybrid.attn(*case.args, int(mode), prefill_backend=backend, decode_backend=backend,
                                speculative_attention_mode="decode")  # fmt: skip
    assert out.shape == (sum(q_lens), num_q_heads, v_head_dim)
    assert_close(out, reference(case), dtype)
    assert torch.equal(case.k_cache, k_expected), "the latent cache differs from the expected"


def test_values_of_rows_laid_out_otherwise_refused():
    """v_cache may be the leading values of a contiguous tensor's rows (of any width), not another layout."""
    case = latent_case([2], [3])
    num_pages, page_size = case.k_cache.shape[:2]
    page_major = torch.zeros(page_size, num_pages, 1, 40).transpose(0, 1)[..., :32]  # pages are not outermost
    with pytest.raises(HybridInputError, match=r"v_cache must be a contiguous \[num_pages, page_size, Hkv, Dv\]"):
        torch.ops.hybrid.prefill(*case.args[:4], page_major, *case.args[5:])
    wider = torch.zeros(num_pages, page_size, 1, 64)[..., :32]  # rows of 64 values: accepted
    torch.ops.hybrid.prefill(*case.args[:4], wider, *case.args[5:], backend="torch")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_compiled_over_the_latent_cache(backend):
    """torch.compile (fullgraph, dynamic) of a layer over the latent cache: the cache and its view passed as k_cache
    and v_cache, written in place (no copy of either), the reference's output."""
    case = latent_case([4, 2], [5, 0], page_size=16)
    k_expected, _ = expected_cache(case)
    cache = case.k_cache

    def layer(q, k, cu_seqlens_q, seq_lens, block_table, forward_mode: int):
        return torch.ops.hybrid.attn(q, k, k[..., :32], cache, cache[..., :32], cu_seqlens_q, seq_lens, block_table,
                                     forward_mode, prefill_backend=backend)  # fmt: skip

    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    args = (case.q, case.k, case.cu_seqlens_q, case.seq_lens, case.block_table, int(ForwardMode.EXTEND))
    out, codes = run_and_get_code(compiled, *args)
    code = "\n".join(codes)
    assert "torch.ops.hybrid.attn.default(" in code and "aten.copy" not in code and ".clone(" not in code
    assert_close(out, reference(case), torch.float32)
    assert torch.equal(cache, k_expected)
