"""One rank of test_distributed.py's tensor-parallel run, started by torchrun (gloo on the CPU).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp_worker.py SPEC.json OUT_DIR

SPEC: {"models": {name: checkpoint dir}, "compiled": [names], "prompts": [[ids]], "new_tokens": n}. Each rank loads
every model with DistributedConfig(tp_plan="auto"), generates greedily (eager, then compiled for the models named in
"compiled") and by sampling seeded with its own rank, and writes OUT_DIR/rank{rank}.json: {"name/eager" |
"name/compiled" | "name/sampled": tokens, "name/kv_heads": the cache's heads, "name/different_prompts": the error of
ranks given different prompts}, or {"name/error": message} when HybridGenerator refuses the model.
"""

import json
import sys

import torch
import torch.distributed as dist
from helpers.models import SIZES
from transformers import AutoModelForCausalLM, DistributedConfig

from hybrid_ops import HybridGenerator, HybridInputError


def run(model, prompts, new_tokens, rank, compiled):
    results = {}
    for mode in ("eager", "compiled") if compiled else ("eager",):
        torch._dynamo.reset()
        generator = HybridGenerator(model, **SIZES, compile=mode == "compiled")
        results[mode] = generator.generate(prompts, new_tokens)
    results["kv_heads"] = generator.cache.k_caches[0].shape[2]
    results["sampled"] = HybridGenerator(model, **SIZES, compile=False).generate(
        prompts, new_tokens, do_sample=True, top_k=20, seed=rank
    )
    try:
        HybridGenerator(model, **SIZES, compile=False).generate([[1 + rank]], 2)
    except HybridInputError as e:
        results["different_prompts"] = str(e)
    return results


def main(spec_path, out_dir):
    with open(spec_path) as f:
        spec = json.load(f)
    dist.init_process_group("gloo")
    rank, results = dist.get_rank(), {}
    for name, path in spec["models"].items():
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))
        try:
            outs = run(model, spec["prompts"], spec["new_tokens"], rank, name in spec["compiled"])
        except HybridInputError as e:
            outs = {"error": str(e)}
        results.update({f"{name}/{key}": value for key, value in outs.items()})
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
