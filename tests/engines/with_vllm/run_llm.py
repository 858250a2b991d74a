"""One vLLM engine in this process (`python run_llm.py '<json>'`): the greedy ids of the prompts, then of each later
batch, and the attention implementations its layers hold, printed as one JSON line. The tests start one process per
engine: vLLM keeps process-wide state (its distributed group, the selector's cache) that a second engine would meet.

The JSON: {"model": directory, "batches": [[prompt ids, ...], ...], "llm": LLM's keywords}."""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its layers can be read

from vllm import LLM, SamplingParams  # noqa: E402


def main():
    request = json.loads(sys.argv[1])
    llm = LLM(
        model=request["model"], skip_tokenizer_init=True, enforce_eager=True, max_model_len=256, max_num_seqs=8,
        kv_cache_memory_bytes=64 << 20, **request["llm"],
    )  # fmt: skip
    greedy = SamplingParams(max_tokens=request.get("new_tokens", 8), temperature=0.0, ignore_eos=True)
    ids = []
    for batch in request["batches"]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
        ids.append([list(o.outputs[0].token_ids) for o in outputs])
    layers = llm.llm_engine.model_executor.driver_worker.worker.model_runner.compilation_config.static_forward_context
    impls = sorted({type(layer.impl).__name__ for layer in layers.values() if hasattr(layer, "impl")})
    print(json.dumps({"ids": ids, "impls": impls}))


if __name__ == "__main__":
    main()
