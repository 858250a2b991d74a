"""hybrid_ops' sglang backend driven by the installed sglang's own objects (HybridAttnBackend, RadixAttention,
MHATokenToKVPool, ReqToTokenPool, ForwardBatch, EagleVerifyInput), against float64 attention in sglang's conventions
(`sglang_batches.reference`): every mode, pages of 1 and 16 tokens, scrambled rows and slots, windows, soft-caps,
sinks, chunks, trees in both of sglang's mask layouts, fp8 pools, and sglang's graph hooks."""

import random
from types import SimpleNamespace

import pytest
import torch
from helpers.reference import assert_close, to_fp8
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import get_context, get_parallel
from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
from sglang.srt.speculative.eagle_utils import TreeMaskMode
from sglang_batches import Runner, full_mask, make_step, reference
from torch._inductor.utils import run_and_get_code

from hybrid_ops import HybridInputError
from hybrid_ops.integrations import sglang as integration
from hybrid_ops.modes import select_path

HQ, HKV, D = 4, 2, 16


@pytest.fixture(autouse=True, scope="module")
def plugins():
    """As every process sglang starts: its plugins loaded (hybrid_ops' entry point among them)."""
    load_plugins()


@pytest.fixture(params=["prefill", "decode"])
def speculative_attention_mode(request):
    """sglang's runtime config for one rank, with each `--speculative-attention-mode`."""
    with get_parallel().override(attn_tp_size=1, attn_dcp_rank=0):
        override = get_context().override_server_args(device="cpu", speculative_attention_mode=request.param)
        override.install()
        try:
            yield request.param
        finally:
            override.restore()


@pytest.fixture
def config():
    with get_parallel().override(attn_tp_size=1, attn_dcp_rank=0):
        override = get_context().override_server_args(device="cpu")
        override.install()
        try:
            yield
        finally:
            override.restore()


def layer_of(layer_id=0, head_dim=D, **options):
    return RadixAttention(HQ, head_dim, head_dim**-0.5, HKV, layer_id, **options)


def attend(backend, step, layer, **kwargs):
    """The layer's forward as a model runs it: RadixAttention under sglang's forward context."""
    backend.init_forward_metadata(step.batch)
    with forward_context(ForwardContext(attn_backend=backend), forward_batch=step.batch):
        return layer(step.q.flatten(1), step.k, step.v, step.batch, **kwargs)


def check_written(runner, step, layer_id=0):
    """The new tokens' K/V are in the pool at their slots (`out_cache_loc`)."""
    pool = runner.token_to_kv_pool
    slots = step.batch.out_cache_loc
    assert torch.equal(pool.get_key_buffer(layer_id)[slots], step.k.to(pool.dtype))
    assert torch.equal(pool.get_value_buffer(layer_id)[slots], step.v.to(pool.dtype))


def test_plugin_registers_the_name():
    """The installed entry point ran when sglang loaded its plugins: the name is a choice and a registered backend,
    and registering again changes nothing."""
    assert integration.NAME in ATTENTION_BACKEND_CHOICES
    assert ATTENTION_BACKENDS[integration.NAME] is integration.HybridOpsAttnBackend
    integration.register()
    assert ATTENTION_BACKEND_CHOICES.count(integration.NAME) == 1


# (mode, prefix lengths, new tokens): requests past pages of 16, prefixes empty and long.
STEPS = {
    ForwardMode.EXTEND: ([0, 21, 5], [9, 17, 1]),
    ForwardMode.DECODE: ([30, 0, 16], [1, 1, 1]),
    ForwardMode.MIXED: ([0, 40, 7], [19, 1, 1]),
    ForwardMode.IDLE: ([], []),
    ForwardMode.TARGET_VERIFY: ([18, 3], [3, 3]),
    ForwardMode.DRAFT_EXTEND_V2: ([11, 33], [4, 4]),
    ForwardMode.SPLIT_PREFILL: ([6, 0], [12, 20]),
}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", list(STEPS), ids=lambda m: m.name)
def test_every_mode_inside_sglangs_hybrid_backend(speculative_attention_mode, mode, page_size):
    """sglang's HybridAttnBackend around two of ours: the step's output is the float64 reference's and its K/V land
    at out_cache_loc, in the layer's own buffer, whichever of the two sglang picks."""
    rng = random.Random(int(mode) * 100 + page_size)
    runner = Runner(page_size=page_size)
    hybrid = HybridAttnBackend(
        runner, ATTENTION_BACKENDS["hybrid_ops"](runner), integration.HybridOpsAttnBackend(runner)
    )
    layer = layer_of(layer_id=1)
    step = make_step(runner, mode, *STEPS[mode], rng)
    out = attend(hybrid, step, layer)
    assert out.shape == (sum(step.q_lens), HQ * D)
    assert_close(out.view(-1, HQ, D), reference(step, layer, runner.token_to_kv_pool), torch.float32)
    check_written(runner, step, layer_id=1)


@pytest.mark.parametrize("name", [m.name for m in ForwardMode])
def test_modes_follow_sglangs_predicates(speculative_attention_mode, name):
    """Every member of the installed sglang's ForwardMode: the ops route it to the path that sglang's own
    `_select_backend` picks (prefill or decode backend), or our backend refuses it by name."""
    sglang_mode = ForwardMode[name]
    runner = Runner()
    prefill, decode = integration.HybridOpsAttnBackend(runner), integration.HybridOpsAttnBackend(runner)
    chosen = HybridAttnBackend(runner, prefill, decode)._select_backend(sglang_mode)
    if sglang_mode in (ForwardMode.PREBUILT, ForwardMode.DLLM_EXTEND):
        with pytest.raises(HybridInputError, match=f"does not serve sglang's {name}: "):
            integration.forward_mode_of(sglang_mode)
        return
    ours = integration.forward_mode_of(sglang_mode)
    assert ours.name == name
    path = select_path(int(ours), speculative_attention_mode)
    assert path == ("decode" if chosen is decode else "prefill")


def test_refused_mode_leaves_the_pool(config):
    runner = Runner()
    backend = integration.HybridOpsAttnBackend(runner)
    step = make_step(runner, ForwardMode.EXTEND, [3], [2], random.Random(1))
    before = runner.token_to_kv_pool.get_key_buffer(0).clone()
    step.batch.forward_mode = ForwardMode.DLLM_EXTEND
    with pytest.raises(
        HybridInputError, match="does not serve sglang's DLLM_EXTEND: its blocks attend bidirectionally"
    ):
        attend(backend, step, layer_of())
    assert torch.equal(runner.token_to_kv_pool.get_key_buffer(0), before)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "options",
    [
        dict(sliding_window_size=6),
        dict(sliding_window_size=0),
        dict(logit_cap=1.5),
        dict(sliding_window_size=20, logit_cap=3.0),
    ],
    ids=["window", "window-0", "cap", "window-cap"],
)
def test_layer_options(config, options, page_size):
    """RadixAttention's window (W + 1 keys, sglang's convention: 0 is the token alone) and soft-cap, in prefill and
    decode steps."""
    rng = random.Random(page_size)
    runner = Runner(page_size=page_size)
    backend = integration.HybridOpsAttnBackend(runner)
    layer = layer_of(**options)
    for mode, lens in ((ForwardMode.EXTEND, ([0, 25], [30, 9])), (ForwardMode.DECODE, ([37, 8], [1, 1]))):
        step = make_step(runner, mode, *lens, rng)
        out = attend(backend, step, layer)
        assert_close(out.view(-1, HQ, D), reference(step, layer, runner.token_to_kv_pool), torch.float32)


def test_window_matches_sglangs_torch_native(config):
    """The window as sglang's own torch_native backend computes it, on the same pool and batch."""
    rng = random.Random(7)
    runner = Runner(page_size=16)
    ours, native = integration.HybridOpsAttnBackend(runner), ATTENTION_BACKENDS["torch_native"](runner)
    layer = layer_of(sliding_window_size=5)
    for mode, lens in ((ForwardMode.EXTEND, ([4, 20], [25, 6])), (ForwardMode.DECODE, ([40, 9], [1, 1]))):
        step = make_step(runner, mode, *lens, rng)
        out = attend(ours, step, layer)
        assert_close(out, attend(native, step, layer).double(), torch.float32)


def test_sinks_and_chunks(config):
    """gpt-oss's sinks (a forward keyword, [Hq] in the model's dtype) and Llama 4's chunks (the runner's
    attention_chunk_size, on layers with use_irope; the others attend in full)."""
    rng = random.Random(3)
    runner = Runner(attention_chunk_size=8)
    backend = integration.HybridOpsAttnBackend(runner)
    sinks = torch.randn(HQ).to(torch.bfloat16)
    for layer, chunk in ((layer_of(use_irope=True), 8), (layer_of(use_irope=False), -1)):
        for mode, lens in ((ForwardMode.EXTEND, ([5, 14], [20, 3])), (ForwardMode.DECODE, ([23, 8], [1, 1]))):
            step = make_step(runner, mode, *lens, rng)
            out = attend(backend, step, layer, sinks=sinks)
            want = reference(step, layer, runner.token_to_kv_pool, sinks=sinks.float(), attention_chunk=chunk)
            assert_close(out.view(-1, HQ, D), want, torch.float32)


@pytest.mark.parametrize("layout", [TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK], ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_trees(speculative_attention_mode, monkeypatch, layout, page_size):
    """TARGET_VERIFY with EAGLE trees in both of sglang's mask layouts (the CPU's and the GPU's), and with a chain
    (topk 1: causal), inside sglang's HybridAttnBackend."""
    monkeypatch.setattr(integration, "default_tree_mask_mode", lambda: layout)
    rng = random.Random(page_size)
    runner = Runner(page_size=page_size)
    hybrid = HybridAttnBackend(runner, *(integration.HybridOpsAttnBackend(runner) for _ in range(2)))
    layer = layer_of()
    for tree in (True, False):
        step = make_step(
            runner, ForwardMode.TARGET_VERIFY, [21, 0, 35], [5, 5, 5] if tree else [4, 4, 4], rng, tree=tree
        )
        if layout == TreeMaskMode.FULL_MASK:
            step.batch.spec_info.custom_mask = full_mask(step)
        out = attend(hybrid, step, layer)
        assert_close(out.view(-1, HQ, D), reference(step, layer, runner.token_to_kv_pool), torch.float32)
        check_written(runner, step)


def test_value_head_dim_and_bf16(config):
    """Dv other than D (RadixAttention's v_head_dim) and a bf16 pool."""
    rng = random.Random(5)
    runner = Runner(page_size=16, v_head_dim=8, dtype=torch.bfloat16)
    backend = integration.HybridOpsAttnBackend(runner)
    layer = layer_of(v_head_dim=8)
    for mode, lens in ((ForwardMode.EXTEND, ([3, 17], [22, 2])), (ForwardMode.DECODE, ([30, 4], [1, 1]))):
        step = make_step(runner, mode, *lens, rng, dtype=torch.bfloat16)
        out = attend(backend, step, layer)
        assert out.shape == (sum(step.q_lens), HQ * 8) and out.dtype == torch.bfloat16
        assert_close(out.view(-1, HQ, 8), reference(step, layer, runner.token_to_kv_pool), torch.bfloat16)
        check_written(runner, step)


@pytest.mark.parametrize("scales", ["tensor", "float", "none"])
def test_fp8_pool(config, scales):
    """An fp8 pool holds k / k_scale, read times the scale; the layer's scales as sglang gives them (quantized
    checkpoints: 0-d tensors; `k_scale_float` alone; none: 1.0)."""
    rng = random.Random(9)
    runner = Runner(page_size=16, dtype=torch.float8_e4m3fn)
    backend = integration.HybridOpsAttnBackend(runner)
    layer = layer_of()
    k_scale, v_scale = {"tensor": (0.5, 2.0), "float": (0.25, 1.5), "none": (None, None)}[scales]
    if scales == "tensor":
        layer.k_scale, layer.v_scale = torch.tensor(k_scale), torch.tensor(v_scale)
    if scales != "none":
        layer.k_scale_float, layer.v_scale_float = k_scale, v_scale
    pool = runner.token_to_kv_pool
    for mode, lens in ((ForwardMode.EXTEND, ([5, 20], [12, 3])), (ForwardMode.DECODE, ([25, 9], [1, 1]))):
        step = make_step(runner, mode, *lens, rng)
        out = attend(backend, step, layer)
        slots = step.batch.out_cache_loc
        for buffer, new, scale in (
            (pool.get_key_buffer(0), step.k, k_scale),
            (pool.get_value_buffer(0), step.v, v_scale),
        ):
            stored = to_fp8(new, torch.tensor(scale or 1.0), torch.float8_e4m3fn)
            assert torch.equal(buffer[slots].view(torch.uint8), stored.view(torch.uint8))
        # The reference attends over what the pool holds, the new tokens included, dequantized.
        step.k = pool.get_key_buffer(0)[slots].float() * (k_scale or 1.0)
        step.v = pool.get_value_buffer(0)[slots].float() * (v_scale or 1.0)
        want = reference(step, layer, pool, k_scale=k_scale, v_scale=v_scale)
        assert_close(out.view(-1, HQ, D), want, torch.float32)


def test_kv_already_stored(config):
    """`save_kv_cache=False` and `k=None` (a layer that shares another's KV, or a fused kernel that stored it): the
    pool's K/V at out_cache_loc are attended over, unchanged."""
    rng = random.Random(11)
    runner = Runner(page_size=16)
    backend = integration.HybridOpsAttnBackend(runner)
    layer = layer_of()
    pool = runner.token_to_kv_pool
    step = make_step(runner, ForwardMode.EXTEND, [9, 30], [14, 2], rng)
    slots = step.batch.out_cache_loc
    pool.get_key_buffer(0)[slots] = step.k
    pool.get_value_buffer(0)[slots] = step.v
    before = pool.get_key_buffer(0).clone(), pool.get_value_buffer(0).clone()
    want = reference(step, layer, pool)
    backend.init_forward_metadata(step.batch)
    with forward_context(ForwardContext(attn_backend=backend), forward_batch=step.batch):
        shared = layer(step.q.flatten(1), None, None, step.batch, save_kv_cache=False)
        fused = layer(step.q.flatten(1), torch.randn_like(step.k), torch.randn_like(step.v), step.batch, False)
    for out in (shared, fused):
        assert_close(out.view(-1, HQ, D), want, torch.float32)
    assert torch.equal(pool.get_key_buffer(0), before[0]) and torch.equal(pool.get_value_buffer(0), before[1])


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(is_cross_attention=True), "layer 0 is cross attention"),
        (dict(attn_type=AttentionType.ENCODER_ONLY), "layer 0 is encoder_only"),
        (dict(logit_capping_method="gelu", logit_cap=2.0), "logit_capping_method 'gelu' is not served"),
        (dict(xai_temperature_len=4), "xai_temperature_len"),
    ],
)
def test_refused_layers(config, change, words):
    """What the ops cannot compute is refused by name, the pool untouched, and the backend serves the next call."""
    rng = random.Random(2)
    runner = Runner()
    backend = integration.HybridOpsAttnBackend(runner)
    step = make_step(runner, ForwardMode.EXTEND, [4], [3], rng)
    bad = layer_of()
    for name, value in change.items():
        setattr(bad, name, value)
    before = runner.token_to_kv_pool.get_key_buffer(0).clone()
    with pytest.raises(HybridInputError, match=words):
        attend(backend, step, bad)
    with pytest.raises(HybridInputError, match=r"does not serve the keywords \['return_lse'\]"):
        attend(backend, step, layer_of(), return_lse=True)
    assert torch.equal(runner.token_to_kv_pool.get_key_buffer(0), before)
    out = attend(backend, step, layer_of())
    assert_close(out.view(-1, HQ, D), reference(step, layer_of(), runner.token_to_kv_pool), torch.float32)


def test_refused_pools(config):
    """MLA's latent pool (and any pool but MHATokenToKVPool) is refused when sglang builds the backend."""
    runner = Runner()
    runner.token_to_kv_pool = MLATokenToKVPool(
        size=64, page_size=1, dtype=torch.float32, kv_lora_rank=16, qk_rope_head_dim=8, layer_num=1, device="cpu",
        enable_memory_saver=False,
    )  # fmt: skip
    with pytest.raises(
        HybridInputError, match="serves sglang's MHATokenToKVPool; this model's pool is MLATokenToKVPool"
    ):
        integration.HybridOpsAttnBackend(runner)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY], ids=lambda m: m.name)
def test_cuda_graph_hooks(speculative_attention_mode, mode):
    """sglang 0.5.23's CUDA-graph hooks, run as far as the CPU allows: the capture's metadata goes into static
    buffers of the context's width, and each replay (sglang's view of the padded batch: padded requests on row 0,
    seq_lens the fill value) rewrites them in place, so the graph's tensors never move; the real rows give the
    reference's output and the padded ones write only sglang's padding page."""
    rng = random.Random(int(mode))
    runner = Runner(page_size=16)
    backend = integration.HybridOpsAttnBackend(runner)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=16)
    q_len = 1 if mode == ForwardMode.DECODE else 3
    layer = layer_of()
    pool = runner.token_to_kv_pool
    addresses = None
    for prefix_lens in ([5, 40], [33, 0]):
        step = make_step(runner, mode, prefix_lens, [q_len] * 2, rng)
        real_tokens = 2 * q_len
        fill = backend.get_cuda_graph_seq_len_fill_value()
        padded = SimpleNamespace(
            forward_mode=mode,
            batch_size=4,
            req_pool_indices=torch.cat([step.batch.req_pool_indices, torch.zeros(2, dtype=torch.int64)]),
            seq_lens=torch.cat([step.batch.seq_lens, torch.full((2,), fill, dtype=torch.int64)]),
            seq_lens_cpu=None,
            out_cache_loc=step.batch.out_cache_loc,
            spec_info=step.batch.spec_info,
        )
        if mode == ForwardMode.TARGET_VERIFY:
            padded.spec_info.custom_mask = torch.cat(
                [padded.spec_info.custom_mask, torch.ones(2 * q_len * q_len, dtype=torch.bool)]
            )
        backend.init_forward_metadata_out_graph(padded, in_capture=addresses is None)
        metadata = backend.forward_metadata
        now = [t.data_ptr() for t in (metadata.cu_seqlens_q, metadata.seq_lens, metadata.block_table)]
        assert addresses is None or now == addresses
        addresses = now
        assert metadata.block_table.shape == (4, backend.max_pages)
        others = [p for p in range(1, runner.num_pages)]
        before = pool.get_key_buffer(0).view(-1, 16, HKV, D)[others].clone()
        q, k, v = (torch.cat([t, torch.randn(2 * q_len, *t.shape[1:])]) for t in (step.q, step.k, step.v))
        out = backend.forward_decode(q.flatten(1), k, v, layer, step.batch)
        assert_close(out[:real_tokens].view(-1, HQ, D), reference(step, layer, pool), torch.float32)
        check_written(runner, step)
        # Padding wrote page 0 only: the other pages hold what they held, but the real tokens' slots.
        after = pool.get_key_buffer(0).view(-1, 16, HKV, D)[others]
        real = {int(s) // 16 for s in step.batch.out_cache_loc}
        for index, page in enumerate(others):
            if page not in real:
                assert torch.equal(after[index], before[index])


def test_cpu_graph_compiles_attention_whole(config):
    """sglang's CPU graph runner compiles the model with the layers' attention inside (`torch.compile(...,
    dynamic=False)` per batch size): the backend's forward traces with no graph break, replays of other batches of
    the captured size recompile nothing, and the pool is written in place (no copy)."""
    rng = random.Random(4)
    runner = Runner(page_size=16)
    backend = integration.HybridOpsAttnBackend(runner)
    backend.init_cpu_graph_state(max_bs=2, max_num_tokens=2)
    layer = layer_of()
    step = make_step(runner, ForwardMode.DECODE, [3, 20], [1, 1], rng)
    backend.init_forward_metadata_capture_cpu_graph(
        2, 2, step.batch.req_pool_indices, step.batch.seq_lens, step.batch.out_cache_loc, None, ForwardMode.DECODE, None
    )
    compiled = torch.compile(backend.forward, fullgraph=True, dynamic=False)
    codes = []
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        for prefix_lens in ([3, 20], [50, 0], [17, 31]):
            step = make_step(runner, ForwardMode.DECODE, prefix_lens, [1, 1], rng)
            backend.init_forward_metadata(step.batch)
            out, code = run_and_get_code(compiled, step.q.flatten(1), step.k, step.v, layer, step.batch)
            codes += code
            assert_close(out.view(-1, HQ, D), reference(step, layer, runner.token_to_kv_pool), torch.float32)
            check_written(runner, step)
    # The generated code hands the pool's pages to the op: no copy of them, no clone.
    code = "\n".join(codes)
    assert "torch.ops.hybrid.attn.default(" in code
    assert "aten.copy" not in code and ".clone(" not in code and "copy_(" not in code
