"""Speculative decoding: a draft model proposes tokens, the target verifies them all in one TARGET_VERIFY step.

A chain (`--chain N`, or the tree N,1) is N greedy draft tokens. A tree (`--tree DEPTH,WIDTH`) has DEPTH levels of
WIDTH nodes: each level holds the WIDTH children of the level before with the highest draft log-probability of their
path (a top-k tree, as EAGLE-2 grows it). The target verifies its last token (the tree's root) and every node in one
step with the ops' `tree_mask` ([T, Q] bool): a node sees its ancestors only, its RoPE position is prefix + depth,
and its K/V go to the next linear slot. The longest path whose every node is the target's argmax at its parent is
accepted; `PagedKVCache.keep` keeps that path's rows, in the target's cache and in the draft's, and drops the
others. The tokens equal plain greedy decoding's (checked).

Both models run over paged caches of their own through `ModelRunner`, each compiled once: every step passes a tree
mask, causal where there is no tree (prefill; depth 0 is plain decoding), always `max_q_len` columns wide, so a
change of mode, tree or batch never recompiles after the warm-up (counted). The draft grows its tree through the same
graph: each level runs the tokens its cache lacks and the tree so far, with their tree mask, over its cache truncated
back to the tokens it holds.

A hybrid target (`--model qwen3_5_text`: a gated delta rule layer after an attention layer) keeps each request's
recurrent state in a slot of a `StatePool`: its verify step leaves the state after every tree node in the pool's
intermediate states, and the state after the last accepted node is committed (`StatePool.commit`). Its draft is its
attention layer alone.

    python examples/speculative.py --tree 2,2 --max-new-tokens 64
    python examples/speculative.py --model qwen3_5_text
"""

import argparse
import time

import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3_5TextConfig

import hybrid_ops
from hybrid_ops import ForwardMode, HybridInputError, PagedKVCache
from hybrid_ops.generation.runner import ModelRunner
from hybrid_ops.integrations.servable import check_servable
from hybrid_ops.state import StatePool

# 16 ragged prompts of 3..11 tokens (ids 1..63 of the 64-token vocabulary).
PROMPTS = [[(7 * i + 5 * j) % 63 + 1 for j in range(3 + (5 * i) % 9)] for i in range(16)]


TINY = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
# model -> (config class, its extra sizes, the target's layer types): the draft is the target's first layer.
MODELS = {
    "llama": (LlamaConfig, {}, None),
    "qwen3_5_text": (
        Qwen3_5TextConfig,
        dict(
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        ),
        ["full_attention", "linear_attention"],
    ),  # fmt: skip
}


def tiny_model(name, layers, seed):
    """The first `layers` layers of `name`'s target."""
    config_class, sizes, layer_types = MODELS[name]
    extra = {} if layer_types is None else dict(layer_types=layer_types[:layers])
    config = config_class(**TINY, **sizes, num_hidden_layers=layers, **extra)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="hybrid").eval()


def target_and_draft(name="llama"):
    """The draft is the target's first layer (same embeddings and head): it agrees with the target often, not always."""
    target, draft = tiny_model(name, 2, seed=0), tiny_model(name, 1, seed=1)
    draft.load_state_dict(target.state_dict(), strict=False)
    for model in (target, draft):
        check_servable(model)
    return target, draft


def ancestry(parents):
    """Per new token, the new tokens it sees: its ancestors and itself. parents[j] < j: the index of token j's parent
    among the new tokens, -1 for none (it follows the cached tokens)."""
    seen = []
    for j, parent in enumerate(parents):
        seen.append((seen[parent] if parent >= 0 else []) + [j])
    return seen


def chain(n):
    """The parents of n new tokens in sequence."""
    return list(range(-1, n - 1))


class PagedModel:
    """A model over a paged cache of its own; each step is one call of its compiled `ModelRunner` with a tree mask."""

    def __init__(self, model, speculative_attention_mode, max_q_len, compile_backend, max_batch_size=16):
        layer_shapes, mixers = check_servable(model)
        self.cache = PagedKVCache(
            num_pages=16 * max_batch_size,
            page_size=8,
            num_kv_heads=layer_shapes[0][0],
            head_dim=layer_shapes[0][1],
            layer_shapes=layer_shapes,
            max_pages_per_request=16,
        )
        # A hybrid model's state slots, with room for the state after each of a step's max_q_len tokens.
        self.states = None
        if mixers:
            layers = [[(spec.shape, spec.dtype) for spec in mixer.states] for mixer in mixers]
            self.states = StatePool(layers, max_batch_size, max_verify_tokens=max_q_len)
        self.max_q_len = max_q_len
        self.runner = ModelRunner(
            model,
            self.cache,
            max_batch_size,
            max_seq_len=16 * 8,
            prefill_chunk=max_q_len,
            speculative_attention_mode=speculative_attention_mode,
            compile_backend=compile_backend,
            states=self.states,
        )

    def add(self, request):
        self.cache.add(request)
        if self.states is not None:
            self.states.add(request)

    def free(self, request):
        self.cache.free(request)
        if self.states is not None:
            self.states.free(request)

    def step(self, mode, requests, chunks, logits_rows):
        """One forward over each request's new tokens, chunks[i] = (token ids, parents as in `ancestry`) -> logits
        [len(logits_rows), vocab] of the step's token rows `logits_rows`."""
        lens = [len(tokens) for tokens, _ in chunks]
        if max(lens) > self.max_q_len:
            raise HybridInputError(
                f"a step of {max(lens)} new tokens for one request exceeds max_q_len={self.max_q_len}"
            )
        batch = self.cache.step(requests, lens, mode)
        ids, positions, rows = [], [], []
        for request, (tokens, parents) in zip(requests, chunks):
            prefix = self.cache.seq_len(request) - len(tokens)
            for seen in ancestry(parents):
                positions.append(prefix + len(seen) - 1)
                rows.append([column in seen for column in range(self.max_q_len)])
            ids += tokens
        batch.tree_mask = torch.tensor(rows, dtype=torch.bool, device=self.cache.device)
        torch._dynamo.mark_static(batch.tree_mask, 1)  # Q: one width for every step
        slots = None if self.states is None else self.states.slots(requests)
        return self.runner.run(batch, lens, ids, positions, logits_rows, slots)


class SpeculativeGenerator:
    """Greedy speculative decoding of `target` with `draft`; `generate`, or `add`, `step` and `free` per request."""

    def __init__(self, target, draft, speculative_attention_mode="prefill", max_q_len=24, compile_backend="inductor"):
        self.target, self.draft = (
            PagedModel(m, speculative_attention_mode, max_q_len, compile_backend) for m in (target, draft)
        )
        if self.draft.states is not None:
            raise HybridInputError("the draft must attend only: its tree levels rerun tokens, which a state cannot")
        self.seqs = {}  # request id -> its tokens: prompt, generated, then the target's next token (not yet cached)

    @torch.inference_mode()
    def add(self, prompts) -> list:
        """Prefills the target on each prompt (the draft catches up at its first step); returns the request ids."""
        requests = [max(self.seqs, default=-1) + 1 + i for i in range(len(prompts))]
        for request in requests:
            self.target.add(request)
            self.draft.add(request)
        chunks = [(list(p), chain(len(p))) for p in prompts]
        ends = [sum(map(len, prompts[: i + 1])) - 1 for i in range(len(prompts))]
        logits = self.target.step(ForwardMode.EXTEND, requests, chunks, ends)
        for request, prompt, token in zip(requests, prompts, logits.argmax(-1).tolist()):
            self.seqs[request] = list(prompt) + [token]
        return requests

    def free(self, request):
        self.target.free(request)
        self.draft.free(request)
        return self.seqs.pop(request)

    @torch.inference_mode()
    def step(self, requests, depth, width) -> list:
        """One draft tree (`depth` levels of `width` nodes; depth 0: plain decoding) and one verify step for each
        request; returns the number of draft tokens accepted for each."""
        trees, written = self.propose(requests, depth, width) if depth else ([[] for _ in requests], None)
        chunks = [
            ([self.seqs[r][-1]] + [t for t, _ in tree], [-1] + [p + 1 for _, p in tree])
            for r, tree in zip(requests, trees)
        ]
        num_tokens = sum(len(tokens) for tokens, _ in chunks)
        mode = ForwardMode.TARGET_VERIFY if depth else ForwardMode.DECODE
        best = self.target.step(mode, requests, chunks, list(range(num_tokens))).argmax(-1).tolist()
        accepted, last_nodes, start = [], [], 0
        for i, (request, (tokens, parents)) in enumerate(zip(requests, chunks)):
            target_tokens, start = best[start : start + len(tokens)], start + len(tokens)
            path, node = [], 0  # indices in the chunk; node 0 is the root, the request's last token
            while True:
                child = next((c for c, p in enumerate(parents) if p == node and tokens[c] == target_tokens[node]), None)
                if child is None:
                    break
                path.append(child)
                node = child
            self.target.cache.keep(request, len(tokens), [0] + path)
            if depth:  # the draft wrote its catch-up tokens and the levels above the last
                caught_up, levels = written[i]
                kept = [caught_up + c - 1 for c in path if c - 1 < levels]
                self.draft.cache.keep(request, caught_up + levels, list(range(caught_up)) + kept)
            self.seqs[request] += [tokens[c] for c in path] + [target_tokens[node]]
            accepted.append(len(path))
            last_nodes.append(node)
        if depth and self.target.states is not None:  # the verify step left each node's state: keep the last accepted
            self.target.states.commit(requests, last_nodes)
        return accepted

    def propose(self, requests, depth, width):
        """Each request's draft tree, nodes [(token, parent)] level by level (parent: the node's index, -1 for the
        root), and what the draft's last step wrote: (catch-up tokens, tree nodes)."""
        cache = self.draft.cache
        held = [cache.seq_len(r) for r in requests]
        catch_up = [self.seqs[r][n:] for r, n in zip(requests, held)]  # ends with the root
        trees = [[] for _ in requests]  # per request: [(token, parent, path log-probability)]
        for level in range(depth):
            for request, n in zip(requests, held):
                cache.truncate(request, n)
            chunks, rows, frontiers = [], [], []
            for tokens, tree in zip(catch_up, trees):
                k = len(tokens)
                parents = chain(k) + [k + p if p >= 0 else k - 1 for _, p, _ in tree]
                frontier = list(range(len(tree) - width, len(tree))) if level else [-1]
                rows += [sum(len(c) for c, _ in chunks) + k + f for f in frontier]
                chunks.append((tokens + [t for t, _, _ in tree], parents))
                frontiers.append(frontier)
            logprobs = self.draft.step(ForwardMode.EXTEND, requests, chunks, rows).float().log_softmax(-1)
            start = 0
            for tree, frontier in zip(trees, frontiers):
                candidates = []
                for f, row in zip(frontier, logprobs[start : start + len(frontier)]):
                    score = tree[f][2] if f >= 0 else 0.0
                    values, tokens = row.topk(width)
                    candidates += [(score + v, f, t) for v, t in zip(values.tolist(), tokens.tolist())]
                start += len(frontier)
                tree += [(t, f, s) for s, f, t in sorted(candidates, key=lambda c: -c[0])[:width]]
        written = [(len(tokens), (depth - 1) * width) for tokens in catch_up]
        return [[(t, p) for t, p, _ in tree] for tree in trees], written

    def generate(self, prompts, max_new_tokens, depth, width):
        """-> (tokens per prompt, draft tokens accepted per request and verify step). A request stops (and leaves the
        batch) once it has max_new_tokens."""
        requests = self.add(prompts)
        prompt_lens = dict(zip(requests, map(len, prompts)))
        tokens, accepted = {}, []
        try:
            while requests:
                accepted += self.step(requests, depth, width)
                for request in [r for r in requests if len(self.seqs[r]) - prompt_lens[r] >= max_new_tokens]:
                    tokens[request] = self.free(request)[prompt_lens[request] :][:max_new_tokens]
                    requests.remove(request)
        finally:
            for request in requests:
                self.free(request)
        return [tokens[r] for r in sorted(tokens)], accepted

    def warm_up(self):
        """Compiles the graphs Dynamo specialises (one request, one token) and the general ones."""
        for prompts, depth, width in (([[1, 2, 3]], 0, 1), ([[1, 2, 3]], 2, 2), ([[1, 2, 3], [4, 5]], 2, 2)):
            self.generate(prompts, 3, depth, width)


def tree_shape(text):
    depth, width = map(int, text.split(","))
    if depth < 1 or width < 1:
        raise argparse.ArgumentTypeError(f"DEPTH,WIDTH must be positive ints, got {text}")
    return depth, width


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=tree_shape, default=(2, 2), metavar="DEPTH,WIDTH")
    parser.add_argument("--chain", type=int, help="draft tokens of the chain (default: the tree's DEPTH x WIDTH nodes)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--modes", default="prefill,decode", help="speculative_attention_mode values to run")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs of each, interleaved; the best is shown")
    parser.add_argument("--model", choices=list(MODELS), default="llama", help="the target's family")
    args = parser.parse_args(argv)
    (depth, width), num_chain = args.tree, args.chain or args.tree[0] * args.tree[1]
    target, draft = target_and_draft(args.model)
    greedy = hybrid_ops.generate(target, PROMPTS, args.max_new_tokens, compile=False)
    runs = [("plain decoding", 0, 1), (f"chain of {num_chain}", num_chain, 1), (f"tree {depth}x{width}", depth, width)]
    for mode in args.modes.split(","):
        generator = SpeculativeGenerator(target, draft, mode, compile_backend=args.compile_backend)
        generator.warm_up()
        graphs = counters["stats"]["unique_graphs"]
        print(f"speculative_attention_mode={mode!r}, {len(PROMPTS)} prompts, {args.max_new_tokens} new tokens each:")
        seconds, outputs = {name: [] for name, _, _ in runs}, {}
        for _ in range(args.repeat):  # interleaved, each run's best time: others' work on the machine varies
            for name, d, w in runs:
                start = time.perf_counter()
                outputs[name] = generator.generate(PROMPTS, args.max_new_tokens, d, w)
                seconds[name].append(time.perf_counter() - start)
        for name, d, w in runs:
            tokens, accepted = outputs[name]
            per_step = sum(accepted) / len(accepted)
            print(
                f"  {name:>16}: {d * w:2d} draft tokens per step, {per_step:.2f} accepted per step "
                f"({per_step + 1:.2f} tokens per target step), {min(seconds[name]) / sum(map(len, tokens)) * 1e3:.2f} "
                f"ms per token, tokens equal plain greedy decoding: {tokens == greedy}"
            )
            assert tokens == greedy
        print(f"  recompiles after the warm-up: {counters['stats']['unique_graphs'] - graphs}")


if __name__ == "__main__":
    main()
