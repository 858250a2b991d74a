"""MLA's latent cache: through the attention ops, one kv head whose values are the first Dv values of its keys, stored
once (v_cache = k_cache[..., :Dv]), on every backend that runs on the CPU, against the float64 reference, the write
landing once in the one cache tensor, compiled over it; then the MLA model families served over it (weight
absorption, integrations/mla.py) with transformers' own tokens."""

import pytest
import torch
from helpers.models import NEW_TOKENS, PROMPTS, SIZES, make_model, preempting_pages, reference_tokens, tiny_config
from helpers.reference import (
    BACKENDS,
    assert_close,
    expected_cache,
    fp8_case,
    latent_case,
    make_case,
    reference,
    slow_except,
)
from helpers.serving import assert_logits_equal_transformers, serve
from torch._inductor.utils import run_and_get_code

import hybrid_ops
from hybrid_ops import ForwardMode, GenerationStats, HybridGenerator, HybridInputError

# (q_lens, prefix_lens, mode): a ragged prefill over prefixes, decode, verify of 3 draft tokens.
STEPS = {
    "prefill": ([5, 9, 0], [3, 0, 6], ForwardMode.EXTEND),
    "decode": ([1, 1, 1], [17, 4, 40], ForwardMode.DECODE),
    "verify": ([3, 3], [9, 30], ForwardMode.TARGET_VERIFY),
}
# (Hq, D, Dv): a small one, and DeepSeek-V3's latent (kv_lora_rank 512 + qk_rope_head_dim 64) with 16 heads.
HEADS = {"small": (8, 40, 32), "deepseek": (16, 576, 512)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("size", slow_except("small", list(HEADS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_cache(backend, step, size, dtype):
    q_lens, prefix_lens, mode = STEPS[step]
    num_q_heads, head_dim, v_head_dim = HEADS[size]
    case = latent_case(q_lens, prefix_lens, num_q_heads, head_dim, v_head_dim, page_size=16, dtype=dtype)
    k_expected, _ = expected_cache(case)
    out = torch.ops.hybrid.attn(*case.args, int(mode), prefill_backend=backend, decode_backend=backend,
                                speculative_attention_mode="decode")  # fmt: skip
    assert out.shape == (sum(q_lens), num_q_heads, v_head_dim)
    assert_close(out, reference(case), dtype)
    assert torch.equal(case.k_cache, k_expected), "the latent cache differs from the expected"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("step", STEPS)
def test_latent_fp8_cache(backend, step):
    """An e4m3 latent cache: the latent row stored once as k / scale (one scale: the values are the keys' bytes),
    attention against float64 over the dequantized rows."""
    q_lens, prefix_lens, mode = STEPS[step]
    case = latent_case(q_lens, prefix_lens, 8, 40, 32, page_size=16, dtype=torch.bfloat16)
    scale = torch.tensor(0.37)
    fp8, read, (k_expected, _) = fp8_case(case, torch.float8_e4m3fn, scale, scale)
    fp8.v_cache = fp8.k_cache[..., :32]
    out = torch.ops.hybrid.attn(*fp8.args, int(mode), k_scale=scale, v_scale=scale, prefill_backend=backend,
                                decode_backend=backend, speculative_attention_mode="decode")  # fmt: skip
    assert_close(out, reference(read), torch.bfloat16)
    assert torch.equal(fp8.k_cache.view(torch.uint8), k_expected)


def test_latent_fp8_layer_shares_its_scale():
    """PagedKVCache's fp8 latent layer: v_scales[layer] is k_scales[layer] (its values are its keys' bytes); a layer
    of its own values keeps two."""
    cache = hybrid_ops.PagedKVCache(8, 4, 1, 1, layer_shapes=[(1, 40, 32, True), (2, 16, 16)],
                                    dtype=torch.float8_e4m3fn, kv_scale=0.5, for_compile=False)  # fmt: skip
    assert cache.v_scales[0] is cache.k_scales[0] and cache.v_scales[1] is not cache.k_scales[1]
    assert cache.scales(0)["v_scale"].item() == 0.5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_leading_wider_rows(backend, step, dtype):
    """Values of their own in the leading Dv of wider rows (v_cache a view of a [.., Hkv, Dv + 8] tensor), several kv
    heads: every head's rows found at the rows' width, the 8 values past Dv never read nor written."""
    q_lens, prefix_lens, mode = STEPS[step]
    case = make_case(q_lens, prefix_lens, 8, 4, 32, page_size=16, dtype=dtype, v_head_dim=24)
    wide = torch.full((*case.v_cache.shape[:3], 32), float("nan"), dtype=dtype)
    wide[..., :24] = case.v_cache
    case.v_cache = wide[..., :24]
    k_expected, v_expected = expected_cache(case)
    out = torch.ops.hybrid.attn(*case.args, int(mode), prefill_backend=backend, decode_backend=backend,
                                speculative_attention_mode="decode")  # fmt: skip
    assert_close(out, reference(case), dtype)
    assert torch.equal(case.k_cache, k_expected) and torch.equal(case.v_cache, v_expected)
    assert wide[..., 24:].isnan().all()


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


# The MLA families of transformers' causal LMs (deepseek_v2's layer and those built on it), each served over its
# latent cache.
MLA_TYPES = [
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe_lite",
    "longcat_flash",
    "minicpm3",
    "youtu",
    "sarvam_mla",
    "kimi_linear",
    "bailing_hybrid",
]


@pytest.mark.parametrize("model_type", slow_except("deepseek_v3", MLA_TYPES))
def test_mla_models_over_their_latent_cache(model_type, fresh_dynamo):
    """Every MLA layer's cache holds (kv_lora_rank + qk_rope_head_dim) values per token and layer, its values a view
    of its keys (no second copy); greedy tokens equal transformers' own, through a page budget that preempts. Eager:
    compiled MLA is tests/test_models.py's deepseek_v3 (no recompile across modes); every other type but
    longcat_flash gave transformers' tokens compiled too, each taking 40-130 s to compile on 2 cores. longcat_flash's
    MoE loops over the experts a batch hits, a data-dependent count that no fullgraph compile takes: it is served
    eager."""
    config = tiny_config(model_type)
    model = make_model(config)
    generator = HybridGenerator(model, **SIZES, num_pages=preempting_pages(model), compile=False)
    text = config.get_text_config()
    latent = [i for i, shape in enumerate(generator.cache.layer_shapes) if shape.latent]
    assert latent, "no layer served over a latent cache"
    for i in latent:
        k_cache, v_cache = generator.cache.layer(i)
        row = k_cache[0, 0].numel() * k_cache.element_size()
        assert row == (text.kv_lora_rank + text.qk_rope_head_dim) * k_cache.element_size()
        assert v_cache.data_ptr() == k_cache.data_ptr() and v_cache.shape[-1] == text.kv_lora_rank
    stats = GenerationStats()
    reference = make_model(tiny_config(model_type))  # a config of its own: a model sets its attention there
    assert generator.generate(PROMPTS, NEW_TOKENS, stats=stats) == reference_tokens(reference)
    assert stats.preemptions > 0


@pytest.mark.parametrize("model_type", slow_except("deepseek_v3", MLA_TYPES))
def test_mla_logits_equal_transformers(model_type):
    """Every sampled row's logits through the packed forward over latent caches (prefill chunks across pages, mixed
    steps, batched decoding, a preemption) against transformers' forward over the same tokens, to 1e-5: a tiny
    model's greedy tokens can hide a wrong term (a dropped rope part leaves them unchanged)."""
    model = make_model(tiny_config(model_type), attn_implementation="hybrid")
    tokens, rows = serve(model)
    assert any(getattr(m, "hybrid_latent", None) for m in model.modules()), "no layer served over a latent cache"
    assert_logits_equal_transformers(model_type, make_model(tiny_config(model_type)), rows, tokens)


def test_absorbed_attention_with_value_heads_apart_from_keys():
    """`LatentAttention.attend` (weight absorption) on GLM-4.7-Flash's structure, qk_nope_head_dim 24 and v_head_dim
    32 (192 and 256 in its checkpoint): the output of the expanded attention, per-head keys [nope + rope] and values
    [v] from kv_b_proj, causal, written plainly in float64."""
    from hybrid_ops.integrations.mla import LatentAttention

    text = tiny_config("glm4_moe_lite").get_text_config()
    nope, rope, rank, v_dim, heads = (text.qk_nope_head_dim, text.qk_rope_head_dim, text.kv_lora_rank,
                                      text.v_head_dim, text.num_attention_heads)  # fmt: skip
    assert nope != v_dim
    module = torch.nn.Module()
    module.kv_b_proj = torch.nn.Linear(rank, heads * (nope + v_dim), bias=False).double()
    latent = LatentAttention(module, heads, nope, rope, rank, v_dim)
    T, scale = 7, (nope + rope) ** -0.5
    query = torch.randn(1, heads, T, nope + rope, dtype=torch.float64)
    key = torch.randn(1, 1, T, rank + rope, dtype=torch.float64)
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def attn(q, k, v, v_dims):  # the op over the latent cache: one kv head, [T, H, rank + rope] queries
        scores = torch.einsum("thd,sd->hts", q, k[:, 0]) * scale
        return torch.einsum("hts,sv->thv", scores.masked_fill(~causal, float("-inf")).softmax(-1), v[:, 0])

    weight = module.kv_b_proj.weight.view(heads, nope + v_dim, rank)
    k_nope = torch.einsum("hnr,tr->htn", weight[:, :nope], key[0, 0, :, :rank])
    k = torch.cat([k_nope, key[0, 0, :, rank:].expand(heads, T, rope)], -1)  # [H, T, nope + rope]
    v = torch.einsum("hvr,tr->htv", weight[:, nope:], key[0, 0, :, :rank])  # [H, T, v]
    scores = (query[0] @ k.transpose(1, 2) * scale).masked_fill(~causal, float("-inf"))
    expected = (scores.softmax(-1) @ v).transpose(0, 1)[None]  # [1, T, H, v]
    torch.testing.assert_close(latent.attend(query, key, attn), expected, rtol=1e-9, atol=1e-9)
