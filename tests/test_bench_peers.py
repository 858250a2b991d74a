"""The bench's peer machinery without the peers: the cases a peer's process builds, the float64 check it runs on the
peer's output, and the rows a missing peer leaves ("not installed"). No timing is asserted."""

import json

import pytest
import torch
from helpers.reference import dense_attention

from bench import peer_worker
from bench.peers import Ipex, LlamaCpp, PeerError
from bench.run import Batch, markdown, timeit_side_by_side


def spec(dtype=torch.float32, scattered=True):
    """Three requests: a decode-like one, a fresh prompt and one over a prefix crossing page boundaries."""
    return peer_worker.case_spec([40, 0, 21], [1, 13, 6], dtype, scattered, 8, 2, 16, 8, seed=3)


@pytest.mark.parametrize("scattered", [False, True])
def test_case_pages_hold_each_request(scattered):
    """`paged` puts request i's position p at page block_table[i, p // page_size], row p % page_size."""
    case = peer_worker.make_case(spec(scattered=scattered))
    k_cache = peer_worker.paged(case, case.k)
    used = torch.cat([case.block_table[i, : -(-n // 8)] for i, n in enumerate(case.seq_lens.tolist())])
    assert sorted(used.tolist()) == list(range(case.num_pages))
    assert (used.tolist() != sorted(used.tolist())) == scattered
    for i, k in enumerate(case.k):
        for p in range(k.shape[2]):
            assert torch.equal(k_cache[case.block_table[i, p // 8], p % 8], k[0, :, p])


def test_worker_reference_is_causal_attention():
    """The check a peer's output must pass is float64 causal attention over each request's dense K/V."""
    case = peer_worker.make_case(spec())
    starts = case.cu_seqlens_q.tolist()
    expected = torch.cat(
        [
            dense_attention(case.q[a:b], k[0].transpose(0, 1), v[0].transpose(0, 1), prefix=k.shape[2] - (b - a))
            for a, b, k, v in zip(starts, starts[1:], case.k, case.v)
        ]
    )
    torch.testing.assert_close(peer_worker.reference(case), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_worker_check_passes_our_op_and_fails_a_wrong_output(dtype):
    """The bench's Batch (our rows) and the worker's case are the same tensors: our op passes the worker's check;
    an output 2% off in one token does not."""
    torch.manual_seed(0)
    batch = Batch([40, 0, 21], [1, 13, 6], dtype, True)
    assert peer_worker.checksum(batch.case) == peer_worker.checksum(peer_worker.make_case(batch.spec))
    out = batch.hybrid(torch.ops.hybrid.prefill, "torch")()
    assert peer_worker.max_error(batch.case, out) < peer_worker.TOLERANCE[dtype]
    wrong = out.clone()
    wrong[5] *= 1.02
    assert peer_worker.max_error(batch.case, wrong) > peer_worker.TOLERANCE[dtype]


def test_missing_peers_give_not_installed_rows(tmp_path):
    notes = {}
    batch = Batch([7], [1], torch.float32, False)
    with Ipex(None) as absent, Ipex(str(tmp_path / "python")) as missing:
        methods = {"absent": absent.method("k", batch), "missing": missing.method("k", batch), "ours": lambda: int}
        times = timeit_side_by_side(methods, reps=1, warmup=1, notes=notes)
    assert times["absent"] is None and times["missing"] is None and times["ours"] is not None
    assert notes == {
        "absent": "not installed (set HYBRID_OPS_IPEX_PYTHON)",
        "missing": f"not installed: no {tmp_path / 'python'}",
    }
    with LlamaCpp(None, None) as llama_cpp, pytest.raises(PeerError, match="not installed"):
        llama_cpp.generate(None, [[1]], 1, "f32")
    row = dict(case="decode", dtype="fp32", pages="scattered", method="ipex", ms=None, note=notes["absent"])
    e2e = dict(workload="demo", method="llama.cpp f32", tokens=8, note="not installed (set X)")
    table = markdown(dict(date="d", machine="m", read_gbps=1.0, command="c", load=[0.0, 0.0], op=[row], e2e=[e2e]))
    assert "| decode | fp32 | scattered | ipex | not installed (set HYBRID_OPS_IPEX_PYTHON) | | | |" in table
    assert "| demo | llama.cpp f32 | not installed (set X) |  |  |  |" in table


def test_worker_reports_a_failure_and_serves_on():
    """A library that cannot run answers an error line (shown in its row), and the next request is served."""
    requests = [
        dict(op="case", key="a", library="ipex", spec=spec(), threads=1),
        dict(op="time", key="a"),
        dict(op="forget"),
    ]
    replies = []
    peer_worker.serve([json.dumps(r) for r in requests], lambda line: replies.append(json.loads(line)))
    assert replies[0] == {"error": "ModuleNotFoundError: No module named 'intel_extension_for_pytorch'"}
    assert replies[1] == {"error": "KeyError: 'a'"}
    assert replies[2] == {}
