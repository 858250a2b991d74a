"""Every example runs, at small sizes, so none of them can rot."""

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.reference import assert_close, dense_attention
from helpers.scripts import EXAMPLES, ROOT, run_script
from torch._dynamo.utils import counters

import hybrid_ops


def run_example(name, monkeypatch, argv=()):
    monkeypatch.setattr(sys, "argv", [name, *argv])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")


def test_direct_op(monkeypatch, capsys):
    run_example("direct_op.py", monkeypatch)
    assert "all outputs match dense attention" in capsys.readouterr().out


@pytest.mark.slow
def test_speculative(monkeypatch, capsys):
    args = ["--max-new-tokens", "6", "--tree", "3,2", "--chain", "5", "--compile-backend", "eager"]
    run_example("speculative.py", monkeypatch, args)
    out = capsys.readouterr().out
    assert out.count("tokens equal plain greedy decoding: True") == 6
    assert out.count("recompiles after the warm-up: 0") == 2
    assert "chain of 5:  5 draft tokens per step" in out and "tree 3x2:  6 draft tokens per step" in out


def test_speculative_on_a_hybrid_target(monkeypatch, capsys):
    """qwen3_5_text as the target (its gated delta rule layer's state kept per draft node in the verify step, the
    accepted one committed): greedy decoding's tokens, drafts accepted, no recompile after the warm-up."""
    args = ["--model", "qwen3_5_text", "--max-new-tokens", "6", "--modes", "decode", "--compile-backend", "eager"]
    run_example("speculative.py", monkeypatch, args)
    out = capsys.readouterr().out
    assert out.count("tokens equal plain greedy decoding: True") == 3
    assert "recompiles after the warm-up: 0" in out
    rows = [line for line in out.splitlines() if "draft tokens per step" in line]
    accepted = [float(row.split(" accepted per step")[0].split(",")[-1]) for row in rows]
    assert accepted[0] == 0 and min(accepted[1:]) > 0.5  # the chain and the tree accept drafts


def cache_rows(cache, request, length):
    """Per layer, (k, v) of a request's first `length` tokens in position order: [length, Hkv, D] each."""
    pages = torch.tensor(cache.pages(request))
    positions = torch.arange(length)
    slots = pages[positions // cache.page_size], positions % cache.page_size
    return [(k[slots], v[slots]) for k, v in zip(cache.k_caches, cache.v_caches)]


def assert_cache_holds(model, cache, request, tokens):
    """The request's cache rows are exactly the K/V of `tokens`, as transformers' own cache holds them after one
    plain forward over them (its dense attention, no paged cache)."""
    assert cache.seq_len(request) == len(tokens)
    with torch.inference_mode():
        plain = model(torch.tensor([tokens]), use_cache=True).past_key_values
    for layer, (k, v) in enumerate(cache_rows(cache, request, len(tokens))):
        assert_close(k, plain.layers[layer].keys[0].transpose(0, 1), torch.float32)
        assert_close(v, plain.layers[layer].values[0].transpose(0, 1), torch.float32)


# The draft's trees run through the prefill path in either mode; verify through the prefill path is the slow case.
@pytest.mark.parametrize("speculative_attention_mode", ["decode", pytest.param("prefill", marks=pytest.mark.slow)])
def test_speculative_trees_give_greedy_tokens_keep_the_accepted_rows_and_never_recompile(speculative_attention_mode):
    """Trees, chains and plain decoding through one compiled graph per model: after the warm-up, no change of tree,
    mode or batch recompiles (a recompile raises); tokens equal plain greedy decoding; after each step both caches
    hold exactly the accepted tokens' K/V (the target all but its last token, the draft what it caught up on)."""
    example = runpy.run_path(str(EXAMPLES / "speculative.py"))
    prompts = [[5, 9, 11, 3, 7], [8, 1, 2], [4, 4, 6, 9, 10, 12, 13]]  # each tree below accepts some draft tokens
    target, draft = example["target_and_draft"]()
    greedy = hybrid_ops.generate(target, prompts, 7, compile=False)
    generator = example["SpeculativeGenerator"](target, draft, speculative_attention_mode, compile_backend="eager")
    generator.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for depth, width, chosen in [
            (2, 2, [0, 1, 2]),
            (3, 1, [1]),
            (1, 3, [2, 0]),
            (3, 2, [0, 1, 2]),
            (0, 1, [1]),
            (1, 1, [2]),
        ]:
            tokens, accepted = generator.generate([prompts[i] for i in chosen], 7, depth, width)
            assert tokens == [greedy[i] for i in chosen], (depth, width)
            assert all(0 <= n <= depth for n in accepted) and (depth == 0 or sum(accepted) > 0)
        requests = generator.add(prompts)
        for depth, width in [(2, 3), (3, 2), (1, 1)]:
            generator.step(requests, depth, width)
            for request in requests:
                seq = generator.seqs[request]
                assert_cache_holds(target, generator.target.cache, request, seq[:-1])
                held = generator.draft.cache.seq_len(request)
                assert len(seq) - 2 <= held <= len(seq) - 1  # at most the last accepted token and the root missing
                assert_cache_holds(draft, generator.draft.cache, request, seq[:held])
        for request in requests:
            generator.free(request)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_generate_demo():
    """The README's first command, with fewer new tokens: compiles once, never recompiles, same tokens as
    transformers' static-cache generate."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = run_script(EXAMPLES / "generate.py", "--max-new-tokens", "6", env=env)
    assert "recompiles in the measured run: 0" in out
    assert "identical tokens for 8/8 prompts" in out


@pytest.mark.slow
def test_gpu_check_script_smoke(tmp_path):
    """The GPU check script's logic, at tiny sizes on the CPU, so it is ready whenever a GPU is."""
    out = run_script(ROOT / "scripts" / "gpu_check.py", "--smoke", "--out", tmp_path)
    for cache in ("torch.bfloat16", "torch.float8_e4m3fn"):
        assert f"correct: triton q torch.bfloat16, cache {cache}, every mode" in out
    assert "trees: torch, prefill and verify" in out
    assert "state ops: triton mamba1" in out and "| mamba1 | prefill 2 x 16 |" in out
    assert "triton MLA latent cache D 40 / Dv 32" in out and "| latent | batch 2 x ctx 64, Hq 4 |" in out
    assert (tmp_path / "gpu_check_smoke_cpu.md").exists()


@pytest.mark.slow
def test_bench_runs(tmp_path):
    """The benchmark script runs (its dispatch section, quick); it asserts no timings, it only must not rot."""
    out = run_script("-m", "bench", "dispatch", "--quick", cwd=ROOT)
    assert "| compiled decode (T = 1), cpu backend |" in out


def test_bench_bound_runs():
    """bench.bound's tables (in cache, from memory at --scale 2, the marginal arithmetic): the rows of both dtypes;
    it asserts no timings."""
    out = run_script("-m", "bench.bound", "--reps", "10", "--scale", "2", cwd=ROOT)
    for dtype in ("float32", "bfloat16"):
        assert re.search(rf"\| {dtype} \| from memory \(decode case\) \| [\d.]+, [\d.]+ \|", out), out
        assert re.search(rf"\| {dtype} \| -?[\d.]+ \|", out), out


def test_bench_full_run_needs_matplotlib_first(monkeypatch, capsys):
    """A full run saves its tables after drawing the plot: without matplotlib it stops before measuring anything."""
    from bench.run import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setattr("bench.run.read_bandwidth", lambda: pytest.fail("measured before the check"))
    with pytest.raises(SystemExit):
        main([])
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.endswith("error: a full run draws bench/results/cpu.png with matplotlib: pip install -e '.[bench]'")


def test_readme_example():
    """The README's first Python block runs as written and attends causally (float64 reference)."""
    readme = (ROOT / "README.md").read_text()
    scope = {}
    exec(re.search(r"```python\n(.*?)```", readme, re.S).group(1), scope)
    assert_close(scope["out"], dense_attention(scope["q"], scope["k"], scope["v"], prefix=0), torch.float32)


def site_packages_without_kernels(tmp_path):
    """This interpreter's site-packages as links, less the PyPI package `kernels` (its code and its metadata), as an
    environment of transformers < 5.25 holds it: a directory for PYTHONPATH under `python -S`."""
    import site

    links = tmp_path / "site-packages"
    links.mkdir()
    for directory in site.getsitepackages():
        for entry in Path(directory).iterdir():
            if entry.name != "kernels" and not entry.name.startswith("kernels-") and entry.suffix != ".pth":
                (links / entry.name).symlink_to(entry)
    return links


@pytest.mark.parametrize("pypi_kernels", [True, False], ids=["pypi-kernels", "no-pypi-kernels"])
def test_python_runs_from_the_repository_root(pypi_kernels, tmp_path):
    """Run from the repository's root, Python finds kernels/ as a top-level `kernels`, the name of the PyPI package
    that transformers looks for. With that package installed and without it (where transformers 5.0-5.24 once failed
    on the folder), the transformers integration imports and the bench starts; `kernels` is the package or an empty
    namespace, never the folder, which stays hybrid_ops.kernels."""
    import importlib.metadata

    env, python = dict(os.environ), [sys.executable]
    if pypi_kernels:
        try:
            importlib.metadata.version("kernels")
        except importlib.metadata.PackageNotFoundError:
            pytest.skip("the PyPI package kernels is not installed (transformers >= 5.25 requires it)")
    else:
        python.append("-S")  # site-packages only through the links: no .pth file (the editable install's finder)
        env["PYTHONPATH"] = str(site_packages_without_kernels(tmp_path))
    code = (
        "import kernels, hybrid_ops.integrations.transformers, transformers.utils as u\n"
        "print(getattr(kernels, '__file__', None), u.is_kernels_available())"
    )
    out = [
        subprocess.run([*python, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        for args in (["-c", code], ["-m", "bench", "--help"])
    ]
    assert [r.returncode for r in out] == [0, 0], [r.stderr[-3000:] for r in out]
    where, available = out[0].stdout.split()
    if pypi_kernels:
        assert where.endswith(f"site-packages{os.sep}kernels{os.sep}__init__.py"), where
        code = "import hybrid_ops.kernels as h; print(h.__file__)"
        assert run_script("-c", code, cwd=ROOT).strip().endswith(f"{os.sep}kernels{os.sep}__init__.py")
    else:
        assert (where, available) == ("None", "False")
