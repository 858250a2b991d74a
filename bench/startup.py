"""Start-up: seconds from a new process's start to its first token, and its decode tokens/s, for each way to serve.

    compile=False        eager
    compile=True, cold   an empty Inductor cache (TORCHINDUCTOR_CACHE_DIR); it writes the compile_cache file
    compile=True, warm   the Inductor cache the cold process left
    compile_cache        an empty Inductor cache and the compile_cache file (`torch.compiler.load_cache_artifacts`)
    package              `HybridGenerator.from_package` of a .pt2 written beforehand (`hybrid_ops.package`); the
                         process imports hybrid_ops only: no transformers, no model built

Each runs in a process of its own, started after the last has ended, on the same prompts: its first call (`stream`)
gives the first token (the time from the parent's `Popen`, imports included), the best of three more calls the
tokens/s of a warm generator (the prompts prefilled, then their new tokens). The tokens must be identical across all
five.

    python -m bench startup               # the demo model (examples/generate.py), then 8 layers 1024 wide
    python -m bench startup --quick       # the demo model only, fewer new tokens
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A larger random Llama beside the demo's, where the model's work outweighs the per-step overhead.
LARGER_SIZES = dict(
    hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4
)
VARIANTS = ["compile=False", "compile=True, cold", "compile=True, warm", "compile_cache", "package"]


def model(name):
    """The demo model, a Llama of 8 layers 1024 wide (GQA 16/4 heads, 4096 ids), seeded alike, or one of
    bench/hybrid.py's models by its type."""
    sys.path.insert(0, str(ROOT))
    from examples.generate import demo_model

    from .hybrid import MODELS, make_model

    if name in MODELS:
        return make_model(name)
    if name == "demo":
        return demo_model()
    return demo_model(**LARGER_SIZES)


def child(variant, job):
    """In the new process: serve `job`'s prompts as `variant` says; prints the stamps and tokens as JSON."""
    import hybrid_ops

    sizes = job["sizes"]
    if variant == "package":
        generator = hybrid_ops.HybridGenerator.from_package(job["package"])
    else:
        generator = hybrid_ops.HybridGenerator(
            model(job["model"]),
            **sizes,
            compile=variant != "compile=False",
            compile_cache=job["compile_cache"] if variant in ("compile=True, cold", "compile_cache") else None,
        )
    prompts, new_tokens = job["prompts"], job["new_tokens"]
    tokens = [[] for _ in prompts]
    first = None
    for index, new, _ in generator.stream(prompts, new_tokens):
        first = first or time.time()
        tokens[index] += new
    rates = []
    for _ in range(3):  # the best of three: this machine is shared
        stats = hybrid_ops.GenerationStats()
        assert generator.generate(prompts, new_tokens, stats=stats) == tokens
        rates.append(stats.tokens_per_second)
    loaded = "transformers" in sys.modules
    print(json.dumps(dict(first_token=first, tokens_per_s=max(rates), tokens=tokens, transformers=loaded)))


def run_child(variant, job, inductor_cache):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_cache)
    start = time.time()
    out = subprocess.run(
        [sys.executable, "-m", "bench.startup", variant, json.dumps(job)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        raise RuntimeError(f"{variant}: {out.stderr[-3000:]}")
    result = json.loads(out.stdout.splitlines()[-1])
    return dict(result, first_token_s=result["first_token"] - start)


def measure(name, new_tokens, variants=VARIANTS):
    """Rows of the `variants` (default: all five) on model `name`: 8 prompts of the demo's lengths."""
    import hybrid_ops

    sys.path.insert(0, str(ROOT))
    from examples.generate import PROMPT_LENGTHS, demo_prompts

    served = model(name)
    prompts = demo_prompts(served.config.vocab_size, PROMPT_LENGTHS)
    sizes = dict(max_batch_size=len(prompts), max_seq_len=max(PROMPT_LENGTHS) + new_tokens, prefill_chunk=1024)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        package = hybrid_ops.package(served, Path(scratch, "model.pt2"), **sizes)
        packaging_s = time.perf_counter() - start
        job = dict(
            model=name,
            sizes=sizes,
            prompts=prompts,
            new_tokens=new_tokens,
            package=package,
            compile_cache=str(Path(scratch, "compile_cache.bin")),
        )
        caches = {v: str(Path(scratch, f"inductor-{i}")) for i, v in enumerate(VARIANTS)}
        caches["compile=True, warm"] = caches["compile=True, cold"]
        for variant in variants:
            rows.append(dict(model=name, variant=variant, **run_child(variant, job, caches[variant])))
            print(f"{name}, {variant}: {rows[-1]['first_token_s']:.1f} s to the first token", flush=True)
    assert all(r["tokens"] == rows[0]["tokens"] for r in rows), "the variants gave different tokens"
    by_variant = {r["variant"]: r["tokens_per_s"] for r in rows}
    for r in rows:
        r.update(packaging_s=packaging_s)
        if "compile=True, warm" in by_variant:
            r.update(vs_compiled=r["tokens_per_s"] / by_variant["compile=True, warm"])
        del r["tokens"], r["first_token"]
    return rows


def startup_section(quick):
    """The demo model (16 new tokens with `quick`), then the larger one; a full run writes bench/results/startup.md."""
    rows = measure("demo", 16 if quick else 48)
    if not quick:
        rows += measure("8 layers, 1024 wide", 48)
        save(rows)
    return rows


def save(rows, note=""):
    """bench/results/startup.md: the table, the date, machine and load average it was measured at, and `note`."""
    import platform

    import torch

    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    when = f"Measured {time.strftime('%Y-%m-%d')} on {machine}; load average {os.getloadavg()[0]:.1f} at the end."
    (ROOT / "bench" / "results" / "startup.md").write_text(f"{when} {note}".strip() + "\n\n" + markdown(rows))


def markdown(rows):
    lines = [
        "| model | serving | process start to first token (s) | tokens/s of a warm run | tokens/s / compile=True warm "
        "| imports transformers |",
        "|---|---|---:|---:|---:|---|",
    ]
    lines += [
        f"| {r['model']} | {r['variant']} | {r['first_token_s']:.1f} | {r['tokens_per_s']:.1f} "
        f"| {r['vs_compiled']:.2f} | {'yes' if r['transformers'] else 'no'} |"
        for r in rows
    ]
    packaging = {r["model"]: r["packaging_s"] for r in rows}
    packaged = ", ".join(f"{name} {s:.0f} s" for name, s in packaging.items())
    lines += ["", f"Packaging (export and AOTInductor compile, once): {packaged}. Tokens identical across the five."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    child(sys.argv[1], json.loads(sys.argv[2]))
