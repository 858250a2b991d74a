"""One rank of test_distributed.py's tensor-parallel run (started by torchrun, gloo on the CPU).

    python -m torch.distributed.run --nproc-per-node 2 tests/tp_worker.py SPEC.json OUT_DIR

SPEC: {"models": {name: checkpoint dir}, "prompts": [[ids]], "new_tokens": n}. Each rank loads every model with
tp_plan="auto", generates greedily (eager and compiled) and by sampling seeded with its rank, and writes
OUT_DIR/rank{rank}.json: {"name/run": tokens, "name/kv_heads": this rank's cache heads}.
"""

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from hybrid_ops import HybridGenerator


def main(spec_path, out_dir):
    spec = json.load(open(spec_path))
    dist.init_process_group("gloo")
    rank, results = dist.get_rank(), {}
    for name, path in spec["models"].items():
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
        for compile in (False, True):
            torch._dynamo.reset()
            generator = HybridGenerator(model, max_batch_size=3, max_seq_len=48, page_size=4, prefill_chunk=12,
                                        compile=compile)
            results[f"{name}/{'compiled' if compile else 'eager'}"] = generator.generate(spec["prompts"],
                                                                                           spec["new_tokens"])
        results[f"{name}/kv_heads"] = generator.cache.k_caches[0].shape[2]
        results[f"{name}/sampled"] = HybridGenerator(model, max_batch_size=3, max_seq_len=48, compile=False).generate(
            spec["prompts"], spec["new_tokens"], do_sample=True, top_k=20, seed=rank)
    json.dump(results, open(f"{out_dir}/rank{rank}.json", "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
