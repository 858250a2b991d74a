"""What bounds decode: the cpu kernel beside a sum of the same bytes, in alternating rounds, the best call of each,
with the keys in cache (16 requests of 64 keys, called again and again) and from memory (the op section's decode
case, twice the last-level cache read before each call so that none of it is there; `--scale N`: N times its
lengths). Then the kernel's arithmetic alone: the marginal cost of a key per kv head on one thread between a request of
64 keys and one of 192, two more full tiles of 64 (most of the decode case's), whose K/V (1.5 MiB of fp32, 0.75 of bf16)
a 1-2 MiB L2 holds or nearly, where "in cache" is 4-8 MiB.

    python -m bench.bound                  # one thread, 200 rounds in cache, 20 from memory
    python -m bench.bound --threads 2 --reps 50
    python -m bench.bound --scale 4        # the decode case 4 times as long (300 MB of bf16 K/V)

Prints ns per (key, kv head), the GB/s of K/V consumed and the kernel's time over the read's; and the share of the read
from memory that the arithmetic alone leaves the kernel, were every read hidden under it.
"""

import argparse
import glob
import time
from pathlib import Path

import torch

from .run import DECODE_LENS, HKV, Batch


def last_level_cache_bytes(default=256 << 20):
    """The size of the CPU's last-level cache (Linux's sysfs), or `default` where the system does not say."""
    sizes = {}
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        level, size = (Path(index, name).read_text().strip() for name in ("level", "size"))
        if size.endswith("K"):
            sizes[int(level)] = int(size[:-1]) << 10
    return sizes[max(sizes)] if sizes else default


def best_seconds(fns, reps, warmup=5, before=None):
    """The fastest of `reps` alternating calls of each function, `before()` (untimed) ahead of each call."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for name, fn in fns.items():
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--scale", type=int, default=1, help="the decode case's lengths times this")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"| {args.threads} thread(s) | keys | ns per (key, kv head): kernel, read | K/V GB/s: kernel, read "
        "| kernel / read |\n|---|---|---:|---:|---:|"
    )
    evict = torch.ones(2 * last_level_cache_bytes() // 4)
    places = {
        "in cache (16 x 64)": ([63] * 16, args.reps, None),
        "from memory (decode case)": ([n * args.scale - 1 for n in DECODE_LENS], args.reps // 10, evict.sum),
    }
    read_from_memory = {}  # ns per (key, kv head)
    for dtype in (torch.float32, torch.bfloat16):
        for place, (prefixes, reps, before) in places.items():
            batch = Batch(prefixes, [1] * 16, dtype, shuffle_pages=True)
            fns = {"kernel": batch.hybrid(torch.ops.hybrid.decode, "cpu"), "read": batch.read_floor()}
            best = best_seconds(fns, reps, before=before)
            ns = {k: best[k] / (sum(batch.seq_lens) * HKV) * 1e9 for k in fns}
            gbps = {k: batch.kv_bytes / best[k] / 1e9 for k in fns}
            dtype_name = str(dtype).removeprefix("torch.")
            if before is not None:
                read_from_memory[dtype] = ns["read"]
            print(
                f"| {dtype_name} | {place} | {ns['kernel']:.1f}, {ns['read']:.1f} | {gbps['kernel']:.1f}, "
                f"{gbps['read']:.1f} | {best['kernel'] / best['read']:.2f} |",
                flush=True,
            )
    torch.set_num_threads(1)
    # Decode takes at least its arithmetic: were every read hidden under it, shared evenly by the threads, the kernel
    # would still read at most this share of the read.
    print(
        "\n| 1 thread | marginal ns per (key, kv head), 1 x 64 to 1 x 192 keys | the read from memory (ns) x threads / "
        "it: the share decode can reach |\n|---|---:|---:|"
    )
    for dtype in (torch.float32, torch.bfloat16):
        batches = {n: Batch([n - 1], [1], dtype, shuffle_pages=True) for n in (64, 192)}
        best = best_seconds({n: b.hybrid(torch.ops.hybrid.decode, "cpu") for n, b in batches.items()}, args.reps)
        arithmetic = (best[192] - best[64]) / (128 * HKV) * 1e9
        ceiling = read_from_memory[dtype] * args.threads / arithmetic
        print(
            f"| {str(dtype).removeprefix('torch.')} | {arithmetic:.1f} | {read_from_memory[dtype]:.1f} x "
            f"{args.threads}: {ceiling:.0%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
