"""Speculative decoding: a draft model proposes tokens, the target verifies them in one TARGET_VERIFY step.

The target's attention runs through torch.ops.hybrid.attn over a PagedKVCache; rejected draft tokens are dropped
from the cache with `truncate`. The verify step is served by the prefill backend or the decode backend
(`speculative_attention_mode`); both give exactly the tokens of plain greedy decoding.
"""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hybrid_ops
from hybrid_ops import ForwardMode, PagedKVCache
from hybrid_ops.integrations.transformers import HybridStep


def tiny_llama(layers, seed):
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@torch.inference_mode()
def speculative_generate(target, draft, prompts, max_new_tokens, num_draft, speculative_attention_mode):
    """Greedy speculative decoding; returns (tokens per prompt, accepted draft tokens, proposed draft tokens)."""
    target.set_attn_implementation("hybrid")
    config = target.config
    cache = PagedKVCache(
        num_pages=64,
        page_size=8,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        num_layers=config.num_hidden_layers,
        max_pages_per_request=16,
    )

    def target_logits(mode, requests, chunks):
        batch = cache.step(requests, [len(c) for c in chunks], mode)
        positions = [p for r, c in zip(requests, chunks) for p in range(cache.seq_len(r) - len(c), cache.seq_len(r))]
        step = HybridStep(
            int(mode),
            *batch.metadata,
            cache.k_caches,
            cache.v_caches,
            speculative_attention_mode=speculative_attention_mode,
        )
        out = target(
            torch.tensor([sum(chunks, [])]), position_ids=torch.tensor([positions]), use_cache=False, hybrid_step=step
        )
        return out.logits[0].argmax(-1).split([len(c) for c in chunks])

    requests = list(range(len(prompts)))
    for r in requests:
        cache.add(r)
    # The last token of each request ("pending") is sampled but not yet in the cache.
    pending = [g[-1].item() for g in target_logits(ForwardMode.EXTEND, requests, prompts)]
    generated = [[] for _ in prompts]
    accepted = proposed = 0
    while min(map(len, generated)) < max_new_tokens:
        drafts = []
        for r in requests:  # the draft model proposes num_draft greedy tokens (no cache: a tiny model)
            seq = prompts[r] + generated[r] + [pending[r]]
            for _ in range(num_draft):
                seq.append(draft(torch.tensor([seq])).logits[0, -1].argmax().item())
            drafts.append(seq[-num_draft:])
        verified = target_logits(ForwardMode.TARGET_VERIFY, requests, [[pending[r]] + drafts[r] for r in requests])
        for r in requests:
            target_tokens = verified[r].tolist()  # the target's greedy token after each verified position
            n = 0
            while n < num_draft and drafts[r][n] == target_tokens[n]:
                n += 1
            generated[r] += [pending[r]] + drafts[r][:n]
            pending[r] = target_tokens[n]
            cache.truncate(r, cache.seq_len(r) - (num_draft - n))  # drop the rejected draft tokens
            accepted, proposed = accepted + n, proposed + num_draft
    return [g[:max_new_tokens] for g in generated], accepted, proposed


def main(max_new_tokens=16, num_draft=3):
    # The draft is the target's first layer (same embeddings and head): it agrees with the target often, not always.
    target, draft = tiny_llama(layers=2, seed=0), tiny_llama(layers=1, seed=1)
    draft.load_state_dict(target.state_dict(), strict=False)
    prompts = [[5, 9, 11, 3, 7], [8, 1, 2], [4, 4, 6, 9, 10, 12, 13]]
    greedy = hybrid_ops.generate(target, prompts, max_new_tokens, compile=False)
    for mode in ("prefill", "decode"):
        tokens, accepted, proposed = speculative_generate(target, draft, prompts, max_new_tokens, num_draft, mode)
        print(
            f"speculative_attention_mode={mode!r}: {accepted}/{proposed} draft tokens accepted, "
            f"tokens equal plain greedy decoding: {tokens == greedy}"
        )
        assert tokens == greedy


if __name__ == "__main__":
    main()
