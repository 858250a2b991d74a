"""Every example runs, at small sizes, so none of them can rot."""

import os
import re
import runpy
import sys

import pytest
import torch
from helpers.reference import assert_close, dense_attention
from helpers.scripts import EXAMPLES, ROOT, run_script


def run_example(name, monkeypatch, argv=()):
    monkeypatch.setattr(sys, "argv", [name, *argv])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")


def test_direct_op(monkeypatch, capsys):
    run_example("direct_op.py", monkeypatch)
    assert "all outputs match dense attention" in capsys.readouterr().out


@pytest.mark.slow
def test_speculative(monkeypatch, capsys):
    run_example("speculative.py", monkeypatch)
    out = capsys.readouterr().out
    assert out.count("tokens equal plain greedy decoding: True") == 2


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
    assert (tmp_path / "gpu_check_smoke_cpu.md").exists()


@pytest.mark.slow
def test_bench_runs(tmp_path):
    """The benchmark script runs (its dispatch section, quick); it asserts no timings, it only must not rot."""
    out = run_script("-m", "bench", "dispatch", "--quick", cwd=ROOT)
    assert "| compiled decode (T = 1), cpu backend |" in out


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
