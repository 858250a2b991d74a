"""sglang's own Engine and server with hybrid_ops as its attention backend, on tiny local models (nothing downloaded):
greedy ids equal to transformers' and to sglang's own torch_native backend's, with ours as prefill, as decode and as
both, batched, on radix-cache hits, with pages of 16 tokens, and compiled by sglang's CPU graph runner."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import sglang
from tiny_models import CONFIGS, HIT, NEW_TOKENS, PROMPTS


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request, saved):
    return saved(request.param)


def engine_ids(directory, **server_args):
    """sglang's Engine on the model: the greedy ids of PROMPTS as one batch, then of HIT (a radix-cache hit), and
    the tokens that hit reused."""
    engine = sglang.Engine(
        model_path=directory, device="cpu", dtype="float32", mem_fraction_static=0.02, disable_cuda_graph=True,
        **server_args,
    )  # fmt: skip
    try:
        greedy = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        batch = engine.generate(input_ids=PROMPTS, sampling_params=greedy)
        hit = engine.generate(input_ids=[HIT], sampling_params=greedy)[0]
    finally:
        engine.shutdown()
    return [o["output_ids"] for o in batch] + [hit["output_ids"]], hit["meta_info"]["cached_tokens"]


@pytest.fixture(scope="module")
def native(model):
    """sglang's own torch_native backend's ids."""
    return engine_ids(model[1], attention_backend="torch_native")[0]


ROLES = {
    "both": dict(attention_backend="hybrid_ops"),
    "prefill": dict(prefill_attention_backend="hybrid_ops", decode_attention_backend="torch_native"),
    "decode": dict(prefill_attention_backend="torch_native", decode_attention_backend="hybrid_ops"),
    "pages_of_16": dict(attention_backend="hybrid_ops", page_size=16),
}


@pytest.mark.parametrize("role", list(ROLES))
def test_greedy_ids(model, native, role):
    """Ours as both backends, as sglang's HybridAttnBackend's prefill or decode half, and over pages of 16 tokens:
    transformers' ids and torch_native's, batched and on the radix-cache hit."""
    name, directory, want = model
    ids, cached = engine_ids(directory, **ROLES[role])
    assert ids == want[:4]
    assert ids == native
    assert cached == (16 if role == "pages_of_16" else len(PROMPTS[1]))


def test_compiled_by_the_cpu_graph_runner(model, capfd):
    """`--enable-torch-compile`: sglang's CPU graph runner compiles the model per decode batch size (1 and 2) with our
    ops inside and replays those graphs (its log says "cpu graph: True"), with transformers' ids."""
    name, directory, want = model
    engine = sglang.Engine(
        model_path=directory, device="cpu", dtype="float32", mem_fraction_static=0.02, attention_backend="hybrid_ops",
        enable_torch_compile=True, cuda_graph_bs_decode=[1, 2], torch_compile_max_bs=2, log_level="info",
        decode_log_interval=1,
    )  # fmt: skip
    try:
        greedy = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        pair = engine.generate(input_ids=PROMPTS[:2], sampling_params=greedy)
        alone = engine.generate(input_ids=[PROMPTS[2]], sampling_params=greedy)
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in pair + alone] == want[:3]
    log = capfd.readouterr().err
    assert "Capture cpu graph bs [1, 2]" in log
    assert "cpu graph: True" in log


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launch_server_answers_completions(saved, tmp_path):
    """`python -m sglang.launch_server --attention-backend hybrid_ops --device cpu` (the plugin's command-line
    choice) answers a completions request, with pages of 16 tokens, with transformers' greedy tokens."""
    name, directory, want = saved("llama")
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    command = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", directory, "--attention-backend", "hybrid_ops",
        "--device", "cpu", "--dtype", "float32", "--page-size", "16", "--mem-fraction-static", "0.02", "--host",
        "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not start in 300 s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        # The prompt as token ids (the completions API takes them): the ids, not a tokenizer's reading of text.
        body = {
            "model": directory,
            "prompt": PROMPTS[1],
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
    finally:
        server.terminate()
        server.wait(60)
    words = answer["choices"][0]["text"].split()
    assert [int(w[1:]) for w in words] == want[1]
