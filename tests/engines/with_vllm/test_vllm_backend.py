"""hybrid_ops' vLLM backend on vLLM's own objects: its plugin loading, the CPU platform's selection, the KV cache as
vLLM allocates it (`create_kv_cache_views`, each layout the backend accepts), `CommonAttentionMetadata` and the
metadata builder, against float64 attention written here; vLLM's block zeroing and copy-on-write on that cache."""

import math
import random
from types import SimpleNamespace

import pytest
import torch
from helpers.reference import assert_close
from vllm.platforms.cpu import CpuPlatform
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout, KVCacheTensor, create_kv_cache_views

from hybrid_ops import ForwardMode, HybridInputError
from hybrid_ops.integrations import vllm as integration

HQ, HKV, D, BLOCK, NUM_BLOCKS = 4, 2, 32, 16, 40


@pytest.fixture(autouse=True, scope="module")
def plugins():
    """As every process vLLM starts: its general plugins loaded (hybrid_ops' entry point among them)."""
    load_general_plugins()


def selector(**changes):
    fields = dict(
        head_size=D, dtype=torch.float32, kv_cache_dtype="auto", block_size=None, use_mla=False, has_sink=False,
        use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False, attn_type=AttentionType.DECODER,
    )  # fmt: skip
    return AttentionSelectorConfig(**{**fields, **changes})


def test_cpu_platform_lets_an_explicit_custom_through():
    """CUSTOM is ours (registered by the installed entry point); asking for no backend still gives CPU_ATTN; a layer
    our backend cannot serve is refused when vLLM selects its backend; loading the plugins again wraps nothing
    twice."""
    assert AttentionBackendEnum.CUSTOM.get_path() == "hybrid_ops.integrations.vllm.HybridOpsBackend"
    assert CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, selector()) == (
        "hybrid_ops.integrations.vllm.HybridOpsBackend"
    )
    assert CpuPlatform.get_attn_backend_cls(None, selector()) == AttentionBackendEnum.CPU_ATTN.get_path()
    choose = CpuPlatform.get_attn_backend_cls
    integration.register()
    assert CpuPlatform.get_attn_backend_cls == choose
    for changes, reason in (
        (dict(attn_type=AttentionType.ENCODER_ONLY), "attention type AttentionType.ENCODER_ONLY not supported"),
        (dict(use_non_causal=True), "non-causal"),
        (dict(kv_cache_dtype="int8"), "kv_cache_dtype not supported"),
    ):
        with pytest.raises(HybridInputError, match=f"cannot serve this layer: .*{reason}"):
            CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, selector(**changes))


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(alibi_slopes=[0.5] * HQ), "ALiBi slopes"),
        (dict(attn_type=AttentionType.ENCODER_DECODER), "encoder_decoder attention"),
        (dict(kv_sharing_target_layer_name="model.layers.0.self_attn.attn"), "KV sharing"),
        (dict(use_alibi_sqrt=True), r"the options \['use_alibi_sqrt'\]"),
    ],
)
def test_refused_when_the_layer_is_built(options, words):
    with pytest.raises(HybridInputError, match=f"does not serve {words}"):
        integration.HybridOpsImpl(HQ, D, D**-0.5, HKV, **options)


def layer_caches(layout, dtype=torch.float32):
    """Two layers' caches as vLLM allocates and views them: one zeroed int8 buffer, a [num_blocks, Hkv, block, 2D]
    view per layer in `layout`."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=dtype)
    page = spec.page_size_bytes
    if layout in (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC):
        strides = dict(layer_stride=page * NUM_BLOCKS, block_stride=page)
    else:
        strides = dict(layer_stride=page, block_stride=2 * page)
    tensor = KVCacheTensor(size=2 * page * NUM_BLOCKS, layers=["layer.0", "layer.1"], **strides)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)


class Requests:
    """Requests over scrambled blocks of one layer's cache, with every token's k, v kept to check against."""

    def __init__(self, rng, num_requests):
        blocks = rng.sample(range(1, NUM_BLOCKS), num_requests * 3)  # block 0 is vLLM's null block
        self.blocks = [blocks[3 * i : 3 * i + 3] for i in range(num_requests)]
        self.k = [torch.zeros(0, HKV, D) for _ in range(num_requests)]
        self.v = [torch.zeros(0, HKV, D) for _ in range(num_requests)]

    def step(self, q_lens, dtype=torch.float32):
        """CommonAttentionMetadata of the step (vLLM's), and its q, k, v: [T, H, D] in `dtype` (k, v appended to the
        kept)."""
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        k_new, v_new = (torch.randn(starts[-1], HKV, D).to(dtype) for _ in range(2))
        slots = []
        for i, n in enumerate(q_lens):
            first = self.k[i].shape[0]
            self.k[i] = torch.cat([self.k[i], k_new[starts[i] : starts[i + 1]]])
            self.v[i] = torch.cat([self.v[i], v_new[starts[i] : starts[i + 1]]])
            slots += [self.blocks[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(first, first + n)]
        seq_lens = torch.tensor([k.shape[0] for k in self.k], dtype=torch.int32)
        table = torch.zeros(len(q_lens), 8, dtype=torch.int32)  # past a request's blocks: vLLM's null block
        for i, blocks in enumerate(self.blocks):
            table[i, : len(blocks)] = torch.tensor(blocks)
        cu = torch.tensor(starts, dtype=torch.int32)
        metadata = CommonAttentionMetadata(
            query_start_loc=cu, query_start_loc_cpu=cu, seq_lens=seq_lens, num_reqs=len(q_lens),
            num_actual_tokens=starts[-1], max_query_len=max(q_lens), max_seq_len=int(seq_lens.max()),
            block_table_tensor=table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        )  # fmt: skip
        return metadata, torch.randn(starts[-1], HQ, D).to(dtype), k_new, v_new

    def reference(self, q, q_lens, scale, window=-1, cap=0.0, sinks=None):
        """float64: token j of request i, at position L - q_len + j, sees the kept keys up to its own (the last
        `window` of them)."""
        out, start = [], 0
        for i, n in enumerate(q_lens):
            keys, values = self.k[i].double(), self.v[i].double()
            for j in range(n):
                pos = keys.shape[0] - n + j
                first = max(0, pos - window + 1) if window > 0 else 0
                rows = []
                for h in range(HQ):
                    s = keys[first : pos + 1, h // (HQ // HKV)] @ q[start + j, h].double() * scale
                    s = cap * torch.tanh(s / cap) if cap else s
                    top = max(float(s.max()), float(sinks[h])) if sinks is not None else float(s.max())
                    w = torch.exp(s - top)
                    total = w.sum() + (math.exp(float(sinks[h]) - top) if sinks is not None else 0.0)
                    rows.append((w[:, None] * values[first : pos + 1, h // (HQ // HKV)]).sum(0) / total)
                out.append(torch.stack(rows))
            start += n
        return torch.stack(out)


def attend(impl, builder, metadata, q, k, v, kv_cache, layer=None):
    """The layer's call as vLLM makes it: a padded output buffer, the builder's metadata, impl.forward."""
    output = torch.full((q.shape[0] + 3, HQ, D), float("nan"), dtype=q.dtype)
    padded = [torch.cat([t, torch.randn(3, *t.shape[1:]).to(t.dtype)]) for t in (q, k, v)]
    attn_metadata = builder.build(0, metadata)
    # A step of decodes alone takes the ops' decode path; any other step their prefill path.
    decode = metadata.num_actual_tokens == metadata.num_reqs
    assert attn_metadata.forward_mode == (ForwardMode.DECODE if decode else ForwardMode.EXTEND)
    layer = layer or SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    impl.forward(layer, *padded, kv_cache, attn_metadata, output)
    return output[: q.shape[0]]


def builder_for(dtype=torch.float32):
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=dtype)
    return integration.HybridOpsMetadataBuilder(spec, ["layer.0"], SimpleNamespace(), torch.device("cpu"))


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC], ids=lambda layout: layout.name)
@pytest.mark.parametrize(
    "options",
    [dict(), dict(sliding_window=6), dict(logits_soft_cap=2.0), dict(sinks=True)],
    ids=["plain", "window", "cap", "sinks"],
)
def test_steps_against_float64(layout, options):
    """A prefill, a mixed step (chunks over cached tokens and decodes) and a decode step over scrambled blocks: the
    float64 reference's outputs, with the layer's options (vLLM's window counts the token itself)."""
    rng = random.Random(str(layout) + str(options))
    kv_cache = layer_caches(layout)[1]
    sinks = torch.randn(HQ).to(torch.bfloat16) if options.pop("sinks", False) else None
    impl = integration.HybridOpsImpl(HQ, D, D**-0.5, HKV, sinks=sinks, **options)
    builder, requests = builder_for(), Requests(rng, 3)
    for q_lens in ([17, 5, 30], [9, 1, 1], [1, 1, 1]):
        metadata, q, k, v = requests.step(q_lens)
        out = attend(impl, builder, metadata, q, k, v, kv_cache)
        want = requests.reference(
            q, q_lens, D**-0.5, options.get("sliding_window", -1), options.get("logits_soft_cap", 0.0),
            None if sinks is None else sinks.float(),
        )  # fmt: skip
        assert_close(out, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_models(dtype):
    """bf16 and fp16 models over caches of their dtype."""
    rng = random.Random(str(dtype))
    kv_cache = layer_caches(KVCacheLayout.LBHNC, dtype)[0]
    impl, builder, requests = integration.HybridOpsImpl(HQ, D, D**-0.5, HKV), builder_for(dtype), Requests(rng, 2)
    for q_lens in ([19, 6], [1, 1]):
        metadata, q, k, v = requests.step(q_lens, dtype)
        out = attend(impl, builder, metadata, q, k, v, kv_cache)
        assert_close(out, requests.reference(q, q_lens, D**-0.5), dtype)


def test_blocks_zeroed_and_copied_whole():
    """vLLM zeroes and copies a layer's blocks through its own view (`kv[b]`): zeroing a block no request holds
    changes no output, and a request over a copy of another's blocks (copy-on-write) reads the same K and V."""
    rng = random.Random(1)
    kv_cache = layer_caches(KVCacheLayout.LBNHC)[0]
    impl, builder, requests = integration.HybridOpsImpl(HQ, D, D**-0.5, HKV), builder_for(), Requests(rng, 2)
    metadata, q, k, v = requests.step([40, 20])
    attend(impl, builder, metadata, q, k, v, kv_cache)
    held = {b for blocks in requests.blocks for b in blocks}
    for block in set(range(1, NUM_BLOCKS)) - held:
        kv_cache[block].fill_(7)
        kv_cache[block].zero_()
    copies = [b for b in range(1, NUM_BLOCKS) if b not in held][:3]
    for source, copy in zip(requests.blocks[0], copies):
        kv_cache[copy] = kv_cache[source]
    requests.blocks[1] = copies  # request 1 now reads request 0's tokens, from the copies
    requests.k[1], requests.v[1] = requests.k[0], requests.v[0]
    metadata, q, k, v = requests.step([1, 1])
    out = attend(impl, builder, metadata, q, k, v, kv_cache)
    assert_close(out, requests.reference(q, [1, 1], D**-0.5), torch.float32)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_with_the_layers_scales(kv_cache_dtype):
    """An fp8 cache (vLLM stores it as uint8) holds k / _k_scale, read times the scale."""
    rng = random.Random(kv_cache_dtype)
    fp8 = integration.FP8[kv_cache_dtype]
    kv_cache = layer_caches(KVCacheLayout.LBHNC, torch.uint8)[0]
    impl = integration.HybridOpsImpl(HQ, D, D**-0.5, HKV, kv_cache_dtype=kv_cache_dtype)
    layer = SimpleNamespace(_k_scale=torch.tensor(0.5), _v_scale=torch.tensor(2.0))
    builder, requests = builder_for(torch.uint8), Requests(rng, 2)
    for q_lens in ([20, 7], [1, 1]):
        metadata, q, k, v = requests.step(q_lens)
        out = attend(impl, builder, metadata, q, k, v, kv_cache, layer)
        # The reference attends over what the cache holds: each token's k, v through the fp8 store and back.
        for i in range(2):
            requests.k[i] = (requests.k[i] / 0.5).to(fp8).float() * 0.5
            requests.v[i] = (requests.v[i] / 2.0).to(fp8).float() * 2.0
        assert_close(out, requests.reference(q, q_lens, D**-0.5), torch.float32)


def test_block_outermost_layout_refused():
    """A layout that interleaves the layers' pages within a block (BLHNC) leaves a layer's blocks apart: refused."""
    kv_cache = layer_caches(KVCacheLayout.BLHNC)[0]
    impl, builder, requests = (
        integration.HybridOpsImpl(HQ, D, D**-0.5, HKV),
        builder_for(),
        Requests(random.Random(), 1),
    )
    metadata, q, k, v = requests.step([3])
    with pytest.raises(HybridInputError, match="needs each block's bytes dense"):
        attend(impl, builder, metadata, q, k, v, kv_cache)
