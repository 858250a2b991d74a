"""Tensor parallelism: 2 ranks on the CPU (gloo), each holding half of the KV heads, give one process's tokens."""

import json
import subprocess
import sys

import pytest
from helpers.models import MODELS, NEW_TOKENS, PROMPTS, SIZES, SMALL, make_model, reference_tokens, small_model
from helpers.scripts import ROOT
from transformers import LlamaConfig

import hybrid_ops

pytestmark = pytest.mark.slow

SHARDED = ["llama", "mistral_window"]
COMPILED = ["llama"]  # a sharded graph compiles alike for both; the sliding window is the op's, not the sharding's


def torchrun(*args):
    """Runs `args` on 2 ranks (a free port: `--standalone`); returns the finished process."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Each rank's results from tp_worker.py, for the sharded models and one whose KV head does not divide by 2."""
    tmp = tmp_path_factory.mktemp("tp")
    models = {}
    for name in SHARDED:
        small_model(name).save_pretrained(tmp / name)
        models[name] = str(tmp / name)
    make_model(LlamaConfig(**{**SMALL, "num_key_value_heads": 1})).save_pretrained(tmp / "one_kv_head")
    models["one_kv_head"] = str(tmp / "one_kv_head")
    spec = {"models": models, "compiled": COMPILED, "prompts": PROMPTS, "new_tokens": NEW_TOKENS}
    (tmp / "spec.json").write_text(json.dumps(spec))
    result = torchrun(ROOT / "tests" / "tp_worker.py", tmp / "spec.json", tmp)
    assert result.returncode == 0, result.stderr[-5000:]
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize(
    "name, mode", [(name, "eager") for name in SHARDED] + [(name, "compiled") for name in COMPILED]
)
def test_ranks_generate_one_process_tokens(ranks, name, mode):
    expected = reference_tokens(small_model(name))
    for results in ranks:
        assert results[f"{name}/{mode}"] == expected


@pytest.mark.parametrize("name", SHARDED)
def test_each_rank_caches_its_own_kv_heads(ranks, name):
    total = MODELS[name][0]().num_key_value_heads
    assert [results[f"{name}/kv_heads"] for results in ranks] == [total // 2] * 2


@pytest.mark.parametrize("name", SHARDED)
def test_ranks_sample_rank_zeros_tokens(ranks, name):
    """The ranks seed their generators differently; all take rank 0's samples, which one process seeded alike draws."""

    def sampled(seed):
        """As tp_worker.py samples on the rank seeded with `seed`."""
        model = small_model(name)
        return hybrid_ops.generate(
            model, PROMPTS, NEW_TOKENS, compile=False, **SIZES, do_sample=True, top_k=20, seed=seed
        )

    one_process = sampled(0)
    assert [results[f"{name}/sampled"] for results in ranks] == [one_process] * 2
    assert one_process != sampled(1)


@pytest.mark.parametrize("name", SHARDED)
def test_ranks_given_different_prompts_all_raise(ranks, name):
    for results in ranks:
        assert results[f"{name}/different_prompts"] == (
            "prompts, max_new_tokens and the sampling options must be "
            "the same on every rank of the tensor-parallel group"
        )


def test_kv_heads_that_do_not_divide_are_refused(ranks):
    for results in ranks:
        assert results["one_kv_head/error"] == (
            "num_key_value_heads (1) must divide by the tensor-parallel size (2): each rank must hold whole KV heads"
        )


def test_tensor_parallel_example():
    result = torchrun(ROOT / "examples" / "tensor_parallel.py", "--max-new-tokens", "4", "--prompts", "3")
    assert result.returncode == 0, result.stderr[-5000:]
    assert "1 of 2 KV heads on each of 2 ranks" in result.stdout
    assert "tokens equal on every rank: True" in result.stdout
    assert "tokens equal one process's: True" in result.stdout
