"""A hand-scheduled packed forward of a transformers model with `attn_implementation="hybrid"`: prefill chunks that
cross pages, mixed steps, batched decoding and a preemption, every state slot not yet written full of NaN; and the
check of its sampled rows' logits against transformers' own forward over the same tokens."""

import torch

from hybrid_ops import ForwardMode, PagedKVCache
from hybrid_ops.integrations.servable import check_servable
from hybrid_ops.integrations.transformers import HybridStep
from hybrid_ops.state import StatePool

from .models import PROMPTS

NEW_TOKENS = 6


def fill_free_slots(pool, value=float("nan")):
    held = {pool.slot(r) for r in pool.requests}
    for state in pool.all_states:
        state[[s for s in range(pool.num_slots) if s not in held]] = value


def serve(model, prompts=PROMPTS, new_tokens=NEW_TOKENS, chunk=5, preempt_after=2):
    """Greedy generation through the model's packed forward with a HybridStep, scheduled by hand: prefill chunks of
    at most `chunk` tokens per step (pages of 4 tokens), one decode token per request that has its prompt; once the
    last request has `preempt_after` new tokens, it is preempted (pages and slot freed, the slot filled with NaN) and
    started again on its tokens so far. Returns (new tokens of each request, [(request, position, logits row)])."""
    layer_shapes, mixers = check_servable(model)
    cache = PagedKVCache(64, 4, *layer_shapes[0][:2], layer_shapes=layer_shapes, max_pages_per_request=16)
    pool = StatePool([[(s.shape, s.dtype) for s in m.states] for m in mixers], len(prompts) + 1)
    fill_free_slots(pool)
    tokens, cached, rows = [list(p) for p in prompts], [0] * len(prompts), []
    for i in range(len(prompts)):
        cache.add(i)
        pool.add(i)
    last, preempted = len(prompts) - 1, False
    while any(len(t) < len(p) + new_tokens for t, p in zip(tokens, prompts)):
        if not preempted and len(tokens[last]) == len(prompts[last]) + preempt_after:
            preempted = True
            cache.free(last)
            pool.free(last)
            fill_free_slots(pool)
            cache.add(last)
            pool.add(last)
            cached[last] = 0
        batch, budget = [], chunk
        for i, t in enumerate(tokens):
            if len(t) == len(prompts[i]) + new_tokens:
                continue
            n = 1 if len(t) - cached[i] == 1 else min(budget, len(t) - cached[i])
            budget -= n if n > 1 else 0
            if n:
                batch.append((i, n))
        prefills = sum(len(tokens[i]) - cached[i] > 1 for i, _ in batch)
        mode = [ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.EXTEND][(prefills > 0) + (prefills == len(batch))]
        ids, counts = [i for i, _ in batch], [n for _, n in batch]
        meta = cache.step(ids, counts, mode)
        ids_in, positions, sampled, last_rows = [], [], [], []
        for i, n in batch:
            ids_in += tokens[i][cached[i] : cached[i] + n]
            positions += range(cached[i], cached[i] + n)
            cached[i] += n
            if cached[i] == len(tokens[i]):
                sampled.append(i)
                last_rows.append(len(ids_in) - 1)
        hybrid_step = HybridStep(int(mode), *meta.metadata, cache.k_caches, cache.v_caches)
        hybrid_step.state_slots, hybrid_step.states = pool.slots(ids), pool.states
        with torch.inference_mode():
            logits = model(
                input_ids=torch.tensor([ids_in]),
                position_ids=torch.tensor([positions]),
                use_cache=False,
                logits_to_keep=torch.tensor(last_rows or [len(ids_in) - 1]),
                hybrid_step=hybrid_step,
            ).logits[0]
        for i, row in zip(sampled, logits):
            rows.append((i, len(tokens[i]), row))
            tokens[i].append(int(row.argmax()))
    return [t[len(p) :] for t, p in zip(tokens, prompts)], rows


def assert_logits_equal_transformers(model_type, reference, rows, tokens):
    with torch.no_grad():
        full = [reference(input_ids=torch.tensor([p + t]), use_cache=False).logits[0] for p, t in zip(PROMPTS, tokens)]
    for request, position, row in rows:
        torch.testing.assert_close(
            row, full[request][position - 1], atol=1e-5, rtol=0, msg=lambda m: f"{model_type}, request {request}: {m}"
        )
