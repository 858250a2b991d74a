"""Steps of sglang's own objects for the backend tests: a `ModelRunner` with real pools, `ForwardBatch`es of every
mode over scrambled pages and request rows, and the float64 attention they must give, written in sglang's
conventions (a window W admits the keys at positions >= q_pos - W)."""

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from helpers.reference import random_tree
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.speculative.eagle_info import EagleVerifyInput

NUM_LAYERS = 2
NUM_REQUEST_ROWS = 12  # req_to_token rows 1..12; row 0 is sglang's padding row


class Runner(ModelRunner):
    """sglang's ModelRunner with its __init__ replaced by what an attention backend reads, over real pools (as
    sglang's own attention test kit builds one)."""

    def __init__(
        self, page_size=1, dtype=torch.float32, num_kv_heads=2, head_dim=16, v_head_dim=None, num_tokens=768,
        context_len=96, attention_chunk_size=None,
    ):  # fmt: skip
        num_pages = num_tokens // page_size
        self.device, self.dtype, self.kv_cache_dtype, self.page_size = "cpu", dtype, dtype, page_size
        self.model_config = SimpleNamespace(context_len=context_len)
        self.attention_chunk_size = attention_chunk_size
        self.kv_index_translator = None
        self.req_to_token_pool = ReqToTokenPool(
            size=NUM_REQUEST_ROWS, max_context_len=context_len, device="cpu", enable_memory_saver=False
        )
        self.token_to_kv_pool = MHATokenToKVPool(
            size=num_pages * page_size,
            page_size=page_size,
            dtype=dtype,
            head_num=num_kv_heads,
            head_dim=head_dim,
            layer_num=NUM_LAYERS,
            device="cpu",
            enable_memory_saver=False,
            v_head_dim=v_head_dim,
            enable_alt_stream=False,
        )
        self.num_pages = num_pages


@dataclass
class Step:
    """One step's batch and what the reference needs: per request its row, slots, prefix and new tokens."""

    batch: ForwardBatch
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, Dv]
    prefix_lens: list
    q_lens: list
    slots: list  # per request, the pool slot of each position
    trees: list = field(default_factory=list)  # per request, [n, n] bool rows (TARGET_VERIFY with a tree)

    @property
    def new_slots(self):
        return [s[p:] for s, p in zip(self.slots, self.prefix_lens)]


def scrambled_slots(runner, lengths, rng):
    """Distinct pages (never page 0) in random order for each request of `lengths` tokens; position p of a request
    lies at slot page * P + p % P, as sglang's allocator places it."""
    page_size = runner.page_size
    counts = [-(-n // page_size) for n in lengths]
    pages = rng.sample(range(1, runner.num_pages), sum(counts))
    slots, start = [], 0
    for n, count in zip(lengths, counts):
        own = pages[start : start + count]
        start += count
        slots.append([own[p // page_size] * page_size + p % page_size for p in range(n)])
    return slots


def make_step(runner, mode, prefix_lens, q_lens, rng, num_q_heads=4, dtype=torch.float32, tree=False, layers=None):
    """A `mode` step of requests with `prefix_lens` cached tokens (written to every layer of the pool, or to
    `layers`) and `q_lens` new ones, at scrambled request rows and pages. TARGET_VERIFY's seq_lens count the prefix
    only, as sglang's do; with `tree`, its spec_info carries an EAGLE tree (sglang's CPU layout, QLEN_ONLY)."""
    pool, req_to_token = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    totals = [p + n for p, n in zip(prefix_lens, q_lens)]
    slots = scrambled_slots(runner, totals, rng)
    rows = rng.sample(range(1, NUM_REQUEST_ROWS + 1), len(totals))
    for row, request_slots in zip(rows, slots):
        req_to_token[row, : len(request_slots)] = torch.tensor(request_slots, dtype=torch.int32)
    num_kv_heads, head_dim, v_head_dim = pool.head_num, pool.head_dim, pool.v_head_dim
    for layer_id in layers if layers is not None else range(NUM_LAYERS):
        k_buffer, v_buffer = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
        for request_slots, prefix in zip(slots, prefix_lens):
            cached = torch.tensor(request_slots[:prefix], dtype=torch.int64)
            k_buffer[cached] = torch.randn(prefix, num_kv_heads, head_dim).to(k_buffer.dtype)
            v_buffer[cached] = torch.randn(prefix, num_kv_heads, v_head_dim).to(v_buffer.dtype)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_q_heads, head_dim).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, v_head_dim).to(dtype)
    out_cache_loc = torch.tensor([s for rs, p in zip(slots, prefix_lens) for s in rs[p:]], dtype=torch.int64)
    positions = torch.tensor([p + j for p, n in zip(prefix_lens, q_lens) for j in range(n)], dtype=torch.int64)
    verify = mode == ForwardMode.TARGET_VERIFY
    seq_lens = torch.tensor(prefix_lens if verify else totals, dtype=torch.int64)
    step = Step(None, q, k, v, list(prefix_lens), list(q_lens), slots)
    spec_info = None
    if verify:
        step.trees = [
            random_tree(2, 2, rng, full=True)[0] if tree else torch.ones(n, n, dtype=torch.bool).tril() for n in q_lens
        ]
        assert all(t.shape[0] == q_lens[0] for t in step.trees), "a verify step's requests share their draft length"
        mask = torch.cat([t.flatten() for t in step.trees]) if step.trees else torch.zeros(0, dtype=torch.bool)
        spec_info = EagleVerifyInput(
            draft_token=torch.zeros(num_tokens, dtype=torch.int64),
            custom_mask=mask,
            positions=positions,
            retrieve_index=None,
            retrieve_next_token=None,
            retrieve_next_sibling=None,
            retrieve_cum_len=None,
            spec_steps=max(q_lens[0] - 1, 0) if q_lens else 0,
            topk=2 if tree else 1,
            draft_token_num=q_lens[0] if q_lens else 1,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            seq_lens_sum=None,
            seq_lens_cpu=None,
        )
    step.batch = ForwardBatch(
        forward_mode=mode,
        batch_size=len(totals),
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        out_cache_loc=out_cache_loc,
        seq_lens_sum=int(seq_lens.sum()),
        positions=positions,
        spec_info=spec_info,
    )
    if mode.is_extend(include_draft_extend_v2=True) and not verify:
        step.batch.extend_prefix_lens = torch.tensor(prefix_lens, dtype=torch.int32)
        step.batch.extend_prefix_lens_cpu = list(prefix_lens)
        step.batch.extend_seq_lens = torch.tensor(q_lens, dtype=torch.int32)
        step.batch.extend_seq_lens_cpu = list(q_lens)
        step.batch.extend_num_tokens = num_tokens
        step.batch.extend_start_loc = torch.tensor([sum(q_lens[:i]) for i in range(len(q_lens))], dtype=torch.int32)
    return step


def full_mask(step):
    """The step's tree in sglang's GPU layout (FULL_MASK): per request [Q, prefix + Q], the prefix all True."""
    blocks = [
        torch.cat([torch.ones(t.shape[0], p, dtype=torch.bool), t], 1) for t, p in zip(step.trees, step.prefix_lens)
    ]
    return torch.cat([b.flatten() for b in blocks])


def reference(step, layer, pool, sinks=None, attention_chunk=-1, k_scale=None, v_scale=None):
    """float64 attention of the step's new tokens over the pool's prefix (read as stored, times the fp8 scales) and
    the new k, v, in sglang's conventions; [T, Hq, Dv]."""
    num_q_heads, num_kv_heads = layer.tp_q_head_num, layer.tp_k_head_num
    group = num_q_heads // num_kv_heads
    k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    outs, start = [], 0
    for i, (prefix, n) in enumerate(zip(step.prefix_lens, step.q_lens)):
        cached = torch.tensor(step.slots[i][:prefix], dtype=torch.int64)
        keys = torch.cat([k_buffer[cached].double() * (k_scale or 1.0), step.k[start : start + n].double()])
        values = torch.cat([v_buffer[cached].double() * (v_scale or 1.0), step.v[start : start + n].double()])
        tree = step.trees[i] if step.trees else torch.ones(n, n, dtype=torch.bool).tril()
        depth = tree.sum(1) - 1
        for j in range(n):
            q_pos = prefix + int(depth[j])
            seen = [p for p in range(prefix)] + [prefix + c for c in range(n) if tree[j, c]]
            first = 0
            if layer.sliding_window_size >= 0:
                first = max(first, q_pos - layer.sliding_window_size)
            if attention_chunk > 0:
                first = max(first, q_pos - q_pos % attention_chunk)
            # A key's position: a prefix key's own, a new token's by its depth in the tree.
            key_pos = [p if p < prefix else prefix + int(depth[p - prefix]) for p in seen]
            seen = [p for p, kp in zip(seen, key_pos) if kp >= first]
            rows = []
            for h in range(num_q_heads):
                scores = (keys[seen, h // group] @ step.q[start + j, h].double()) * layer.scaling
                if layer.logit_cap > 0:
                    scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
                top = scores.max()
                if sinks is not None:
                    top = torch.maximum(top, sinks[h].double())
                weights = torch.exp(scores - top)
                denominator = weights.sum() + (math.exp(float(sinks[h]) - top) if sinks is not None else 0.0)
                rows.append((weights[:, None] * values[seen, h // group]).sum(0) / denominator)
            outs.append(torch.stack(rows))
        start += n
    return torch.stack(outs) if outs else torch.zeros(0, num_q_heads, step.v.shape[-1], dtype=torch.float64)
