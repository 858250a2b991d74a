"""Hybrid model families end to end: tokens/s of each, compiled, against an attention-only Llama of the same sizes and
against transformers' own generate, side by side in one run.

Every model has 8 decoder layers of width 256 with random weights: the hybrids mix stateful layers with attention
(qwen3_5_text, lfm2, granitemoehybrid, jamba: 6 stateful + 2 attention layers; nemotron_h: 6 Mamba2 + 2 attention
blocks, each followed by an MLP block; falcon_h1: Mamba2 beside attention in every layer). Two workloads, which
differ only in their prompts:

    decode-heavy   8 prompts of 16 to 250 tokens, 32 new tokens each
    prefill-heavy  8 prompts of 500 to 1000 tokens, 32 new tokens each

hybrid_ops: one `HybridGenerator` per model (compile=True), its second call timed (the first compiles); tokens/s are
new tokens over the call's seconds, prefill included. transformers: `model.generate` greedy on one prompt at a time
(its own cache of conv and recurrent states, its PyTorch fallbacks where flash-linear-attention and mamba-ssm are not
installed), the prompts' seconds summed. The tokens of both are compared (the count of identical requests is
printed). Then qwen3_5_text packaged (`hybrid_ops.package`) and served from the package by a new process: the seconds
from its start to the first token (bench/startup.py's measurement).

    python -m bench hybrid            # both workloads, every model
    python -m bench hybrid --quick    # decode-heavy, fewer new tokens, transformers on two prompts
"""

import time

import torch

WIDTH = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
    tie_word_embeddings=False,
)
# Layers 3 and 7 attend: the pattern of Qwen3.5 (3 linear, 1 full) over 8 layers.
PATTERN = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1, mamba_chunk_size=64)
MODELS = {
    "llama": dict(num_hidden_layers=8),
    "qwen3_5_text": dict(
        num_hidden_layers=8,
        layer_types=PATTERN,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    ),
    "lfm2": dict(
        num_hidden_layers=8,
        layer_types=["conv" if t == "linear_attention" else t for t in PATTERN],
        block_auto_adjust_ff_dim=False,
    ),
    "granitemoehybrid": dict(
        num_hidden_layers=8, layer_types=PATTERN, num_local_experts=0, shared_intermediate_size=768, **MAMBA2
    ),
    "nemotron_h": dict(
        num_hidden_layers=16,
        hybrid_override_pattern="M-M-M-*-M-M-M-*-",
        mamba_num_heads=8,
        mamba_head_dim=64,
        ssm_state_size=64,
        n_groups=1,
        chunk_size=64,
    ),
    "falcon_h1": dict(num_hidden_layers=8, mamba_d_ssm=512, **MAMBA2),
    "jamba": dict(num_hidden_layers=8, attn_layer_period=4, attn_layer_offset=3, num_experts=1),
}
# The families' targets on this CPU (issue-set): the share of the Llama's tokens/s, and the speed-up on transformers.
FAMILY = {
    "qwen3_5_text": ("gated delta rule", 0.7),
    "lfm2": ("short convolution", 0.7),
    "granitemoehybrid": ("Mamba2", 0.5),
    "nemotron_h": ("Mamba2", 0.5),
    "falcon_h1": ("Mamba2", 0.5),
    "jamba": ("Mamba1", None),
}
WORKLOADS = {"decode-heavy": ((16, 250), 32), "prefill-heavy": ((500, 1000), 32)}


def make_model(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {**WIDTH, **MODELS[name]}
    config = AutoConfig.for_model(name, **sizes)
    if "layer_types" in sizes:  # some configs derive theirs in __post_init__ from other fields
        config.layer_types = sizes["layer_types"]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def prompts(lengths, count=8, vocab_size=4096):
    generator = torch.Generator().manual_seed(1)
    low, high = lengths
    sizes = torch.linspace(low, high, count).round().int().tolist()
    return [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in sizes]


def run_hybrid(model, batch, new_tokens):
    """(tokens, tokens/s of the second call) of one compiled generator."""
    import hybrid_ops

    generator = hybrid_ops.HybridGenerator(
        model, max_batch_size=len(batch), max_seq_len=max(map(len, batch)) + new_tokens, prefill_chunk=1024
    )
    generator.generate(batch, new_tokens)
    stats = hybrid_ops.GenerationStats()
    tokens = generator.generate(batch, new_tokens, stats=stats)
    return tokens, stats.tokens_per_second


def run_transformers(model, batch, new_tokens):
    """(tokens, tokens/s) of transformers' greedy generate, one prompt at a time (its first prompt run once before,
    untimed: lazy initialisation)."""
    model.set_attn_implementation("sdpa")
    calls = lambda prompt: model.generate(  # noqa: E731
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.inference_mode():
        calls(batch[0][:16])
        start = time.perf_counter()
        tokens = [calls(p)[0, len(p) :].tolist() for p in batch]
    return tokens, len(batch) * new_tokens / (time.perf_counter() - start)


def hybrid_section(quick):
    """{workload: {model: {tokens/s, transformers tokens/s, ratios, identical}}}."""
    results = {}
    workloads = {"decode-heavy": ((16, 250), 16)} if quick else WORKLOADS
    for workload, (lengths, new_tokens) in workloads.items():
        batch = prompts(lengths)
        rows = {}
        for name in MODELS:
            model = make_model(name)
            tokens, rate = run_hybrid(model, batch, new_tokens)
            reference_batch = batch[:2] if quick else batch
            reference, reference_rate = run_transformers(model, reference_batch, new_tokens)
            identical = sum(a == b for a, b in zip(tokens, reference))
            rows[name] = dict(
                tokens_per_second=rate,
                transformers_tokens_per_second=reference_rate,
                identical=f"{identical}/{len(reference)}",
            )
            print(f"  {workload} {name}: {rate:.1f} tok/s, transformers {reference_rate:.1f}, identical {identical}")
        llama = rows["llama"]["tokens_per_second"]
        for row in rows.values():
            row["vs_llama"] = row["tokens_per_second"] / llama
            row["vs_transformers"] = row["tokens_per_second"] / row["transformers_tokens_per_second"]
        results[workload] = rows
    if not quick:
        from .startup import measure

        results["package"] = measure("qwen3_5_text", 32, variants=["package"])
    return results


def markdown(results) -> str:
    lines = ["## Hybrid families end to end (python -m bench hybrid)", ""]
    for workload, rows in results.items():
        if workload == "package":
            (row,) = rows
            lines += [
                f"qwen3_5_text from a package (packaged once in {row['packaging_s']:.0f} s): a new process's start to "
                f"its first token {row['first_token_s']:.1f} s, then {row['tokens_per_s']:.1f} tok/s warm; "
                f"transformers imported: {'yes' if row['transformers'] else 'no'}.",
                "",
            ]
            continue
        lines += [
            f"{workload}:",
            "",
            "| model | family | hybrid_ops tok/s | / Llama | target | transformers tok/s | / transformers | "
            "identical requests |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in rows.items():
            family, target = FAMILY.get(name, ("attention", None))
            lines.append(
                f"| {name} | {family} | {r['tokens_per_second']:.1f} | {r['vs_llama']:.2f} | "
                f"{'' if target is None else f'>= {target}'} | {r['transformers_tokens_per_second']:.1f} | "
                f"{r['vs_transformers']:.1f}x | {r['identical']} |"
            )
        lines.append("")
    return "\n".join(lines)
