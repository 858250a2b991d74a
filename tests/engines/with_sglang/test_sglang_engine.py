"""sglang's own Engine and server with hybrid_ops as its attention backend, on tiny local models (nothing downloaded):
greedy ids equal to transformers' and to sglang's own torch_native backend's, with ours as prefill, as decode and as
both (over pages of 16 tokens), batched, on radix-cache hits, and compiled by sglang's CPU graph runner. Each engine
runs in a process of its own (`run_engine.py`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from serving import free_port, post, wait_until_healthy
from tiny_models import HIT, NEW_TOKENS, PROMPTS

RUN = Path(__file__).with_name("run_engine.py")


def engine_ids(directory, **engine):
    """sglang's Engine on the model with `engine`'s keywords: the greedy ids of PROMPTS as one batch, then of HIT (a
    radix-cache hit on the second prompt), and the tokens that hit reused."""
    request = {"model": directory, "batches": [PROMPTS, [HIT]], "new_tokens": NEW_TOKENS, "engine": engine}
    result = subprocess.run(
        [sys.executable, str(RUN), json.dumps(request)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    return [ids for batch in answer["ids"] for ids in batch], answer["cached"][1][0]


@pytest.fixture(scope="module")
def native():
    """name -> sglang's own torch_native backend's ids, once each."""
    ids = {}

    def get(name, directory):
        if name not in ids:
            ids[name] = engine_ids(directory, attention_backend="torch_native", disable_cuda_graph=True)[0]
        return ids[name]

    return get


ROLES = {
    "prefill": dict(prefill_attention_backend="hybrid_ops", decode_attention_backend="torch_native"),
    "decode": dict(prefill_attention_backend="torch_native", decode_attention_backend="hybrid_ops"),
    "pages_of_16": dict(attention_backend="hybrid_ops", page_size=16),
}
# Ours as sglang's HybridAttnBackend's halves beside torch_native on Llama (pages of one token); as both on Gemma 2's
# windows and soft-cap over pages of 16 (and in the server test below, compiled).
CASES = [("llama", "prefill"), ("llama", "decode"), ("gemma2", "pages_of_16")]


@pytest.mark.parametrize("name, role", CASES)
def test_greedy_ids(saved, native, name, role):
    """transformers' ids and torch_native's, batched and on the radix-cache hit."""
    name, directory, want = saved(name)
    ids, cached = engine_ids(directory, disable_cuda_graph=True, **ROLES[role])
    assert ids == want[:4]
    assert ids == native(name, directory)
    assert cached == (16 if role == "pages_of_16" else len(PROMPTS[1]))


def test_launch_server_compiled_over_pages_of_16(saved, tmp_path):
    """`python -m sglang.launch_server --attention-backend hybrid_ops --device cpu --page-size 16
    --enable-torch-compile` (the plugin's command-line choice): sglang's CPU graph runner compiles the model per decode
    batch size (1 and 2) with our ops inside and replays those graphs (its log says "cpu graph: True"), and the
    completions API answers a batch of two prompts, then one, with transformers' greedy tokens, on Gemma 2's windows
    and soft-cap."""
    name, directory, want = saved("gemma2")
    port = free_port()
    log_path = tmp_path / "server.log"
    command = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", directory, "--attention-backend", "hybrid_ops",
        "--device", "cpu", "--dtype", "float32", "--page-size", "16", "--mem-fraction-static", "0.02",
        "--enable-torch-compile", "--cuda-graph-bs-decode", "1", "2", "--torch-compile-max-bs", "2",
        "--log-level", "info", "--decode-log-interval", "1", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(server, port, log_path, 600)
        texts = []
        # The prompts as token ids (the completions API takes them): the ids, not a tokenizer's reading of text.
        for prompts in [PROMPTS[:2], PROMPTS[2:]]:
            body = {
                "model": directory,
                "prompt": prompts,
                "max_tokens": NEW_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "skip_special_tokens": False,  # the ids as they are, eos's (t2) too
            }
            choices = sorted(post(port, "/v1/completions", body)["choices"], key=lambda c: c["index"])
            texts += [c["text"] for c in choices]
    finally:
        server.terminate()
        server.wait(60)
    # The tokenizer reads token id i as the word "t{i}".
    assert [[int(w[1:]) for w in text.split()] for text in texts] == want[:3]
    log = log_path.read_text()
    assert "Capture cpu graph bs [1, 2]" in log
    assert "cpu graph: True" in log
