"""Tensor-parallel generation: a model sharded over the ranks by transformers' `tp_plan`, its attention through the
hybrid ops. Needs `accelerate`.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/tensor_parallel.py    # CPU, gloo
    torchrun --standalone --nproc-per-node 2 examples/tensor_parallel.py PATH/TO/MODEL --compile   # GPUs, NCCL

Each rank holds num_key_value_heads / world_size of the KV heads, and its cache holds only those. Every rank runs the
same steps and ends with the same tokens; rank 0 then checks them against one process running the whole model
(`--no-compare` skips that, for a model that does not fit one device). Without a checkpoint, rank 0 first saves the
demo's small random Llama (examples/generate.py) to a temporary directory.
"""

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from generate import demo_model, demo_prompts
from transformers import AutoModelForCausalLM, DistributedConfig

import hybrid_ops


def checkpoint(path):
    """`path`, or a directory that rank 0 saved the demo model to, the same on every rank."""
    if path:
        return path
    shared = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    if shared[0]:
        demo_model().save_pretrained(shared[0])
    dist.broadcast_object_list(shared, group_src=0)
    return shared[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="a local checkpoint directory (default: random weights)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8, help="how many of the demo's prompts to run")
    parser.add_argument("--compile", action="store_true", help="compile the forward (torch.compile)")
    parser.add_argument("--no-compare", action="store_true", help="skip the one-process run on rank 0")
    args = parser.parse_args()

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = checkpoint(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))
    prompts = demo_prompts(model.config.vocab_size)[: args.prompts]
    generator = hybrid_ops.HybridGenerator(
        model,
        max_batch_size=len(prompts),
        max_seq_len=max(map(len, prompts)) + args.max_new_tokens,
        compile=args.compile,
    )
    tokens = generator.generate(prompts, args.max_new_tokens)
    every_rank = [None] * world
    dist.all_gather_object(every_rank, tokens)
    if rank == 0:
        heads = generator.cache.k_caches[0].shape[2]
        print(f"{heads} of {model.config.get_text_config().num_key_value_heads} KV heads on each of {world} ranks")
        print(f"tokens equal on every rank: {all(t == tokens for t in every_rank)}")
        for prompt, out in list(zip(prompts, tokens))[:3]:
            print(f"  prompt of {len(prompt):3d} tokens -> {out[:12]}")
        if not args.no_compare:
            whole = AutoModelForCausalLM.from_pretrained(path).to(generator.device)
            one_process = hybrid_ops.generate(whole, prompts, args.max_new_tokens, compile=False)
            print(f"tokens equal one process's: {one_process == tokens}")
    dist.barrier()
    if rank == 0 and not args.model:
        shutil.rmtree(path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
