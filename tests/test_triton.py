"""The Triton kernels through the interpreter: every head dim and dtype, split-KV decode, compile, packaging."""

import os
import subprocess
import sys

import pytest
import torch
from reference import assert_close, expected_cache, make_case, reference

import hybrid_ops
from hybrid_ops.kernels import decode as decode_kernels
from hybrid_ops.kernels.config import INTERPRETER

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims(head_dim, dtype):
    case = make_case([4, 7], [9, 0], num_q_heads=4, num_kv_heads=2, head_dim=head_dim, page_size=8, dtype=dtype)
    k_ref, v_ref = expected_cache(case)
    out = torch.ops.hybrid.prefill(*case.args, backend="triton", sliding_window=8, logit_cap=5.0)
    assert_close(out, reference(case, sliding_window=8, logit_cap=5.0), dtype)
    assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref)
    case = make_case([2, 2], [9, 30], num_q_heads=4, num_kv_heads=1, head_dim=head_dim, page_size=8, dtype=dtype)
    out = torch.ops.hybrid.decode(*case.args, backend="triton", scale=0.1)
    assert_close(out, reference(case, scale=0.1), dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize("window", [-1, 5])
def test_decode_splits(num_splits, window):
    """More splits than the requests have pages (empty splits) and fewer; the reduction is exact either way."""
    case = make_case([1, 1, 1], [0, 6, 40], num_q_heads=8, num_kv_heads=2, page_size=4, seed=num_splits)
    torch.ops.hybrid.decode(*case.args, backend="torch")  # stores the new tokens
    scale = case.q.shape[-1] ** -0.5
    out = decode_kernels.decode(case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_table, scale, window,
                                0.0, INTERPRETER, num_splits=num_splits)
    assert_close(out, reference(case, sliding_window=window), torch.float32)


def test_num_splits_from_static_sizes():
    sms = 132
    assert decode_kernels.num_kv_splits(1 * 8, 32768, 64, sms) == 33  # a batch of 1 still fills the GPU
    assert decode_kernels.num_kv_splits(64 * 8, 4096, 64, sms) == 1
    assert decode_kernels.num_kv_splits(4 * 8, 64, 64, sms) == 1  # never more splits than KV blocks
    assert decode_kernels.num_kv_splits(1 * 8 * 4, 32768, 64, sms) == 9  # row tiles count as programs


def test_matches_torch_backend():
    case = make_case([5, 1, 12], [3, 30, 0], num_q_heads=6, num_kv_heads=2, page_size=16, dtype=torch.float16)
    args_torch = [a.clone() for a in case.args]
    out_triton = torch.ops.hybrid.prefill(*case.args, backend="triton")
    out_torch = torch.ops.hybrid.prefill(*args_torch, backend="torch")
    assert (out_triton.float() - out_torch.float()).abs().max() < 2e-3
    assert torch.equal(case.k_cache, args_torch[3]) and torch.equal(case.v_cache, args_torch[4])


def test_compiled_with_triton_backends(fresh_dynamo):

    def step(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, forward_mode: int):
        return torch.ops.hybrid.attn(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, forward_mode,
                                     prefill_backend="triton", decode_backend="triton")

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for mode, q_lens in [(1, [3, 5]), (2, [1, 1]), (5, [2, 2]), (3, [4, 1])]:
        case = make_case(q_lens, [6, 2], seed=mode)
        assert_close(compiled(*case.args, mode), reference(case), torch.float32)


def test_import_without_triton():
    """hybrid_ops imports without Triton; asking for it is a clear error."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, hybrid_ops\n"
        "q = torch.zeros(0, 2, 8); kc = torch.zeros(1, 1, 1, 8); i = torch.zeros(1, dtype=torch.int32)\n"
        "try:\n"
        "    torch.ops.hybrid.prefill(q, q[:, :1], q[:, :1], kc, kc, i, i[:0], i[:0].view(0, 1), backend='triton')\n"
        "except hybrid_ops.HybridInputError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "backend='triton' needs triton" in result.stdout


def test_auto_picks_the_native_kernels_on_cpu():
    """Not Triton's interpreter, even when it is on."""
    assert hybrid_ops.get_backend("auto", torch.device("cpu"), torch.float32, 8).name == "cpu"
