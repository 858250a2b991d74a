"""torch.export and AOTInductor: one exported program serves every mode, with the cache written in place."""

import pytest
import torch
from expecttest import assert_expected_inline
from helpers.reference import assert_close, expected_cache, make_case, reference
from torch._inductor import aoti_compile_and_package, aoti_load_package
from torch.export import Dim

from hybrid_ops import ForwardMode

# Per mode, (query lengths, cached prefix lengths) crossing page boundaries (page_size 4), with an empty query; the
# speculative modes take the decode path (speculative_attention_mode="decode"), so both paths run.
STEPS = {
    ForwardMode.EXTEND: ([3, 0, 6], [2, 7, 0]),
    ForwardMode.DECODE: ([1, 1, 1], [4, 9, 0]),
    ForwardMode.MIXED: ([5, 1, 1], [0, 6, 11]),
    ForwardMode.IDLE: ([], []),
    ForwardMode.TARGET_VERIFY: ([3, 3], [5, 8]),
    ForwardMode.DRAFT_EXTEND_V2: ([2, 2], [1, 6]),
}


OPTIONS = dict(sliding_window=8, speculative_attention_mode="decode")


class Attention(torch.nn.Module):
    """A layer around the op. forward_mode: an int, or a 0-d int64 tensor read with `.item()`; AOTInductor takes
    tensor inputs only (torch 2.13 turns any other input into a constant), so the tensor form is what it packages."""

    def forward(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, forward_mode):
        if isinstance(forward_mode, torch.Tensor):
            forward_mode = forward_mode.item()
        out = torch.ops.hybrid.attn(
            q * 2.0, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, forward_mode, **OPTIONS
        )
        return out + 1.0


def mode_input(mode, as_tensor):
    return torch.tensor(int(mode)) if as_tensor else int(mode)


def export(as_tensor):
    """The exported program: token count, batch size, page count and table width all symbolic, and the mode."""
    case = make_case([3, 2], [4, 1], seed=0)
    tokens, batch, pages, width = Dim("tokens"), Dim("batch"), Dim("pages"), Dim("width")
    dynamic_shapes = (
        {0: tokens},
        {0: tokens},
        {0: tokens},
        {0: pages},
        {0: pages},
        {0: batch + 1},
        {0: batch},
        {0: batch, 1: width},
        None if as_tensor else Dim.DYNAMIC,
    )
    return torch.export.export(
        Attention(), (*case.args, mode_input(ForwardMode.EXTEND, as_tensor)), dynamic_shapes=dynamic_shapes
    )


def check_every_mode(fn, as_tensor):
    """fn's output and cache writes against eager's and the float64 reference, for every mode, on fresh inputs."""
    for mode, (q_lens, prefix_lens) in STEPS.items():
        case = make_case(q_lens, prefix_lens)
        q, k, v, k_cache, v_cache, *metadata = case.args
        eager_k, eager_v = k_cache.clone(), v_cache.clone()
        eager = Attention()(q, k, v, eager_k, eager_v, *metadata, int(mode))
        out = fn(q, k, v, k_cache, v_cache, *metadata, mode_input(mode, as_tensor))
        assert torch.equal(out, eager), mode
        assert_close(out, reference(case, scale=2 / q.shape[-1] ** 0.5, sliding_window=8) + 1.0, torch.float32)
        expected_k, expected_v = expected_cache(case)
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v), mode
        assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v), mode


@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
def test_exported_program_runs_every_mode(as_tensor):
    exported = export(as_tensor)
    attn = next(n for n in exported.graph.nodes if n.target == torch.ops.hybrid.attn.default)
    mode = attn.args[8]
    # The mode reaches the op as a symbol computed from the program's input, not as a constant.
    assert isinstance(mode, torch.fx.Node) and isinstance(mode.meta["val"], torch.SymInt)
    source = mode if not as_tensor else mode.args[0]
    assert source.op == "placeholder" and source.name == "forward_mode"
    check_every_mode(exported.module(), as_tensor)


@pytest.mark.slow
def test_aoti_package_runs_every_mode(tmp_path):
    exported = export(as_tensor=True)
    assert_expected_inline(
        exported.graph_module.code.strip(),
        """\
def forward(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, forward_mode):
    item = torch.ops.aten.item.default(forward_mode);  forward_mode = None
    mul = torch.ops.aten.mul.Tensor(q, 2.0);  q = None
    attn = torch.ops.hybrid.attn.default(mul, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, item, sliding_window = 8, speculative_attention_mode = 'decode');  mul = k = v = k_cache = v_cache = cu_seqlens_q = seq_lens = block_table = item = None
    add = torch.ops.aten.add.Tensor(attn, 1.0);  attn = None
    return (add,)""",
    )
    package = aoti_load_package(aoti_compile_and_package(exported, package_path=str(tmp_path / "attn.pt2")))
    check_every_mode(package, as_tensor=True)
    case = make_case([2], [3])
    before = case.k_cache.clone()
    with pytest.raises(Exception, match="forward_mode must be one of"):
        package(*case.args, torch.tensor(10))
    assert torch.equal(case.k_cache, before)
