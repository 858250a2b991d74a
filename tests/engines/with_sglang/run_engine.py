"""One sglang Engine in this process (`python run_engine.py '<json>'`): the greedy ids of each batch of prompts, in
order, and the tokens each batch found in the radix cache, printed as one JSON line. The tests start one process per
engine: an Engine's shutdown ends every child of its process and its signal handlers end the process itself when a
child dies, which a pytest worker must not meet.

The JSON: {"model": directory, "batches": [[prompt ids, ...], ...], "new_tokens": n, "engine": Engine's keywords}."""

import json
import sys

import sglang


def main():
    request = json.loads(sys.argv[1])
    engine = sglang.Engine(
        model_path=request["model"], device="cpu", dtype="float32", mem_fraction_static=0.02, **request["engine"]
    )
    try:
        greedy = {"temperature": 0, "max_new_tokens": request["new_tokens"], "ignore_eos": True}
        outputs = [engine.generate(input_ids=batch, sampling_params=greedy) for batch in request["batches"]]
    finally:
        engine.shutdown()
    ids = [[o["output_ids"] for o in batch] for batch in outputs]
    cached = [[o["meta_info"]["cached_tokens"] for o in batch] for batch in outputs]
    print(json.dumps({"ids": ids, "cached": cached}))


if __name__ == "__main__":
    main()
