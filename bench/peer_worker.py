"""A peer library's side of the benchmark, run under that library's own python (IPEX needs torch 2.8, llama.cpp its
own build): it builds the bench's attention cases from their specs, checks the library's output once per case against
float64 attention written plainly, and times single calls or whole generations. It imports torch and the peer only, so
that any python with torch runs it.

Protocol: one JSON object a line on stdin, one reply a line on stdout (everything the process or a library prints goes
to stderr); a failure replies {"error": "..."} and the worker serves on; end of input ends it.

    {"op": "case", "key": K, "library": "ipex", "spec": SPEC, "threads": T}  -> {"checksum": c, "max_error": e}
    {"op": "time", "key": K}                            -> {"seconds": s}   (one call)
    {"op": "forget"}                                    -> {}               (drops every case)
    {"op": "generate", "model_dir": DIR, "outtype": "f32", "converter": PATH, "prompts": [[id, ...], ...],
     "new_tokens": N, "threads": T}                               -> {"tokens", "seconds", "first_token_seconds",
                                                                      "first_logits"}

SPEC (`case_spec`): prefix_lens, new_lens, dtype ("float32", "bfloat16"), scattered, num_q_heads, num_kv_heads,
head_dim, page_size, seed.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

# Largest error accepted per token: |out - ref| / |ref| over its [Hq * D] values (bf16 rounds its output: about 0.1%).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-3}


def case_spec(prefix_lens, new_lens, dtype, scattered, num_q_heads, num_kv_heads, head_dim, page_size, seed=0):
    """The JSON-able description of a case, from which every process builds the same tensors (`make_case`)."""
    return dict(
        prefix_lens=list(prefix_lens),
        new_lens=list(new_lens),
        dtype=str(dtype).removeprefix("torch."),
        scattered=scattered,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        seed=seed,
    )


def make_case(spec):
    """Requests with a cached prefix and new tokens, from `spec` (`case_spec`) and its seed:
    k, v: per request [1, Hkv, L, D] (the whole sequence; its last `new_lens[i]` rows are the new tokens'),
    q: [T, Hq, D], k_new, v_new: [T, Hkv, D], all in spec's dtype;
    cu_seqlens_q [B + 1], seq_lens [B], block_table [B, max_pages] (int32), num_pages: request i's pages are taken in
    order from every page (consecutive) or from a random permutation of them (scattered, as a long-running server
    leaves them); rows of a page past a request's length stay zero."""
    s = SimpleNamespace(**spec)
    dtype = getattr(torch, s.dtype)
    gen = torch.Generator().manual_seed(s.seed)
    seq_lens = [p + n for p, n in zip(s.prefix_lens, s.new_lens)]
    pages_per_request = [-(-n // s.page_size) for n in seq_lens]
    num_pages = sum(pages_per_request)
    pages = torch.randperm(num_pages, generator=gen) if s.scattered else torch.arange(num_pages)
    k = [torch.randn(1, s.num_kv_heads, n, s.head_dim, generator=gen).to(dtype) for n in seq_lens]
    v = [torch.randn(1, s.num_kv_heads, n, s.head_dim, generator=gen).to(dtype) for n in seq_lens]
    q = torch.randn(sum(s.new_lens), s.num_q_heads, s.head_dim, generator=gen).to(dtype)
    block_table = torch.zeros(len(seq_lens), max(pages_per_request), dtype=torch.int32)
    first = 0
    for i, n in enumerate(pages_per_request):
        block_table[i, :n] = pages[first : first + n]
        first += n
    return SimpleNamespace(
        spec=spec,
        dtype=dtype,
        q=q,
        k=k,
        v=v,
        k_new=torch.cat([x[0, :, -n:].transpose(0, 1) for x, n in zip(k, s.new_lens)]),
        v_new=torch.cat([x[0, :, -n:].transpose(0, 1) for x, n in zip(v, s.new_lens)]),
        cu_seqlens_q=torch.tensor([0, *torch.tensor(s.new_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        num_pages=num_pages,
        page_size=s.page_size,
    )


def paged(case, dense):
    """[num_pages, page_size, Hkv, D]: the per-request `dense` [1, Hkv, L, D] K or V at their pages."""
    _, num_kv_heads, _, head_dim = dense[0].shape
    cache = torch.zeros(case.num_pages * case.page_size, num_kv_heads, head_dim, dtype=case.dtype)
    for i, x in enumerate(dense):
        n = x.shape[2]
        positions = torch.arange(n)
        slots = case.block_table[i].long()[positions // case.page_size] * case.page_size + positions % case.page_size
        cache[slots] = x[0].transpose(0, 1)
    return cache.view(case.num_pages, case.page_size, num_kv_heads, head_dim)


def checksum(case):
    """One float over the case's tensors and pages: two processes built the same case when theirs agree."""
    parts = [case.q, *case.k, *case.v, case.block_table]
    return sum(
        (i + 1) * float((x.double().flatten() * torch.linspace(1, 2, x.numel(), dtype=torch.float64)).sum())
        for i, x in enumerate(parts)
    )


def reference(case):
    """[T, Hq, D] float64: each new token attends to its request's keys up to its own position."""
    out = []
    for i, (k, v) in enumerate(zip(case.k, case.v)):
        start, end = case.cu_seqlens_q[i].item(), case.cu_seqlens_q[i + 1].item()
        q = case.q[start:end].double()  # [n, Hq, D]
        num_q_heads, head_dim = q.shape[1:]
        group = num_q_heads // k.shape[1]
        k = k[0].double().repeat_interleave(group, dim=0)  # [Hq, L, D]
        v = v[0].double().repeat_interleave(group, dim=0)
        scores = torch.einsum("nhd,hld->hnl", q, k) / head_dim**0.5
        length = k.shape[1]
        visible = torch.arange(length)[None, :] <= torch.arange(length - (end - start), length)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out.append(torch.einsum("hnl,hld->nhd", probs, v))
    return torch.cat(out)


def max_error(case, out):
    """The largest per-token relative error of `out` [T, Hq, D] against `reference`."""
    ref = reference(case).flatten(1)
    return ((out.double().flatten(1) - ref).norm(dim=1) / ref.norm(dim=1)).max().item()


class IpexCase:
    """The case through IPEX's paged attention (vLLM's API): reshape_and_cache stores the new tokens' K/V, then
    single_query_cached_kv_attention (decode) or flash_attn_varlen_func (prefill, causal over the cached prefix)
    attends; caches [num_pages, Hkv, page_size, D]. A call allocates its output, as the hybrid ops do."""

    def __init__(self, case):
        import intel_extension_for_pytorch as ipex

        self.attention = ipex.llm.modules.PagedAttention
        self.case = case
        self.k_cache, self.v_cache = (paged(case, x).transpose(1, 2).contiguous() for x in (case.k, case.v))
        starts = case.seq_lens - (case.cu_seqlens_q[1:] - case.cu_seqlens_q[:-1])
        positions = torch.cat([torch.arange(a, b) for a, b in zip(starts.tolist(), case.seq_lens.tolist())])
        request = torch.repeat_interleave(torch.arange(len(starts)), case.cu_seqlens_q.diff())
        pages = case.block_table[request, positions // case.page_size]
        self.slots = (pages * case.page_size + positions % case.page_size).int()
        self.cu_seqlens_kv = torch.cat([torch.zeros(1), case.seq_lens.cumsum(0)]).int()
        num_q_heads, num_kv_heads = case.q.shape[1], case.k[0].shape[1]
        self.head_mapping = (torch.arange(num_q_heads) // (num_q_heads // num_kv_heads)).int()
        self.scale = case.q.shape[2] ** -0.5
        self.max_q, self.max_kv = int(case.cu_seqlens_q.diff().max()), int(case.seq_lens.max())
        self.decode = self.max_q == 1

    def __call__(self):
        c = self.case
        self.attention.reshape_and_cache(c.k_new, c.v_new, self.k_cache, self.v_cache, self.slots)
        out = torch.empty_like(c.q)
        if self.decode:
            self.attention.single_query_cached_kv_attention(
                out,
                c.q,
                self.k_cache,
                self.v_cache,
                self.head_mapping,
                self.scale,
                c.block_table,
                c.seq_lens,
                c.page_size,
                self.max_kv,
                None,
            )
        else:
            self.attention.flash_attn_varlen_func(
                out,
                c.q,
                self.k_cache,
                self.v_cache,
                c.cu_seqlens_q,
                self.cu_seqlens_kv,
                self.max_q,
                self.max_kv,
                self.scale,
                True,
                c.block_table,
                None,
            )
        return out


LIBRARIES = {"ipex": IpexCase}


def sentencepiece_vocab(model_dir):
    """A character-level sentencepiece model in `model_dir`: llama.cpp's converter takes a Llama's vocabulary from
    tokenizer.model and pads it to the config's vocab_size. Its pieces are never used: prompts are token ids."""
    import sentencepiece

    text = "abcdefghijklmnopqrstuvwxyz"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([text] * 8),
        model_prefix=str(Path(model_dir) / "tokenizer"),
        vocab_size=len(text) + 4,  # the letters, "▁", unk, bos and eos
        model_type="char",
        minloglevel=2,
    )


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C API: a GGUF converted by llama.cpp's convert_hf_to_gguf.py, greedy
    generation for a batch of token-id prompts, every sequence of the batch in one llama_decode per step (llama.cpp's
    own way of batching, its examples/batched), the prompts prefilled together in chunks of n_batch tokens."""

    def __init__(self):
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.models = {}  # (model_dir, outtype) -> llama_model pointer
        self.gguf_dir = tempfile.mkdtemp()

    def model(self, model_dir, outtype, converter):
        if (model_dir, outtype) not in self.models:
            if not (Path(model_dir) / "tokenizer.model").exists():
                sentencepiece_vocab(model_dir)
            path = Path(self.gguf_dir) / f"{len(self.models)}-{outtype}.gguf"
            command = [sys.executable, converter, model_dir, "--outfile", str(path), "--outtype", outtype]
            subprocess.run(command, check=True, stdout=sys.stderr, stderr=sys.stderr)
            params = self.lib.llama_model_default_params()
            model = self.lib.llama_model_load_from_file(str(path).encode(), params)
            if not model:
                raise RuntimeError(f"llama.cpp did not load {path}")
            self.models[model_dir, outtype] = model
        return self.models[model_dir, outtype]

    def generate(self, model_dir, outtype, converter, prompts, new_tokens, threads, n_batch=2048):
        import numpy as np

        lib = self.lib
        model = self.model(model_dir, outtype, converter)
        n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        params = lib.llama_context_default_params()
        params.n_ctx = sum(len(p) + new_tokens for p in prompts)
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = len(prompts)
        params.kv_unified = True  # the sequences share one cache of n_ctx positions
        params.n_threads = params.n_threads_batch = threads
        ctx = lib.llama_init_from_model(model, params)
        batch = lib.llama_batch_init(max(n_batch, len(prompts)), 0, 1)
        try:
            start = time.perf_counter()
            tokens, first_logits, first_seconds = [[] for _ in prompts], [None] * len(prompts), [None] * len(prompts)
            # The prompts' tokens, request after request, in chunks of n_batch; logits for each prompt's last one.
            pending = [(i, pos, t) for i, p in enumerate(prompts) for pos, t in enumerate(p)]
            for first in range(0, len(pending), n_batch):
                chunk = pending[first : first + n_batch]
                wanted = {j: i for j, (i, pos, _) in enumerate(chunk) if pos == len(prompts[i]) - 1}
                self.fill(batch, [(i, pos, t, j in wanted) for j, (i, pos, t) in enumerate(chunk)])
                if lib.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed on a prompt chunk")
                for j, i in wanted.items():
                    logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, j), shape=(n_vocab,))
                    first_logits[i] = logits.tolist()
                    tokens[i].append(int(logits.argmax()))
                    first_seconds[i] = time.perf_counter() - start
            for _ in range(new_tokens - 1):
                self.fill(
                    batch, [(i, len(p) + len(t) - 1, t[-1], True) for i, (p, t) in enumerate(zip(prompts, tokens))]
                )
                if lib.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed on a decode step")
                for j, t in enumerate(tokens):
                    t.append(int(np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, j), shape=(n_vocab,)).argmax()))
            seconds = time.perf_counter() - start
        finally:
            lib.llama_batch_free(batch)
            lib.llama_free(ctx)
        return dict(tokens=tokens, seconds=seconds, first_token_seconds=first_seconds, first_logits=first_logits)

    @staticmethod
    def fill(batch, rows):
        """Puts (sequence, position, token, wants logits) rows into a llama_batch."""
        for j, (seq, pos, token, logits) in enumerate(rows):
            batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = token, pos, 1, logits
            batch.seq_id[j][0] = seq
        batch.n_tokens = len(rows)


def serve(requests, reply):
    cases, llama_cpp = {}, None
    for line in requests:
        message = json.loads(line)
        try:
            op = message["op"]
            if op == "case":
                torch.set_num_threads(message["threads"])
                case = make_case(message["spec"])
                run = LIBRARIES[message["library"]](case)
                error = max_error(case, run())
                if error > TOLERANCE[case.dtype]:
                    raise RuntimeError(f"wrong output: error {error:.2g} against float64 attention")
                cases[message["key"]] = run
                answer = dict(checksum=checksum(case), max_error=error)
            elif op == "time":
                run = cases[message["key"]]
                start = time.perf_counter()
                run()
                answer = dict(seconds=time.perf_counter() - start)
            elif op == "forget":
                cases.clear()
                answer = {}
            elif op == "generate":
                llama_cpp = llama_cpp or LlamaCpp()
                args = {
                    k: message[k] for k in ("model_dir", "outtype", "converter", "prompts", "new_tokens", "threads")
                }
                answer = llama_cpp.generate(**args)
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # noqa: BLE001 - reported to the bench, which shows it in the peer's row
            answer = dict(error=f"{type(e).__name__}: {e}")
        reply(json.dumps(answer))


def run(serve):
    """`serve(requests, reply)` over this process's stdin and stdout, everything else it prints sent to stderr: a
    library's prints (C or Python) must not enter the protocol. bench/engine_worker.py serves the same way."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr

    def reply(text):
        protocol.write(text + "\n")
        protocol.flush()

    serve(sys.stdin, reply)


if __name__ == "__main__":
    run(serve)
