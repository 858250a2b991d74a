"""HybridGenerator as a serving engine: a stream of tokens per request, then requests that come and go.

    python examples/serve.py                                # the demo's small random Llama, compiled
    python examples/serve.py --compile-cache /tmp/hybrid.bin  # a second run loads the compiled code

1. `stream(prompts, ...)` yields (index, new tokens, finished) as each step makes them.
2. The step API: `add_request(prompt, max_new_tokens, **options) -> id`, `step() -> [(id, new tokens, finished)]`,
   `abort(id)`. Requests join while others run, each with its own length and sampling options, and one is aborted.
   Through a page budget of a fifth of the worst case, some are preempted and recomputed: the greedy ones still
   give `generate`'s tokens.
"""

import argparse
import time

from generate import demo_model, demo_prompts

import hybrid_ops


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--compile-cache", help="a file for the compiled artifacts, written by the first run")
    args = parser.parse_args()

    model = demo_model()
    prompts = demo_prompts(model.config.vocab_size, lengths=[12, 96, 7, 150, 40, 64])
    sizes = dict(max_batch_size=4, max_seq_len=256, page_size=8, prefill_chunk=128)
    start = time.perf_counter()
    generator = hybrid_ops.HybridGenerator(
        model, **sizes, compile=not args.no_compile, compile_cache=args.compile_cache
    )
    generator.generate(prompts[:1], 1)  # the first step also compiles every graph a later one needs
    print(f"start: {time.perf_counter() - start:.1f} s to the first token")

    print("\n1. stream: tokens as they come")
    shown = {}
    for index, tokens, finished in generator.stream(prompts[:3], args.max_new_tokens):
        shown.setdefault(index, []).extend(tokens)
        if finished:
            print(
                f"  prompt {index} ({len(prompts[index])} tokens) finished after {len(shown[index])}: "
                f"{shown[index][:8]}..."
            )

    print("\n2. step API, through a fifth of the worst case's pages")
    want = generator.generate(prompts, args.max_new_tokens)
    budget = hybrid_ops.HybridGenerator(
        model,
        **sizes,
        num_pages=generator.cache.num_pages // 5,
        compile=not args.no_compile,
        compile_cache=args.compile_cache,
    )
    ids = {budget.add_request(prompts[i], args.max_new_tokens): i for i in range(4)}
    sampled = budget.add_request(prompts[4], 8, do_sample=True, temperature=0.8, top_p=0.9, seed=7)
    got, step, stats = {rid: [] for rid in ids}, 0, hybrid_ops.GenerationStats()
    while budget.has_unfinished():
        events = budget.step(stats)
        step += 1
        if step == 3:
            ids[budget.add_request(prompts[5], args.max_new_tokens)] = 5  # joins while others run
            got[max(ids)] = []
        if step == 5:
            budget.abort(min(ids))
            print(f"  step {step}: aborted request {min(ids)} after {len(got[min(ids)])} tokens")
            del got[min(ids)]
        for rid, tokens, finished in events:
            if rid in got:
                got[rid] += tokens
            if finished:
                print(f"  step {step}: request {rid} finished")
    same = all(got[rid] == want[ids[rid]] for rid in got)
    print(
        f"  sampled request {sampled} ran too; {stats.preemptions} preemptions; free pages at the end: "
        f"{budget.cache.num_free_pages}/{budget.cache.num_pages}"
    )
    print(f"  step API tokens equal generate's: {same}")


if __name__ == "__main__":
    main()
