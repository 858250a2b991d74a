"""Where a generation step's time goes on the CPU, and what each compile lever changes, on the 8-layer, 1024-wide
Llama of the end-to-end section (bench/startup.py's LARGER_SIZES) over the demo's 8 prompts, 48 new tokens each.

    python -m bench step            # fp32 and bf16
    python -m bench step --quick    # fp32, fewer rounds

Profile: one `generate` call of a generator compiled with the default options (and Inductor's kernels named in the
profile, `cpp.enable_kernel_profile`) under torch.profiler; each step's time split by what ran, for the mean decode
step and the prefill step: the linear layers' matrix products, attention (`hybrid::*`, the K/V store included),
Inductor's generated kernels (norms, rotary, activations, residual adds), Dynamo's guards, the rest of the compiled
forward (Python: the graph's wrapper and the call), sampling, and the host's work outside the forward (the scheduler,
the step's metadata, its input tensors). The profiler's own cost inflates the small entries.

Levers: one generator per set of Inductor options (`HybridGenerator(compile_options=...)`), their `generate` calls
alternated round by round; each row its median tokens/s, decode-step and prefill-step times, and tokens/s over the
default's. "guards skipped" is the default's generator run under `torch.compiler.set_stance(skip_guard_eval_unsafe=
True)` (measured, not used: it trusts that no guard fails). Every variant's tokens are compared with the default's.

One prompt alone (fp32): the profile of its decode steps beside the 8 prompts', and the step's linear products at 1
and 8 rows as aten's mm, MKL's packed sgemm and oneDNN's packed product (`products`): Dynamo gives a step of one token
a graph of its own, of a static batch, whose products Inductor's freezing packs for MKL; a dynamic batch's, for oneDNN.
So where MKL is not native the runner pads such steps to two tokens (`mkl_is_native`); `one_token_padding` times a
padded generator against one that does not pad.
"""

import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

CATEGORIES = [
    ("linear layers", lambda n: n in ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "mkl::_mkl_linear")),
    ("attention (hybrid::attn, K/V store included)", lambda n: n.startswith("hybrid::")),
    ("norms, rotary, activations, residuals (Inductor's kernels)", lambda n: "cpp_fused" in n),
    ("Dynamo's guards", lambda n: n == "TorchDynamo Cache Lookup"),
]
REST = "rest of the forward (Python, the graph's wrapper)"
LEVERS = {
    "default: freezing + concatenated linears": None,
    "no freezing (compile_options={})": {},
    "freezing only": {"freezing": True},
    "default + cpp_wrapper": {"freezing": True, "cpp.enable_concat_linear": True, "cpp_wrapper": True},
}


class StepClock:
    """Wraps a generator's step, forward and sampling in profiler ranges and perf_counter stamps: `forwards` holds
    (new tokens, seconds) of each forward call."""

    def __init__(self, generator):
        from hybrid_ops.generation import api

        self.forwards, self.pads_one_token = [], generator.runner.pad_one_token
        forward, step, sample = generator.runner.forward, generator._step, api.next_tokens

        def timed_forward(input_ids, *args):
            start = time.perf_counter()
            with record_function("forward"):
                out = forward(input_ids, *args)
            self.forwards.append((input_ids.shape[1], time.perf_counter() - start))
            return out

        def timed_step(stats):
            with record_function("step"):
                return step(stats)

        def timed_sample(*args):
            with record_function("sampling"):
                return sample(*args)

        generator.runner.forward, generator._step = timed_forward, timed_step
        api.next_tokens = timed_sample  # the module's name, which _step calls

    def is_decode(self, tokens, num_requests):
        """Whether a forward of `tokens` new tokens is a decode step of `num_requests` (a step of one token runs
        padded to two where the runner pads it)."""
        return tokens <= num_requests + (self.pads_one_token and num_requests == 1)

    def split(self, num_requests):
        """(median decode-step seconds, prefill seconds summed) of the forwards since the last split."""
        decode = [s for n, s in self.forwards if self.is_decode(n, num_requests)]
        prefill = sum(s for n, s in self.forwards if not self.is_decode(n, num_requests))
        self.forwards.clear()
        return statistics.median(decode), prefill


def categorise(step_event):
    """{category: seconds} of one profiled step: its descendants' self times by name; the forward's uncategorised
    time as REST, sampling's as "sampling", the rest of the step as the host's."""
    out = dict.fromkeys([c for c, _ in CATEGORIES] + [REST, "sampling", "host: scheduler, metadata, inputs"], 0.0)

    def walk(event, region):
        name = event.name
        region = name if name in ("forward", "sampling") else region
        category = next((c for c, match in CATEGORIES if match(name)), None)
        if category is None:
            category = {"forward": REST, "sampling": "sampling"}.get(region, "host: scheduler, metadata, inputs")
        out[category] += event.self_cpu_time_total / 1e6
        for child in event.cpu_children:
            walk(child, region)

    walk(step_event, None)
    return out


def generator_for(model, prompts, new_tokens, compile_options=None):
    import hybrid_ops

    return hybrid_ops.HybridGenerator(
        model, max_batch_size=len(prompts), max_seq_len=max(map(len, prompts)) + new_tokens, prefill_chunk=1024,
        compile_options=compile_options,
    )  # fmt: skip


def profile_steps(model, prompts, new_tokens):
    """{"decode": {category: mean seconds per decode step}, "prefill": {category: seconds of the prefill steps}}."""
    from hybrid_ops.generation.runner import default_compile_options

    options = default_compile_options(torch.device("cpu")) | {"cpp.enable_kernel_profile": True}
    generator = generator_for(model, prompts, new_tokens, options)
    generator.generate(prompts, new_tokens)
    clock = StepClock(generator)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generator.generate(prompts, new_tokens)
    steps = sorted(
        (e for e in prof.events() if e.name == "step" and e.cpu_parent is None), key=lambda e: e.time_range.start
    )
    split = {"decode": [], "prefill": []}
    for event, (tokens, _) in zip(steps, clock.forwards):
        split["decode" if clock.is_decode(tokens, len(prompts)) else "prefill"].append(categorise(event))
    return {
        kind: {c: sum(r[c] for r in rows) / (len(rows) if kind == "decode" else 1) for c in rows[0]}
        for kind, rows in split.items()
    }


def compare_levers(model, prompts, new_tokens, rounds):
    """[{lever, tokens_per_s, decode_ms, prefill_ms, ratio, same_tokens}], the levers' calls alternated."""
    import hybrid_ops

    generators = {}
    for name, options in LEVERS.items():
        generators[name] = generator_for(model, prompts, new_tokens, options)
        generators[name].generate(prompts, new_tokens)  # compiles
    clocks = {name: StepClock(g) for name, g in generators.items()}
    default = next(iter(LEVERS))
    runs = {name: [] for name in [*LEVERS, "default + guards skipped"]}
    tokens = {}
    for _ in range(rounds):
        for name in runs:
            lever = default if name == "default + guards skipped" else name
            skip = name == "default + guards skipped"
            stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if skip else nullcontext()
            stats = hybrid_ops.GenerationStats()
            with stance:
                tokens[name] = generators[lever].generate(prompts, new_tokens, stats=stats)
            runs[name].append((stats.tokens_per_second, *clocks[lever].split(len(prompts))))
    rows = []
    for name, measured in runs.items():
        rate, decode, prefill = (statistics.median(column) for column in zip(*measured))
        rows.append(dict(lever=name, tokens_per_s=rate, decode_ms=decode * 1e3, prefill_ms=prefill * 1e3))
        rows[-1]["same_tokens"] = tokens[name] == tokens[default]
    for row in rows:
        row["ratio"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def one_token_padding(model, prompt, new_tokens, rounds):
    """[{variant, tokens_per_s, decode_ms, same_tokens}] of one prompt: a generator whose steps of one token run
    padded to two (`ModelRunner.pad_one_token`, the default where MKL is not native) against one whose runner does not
    pad them, their calls alternated; same_tokens: equal to the eager generator's."""
    import hybrid_ops

    eager = hybrid_ops.HybridGenerator(
        model, max_batch_size=1, max_seq_len=len(prompt[0]) + new_tokens, compile=False
    ).generate(prompt, new_tokens)
    generators = {}
    for name, pad in (("padded to two tokens", True), ("a graph of its own (static sizes)", False)):
        generator = generator_for(model, prompt, new_tokens)
        name += " (default)" if generator.runner.pad_one_token == pad else ""
        generator.runner.pad_one_token = pad
        generator.generate(prompt, new_tokens)  # compiles
        generators[name] = generator
    clocks = {name: StepClock(g) for name, g in generators.items()}
    runs, tokens = {name: [] for name in generators}, {}
    for _ in range(rounds):
        for name, generator in generators.items():
            stats = hybrid_ops.GenerationStats()
            tokens[name] = generator.generate(prompt, new_tokens, stats=stats)
            runs[name].append((stats.tokens_per_second, clocks[name].split(1)[0]))
    return [
        dict(
            variant=name,
            tokens_per_s=statistics.median(r for r, _ in measured),
            decode_ms=statistics.median(d for _, d in measured) * 1e3,
            same_tokens=tokens[name] == eager,
        )
        for name, measured in runs.items()
    ]


def products(model, rows=(1, 8), rounds=15):
    """[{rows, product, ms, gb_per_s}]: one decode step's linear products of an fp32 model (q/k/v and gate/up each
    one product, as the default compile makes them; the LM head included), weights cycled layer by layer as a step
    reads them (more than the L3), as aten's mm, MKL's packed sgemm (what Inductor's freezing packs a graph of a static
    batch with, such as Dynamo's own graph for one token) and oneDNN's packed product (a dynamic batch's)."""
    weights = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        weights.append(torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]))
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        weights += [attention.o_proj.weight, gate_up, mlp.down_proj.weight]
    weights = [w.detach().contiguous() for w in [*weights, model.lm_head.weight]]
    size = sum(w.numel() * w.element_size() for w in weights)
    out = []
    for m in rows:
        inputs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in weights]
        calls = {
            "aten mm (unpacked)": lambda: [F.linear(inputs[w.shape[1]], w) for w in weights],
            "MKL packed (a static batch's graph)": lambda: [
                torch.ops.mkl._mkl_linear(inputs[w.shape[1]], p, w, None, m) for w, p in zip(weights, mkl)
            ],
            "oneDNN packed (a dynamic batch's graph)": lambda: [
                torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")
                for w, p in zip(weights, onednn)
            ],
        }
        seconds = {name: [] for name in calls}
        for _ in range(rounds):  # alternated, so that each sees the same moments of a shared machine
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
        for name, times in seconds.items():
            t = statistics.median(times[2:])
            out.append(dict(rows=m, product=name, ms=t * 1e3, gb_per_s=size / t / 1e9, weights_mb=size / 1e6))
    return out


def step_section(quick):
    """{dtype: {"profile": ..., "levers": [...]}} for fp32 (and bf16 unless quick)."""
    from examples.generate import PROMPT_LENGTHS, demo_model, demo_prompts

    from .startup import LARGER_SIZES

    out = {}
    for dtype in [torch.float32] if quick else [torch.float32, torch.bfloat16]:
        model = demo_model(dtype=dtype, **LARGER_SIZES)
        prompts = demo_prompts(model.config.vocab_size, PROMPT_LENGTHS)
        new_tokens = 16 if quick else 48
        name = str(dtype).removeprefix("torch.")
        out[name] = dict(profile=profile_steps(model, prompts, new_tokens))
        print(f"  step {name}: profile {out[name]['profile']}", flush=True)
        if dtype == torch.float32:  # one prompt alone: a step of one token, and the products' rate at 1 and 8 rows
            out[name]["one_prompt"] = profile_steps(model, prompts[-1:], new_tokens)
            out[name]["one_token_padding"] = one_token_padding(model, prompts[-1:], new_tokens, 3 if quick else 5)
            for row in out[name]["one_token_padding"]:
                print(f"  step {name}: {row}", flush=True)
            out[name]["products"] = products(model)
            for row in out[name]["products"]:
                print(f"  step {name}: {row}", flush=True)
        out[name]["levers"] = compare_levers(model, prompts, new_tokens, 2 if quick else 5)
        for row in out[name]["levers"]:
            print(f"  step {name}: {row}", flush=True)
    return out


def markdown(results):
    """The section's tables."""
    lines = []
    for dtype, result in results.items():
        profile_rows = result["profile"]
        decode_total, prefill_total = (sum(profile_rows[k].values()) for k in ("decode", "prefill"))
        lines += [
            f"Where a step's time goes ({dtype}; mean decode step of 8 requests, the prefill step of 502 tokens):",
            "",
            "| part | decode ms | decode % | prefill ms | prefill % |",
            "|---|---:|---:|---:|---:|",
        ]
        for category in profile_rows["decode"]:
            d, p = profile_rows["decode"][category], profile_rows["prefill"][category]
            d_share, p_share = 100 * d / decode_total, 100 * p / prefill_total
            lines.append(f"| {category} | {d * 1e3:.2f} | {d_share:.0f}% | {p * 1e3:.1f} | {p_share:.0f}% |")
        lines += [f"| step | {decode_total * 1e3:.2f} | | {prefill_total * 1e3:.1f} | |", ""]
        if "one_prompt" in result:
            one = result["one_prompt"]["decode"]
            lines += [
                f"One prompt alone ({dtype}; mean decode step of 1 request against 8's above):",
                "",
                "| part | 1 request ms | 8 requests ms |",
                "|---|---:|---:|",
                *(f"| {c} | {one[c] * 1e3:.2f} | {profile_rows['decode'][c] * 1e3:.2f} |" for c in one),
                f"| step | {sum(one.values()) * 1e3:.2f} | {decode_total * 1e3:.2f} |",
                "",
                f"A decode step's products ({dtype}, {result['products'][0]['weights_mb']:.0f} MB of weights; medians "
                "of alternated rounds):",
                "",
                "| rows | product | ms | GB/s of weights |",
                "|---:|---|---:|---:|",
                *(
                    f"| {r['rows']} | {r['product']} | {r['ms']:.1f} | {r['gb_per_s']:.1f} |"
                    for r in result["products"]
                ),
                "",
                f"One prompt's steps of one token ({dtype}; medians of alternated rounds):",
                "",
                "| step of one token | tokens/s | decode step ms | tokens as eager's |",
                "|---|---:|---:|---|",
                *(
                    f"| {r['variant']} | {r['tokens_per_s']:.1f} | {r['decode_ms']:.2f} | "
                    f"{'same' if r['same_tokens'] else 'differ'} |"
                    for r in result["one_token_padding"]
                ),
                "",
            ]
        lines += [
            f"Compile levers ({dtype}; medians of alternated rounds):",
            "",
            "| lever | tokens/s | / default | decode step ms | prefill ms | tokens as default's |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for r in result["levers"]:
            lines.append(
                f"| {r['lever']} | {r['tokens_per_s']:.1f} | {r['ratio']:.2f} | {r['decode_ms']:.2f} | "
                f"{r['prefill_ms']:.0f} | {'same' if r['same_tokens'] else 'differ'} |"
            )
        lines.append("")
    return "\n".join(lines)
