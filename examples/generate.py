"""The main demo: a Llama-style model generating for a batch of ragged prompts through torch.ops.hybrid.attn.

    python examples/generate.py                  # a small random-weight model (no download)
    python examples/generate.py PATH/TO/MODEL    # a local checkpoint, loaded with from_pretrained

Prompts of different lengths are prefilled in chunks and decoded together by one compiled forward; then the same
prompts go through transformers' static-cache compiled generate (left-padded) for comparison.
"""

import argparse
import time

import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, CompileConfig, LlamaConfig

import hybrid_ops

PROMPT_LENGTHS = [12, 96, 7, 150, 40, 64, 23, 110]
DEMO_SIZES = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
)


def demo_model(path=None, dtype=torch.float32, **sizes):
    """A local checkpoint, or a small random Llama (DEMO_SIZES: 4 layers, 256 wide, GQA 8/2 heads; `sizes` replaces
    any of them)."""
    if path:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    config = LlamaConfig(
        **(DEMO_SIZES | sizes),
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()


def demo_prompts(vocab_size, lengths=PROMPT_LENGTHS):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def run_hybrid(model, prompts, max_new_tokens, progress=False):
    """Two runs of one HybridGenerator (the first compiles); returns (tokens, stats of the second, graphs compiled,
    graphs compiled in the second run)."""
    generator = hybrid_ops.HybridGenerator(
        model, max_batch_size=len(prompts), max_seq_len=max(map(len, prompts)) + max_new_tokens, prefill_chunk=1024
    )
    graphs = counters["stats"]["unique_graphs"]
    generator.generate(prompts, max_new_tokens, progress=progress)
    warm_graphs = counters["stats"]["unique_graphs"]
    stats = hybrid_ops.GenerationStats()
    tokens = generator.generate(prompts, max_new_tokens, progress=progress, stats=stats)
    return tokens, stats, warm_graphs - graphs, counters["stats"]["unique_graphs"] - warm_graphs


def run_transformers_static(model, prompts, max_new_tokens):
    """transformers' generate with a static cache and its compiled forward, on the left-padded prompts. Two runs
    (the first compiles); returns (tokens, seconds of the second run)."""
    model.set_attn_implementation("sdpa")
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    compile_config = CompileConfig(fullgraph=True, mode="default")
    compile_config._compile_all_devices = True  # transformers compiles on the CPU only when asked
    for _ in range(2):
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            cache_implementation="static",
            compile_config=compile_config,
            eos_token_id=None,
            pad_token_id=0,
        )
        seconds = time.perf_counter() - start
    return [row[width:].tolist() for row in out], seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="a local checkpoint directory (default: random weights)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--no-compare", action="store_true", help="skip the transformers static-cache run")
    args = parser.parse_args()

    model = demo_model(args.model)
    prompts = demo_prompts(model.config.vocab_size)
    tokenizer = None
    if args.model:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    print(f"{len(prompts)} prompts of {sorted(map(len, prompts))} tokens, {args.max_new_tokens} new tokens each")
    tokens, stats, graphs, recompiles = run_hybrid(model, prompts, args.max_new_tokens, progress=True)
    for prompt, out in list(zip(prompts, tokens))[:3]:
        shown = tokenizer.decode(out) if tokenizer else out[:12]
        print(f"  prompt of {len(prompt):3d} tokens -> {shown}")
    ttft = sum(stats.first_token_seconds) / len(stats.first_token_seconds)
    print(f"\nhybrid_ops: {stats.tokens_per_second:8.1f} tokens/s, mean time to first token {ttft * 1e3:.0f} ms")
    print(f"  steps per mode: {dict(stats.steps)}")
    print(f"  graphs compiled: {graphs} (warm-up run), recompiles in the measured run: {recompiles}")
    if not args.no_compare:
        ref_tokens, seconds = run_transformers_static(model, prompts, args.max_new_tokens)
        ref_rate = len(prompts) * args.max_new_tokens / seconds
        same = sum(a == b for a, b in zip(tokens, ref_tokens))
        print(f"transformers static cache, compiled: {ref_rate:8.1f} tokens/s")
        print(
            f"  hybrid_ops / transformers: {stats.tokens_per_second / ref_rate:.2f}x; "
            f"identical tokens for {same}/{len(prompts)} prompts"
        )


if __name__ == "__main__":
    main()
